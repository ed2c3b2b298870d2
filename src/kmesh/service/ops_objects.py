"""Operations on stored objects: save, load (with the disk and remote tiers' parked loads), evict, retain, unretain.

Disk tier (--disk-dir): a load of an original whose RAM copy was evicted never reads the file on the loop's
thread. It starts one read on a small reader pool (kmesh.service.diskreads) and its reply is parked; loads of
the same object arriving meanwhile join that read (`joins`); when it ends (the pool's wake pipe) the loop calls
collect_reads(), which checks the digest against the commit, installs the RAM copy and runs each parked load
again from the top, now a RAM hit (or sends each the same DiskReadError). Meanwhile everyone else is served. On
start the store re-adopts the object files a previous run left in the disk dir (--no-adopt: start empty; see
kmesh.service.store).

Remote tier (--remote-master): every commit of this host's saves is published to the shared store, and a load
of a key this host does not hold at all parks behind one fetch of it (kmesh.service.remotetier; loads of the
same key join it); collect_remote() installs the verified object and runs the parked loads again — the same
resume path as the disk tier's.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kmesh.service.diskreads import Flight, ReadCancelledError
from kmesh.service.errors import (DiskReadError, InternalError, LayoutMismatchError, ObjectMissingError,
                                  RemoteReadError, ServiceError, ShuttingDownError)
from kmesh.service.jobs import CopyJob
from kmesh.service.ops_copies import CopyOps
from kmesh.service.ops_registrations import check_range, work_registration
from kmesh.service.protocol import Request, clip, ok_reply
from kmesh.service.registry import Client
from kmesh.service.remotetier import Fetch, Publish, RemoteCancelledError
from kmesh.service.state import DEFERRED, Conn, Replies, ServiceState
from kmesh.storage.remote import RemoteMissingError

log = logging.getLogger("kmesh.service")

# a load checked and ready to be accepted: its job, source, destination, and what undoes its pin of the original
PreparedLoad = tuple[CopyJob, Any, Any, Callable[[], None]]


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
        prepared = self._checked_load(conn, c, req)
        if prepared is DEFERRED:
            return DEFERRED
        job, src, dst, undo = prepared
        return self.copies.accept(job, src=src, dst=dst, writes=True, undo=undo)

    def _checked_load(self, conn: Conn, c: Client, req: Request,
                      batch: list[tuple[int, int, int, int]] = ()) -> Any:
        """load()'s checks and what its copy needs, nothing started: (job, src, dst, undo), the original pinned
        (undo releases it), or DEFERRED where the load parked. `batch`: the destinations (reg_id, start, end,
        req_id) of the loads of the same load_many prepared before this one and not accepted yet: one overlapping
        this one's is refused as if they had been accepted (as load() one after another would), and they count
        as copies in flight."""
        st = self.state
        a = req.args
        reg = work_registration(st, c, req)
        if st.remote is not None and a["key"] not in st.store.objects:
            return self._park_fetch(conn, c, req, a["key"])
        obj = st.store.lookup(a["key"])
        if obj.geometry != reg.geometry:
            raise LayoutMismatchError(f"object {a['key'][:64]!r} was saved under another KV geometry")
        off, n = a["offset"], obj.nbytes
        check_range(reg, off, n)
        st.copies.reservations.check(reg.reg_id, off, off + n, writes=True, extra=batch)
        if not obj.in_ram:
            return self._park_load(conn, c, req, obj)
        obj = st.store.acquire(a["key"])
        try:
            req_id = st.copies.new_id(pending=len(batch))
        except BaseException:
            st.store.release(obj)
            raise
        job = CopyJob(req_id, c.client_id, "load", reg, obj, off, n)
        return job, obj.tensor, reg.memory.tensor[off:off + n], (lambda: st.store.release(obj))

    def load_many(self, conn: Conn, c: Client, req: Request) -> Any:
        """The items' loads in order, each with load()'s checks and copy, up to the first one load() would refuse
        (its typed error in the reply; nothing after it requested) or park (an original not in this host's RAM:
        the client loads it and the rest one by one); the copies of the items before it are accepted together
        (CopyOps.accept_many: one batch for the transfer engine). Then, with timeout_s > 0, one wait for all of
        the accepted copies (CopyOps.wait_batch). One round trip for a child's segments instead of two each."""
        a = req.args
        stopped: int | None = None
        error: dict[str, str] | None = None
        batch: list[PreparedLoad] = []
        ranges: list[tuple[int, int, int, int]] = []     # the batch's destinations, for the next item's check
        try:
            for i, item in enumerate(a["items"]):
                if self._would_park(item["key"]):
                    stopped = i
                    break
                one = Request("load", req.seq, req.token, {"reg": a["reg"], "gen": a["gen"],
                                                            "layout_digest": a["layout_digest"], **item}, [])
                try:
                    prepared = self._checked_load(conn, c, one, ranges)
                except ServiceError as e:
                    if e.fatal:
                        raise
                    stopped, error = i, {"code": e.code, "message": clip(str(e))}
                    break
                if prepared is DEFERRED:   # _would_park says when load parks: never here
                    raise InternalError(f"load_many: item {i} parked although its original is in RAM")
                batch.append(prepared)
                job = prepared[0]
                ranges.append((job.reg.reg_id, job.offset, job.offset + job.nbytes, job.req_id))
        except BaseException:
            for _, _, _, undo in batch:    # nothing of the batch was accepted: its originals are unpinned
                undo()
            raise
        accepted, refused = self.copies.accept_many(batch)
        if refused is not None and (stopped is None or len(accepted) < stopped):
            stopped, error = len(accepted), {"code": refused.code, "message": clip(str(refused))}
        reqs = [job.req_id for job in accepted]
        reply = {"reqs": reqs, "stopped_at": stopped, "error": error}
        return self.copies.wait_batch(conn, req.seq, reqs, a["timeout_s"], reply)

    def _would_park(self, key: bytes) -> bool:
        """load() would park this key: not on this host (a remote fetch) or committed here with no RAM copy."""
        st = self.state
        if st.remote is not None and key not in st.store.objects:
            return True
        obj = st.store.objects.get(key)
        return obj is not None and obj.state == "committed" and not obj.in_ram

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

    def _park_fetch(self, conn: Conn, c: Client, req: Request, key: bytes) -> Any:
        """This host holds no such object: one fetch from the remote tier (loads of the key meanwhile join it);
        collect_remote runs each parked load again from the top once the fetch ended."""
        st = self.state
        assert st.remote is not None
        waiter = ParkedLoad(conn.cid, c.client_id, req)
        flight = st.remote.get(key)
        if flight is not None:
            st.remote.join(flight, waiter)
        else:
            st.remote.fetch(key, waiter)   # CapacityError: refused, nothing started
        conn.parked_loads += 1
        st.stats["loads_parked"] += 1
        return DEFERRED

    def collect_remote(self) -> None:
        """Settle every finished remote task: a verified fetch becomes a committed original here, then its parked
        loads run again (a RAM hit now); a failed one answers each of them with the same error."""
        st = self.state
        st.version += 1
        assert st.remote is not None  # the loop watches the tier's wake pipe only when there is one
        try:
            tasks = st.remote.finished()
        except Exception:
            st.internal("collect remote: finished()")
            return
        for t in tasks:
            if isinstance(t, Publish):
                continue
            try:
                err = self._install_fetch(t)
            except Exception as e:
                st.internal("collect remote: install", f"object {t.key[:64]!r}")
                err = InternalError(f"installing the fetched object failed: {type(e).__name__}: {e}")
            self._resume(t.waiters, err)

    def _install_fetch(self, f: Fetch) -> ServiceError | None:
        st = self.state
        if isinstance(f.error, RemoteMissingError):
            return ObjectMissingError(f"no committed object {f.key[:64]!r} here or in the remote tier")
        if isinstance(f.error, RemoteCancelledError):
            return ShuttingDownError(f"service is shutting down (the fetch of {f.key[:64]!r} was cancelled)")
        if f.error is not None:
            log.warning("remote fetch of %r failed (%d load(s) refused): %s", f.key[:64], len(f.waiters), f.error)
            return RemoteReadError(f"object {f.key[:64]!r} could not be fetched from the remote tier: "
                                   f"{type(f.error).__name__}: {f.error}")
        if f.key in st.store.objects:   # saved here meanwhile: the parked loads find that one
            return None
        try:
            st.store.install_fetched(f.key, f.layout, f.geometry, f.payload, f.sha256)
        except ServiceError as e:        # CapacityError: no room for it here
            return e
        finally:
            f.payload = None
        return None

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
        self._resume(f.waiters, err)

    def _resume(self, waiters: list[ParkedLoad], err: ServiceError | None) -> None:
        """Each parked load of a read-back or fetch that ended: run again from the top, or answered err."""
        st = self.state
        now = time.monotonic()
        for w in waiters:
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
