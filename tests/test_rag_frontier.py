"""The RAG-shaped frontier (kmesh.stages.equivalence.rag, issue 22) on a tiny CPU model: every arm of every
child measured against full recompute, each arm's recomputed positions checked against its rule as the workload's
placements give it (a child path that hands the epic arm fewer chunks fails that check), stock-matched at the
matched repair arm's count, timed rounds with an end-to-end arm through a real service, the frontier and its goals,
the report's table and plot. kmesh.model.frontier's dominance rules on their own. ~15 s."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kmesh.harness.child import ChildContext, full_reference
from kmesh.harness.modelsetup import ModelSetup, leader_prefill
from kmesh.harness.workload import ByteTokenizer, RagSpec, build_rag
from kmesh.model.blend import RepairConfig
from kmesh.model.frontier import Point, better_at_no_more_cost, dominated_by, dominates, pareto_front
from kmesh.model.runner import LayerRunner
from kmesh.result import Result
from kmesh.stages.equivalence import endtoend, rag
from kmesh.transfer.engine import TransferEngine
from prefill_spy import PrefillLog
from tiny_llama import tiny_llama

RAG = {"workload": {"chunks": 4, "chunk_tokens": 96, "prompt_tokens": 512, "children": 3, "block_size": 16,
                    "leader_preamble_tokens": 16, "min_restorable": 0.7},
       "max_new_tokens": 4, "repair_ratios": [0.05, 0.3], "matched_ratio": 0.3, "epic_tokens": [4, 16],
       "quality_batch_children": 2,     # 3 children: a batch of two, then one
       "ttft": {"children": 1, "pairs": 2, "warmup": 0}}
ARMS = ["full", "naive", "stock", "repair-0.05", "repair-0.30", "stock-matched", "epic-4", "epic-16"]


class _Cfg:
    seed = 0

    @staticmethod
    def section(name: str) -> dict:
        assert name == "timing"
        return {"pairs": 1, "warmup": 1}     # not the rag ttft's own (2, 0): the stage must read its own section


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama()
    runner = LayerRunner(model)
    tok = ByteTokenizer(vocab_size=300)
    # the stage's own setup prefills the equivalence workload; the rag cases only need the runner and context
    placeholder = build_rag(tok, 1, RagSpec(**RAG["workload"]))
    export = leader_prefill(runner, placeholder, b"kmesh-rag-test/placeholder")
    # max_new_tokens 6, not the rag section's 4: the rag cases must decode by their own section
    ctx = ChildContext(runner, export.catalog, TransferEngine("cpu"), RepairConfig(check_layers=(1,)), 6)
    # an end-of-turn token the first child's full continuation reaches at its second token: continuations of
    # different lengths meet in the batched decode, and one that ignored it would run past it
    first = build_rag(tok, _Cfg.seed, RagSpec(**RAG["workload"])).children[0]
    ctx = dataclasses.replace(ctx, stop_ids=(full_reference(ctx, first).tokens[1],))
    sec = {"rag": RAG, "repair": {"check_layers": [1], "recompute_ratio": 0.15},
           # stock's check layer differs from repair's: stock-matched must take stock's (its layers before it
           # recompute every position), not whichever arm's config comes first
           "stock": {"check_layers": [2], "recompute_ratio": 0.15}, "ttft": {"graphs": False},
           "heartbeat_timeout_s": 30.0, "chunk_bytes": 65536}
    yield ModelSetup(cfg=_Cfg(), sec=sec, device=torch.device("cpu"), model=model, what="tiny-llama", tok=tok,
                     runner=runner, workload=placeholder, export=export, ctx=ctx)
    ctx.engine.close()


def _failed(res: Result) -> dict:
    return {c.id: (c.error, {k: v for k, v in c.checks.items() if v["ok"] is False}) for c in res.cases
            if c.passed is not True}


@pytest.fixture(scope="module")
def ran(setup):
    res = Result("equivalence", "test", provenance={})
    return res, rag.rag_cases(res, setup)


def test_every_arm_measured_checked_and_timed(ran, setup):
    res, out = ran
    assert not _failed(res)
    assert [c.id for c in res.cases] == ["rag-workload", "rag-quality", "rag-ttft"]
    assert out["arms"] == ARMS and list(out["quality"]) == ARMS and out["matched_arm"] == "repair-0.30"
    assert all(out["quality"][a]["children"] == 3 for a in ARMS)
    quality = next(c for c in res.cases if c.id == "rag-quality")
    for check in ("arms_used_segments", "every_arm_recomputed_what_its_rule_says", "continuations_end_as_decode_says",
                  "stock_matched_budget_equals_matched_repair", "teacher_forcing_reproduces_full_tokens"):
        assert quality.checks[check]["ok"] is True, check
    q = out["quality"]
    # full's state is the reference's bit for bit (checked): its KL is the batched forward's rounding floor only
    assert 0 <= q["full"]["kl_teacher_forced_mean"] < 1e-9 and q["full"]["recomputed_fraction_of_positions_mean"] == 1
    assert q["full"]["kl_first_token_mean"] == 0 and q["full"]["top1_teacher_forced"] == 1
    assert q["stock-matched"]["recomputed_positions"] == q["repair-0.30"]["recomputed_positions"]
    per_child = next(c for c in res.cases if c.id == "rag-quality").checks["per_child"]["value"]
    T = RAG["workload"]["prompt_tokens"]
    for matched, rep in zip(per_child["stock-matched"], per_child["repair-0.30"]):
        assert matched["recomputed_per_layer"][:2] == [T, T] and rep["recomputed_per_layer"][0] == T
        assert rep["recomputed_per_layer"][1] == matched["recomputed_per_layer"][2] < T
    # repair at a larger ratio recomputes more; epic with k = chunk length recomputes every position
    assert all(a < b for a, b in zip(q["repair-0.05"]["recomputed_positions"],
                                     q["repair-0.30"]["recomputed_positions"]))
    assert q["epic-16"]["recomputed_positions"] < q["full"]["recomputed_positions"]
    # every reuse arm and the end-to-end arm paired with full in the same rounds, stored as timings
    for name in ARMS[1:] + ["end-to-end"]:
        assert out["ttft"][name]["pairs"] == 2 and f"rag_ttft_full_vs_{name}" in res.timings
        assert res.timings[f"rag_ttft_full_vs_{name}"]["design"]["warmup"] == 0
    assert out["ttft"]["end-to-end"]["arm"] == "repair-0.30"
    # the end-to-end arm's parts are published with its row (mutation survivors rag._ttft #267-#269)
    assert set(out["ttft"]["end-to-end"]["parts_ms_median"]) == set(endtoend.PARTS)
    # the rag section's max_new_tokens, not the context's; the summary's workload entry (the report's caption
    # reads it) and its frontier (mutation survivors rag_cases #63, #35-#47, #149-#152)
    assert quality.params["max_new_tokens"] == RAG["max_new_tokens"] != setup.ctx.max_new_tokens
    w = rag.rag_workload(setup)
    assert out["workload"] == {"chunks": 4, "children": 3, "prompt_tokens": 512, "sha256": w.sha256(),
                               "restorable_fraction": rag._restorable(w)}
    assert [r["arm"] for r in out["frontier"]] == ARMS and "front" in out["goals"]


def test_frontier_points_front_and_goals(ran):
    _, out = ran
    rows = {r["arm"]: r for r in out["frontier"]}
    assert list(rows) == ARMS and rows["full"]["ttft_ratio_vs_full"] == 1.0
    for arm in ARMS[1:]:
        assert rows[arm]["ttft_ratio_vs_full"] == out["ttft"][arm]["median_ratio_b_over_a"]
        assert rows[arm]["kl_teacher_forced_mean"] == out["quality"][arm]["kl_teacher_forced_mean"]
    points = [Point(a, r["ttft_ratio_vs_full"], r["kl_teacher_forced_mean"]) for a, r in rows.items()]
    assert out["goals"]["front"] == pareto_front(points) and "full" in out["goals"]["front"]
    assert {r["arm"] for r in out["frontier"] if r["on_front"]} == set(out["goals"]["front"])
    beaten = out["goals"]["arms_with_lower_kl_at_no_more_ttft"]
    assert set(beaten) == {"repair-0.05", "repair-0.30"}
    assert out["goals"]["goal_no_arm_better_than_repair"]["met"] == (not any(beaten.values()))
    ideal = out["goals"]["goal_within_ideal"]
    assert ideal["ideal_ms"] > 0 and math.isclose(ideal["ratio"], ideal["end_to_end_ms"] / ideal["ideal_ms"])


def _one_child(ttft: dict) -> dict:
    """The rag section on one child, rag-ttft as `ttft` says."""
    return dict(RAG, workload=dict(RAG["workload"], children=1), ttft=ttft)


def test_epic_handed_fewer_chunks_fails_the_rule_check(setup, monkeypatch):
    """The arms' recomputed counts are checked against the workload's placements, not the arm's own inputs."""
    import kmesh.harness.child

    real = kmesh.harness.child.restored_chunks
    monkeypatch.setattr(kmesh.harness.child, "restored_chunks", lambda child, restored: real(child, restored)[1:])
    res = Result("equivalence", "test", provenance={})
    monkeypatch.setitem(setup.sec, "rag", _one_child({"children": 1, "pairs": 1, "warmup": 0}))
    rag.rag_cases(res, setup)
    check = next(c for c in res.cases if c.id == "rag-quality").checks["every_arm_recomputed_what_its_rule_says"]
    assert check["ok"] is False and set(check["value"]["A"]) == {"epic-4", "epic-16"}
    assert all(v["expected"] > v["recomputed"] for v in check["value"]["A"].values())   # one chunk's head fewer


def _one_child_quality_check(setup, monkeypatch, name: str) -> dict:
    """The RAG cases on one child (one TTFT pair), with whatever the caller planted: rag-quality's check `name`."""
    res = Result("equivalence", "test", provenance={})
    monkeypatch.setitem(setup.sec, "rag", _one_child({"children": 1, "pairs": 1, "warmup": 0}))
    rag.rag_cases(res, setup)
    return next(c for c in res.cases if c.id == "rag-quality").checks[name]


def test_an_arm_that_fell_back_fails_arms_used_segments_and_is_named(setup, monkeypatch):
    """A child path that recomputed instead of restoring (a fallback) is not the arm it claims to measure."""
    import dataclasses

    real = rag.run_child

    def naive_falls_back(ctx, child, source, staging, private, arm="repair"):
        out = real(ctx, child, source, staging, private, arm=arm)
        return dataclasses.replace(out, fallback="ObjectMissing: planted") if arm == "naive" else out

    monkeypatch.setattr(rag, "run_child", naive_falls_back)
    check = _one_child_quality_check(setup, monkeypatch, "arms_used_segments")
    assert check["ok"] is False and check["value"] == {"A": {"naive": "ObjectMissing: planted"}}


def test_rag_ttft_times_what_each_arm_claims(setup, monkeypatch):
    """rag-ttft as the shipped config runs it (config.yaml's rag.ttft is {children: 2}: pairs and warm-up come from
    timing.*): every run of a reuse arm restores its own cache before its prefill, the full arm never restores, and
    stock-matched is timed with stock's rule (its check layer), as rag-quality measured it (mutation survivors
    rag._ttft #13/#15/#22/#24, #53, #149). Two rounds (warm-up + pair): in the second, a reuse arm that skipped its
    restore would follow its own prefill. The end-to-end arm is a stand-in without a service (what it checks is
    `ran`'s), which costs this test a fraction of a second instead of a service's start."""
    import contextlib
    from types import SimpleNamespace

    @contextlib.contextmanager
    def no_service(case, setup, export, children, *_):
        yield SimpleNamespace(run=lambda round_index: {"ttft": [1e-3] * len(children)},
                              finish=lambda case, timing: {"parts_ms_median": {}, "loading_fraction_median": None})

    log, stocks, real_matched = PrefillLog(monkeypatch, rag), [], rag.matched_stock
    monkeypatch.setattr(rag, "matched_stock",
                        lambda stock, masks: (stocks.append(stock), real_matched(stock, masks))[1])
    monkeypatch.setattr(rag, "end_to_end_arm", no_service)
    monkeypatch.setitem(setup.sec, "rag", _one_child({"children": 1}))
    res = Result("equivalence", "test", provenance={})
    out = rag.rag_cases(res, setup)
    assert not _failed(res)
    for name in ARMS[1:] + ["end-to-end"]:           # _Cfg's timing section: 1 pair after 1 warm-up round
        assert out["ttft"][name]["pairs"] == 1 and res.timings[f"rag_ttft_full_vs_{name}"]["design"]["warmup"] == 1
    assert stocks and {s.check_layers for s in stocks} == {(2,)}      # stock's; repair's (and full's) is (1,)
    assert log.blend_arms() == {"full", "naive", "stock", "repair", "epic"} and log.misordered() == []


def test_matched_ratio_must_be_a_repair_ratio(setup, monkeypatch):
    monkeypatch.setitem(setup.sec, "rag", dict(RAG, matched_ratio=0.15))
    res = Result("equivalence", "test", provenance={})
    out = rag.rag_cases(res, setup)
    assert [c.id for c in res.cases] == ["rag-workload"] and "quality" not in out
    assert "ConfigError" in res.cases[0].error and "equivalence.rag.matched_ratio" in res.cases[0].error


def test_report_table_and_plot(ran, tmp_path):
    from kmesh.report import plots, tables

    _, out = ran
    df = tables.frontier_frame(out)
    assert list(df["arm"]) == ARMS and "on the front" in df.columns
    caption = tables.frontier_caption(out)
    assert "3 children of 512 tokens" in caption and ("met" in caption or "missed" in caption)
    written = plots.frontier_plot(out, tmp_path / "frontier", ["png", "svg"], "t")
    assert all(p.stat().st_size > 0 for p in written) and len(written) == 2


def test_frontier_rows_and_goals_from_given_measurements():
    """rag._frontier on hand-made measurements (a pure function of the quality summary and the TTFT rows): each
    arm's row carries its own measures, the goals' numbers and verdicts follow their definitions (ties included),
    and the report's table and caption read them. `ran` computes its frontier inside the first test that uses it,
    so mutmut runs the two frontier tests above against no _frontier mutant: this one calls _frontier itself
    (mutation survivors rag._frontier #37-#50, #53/#54/#56, #77/#78, #85/#86, #106/#107, #148, the ties #120/#151)."""
    from kmesh.report import tables

    arms = ARMS[:-1]                        # one epic arm is enough
    cost = {"naive": 0.3, "stock": 0.8, "repair-0.05": 0.4, "repair-0.30": 0.6, "stock-matched": 0.7, "epic-4": 0.35}
    loss = {"full": 1e-15, "naive": 0.5, "stock": 0.3, "repair-0.05": 0.2, "repair-0.30": 0.05,
            "stock-matched": 0.1, "epic-4": 0.1}
    # every measure distinct per arm, so a row holding another arm's (or another key's) value shows
    quality = {a: {"kl_teacher_forced_mean": loss[a], "kl_first_token_mean": loss[a] / 2 + i,
                   "exact_match": 0.1 * i, "top1_teacher_forced": 0.9 - 0.01 * i,
                   "recomputed_fraction_of_positions_mean": 0.2 + 0.01 * i,
                   "recomputed_fraction_of_layer_positions_mean": 0.5 if a == "repair-0.30" else 0.3 + 0.01 * i}
               for i, a in enumerate(arms)}
    ttft = {a: {"median_ratio_b_over_a": cost[a], "median_speedup_a_over_b": 1 / cost[a], "b_faster_pairs": i}
            for i, a in enumerate(arms) if a != "full"}
    # ideal = 10 ms x 0.5 + 1 ms = 6 ms; end to end 7.5 ms: exactly 1.25x (met); speedup exactly 3.0 (met)
    ttft["end-to-end"] = {"median_speedup_a_over_b": 3.0, "median_b_ms": 7.5}
    ttft.update(full_ms_median=10.0, restore_copy_ms_median=1.0)
    res = Result("equivalence", "test", provenance={})
    with res.case("rag-ttft") as case:
        rows, goals = rag._frontier(case, quality, ttft, "repair-0.30")
    assert res.cases[0].error is None
    assert [r["arm"] for r in rows] == arms
    # epic-4 (0.35, 0.1) dominates repair-0.05 (0.4, 0.2); repair-0.30 (0.6, 0.05) dominates stock-matched and stock
    front = ["naive", "epic-4", "repair-0.30", "full"]
    keys = ("kl_first_token_mean", "exact_match", "top1_teacher_forced", "recomputed_fraction_of_positions_mean",
            "recomputed_fraction_of_layer_positions_mean")
    for r in rows:
        a = r["arm"]
        assert set(r) == {"arm", "ttft_ratio_vs_full", "kl_teacher_forced_mean", *keys, "pairs_faster_than_full",
                          "on_front"}
        assert all(r[k] == quality[a][k] for k in keys) and r["on_front"] == (a in front)
        assert (r["ttft_ratio_vs_full"], r["kl_teacher_forced_mean"]) == ((1.0, 0.0) if a == "full"
                                                                          else (cost[a], loss[a]))
        assert r["pairs_faster_than_full"] == (None if a == "full" else ttft[a]["b_faster_pairs"])
    assert goals["front"] == front
    points = [Point("full", 1.0, 0.0)] + [Point(a, cost[a], loss[a]) for a in arms[1:]]
    assert goals["repair_dominates"] == {n: dominated_by(points, n) for n in ("repair-0.05", "repair-0.30")}
    assert [d["arm"] for d in goals["repair_dominates"]["repair-0.30"]] == ["stock", "stock-matched"]
    assert goals["arms_with_lower_kl_at_no_more_ttft"] == {"repair-0.05": ["epic-4"], "repair-0.30": []}
    assert goals["goal_no_arm_better_than_repair"]["met"] is False
    assert goals["goal_ttft_3x_end_to_end"] == {"arm": "repair-0.30", "goal": 3.0, "measured_speedup": 3.0,
                                                "met": True, "repair_only_speedup": 1 / 0.6}
    ideal = goals["goal_within_ideal"]
    assert (ideal["arm"], ideal["goal"], ideal["ideal_ms"], ideal["end_to_end_ms"], ideal["ratio"], ideal["met"]) == (
        "repair-0.30", 1.25, 6.0, 7.5, 1.25, True)
    summary = {"frontier": rows, "goals": goals, "matched_arm": "repair-0.30",
               "workload": {"children": 3, "prompt_tokens": 512, "chunks": 4, "restorable_fraction": 0.75}}
    df = tables.frontier_frame(summary)
    assert list(df["faster than full (pairs)"]) == ["", "1", "2", "3", "4", "5", "6"]
    assert df.set_index("arm").loc["repair-0.05", "lower KL at no more TTFT"] == "epic-4"
    caption = tables.frontier_caption(summary)
    assert "Goal ≥ 3× end to end for repair-0.30: 3.00× (met" in caption
    assert "Within 1.25× of the ideal (6 ms): 1.25× (met)" in caption


def test_device_copy_ms_is_the_median_after_one_warmup(monkeypatch):
    """The ideal restore's copy time: reps + 1 timed copies, the first dropped, the median of the rest in ms
    (mutation survivors rag._device_copy_ms #1, #8, #9, #17, #20)."""
    import contextlib
    from types import SimpleNamespace

    made = []

    class OneMsMore:                               # the n-th copy made takes n ms
        def __init__(self, device):
            made.append(device)
            self.ms = len(made)

        @contextlib.contextmanager
        def part(self, name):
            assert name == "copy"
            yield

        def seconds(self):
            return {"copy": self.ms / 1000}

    monkeypatch.setattr(rag, "Intervals", OneMsMore)
    ms = rag._device_copy_ms(SimpleNamespace(raw=torch.zeros(64, dtype=torch.uint8)), torch.device("cpu"), "cpu")
    assert made == ["cpu"] * 6 and ms == pytest.approx(4.0)   # the median of 2..6 ms: the warm-up's 1 ms dropped


def test_dominance_rules():
    a, b, c, d = Point("a", 0.5, 0.2), Point("b", 0.6, 0.3), Point("c", 0.4, 0.5), Point("d", 0.5, 0.2)
    assert dominates(a, b) and not dominates(b, a) and not dominates(a, c) and not dominates(c, a)
    assert not dominates(a, d) and not dominates(d, a)          # a tie dominates neither way
    assert pareto_front([a, b, c, d]) == ["c", "a", "d"]
    assert dominated_by([a, b, c], "a") == [{"arm": "b", "cost_ratio": pytest.approx(1.2),
                                              "loss_ratio": pytest.approx(1.5)}]
    assert better_at_no_more_cost([a, b, c], "b") == ["a"] and better_at_no_more_cost([a, b, c], "c") == []
    zero = Point("full", 1.0, 0.0)
    assert dominated_by([zero, Point("x", 1.2, 0.1)], "full")[0]["loss_ratio"] is None


def test_workload_is_the_seeds_and_each_workload_check_can_fail(setup):
    """rag-workload: the workload is a function of the config's seed (another seed, another workload), its
    restorable fraction is the smallest over children of restored / all positions, and each check fails on a
    workload that breaks it (found by mutation: a seed of None, a product for the fraction, both passed)."""
    import dataclasses

    spec = RagSpec(**RAG["workload"])
    w = rag.rag_workload(setup)
    assert w.sha256() == rag.rag_workload(setup).sha256() == build_rag(setup.tok, setup.cfg.seed, spec).sha256()
    assert w.sha256() != build_rag(setup.tok, setup.cfg.seed + 1, spec).sha256()
    by_hand = min(sum(p.end - p.start for p in c.placements) / len(c.ids) for c in w.children)
    assert rag._restorable(w) == pytest.approx(by_hand) and 0.7 <= by_hand < 1

    def failed(workload) -> set[str]:
        res = Result("equivalence", "test", provenance={})
        with res.case("rag-workload", {}) as case:
            rag._workload_checks(case, workload)
        return {name for name, c in case.checks.items() if c["ok"] is False}

    assert failed(w) == set()
    c0, c1, c2 = w.children
    assert failed(dataclasses.replace(w, children=(c0, c1))) == {"children"}
    assert failed(dataclasses.replace(w, spec=dataclasses.replace(spec, min_restorable=by_hand + 0.01))) == {
        "restorable_fraction_at_least_min"}
    # at least: a fraction equal to the minimum passes (mutation survivor _workload_checks #26)
    assert failed(dataclasses.replace(w, spec=dataclasses.replace(spec, min_restorable=rag._restorable(w)))) == set()
    assert failed(dataclasses.replace(w, children=(c0, c0, c2))) == {"orders_distinct_and_not_the_leaders"}
    p = c1.placements[0]
    edited = list(c1.ids)
    edited[p.start] = (edited[p.start] + 1) % 300
    assert failed(dataclasses.replace(w, children=(c0, dataclasses.replace(c1, ids=tuple(edited)), c2))) == {
        "chunks_in_children"}


def test_frontier_arms_give_each_epic_arm_its_own_k():
    """epic-<k> runs with epic_tokens k, not the repair section's default (mutation survivor frontier_arms #82:
    every epic arm at 16, so epic-4 published epic-16's figures)."""
    arms = rag.frontier_arms({"rag": RAG, "repair": {"check_layers": [1], "recompute_ratio": 0.15},
                              "stock": {"check_layers": [2], "recompute_ratio": 0.15}})
    assert [a.name for a in arms] == ARMS
    assert {a.name: a.config.epic_tokens for a in arms if a.blend_arm == "epic"} == {"epic-4": 4, "epic-16": 16}


def test_expected_recomputed_follows_each_rule_from_the_placements():
    """Each arm's expected count, from hand-made placements: the last position is recomputed whether restored
    or not, epic adds each chunk's first k, stock-matched takes the matched arm's last layer (None without its
    masks), stock takes int(ratio x T) but at least one (mutation survivors expected_recomputed #13, #48, #50,
    #51, #62: equal on the stage's workloads, whose prompts end in a question and whose check layer is layer 1)."""
    from types import SimpleNamespace as NS

    # 12 positions: chunks [2, 6) and [6, 11) restored; 0, 1 and the last one (11) not, the one before it (10) is
    child = NS(ids=list(range(12)), placements=[NS(start=2, end=6, tokens=4), NS(start=6, end=11, tokens=5)])
    cfg = RepairConfig(check_layers=(1,), recompute_ratio=0.15)

    def expected(blend_arm, config=cfg, masks=None, of=child):
        return rag.expected_recomputed(rag.FrontierArm("arm", blend_arm, config), of, masks)

    assert expected("full") == 12
    assert expected("naive") == 3                                             # 0, 1, 11
    assert expected("naive", of=NS(ids=list(range(12)), placements=[NS(start=2, end=12, tokens=10)])) == 3
    assert expected("epic", dataclasses.replace(cfg, epic_tokens=2)) == 7     # + 2, 3 and 6, 7
    assert expected("repair") == 3 + math.ceil(0.15 * 9)
    masks = torch.zeros(4, 12, dtype=torch.bool)
    masks[0], masks[1, :7], masks[2, :5], masks[3, :4] = True, True, True, True
    assert expected("stock", None, masks) == 4 and expected("stock", None) is None
    assert expected("stock") == 1                                             # int(12 x 0.15) = 1
    assert expected("stock", RepairConfig(check_layers=(1,), recompute_ratio=0.05)) == 1   # int(0.6) = 0


def test_continuation_fault_is_decodes_rule():
    assert rag.continuation_fault([5, 6, 7, 8], 4, (9,)) is None
    assert rag.continuation_fault([5, 9], 4, (9,)) is None                  # ended at its end-of-turn
    assert rag.continuation_fault([9], 4, (9,)) is None
    assert "past an end-of-turn" in rag.continuation_fault([9, 5, 6, 7], 4, (9,))
    assert "past an end-of-turn" in rag.continuation_fault([5, 9, 6], 4, (9,))   # one token past it (survivor #6)
    assert "1 of 4" in rag.continuation_fault([5], 4, (9,))                  # cut short: a prefill's first token only
    assert "5 of 4" in rag.continuation_fault([5, 6, 7, 8, 1], 4, ())
    assert "0 of 4" in rag.continuation_fault([], 4, ())


def test_a_continuation_past_its_end_of_turn_fails_continuations_end_as_decode_says(setup, monkeypatch):
    """The batched decode hands the first reuse arm (naive) a continuation that goes on after an end-of-turn
    token: the case's check fails and names the child, the arm, the fault and the length (mutation survivor:
    `fault = None`, a check that could never fail)."""
    real = rag.decode_batch

    def past_the_stop(runner, outcomes, max_new_tokens, stop_ids=()):
        rows = [list(r) for r in real(runner, outcomes, max_new_tokens, stop_ids)]
        rows[0] = [stop_ids[0]] + [0] * (max_new_tokens - 1)    # the first reuse row: child A, arm naive
        return rows

    monkeypatch.setattr(rag, "decode_batch", past_the_stop)
    check = _one_child_quality_check(setup, monkeypatch, "continuations_end_as_decode_says")
    assert check["ok"] is False
    assert check["value"] == {"A": {"naive": {"fault": "continues past an end-of-turn token",
                                              "tokens": RAG["max_new_tokens"]}}}
