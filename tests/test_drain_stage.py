"""Stage `drain` on the CPU profile: 6 + 1 cases across real processes, and a negative control proving its
reuse checks can fail."""
import os

import pytest

from kmesh.config import load_config
from kmesh.errors import StageError
from kmesh.result import Result
from kmesh.stages import drain
from kmesh.stages.drain import stage as drain_stage
from kmesh.stages.drain.cases import run_transfer_case
from kmesh.stages.drain.copier import CopierProcess


@pytest.fixture
def cfg(tmp_path):
    return load_config(profile="cpu", overrides={"results_dir": str(tmp_path), "drain": {"bench_reps": 3}})


@pytest.mark.covered_by_stage("drain", "d2h-success", "d2h-error_completable", "d2h-refused_then_ok", "h2d-success",
                                "h2d-error_completable", "h2d-refused_then_ok", "client-sigkill")
def test_drain_stage_all_cases_pass_across_processes(cfg):
    res = drain.run(cfg)
    by_id = {c.id: c for c in res.cases}
    assert sorted(by_id) == sorted([f"{d}-{m}" for d in drain_stage.DIRECTIONS for m in drain_stage.MODES]
                                   + ["client-sigkill"])
    failed = {c.id: (c.error, [k for k, v in c.checks.items() if v["ok"] is False]) for c in res.cases
              if c.passed is not True}
    assert not failed, failed
    for cid, c in by_id.items():
        checks = c.checks
        assert checks.get("no_leaks", {}).get("ok") is True, cid
        if cid == "client-sigkill":
            assert checks["killed_by_sigkill"]["value"] == -9
            assert checks["reclaim_refused_until_exit_observed"]["ok"] is True
            assert checks["copy_stopped_where_gated"]["ok"] is True
            continue
        assert checks["copier_pid"]["value"] != os.getpid()
        for k in ("mid_flight", "dst_partly_written", "owner_reuse_refused_pending", "copier_release_raises_pending",
                  "data_correct", "no_holds_after_drain", "sentinels_intact_after_copier_stopped", "canaries_intact"):
            assert checks[k]["ok"] is True, (cid, k)
        if cid.endswith("refused_then_ok"):
            assert checks["first_drain_refused"]["ok"] and checks["second_drain_timed_out"]["ok"]
        if cid.endswith("error_completable"):
            assert checks["submit_raised_typed_error_with_pending"]["ok"]
    assert set(res.timings) == set(by_id) and "final_drain_s" in res.timings["d2h-success"]
    assert res.extra["copier_exit"] == 0


@pytest.mark.parametrize("ignored, caught_by", [
    ("dev", "data_correct"),  # d2h: the source reused early -> the copy carries the reuser's bytes
    ("host", "sentinels_intact_after_copier_stopped"),  # the destination reused early -> the copy overwrites it
])
def test_reuser_ignoring_holds_is_caught(cfg, ignored, caught_by):
    """Negative control: a reuser that takes memory while a copy is pending must fail the stage's checks."""
    settings = drain_stage.setting(cfg)
    res = Result("drain", "cpu", {})
    copier = CopierProcess("cpu", settings.log_dir / "copier-control.log")
    try:
        with res.case("control") as case:
            run_transfer_case(case, settings, copier, "d2h", "refused_then_ok", 11, f"kmesh-drain-{os.getpid()}-ctl",
                              ignore_holds=frozenset({ignored}))
    finally:
        assert copier.finish(settings.wait_s) == 0
    (c,) = res.cases
    bad = {k for k, v in c.checks.items() if v["ok"] is False}
    assert c.passed is False and c.error is None
    assert {"owner_reuse_refused_pending", caught_by} <= bad, bad
    assert c.checks["no_leaks"]["ok"] is True  # the control still cleans up after itself


def test_bad_drain_sizes_are_rejected(tmp_path):
    cfg = load_config(profile="cpu", overrides={"results_dir": str(tmp_path),
                                                "drain": {"nbytes": 1000, "chunk_bytes": 512}})
    with pytest.raises(StageError, match="multiple of drain.chunk_bytes"):
        drain_stage.setting(cfg)
