"""An internal error in one client's work is contained (issue 8 item 3), across real processes.

The service is started with deliberate faults (opt-in negative controls, server.FAULTS): collecting a
finished copy whose key starts with b"kmesh-fault:" raises, and the periodic tick raises while a live client
named "kmesh-fault:tick" exists. Other clients must be served throughout (copies complete, waits answer,
heartbeat loss is still seen, registrations release), the faulty client's registration must still drain and
release (never stranded in closing), and every internal error must be counted.
"""
from __future__ import annotations

import time

import pytest

from kmesh.harness.service import Harness
from kmesh.harness.worker import pattern, sha
from kmesh.service import descriptor
from kmesh.service.errors import ObjectMissingError, WaitTimeoutError

LAYOUT = descriptor.example(num_blocks=2)
N = descriptor.nbytes(LAYOUT)


def _registered(h: Harness, name: str, seed: int):
    w = h.worker(name=name)
    w.call("alloc", name="kv", nbytes=N, seed=seed)
    return w, w.call("register", name="kv", alloc_id=1, generation=1, layout=LAYOUT)


@pytest.mark.timeout(120)
def test_faults_in_collect_and_tick_are_contained(tmp_path) -> None:
    with Harness(heartbeat_timeout_s=1.0, log_dir=tmp_path, faults=["collect_raises", "tick_raises"]) as h:
        a, ra = h.worker_with_original(None, b"bystander", LAYOUT, N, seed=5, name="bystander")
        f, rf = _registered(h, "faulty", seed=6)

        # 1. a copy whose collect step raises, finishing next to an ordinary one
        fs = f.call("save", reg=rf["reg"], key=b"kmesh-fault:save", offset=0, nbytes=N)
        h.accepted(N)
        a.call("fill", name="kv", seed=7, n=N)
        al = a.call("load", reg=ra["reg"], key=b"bystander", offset=0)
        h.accepted(N)
        h.finish()
        assert a.call("wait", req=al, timeout=10)["state"] == "done"
        assert a.call("digest", name="kv") == sha(pattern(5, N))
        got = f.call("wait", req=fs, timeout=10)  # answered, not left running forever
        assert got["state"] == "failed" and "internal" in got["error"], got
        with pytest.raises(ObjectMissingError):  # the failed save never became an original
            f.call("load", reg=rf["reg"], key=b"kmesh-fault:save", offset=0)
        st = h.status()
        assert st["reservations"] == 0 and st["store"]["pins"] == 0 and h.reg(rf["reg"], st)["in_flight"] == []
        f.call("close", reg=rf["reg"])
        h.wait_released(rf["reg"])  # drained and released, not stranded in closing

        # 2. a tick that raises while a client named kmesh-fault:tick lives
        errors_before = h.status()["stats"]["internal_errors"]
        t, rt = _registered(h, "kmesh-fault:tick", seed=8)
        s, rs = _registered(h, "silent", seed=9)
        time.sleep(0.3)  # several ticks
        assert h.service.alive()
        s.call("pause_heartbeats")  # heartbeat loss of another client is still seen
        st = h.wait_until("the silent client's heartbeat loss", lambda st: h.reg(rs["reg"], st)["state"] != "active")
        assert h.reg(rs["reg"], st)["reason"] == "heartbeat lost"
        al2 = a.call("load", reg=ra["reg"], key=b"bystander", offset=0)
        h.accepted(N)
        with pytest.raises(WaitTimeoutError):  # a parked wait is answered at its deadline (by the tick)
            a.call("wait", req=al2, timeout=0.5)
        h.finish()
        assert a.call("wait", req=al2, timeout=10)["state"] == "done"
        t.call("close", reg=rt["reg"])
        h.wait_released(rt["reg"])  # the faulty client's registration releases too
        h.wait_released(rs["reg"])
        t.exit()
        st = h.status()
        assert st["stats"]["internal_errors"] > errors_before >= 1, st["stats"]
        assert st["violations"] == [] and st["stats"]["stale_uses"] == 0
        a.call("close", reg=ra["reg"])
        h.wait_released(ra["reg"])
        for w in (a, f, s):
            w.exit()
        st = h.wait_until("everything released", lambda st: not st["registrations"])
        assert h.no_leaks(st), h.leaks(st)
    log = (tmp_path / "service.log").read_text()
    assert "FAULTS INJECTED" in log and "injected fault collect_raises" in log and "injected fault tick_raises" in log


@pytest.mark.timeout(60)
def test_fault_names_are_inert_without_the_fault_flags(tmp_path) -> None:
    """The faults are opt-in: without --fault, the trigger names are ordinary names and keys."""
    with Harness(heartbeat_timeout_s=5.0, log_dir=tmp_path) as h:
        t, rt = _registered(h, "kmesh-fault:tick", seed=3)
        req = t.call("save", reg=rt["reg"], key=b"kmesh-fault:save", offset=0, nbytes=N)
        h.accepted(N)
        h.finish()
        assert t.call("wait", req=req)["state"] == "done"
        time.sleep(0.3)  # several ticks with that client alive
        st = h.status()
        assert st["stats"]["internal_errors"] == 0 and any(o["key"] == b"kmesh-fault:save"
                                                             for o in st["store"]["objects"])
        t.call("close", reg=rt["reg"])
        h.wait_released(rt["reg"])
        t.exit()
    assert "FAULTS INJECTED" not in (tmp_path / "service.log").read_text()
