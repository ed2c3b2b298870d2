"""kmesh.transfer: holds, drain, every typed error, fault points, and the cross-process ledger.

Copies that must still be in flight are held by a ChunkGate (a token pipe), never by sleeps.
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from kmesh.transfer import (BufferHeldError, ChunkGate, CompletionCheckError, DrainRefusedError, DrainTimeoutError,
                            EngineClosedError, FaultPlan, HolderAliveError, SharedLedger, SubmitError,
                            TransferArgumentError, TransferEngine, TransferError, shm)
from kmesh.transfer.ledger import exited

CHUNK = 4096
N = 16 * CHUNK  # 16 chunks
POISON = 0xA5


def pattern(n=N, seed=7):
    return (torch.arange(n, dtype=torch.int64) * 2654435761 + seed).remainder(251).to(torch.uint8)


def bufs(n=N):
    return pattern(n), torch.full((n,), POISON, dtype=torch.uint8)


def gated(**faults):
    g = ChunkGate()
    return TransferEngine("cpu", FaultPlan(chunk_bytes=CHUNK, **faults), gate=g), g


def wait_chunks(t, k):
    import time

    t0 = time.monotonic()
    while t.chunks_done < k:  # an observed state, with a failing deadline
        assert time.monotonic() - t0 < 10, f"copy did not reach {k} chunks"
        time.sleep(0.001)


# -- holds, release, drain ----------------------------------------------------------------------------------
def test_copy_completes_and_holds_drop_only_in_drain():
    eng = TransferEngine("cpu")
    src, dst = bufs()
    t = eng.submit(src, dst, owner="r1")
    assert t.state == "pending" and eng.holds(src) == 1 and eng.holds(dst) == 1
    assert eng.pending("r1") == [t] and eng.pending("other") == []
    r = eng.drain(owner="r1")
    assert r.done == [t] and r.ok and r.holds_released == 2
    assert t.state == "done" and torch.equal(dst, src)
    assert eng.holds(dst) == 0 and eng.live_holds() == 0
    eng.release(dst)  # allowed now
    eng.close()


def test_release_before_drain_raises_and_loses_nothing():
    eng, gate = gated()
    src, dst = bufs()
    t = eng.submit(src, dst, owner="r1")
    for victim in (dst, src, dst[100:200], src.view(-1, 64)[3]):  # views overlapping held bytes too
        with pytest.raises(BufferHeldError) as ei:
            eng.release(victim)
        assert ei.value.pending == [t]
    assert eng.holds(dst) == 1 and t.state == "pending"
    other = torch.zeros(N, dtype=torch.uint8)
    eng.release(other)  # unrelated memory: fine
    gate.open()
    eng.drain([t])
    eng.release(dst)
    assert torch.equal(dst, src)
    eng.close()


def test_holds_are_refcounted_per_ticket():
    eng, gate = gated()
    src, dst = bufs()
    dst2 = torch.empty_like(dst)
    t1 = eng.submit(src, dst, owner="a")
    t2 = eng.submit(src, dst2, owner="b")
    assert eng.holds(src) == 2
    gate.open()
    eng.drain([t1])
    assert eng.holds(src) == 1 and eng.holds(dst) == 0
    with pytest.raises(BufferHeldError):
        eng.release(src)
    eng.drain(owner="b")
    assert eng.holds(src) == 0
    eng.release(src)
    assert torch.equal(dst2, src) and t2.state == "done"
    eng.close()


def test_non_overlapping_part_of_same_storage_is_not_held():
    eng, gate = gated()
    big = torch.zeros(2 * N, dtype=torch.uint8)
    t = eng.submit(pattern(), big[:N], owner="a")
    assert eng.holds(big[N:]) == 0 and eng.holds(big) == 1
    eng.release(big[N:])
    gate.open()
    eng.drain([t])
    eng.close()


# -- typed errors and fault points --------------------------------------------------------------------------
def test_fail_after_submit_raises_with_completable_pending_ticket():
    eng, gate = gated(fail_after_submit=1)
    src, dst = bufs()
    with pytest.raises(SubmitError) as ei:
        eng.submit(src, dst, owner="r1")
    (t,) = ei.value.pending
    assert isinstance(ei.value, TransferError) and t.state == "pending" and eng.holds(dst) == 1
    with pytest.raises(BufferHeldError):
        eng.release(dst)
    gate.open()
    r = eng.drain(ei.value.pending)
    assert r.done == [t] and torch.equal(dst, src) and eng.holds(dst) == 0
    t2 = eng.submit(src, torch.empty_like(dst), owner="r2")  # the fault fired once only
    eng.drain([t2])
    eng.close()


def test_refused_first_drain_keeps_holds_then_later_drain_succeeds():
    eng, gate = gated(refuse_first_drain=1)
    src, dst = bufs()
    t = eng.submit(src, dst, owner="r1")
    gate.open()
    wait_chunks(t, 16)  # the copy has physically finished; the refused drain must still keep the holds
    with pytest.raises(DrainRefusedError) as ei:
        eng.drain([t])
    assert ei.value.pending == [t] and not isinstance(ei.value, DrainTimeoutError)
    assert t.state == "pending" and eng.holds(src) == 1 and eng.holds(dst) == 1
    with pytest.raises(BufferHeldError):
        eng.release(src)
    assert eng.drain([t]).done == [t] and eng.live_holds() == 0
    eng.close()


def test_drain_timeout_while_copy_in_flight_keeps_holds_and_never_resubmits():
    eng, gate = gated()
    src, dst = bufs()
    t = eng.submit(src, dst, owner="r1")
    gate.allow(3)
    wait_chunks(t, 3)
    with pytest.raises(DrainTimeoutError) as ei:
        eng.drain([t], timeout=0.05)
    assert isinstance(ei.value, DrainRefusedError) and ei.value.pending == [t]
    assert t.chunks_done == 3 and eng.holds(dst) == 1
    # the owner's view: exactly three chunks landed, the rest is still poison
    assert torch.equal(dst[:3 * CHUNK], src[:3 * CHUNK]) and bool((dst[3 * CHUNK:] == POISON).all())
    gate.open()
    eng.drain([t])
    assert torch.equal(dst, src) and t.chunks_done == 16
    eng.close()


def test_completion_check_failure_is_typed_and_keeps_holds():
    eng, gate = gated(fail_completion_check=1)
    src, dst = bufs()
    t = eng.submit(src, dst, owner="r1")
    gate.open()
    with pytest.raises(CompletionCheckError) as ei:
        eng.drain()
    assert ei.value.pending == [t] and eng.holds(dst) == 1 and t.state == "pending"
    assert eng.drain().done == [t] and eng.holds(dst) == 0
    eng.close()


def test_failed_copy_is_reported_after_it_stopped_and_never_resubmitted():
    eng, gate = gated(fail_copy_at_chunk=5)
    src, dst = bufs()
    t = eng.submit(src, dst, owner="r1")
    gate.open()
    r = eng.drain([t])
    assert r.failed == [t] and not r.ok and t.state == "failed" and "chunk 5" in t.error
    assert eng.holds(dst) == 0  # the copy has stopped: its memory may be reused
    assert torch.equal(dst[:5 * CHUNK], src[:5 * CHUNK]) and bool((dst[5 * CHUNK:] == POISON).all())
    assert eng.drain([t]).done == [] and t.chunks_done == 5  # draining again does not copy again
    assert bool((dst[5 * CHUNK:] == POISON).all())
    eng.close()


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.zeros(10, dtype=torch.uint8), torch.zeros(11, dtype=torch.uint8)), "equal byte counts"),
    (lambda: (torch.zeros(4, 4).t(), torch.zeros(4, 4)), "contiguous"),
    (lambda: ("not a tensor", torch.zeros(4)), "torch.Tensor"),
])
def test_bad_arguments_are_rejected_before_anything_is_accepted(make, match):
    eng = TransferEngine("cpu")
    src, dst = make()
    with pytest.raises(TransferArgumentError, match=match):
        eng.submit(src, dst, owner="r")
    assert eng.live_holds() == 0 and eng.pending() == []
    eng.close()


def test_more_argument_errors():
    eng = TransferEngine("cpu")
    buf = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(TransferArgumentError, match="overlap"):
        eng.submit(buf[:60], buf[40:], owner="r")
    with pytest.raises(TransferArgumentError, match="owner"):
        eng.submit(buf[:50], buf[50:], owner="")
    with pytest.raises(TransferArgumentError, match="after"):
        eng.submit(buf[:50], buf[50:], owner="r", after=42)
    with pytest.raises(TransferArgumentError, match="unknown fault"):
        FaultPlan.from_dict({"fail_after_submitt": 1})
    with pytest.raises(TransferArgumentError, match="device"):
        TransferEngine("meta")
    other = TransferEngine("cpu")
    foreign = other.submit(buf[:50], buf[50:], owner="r")
    with pytest.raises(TransferArgumentError, match="not a ticket of this engine"):
        eng.drain([foreign])
    other.close()
    assert eng.live_holds() == 0
    eng.close()
    with pytest.raises(EngineClosedError):
        eng.submit(buf[:50], buf[50:], owner="r")


def test_cpu_copy_waits_for_its_producer():
    eng = TransferEngine("cpu")
    src, dst = bufs()
    src.zero_()
    produced = threading.Event()
    t = eng.submit(src, dst, owner="r", after=produced)
    assert not t._stopped.wait(0.05)  # waiting on the producer, not reading yet
    src.copy_(pattern())  # the producer's write, then its signal
    produced.set()
    eng.drain([t])
    assert torch.equal(dst, pattern())
    eng.close()


def test_close_drains_and_refusal_keeps_engine_usable():
    eng, gate = gated(refuse_first_drain=1)
    src, dst = bufs()
    eng.submit(src, dst, owner="r")
    gate.open()
    with pytest.raises(DrainRefusedError):
        eng.close()
    assert eng.live_holds() == 2
    eng.close()
    assert eng.live_holds() == 0 and torch.equal(dst, src)


# -- shared memory and the cross-process ledger -------------------------------------------------------------
def test_segment_views_pin_the_mapping_and_leaks_are_counted():
    name = f"kmesh-test-{os.getpid()}-seg"
    fds, live = shm.open_fds(), shm.live_segments()
    seg = shm.Segment.create(8192, name=name)
    assert shm.dev_shm_entries(name) == [name] and shm.live_segments() == live + 1
    v = seg.tensor(torch.int32, (16, 16), offset=4096)
    v.fill_(3)
    other = shm.Segment.attach(name)
    assert other.tag == seg.tag and int(other.tensor(torch.int32, offset=4096)[255]) == 3
    assert shm.segment_at(v.data_ptr(), 1024) == (seg, 4096)
    with pytest.raises(shm.SegmentBusyError):
        seg.close()
    del v
    seg.close()
    other.close()
    seg.unlink()
    assert shm.dev_shm_entries(name) == [] and shm.open_fds() == fds and shm.live_segments() == live
    with pytest.raises(shm.SegmentNotFoundError):
        shm.Segment.attach(name)
    with pytest.raises(shm.ShmError, match="no slash"):
        shm.Segment.create(10, name="a/b")
    with pytest.raises(shm.ShmError, match="does not fit"):
        shm.Segment.create(10).tensor(torch.int32, (100,))


_CHILD = textwrap.dedent("""
    import sys, torch
    from kmesh.transfer import shm
    from kmesh.transfer import ChunkGate, FaultPlan, SharedLedger, TransferEngine
    ledger = SharedLedger.attach(sys.argv[1])
    seg = shm.Segment.attach(sys.argv[2])
    src, dst = seg.tensor(torch.uint8, (%(n)d,)), seg.tensor(torch.uint8, (%(n)d,), %(n)d)
    kill = None if sys.argv[4] == "none" else int(sys.argv[4])
    eng = TransferEngine("cpu", FaultPlan(chunk_bytes=%(chunk)d, kill_after_chunks=kill),
                         gate=ChunkGate.from_read_fd(int(sys.argv[3])), ledger=ledger)
    t = eng.submit(src, dst, owner="child")
    print("submitted", flush=True)
    eng.drain([t])
    print("drained", flush=True)
""") % {"n": N, "chunk": CHUNK}


def _spawn_child(tmp_name, kill):
    ledger = SharedLedger.create(f"{tmp_name}-ledger", slots=16)
    seg = shm.Segment.create(2 * N, name=f"{tmp_name}-buf")
    seg.tensor(torch.uint8, (N,)).copy_(pattern())
    seg.tensor(torch.uint8, (N,), N).fill_(POISON)
    gate = ChunkGate()
    p = subprocess.Popen([sys.executable, "-c", _CHILD, ledger.name, seg.name, str(gate.read_fd), str(kill)],
                         pass_fds=(gate.read_fd,), stdout=subprocess.PIPE, text=True)
    os.close(gate.read_fd)
    pidfd = os.pidfd_open(p.pid)
    assert p.stdout.readline().strip() == "submitted"
    return ledger, seg, gate, p, pidfd


def _cleanup(ledger, seg, gate, p, pidfd):
    gate.open()
    p.wait(timeout=30)
    p.stdout.close()
    os.close(pidfd)
    for x in (ledger, seg):
        x.close()
        x.unlink()


def test_ledger_shows_other_process_holds_until_its_drain():
    name = f"kmesh-test-{os.getpid()}-led"
    ledger, seg, gate, p, pidfd = _spawn_child(name, "none")
    try:
        held = ledger.holds(pid=p.pid)
        assert sorted(h.role for h in held) == ["dst", "src"] and all(h.tag == seg.tag for h in held)
        assert ledger.holds(seg.tag, N, 2 * N)[0].role == "dst"  # by byte range inside the segment
        with pytest.raises(HolderAliveError):
            ledger.reap(p.pid, pidfd)
        gate.open()
        assert p.stdout.readline().strip() == "drained"
        assert ledger.holds(pid=p.pid) == []
        assert torch.equal(seg.tensor(torch.uint8, (N,), N), pattern())
    finally:
        _cleanup(ledger, seg, gate, p, pidfd)


def test_kill_fault_sigkills_the_copy_owner_mid_copy_and_holds_are_reaped_only_after_exit():
    name = f"kmesh-test-{os.getpid()}-kill"
    ledger, seg, gate, p, pidfd = _spawn_child(name, 3)
    try:
        gate.allow(5)  # tokens for more than 3 chunks: the kill fault, not the gate, stops the copy
        assert exited(pidfd, timeout=30)
        assert p.wait(timeout=30) == -signal.SIGKILL
        assert len(ledger.holds(pid=p.pid)) == 2  # a dead holder's slots stay until reaped
        assert ledger.reap(p.pid, pidfd) == 2 and ledger.live() == 0
        dst = seg.tensor(torch.uint8, (N,), N)
        assert torch.equal(dst[:3 * CHUNK], pattern()[:3 * CHUNK]) and bool((dst[3 * CHUNK:] == POISON).all())
        del dst
    finally:
        _cleanup(ledger, seg, gate, p, pidfd)


# -- CUDA -------------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_cuda_copy_is_physical_and_holds_drop_in_drain(direction):
    eng = TransferEngine("cuda")
    host = pattern(1 << 24).pin_memory()
    dev = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    if direction == "d2h":
        dev.copy_(host)
        host = torch.empty_like(host).pin_memory()
        src, dst = dev, host
    else:
        src, dst = host, dev
    t = eng.submit(src, dst, owner="g")
    assert eng.holds(src) == 1 and eng.holds(dst) == 1
    with pytest.raises(BufferHeldError):
        eng.release(dst)
    r = eng.drain([t])
    assert r.done == [t] and t._event.query()
    assert torch.equal(dst.cpu(), pattern(1 << 24)) and eng.live_holds() == 0
    eng.close()


@pytest.mark.gpu
@cuda
def test_cuda_copy_waits_for_producer_stream_and_a_control_does_not():
    n = 1 << 22
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    host2 = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    eng = TransferEngine("cuda")
    torch.cuda._sleep(200_000_000)  # the producer is slow...
    dev.fill_(7)  # ...then writes the source
    t = eng.submit(dev, host, owner="p")  # default: after the current (producer) stream
    control = TransferEngine("cuda")
    tc = control.submit(dev, host2, owner="c", after=torch.cuda.Stream())  # waits for an idle stream only
    eng.drain([t])
    control.drain([tc])
    assert bool((host == 7).all())
    assert bool((host2 == 0).all()), "control copy should have read the source before the producer wrote it"
    eng.close()
    control.close()


@pytest.mark.gpu
@cuda
def test_cuda_gated_copy_drain_timeout_then_success():
    g = ChunkGate()
    eng = TransferEngine("cuda", FaultPlan(chunk_bytes=1 << 20), gate=g)
    src = pattern(8 << 20).cuda()
    dst = torch.full((8 << 20,), POISON, dtype=torch.uint8).pin_memory()
    t = eng.submit(src, dst, owner="g")
    g.allow(2)
    wait_chunks(t, 2)
    with pytest.raises(DrainTimeoutError):
        eng.drain([t], timeout=0.1)
    assert eng.holds(dst) == 1 and bool((dst[2 << 20:] == POISON).all())
    g.open()
    eng.drain([t])
    assert torch.equal(dst, pattern(8 << 20))
    eng.close()


# -- drain selection, partial failures, reports (in process) ---------------------------------------------------
class _Hooked(FaultPlan):
    """A FaultPlan that runs `on_check(n)` at the n-th completion check and fails the check when it returns True:
    lets a test act exactly when drain asks "finished?" (no timing guesses)."""

    def __init__(self, on_check, **kw):
        super().__init__(**kw)
        self.on_check, self.checks = on_check, 0

    def take(self, name):
        if name == "fail_completion_check":
            self.checks += 1
            return bool(self.on_check(self.checks))
        return super().take(name)


def test_drain_timeout_finalizes_the_tickets_that_finished_and_keeps_the_rest_held():
    eng, gate = gated()
    src, dst1 = bufs()
    dst2 = torch.full((N,), POISON, dtype=torch.uint8)
    t1 = eng.submit(src, dst1, owner="a")
    t2 = eng.submit(src, dst2, owner="a")  # FIFO worker: t2 gets no tokens until t1 has all of its chunks
    gate.allow(16)
    assert t1._stopped.wait(10)
    import time

    t0 = time.monotonic()
    with pytest.raises(DrainTimeoutError) as ei:
        eng.drain([t2, t1], timeout=0.05)
    assert time.monotonic() - t0 < 0.9  # the timeout bounds the wait
    assert ei.value.pending == [t2] and t1.state == "done" and t2.state == "pending"
    assert eng.holds(dst1) == 0 and eng.holds(dst2) == 1 and eng.holds(src) == 1  # only t2's holds remain
    assert eng.pending() == [t2] and torch.equal(dst1, src) and bool((dst2 == POISON).all())
    gate.open()
    r = eng.drain()
    assert r.done == [t2] and r.holds_released == 2 and torch.equal(dst2, src) and eng.live_holds() == 0
    eng.close()


def test_completion_check_failure_mid_drain_keeps_holds_from_that_ticket_on():
    gate = ChunkGate()
    plan = _Hooked(lambda n: n == 2, chunk_bytes=CHUNK)  # the second "finished?" fails
    eng = TransferEngine("cpu", plan, gate=gate)
    src, dst1 = bufs()
    dst2, dst3 = torch.empty_like(dst1), torch.empty_like(dst1)
    ts = [eng.submit(src, d, owner="a") for d in (dst1, dst2, dst3)]
    gate.open()
    assert all(t._stopped.wait(10) for t in ts)  # all copies stopped: one check per ticket
    with pytest.raises(CompletionCheckError) as ei:
        eng.drain()
    assert ei.value.pending == ts[1:] and ts[0].state == "done" and eng.holds(dst1) == 0
    assert [t.state for t in ts[1:]] == ["pending", "pending"] and eng.holds(dst2) == 1 and eng.holds(dst3) == 1
    assert eng.drain().done == ts[1:] and eng.live_holds() == 0
    eng.close()


def test_drain_report_lists_tickets_once_in_id_order_with_every_hold_and_its_time():
    import time

    eng, gate = gated()
    src, dst1 = bufs()
    dst2 = torch.empty_like(dst1)
    t1 = eng.submit(src, dst1, owner="a")
    t2 = eng.submit(src, dst2, owner="a")
    gate.open()
    w0 = time.perf_counter()
    r = eng.drain([t2, t1, t2])
    wall = time.perf_counter() - w0
    assert r.done == [t1, t2] and r.failed == [] and r.ok and r.holds_released == 4
    assert 0 <= r.seconds <= wall
    eng.close()


def test_drain_selects_by_owner_and_skips_tickets_already_drained():
    eng, gate = gated()
    src, dst1 = bufs()
    dst2 = torch.empty_like(dst1)
    ta = eng.submit(src, dst1, owner="a")
    tb = eng.submit(src, dst2, owner="b")
    gate.open()
    assert eng.drain([ta, tb], owner="a").done == [ta] and tb.state == "pending" and eng.holds(dst2) == 1
    assert eng.drain([ta]).done == []  # drained already: nothing to wait for, no error
    other = TransferEngine("cpu")
    buf = torch.zeros(100, dtype=torch.uint8)
    foreign = other.submit(buf[:50], buf[50:], owner="a")
    other.drain([foreign])
    assert eng.drain([foreign]).done == []  # a finished ticket of another engine holds nothing here
    pending_foreign = other.submit(buf[:50], buf[50:], owner="a")
    with pytest.raises(TransferArgumentError, match="not a ticket of this engine"):  # checked after a skip too
        eng.drain([ta, pending_foreign])
    other.drain([pending_foreign])
    assert eng.drain(owner="a").done == [] and eng.drain(owner="b").done == [tb] and eng.drain().done == []
    other.close()
    eng.close()


def test_drain_with_a_deadline_waits_for_a_copy_that_finishes_before_it():
    gate = ChunkGate()
    # The copy is held at the gate until drain first asks whether it has finished: it is still running then.
    plan = _Hooked(lambda n: gate.open() if n == 1 else None, chunk_bytes=CHUNK)
    eng = TransferEngine("cpu", plan, gate=gate)
    src, dst = bufs()
    t = eng.submit(src, dst, owner="a")
    r = eng.drain([t], timeout=30)
    assert r.done == [t] and plan.checks >= 1 and torch.equal(dst, src) and eng.live_holds() == 0
    eng.close()


def test_release_names_every_pending_holder_in_id_order():
    eng, gate = gated()
    src, dst1 = bufs()
    dst2 = torch.empty_like(dst1)
    t1 = eng.submit(src, dst1, owner="a")
    t2 = eng.submit(src, dst2, owner="b")
    with pytest.raises(BufferHeldError, match="held by 2 hold") as ei:
        eng.release(src)
    assert ei.value.pending == [t1, t2] and eng.holds(src[:1]) == 2 and eng.holds(dst1[-1:]) == 1
    assert eng.pending() == [t1, t2] and eng.pending("b") == [t2]
    gate.open()
    eng.drain()
    eng.close()


def test_close_with_a_timeout_refuses_while_a_copy_runs_and_keeps_the_engine_open():
    eng, gate = gated()
    src, dst = bufs()
    t = eng.submit(src, dst, owner="a")
    outcome = []

    def close_briefly():
        try:
            eng.close(timeout=0.05)
            outcome.append("closed")
        except DrainTimeoutError:
            outcome.append("timed out")

    closer = threading.Thread(target=close_briefly)
    closer.start()
    closer.join(10)
    if closer.is_alive():  # let the copy finish so the test ends, then fail
        gate.open()
        closer.join()
        pytest.fail("close(timeout=0.05) did not pass its timeout to the drain")
    assert outcome == ["timed out"]
    t2 = eng.submit(src, torch.empty_like(dst), owner="a")  # still open: the close did not happen
    gate.open()
    eng.close(timeout=30)
    assert t.state == t2.state == "done" and eng.live_holds() == 0 and eng._worker is None
    with pytest.raises(EngineClosedError):
        eng.submit(src, dst, owner="a")
    eng.close()  # closing again is harmless
    with eng:
        pass


# -- submit: what a ticket records, chunking, producers ---------------------------------------------------------
def test_ticket_records_bytes_route_and_chunk_count():
    eng = TransferEngine("cpu")
    src = torch.arange(1024, dtype=torch.float32)
    dst = torch.zeros(4096, dtype=torch.uint8)  # same bytes, another dtype: the copy is bytewise
    t = eng.submit(src, dst, owner="r9")
    assert (t.owner, t.nbytes, t.route, t.chunks_total) == ("r9", 4096, "cpu->cpu", 1)
    eng.drain([t])
    assert t.chunks_done == 1 and torch.equal(dst.view(torch.float32), src)
    back = torch.zeros(1024, dtype=torch.float32)
    eng.drain([eng.submit(dst, back, owner="r9")])  # and back: byte counts, not element counts, must match
    assert torch.equal(back, src)
    eng.close()


def test_default_engine_copies_on_cpu_with_a_worker_that_never_keeps_the_process_alive():
    eng = TransferEngine()
    assert eng.device == torch.device("cpu")
    src, dst = bufs()
    t = eng.submit(src, dst, owner="a")
    assert eng._worker.daemon  # an engine left unclosed must not block interpreter exit
    eng.drain([t])
    eng.close()
    if not torch.cuda.is_available():  # a cuda engine is a known device kind, refused for want of a GPU
        with pytest.raises(TransferArgumentError, match="needs a CUDA device"):
            TransferEngine("cuda")


@pytest.mark.parametrize("n, chunks", [(N, 16), (N + 100, 17), (CHUNK - 1, 1), (1, 1), (0, 1)])
def test_chunked_copy_covers_every_byte_once(n, chunks):
    eng, gate = gated()
    src, dst = bufs(n)
    t = eng.submit(src, dst, owner="a")
    assert t.chunks_total == chunks
    gate.open()
    assert eng.drain([t]).done == [t] and t.chunks_done == chunks and torch.equal(dst, src)
    eng.close()


def test_without_faults_or_gate_a_copy_is_one_piece_of_any_size():
    eng = TransferEngine("cpu")
    src, dst = bufs(3 << 20)  # larger than the default chunk size, which applies only with faults or a gate
    one_src, one_dst = bufs(1)
    ts = [eng.submit(src, dst, owner="a"), eng.submit(one_src, one_dst, owner="a")]
    assert [t.chunks_total for t in ts] == [1, 1]
    assert eng.drain(ts).done == ts and torch.equal(dst, src) and torch.equal(one_dst, one_src)
    eng.close()


def test_one_byte_chunks_are_allowed():
    eng = TransferEngine("cpu", FaultPlan(chunk_bytes=1))
    src, dst = bufs(8)
    t = eng.submit(src, dst, owner="a")
    assert t.chunks_total == 8 and eng.drain([t]).done == [t] and t.chunks_done == 8 and torch.equal(dst, src)
    eng.close()


def test_a_chunk_fault_without_a_gate_still_copies_in_chunks():
    eng = TransferEngine("cpu", FaultPlan(chunk_bytes=CHUNK, fail_copy_at_chunk=5))
    src, dst = bufs()
    t = eng.submit(src, dst, owner="a")
    assert t.chunks_total == 16
    r = eng.drain([t])
    assert r.failed == [t] and t.chunks_done == 5 and bool((dst[5 * CHUNK:] == POISON).all())
    assert t.error == "TransferError: copy failed at chunk 5 (injected fault)"  # the copy's own error, typed
    eng.close()


def test_a_copy_after_another_engines_ticket_reads_what_that_copy_wrote():
    first, gate = gated()
    second = TransferEngine("cpu")
    a, b = bufs()
    c = torch.zeros(N, dtype=torch.uint8)
    t1 = first.submit(a, b, owner="p")
    t2 = second.submit(b, c, owner="q", after=t1)  # b is t1's destination: wait for t1 to stop
    assert not t2._stopped.wait(0.05)
    gate.open()
    second.drain([t2])
    assert torch.equal(c, a) and t1._stopped.is_set()
    first.drain([t1])
    first.close()
    second.close()


def test_more_submit_argument_errors():
    eng = TransferEngine("cpu")
    buf = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(TransferArgumentError, match="owner"):
        eng.submit(buf[:50], buf[50:], owner=7)
    with pytest.raises(TransferArgumentError, match="src is on unsupported device"):  # names the culprit
        eng.submit(torch.zeros(50, dtype=torch.uint8, device="meta"), buf[50:], owner="r")
    with pytest.raises(TransferArgumentError, match="dst is on unsupported device"):
        eng.submit(buf[50:], torch.zeros(50, dtype=torch.uint8, device="meta"), owner="r")
    zero = TransferEngine("cpu", FaultPlan(chunk_bytes=0))
    with pytest.raises(TransferArgumentError, match="chunk_bytes"):
        zero.submit(buf[:50], buf[50:], owner="r")
    assert eng.live_holds() == zero.live_holds() == 0 and eng.pending() == zero.pending() == []
    empty = eng.submit(buf[:0], buf[0:0], owner="r")  # zero bytes never overlap
    assert eng.drain([empty]).done == [empty]
    zero.close()
    eng.close()


def test_a_submit_that_cannot_enqueue_leaves_no_ticket_and_no_holds():
    eng = TransferEngine("cpu")
    src, dst = bufs()

    def refuse(job):
        raise RuntimeError("queue gone")

    eng._enqueue = refuse
    with pytest.raises(TransferError, match="could not enqueue") as ei:
        eng.submit(src, dst, owner="a")
    assert not isinstance(ei.value, SubmitError) and ei.value.pending == []
    assert eng.live_holds() == 0 and eng.pending() == []
    eng.release(dst)
    eng.close()


def test_kill_fault_requests_sigkill_of_this_process_after_exactly_n_chunks(monkeypatch):
    # In process, the SIGKILL is intercepted (it would end the test run): the fault must aim it at this very
    # process after the n-th chunk, and nothing more may be copied.
    kills = []

    def fake_kill(pid, sig):
        kills.append((pid, sig))
        raise RuntimeError("killed (intercepted)")

    monkeypatch.setattr(os, "kill", fake_kill)
    eng, gate = gated(kill_after_chunks=3)
    src, dst = bufs()
    t = eng.submit(src, dst, owner="a")
    gate.open()
    r = eng.drain([t])
    assert kills == [(os.getpid(), signal.SIGKILL)] and r.failed == [t] and t.chunks_done == 3
    assert torch.equal(dst[:3 * CHUNK], src[:3 * CHUNK]) and bool((dst[3 * CHUNK:] == POISON).all())
    monkeypatch.undo()
    eng.close()


# -- shared memory in process: ledger slots and views -------------------------------------------------------------
def _close_when_unreferenced(seg, limit=10.0):
    import time

    t0 = time.monotonic()
    while True:  # an observed state (the mapping can be closed) with a failing deadline
        try:
            seg.close()
            return
        except shm.SegmentBusyError:
            assert time.monotonic() - t0 < limit, "a view of the segment stayed alive after its copy drained"
            time.sleep(0.001)


def test_ledger_publishes_each_hold_by_segment_range_until_its_drain():
    ledger = SharedLedger.create(slots=8)
    seg = shm.Segment.create(2 * N)
    gate = ChunkGate()
    eng = TransferEngine("cpu", FaultPlan(chunk_bytes=CHUNK), gate=gate, ledger=ledger)
    src = seg.tensor(torch.uint8, (N,))
    dst = seg.tensor(torch.uint8, (N,), N)
    src.copy_(pattern())
    t = eng.submit(src[CHUNK:], dst[:N - CHUNK], owner="a")
    plain = eng.submit(pattern(), torch.empty(N, dtype=torch.uint8), owner="b")  # not shared memory: no slots
    held = sorted(ledger.holds(pid=os.getpid()), key=lambda h: h.role)
    assert [(h.role, h.ticket_id, h.tag, h.start, h.end) for h in held] == [
        ("dst", t.id, seg.tag, N, 2 * N - CHUNK), ("src", t.id, seg.tag, CHUNK, N)]
    assert len(t._ledger_slots) == 2 and plain._ledger_slots == []
    gate.open()
    eng.drain()
    assert ledger.holds(pid=os.getpid()) == [] and t._ledger_slots == []
    assert torch.equal(dst[:N - CHUNK], pattern()[CHUNK:])
    last = seg.tensor(torch.uint8, (1,), 2 * N - 1)  # one byte at the very end of the segment is held too
    t1 = eng.submit(src[:1], last, owner="c")
    assert sorted((h.role, h.start, h.end) for h in ledger.holds(pid=os.getpid())) == [
        ("dst", 2 * N - 1, 2 * N), ("src", 0, 1)]
    eng.drain([t1])
    assert ledger.live() == 0
    eng.close()
    del src, dst, last
    _close_when_unreferenced(seg)
    ledger.close()


def test_the_worker_keeps_no_view_of_drained_memory():
    # A view kept by the engine after its drain would stop the owner from unmapping memory it may reuse.
    seg = shm.Segment.create(2 * N)
    eng = TransferEngine("cpu")
    src, dst = seg.tensor(torch.uint8, (N,)), seg.tensor(torch.uint8, (N,), N)
    eng.drain([eng.submit(src, dst, owner="a")])
    del src, dst
    _close_when_unreferenced(seg)  # no further copy arrives to displace the last job
    eng.close()


def test_a_submit_refused_for_a_full_ledger_leaves_no_holds_behind():
    # Regression: the refusal came after the holds went on; nothing could drain them (no ticket was returned),
    # so the buffers could never be released.
    ledger = SharedLedger.create(slots=1)  # room for the source's slot only
    seg = shm.Segment.create(2 * N)
    eng = TransferEngine("cpu", ledger=ledger)
    src, dst = seg.tensor(torch.uint8, (N,)), seg.tensor(torch.uint8, (N,), N)
    with pytest.raises(TransferArgumentError, match="ledger full"):
        eng.submit(src, dst, owner="a")
    assert eng.live_holds() == 0 and ledger.live() == 0 and eng.pending() == []
    eng.release(src)
    eng.release(dst)
    t = eng.submit(src[:1], pattern(1), owner="a")  # the ledger slot is free again
    eng.drain([t])
    eng.close()
    del src, dst
    _close_when_unreferenced(seg)
    ledger.close()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("busy", ["copy", "default"])
def test_cuda_drain_waits_until_the_copy_itself_ran(chunked, busy):
    # GPU work queued ahead on one stream delays whatever is queued behind it there. Busy copy stream: the copy
    # runs late, so a completion event recorded anywhere but after it on that stream (or none: "all chunks
    # issued") lets drain drop the holds before the DMA ran. Busy default stream: chunks issued off the copy
    # stream would run late while its event completes at once. Either way the destination would be poison.
    g = ChunkGate() if chunked else None
    eng = TransferEngine("cuda", FaultPlan(chunk_bytes=1 << 20) if chunked else None, gate=g)
    src = pattern(8 << 20).cuda()
    dst = torch.full((8 << 20,), POISON, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    if busy == "copy":
        with torch.cuda.stream(eng._stream):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the copy
        t = eng.submit(src, dst, owner="g")
    else:
        torch.cuda._sleep(1_000_000_000)  # on the default stream
        t = eng.submit(src, dst, owner="g", after=torch.cuda.Stream())  # the producer: an idle stream
    if g is not None:
        g.open()
    r = eng.drain([t])
    assert r.done == [t] and t._event is not None and t._event.query()
    assert torch.equal(dst, pattern(8 << 20)) and eng.live_holds() == 0
    eng.close()
    torch.cuda.synchronize()


def test_gate_opened_for_good_is_seen_without_taking_a_token():
    g = ChunkGate()
    reader = ChunkGate.from_read_fd(g.read_fd)
    assert not reader.opened_for_good()
    g.allow(2)
    assert not reader.opened_for_good()         # tokens granted, the controller still holds the write end
    assert reader.wait(0) and not reader._open  # a token is still there to take: polling took none
    g.open()
    assert reader.opened_for_good()              # one token left, but nothing can follow it but the open gate
    assert reader.wait(0) and reader.wait(0)


def test_a_gate_paces_copies_until_it_is_opened_for_good_then_copies_run_whole():
    """A copy submitted while the gate paces goes chunk by chunk; one submitted after the controller opened the
    gate for good runs whole, as without a gate (the service after ServiceSide.unpace); a chunk fault still
    chunks through an open gate."""
    eng, gate = gated()
    src, dst = bufs()
    paced = eng.submit(src, dst, owner="a")
    assert paced.chunks_total == N // CHUNK
    gate.allow(2)
    wait_chunks(paced, 2)
    assert paced.state == "pending" and paced.chunks_done == 2
    gate.open()
    assert eng.drain([paced]).done == [paced] and torch.equal(dst, src)
    src2, dst2 = bufs()
    whole = eng.submit(src2, dst2, owner="a")
    assert whole.chunks_total == 1 and eng.drain([whole]).done == [whole] and torch.equal(dst2, src2)
    eng.close()
    faulty, gate = gated(fail_copy_at_chunk=2)
    gate.open()
    src3, dst3 = bufs()
    t = faulty.submit(src3, dst3, owner="a")
    assert t.chunks_total == N // CHUNK
    assert faulty.drain([t]).failed == [t] and t.chunks_done == 2
    faulty.close()


# --- submit_many: submit() of every pair as one batch --------------------------------------------------------

def _pairs(n_pairs, size=CHUNK):
    src = pattern(n_pairs * size)
    dst = torch.full((n_pairs * size,), POISON, dtype=torch.uint8)
    return src, dst, [(src[i * size:(i + 1) * size], dst[i * size:(i + 1) * size]) for i in range(n_pairs)]


def test_submit_many_copies_every_pair_with_a_ticket_and_holds_each():
    eng = TransferEngine("cpu")
    src, dst, pairs = _pairs(5)
    tickets = eng.submit_many(pairs, owner="m")
    assert [t.nbytes for t in tickets] == [CHUNK] * 5 and len({t.id for t in tickets}) == 5
    assert all(t.owner == "m" for t in tickets)
    r = eng.drain(owner="m")
    assert sorted(t.id for t in r.done) == sorted(t.id for t in tickets) and r.holds_released == 10
    assert torch.equal(dst, src) and eng.live_holds() == 0
    eng.close()


def test_submit_many_refused_at_pair_k_keeps_the_pairs_before_it_accepted_and_issued():
    eng = TransferEngine("cpu")
    src, dst, pairs = _pairs(4)
    pairs[2] = (pairs[2][0], pairs[2][1][:-1])            # one byte short: refused before anything of it is held
    with pytest.raises(TransferArgumentError) as e:
        eng.submit_many(pairs, owner="m")
    assert [t.nbytes for t in e.value.accepted] == [CHUNK, CHUNK]
    assert eng.pending(owner="m") == e.value.accepted     # pairs 0 and 1 accepted, nothing of 2 and 3
    eng.drain(owner="m")
    assert torch.equal(dst[:2 * CHUNK], src[:2 * CHUNK]) and bool((dst[2 * CHUNK:] == POISON).all())
    assert eng.live_holds() == 0
    eng.close()


def test_submit_many_injected_submit_error_names_the_failed_pair_pending_and_the_earlier_accepted():
    g = ChunkGate()
    eng = TransferEngine("cpu", FaultPlan(chunk_bytes=CHUNK), gate=g)
    src, dst, pairs = _pairs(3)
    eng.submit(pattern(CHUNK), torch.empty(CHUNK, dtype=torch.uint8), owner="other")   # a submit before the batch
    eng.faults.fail_after_submit = 1
    g.open()
    with pytest.raises(SubmitError) as e:
        eng.submit_many(pairs, owner="m")
    assert e.value.accepted == [] and len(e.value.pending) == 1 and e.value.pending[0].owner == "m"
    eng.drain()
    assert torch.equal(dst[:CHUNK], src[:CHUNK]) and bool((dst[CHUNK:] == POISON).all())   # pair 0 ran out
    eng.close()


def test_submit_many_goes_through_an_overridden_submit_pair_by_pair():
    calls = []

    class Counting(TransferEngine):
        def submit(self, *args, **kwargs):
            calls.append(kwargs["owner"])
            if len(calls) == 3:
                raise TransferArgumentError("refused by the override")
            return super().submit(*args, **kwargs)

    eng = Counting("cpu")
    src, dst, pairs = _pairs(4)
    with pytest.raises(TransferArgumentError, match="override") as e:
        eng.submit_many(pairs, owner="m")
    assert calls == ["m"] * 3 and len(e.value.accepted) == 2
    eng.drain(owner="m")
    assert torch.equal(dst[:2 * CHUNK], src[:2 * CHUNK]) and eng.live_holds() == 0
    eng.close()


def test_submit_many_joins_adjacent_pairs_into_one_ticket_per_run():
    eng = TransferEngine("cpu")
    src, dst, pairs = _pairs(5)
    tickets = eng.submit_many(pairs, owner="m", join_adjacent=True)
    assert len(tickets) == 5 and len({id(t) for t in tickets}) == 1 and tickets[0].nbytes == 5 * CHUNK
    assert eng.live_holds() == 2 and eng.holds(src[4 * CHUNK:]) == 1 and eng.holds(dst[:1]) == 1
    r = eng.drain(owner="m")
    assert r.done == tickets[:1] and r.holds_released == 2 and torch.equal(dst, src)
    # runs end at a gap in the source, a change of owner, and where the joined spans would overlap
    src, dst, pairs = _pairs(6)
    pairs[2] = (src[2 * CHUNK + 1:3 * CHUNK + 1], dst[2 * CHUNK:3 * CHUNK])       # the source skips a byte
    buf = pattern(4 * CHUNK)
    shifted = [(buf[:CHUNK], buf[CHUNK:2 * CHUNK]), (buf[CHUNK:2 * CHUNK], buf[2 * CHUNK:3 * CHUNK])]
    owners = ["a", "a", "a", "a", "b", "b", "c", "c"]
    tickets = eng.submit_many(pairs + shifted, owners=owners, join_adjacent=True)
    runs = [[i for i, t in enumerate(tickets) if t is u] for u in dict.fromkeys(tickets)]
    assert runs == [[0, 1], [2], [3], [4, 5], [6], [7]]
    assert [t.owner for t in dict.fromkeys(tickets)] == ["a", "a", "a", "b", "c", "c"]
    eng.drain()
    assert torch.equal(dst[:2 * CHUNK], src[:2 * CHUNK]) and eng.live_holds() == 0
    # adjacent addresses in two storages (views of one bytearray): never one view, so never one copy
    raw = bytearray(pattern(4 * CHUNK).numpy().tobytes())
    parts = [torch.frombuffer(memoryview(raw)[i * CHUNK:(i + 1) * CHUNK], dtype=torch.uint8) for i in range(4)]
    assert parts[0].data_ptr() + CHUNK == parts[1].data_ptr()
    out = torch.zeros(4 * CHUNK, dtype=torch.uint8)
    tickets = eng.submit_many([(parts[i], out[i * CHUNK:(i + 1) * CHUNK]) for i in range(4)], owner="s",
                              join_adjacent=True)
    assert len({id(t) for t in tickets}) == 4
    eng.drain()
    assert torch.equal(out, pattern(4 * CHUNK))
    eng.close()


def test_submit_many_joined_refused_at_pair_k_accepts_the_runs_before_it():
    eng = TransferEngine("cpu")
    src, dst, pairs = _pairs(4)
    pairs[2] = (pairs[2][0], pairs[2][1][:-1])
    with pytest.raises(TransferArgumentError) as e:
        eng.submit_many(pairs, owner="m", join_adjacent=True)
    accepted = e.value.accepted
    assert len(accepted) == 2 and accepted[0] is accepted[1] and accepted[0].nbytes == 2 * CHUNK
    assert eng.pending(owner="m") == accepted[:1]
    eng.drain(owner="m")
    assert torch.equal(dst[:2 * CHUNK], src[:2 * CHUNK]) and bool((dst[2 * CHUNK:] == POISON).all())
    with pytest.raises(TransferArgumentError, match="owner"):
        eng.submit_many(_pairs(2)[2], owners=["m", ""], join_adjacent=True)
    eng.drain()
    assert eng.live_holds() == 0
    eng.close()


def test_submit_many_does_not_join_where_a_fault_is_planned_per_copy():
    eng = TransferEngine("cpu", FaultPlan(fail_after_submit=1), gate=ChunkGate())
    eng.gate.open()
    src, dst, pairs = _pairs(3)
    with pytest.raises(SubmitError) as e:
        eng.submit_many(pairs, owner="m", join_adjacent=True)
    assert e.value.accepted == [] and e.value.pending[0].nbytes == CHUNK    # pair 0 alone, as without joining
    eng.drain()
    eng.close()


def test_hold_table_drops_one_tickets_holds_and_counts_the_rest():
    from kmesh.transfer.holds import Hold, HoldTable, Span

    table = HoldTable()
    for tid in (1, 2, 3):
        table.add(Hold(tid, "src", Span("cpu", tid * 100, tid * 100 + 50)))
        table.add(Hold(tid, "dst", Span("cpu", 1000 + tid * 100, 1000 + tid * 100 + 50)))
    assert len(table) == 6
    assert {h.role for h in table.drop_ticket(2)} == {"src", "dst"} and len(table) == 4
    assert table.drop_ticket(2) == [] and len(table) == 4
    assert [h.ticket_id for h in table.over(Span("cpu", 0, 10_000))] == [1, 1, 3, 3]
    assert table.over(Span("cpu", 200, 250)) == [] and len(table.over(Span("cuda:0", 100, 150))) == 0
    table.add_pair(Hold(4, "src", Span("cpu", 0, 8)), Hold(4, "dst", Span("cpu", 8, 16)))
    assert len(table) == 6 and {h.role for h in table.drop_ticket(4)} == {"src", "dst"} and len(table) == 4
    with pytest.raises(ValueError, match="one ticket"):
        table.add_pair(Hold(5, "src", Span("cpu", 0, 8)), Hold(6, "dst", Span("cpu", 8, 16)))
    assert len(table) == 4


@pytest.mark.gpu
@cuda
def test_cuda_submit_many_waits_for_the_producer_once_and_every_ticket_for_its_copy():
    # the producer (the default stream) is busy when the batch is submitted: a copy issued without waiting for it
    # would read the source before the producer's write; a ticket finished before its own copy would drain early
    eng = TransferEngine("cuda")
    n, size = 6, 1 << 20
    src = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    dst = torch.full((n * size,), POISON, dtype=torch.uint8).pin_memory()
    want = pattern(n * size).cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)
    src.copy_(want)                                             # written on the default stream, after the sleep
    tickets = eng.submit_many([(src[i * size:(i + 1) * size], dst[i * size:(i + 1) * size]) for i in range(n)],
                              owner="g")
    assert len({id(t._event) for t in tickets}) == 1           # one event after the last copy
    r = eng.drain(tickets[:1])
    assert r.done == tickets[:1] and torch.equal(dst, pattern(n * size))
    eng.drain(owner="g")
    assert eng.live_holds() == 0
    # joined: one ticket for the six, issued after the producer's write as well
    dst.fill_(POISON)
    torch.cuda._sleep(500_000_000)
    src.copy_(want.flip(0))
    tickets = eng.submit_many([(src[i * size:(i + 1) * size], dst[i * size:(i + 1) * size]) for i in range(n)],
                              owner="g", join_adjacent=True)
    assert len({id(t) for t in tickets}) == 1 and tickets[0].nbytes == n * size
    eng.drain(owner="g")
    assert torch.equal(dst, pattern(n * size).flip(0)) and eng.live_holds() == 0
    eng.close()
    torch.cuda.synchronize()


def test_coalesced_joins_pairs_that_continue_each_other_in_both_storages_and_nothing_else():
    from kmesh.transfer.engine import coalesced

    src, dst = pattern(64), torch.zeros(64, dtype=torch.uint8)
    other = torch.zeros(64, dtype=torch.uint8)
    adjacent = [(src[0:8], dst[0:8]), (src[8:20], dst[8:20]), (src[20:24], dst[20:24])]
    (one,) = coalesced(adjacent)
    assert one[0].data_ptr() == src.data_ptr() and one[0].numel() == 24 and one[1].data_ptr() == dst.data_ptr()
    gap = [(src[0:8], dst[0:8]), (src[9:12], dst[8:11])]                 # the source skips a byte
    assert [p[0].numel() for p in coalesced(gap)] == [8, 3]
    elsewhere = [(src[0:8], dst[0:8]), (src[8:16], other[8:16])]        # another destination storage
    assert len(coalesced(elsewhere)) == 2
    backwards = [(src[8:16], dst[8:16]), (src[0:8], dst[0:8])]          # in order, but not continuing
    assert len(coalesced(backwards)) == 2
    # a shift by one span inside one buffer: joined, the source would overlap the destination; kept apart
    buf = pattern(32)
    shifted = [(buf[0:4], buf[4:8]), (buf[4:8], buf[8:12])]
    assert len(coalesced(shifted)) == 2
    assert coalesced([]) == []
    assert [p[0].numel() for p in coalesced([(src[0:0], dst[0:0]), (src[0:4], dst[0:4])])] == [4]
    for a, b in coalesced(adjacent):                                      # what the joined copy does is the same
        b.copy_(a)
    assert torch.equal(dst[:24], src[:24])


def test_drain_asks_a_shared_event_once_and_a_failed_check_keeps_every_hold():
    eng = TransferEngine("cpu")
    calls = []

    class FakeEvent:
        def query(self):
            calls.append(1)
            return True

    src, dst, pairs = _pairs(3)
    for round_ in range(2):
        tickets = eng.submit_many(pairs, owner="e")
        shared = FakeEvent()
        for t in tickets:
            t._stopped.wait(5)
            t._event = shared
        if round_ == 1:
            eng.faults.fail_completion_check = 1      # the first ticket's check fails: nothing is released
            with pytest.raises(CompletionCheckError):
                eng.drain(tickets)
            assert eng.live_holds() == 6 and len(eng.pending()) == 3
        eng.drain(tickets)
        assert len(calls) == round_ + 1 and eng.live_holds() == 0
    eng.close()
