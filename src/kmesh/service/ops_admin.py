"""Admin and introspection: status, list, health, shutdown.

Every reply is bounded (status is a summary; lists are paged, protocol.cut_page), and every collection the
service keeps has a limit (objects, jobs, registrations, tombstones: ServiceOptions), so no valid request can
make a reply that does not fit in a frame; one that still would is refused as reply_too_large, non-fatally
(the loop's send). Admin ops (shutdown, status and lists of all clients or of the store) need the admin token
(ServiceState.require_admin).
"""
from __future__ import annotations

import bisect
import logging
import os
from typing import Any

from kmesh.service.protocol import Request, clip, cut_page
from kmesh.service.registry import Client
from kmesh.service.state import Conn, ServiceState

log = logging.getLogger("kmesh.service")
VERIFY_BYTES = 64 << 20    # originals re-hashed per `list objects verify` page (at least one): bounded work


class AdminOps:
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def status(self, conn: Conn, req: Request) -> dict[str, Any]:
        """A bounded summary: counts, states, counters, health, store totals; the lists come from `list`."""
        st = self.state
        c = conn.client
        assert c is not None
        if req.args["scope"] == "self":
            snap = st.registry.summary(c.client_id)
            mine = st.copies.jobs_of(c.client_id)
            snap["counts"].update(requests=len(mine), requests_running=sum(not j.terminal for j in mine))
            snap["client"] = c.describe()
            snap["version"] = st.version
            return snap
        st.require_admin(conn, req, "status of all clients")
        snap = st.registry.summary()
        snap["counts"].update(requests=len(st.copies.jobs), requests_running=st.copies.running(),
                              objects=len(st.store.objects))
        snap.update(self.health())
        snap["store"] = st.store.summary()
        snap["disk_reads"] = st.reads.describe() if st.reads is not None else None
        snap["remote"] = st.remote.describe() if st.remote is not None else None
        snap["version"] = st.version
        snap["limits"] = {k: getattr(st.opts, k) for k in ("max_regs_per_client", "max_regs", "max_tombstones",
                                                            "max_objects", "max_jobs", "max_connections")}
        return snap

    def list(self, conn: Conn, req: Request) -> dict[str, Any]:
        """One page of one list, in cursor order (ids; release order for `released`; creation order for
        objects). Ordinary clients see only their own items; everything else is an admin op."""
        st = self.state
        c = conn.client
        assert c is not None
        a = req.args
        what = a["what"]
        everyone = a["scope"] == "all"
        if everyone or what == "objects":
            st.require_admin(conn, req, f"listing {'all ' if everyone else ''}{what}")

        def own(client_id: int) -> bool:
            return everyone or client_id == c.client_id

        items: list[tuple[int, Any]]  # (cursor, thing), ascending cursor
        # a client's own lists come from its own indexes: their cost is what it holds, not the service's history
        who = None if everyone else c.client_id
        if what == "clients":
            items = sorted((k, x) for k, x in st.registry.clients.items() if own(k))
        elif what == "registrations":
            items = sorted((x.reg_id, x) for x in st.registry.regs_of(who))
        elif what == "released":
            items = [(t.seq, t) for t in st.registry.tombstones_of(who)]  # bury order
        elif what == "requests":
            items = [(j.req_id, j) for j in st.copies.jobs_of(who)
                     if not (a["running"] and j.terminal)]  # ids ascend in insertion order
        else:
            items = sorted(((o.seq, o) for o in st.store.objects.values()), key=lambda t: t[0])
        keys = [k for k, _ in items]
        after = a["after"]
        if a["order"] == "asc":
            start = bisect.bisect_right(keys, after) if after is not None else 0
            todo = items[start:]
        else:
            stop = bisect.bisect_left(keys, after) if after is not None else len(items)
            todo = items[:stop][::-1]
        limit = a["limit"]
        cut_short = False
        if what == "objects" and a["verify"]:
            hashed = 0  # bounded hashing per page: the loop serves everyone else in between
            for i, (_, o) in enumerate(todo[:limit]):
                hashed += o.nbytes
                if hashed > VERIFY_BYTES and i > 0:
                    todo, cut_short = todo[:i], True
                    break
        verify = a["verify"]
        page, nxt = cut_page(((k, (lambda x=x: x.describe(verify) if what == "objects" else x.describe()))
                              for k, x in todo), limit)
        if nxt is None and cut_short and page:
            nxt = todo[len(page) - 1][0]
        return {"items": page, "next": nxt, "version": st.version}

    def health(self) -> dict[str, Any]:
        from kmesh.transfer.shm import mapped_shm

        st = self.state
        violations = st.registry.violations()
        return {"stats": st.stats, "violations": [clip(v) for v in violations[:16]],  # bounded: first 16
                "violations_count": len(violations), "copies_running":
                st.copies.running(), "reservations": st.copies.reservations.count(),
                "engine_holds": st.copies.live_holds(), "cuda_handles_open": len(st.cuda),
                "memfd_mappings": mapped_shm(), "open_fds": len(os.listdir("/proc/self/fd")),
                "fd_baseline": st.fd_baseline, "connections_open": len(st.conns),
                "stopping": st.stopping, "pid": os.getpid()}

    def shutdown(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self.state.require_admin(conn, req, "shutdown")
        self.begin_shutdown(f"requested by client {c.client_id}")
        return {"state": "stopping", "registrations": len(self.state.registry.regs)}

    def begin_shutdown(self, why: str) -> None:
        st = self.state
        if not st.stopping:
            log.info("shutting down (%s): closing %d registration(s)", why, len(st.registry.regs))
        st.stopping = True
        st.version += 1
        if st.reads is not None:
            st.reads.stop_waiting()  # held reads end now; their parked loads get shutting_down
        for reg in list(st.registry.regs.values()):
            st.registry.close(reg, "service shutdown")
