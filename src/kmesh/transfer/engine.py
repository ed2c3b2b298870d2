"""The copy engine: submit() accepts a copy and returns a Ticket; drain() waits until accepted copies have
PHYSICALLY finished and only then drops the holds on their buffers.

Completion is never "the call returned":
- CPU: copies run on one worker thread (FIFO); a ticket is finished when that thread has stopped copying it.
- CUDA: copies run on a side stream that first waits for the producer (the caller's current stream, or the
  `after` stream/event), so the producer's earlier writes are visible; a ticket is finished when all its
  chunks are issued and a CUDA event recorded after them has completed.
Holds: while a ticket is pending, its source and destination are held (refcounted, by byte range);
release() of a held buffer raises BufferHeldError. A drain that fails (refused, timed out, completion check
failed) drops nothing; a failed copy is never resubmitted, it is reported as failed once it has stopped.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

import torch

from kmesh.transfer.errors import (BufferHeldError, CompletionCheckError, DrainRefusedError, DrainTimeoutError,
                                   EngineClosedError, SubmitError, TransferArgumentError, TransferError)
from kmesh.transfer.faults import ChunkGate, FaultPlan
from kmesh.transfer.holds import Hold, HoldTable, Span, span_of
from kmesh.transfer.ledger import SharedLedger

TicketState = Literal["pending", "done", "failed"]


@dataclass(eq=False)
class Ticket:
    """One accepted copy. state: pending (accepted, holds on) → done | failed (drained, holds off)."""

    id: int
    owner: str
    nbytes: int
    route: str  # e.g. "cuda:0->cpu"
    state: TicketState = "pending"
    error: str | None = None
    chunks_done: int = 0  # chunks copied (CPU) or issued to the stream (CUDA)
    chunks_total: int = 1
    _stopped: threading.Event = field(default_factory=threading.Event, repr=False)
    _event: object | None = field(default=None, repr=False)  # torch.cuda.Event after the last chunk
    _copy_error: str | None = field(default=None, repr=False)
    _ledger_slots: list[int] = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        return f"Ticket(id={self.id}, owner={self.owner!r}, state={self.state}, {self.route}, {self.nbytes} B)"

    def issued(self, timeout: float | None = None) -> object | None:
        """Wait until every chunk of this copy is issued (CPU: copied), then return the CUDA event recorded after
        the last chunk, for a consumer stream to wait on (device visibility); None on CPU. The holds stay until
        drain(): a consumer of the destination keeps it alive by submitting its own ticket after its work."""
        self._stopped.wait(timeout)
        return self._event


@dataclass
class DrainReport:
    done: list[Ticket]
    failed: list[Ticket]
    seconds: float
    holds_released: int

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class _Job:
    ticket: Ticket
    src: torch.Tensor  # flat byte views
    dst: torch.Tensor
    after: object | None
    chunk: int
    chunked: bool = False   # decided once, at submit: through the worker, chunk by chunk


_ids = itertools.count(1)


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b's bytes begin where a's end, in the same storage (flat uint8 views)."""
    return (a.storage_offset() + a.numel() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.get_device() == b.get_device())


def _grown(a: torch.Tensor, n: int) -> torch.Tensor:
    return a.as_strided((a.numel() + n,), (1,), a.storage_offset())


def _flat_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


def _storage_end(x: torch.Tensor) -> int:
    st = x.untyped_storage()
    return st.data_ptr() + st.nbytes()


class _Run:
    """Pairs joined into one copy (submit_many's join_adjacent): spans only, one flat view per side at the end.
    A pair joins when its source and destination bytes begin where the run's end, inside the run's first
    tensors' storages (a view may only grow within its storage), and the joined spans do not overlap."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, src_span: Span, dst_span: Span) -> None:
        self.src, self.dst, self.src_span, self.dst_span, self.pairs = src, dst, src_span, dst_span, 1
        self._ends: tuple[int, int] | None = None

    def join(self, s: Span, d: Span) -> bool:
        if s.start == s.end or s.start != self.src_span.end or d.start != self.dst_span.end:
            return False
        if s.device != self.src_span.device or d.device != self.dst_span.device:
            return False
        if self._ends is None:
            self._ends = (_storage_end(self.src), _storage_end(self.dst))
        joined_s, joined_d = Span(s.device, self.src_span.start, s.end), Span(d.device, self.dst_span.start, d.end)
        if s.end > self._ends[0] or d.end > self._ends[1] or joined_s.overlaps(joined_d):
            return False
        self.src_span, self.dst_span, self.pairs = joined_s, joined_d, self.pairs + 1
        return True

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        s, d = _flat_bytes(self.src), _flat_bytes(self.dst)
        n = self.src_span.end - self.src_span.start
        if n == s.numel():
            return s, d
        return _grown(s, n - s.numel()), _grown(d, n - d.numel())


def coalesced(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same copies (flat uint8 (src, dst) views, in order) as fewer: a pair whose source and destination
    both continue the previous pair's, in the same storages, joins it, unless the joined source and destination
    would overlap (then the order of the two copies matters). A child's private copy of its 15-60 staged
    segments, adjacent in staging and in private, becomes one copy (each launch costs ~10 µs of host time)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for src, dst in pairs:
        if out and src.numel() and _follows(out[-1][0], src) and _follows(out[-1][1], dst):
            a, b = _grown(out[-1][0], src.numel()), _grown(out[-1][1], dst.numel())
            if not span_of(a).overlaps(span_of(b)):
                out[-1] = (a, b)
                continue
        out.append((src, dst))
    return out


class TransferEngine:
    def __init__(self, device: str = "cpu", faults: FaultPlan | None = None, *,
                 gate: ChunkGate | None = None, ledger: SharedLedger | None = None) -> None:
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise TransferArgumentError(f"device must be cpu or cuda[:N], got {device!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise TransferArgumentError("a cuda TransferEngine needs a CUDA device; none is available")
            dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.device = dev
        self.faults = faults or FaultPlan()
        # Chunk by chunk where something acts between chunks: a chunk fault, or a gate that still paces. A gate
        # opened for good paces nothing, so with a gate and no chunk fault, copies submitted after it opened run
        # whole, as in an engine without a gate (a service whose harness opened its gate copies as a deployed one).
        # Without a gate an explicit plan chunks at its chunk_bytes.
        chunk_fault = faults is not None and (faults.fail_copy_at_chunk is not None
                                              or faults.kill_after_chunks is not None)
        self._chunk_faults = chunk_fault or (faults is not None and gate is None)
        self.gate = gate
        self.ledger = ledger
        self._holds = HoldTable()
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._closed = False
        self._stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    def _chunked(self) -> bool:
        return self._chunk_faults or (self.gate is not None and not self.gate.opened_for_good())

    # -- submit -------------------------------------------------------------------------------------
    def submit(self, src: torch.Tensor, dst: torch.Tensor, *, owner: str, after: object | None = None) -> Ticket:
        """Accept an async copy src -> dst (same number of bytes, both contiguous); holds go on both.

        after: what the source's producer must finish first. CUDA: a torch.cuda.Stream or Event (default: the
        caller's current stream); CPU: a threading.Event or an earlier Ticket (default: nothing, CPU writes
        made before submit are already visible). Raises TransferArgumentError before accepting anything, or
        SubmitError after accepting (its .pending holds the ticket: drain it).
        """
        job = self._accept(src, dst, owner, self._producer(after))
        self._issue([job])
        if self.faults.take("fail_after_submit"):
            raise SubmitError("submit failed after the copy was accepted (injected fault)", [job.ticket])
        return job.ticket

    def submit_many(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, owner: str | None = None,
                    owners: Sequence[str] | None = None, after: object | None = None,
                    join_adjacent: bool = False) -> list[Ticket]:
        """submit() of every (src, dst) pair in order, as one batch; returns their tickets. The pairs' owner:
        `owner` for all, or `owners`, one per pair.

        Each pair gets submit()'s checks, ticket, holds and injected faults. A failure at pair k raises what
        submit() would have raised for it, with `.accepted` set to the tickets of pairs 0..k-1 (accepted and
        issued: drain them, as pair k's own ticket in a SubmitError's `.pending`). On CUDA the copies that are not
        chunked are issued together: the side stream waits for the producer once, the copies are issued in one
        stream context, and one event recorded after the last is every ticket's completion (an event recorded
        later completes later: no copy is reported finished before it is). Per copy that saves the stream wait,
        the stream switch and an event (~0.1 ms a copy on the H200 in Python; a RAG child copies 15-60 segments).
        An engine whose submit() is overridden (a control's fault) gets every pair through it, one by one.

        join_adjacent: a run of pairs whose sources and destinations each continue the previous pair's bytes (same
        owner, joined spans not overlapping) is accepted as ONE copy with one ticket, returned at each of the run's
        positions: its holds cover the run's bytes, and it finishes or fails as a whole. Every pair is still checked
        on its own first; a pair that fails its checks ends the batch there, the runs before it accepted and issued
        (`.accepted`, per pair). Not with a planned fault or a pacing gate (they act per copy): then as without it.
        Per copy the ticket, holds and views are host work (~10-80 µs); a child's private copy of 15-60 adjacent
        segments needs one."""
        if (owner is None) == (owners is None) or (owners is not None and len(owners) != len(pairs)):
            raise TransferArgumentError("submit_many takes `owner`, or `owners` with one owner per pair")
        names = list(owners) if owners is not None else [owner] * len(pairs)
        if type(self).submit is not TransferEngine.submit:
            return self._submit_each(pairs, names, after)
        if join_adjacent and not self._chunked() and not self.faults.fail_after_submit:
            return self._submit_joined(pairs, names, self._producer(after))
        producer = self._producer(after)
        jobs: list[_Job] = []
        try:
            for (src, dst), name in zip(pairs, names):
                job = self._accept(src, dst, name, producer)
                jobs.append(job)
                producer = None if self.device.type == "cuda" else producer   # the side stream waits once
                if self.faults.take("fail_after_submit"):
                    self._issue(jobs)
                    raise SubmitError("submit failed after the copy was accepted (injected fault)", [job.ticket])
        except TransferError as e:
            done = [j.ticket for j in jobs if not isinstance(e, SubmitError) or j.ticket not in e.pending]
            if not isinstance(e, SubmitError):
                self._issue(jobs)
            e.accepted = done      # type: ignore[attr-defined]
            raise
        self._issue(jobs)
        return [j.ticket for j in jobs]

    def _submit_each(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], owners: list[str],
                     after: object | None) -> list[Ticket]:
        tickets: list[Ticket] = []
        for (src, dst), owner in zip(pairs, owners):
            try:
                tickets.append(self.submit(src, dst, owner=owner, after=after))
            except TransferError as e:
                e.accepted = tickets   # type: ignore[attr-defined]
                raise
        return tickets

    def _submit_joined(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], owners: list[str],
                       producer: object | None) -> list[Ticket]:
        """submit_many(join_adjacent=True): every pair checked, runs of adjacent pairs accepted as one job each."""
        runs: list[_Run] = []
        failure: Exception | None = None
        for i, ((src, dst), name) in enumerate(zip(pairs, owners)):
            try:
                self._check_owner(name)
                s_span, d_span = self._checked_spans(src, dst)
            except TransferError as e:
                failure = e
                break
            if runs and owners[i - 1] == name and runs[-1].join(s_span, d_span):
                continue
            runs.append(_Run(src, dst, s_span, d_span))
        jobs: list[_Job] = []
        tickets: list[Ticket] = []
        try:
            for run in runs:
                s, d = run.views()
                jobs.append(self._accept_views(s, d, run.src_span, run.dst_span, owners[len(tickets)], producer))
                tickets.extend([jobs[-1].ticket] * run.pairs)
                producer = None if self.device.type == "cuda" else producer   # the side stream waits once
        except Exception as e:      # e.g. the hold ledger is full: the runs before it stand, issued
            failure = e             # type: ignore[assignment]
        self._issue(jobs)
        if failure is not None:
            failure.accepted = tickets      # type: ignore[attr-defined]
            raise failure
        return tickets

    def _check_owner(self, owner: str) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if not isinstance(owner, str) or not owner:
            raise TransferArgumentError(f"owner must be a non-empty string, got {owner!r}")

    def _accept(self, src: torch.Tensor, dst: torch.Tensor, owner: str, producer: object | None) -> _Job:
        """submit()'s checks, ticket and holds: the copy is accepted (not issued yet). Raises
        TransferArgumentError (or a hold's error) with nothing accepted."""
        self._check_owner(owner)
        return self._accept_views(*self._byte_views(src, dst), owner, producer)

    def _accept_views(self, s: torch.Tensor, d: torch.Tensor, s_span: Span, d_span: Span, owner: str,
                      producer: object | None) -> _Job:
        """The ticket and holds of a checked copy (flat byte views and their spans)."""
        chunked = self._chunked()
        n = s.numel()
        chunk = self.faults.chunk_bytes if chunked else max(n, 1)
        if chunk <= 0:
            raise TransferArgumentError(f"chunk_bytes must be > 0, got {chunk}")
        t = Ticket(id=next(_ids), owner=owner, nbytes=n, route=f"{s_span.device}->{d_span.device}",
                   chunks_total=max(1, -(-n // chunk)))
        try:
            self._hold(t, s_span, d_span)
        except Exception:  # e.g. the hold ledger is full: nothing was accepted, so no hold may stay behind
            self._finalize(t)
            raise
        with self._lock:
            self._tickets[t.id] = t
        return _Job(t, s, d, producer, chunk, chunked)

    def _issue(self, jobs: list[_Job]) -> None:
        """Start accepted copies: CUDA ones not chunked issued on the side stream together (_submit_cuda), the
        rest to the worker. A job that cannot be issued never existed (its holds undone); the error names it."""
        if self.device.type == "cuda":
            whole = [j for j in jobs if not j.chunked]
            if whole:
                try:
                    self._submit_cuda(whole)
                except Exception as e:
                    for j in whole:
                        self._finalize(j.ticket)
                    raise TransferError(f"submit could not enqueue the copy: {type(e).__name__}: {e}") from e
            jobs = [j for j in jobs if j.chunked]
        for job in jobs:
            try:
                if self.device.type == "cuda":
                    self._order_cuda(job)
                self._enqueue(job)
            except Exception as e:  # nothing was enqueued: undo the holds, the ticket never existed
                self._finalize(job.ticket)
                raise TransferError(f"submit could not enqueue the copy: {type(e).__name__}: {e}") from e

    def _byte_views(self, src: torch.Tensor,
                    dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Span, Span]:
        """Flat uint8 views of src and dst, and the bytes each covers (computed once: the holds take them too;
        per copy this bookkeeping is what a batch of small copies costs on the host)."""
        s_span, d_span = self._checked_spans(src, dst)
        return _flat_bytes(src), _flat_bytes(dst), s_span, d_span

    def _checked_spans(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[Span, Span]:
        """submit()'s checks of one pair; the bytes src and dst cover."""
        cuda_index = self.device.index if self.device.type == "cuda" else None
        for name, x in (("src", src), ("dst", dst)):
            if not isinstance(x, torch.Tensor):
                raise TransferArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if not x.is_contiguous():
                raise TransferArgumentError(f"{name} must be contiguous (shape {tuple(x.shape)}, "
                                            f"stride {x.stride()})")
            if x.is_cuda:
                if cuda_index is None or x.get_device() != cuda_index:
                    raise TransferArgumentError(f"{name} is on {x.device}, this engine copies on {self.device}")
            elif not x.is_cpu:
                raise TransferArgumentError(f"{name} is on unsupported device {x.device}")
        nb_s, nb_d = src.numel() * src.element_size(), dst.numel() * dst.element_size()
        if nb_s != nb_d:
            raise TransferArgumentError(f"src has {nb_s} bytes, dst {nb_d}; a copy moves equal byte counts")
        s_span, d_span = span_of(src), span_of(dst)
        if nb_s and s_span.overlaps(d_span):
            raise TransferArgumentError("src and dst overlap")
        return s_span, d_span

    def _producer(self, after: object | None) -> object | None:
        if self.device.type == "cuda":
            if after is None:
                return torch.cuda.current_stream(self.device)
            if isinstance(after, (torch.cuda.Stream, torch.cuda.Event)):
                return after
            if isinstance(after, Ticket):
                if after.id in self._tickets and self._tickets[after.id] is after:
                    return None  # same side stream: FIFO order already puts this copy after it
                if after._event is None:
                    raise TransferArgumentError(f"producer {after!r} of another engine is not issued yet")
                return after._event
        else:
            if after is None or isinstance(after, (threading.Event, Ticket)):
                return after
        raise TransferArgumentError(f"after= must be a producer stream/event (cuda) or threading.Event/Ticket "
                                    f"(cpu), got {type(after).__name__}")

    def _hold(self, t: Ticket, src: Span, dst: Span) -> None:
        """Both holds of a copy, added together (one lock: a service's watcher thread drops holds meanwhile)."""
        self._holds.add_pair(Hold(t.id, "src", src), Hold(t.id, "dst", dst))
        if self.ledger is None:
            return
        for span, role in ((src, "src"), (dst, "dst")):
            if span.device == "cpu":
                from kmesh.transfer.shm import segment_at

                hit = segment_at(span.start, max(span.end - span.start, 1))
                if hit is not None:
                    seg, off = hit
                    t._ledger_slots.append(self.ledger.add(t.id, seg.tag, off, off + span.end - span.start, role))

    # -- the copy itself ----------------------------------------------------------------------------
    def _enqueue(self, job: _Job) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="kmesh-transfer", daemon=True)
            self._worker.start()
        self._queue.put(job)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            t = job.ticket
            try:
                self._copy_chunks(job)
            except Exception as e:  # the copy stopped; drain reports it failed, never retries it
                t._copy_error = f"{type(e).__name__}: {e}"
            finally:
                if self.device.type == "cuda" and self._stream is not None:
                    ev = torch.cuda.Event()
                    ev.record(self._stream)  # after every chunk that was issued
                    t._event = ev
                t._stopped.set()
            # Drop this job's buffer views now, not when the next copy arrives: a view kept alive here
            # would stop the owner from unmapping memory whose copies have already drained.
            job = t = None

    def _copy_chunks(self, job: _Job) -> None:
        t, f = job.ticket, self.faults
        if self.device.type == "cpu":
            if isinstance(job.after, threading.Event):
                job.after.wait()
            elif isinstance(job.after, Ticket):
                job.after._stopped.wait()
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream_ctx:
            for i in range(t.chunks_total):
                if f.fail_copy_at_chunk is not None and i >= f.fail_copy_at_chunk:
                    raise TransferError(f"copy failed at chunk {i} (injected fault)")
                if self.gate is not None:
                    self.gate.wait()
                a, b = i * job.chunk, min((i + 1) * job.chunk, job.src.numel())
                job.dst[a:b].copy_(job.src[a:b], non_blocking=self._stream is not None)
                t.chunks_done = i + 1
                if f.kill_after_chunks is not None and t.chunks_done >= f.kill_after_chunks:
                    if self._stream is not None:
                        self._stream.synchronize()
                    os.kill(os.getpid(), signal.SIGKILL)

    def _order_cuda(self, job: _Job) -> None:
        """Order the side stream after the job's producer now, in the submitting thread (current streams are per
        thread), and keep its CUDA memory from the caching allocator until the side stream passed it."""
        s = self._stream
        assert s is not None
        self._wait_producer(job)
        for x in (job.src, job.dst):
            if x.is_cuda:
                x.record_stream(s)  # the caching allocator must not reuse the block before the copy ends

    def _wait_producer(self, job: _Job) -> None:
        s = self._stream
        assert s is not None
        if isinstance(job.after, torch.cuda.Stream):
            s.wait_stream(job.after)
        elif isinstance(job.after, torch.cuda.Event):
            s.wait_event(job.after)
        job.after = None

    def _submit_cuda(self, jobs: list[_Job]) -> None:
        """Issue unchunked copies in order on the side stream (adjacent ones as one: coalesced); one event after
        the last finishes them all. Each CUDA storage involved is recorded on the side stream once."""
        s = self._stream
        assert s is not None
        for job in jobs:
            self._wait_producer(job)
        pairs = coalesced([(job.src, job.dst) for job in jobs])
        recorded: set[tuple[int, int]] = set()
        for x in (x for pair in pairs for x in pair):
            if x.is_cuda:
                storage = (x.get_device(), x.untyped_storage().data_ptr())
                if storage not in recorded:   # the allocator must not reuse the block before the copy ends
                    recorded.add(storage)
                    x.record_stream(s)
        with torch.cuda.stream(s):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(s)
        for job in jobs:
            t = job.ticket
            t._event = ev
            t.chunks_done = 1
            t._stopped.set()

    # -- completion and drain -----------------------------------------------------------------------
    def _finished(self, t: Ticket) -> bool:
        """Has the copy physically stopped? Never guesses: a failing check raises CompletionCheckError."""
        if self.faults.take("fail_completion_check"):
            raise CompletionCheckError(f"completion check of ticket {t.id} failed (injected fault)")
        if not t._stopped.is_set():
            return False
        if t._event is not None:
            try:
                return bool(t._event.query())  # type: ignore[attr-defined]
            except RuntimeError as e:
                raise CompletionCheckError(f"completion check of ticket {t.id} failed: {e}") from e
        return True

    def _wait(self, t: Ticket, deadline: float | None) -> bool:
        delay = 1e-5
        while not self._finished(t):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if not t._stopped.is_set():
                t._stopped.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            elif deadline is None and t._event is not None:
                t._event.synchronize()  # type: ignore[attr-defined]
            else:
                time.sleep(delay)  # waiting on a CUDA event: poll with backoff (bounded by the deadline)
                delay = min(delay * 2, 1e-3)
        return True

    def drain(self, tickets: Iterable[Ticket] | None = None, *, owner: str | None = None,
              timeout: float | None = None) -> DrainReport:
        """Wait until the selected pending tickets (given ones, else owner's, else all) have physically finished,
        then drop their holds. Finishes accepted work only; never resubmits a failed copy.

        Raises DrainRefusedError (injected) / DrainTimeoutError / CompletionCheckError; their .pending lists
        the tickets still held. Tickets that did finish before the failure are finalized (holds dropped).
        """
        t0 = time.perf_counter()
        sel = self._select(tickets, owner)
        if self.faults.take("refuse_first_drain"):
            raise DrainRefusedError("drain refused (injected fault); holds kept", sel)
        deadline = None if timeout is None else time.monotonic() + timeout
        done: list[Ticket] = []
        failed: list[Ticket] = []
        released = 0
        seen_done: object | None = None     # a CUDA event seen complete: the tickets sharing it need no query
        for i, t in enumerate(sel):
            try:
                ok = (t._event is not None and t._event is seen_done and t._stopped.is_set()) or \
                    self._wait(t, deadline)
                seen_done = t._event
            except CompletionCheckError as e:
                raise CompletionCheckError(f"{e}; holds kept", sel[i:]) from e
            if not ok:
                raise DrainTimeoutError(f"drain timed out after {timeout} s; copies still running", sel[i:])
            released += self._finalize(t)
            (failed if t.state == "failed" else done).append(t)
        return DrainReport(done, failed, time.perf_counter() - t0, released)

    def _select(self, tickets: Iterable[Ticket] | None, owner: str | None) -> list[Ticket]:
        with self._lock:
            if tickets is not None:
                sel = list(tickets)
                for t in sel:
                    if not isinstance(t, Ticket) or self._tickets.get(t.id) is not t:
                        if isinstance(t, Ticket) and t.state != "pending":
                            continue
                        raise TransferArgumentError(f"{t!r} is not a ticket of this engine")
                sel = [t for t in sel if t.state == "pending"]
                if owner is not None:
                    sel = [t for t in sel if t.owner == owner]
            else:
                sel = [t for t in self._tickets.values() if owner is None or t.owner == owner]
        return sorted(set(sel), key=lambda t: t.id)

    def _finalize(self, t: Ticket) -> int:
        t.state = "failed" if t._copy_error else "done"
        t.error = t._copy_error
        gone = self._holds.drop_ticket(t.id)
        if self.ledger is not None:
            for slot in t._ledger_slots:
                self.ledger.remove(slot, t.id)
        t._ledger_slots.clear()
        with self._lock:
            self._tickets.pop(t.id, None)
        return len(gone)

    # -- holds ----------------------------------------------------------------------------------------
    def holds(self, t: torch.Tensor) -> int:
        """Live holds overlapping the bytes of t."""
        return len(self._holds.over(span_of(t)))

    def live_holds(self) -> int:
        return len(self._holds)

    def release(self, t: torch.Tensor) -> None:
        """Declare that the caller is done with t. Raises BufferHeldError while any pending ticket holds it."""
        held = self._holds.over(span_of(t))
        if held:
            ids = {h.ticket_id for h in held}
            with self._lock:
                pend = [self._tickets[i] for i in sorted(ids) if i in self._tickets]
            sp = span_of(t)
            raise BufferHeldError(f"buffer [{sp.start:#x}, {sp.end:#x}) on {sp.device} is held by {len(held)} "
                                  f"hold(s); drain its tickets first", pend)

    def pending(self, owner: str | None = None) -> list[Ticket]:
        with self._lock:
            return sorted((t for t in self._tickets.values() if owner is None or t.owner == owner),
                          key=lambda t: t.id)

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Drain everything (raises like drain, engine stays usable for a retry), then stop the worker."""
        if self.pending():
            self.drain(timeout=timeout)
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
