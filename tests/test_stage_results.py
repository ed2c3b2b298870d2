"""Every stage of the pipeline ran, on this code, and is ok: the results `make test` asks for.

`make test` (scripts/test.sh) runs the cpu pipeline into KMESH_STAGE_RESULTS (results/test) beside the suite, then
these tests with KMESH_REQUIRE_STAGES=cpu: a missing, stale or failed stage result fails here, and so does a stage
case that a test marked covered_by_stage names (the suite left that test out because the case asserts the same)
without having passed. Without that variable (a plain `pytest`) they read the configured results dir and skip
where the pipeline has not been run.
"""
from __future__ import annotations

import ast
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
            pytest.fail(f"{path} is missing: `make test` runs the pipeline beside the suite (scripts/test.sh)")
        pytest.skip(f"{path} not there: run the pipeline first (make pipeline), or `make test`")
    return json.loads(path.read_text())


@pytest.mark.parametrize("stage", STAGES)
def test_stage_ran_and_is_ok(stage):
    res = _result(stage)
    assert res["schema"] == "kmesh.result/1" and res["stage"] == stage and res["profile"] == PROFILE
    summary = res["summary"]
    assert summary["ok"], (f"stage {stage} is not ok: {summary['failed']} failed, {summary['passed']} passed, "
                           f"unallowed skips {summary['skips_unallowed']}")
    assert summary["passed"] > 0


def test_the_stages_left_no_temporary_files():
    """make test runs the pipeline with TMPDIR at a fresh directory of its own (KMESH_STAGE_TMPDIR): every stage
    and every process it started (services, engines, workers) honours TMPDIR through `tempfile`, and nothing of
    theirs may be left there once the pipeline has ended."""
    tmp = os.environ.get("KMESH_STAGE_TMPDIR")
    if not tmp:
        if REQUIRED:
            pytest.fail("KMESH_STAGE_TMPDIR is not set: scripts/test.sh runs the pipeline with a TMPDIR of its own")
        pytest.skip("no KMESH_STAGE_TMPDIR: only make test runs the pipeline with a TMPDIR of its own")
    import getpass

    root = Path(tmp)
    assert root.is_dir(), f"{root}: the pipeline's TMPDIR is gone"
    # torch.compile's own cache (kmesh.diagnostics.attention_variants compiles flex_attention): torch keeps it in
    # $TMPDIR/torchinductor_<user> on purpose, for the next process to reuse; it is not a file KMesh left behind
    cache = root / f"torchinductor_{getpass.getuser()}"
    # (the pinned vLLM's engines leave a `vllm_dist_<hex>` file each in TMPDIR, found by this check at fae91b9:
    # kmesh.vllm.engine.EngineProcess gives each engine a TMPDIR of its own and removes it when the engine ends)
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p != cache and cache not in p.parents)
    assert not left, f"the stages left temporary files behind in {root}: {left[:20]}"


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


def covered_by_stage_marks(tests_dir: Path = ROOT / "tests") -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every test function marked `@pytest.mark.covered_by_stage(stage, *cases)` in the suite, read from the
    sources: {"file::test": (stage, cases)}. The marker's arguments must be string literals."""
    marks: dict[str, tuple[str, tuple[str, ...]]] = {}
    for path in sorted(tests_dir.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and \
                        dec.func.attr == "covered_by_stage":
                    args = [a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                    if len(args) != len(dec.args) or len(args) < 2:
                        raise AssertionError(f"{path.name}::{node.name}: covered_by_stage needs a stage and at "
                                             "least one case, as string literals")
                    marks[f"{path.name}::{node.name}"] = (args[0], tuple(args[1:]))
    return marks


def test_covered_by_stage_marks_are_read_from_the_sources():
    """The reader finds the suite's marks (the vLLM engine tests name the vllm stage's cases) and refuses a mark
    without a case."""
    marks = covered_by_stage_marks()
    assert marks["test_vllm_connector.py::test_exact_prefix_reuse_same_tokens_and_supplied"] == ("vllm",
                                                                                                ("exact-reuse",))
    assert all(stage in STAGES and cases for stage, cases in marks.values())


def test_covered_by_stage_mark_without_a_case_is_refused(tmp_path):
    (tmp_path / "test_x.py").write_text("import pytest\n@pytest.mark.covered_by_stage('vllm')\ndef test_a():\n"
                                        "    pass\n")
    with pytest.raises(AssertionError, match="at least one case"):
        covered_by_stage_marks(tmp_path)


@pytest.mark.parametrize("test_id", sorted(covered_by_stage_marks()))
def test_every_case_a_left_out_test_names_passed(test_id):
    """make test leaves the covered_by_stage tests out of the suite: the stage cases they name must have run here
    and passed (not skipped), so what they assert was asserted."""
    stage, cases = covered_by_stage_marks()[test_id]
    by_id = {c["id"]: c for c in _result(stage)["cases"]}
    missing = [case for case in cases if case not in by_id]
    assert not missing, f"{test_id}: stage {stage} ran no case {missing}"
    bad = {case: (by_id[case]["passed"], by_id[case]["skipped"], by_id[case]["error"]) for case in cases
           if by_id[case]["passed"] is not True}
    assert not bad, f"{test_id}: stage {stage}'s cases did not pass: {bad}"
