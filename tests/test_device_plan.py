"""scripts/device.sh and kmesh.diagnostics.device_plan on the CPU, no GPU and no install: every run listed, an
unknown run refused with exit 2 before anything runs, how a plan's words become runs and their arguments, the
commands a dry run prints, and the readers of result files on small fabricated ones (a malformed file refused by
name, a run failing on it without stopping the plan)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

from kmesh.diagnostics import UnknownDiagnosticError
from kmesh.diagnostics import device_plan as dp
from kmesh.diagnostics.device_plan import DevicePlanError, ResultFormatError, UnknownRunError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device.sh"
# options of the runs: a test sees none from the shell that started it
OPTIONS = ("KMESH_REV", "STAGES", "GPU_TESTS", "NO_ENV", "VARIANTS", "SESSION", "PYTEST_ARGS")


def _device(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in OPTIONS and not k.startswith(("TIMEOUT_", "SET_", "KMESH_ROOT"))}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**clean, "OUT": str(out), **env})


def _listed_runs(text: str) -> list[str]:
    runs_part = text.split("\nevery run:")[0]
    return [line.split()[0] for line in runs_part.splitlines()[1:] if line.startswith("  ")
            and not line.startswith("   ")]


def test_list_names_every_run_and_each_script_it_replaced(tmp_path):
    done = _device(tmp_path, "--list")
    assert done.returncode == 0, done.stderr
    assert _listed_runs(done.stdout) == list(dp.RUNS)
    for name in ("env", "kernels", "stages", "gpu-tests", "diagnostic", "integrity", "mutation", "uring-check",
                 "smollm2", "validate", "restore-variants", "service-load"):
        assert name in dp.RUNS
    for old, (plan, _) in dp.FOLDED.items():
        assert f"{old}" in done.stdout and f"scripts/device.sh {plan}" in done.stdout
        assert not (ROOT / "scripts" / old).exists(), f"{old} is folded into scripts/device.sh"
    assert not list(tmp_path.iterdir()), "--list writes nothing"


def test_every_replaced_script_is_a_valid_plan_and_in_the_measurements_table():
    table = (ROOT / "docs" / "measurements" / "README.md").read_text()
    for old, (plan, _) in dp.FOLDED.items():
        dp.parse_plan(shlex.split(plan), {})
        assert f"`{old}`" in table and f"`scripts/device.sh {plan}`" in table, old
    left = sorted(p.name for p in (ROOT / "scripts").glob("*device*"))
    assert left == ["device.sh", "fetch-device-wheels.sh"]


def test_unknown_run_exits_2_naming_it_and_the_runs_before_anything_runs(tmp_path):
    done = _device(tmp_path, "kernels", "kernals")
    assert done.returncode == 2
    assert "unknown run 'kernals' (kernels takes no arguments)" in done.stderr
    assert all(name in done.stderr for name in dp.RUNS)
    assert not list(tmp_path.iterdir()), "a plan that cannot run starts nothing"
    assert _device(tmp_path).returncode == 2
    assert "no run named" in _device(tmp_path).stderr


def test_the_package_entry_point_refuses_the_same_way(capsys):
    with pytest.raises(UnknownRunError, match="unknown run 'nope'"):
        dp.main(["nope"])
    assert dp.main(["--list"]) == 0
    assert "restore-variants" in capsys.readouterr().out


def test_a_run_takes_the_words_that_are_its_arguments():
    plan = dp.parse_plan(["kernels", "stages", "model,equivalence", "group", "integrity", "gpu-tests",
                          "tests/test_a.py", "-k", "kernel", "diagnostic", "service_load", "--rounds", "3",
                          "mutation", "trust", "120", "x.y*", "uring-check"], {})
    assert plan == [("kernels", []), ("stages", ["model,equivalence", "group", "integrity"]),
                    ("gpu-tests", ["tests/test_a.py", "-k", "kernel"]),
                    ("diagnostic", ["service_load", "--rounds", "3"]), ("mutation", ["trust", "120", "x.y*"]),
                    ("uring-check", [])]
    # a stage after `stages` is a stage (the integrity stage), the integrity run comes before stages or after another
    assert dp.stage_specs(plan[1][1]) == [dp.StageSpec("model"), dp.StageSpec("equivalence"), dp.StageSpec("group"),
                                          dp.StageSpec("integrity")]
    assert dp.parse_plan(["integrity", "stages", "storage@preadv"], {})[0] == ("integrity", [])


@pytest.mark.parametrize("argv, error, message", [
    (["stages"], DevicePlanError, "stages needs its stages"),
    (["stages", "storage@nope"], DevicePlanError, "unknown variant 'storage@nope'; variants: storage@preadv"),
    (["diagnostic"], DevicePlanError, "diagnostic needs a NAME"),
    (["diagnostic", "no_such"], UnknownDiagnosticError, "unknown diagnostic 'no_such'"),
    (["mutation"], DevicePlanError, "mutation needs a SET"),
    (["mutation", "trust", "soon"], DevicePlanError, "SECONDS must be a whole number"),
    (["env", "extra"], UnknownRunError, "unknown run 'extra' (env takes no arguments)"),
    (["gpu-tests", "a.py", "stages", "nope"], UnknownRunError,
     "unknown run 'nope' (nor an argument of stages [STAGE[@VARIANT]...])"),
])
def test_a_plan_missing_an_argument_is_refused(argv, error, message):
    with pytest.raises(error, match=re.escape(message)):
        dp.parse_plan(argv, {})


def test_restore_variants_needs_the_default_build_first():
    assert dp.parse_plan(["restore-variants"], {"VARIANTS": ",-DX=1"}) == [("restore-variants", [])]
    with pytest.raises(DevicePlanError, match="the first variant must be the default build"):
        dp.parse_plan(["restore-variants"], {"VARIANTS": "-DX=1"})


def test_stages_read_from_the_environment_and_an_unknown_stage_refused():
    assert dp.parse_plan(["stages"], {"STAGES": "equivalence group"}) == [("stages", [])]
    with pytest.raises(DevicePlanError, match="unknown stage 'equivalance'"):
        dp.parse_plan(["stages"], {"STAGES": "equivalance"})


def test_env_runs_once_first_and_gpu_info_before_the_first_gpu_run():
    plan = dp.parse_plan(["uring-check", "kernels", "env", "gpu-tests"], {})
    assert [name for name, _ in dp.expand(plan, {})] == ["env", "uring-check", "gpu-info", "kernels", "gpu-tests"]
    assert [name for name, _ in dp.expand(plan, {"NO_ENV": "1"})][0] == "env", "named: it runs"
    plan = dp.parse_plan(["mutation", "trust"], {})
    assert [name for name, _ in dp.expand(plan, {"NO_ENV": "1"})] == ["mutation"], "no GPU run: no gpu-info"


def test_dry_run_prints_each_command_with_its_limit_overrides_and_file_names(tmp_path):
    out = tmp_path / "out"
    done = _device(out, "--dry-run", "stages", "equivalence@rag16k", "diagnostic", "decode_isolation", "--runs", "3",
                   KMESH_REV="abc1234", TIMEOUT_EQUIVALENCE_RAG16K="77", SET_EQUIVALENCE="equivalence.seed=5",
                   DECODE_RUNS="9")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "pip install" in text and "--target /tmp/site ." in text, "env first"
    model = next(line for line in text.splitlines() if "kmesh run model" in line)
    assert model.startswith("$ timeout -k 10 -s TERM 200 "), "model first, under its limit, before equivalence"
    eq = next(line for line in text.splitlines() if "kmesh run equivalence" in line)
    assert eq.startswith("$ timeout -k 10 -s TERM 77 ")
    assert ("--set equivalence.rag.workload.chunks=60 --set equivalence.rag.workload.prompt_tokens=16384 "
            "--set 'equivalence.ttft.prompt_tokens=[4096]' --set equivalence.seed=5") in eq
    assert "$OUT/equivalence-rag16k-abc1234.json" in text and "$OUT/model" not in text
    diag = next(line for line in text.splitlines() if "kmesh diagnose decode_isolation" in line)
    assert diag.endswith(f"--out {out}/decode_isolation-abc1234.json --runs 3"), "the given --runs wins"
    assert "device plan: 0 of 4 runs failed" in (out / "summary.txt").read_text()


def test_a_real_run_records_its_steps_in_summary_and_log(tmp_path):
    """gpu-info for real (no nvidia-smi here is its failure, noted): the child runs with the tree's package."""
    done = _device(tmp_path, "gpu-info", NO_ENV="1")
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode in (0, 1) and "== gpu-info" in summary
    assert "torch" in summary and "cupy" in summary, "print_versions ran in the child"
    assert "$ nvidia-smi" in (tmp_path / "device.log").read_text()
    assert summary.rstrip().splitlines()[-1].startswith("device plan: ")


# ---------------------------------------------------------------------------------------------------------------
# The readers of result files.


def _storage_result() -> dict:
    return {"stage": "storage", "profile": "cuda",
            "cases": [{"id": "floor", "passed": True},
                      {"id": "route-a", "passed": False, "error": "AssertionError: bytes differ\n  at line 3"},
                      {"id": "route-b", "passed": False, "error": None,
                       "checks": {"identical": {"ok": False}, "fast": {"ok": True}}},
                      {"id": "cufile", "passed": None, "skipped": "no cuFile"}],
            "summary": {"passed": 1, "failed": 2, "skipped": 1, "ok": False,
                        "skips_unallowed": [{"case": "cufile", "skipped": "no cuFile"}],
                        "floor_ratio": 1.2651, "floor_ratio_variant": "pipelined",
                        "floor_ratios": {"sequential": 3.0, "pipelined": 1.2651}, "floor_goal": 1.25}}


def test_stage_summary_reads_the_verdict_failures_and_the_storage_floor(tmp_path):
    path = tmp_path / "storage.json"
    path.write_text(json.dumps(_storage_result()))
    assert dp.stage_summary(dp.read_json(path)) == [
        "storage (cuda): 1 passed, 2 failed, 1 skipped, NOT OK",
        "  FAILED route-a: AssertionError: bytes differ",
        "  FAILED route-b: identical",
        "  skip not allowed cufile: no cuFile",
        "  floor_ratio 1.265 (pipelined; goal 1.25)",
        "  floor_ratios sequential 3.000, pipelined 1.265"]


def test_integrity_summary_reads_arms_and_goals():
    data = {"stage": "integrity", "profile": "cuda", "cases": [],
            "summary": {"passed": 7, "failed": 0, "skipped": 0, "ok": True, "digests_match": True,
                        "best_chunk_bytes": 65536,
                        "arms": {"gpu-blake3": {"set": {"median_ms": 0.0286, "gbps": 440.0},
                                                "big": {"median_ms": 0.7354, "gbps": 1460.2}}},
                        "goals": {"arms_read": {"blake3": "gpu-blake3"},
                                  "blake3_12MiB_le_30us": {"measured_us": 28.6, "met": True},
                                  "blake3_1GiB_ge_1TBps": {"measured": 990.5, "met": False}}}}
    assert dp.stage_summary(data) == [
        "integrity (cuda): 7 passed, 0 failed, 0 skipped, ok",
        "  digests_match True, best_chunk_bytes 65536",
        "  gpu-blake3                 set: 0.0286 ms 440.0 GB/s  big: 0.7354 ms 1460.2 GB/s",
        "  goal arms_read: {'blake3': 'gpu-blake3'}",
        "  goal blake3_12MiB_le_30us: 28.60 met",
        "  goal blake3_1GiB_ge_1TBps: 990.50 missed"]


def test_diagnostic_summaries():
    row = {"issue_us": 4.8, "event_us": 28.6, "gpu_only_us": 27.0, "event_GBps": 440.3, "event_ratio_vs_passes": 2.29}
    assert dp.diagnostic_summary("gpu_hash_overhead", {"medians": {"set": {"blake3": {"request128": row}}}}) == [
        "set  blake3       request128  issue      4.8 event      28.6 gpu      27.0 us     440.3 GB/s  vs passes 2.29"]
    runs = [{"run": 0, "tokens_equal": True, "prefill_equal": True, "first_diff": None},
            {"run": 1, "tokens_equal": False, "prefill_equal": True, "first_diff": [5, 1, "attn"]},
            {"run": 2, "tokens_equal": True, "prefill_equal": False, "first_diff": [-1, -1, "prefill"]}]
    assert dp.diagnostic_summary("decode_isolation", {"runs": 3, "churn_contexts": 12, "per_run": runs}) == [
        "runs with tokens equal to run 0: 2, differing: 1, prefill differing: 1 (churn contexts 12)",
        "  run 1: first differing op [5, 1, 'attn']", "  run 2: first differing op [-1, -1, 'prefill']"]
    load = {"segments": 60, "bytes": 100, "rounds": 15, "accept_ms_median": 3.5,
            "arms": {"load-many": {"median_ms": 7.5, "gb_per_s": 24.61, "ratio_to_host-floor_median": 2.0}}}
    assert dp.diagnostic_summary("service_load", load) == [
        "segments 60, bytes 100, rounds 15, accept_ms_median 3.500",
        "  load-many            7.500 ms 24.6 GB/s  ratio_to_host-floor_median 2.000"]
    pair = {"lengths": [{"prompt_tokens": 4096, "checks": {},
                         "full_eager_vs_compiled": {"replay": {"median_ratio": 0.74}}}]}
    assert dp.diagnostic_summary("layer_step_pair", pair) == ["4096: full_eager_vs_compiled replay 0.740"]
    assert dp.diagnostic_summary("blend_profile", {"4096_full": {}, "provenance": {}}) == \
        ["blend_profile: keys 4096_full"]


def test_text_readers():
    lines = ["....F.", "FAILED tests/test_x.py::test_y - AssertionError", "=== 1 failed, 5 passed in 2.10s ==="]
    assert dp.pytest_summary(lines, 1) == ["pytest rc=1: 1 failed, 5 passed in 2.10s",
                                           "  FAILED tests/test_x.py::test_y - AssertionError"]
    assert dp.pytest_summary(["ImportError: no torch"], 4) == ["pytest rc=4: no totals line in its output"]
    assert dp.kmesh_line(["[kmesh] group (cuda): 19 passed", "[kmesh] group: 10 CPU-s", "x"], "group") == \
        "[kmesh] group: 10 CPU-s"
    sass = ["  LDG.E.128 R4, [R2.64]", "  STG.E.EL.128 [R6], R8", "  LDL R1, [R0]", "  FADD R1, R2, R3"]
    assert dp.sass_counts(sass) == (2, 1)
    assert dp.resource_usage_lines(["Resource usage:", " Function sha256:", "  REG:40 STACK:0", ""]) == \
        [" Function sha256:", "  REG:40 STACK:0"]
    assert dp.cpu_facts("processor: 0\nmodel name\t: Xeon 8480\nflags\t: sse avx512f avx2\n") == ("Xeon 8480", True)
    assert dp.cpu_facts("flags: avx512fx\n") == ("unknown", False)
    log = "12 mutations/second\r13 mutations/second\rother\nStopping\nreal 3.0s\n"
    assert dp.mutmut_progress_lines(log) == ["12 mutations/second", "13 mutations/second", "Stopping", "real 3.0s"]
    assert dp.mutmut_progress_lines(log, last=2) == ["Stopping", "real 3.0s"]


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "a JSON object expected, found list"),
    ('{"stage": "storage", "cases": []}', "result of storage: no 'summary'"),
    ('{"stage": "storage", "cases": [], "summary": {"passed": "3", "failed": 0, "skipped": 0}}',
     "'passed' is '3', not int"),
    ('{"stage": "integrity", "cases": [], "summary": {"passed": 1, "failed": 0, "skipped": 0, '
     '"arms": {"gpu-blake3": {"set": {"median_ms": 1.0}}}}}', "arm 'gpu-blake3' lacks median_ms / gbps"),
])
def test_a_malformed_result_is_refused_by_name(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ResultFormatError, match=re.escape(message)):
        dp.stage_summary(dp.read_json(path))
    with pytest.raises(ResultFormatError, match="no such file"):
        dp.read_json(tmp_path / "absent.json")


def test_a_malformed_diagnostic_output_is_refused():
    with pytest.raises(ResultFormatError, match="per_run row lacks tokens_equal"):
        dp.decode_isolation_summary({"per_run": [{"run": 0}]})
    with pytest.raises(ResultFormatError, match="set/blake3/passes lacks"):
        dp.hash_overhead_summary({"medians": {"set": {"blake3": {"passes": {"issue_us": 1.0}}}}})


def test_an_unreadable_result_fails_its_step_and_the_plan_goes_on(tmp_path):
    dev = dp.Device(ROOT, tmp_path, {})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert dev.figures(dp.stage_summary, bad, "result of x") is False
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_storage_result()))
    assert dev.figures(dp.stage_summary, good, "result of storage") is True
    summary = (tmp_path / "summary.txt").read_text()
    assert "cannot read result of x: result of x" in summary and "floor_ratio 1.265" in summary


def test_more_files_than_come_back_are_packed_beside_summary_and_log(tmp_path):
    dev = dp.Device(ROOT, tmp_path, {})
    dev.note("start")
    (tmp_path / "sub").mkdir()
    for i in range(8):
        (tmp_path / ("sub" if i % 2 else ".") / f"f{i}.json").write_text(str(i))
    dev.pack()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.log", "out.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "out.tgz") as tar:
        assert sorted(tar.getnames()) == ["f0.json", "f2.json", "f4.json", "f6.json", "sub/f1.json", "sub/f3.json",
                                          "sub/f5.json", "sub/f7.json"]
    assert "8 packed into out.tgz" in (tmp_path / "summary.txt").read_text()


def test_mutation_state_snapshot_holds_logs_report_and_verdicts(tmp_path):
    base = tmp_path / "mutation" / "trust"
    meta = base / "tree" / "mutants" / "src" / "kmesh"
    meta.mkdir(parents=True)
    (base / "runs.log").write_text("run\n")
    (base / "report.md").write_text("# report\n")
    (base / "tree" / "mutants" / "mutmut-stats.json").write_text("{}")
    (meta / "rope.py.meta").write_text('{"exit_code_by_key": {}}')
    (base / "tree" / "other.txt").write_text("not kept")
    dest = tmp_path / "trust-state.tgz"
    assert dp.snapshot_state(tmp_path / "mutation", "trust", dest) == 4
    with tarfile.open(dest) as tar:
        names = sorted(n for n in tar.getnames() if tar.getmember(n).isfile())
    assert names == ["trust/report.md", "trust/runs.log", "trust/tree/mutants/mutmut-stats.json",
                     "trust/tree/mutants/src/kmesh/rope.py.meta"]
    assert dp.parses(meta / "rope.py.meta") and not dp.parses(_write(tmp_path / "half.meta", '{"exit'))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_stage_list_is_the_pipelines():
    stages = pytest.importorskip("kmesh.stages")
    assert dp.pipeline_stages() == list(stages.STAGES)
