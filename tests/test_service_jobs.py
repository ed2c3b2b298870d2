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
