"""Stage `synthetic` must fail on real bugs in the code it checks (issue 8, items 4 and 5).

Each test runs the real CLI (`kmesh run synthetic`) in a fresh interpreter whose prelude blocks vLLM (the GPU
machine has none, and no vLLM comparator may be what catches a bug) and plants one bug in KMesh itself. The
bug is a mutation of the library code the stage exercises, not a test double: restore, read-back and the
canary mask would all share it if the stage's checks went through the same code.

CPU-profile variants run in CI; cuda-profile variants are `gpu` tests (they build the kernel cubin first).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import sys
sys.modules['vllm'] = None   # vLLM absent: the stage's own references must catch the bug
import torch
import kmesh.cli
import kmesh.kv.layout
import kmesh.kv.rope
"""

# Slot-addressing bugs that stay in bounds (so nothing crashes; on the code before issue 8 the stage passed
# all 47 cases with either, because restore, read-back and canary mask all went through split_slots).
SLOT_MUTATIONS = {
    "offset_rotated_in_block": """
def split_slots(self, slots):
    # bug: the offset one further on, wrapping inside its block
    return torch.div(slots, self.block_size, rounding_mode='floor'), torch.remainder(slots + 1, self.block_size)
kmesh.kv.layout.KVLayout.split_slots = split_slots
""",
    "next_slot_wrapping": """
def split_slots(self, slots):
    # bug: slot + 1 (mod the cache's slots)
    s = (slots + 1) % (self.num_blocks * self.block_size)
    return torch.div(s, self.block_size, rounding_mode='floor'), torch.remainder(s, self.block_size)
kmesh.kv.layout.KVLayout.split_slots = split_slots
""",
}

# RoPE direction: sin -> -sin inside kmesh.kv.rope.apply_rotation, planted in the function's own code object so
# every caller (rope.rotate, rope.shift, restore's torch path) runs it. Before issue 8 the stage passed all
# 47 cases with it: the cached keys and the float64 reference were made by the same reversed rotation.
ROTATION_MUTATION = """
import inspect, textwrap
src = textwrap.dedent(inspect.getsource(kmesh.kv.rope.apply_rotation))
line = 's = sin.to(math_dtype).reshape(view)'
assert src.count(line) == 1, 'mutation target not found in apply_rotation'
ns = {}
exec(compile(src.replace(line, 's = -sin.to(math_dtype).reshape(view)'), kmesh.kv.rope.__file__, 'exec'),
     kmesh.kv.rope.__dict__, ns)
kmesh.kv.rope.apply_rotation.__code__ = ns['apply_rotation'].__code__
"""


def run_stage(tmp_path: Path, profile: str, mutation: str = "", extra: list[str] | None = None,
              timeout: float = 300) -> tuple[int, dict, str]:
    """(exit code, written result.json, stderr) of `kmesh run synthetic` with `mutation` applied first."""
    out = tmp_path / "result.json"
    args = ["run", "synthetic", "--profile", profile, "--out", str(out), *(extra or [])]
    code = PRELUDE + textwrap.dedent(mutation) + f"\nsys.exit(kmesh.cli.main({args!r}))\n"
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert out.is_file(), f"no result written (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return p.returncode, json.loads(out.read_text()), p.stderr


def restore_cases(result: dict) -> list[dict]:
    return [c for c in result["cases"] if not c["id"].startswith("rope-")]


def failed_checks(case: dict) -> set[str]:
    return {k for k, v in case["checks"].items() if v["ok"] is False}


def assert_slot_bug_caught(rc: int, result: dict, stderr: str) -> None:
    assert rc == 1, stderr[-3000:]
    cases = restore_cases(result)
    assert len(cases) >= 32
    for c in cases:
        assert c["error"] is None, (c["id"], c["error"])          # caught by a check, not by a crash
        bad = failed_checks(c)
        assert "canary_untouched" in bad, (c["id"], bad)
        if not c["id"].startswith("mla"):
            assert "values_bit_identical" in bad, (c["id"], bad)


def assert_rotation_bug_caught(rc: int, result: dict, stderr: str) -> None:
    assert rc == 1, stderr[-3000:]
    cases = restore_cases(result)
    moved = [c for c in cases if c["params"]["shift"] != "none"]
    assert len(moved) >= 32
    for c in moved:
        assert c["error"] is None, (c["id"], c["error"])
        assert "keys_vs_float64" in failed_checks(c), (c["id"], failed_checks(c))
    accuracy = [c for c in result["cases"] if c["id"].startswith("rope-accuracy-")]
    assert len(accuracy) == 2
    for c in accuracy:
        assert "fp32_shift_max_rel_le_1e-5" in failed_checks(c), (c["id"], failed_checks(c))


# ------------------------------------------------------------------------------------------- CPU profile

def test_control_unmutated_stage_passes_without_vllm(tmp_path):
    rc, result, stderr = run_stage(tmp_path, "cpu")
    assert rc == 0, stderr[-3000:]
    assert result["summary"]["failed"] == 0 and result["summary"]["passed"] >= 34


@pytest.mark.parametrize("name", list(SLOT_MUTATIONS))
def test_slot_addressing_bug_fails_the_stage_cpu(tmp_path, name):
    assert_slot_bug_caught(*run_stage(tmp_path, "cpu", SLOT_MUTATIONS[name]))


def test_reversed_rotation_fails_the_stage_cpu(tmp_path):
    assert_rotation_bug_caught(*run_stage(tmp_path, "cpu", ROTATION_MUTATION))


# ------------------------------------------------------------------------------------------- cuda profile

@pytest.fixture(scope="module")
def cuda_results(tmp_path_factory) -> Path:
    """A results dir holding the kernels stage's cubin (the cuda synthetic profile launches it)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: the cuda profile needs results/cuda/kernels/restore_rope.cubin")
    d = tmp_path_factory.mktemp("cuda-results")
    p = subprocess.run([sys.executable, "-m", "kmesh", "run", "kernels", "--profile", "cuda",
                        "--set", f"results_dir={d}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    cubin = d / "cuda" / "kernels" / "restore_rope.cubin"
    if not cubin.is_file():
        pytest.skip(f"the kernels stage built no {cubin.name} (rc {p.returncode}): {p.stderr[-500:]}")
    return d


@pytest.mark.gpu
def test_control_unmutated_stage_passes_without_vllm_cuda(tmp_path, cuda_results):
    rc, result, stderr = run_stage(tmp_path, "cuda", extra=["--set", f"results_dir={cuda_results}"])
    assert rc == 0, stderr[-3000:]
    assert result["summary"]["failed"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SLOT_MUTATIONS))
def test_slot_addressing_bug_fails_the_stage_cuda(tmp_path, cuda_results, name):
    rc, result, stderr = run_stage(tmp_path, "cuda", SLOT_MUTATIONS[name],
                                   extra=["--set", f"results_dir={cuda_results}"])
    assert_slot_bug_caught(rc, result, stderr)


@pytest.mark.gpu
def test_reversed_rotation_fails_the_stage_cuda(tmp_path, cuda_results):
    rc, result, stderr = run_stage(tmp_path, "cuda", ROTATION_MUTATION, extra=["--set", f"results_dir={cuda_results}"])
    assert_rotation_bug_caught(rc, result, stderr)
