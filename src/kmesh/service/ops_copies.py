"""Copy jobs: accept one (a save or load that passed every check), collect the drained ones, and the client's
wait / cancel on its own requests.

Copies run on kmesh.transfer engines (kmesh.service.jobs.CopyRunner); their completion comes back through the
runner's wake pipe, and the loop then calls collect(). A job's bookkeeping has steps that must all happen
whatever fails among them (settle), so one job's failure can skip neither its own cleanup nor another job's.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from kmesh.service.errors import InternalError, NotOwnerError, SequenceError
from kmesh.service.jobs import CopyJob
from kmesh.service.protocol import Request, clip, ok_reply
from kmesh.service.registry import Client, State
from kmesh.service.state import DEFERRED, FAULT_KEY_PREFIX, Conn, Replies, ServiceState


class CopyOps:
    def __init__(self, state: ServiceState, replies: Replies) -> None:
        self.state = state
        self.replies = replies

    def accept(self, job: CopyJob, src: Any, dst: Any, writes: bool, undo: Callable[[], None]) -> dict[str, Any]:
        st = self.state
        reg = job.reg
        if reg.state is not State.ACTIVE or reg.memory is None:
            st.stats["stale_uses"] += 1  # unreachable by construction; counted, never silently used
            undo()
            raise InternalError(f"registration {reg.reg_id} not mapped at accept")
        try:
            st.copies.start(job, src, dst)
        except Exception:
            undo()
            raise
        st.copies.reservations.add(reg.reg_id, job.offset, job.offset + job.nbytes, writes, job.req_id)
        st.registry.begin_work(reg, job.req_id)
        return {"req": job.req_id, "state": job.state}

    def accept_many(self, batch: list[tuple[CopyJob, Any, Any, Callable[[], None]]]
                    ) -> tuple[list[CopyJob], InternalError | None]:
        """accept() of every prepared load (writes into client memory) in order, their copies started as one
        batch (CopyRunner.start_many). Returns the accepted jobs and, where the engine refused one (a bug: every
        check passed), an InternalError for it; that one and the rest are undone, never started."""
        st = self.state
        usable: list[tuple[CopyJob, Any, Any, Callable[[], None]]] = []
        error: InternalError | None = None
        for i, (job, src, dst, undo) in enumerate(batch):
            if job.reg.state is not State.ACTIVE or job.reg.memory is None:
                st.stats["stale_uses"] += 1  # unreachable by construction; counted, never silently used
                error = InternalError(f"registration {job.reg.reg_id} not mapped at accept")
                for _, _, _, later in batch[i:]:
                    later()
                break
            usable.append((job, src, dst, undo))
        refused = st.copies.start_many([(job, src, dst) for job, src, dst, _ in usable])
        started = [item for item in usable if item[0].ticket is not None]
        for _, _, _, undo in usable[len(started):]:
            undo()
        if refused is not None:
            error = InternalError(f"the transfer engine refused a checked copy: {type(refused).__name__}: {refused}")
        return self._accepted(started), error

    def _accepted(self, started: list[tuple[CopyJob, Any, Any, Callable[[], None]]]) -> list[CopyJob]:
        st = self.state
        for job, _, _, _ in started:
            st.copies.reservations.add(job.reg.reg_id, job.offset, job.offset + job.nbytes, True, job.req_id)
            st.registry.begin_work(job.reg, job.req_id)
        return [job for job, _, _, _ in started]

    def collect(self) -> None:
        """Finish the bookkeeping of every drained copy. Each job in its own try, and what must happen
        regardless (a terminal state, the store settled, the reservation removed, the registration's in-flight
        entry ended, parked waits answered) runs step by step in _settle, so one job's failure can skip
        neither its own cleanup nor any other job's."""
        st = self.state
        st.version += 1
        try:
            jobs = st.copies.finished()
        except Exception:
            st.internal("collect: finished()")
            return
        for job in jobs:
            try:
                self._complete(job)
            except Exception as e:
                st.internal("collect", f"request {job.req_id}")
                job.error = f"internal error collecting this copy: {type(e).__name__}: {e}"
                if job.state == "running" or not job.store_settled:
                    job.state = "failed"  # its result is not trusted (a save is aborted below)
            finally:
                self._settle(job)

    def _complete(self, job: CopyJob) -> None:
        st = self.state
        if "collect_raises" in st.opts.faults and job.obj.key.startswith(FAULT_KEY_PREFIX):
            raise RuntimeError(f"injected fault collect_raises (request {job.req_id})")
        if job.reg.memory is None:  # the mapping went away under a running copy: must never happen
            st.stats["stale_uses"] += 1
        failed = job.ticket.state == "failed" or job.error is not None
        job.error = job.error or job.ticket.error
        state = "cancelled" if job.cancel_requested else ("failed" if failed else "done")
        job.tensors = ()  # drop our views before the registry may unmap
        if job.kind == "save":
            (st.store.commit if state == "done" else st.store.abort)(job.obj)
        else:
            st.store.release(job.obj)
        job.store_settled = True
        job.state = state
        owner = st.registry.clients.get(job.client_id)
        if state == "done" and owner is not None:
            owner.count_copy(job.kind, job.nbytes)

    def _settle(self, job: CopyJob) -> None:
        st = self.state

        def terminal() -> None:
            if job.state == "running":
                job.state, job.error = "failed", job.error or "internal error"
            job.finished_at = job.finished_at or time.monotonic()
            job.tensors = ()
            st.stats[f"copies_{job.state}"] += 1

        def store() -> None:
            if job.store_settled:
                return
            job.store_settled = True
            if job.kind == "load":
                st.store.release(job.obj)
            elif st.store.objects.get(job.obj.key) is job.obj:  # pending, or a commit cut short: not trusted
                st.store.abort(job.obj)

        steps = [("terminal state", terminal), ("store", store),
                 ("reservation", lambda: st.copies.reservations.remove(job.reg.reg_id, job.req_id)),
                 ("end of work", lambda: st.registry.end_work(job.reg, job.req_id))]
        for name, step in steps:
            try:
                step()
            except Exception:
                st.internal(f"collect: {name}", f"request {job.req_id}")
        if job.store_settled:
            # the finished record is kept for wait/status (up to max_jobs): it must not pin the original's RAM,
            # which the store may evict or forget (a long fuzz grew the service's RSS by ~0.9 KiB per request)
            job.obj = None
        for conn in list(st.conns.values()):
            try:
                parked = conn.parked.pop(job.req_id, None)
                if parked is not None:
                    self.replies.send(conn, ok_reply(parked[0], job.describe()))
            except Exception:
                st.internal("collect: answer wait", f"request {job.req_id}")
            try:
                if conn.parked_batches:
                    self._answer_batches(conn, finished=job.req_id)
            except Exception:
                st.internal("collect: answer load_many", f"request {job.req_id}")

    def _all_terminal(self, reqs: list[int]) -> bool:
        jobs = self.state.copies.jobs
        # the last first: a batch's copies finish in order on one lane, so while it waits this stops at once
        # (a 60-item batch asked once per finished copy scanned ~1800 items, not 60)
        return all(r not in jobs or jobs[r].terminal for r in reversed(reqs))   # one trimmed away had ended

    def batch_jobs(self, reqs: list[int]) -> list[dict[str, Any]]:
        """What load_many's reply says of each of its copies (wait's description without the key: bounded)."""
        out = []
        for r in reqs:
            job = self.state.copies.jobs.get(r)
            out.append({"req": r, "state": "unknown", "nbytes": 0, "error": None} if job is None else
                       {"req": r, "state": job.state, "nbytes": job.nbytes, "error": clip(job.error)})
        return out

    def _answer_batches(self, conn: Conn, finished: int | None = None, now: float | None = None) -> None:
        """Send the parked load_many replies of `conn` that are due: every copy terminal once `finished` ended,
        or the deadline passed by `now`."""
        keep = []
        for seq, reqs, deadline, reply in conn.parked_batches:
            if (finished is not None and self._all_terminal(reqs)) or \
                    (now is not None and now >= deadline):
                self.replies.send(conn, ok_reply(seq, {**reply, "jobs": self.batch_jobs(reqs)}))
            else:
                keep.append((seq, reqs, deadline, reply))
        conn.parked_batches[:] = keep

    def wait_batch(self, conn: Conn, seq: int, reqs: list[int], timeout_s: float, reply: dict[str, Any]) -> Any:
        """load_many's reply: now (timeout 0, or every copy already terminal), else once they all are or the
        timeout passed (parked like a wait)."""
        if timeout_s == 0 or self._all_terminal(reqs):
            return {**reply, "jobs": self.batch_jobs(reqs)}
        conn.parked_batches.append((seq, reqs, time.monotonic() + timeout_s, reply))
        return DEFERRED

    def expire_waits(self, now: float) -> None:
        """The tick's parked-wait deadlines: a wait past its timeout is answered with the job as it stands (a
        load_many with its copies as they stand)."""
        st = self.state
        for conn in list(st.conns.values()):
            if conn.parked_batches:
                try:
                    self._answer_batches(conn, now=now)
                except Exception:
                    st.internal("tick: parked load_many", f"conn {conn.cid}")
            for req, (seq, deadline) in list(conn.parked.items()):
                if now < deadline:
                    continue
                del conn.parked[req]
                try:
                    self.replies.send(conn, ok_reply(seq, st.copies.get(req).describe()))
                except Exception as e:  # the waiter still gets an answer
                    st.internal("tick: parked wait", f"request {req}")
                    self.replies.fail(conn, seq, InternalError(f"answering the wait failed: {type(e).__name__}: {e}"))

    def _own_job(self, c: Client, req_id: int) -> CopyJob:
        job = self.state.copies.get(req_id)
        if job.client_id != c.client_id:
            raise NotOwnerError(f"request {req_id} belongs to another client")
        return job

    def wait(self, conn: Conn, c: Client, req: Request) -> Any:
        job = self._own_job(c, req.args["req"])
        if job.terminal or req.args["timeout_s"] == 0:
            return job.describe()
        if job.req_id in conn.parked:
            raise SequenceError(f"a wait for request {job.req_id} is already pending")
        conn.parked[job.req_id] = (req.seq, time.monotonic() + req.args["timeout_s"])
        return DEFERRED

    def cancel(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        job = self._own_job(c, req.args["req"])
        if not job.terminal:
            job.cancel_requested = True  # the copy runs on; its range stays reserved until it drained
        return job.describe()
