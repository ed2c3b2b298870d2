"""Stage `ownership` on the CPU profile (real service and client processes), plus a negative control: the
same case against a service with the "no in-flight accounting on close" flaw must fail."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kmesh.harness.service import Harness
from kmesh.result import Result
from kmesh.stages import ownership

EXPECTED = {f"{c}/memfd" for c, _, per_mem in ownership.CASES if per_mem} | \
    {c for c, _, per_mem in ownership.CASES if not per_mem}


def _run_stage(tmp_path, profile: str, timeout: int) -> dict:
    """The stage as a user runs it: its own process (which starts the service and worker processes)."""
    out = tmp_path / "ownership.json"
    run = subprocess.run([sys.executable, "-m", "kmesh", "run", "ownership", "--profile", profile, "--out", str(out),
                          "--set", f"results_dir={tmp_path}"], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


@pytest.mark.covered_by_stage(
    "ownership", "register-use-close/memfd", "private-copies/memfd", "same-address-new-gen/memfd",
    "replacement-same-instance/memfd", "close-in-flight/memfd", "cancel-running-copy/memfd",
    "heartbeat-lost-mid-copy/memfd", "foreign-client/memfd", "sigkill-mid-copy/memfd", "death-seen-by-pidfd",
    "eviction-keeps-pinned")
def test_ownership_stage_passes_across_processes(tmp_path):
    res = _run_stage(tmp_path, "cpu", timeout=300)
    by_id = {c["id"]: c for c in res["cases"]}
    assert set(by_id) == EXPECTED
    for cid, c in by_id.items():
        if cid == "foreign-uid" and c["skipped"]:
            continue
        assert c["passed"] is True, (cid, c["error"], [k for k, v in c["checks"].items() if v["ok"] is False])
    assert res["summary"]["service_pid"] != res["provenance"].get("pid")
    assert all(v == 0 for v in res["summary"]["final_leaks"].values()), res["summary"]["final_leaks"]
    checks = by_id["sigkill-mid-copy/memfd"]["checks"]
    assert checks["closing_not_released"]["ok"]
    assert by_id["death-seen-by-pidfd"]["checks"]["reason_client_died"]["value"] == "client died"
    assert by_id["close-in-flight/memfd"]["checks"]["lifecycle_path"]["value"] == \
        ["registered", "active", "closing", "drained", "released"]
    assert by_id["same-address-new-gen/memfd"]["checks"]["same_address"]["ok"]


def test_negative_control_release_without_drain_is_caught(tmp_path):
    """LMCache 0.5.6's unregister frees without in-flight accounting; with that flaw injected the close-in-flight
    case must fail (and the service's own defence — the engine's holds — still refuses to unmap)."""
    res = Result("ownership", "cpu", {})
    with Harness(log_dir=tmp_path, faults=["ignore_in_flight"]) as h:
        ctx = ownership.Ctx(h)
        with res.case("close-in-flight/memfd-flawed") as c:
            ownership.case_close_in_flight(ctx, c, "memfd")
        st = h.status()
    case = res.cases[0]
    assert case.passed is False
    assert case.checks["close_reply_closing_with_copy"]["ok"] is False  # "drained" with a copy in flight
    assert case.checks["still_mapped_while_copying"]["ok"] is False
    # Defence in depth: the transfer engine still held the buffer, so the unmap was refused and the copy's
    # data still arrived intact; the lifecycle check alone would not have caught the flaw.
    assert case.checks["data_complete"]["ok"] is True
    assert st["counters"]["release_deferred"] >= 1


@pytest.mark.gpu
def test_ownership_stage_cuda_ipc_cases(tmp_path):
    """On a GPU: every case also runs on device memory registered through CUDA IPC between processes."""
    res = _run_stage(tmp_path, "cuda", timeout=600)
    cuda = [c for c in res["cases"] if c["id"].endswith("/cuda")]
    assert len(cuda) == sum(per_mem for _, _, per_mem in ownership.CASES)
    assert all(c["passed"] for c in cuda), [c["id"] for c in cuda if not c["passed"]]


def test_service_cli_start_status_stop(tmp_path):
    """`kmesh service start|status|stop`: a detached service, 0600 socket and admin token, clean shutdown;
    status (an admin op) is refused when the admin token file cannot be read."""
    import os

    rd = tmp_path / "rt"
    env = {**os.environ, "KMESH_RUNTIME_DIR": str(rd)}

    def kmesh(*args):
        return subprocess.run([sys.executable, "-m", "kmesh", "service", *args], capture_output=True, text=True,
                              env=env, timeout=120)

    assert kmesh("status").returncode == 1  # not running yet
    started = kmesh("start")
    assert started.returncode == 0, started.stderr
    try:
        assert (rd / "kmesh.sock").stat().st_mode & 0o777 == 0o600
        assert (rd / "kmesh.admin").stat().st_mode & 0o777 == 0o600
        assert rd.stat().st_mode & 0o777 == 0o700
        token = (rd / "kmesh.admin").read_bytes()
        again = kmesh("start")
        assert again.returncode != 0 and "already listens" in again.stderr
        assert (rd / "kmesh.admin").read_bytes() == token, "a refused second start must not replace the token"
        st = kmesh("status", "--json")
        assert st.returncode == 0 and json.loads(st.stdout)["violations"] == []
        (rd / "kmesh.admin").rename(rd / "hidden")
        try:
            refused = kmesh("status")
        finally:
            (rd / "hidden").rename(rd / "kmesh.admin")
        assert refused.returncode == 1 and "refused" in refused.stdout, refused.stdout + refused.stderr
    finally:
        stopped = kmesh("stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert not (rd / "kmesh.sock").exists() and not (rd / "kmesh.admin").exists()


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_wrongly_accepted_copy_is_accounted_so_later_cases_do_not_time_out(tmp_path, monkeypatch):
    """If the service wrongly accepts a copy that a case expects refused, the case must fail on that check and
    the gate's token accounting must still cover the copy: the next case must pass, not time out. Emulated
    here by turning the foreign client's load into a load into its own registration (which is accepted)."""
    from kmesh.harness.worker import Worker

    orig = Worker.call

    def call(self, cmd, **args):
        if cmd == "load" and "as_ref" in args and getattr(self, "own_reg", None) is not None:
            args = {k: v for k, v in args.items() if k != "as_ref"} | {"reg": self.own_reg}
        r = orig(self, cmd, **args)
        if cmd == "register":
            self.own_reg = r["reg"]
        return r

    monkeypatch.setattr(Worker, "call", call)
    res = Result("ownership", "cpu", {})
    with Harness(log_dir=tmp_path) as h:
        ctx = ownership.Ctx(h)
        with res.case("foreign-client/memfd-wrongly-accepts") as c:
            ownership.case_foreign_client(ctx, c, "memfd")
        with res.case("register-use-close/memfd-after") as c:
            ownership.case_register_use_close(ctx, c, "memfd")
    flawed, after = res.cases
    assert flawed.passed is False and flawed.checks["foreign_load_refused"]["value"] == "accepted"
    assert flawed.error is None, flawed.error  # the wrongly accepted copy drained: no timeout in this case
    assert after.passed is True, (after.error, [k for k, v in after.checks.items() if v["ok"] is False])


def test_pidfd_case_kills_its_socket_holder_when_it_fails_early(tmp_path, monkeypatch):
    """case_death_seen_by_pidfd forks a process that holds the client's socket; a failure anywhere after the
    fork (here: load_mid raises) must still kill it."""
    from kmesh.harness.worker import Worker

    holders: list[int] = []
    orig = Worker.call

    def call(self, cmd, **args):
        r = orig(self, cmd, **args)
        if cmd == "fork_holder":
            holders.append(r)
        return r

    def broken_load_mid(self, *a, **k):
        raise RuntimeError("load_mid broke (test)")

    monkeypatch.setattr(Worker, "call", call)
    monkeypatch.setattr(ownership.Ctx, "load_mid", broken_load_mid)
    res = Result("ownership", "cpu", {})
    try:
        with Harness(log_dir=tmp_path) as h:
            with res.case("death-seen-by-pidfd") as c:
                ownership.case_death_seen_by_pidfd(ownership.Ctx(h), c)
        assert "load_mid broke" in (res.cases[0].error or ""), res.cases[0].error
        assert len(holders) == 1, holders
        deadline = time.monotonic() + 5
        while _running(holders[0]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(holders[0]), f"socket holder {holders[0]} left running"
    finally:
        for pid in holders:  # never leave it behind, whatever the outcome
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
