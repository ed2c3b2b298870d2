"""Accepted copy requests: their byte-range reservations, and the engines that run them.

A request is accepted only after every check passed; from then on it is "work in flight" that nothing
cancels part-way: cancel, close, heartbeat loss or client death only mean nobody wants the result, while the
copy itself runs to completion (kmesh.transfer never abandons an accepted copy). The request's byte range in
the client's registration stays reserved until the engine has drained its ticket — a cancelled load's
destination cannot be handed to another copy while the first may still be writing it.

Completion: one watcher thread per engine blocks in `engine.drain([ticket])` (physical completion: finished
host copy / CUDA event) and then wakes the server's selector through a pipe. The server mutates the registry
only from its own thread, when it collects finished jobs.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kmesh.service.errors import CapacityError, DestinationBusyError, UnknownRequestError
from kmesh.service.protocol import clip
from kmesh.service.wake import DoneQueue
from kmesh.transfer import ChunkGate, FaultPlan, SubmitError, TransferEngine, TransferError


@dataclass(eq=False)
class CopyJob:
    req_id: int
    client_id: int
    kind: str                      # "load" (object -> client memory) | "save" (client memory -> object)
    reg: Any                       # Registration
    obj: Any                       # store Original (None once settled: the record keeps only its key)
    offset: int
    nbytes: int
    state: str = "running"         # running -> done | failed | cancelled
    cancel_requested: bool = False
    error: str | None = None
    ticket: Any = None
    drain_errors: int = 0
    accepted_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    tensors: tuple[Any, ...] = ()  # src, dst: alive until the engine drained the ticket
    store_settled: bool = False    # the save committed/aborted, or the load's pin released (exactly once)
    lane: Any = None
    key: bytes = b""               # the object's key (set from obj)

    def __post_init__(self) -> None:
        self.key = self.obj.key

    @property
    def terminal(self) -> bool:
        return self.state != "running"

    def describe(self) -> dict[str, Any]:
        return {"req": self.req_id, "kind": self.kind, "reg": self.reg.reg_id, "key": self.key,
                "offset": self.offset, "nbytes": self.nbytes, "state": self.state,
                "cancel_requested": self.cancel_requested, "error": clip(self.error),
                "chunks_done": getattr(self.ticket, "chunks_done", 0),
                "chunks_total": getattr(self.ticket, "chunks_total", 0)}


class Reservations:
    """Byte ranges of registrations that accepted copies read (shared) or write (exclusive)."""

    def __init__(self) -> None:
        self._by_reg: dict[int, list[tuple[int, int, bool, int]]] = {}

    def check(self, reg_id: int, start: int, end: int, writes: bool,
              extra: list[tuple[int, int, int, int]] = ()) -> None:
        """DestinationBusyError if [start, end) overlaps a reserved range (or one of `extra`: (reg_id, start, end,
        req_id) of writes about to be reserved) that either side writes."""
        pending = [(s, e, True, req) for r, s, e, req in extra if r == reg_id]
        for s, e, w, req in [*self._by_reg.get(reg_id, ()), *pending]:
            if s < end and start < e and (w or writes):
                raise DestinationBusyError(f"bytes [{start}, {end}) of registration {reg_id} overlap request {req} "
                                           f"({'writing' if w else 'reading'} [{s}, {e})), which has not drained")

    def add(self, reg_id: int, start: int, end: int, writes: bool, req_id: int) -> None:
        self._by_reg.setdefault(reg_id, []).append((start, end, writes, req_id))

    def remove(self, reg_id: int, req_id: int) -> None:
        left = [r for r in self._by_reg.get(reg_id, ()) if r[3] != req_id]
        if left:
            self._by_reg[reg_id] = left
        else:
            self._by_reg.pop(reg_id, None)

    def count(self) -> int:
        return sum(len(v) for v in self._by_reg.values())


WATCH_BATCH = 128   # jobs a lane's watcher drains in one call at most (load_many's MAX_BATCH)


class _Lane:
    """One engine and the thread that waits for its tickets in submission order."""

    def __init__(self, engine: TransferEngine, done: "DoneQueue[CopyJob]") -> None:
        self.engine = engine
        self.outstanding = 0  # jobs handed to this lane and not yet collected (server thread only)
        self.q: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._done = done
        self.thread = threading.Thread(target=self._watch, name=f"kmesh-watch-{engine.device}", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            # the jobs queued behind it too (a load_many's copies arrive together): drained in order in one call,
            # whose shared completion event is asked once, and handed to the loop with one wake-up
            jobs, stop = [job], False
            while len(jobs) < WATCH_BATCH:
                try:
                    more = self.q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
            while True:
                try:
                    self.engine.drain([j.ticket for j in jobs])
                    break
                except TransferError as e:  # completion unknown: the copy may still run, so keep waiting
                    for j in jobs:
                        if j.ticket in e.pending:
                            j.drain_errors += 1
                    time.sleep(0.05)
            self._done.put_many(jobs)
            if stop:
                return


class CopyRunner:
    def __init__(self, chunk_bytes: int, gate_fd: int | None = None, max_jobs: int = 4096) -> None:
        self._gate = ChunkGate.from_read_fd(gate_fd) if gate_fd is not None else None
        self._chunk_bytes = chunk_bytes
        self._lanes: dict[str, _Lane] = {}
        self._done: DoneQueue[CopyJob] = DoneQueue()
        self.wake_r = self._done.wake_r
        self.jobs: OrderedDict[int, CopyJob] = OrderedDict()
        self._jobs_of: dict[int, OrderedDict[int, CopyJob]] = {}   # the same jobs by client (its status and lists)
        self._ids = itertools.count(1)
        self.max_jobs = max_jobs
        self.reservations = Reservations()

    def _engine(self, name: str) -> TransferEngine:
        faults = FaultPlan(chunk_bytes=self._chunk_bytes) if self._gate is not None else None
        return TransferEngine(name, faults=faults, gate=self._gate)

    def _lane(self, device: torch.device) -> _Lane:
        name = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane(self._engine(name), self._done)
        return lane

    def recycle_idle(self) -> int:
        """Replace every idle engine by a fresh one (returns how many).

        Why: TransferEngine's CPU worker thread keeps a reference to the last job it copied (and so to views of
        the registered memory) until its next job arrives, which keeps an mmap from closing although the copy
        drained long ago. Closing an idle engine ends that thread and drops the reference. Only engines with
        no accepted work are touched, so no copy is affected."""
        n = 0
        for name, lane in self._lanes.items():
            if lane.outstanding == 0 and not lane.engine.pending():
                old, lane.engine = lane.engine, self._engine(name)
                old.close()
                n += 1
        return n

    def new_id(self, pending: int = 0) -> int:
        """A request id, unless the copies in flight (and `pending` accepted ones about to start) reach max_jobs."""
        running = self.running() + pending
        if running >= self.max_jobs:
            raise CapacityError(f"{running} copies in flight, limit {self.max_jobs}")
        return next(self._ids)

    def start(self, job: CopyJob, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand an accepted job to the engine of the device memory involved (TransferArgumentError = nothing
        accepted; the caller undoes its bookkeeping)."""
        lane = self._lane(self._device_of(src, dst))
        try:
            job.ticket = lane.engine.submit(src, dst, owner=f"req-{job.req_id}")
        except SubmitError as e:  # accepted, then failed: still drained like any accepted copy
            job.ticket, job.error = e.pending[0], str(e)
        self._started(job, lane, src, dst)

    def start_many(self, items: list[tuple[CopyJob, torch.Tensor, torch.Tensor]]) -> TransferError | None:
        """start() of every item in order, the copies of consecutive items on one engine submitted as one batch
        (TransferEngine.submit_many). Returns None, or the error of the first item no engine accepted: it and the
        items after it were not started (the caller undoes their bookkeeping); every item before it was."""
        i = 0
        while i < len(items):
            lane = self._lane(self._device_of(items[i][1], items[i][2]))
            run = [items[i]]
            while i + len(run) < len(items) and \
                    self._lane(self._device_of(items[i + len(run)][1], items[i + len(run)][2])) is lane:
                run.append(items[i + len(run)])
            try:
                tickets = lane.engine.submit_many([(src, dst) for _, src, dst in run],
                                                  owners=[f"req-{job.req_id}" for job, _, _ in run])
                failure: TransferError | None = None
            except SubmitError as e:     # run[k] accepted, then failed: drained like any accepted copy
                tickets, failure = [*e.accepted, e.pending[0]], None   # type: ignore[attr-defined]
                run[len(tickets) - 1][0].error = str(e)
            except TransferError as e:   # run[k] not accepted: nothing from it on started
                tickets, failure = list(getattr(e, "accepted", ())), e
            for (job, src, dst), ticket in zip(run, tickets):
                job.ticket = ticket
                self._started(job, lane, src, dst)
            if failure is not None:
                return failure
            i += len(tickets)
        return None

    @staticmethod
    def _device_of(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
        return dst.device if dst.device.type == "cuda" else src.device

    def _started(self, job: CopyJob, lane: _Lane, src: torch.Tensor, dst: torch.Tensor) -> None:
        job.tensors = (src, dst)
        job.lane = lane
        lane.outstanding += 1
        self.jobs[job.req_id] = job
        self._jobs_of.setdefault(job.client_id, OrderedDict())[job.req_id] = job
        self._trim()
        lane.q.put(job)

    def finished(self) -> list[CopyJob]:
        """Jobs whose tickets drained since the last call (ticket state done/failed is final)."""
        out = self._done.take_all()
        for job in out:
            job.lane.outstanding -= 1
            job.lane = None
        return out

    def get(self, req_id: int) -> CopyJob:
        job = self.jobs.get(req_id)
        if job is None:
            raise UnknownRequestError(f"no request {req_id}")
        return job

    def running(self) -> int:
        """Copies in flight: handed to a lane and not yet collected. The same count as the kept jobs that are not
        terminal (collect() makes every job finished() returns terminal, on this thread), without a scan of every
        kept job: those are up to max_jobs, and each load asked for the count (a child's 60 loads scanned ~4000
        finished jobs each once a few children had run)."""
        return sum(lane.outstanding for lane in self._lanes.values())

    def check_released(self, tensor: torch.Tensor) -> None:
        """BufferHeldError if any engine still holds bytes of tensor (the registry's last word before unmap)."""
        for lane in self._lanes.values():
            lane.engine.release(tensor)

    def live_holds(self) -> int:
        return sum(lane.engine.live_holds() for lane in self._lanes.values())

    def _trim(self) -> None:
        while len(self.jobs) > self.max_jobs:
            oldest = next((k for k, j in self.jobs.items() if j.terminal), None)
            if oldest is None:
                return
            job = self.jobs.pop(oldest)
            mine = self._jobs_of.get(job.client_id)
            if mine is not None:
                mine.pop(oldest, None)
                if not mine:
                    del self._jobs_of[job.client_id]

    def jobs_of(self, client_id: int | None) -> list[CopyJob]:
        """The requests kept (ids ascending), one client's or everyone's."""
        return list((self.jobs if client_id is None else self._jobs_of.get(client_id, {})).values())

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.q.put(None)
            lane.thread.join(timeout=5)
            lane.engine.close(timeout=5)
        self._lanes.clear()
        if self._gate is not None:
            self._gate.close()
        self._done.close()
