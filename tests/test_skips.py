"""Issue 21 item 5: a config switch that turns cases off never makes them vanish. Each such case is recorded as
skipped with a reason naming the switch (kmesh.result: Result.disabled / Result.skip_case), and the stage is ok only
where the profile's `<stage>.allow_skips` allows that skip — a profile cannot make a stage green by configuring
its cases away.

Stages here: vllm (vllm.enabled), storage (storage.checksums, storage.read_once_service; the real stage on a tiny
model, ~20 s), model (model.smollm2.enabled, model.qwen2_random.checkpoint), integrity's GPU-only case.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kmesh.config import SkipAllowance, load_config
from kmesh.result import Result, disabled_reason

ROOT = Path(__file__).resolve().parent.parent


# --- the mechanism ------------------------------------------------------------------------------------------------

def test_disabled_cases_are_skips_naming_the_switch_and_need_an_allowance():
    res = Result("unit", "cpu", {})
    with res.case("runs") as c:
        c.check("fine", 1 + 1 == 2)
    skipped = res.disabled("unit.feature", False, ["feature-a", "feature-b"], {"size": 3})
    assert [c.id for c in skipped] == ["feature-a", "feature-b"]
    assert all(c.skipped == "unit.feature: false (disabled by config)" and c.passed is None for c in skipped)
    assert skipped[0].params == {"size": 3, "disabled_by": "unit.feature"}
    s = res.summary()
    assert (s["passed"], s["skipped"], s["ok"]) == (1, 2, False)      # not allowed: the stage is not ok
    assert [u["case"] for u in s["skips_unallowed"]] == ["feature-a", "feature-b"]

    allowed = Result("unit", "cpu", {}, (SkipAllowance("feature-*", "this profile has no feature"),))
    with allowed.case("runs") as c:
        c.check("fine", 1 + 1 == 2)
    allowed.disabled("unit.feature", False, ["feature-a"])
    s = allowed.summary()
    assert s["ok"] and not s["all_passed"]
    assert s["skips_allowed"] == [{"case": "feature-a", "skipped": "unit.feature: false (disabled by config)",
                                   "pattern": "feature-*", "reason": "this profile has no feature"}]


def test_disabled_reason_writes_the_value_as_json_and_a_skip_needs_a_reason():
    assert disabled_reason("storage.checksums", None) == "storage.checksums: null (disabled by config)"
    assert disabled_reason("storage.checksums.compare", []) == "storage.checksums.compare: [] (disabled by config)"
    with pytest.raises(ValueError, match="reason"):
        Result("unit", "cpu", {}).skip_case("x", {}, "")


def test_a_disabled_case_keeps_its_id_unique():
    res = Result("unit", "cpu", {})
    res.disabled("unit.feature", False, ["feature-a"])
    with pytest.raises(ValueError, match="duplicate"):
        res.disabled("unit.feature", False, ["feature-a"])


# --- vllm.enabled ---------------------------------------------------------------------------------------------------

def _literal_case_ids(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "case"
            and node.args and isinstance(node.args[0], ast.Constant)}


def test_vllm_engine_cases_list_every_case_the_stage_runs():
    from kmesh.stages.vllm.stage import ENGINE_CASES

    ids = _literal_case_ids(ROOT / "src" / "kmesh" / "stages" / "vllm" / "stage.py")
    assert ids == {"arrangement-refusals", *ENGINE_CASES}


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
def test_vllm_disabled_skips_every_engine_case_allowed_only_where_the_profile_says_why(profile, tmp_path):
    from kmesh.stages.vllm import stage as vllm_stage

    cfg = load_config(profile=profile, overrides={"results_dir": str(tmp_path), "vllm": {"enabled": False}})
    res = vllm_stage.run(cfg)
    by_id = {c.id: c for c in res.cases}
    assert list(by_id) == ["arrangement-refusals", *vllm_stage.ENGINE_CASES]
    assert by_id["arrangement-refusals"].passed is True
    assert all(by_id[i].skipped == "vllm.enabled: false (disabled by config)" for i in vllm_stage.ENGINE_CASES)
    s = res.summary()
    if profile == "cuda":     # the GPU host has no vLLM: its profile allows each engine case's skip, with why
        assert s["ok"] and {a["case"] for a in s["skips_allowed"]} == set(vllm_stage.ENGINE_CASES)
        assert all("GPU host carries no vLLM" in a["reason"] for a in s["skips_allowed"])
    else:                     # the cpu profile runs the engine: switching it off cannot pass the stage
        assert not s["ok"] and len(s["skips_unallowed"]) == len(vllm_stage.ENGINE_CASES)


# A host without vLLM and LMCache (the GPU host) runs these stages as the cuda profile says: engine-free cases, the
# engine cases skipped with the profile's reason. Their modules once imported the connector, hence vLLM, at import
# time, so `python -m kmesh run vllm --profile cuda` died there before skipping anything.
_HIDE_ENGINES = ("import runpy, sys\n"
                 "sys.modules['vllm'] = None; sys.modules['lmcache'] = None   # import vllm: ModuleNotFoundError\n"
                 "sys.argv = ['kmesh'] + sys.argv[1:]\n"
                 "runpy.run_module('kmesh', run_name='__main__')\n")


@pytest.mark.parametrize("stage", ["vllm", "peers"])
def test_cuda_profile_stage_runs_where_no_engine_is_installed(stage, tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _HIDE_ENGINES, "run", stage, "--profile", "cuda", "--out", str(out),
                           "--set", f"results_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    skipped = [c for c in res["cases"] if c.get("skipped")]
    assert skipped and all("carries no vLLM" in a["reason"] for a in res["summary"]["skips_allowed"])
    assert res["summary"]["ok"] and not res["summary"]["skips_unallowed"]


# --- peers.enabled --------------------------------------------------------------------------------------------------

def test_peers_cases_list_every_case_the_stage_runs():
    from kmesh.stages.peers.stage import CASES

    assert _literal_case_ids(ROOT / "src" / "kmesh" / "stages" / "peers" / "stage.py") == set(CASES)


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
def test_peers_disabled_skips_every_case_allowed_only_where_the_profile_says_why(profile, tmp_path):
    from kmesh.stages import peers

    cfg = load_config(profile=profile, overrides={"results_dir": str(tmp_path), "peers": {"enabled": False}})
    res = peers.run(cfg)
    from kmesh.stages.peers.stage import CASES, ENGINE_CASES

    by_id = {c.id: c for c in res.cases}
    assert list(by_id) == list(CASES) == ["arms-alike", *ENGINE_CASES]
    assert by_id["arms-alike"].passed is True           # engine-free: runs on any host
    assert all(by_id[i].skipped == "peers.enabled: false (disabled by config)" for i in ENGINE_CASES)
    s = res.summary()
    if profile == "cuda":     # neither vLLM nor LMCache on the GPU host: its profile allows each skip, with why
        assert s["ok"] and {a["case"] for a in s["skips_allowed"]} == set(ENGINE_CASES)
        assert all("no vLLM and no LMCache" in a["reason"] for a in s["skips_allowed"])
    else:                     # the cpu profile runs all three arms: switching them off cannot pass the stage
        assert not s["ok"] and len(s["skips_unallowed"]) == len(ENGINE_CASES)


# --- storage.checksums, storage.read_once_service -------------------------------------------------------------------

def test_checksums_null_skips_every_checksum_case():
    from kmesh.stages.storage import checksum_cases

    res = Result("storage", "cpu", {})
    checksum_cases.run_cases(res, SimpleNamespace(sec={"checksums": None}), {}, 1, 0)
    assert [(c.id, c.skipped) for c in res.cases] == [
        (case_id, "storage.checksums: null (disabled by config)") for case_id in checksum_cases.DISABLED_IDS]


def test_checksums_null_is_valid_config():
    cfg = load_config(profile="cpu", overrides={"storage": {"checksums": None}})
    assert cfg.section("storage")["checksums"] is None


def test_storage_stage_with_switches_off_skips_their_cases(tmp_path):
    from kmesh.stages import storage
    from test_storage_stage import _cfg

    cfg = _cfg(tmp_path, floor_variants=["sequential"], read_once_service=False, checksums=None)
    res = storage.run(cfg)
    by_id = {c.id: c for c in res.cases}
    assert by_id["read-once-service"].skipped == "storage.read_once_service: false (disabled by config)"
    for case_id in ("checksum-objects", "checksums-compare", "checksum-overlap", "checksum-corrupt"):
        assert by_id[case_id].skipped == "storage.checksums: null (disabled by config)"
    ran = [c for c in res.cases if c.skipped is None]
    assert ran and all(c.passed for c in ran), [(c.id, c.error) for c in ran if not c.passed]
    s = res.summary()
    assert not s["ok"] and {u["case"] for u in s["skips_unallowed"]} == {
        "read-once-service", "checksum-objects", "checksums-compare", "checksum-overlap", "checksum-corrupt"}


# --- model.smollm2.enabled, model.qwen2_random.checkpoint; integrity's GPU-only case --------------------------------

def test_cuda_profile_allows_the_model_cases_it_switches_off():
    cfg = load_config(profile="cuda")
    res = Result("model", "cuda", {}, cfg.skip_allowances("model"))
    with res.case("qwen2-random-same-seed") as c:
        c.check("digest_equal", "a" * 2 == "aa")
    from kmesh.stages.model import SMOLLM2_CASES

    res.disabled("model.smollm2.enabled", False, SMOLLM2_CASES)
    res.disabled("model.qwen2_random.checkpoint", None, ["qwen2-checkpoint"])
    assert res.ok and len(res.summary()["skips_allowed"]) == 5


def test_integrity_on_cpu_skips_the_gpu_only_case_allowed():
    cfg = load_config(profile="cpu")
    res = Result("integrity", "cpu", {}, cfg.skip_allowances("integrity"))
    with res.case("cpu-digests") as c:
        c.check("fine", 1 + 1 == 2)
    from kmesh.stages.integrity.stage import WHOLE_BIG_CASE

    res.skip_case(WHOLE_BIG_CASE, {}, "no CUDA device in this profile")
    assert res.ok
    src = (ROOT / "src" / "kmesh" / "stages" / "integrity" / "gpu.py").read_text()
    assert f'res.case("{WHOLE_BIG_CASE}"' in src       # the id the skip stands for is the one the case runs under
