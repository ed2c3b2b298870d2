"""The group stage's parts against a real cache service process, on a tiny CPU model: the group load and its
barrier (kmesh.stages.group.load), the whole group path with its layer write-back (kmesh.stages.group.path), the
failure case (member B failing after layer 0 with a write-back still pending), the measurements' helpers
(kmesh.stages.group.bench).

Model and workload as tests/test_equivalence_parts.py (4 layers; 3 segments of 80 tokens; blocks of 16), here
with 3 children A, B, C. The service copies in 64 KiB chunks (a segment = 2 chunks). ~15 s on CPU.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kmesh.harness.child import ChildContext, full_reference, run_child
from kmesh.harness.leader import export_segments
from kmesh.harness.service import Harness
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import ByteTokenizer, WorkloadSpec, build
from kmesh.kv.errors import SegmentCorruptError
from kmesh.kv.sources import InProcessSegments
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import compare_states, identical
from kmesh.model.runner import LayerRunner
from kmesh.stages.group import bench as group_bench
from kmesh.stages.group.load import GroupAdmissionError, GroupLoad
from kmesh.stages.group.path import run_group
from kmesh.transfer.engine import TransferEngine
from tiny_llama import tiny_llama

SPEC = WorkloadSpec(prompt_tokens=352, segment_tokens=(80, 80, 80), children=3, block_size=16)
MAX_NEW = 8


@pytest.fixture(scope="module")
def env():
    runner = LayerRunner(tiny_llama())
    w = build(ByteTokenizer(300), 0, SPEC)
    lc = runner.new_cache(len(w.leader_ids), 16)
    runner.prefill(torch.tensor(w.leader_ids), lc)
    export = export_segments(runner, lc, w, b"group-stage-test")
    ctx = ChildContext(runner, export.catalog, TransferEngine("cpu"), RepairConfig(), MAX_NEW)
    sec = {"children": 3, "scaling": {"sizes": [1, 3], "pairs": 1, "warmup": 0}, "batched_tolerance": 1e-4,
           "failure": {"child": "B", "after_layer": 0},
           "invariants": {"children": 2, "rows_rel_bound": 1e-4, "logits_rel_bound": 1e-4, "chance_seeds": 2}}
    s = SimpleNamespace(runner=runner, workload=w, export=export, ctx=ctx, device=torch.device("cpu"), sec=sec,
                        group=w.children, cfg=SimpleNamespace(section=lambda name: {"pairs": 1, "warmup": 0}))
    staging = torch.empty(export.catalog.nbytes, dtype=torch.uint8)
    private = torch.empty_like(staging)
    serial = {ch.name: run_child(ctx, ch, InProcessSegments(export), staging, private) for ch in w.children}
    fulls = {ch.name: full_reference(ctx, ch) for ch in w.children}
    with Harness(device="cpu", heartbeat_timeout_s=30.0, chunk_bytes=65536) as h:
        with ServiceSide(h, export, torch.device("cpu")) as svc:
            svc.save_leader()
            yield SimpleNamespace(s=s, svc=svc, h=h, serial=serial, fulls=fulls)
    ctx.engine.close()


def test_group_load_admits_every_member_then_closes_every_handle(env):
    cat = env.s.export.catalog
    with GroupLoad(env.svc, cat, ["A", "B", "C"]) as g:
        g.load_all()
        report = g.admit()
        assert g.loads == 3 * len(cat.entries) == report["loads"]
        assert set(report["members"]) == {"A", "B", "C"}
        assert all(m["service"]["state"] == "active" and m["service"]["in_flight_count"] == 0
                   for m in report["members"].values())
        assert len(env.h.status()["registrations"]) == 3
    assert env.svc.no_leaks(), env.svc.leaks()


def test_admission_refuses_an_incomplete_group(env):
    with GroupLoad(env.svc, env.s.export.catalog, ["A", "B"]) as g:
        g.stagings["A"].tensor.zero_()
        with pytest.raises(GroupAdmissionError, match="0 loads accepted, expected 6"):
            g.admit()                     # nothing loaded yet: no member's inputs may be released
    assert env.svc.no_leaks()


def test_admission_refuses_a_member_whose_handle_was_closed(env):
    with GroupLoad(env.svc, env.s.export.catalog, ["A", "B"]) as g:
        g.load_all()
        env.svc.client.close(g.stagings["B"].reg)      # B's registration leaves "active"
        with pytest.raises(GroupAdmissionError, match=r"B: (state|registration \d+ not listed)"):
            g.admit()
    assert env.svc.no_leaks()


def test_admission_refuses_an_original_unlike_the_catalog(env):
    cat = env.s.export.catalog
    e0 = cat.entries[0]
    bad = dataclasses.replace(cat, entries=(dataclasses.replace(e0, sha256="0" * 64), *cat.entries[1:]))
    with GroupLoad(env.svc, bad, ["A"]) as g:
        with pytest.raises(SegmentCorruptError):   # our own digest check on the staged bytes fires first
            g.load_all()
        g.loads = len(cat.entries)
        with pytest.raises(GroupAdmissionError, match="differs from the catalog"):
            g.admit()                                # and the store's committed digest disagrees too
    assert env.svc.no_leaks()


def test_group_path_is_bit_identical_to_serial(env):
    run = run_group(env.s, env.svc, env.s.group)
    assert run.loads == 9 and run.order_layer_major and all(run.writeback_equal.values())
    for n, o in run.outcomes.items():
        cmp = compare_states(env.serial[n], o)
        assert identical(cmp), cmp
    assert env.svc.no_leaks(), env.svc.leaks()


def test_group_failure_case(env):
    run = run_group(env.s, env.svc, env.s.group, fail={"B": 0}, gated="B")
    f = run.failure["B"]
    assert f["layer"] == 0 and f["pending_at_failure"] >= 1
    assert f["events"][-2:] == ["pending-before-recompute:0", "recompute"]
    b = run.outcomes["B"]
    # the recompute ran in B's working cache as the failure left it: its restored segments and its layer 0
    # (every position) were there, nothing past the prompt (the canaries)
    T = len(env.s.group[1].ids)
    assert f["slots_written_before_recompute"] == T
    assert bool(b.written_before_recompute[:T].all()) and not bool(b.written_before_recompute[T:].any())
    assert b.fallback and b.arm == "full"
    assert b.tokens == env.fulls["B"].tokens and torch.equal(b.k, env.fulls["B"].k)
    for n in ("A", "C"):
        assert identical(compare_states(env.serial[n], run.outcomes[n]))
    assert env.svc.no_leaks(), env.svc.leaks()
    assert not env.s.ctx.engine.pending()


def test_bench_helpers(env):
    from kmesh.result import Result

    res = Result("group", "cpu", {}, [])
    unbatched = run_group(env.s, env.svc, env.s.group).outcomes
    bound, batched = group_bench.batched_agreement(res, env.s, env.serial, unbatched)
    assert bound["rotation_bit_identical"] and bound["tokens_equal"] and set(batched) == set(unbatched)
    # one meaning everywhere: mask_comparisons made, masks_equal found equal (2 children x 4 layers here)
    assert bound["masks_equal"] == bound["mask_comparisons"] == len(unbatched) * env.s.runner.num_layers
    assert bound["max_abs_diff"] <= 1e-4
    held = group_bench.bytes_held(res, env.s, sum(e.nbytes for e in env.s.export.catalog.entries))
    row = held["by_group_size"]["3"]
    assert row["store_bytes_per_child"] * 3 == row["store_bytes_total"]
    assert 0 < row["diff_bytes_per_child"] < row["repaired_copy_bytes_per_child"]
    # layers 0 and 1 (before and at the check layer) recompute every position: at least those rows changed
    for pc in held["per_child"]:
        assert pc["rows_changed_per_layer"][0] == pc["restored_tokens"]
    assert all(c.passed for c in res.cases), [(c.id, c.checks, c.error) for c in res.cases]


def test_peak_memory_sees_a_large_allocation():
    group_bench._pin_mmap_threshold()
    big = group_bench.peak_memory(torch.device("cpu"), lambda: torch.ones(64 << 20, dtype=torch.uint8).sum())
    small = group_bench.peak_memory(torch.device("cpu"), lambda: torch.ones(16, dtype=torch.uint8).sum())
    assert big["bytes"] >= 60 << 20 and small["bytes"] < 8 << 20, (big, small)
    assert "not device memory" in big["what"]


def test_rotation_check_fails_on_any_backend_when_a_byte_differs(env, monkeypatch):
    """Issue 21 item 6: `rotation_recorded` passed whenever restore_backend was not torch (`... or backend !=
    "torch"`). Now the per-member restore of any backend must write the layer-wise restore's bytes exactly."""
    from kmesh.result import Result

    real = group_bench.restore_child

    def one_byte_off(cache, catalog, private, child, runner, backend="torch"):
        restored = real(cache, catalog, private, child, runner, "torch")    # the CPU has no CUDA kernel
        cache.raw.view(torch.uint8)[0] ^= 0x01
        return restored

    monkeypatch.setattr(group_bench, "restore_child", one_byte_off)
    s = SimpleNamespace(**{**vars(env.s), "ctx": dataclasses.replace(env.s.ctx, restore_backend="cuda")})
    res = Result("group", "cuda", {}, [])
    unbatched = run_group(env.s, env.svc, env.s.group).outcomes
    bound, _ = group_bench.batched_agreement(res, s, env.serial, unbatched)
    (case,) = res.cases
    assert case.checks["rotation_bit_identical"]["ok"] is False and "rotation_recorded" not in case.checks
    assert case.checks["rotation_bit_identical"]["value"] == {ch.name: 1 for ch in env.s.group}
    assert bound["rotation_checked"] is False and case.passed is False


def _scaling_setup(env, pairs: int, **extra):
    sec = {**env.s.sec, "scaling": {"sizes": [2], "pairs": pairs, "warmup": 0}}
    return SimpleNamespace(**{**vars(env.s), "sec": sec, **extra})


def test_scaling_pairs_both_arms_with_one_serial_baseline(env):
    """Issue 22 item 5: the serial arm ran twice (once per paired comparison) and one such arm differed 34 %
    between its two pair sets. Now the three arms run in every round, so both comparisons share the serial runs,
    the order is reversed from round to round, and every arm's spread is recorded."""
    from kmesh.result import Result

    res = Result("group", "cpu", {}, [])
    out = group_bench.scaling(res, _scaling_setup(env, pairs=3))
    lm, bt = res.timings["group_2_serial_vs_layer_major"], res.timings["group_2_serial_vs_batched"]
    assert [p["serial"] for p in lm["raw"]] == [p["serial"] for p in bt["raw"]]
    assert len(bt["raw"]) == 3 and [p["order"][0] for p in bt["raw"]] == ["serial", "batched", "serial"]
    row = out["2"]
    assert row["serial_ms"] == lm["summary"]["repair"]["median_a"] * 1e3
    spread = row["spread"]["serial"]
    assert spread["min_ms"] <= spread["q1_ms"] <= spread["median_ms"] <= spread["q3_ms"] <= spread["max_ms"]
    assert spread["median_ms"] == pytest.approx(row["serial_ms"])
    assert all(c.passed for c in res.cases), [(c.id, c.checks, c.error) for c in res.cases]


@pytest.mark.parametrize("attention", ["padded", "member"])
def test_scaling_takes_the_configured_batched_attention(env, attention, monkeypatch):
    from kmesh.model import group as group_math
    from kmesh.result import Result

    seen = []
    original = group_math._batched_step
    monkeypatch.setattr(group_math, "_batched_step",
                        lambda r, st, att="padded": (seen.append(att), original(r, st, att)))
    setup = _scaling_setup(env, pairs=1)
    setup.sec = {**setup.sec, "batched_attention": attention}
    res = Result("group", "cpu", {}, [])
    group_bench.scaling(res, setup)
    (case,) = res.cases
    assert case.passed and case.params["batched_attention"] == attention and set(seen) == {attention}


def test_scaling_graphs_need_a_cuda_group(env):
    from kmesh.result import Result

    setup = _scaling_setup(env, pairs=1)
    setup.sec = {**setup.sec, "scaling": {**setup.sec["scaling"], "graphs": True}}
    with pytest.raises(group_bench.GroupBenchError, match="CUDA"):
        group_bench.scaling(Result("group", "cpu", {}, []), setup)


def test_scaling_refuses_a_size_the_workload_cannot_fill(env):
    from kmesh.result import Result

    res = Result("group", "cpu", {}, [])
    group_bench.scaling(res, _scaling_setup(env, pairs=1), sizes=[9])
    (case,) = res.cases
    assert not case.passed and "only 3 children" in str(case.error)


def test_spread_of_one_and_of_many():
    one = group_bench.spread([0.002])
    assert one["median_ms"] == one["q1_ms"] == one["max_ms"] == 2.0 and one["iqr_over_median"] == 0.0
    many = group_bench.spread([0.001, 0.002, 0.003, 0.004, 0.005])
    assert many["q1_ms"] == 2.0 and many["q3_ms"] == 4.0 and many["iqr_over_median"] == pytest.approx(2 / 3)


def test_rag_scaling_on_the_rag_shape(env):
    """The scaling over the RAG-shaped workload (many chunks, every child its own order): the batched group over
    2 children of 4 chunks, its logits within the bound and its cases passing."""
    from kmesh.harness.workload import RagSpec, build_rag
    from kmesh.result import Result

    spec = RagSpec(chunks=4, chunk_tokens=96, prompt_tokens=512, children=2, block_size=16,
                   leader_preamble_tokens=16, min_restorable=0.7)     # bytes: a fact sentence needs ~70 of them
    w = build_rag(ByteTokenizer(300), 0, spec)
    runner = env.s.runner
    lc = runner.new_cache(len(w.leader_ids), 16)
    runner.prefill(torch.tensor(w.leader_ids), lc)
    export = export_segments(runner, lc, w, b"group-rag-test")
    ctx = dataclasses.replace(env.s.ctx, catalog=export.catalog)
    res = Result("group", "cpu", {}, [])
    out = group_bench.scaling(res, _scaling_setup(env, pairs=1, workload=w, export=export, ctx=ctx), sizes=[2],
                              case_prefix="rag-scaling", timing_prefix="group_rag", goal_at=2)
    (case,) = res.cases
    assert case.id == "rag-scaling-2" and case.passed, (case.checks, case.error)
    assert case.params["segments"] == 4 and "group_rag_2_serial_vs_batched" in res.timings
    assert out["goal_batched_2x_at_2"]["goal"] == 2.0 and "serial_iqr_over_median" in out["goal_batched_2x_at_2"]
    assert case.checks["batched_logits_max_abs_diff"]["value"] <= 1e-3


def test_invariants_case_replays_both_paths_and_names_a_wrong_row(env):
    """repair-matches-float64 (issue 50): the layer-major and batched outcomes of the first members replayed in
    float64; one recomputed row's K changed in the batched outcome fails `recomputed_rows_kv_within_bound` by name."""
    from kmesh.result import Result
    from kmesh.stages.group.stage import _invariants_case

    unbatched = run_group(env.s, env.svc, env.s.group).outcomes
    res = Result("group", "cpu", {}, [])
    _, batched = group_bench.batched_agreement(res, env.s, env.serial, unbatched)
    _invariants_case(res, env.s, unbatched, batched)
    case = res.cases[-1]
    assert case.id == "repair-matches-float64" and case.passed, (case.checks, case.error)
    assert set(case.checks["recomputed_rows_kv_within_bound"]["value"]) == {
        "layer-major/A", "layer-major/B", "batched/A", "batched/B"}
    wrong = dataclasses.replace(batched["B"], k=batched["B"].k.clone())
    row = int(wrong.masks[2].nonzero()[0])
    wrong.k[2, row] += 0.25
    res = Result("group", "cpu", {}, [])
    _invariants_case(res, env.s, unbatched, {**batched, "B": wrong})
    (case,) = res.cases
    assert not case.passed and not case.checks["recomputed_rows_kv_within_bound"]["ok"]
    assert case.checks["selection_is_reference_top_k"]["ok"] and case.checks["masks_follow_rule"]["ok"]
