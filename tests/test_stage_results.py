"""Every stage of the pipeline ran, on this code, and is ok: the results `make check` asks for.

`make check` (scripts/test.sh) runs the cpu pipeline into KMESH_STAGE_RESULTS (results/test) beside the suite, then
these tests with KMESH_REQUIRE_STAGES=cpu: a missing, stale or failed stage result fails here. Without that variable
(a plain `pytest`) they read the configured results dir and skip where the pipeline has not been run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kmesh.config import load_config
from kmesh.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]
PROFILE = os.environ.get("KMESH_REQUIRE_STAGES") or "cpu"
REQUIRED = bool(os.environ.get("KMESH_REQUIRE_STAGES"))


def _results_root() -> Path:
    given = os.environ.get("KMESH_STAGE_RESULTS")
    if given:
        return Path(given) if Path(given).is_absolute() else ROOT / given
    return load_config(profile=PROFILE, root=ROOT).results_dir


def _results_dir() -> Path:
    return _results_root() / PROFILE


def _result(stage: str) -> dict:
    path = _results_dir() / stage / "result.json"
    if not path.is_file():
        if REQUIRED:
            pytest.fail(f"{path} is missing: `make check` runs the pipeline beside the suite (scripts/test.sh)")
        pytest.skip(f"{path} not there: run the pipeline first (make pipeline), or `make check`")
    return json.loads(path.read_text())


@pytest.mark.parametrize("stage", STAGES)
def test_stage_ran_and_is_ok(stage):
    res = _result(stage)
    assert res["schema"] == "kmesh.result/1" and res["stage"] == stage and res["profile"] == PROFILE
    summary = res["summary"]
    assert summary["ok"], (f"stage {stage} is not ok: {summary['failed']} failed, {summary['passed']} passed, "
                           f"unallowed skips {summary['skips_unallowed']}")
    assert summary["passed"] > 0


def test_results_are_current_for_this_code():
    """Snakemake has nothing left to do: every result was made by the code and config now checked out."""
    if not (_results_dir() / "report" / "result.json").is_file():
        _result("report")   # fails (required) or skips with the reason
    # the results dir and overlay exactly as the pipeline was given them (Snakemake keys its records by path)
    given = [f"profile={PROFILE}", f"results_dir={os.environ.get('KMESH_STAGE_RESULTS') or _results_root()}"]
    if os.environ.get("KMESH_STAGE_OVERLAY"):
        given.append(f"overlay={os.environ['KMESH_STAGE_OVERLAY']}")
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--config", *given],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "Nothing to be done" in text, "results are stale for this code or config:\n" + text[-3000:]
