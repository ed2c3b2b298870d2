"""Stage `restore_bench`: the cpu path for real (matched pairs, byte checks), negative controls for the byte
checks, the report's bandwidth table/plot; the cuda path on a GPU only."""
import pytest
import torch

from kmesh.config import load_config
from kmesh.errors import StageError
from kmesh.report import plots, tables
from kmesh.stages import restore_bench
from kmesh.stages.restore_bench.cases import SHAPES, build, check_restored, shape

SMALL = {"restore_bench": {"shapes": ["qwen05b-512-fp8"], "pairs": 2, "reps": 1}}


def test_cpu_stage_times_pairs_and_checks_bytes(tmp_path):
    cfg = load_config(profile="cpu", overrides={**SMALL, "results_dir": str(tmp_path)})
    res = restore_bench.run(cfg)
    assert res.ok, [(c.id, c.error, c.checks) for c in res.cases]
    s = res.summary()["shapes"]["qwen05b-512-fp8"]
    assert s["bytes_differ"] == 0 and s["kernel_vs_copy"] is None and s["speedup_vs_torch"] is None
    assert s["copy_GBps"] > 0 and s["torch_GBps"] > 0 and s["torch_vs_copy"] > 0
    t = res.timings["qwen05b-512-fp8:copy_vs_torch"]
    assert t["kind"] == "paired" and t["design"]["pairs"] == 2 and t["arms"] == {"A": "copy", "B": "torch"}
    orders = [p["order"] for p in t["raw"]]
    assert orders[0] != orders[1]   # alternating arm order
    # no device case on cpu (its check was constant); the one-launch child restore is a skip with its reason
    assert [c.id for c in res.cases] == ["qwen05b-512-fp8", "child-restore"]
    assert res.cases[1].skipped and "cuda" in res.cases[1].skipped.lower()
    case = next(c for c in res.cases if c.id == "qwen05b-512-fp8")
    assert case.checks["torch_values_byte_identical"]["ok"] and case.checks["torch_outside_cells_untouched"]["ok"]


def test_device_case_is_a_real_check_of_the_gpu(tmp_path, monkeypatch):
    """Issue 21 item 6: `device_usable` was the literal True. The cuda profile's device case now fails where torch
    sees no GPU (and on one, checks a round trip of bytes); the cpu profile has no such case."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = restore_bench.run(load_config(profile="cuda", overrides={"results_dir": str(tmp_path)}))
    (case,) = res.cases
    assert case.id == "device" and case.checks["cuda_available"]["ok"] is False and not res.ok
    assert "device_usable" not in case.checks


@pytest.fixture(scope="module")
def bench():
    return build(shape("qwen05b-512-fp8"), 7, "cpu")


def test_byte_checks_pass_for_the_real_restore(bench):
    chk = check_restored(bench, lambda p: p.run("torch"))
    assert chk["values_differ"] == 0 and chk["outside_differ"] == 0


def test_byte_checks_catch_a_stray_write(bench):
    def stray(p):
        p.run("torch")
        p.flat.view(torch.uint8)[0] ^= 0xFF   # one byte outside the restore (block table never starts at 0? check)

    chk = check_restored(bench, stray)
    assert chk["outside_differ"] >= 1 and chk["values_differ"] == 0


def test_byte_checks_catch_a_wrong_value(bench):
    def wrong(p):
        p.run("torch")
        b, n = p.layout.split_slots(p.slots[:1])
        p.layout.v_tensor(p.flat)[0, b, n] = p.layout.v_tensor(p.flat)[0, b, n] ^ 1   # flip a bit of token 0's V

    chk = check_restored(bench, wrong)
    assert chk["values_differ"] >= 1 and chk["outside_differ"] == 0


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(StageError, match="unknown shape 'nope'"):
        shape("nope")


def test_cuda_profile_names_the_measured_shapes():
    cfg = load_config(profile="cuda")
    assert cfg.section("restore_bench")["shapes"] == ["qwen05b", "mha-large", "qwen05b-fp8"]
    assert SHAPES["qwen05b"].tokens == 8192 and SHAPES["mha-large"].kv_heads == 8


def test_bandwidth_table_and_plot(tmp_path):
    shapes = {"a": {"segment_bytes": 2**20, "copy_GBps": 4000.0, "kernel_GBps": 3400.0, "torch_GBps": 150.0,
                    "kernel_vs_copy": 0.85, "speedup_vs_torch": 23.0, "bytes_differ": 0}}
    df = tables.bandwidth_frame(shapes)
    assert list(df["kernel GB/s"]) == [3400.0] and list(df["bytes ≠"]) == [0]
    assert "torch/copy bandwidth" not in df.columns   # cuda rows: no cpu-only column
    out = plots.bandwidth_plot(shapes, tmp_path / "bw", ["png"], "t")
    assert out[0].stat().st_size > 0


@pytest.mark.gpu
def test_cuda_stage_kernel_equals_torch(tmp_path):
    cfg = load_config(profile="cuda", overrides={"results_dir": str(tmp_path), "restore_bench": {
        "shapes": ["qwen05b-512", "qwen05b-512-fp8"], "pairs": 2, "reps": 2, "torch_reps": 1}})
    res = restore_bench.run(cfg)
    assert res.ok, [(c.id, c.error) for c in res.cases]
    for s in res.summary()["shapes"].values():
        assert s["bytes_differ"] == 0 and s["kernel_vs_copy"] > 0 and s["speedup_vs_torch"] > 0
