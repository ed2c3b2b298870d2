"""Operations on stored objects: save, load (with the disk tier's parked loads), evict, retain, unretain.

Disk tier (--disk-dir): a load of an original whose RAM copy was evicted never reads the file on the loop's
thread. It starts one read on a small reader pool (kmesh.service.diskreads) and its reply is parked; loads of
the same object arriving meanwhile join that read (`joins`); when it ends (the pool's wake pipe) the loop calls
collect_reads(), which checks the digest against the commit, installs the RAM copy and runs each parked load
again from the top, now a RAM hit (or sends each the same DiskReadError). Meanwhile everyone else is served. On
start the store re-adopts the object files a previous run left in the disk dir (--no-adopt: start empty; see
kmesh.service.store).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kmesh.service.diskreads import Flight, ReadCancelledError
from kmesh.service.errors import (DiskReadError, InternalError, LayoutMismatchError, ObjectMissingError,
                                  ServiceError, ShuttingDownError)
from kmesh.service.jobs import CopyJob
from kmesh.service.ops_copies import CopyOps
from kmesh.service.ops_registrations import check_range, work_registration
from kmesh.service.protocol import Request, ok_reply
from kmesh.service.registry import Client
from kmesh.service.state import DEFERRED, Conn, Replies, ServiceState

log = logging.getLogger("kmesh.service")


@dataclass(eq=False)
class ParkedLoad:
    """A load whose reply waits for its object's read-back (a Flight waiter)."""

    cid: int
    client_id: int
    req: Request
    parked_at: float = field(default_factory=time.monotonic)


class ObjectOps:
    def __init__(self, state: ServiceState, replies: Replies, copies: CopyOps) -> None:
        self.state = state
        self.replies = replies
        self.copies = copies

    def log_disk_tier(self) -> None:
        """At start: what the disk tier adopted from a previous run and what it refused, file by file."""
        store, opts = self.state.store, self.state.opts
        if store.disk is not None:
            k = store.counters
            log.info("disk tier %s: %d object(s) adopted, %d file(s) rejected, %d stale temp file(s) removed%s",
                     store.disk.directory, k["adopted"], k["disk_rejected"] - k["disk_temp_removed"],
                     k["disk_temp_removed"], "" if opts.adopt else " (--no-adopt: started empty)")
            for r in store.disk_rejected:
                log.warning("disk tier: %s: %s", r["file"], r["reason"])

    def save(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        st = self.state
        a = req.args
        reg = work_registration(st, c, req)
        off, n = a["offset"], a["nbytes"]
        check_range(reg, off, n)
        st.copies.reservations.check(reg.reg_id, off, off + n, writes=False)
        req_id = st.copies.new_id()
        obj = st.store.begin_put(a["key"], n, reg.layout, reg.geometry)
        job = CopyJob(req_id, c.client_id, "save", reg, obj, off, n)
        return self.copies.accept(job, src=reg.memory.tensor[off:off + n], dst=obj.tensor, writes=False,
                                  undo=lambda: st.store.abort(obj))

    def load(self, conn: Conn, c: Client, req: Request) -> Any:
        """Every check first (nothing is read for a load that would be refused); then a RAM hit starts its copy,
        and a load of an evicted original parks behind that object's one read-back (collect_reads runs it
        again from here once the read ended)."""
        st = self.state
        a = req.args
        reg = work_registration(st, c, req)
        obj = st.store.lookup(a["key"])
        if obj.geometry != reg.geometry:
            raise LayoutMismatchError(f"object {a['key'][:64]!r} was saved under another KV geometry")
        off, n = a["offset"], obj.nbytes
        check_range(reg, off, n)
        st.copies.reservations.check(reg.reg_id, off, off + n, writes=True)
        if not obj.in_ram:
            return self._park_load(conn, c, req, obj)
        obj = st.store.acquire(a["key"])
        try:
            req_id = st.copies.new_id()
        except BaseException:
            st.store.release(obj)
            raise
        job = CopyJob(req_id, c.client_id, "load", reg, obj, off, n)
        return self.copies.accept(job, src=obj.tensor, dst=reg.memory.tensor[off:off + n], writes=True,
                                  undo=lambda: st.store.release(obj))

    def _park_load(self, conn: Conn, c: Client, req: Request, obj: Any) -> Any:
        st = self.state
        if st.reads is None:  # only a disk tier evicts RAM copies: unreachable by construction
            raise InternalError(f"object {obj.key[:64]!r} has no RAM copy and this service no disk tier")
        waiter = ParkedLoad(conn.cid, c.client_id, req)
        flight = st.reads.get(obj.key)
        if flight is not None:
            st.reads.join(flight, waiter)
            st.store.joined(obj)
        else:
            st.reads.check_room()
            t = st.store.begin_read_back(obj)  # CapacityError: refused, nothing reserved
            try:
                st.reads.start(obj.key, t, waiter)
            except BaseException:
                st.store.cancel_read_back(obj)
                raise
        conn.parked_loads += 1
        st.stats["loads_parked"] += 1
        return DEFERRED

    def collect_reads(self) -> None:
        """Settle every finished read-back, each in its own try; then run or fail each of its parked loads."""
        st = self.state
        st.version += 1
        try:
            assert st.reads is not None  # the loop watches the pool's wake pipe only when there is one
            flights = st.reads.finished()
        except Exception:
            st.internal("collect reads: finished()")
            return
        for f in flights:
            try:
                self._settle_flight(f)
            except Exception:
                st.internal("collect reads", f"object {f.key[:64]!r}")

    def _settle_flight(self, f: Flight) -> None:
        st = self.state
        err: ServiceError | None = None
        obj = st.store.objects.get(f.key)
        try:
            if obj is None or not obj.reading:  # a reading object can be neither dropped nor evicted
                raise InternalError(f"object {f.key[:64]!r} changed while its read-back was in flight")
            if isinstance(f.error, ReadCancelledError):  # shutdown came first: nothing was read
                st.store.cancel_read_back(obj)
                err = ShuttingDownError(f"service is shutting down (the read of {f.key[:64]!r} was cancelled)")
            else:
                st.store.end_read_back(obj, f.tensor, f.digest, f.error)
        except DiskReadError as e:
            log.warning("read-back of %r failed (%d load(s) refused): %s", f.key[:64], len(f.waiters), e)
            err = e
        except Exception as e:
            st.internal("collect reads: install", f"object {f.key[:64]!r}")
            err = InternalError(f"installing the read-back failed: {type(e).__name__}: {e}")
        finally:
            f.tensor = None  # type: ignore[assignment]  # installed, or dropped with the failure
        now = time.monotonic()
        for w in f.waiters:
            conn = st.conns.get(w.cid)
            if conn is None or conn.client is None or conn.client.client_id != w.client_id:
                st.stats["parked_loads_dropped"] += 1  # the connection went away meanwhile
                continue
            conn.parked_loads -= 1
            seq = w.req.seq
            try:
                if err is not None:
                    raise err
                conn.client.last_seen = now  # it could not heartbeat while we owed it this reply
                st.registry.require_live(conn.client)
                result = self.load(conn, conn.client, w.req)
                if result is not DEFERRED:
                    self.replies.send(conn, ok_reply(seq, result))
            except ServiceError as e:
                self.replies.fail(conn, seq, e)
            except Exception as e:
                st.internal("collect reads: parked load", f"conn {conn.cid}")
                self.replies.fail(conn, seq, InternalError(f"{type(e).__name__}: {e}"))

    def evict(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self.state.require_admin(conn, req, "evict")  # originals are shared: one client may not drop others' data
        a = req.args
        out = self.state.store.evict(a["key"], tier=a["tier"], force=a["force"])
        return {"evicted": len(out["evicted"]), "kept": out["kept"]}

    def retain(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self.state.require_admin(conn, req, "retain")
        key = req.args["key"]
        obj = self.state.store.objects.get(key)
        if obj is None or obj.state != "committed":
            raise ObjectMissingError(f"no committed object {key[:64]!r} to retain")
        self.state.store.retention.retain(req.args["group"], key)
        return {"group": req.args["group"], "retained": True}

    def unretain(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self.state.require_admin(conn, req, "unretain")
        return {"group": req.args["group"], "released": self.state.store.retention.unretain(req.args["group"])}
