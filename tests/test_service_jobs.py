"""kmesh.service.jobs.CopyRunner's count of copies in flight: what bounds new requests (max_jobs) and what status
reports, kept from the lanes' own counts (handed over, not yet collected) rather than a scan of every kept job."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kmesh.service.errors import CapacityError
from kmesh.service.jobs import CopyJob, CopyRunner
from kmesh.transfer.faults import ChunkGate


def _start(runner: CopyRunner, n: int = 8) -> CopyJob:
    job = CopyJob(runner.new_id(), 1, "load", SimpleNamespace(reg_id=1), SimpleNamespace(key=b"k"), 0, n)
    runner.start(job, torch.arange(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8))
    return job


def _collect(runner: CopyRunner, n: int) -> list[CopyJob]:
    """What the server's collect does with finished jobs: each one made terminal."""
    done: list[CopyJob] = []
    deadline = time.monotonic() + 10
    while len(done) < n:
        assert time.monotonic() < deadline, "copies did not drain"
        got = runner.finished()
        for job in got:
            job.state = "done"
        done += got
        time.sleep(0.001)
    return done


def test_copies_in_flight_bound_new_requests_and_finished_ones_do_not():
    gate = ChunkGate()
    runner = CopyRunner(chunk_bytes=4, gate_fd=gate.read_fd, max_jobs=2)
    try:
        paced = [_start(runner), _start(runner)]      # the gate paces: both stay in flight
        assert runner.running() == 2 == sum(not j.terminal for j in runner.jobs.values())
        with pytest.raises(CapacityError, match="2 copies in flight, limit 2"):
            runner.new_id()
        gate.open()
        assert set(_collect(runner, 2)) == set(paced)
        assert runner.running() == 0
        for _ in range(5):                              # kept finished jobs (trimmed at max_jobs) count for nothing
            _collect(runner, len([_start(runner)]))
        assert runner.running() == 0 and len(runner.jobs) == 2
        third = _start(runner)
        assert runner.running() == 1 and not third.terminal
        _collect(runner, 1)
        assert runner.running() == 0
    finally:
        gate.open()
        runner.close()      # closes the gate's read end it was given


def _prepared(runner: CopyRunner, n: int = 8, pending: int = 0):
    job = CopyJob(runner.new_id(pending=pending), 1, "load", SimpleNamespace(reg_id=1), SimpleNamespace(key=b"k"), 0, n)
    return job, torch.arange(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)


def test_start_many_starts_every_item_as_start_does_and_pending_ones_count_against_the_limit():
    runner = CopyRunner(chunk_bytes=4, max_jobs=3)
    try:
        items = [_prepared(runner, pending=k) for k in range(3)]
        with pytest.raises(CapacityError, match="3 copies in flight, limit 3"):
            runner.new_id(pending=3)                     # three prepared, none started yet
        assert runner.start_many(items) is None
        assert runner.running() == 3 and list(runner.jobs) == [job.req_id for job, _, _ in items]
        assert all(job.ticket is not None and job.lane is not None and job.error is None for job, _, _ in items)
        assert set(_collect(runner, 3)) == {job for job, _, _ in items}
        assert all(torch.equal(dst, src) for _, src, dst in items)
    finally:
        runner.close()


def test_start_many_a_refused_item_ends_the_run_and_an_accepted_then_failed_one_is_kept_with_its_error():
    from kmesh.transfer import TransferArgumentError

    runner = CopyRunner(chunk_bytes=4)
    try:
        items = [_prepared(runner) for _ in range(4)]
        job2, src2, _ = items[2]
        items[2] = (job2, src2, torch.zeros(5, dtype=torch.uint8))           # sizes differ: not accepted
        failure = runner.start_many(items)
        assert isinstance(failure, TransferArgumentError)
        assert [job.ticket is not None for job, _, _ in items] == [True, True, False, False]
        assert runner.running() == 2 and set(_collect(runner, 2)) == {items[0][0], items[1][0]}

        items = [_prepared(runner) for _ in range(3)]
        lane = runner._lane(torch.device("cpu"))
        lane.engine.faults.fail_after_submit = 0
        calls = {"n": 0}
        real_take = lane.engine.faults.take

        def take(name):                                   # the second copy accepted, then failing (SubmitError)
            if name == "fail_after_submit":
                calls["n"] += 1
                return calls["n"] == 2
            return real_take(name)

        lane.engine.faults.take = take
        assert runner.start_many(items) is None
        assert [job.ticket is not None for job, _, _ in items] == [True, True, True]
        assert [job.error is not None for job, _, _ in items] == [False, True, False]
        assert runner.running() == 3 and len(_collect(runner, 3)) == 3
    finally:
        runner.close()


def test_put_many_hands_every_item_over_in_order_with_one_wake_up():
    import os

    from kmesh.service.wake import DoneQueue

    q: DoneQueue[int] = DoneQueue()
    try:
        assert q.put_many([3, 1, 2])
        assert os.read(q.wake_r, 16) == b"\0"            # one wake-up for the three
        assert q.take_all() == [3, 1, 2] and q.take_all() == []
    finally:
        q.close()


def test_a_lane_drains_the_jobs_queued_together_and_each_is_collected_once():
    gate = ChunkGate()
    runner = CopyRunner(chunk_bytes=4, gate_fd=gate.read_fd)
    try:
        jobs = [_start(runner) for _ in range(6)]           # paced: queued behind each other on the lane
        assert runner.running() == 6
        gate.open()
        got = _collect(runner, 6)
        assert sorted(j.req_id for j in got) == sorted(j.req_id for j in jobs) and len(got) == 6
        assert all(j.ticket.state == "done" and j.drain_errors == 0 for j in jobs) and runner.running() == 0
    finally:
        gate.open()
        runner.close()
