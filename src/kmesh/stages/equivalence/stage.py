"""Stage `equivalence` (write-up §24, first half): children restore shared segments saved by a leader, repair
them with KMesh's CacheBlend repair, and must get exactly the same state whether the segments came from
inside the model process or through the separate cache service.

Cases:
  runner-matches-transformers  a plain full forward through the layer-wise runner vs transformers' own forward
                               (bound recorded) and the same greedy tokens
  workload                     4 segments totalling 416 tokens, 4 children of 512 tokens, placements differ
  leader-save                  leader prefill → export (one object per segment) → saved through the service;
                               the store's digests equal the leader's catalog
  child-<A..D>                 (a) in-process source vs (b) the service (memfd on CPU, CUDA IPC on GPU): K and V of
                               every layer, next-token logits, generated tokens, recompute masks at every layer —
                               bit for bit; registration released, nothing leaked
  originals-unchanged          after every child: each original still hashes to its committed digest
  negative-controls            a second run of child A compares identical; one flipped bit in K, V, logits, a mask
                               or a staged byte is caught
  control-<name> (7)           missing, corrupt, truncated object, wrong layout descriptor, service killed
                               mid-load, failure after device work was submitted, cancelled child (kmesh.stages.
                               equivalence.controls): each fails at segment 1 with segment 0 already restored, and
                               the recompute over that partially written state equals the pre-failure reference
                               bit for bit; nothing pending before it, nothing leaked (the killed service: this
                               process's own mapping and fd of the staging memory gone)
  one-path-bytes,              the vLLM connector's load path (kmesh.vllm.loads, engine-free) and a child's, over the
  one-path-refuses-<object>    same stored objects in the service: equal destination bytes, the same refusals of a
                               corrupt, missing and wrong-geometry object (kmesh.stages.equivalence.onepath)
  quality                      arms full / naive / stock / stock-matched / repair on the same prompts
                               (kmesh.model.quality): first-token and teacher-forced KL and top-1, generation
                               up to end-of-turn, recomputed fractions; stock-matched = stock's selection rule
                               with exactly the repair arm's recomputed count for that child
  ttft-<T>                     time to first token, matched pairs (kmesh.bench): repair only vs full recompute,
                               end to end (request to first token through a real service: kmesh.stages.
                               equivalence.endtoend) vs full recompute, and full vs transformers' own forward
  repair-self-consistent,      the repair held to its algorithm (kmesh.stages.equivalence.invariants): a child restored
  repair-matches-float64       from its own full prefill gives that prefill back; every repaired child's recomputed
                               rows, selection and logits replayed in float64 by an independent reference
  rag-workload, rag-quality,   the RAG-shaped workload and the repair strategies' quality/speed frontier: full,
  rag-ttft                     naive, stock, stock-matched, repair x ratios, epic x k (kmesh.stages.equivalence.rag)
"""
from __future__ import annotations

import dataclasses
import gc
import statistics
from typing import Any

import torch

from kmesh.config import Config
from kmesh.harness.child import full_reference, run_child
from kmesh.harness.modelsetup import ModelSetup, begin_with_setup, equivalence_setup
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import answer_matches
from kmesh.kv.sources import InProcessSegments, ServiceSegments
from kmesh.model.blend import RepairConfig, matched_stock
from kmesh.model.quality import (arm_quality, compare_states, identical, kv_error, reproduces_greedy, summarize,
                                 teacher_forced_logits_batch, tokens_agree)
from kmesh.model.runner import transformers_sdpa_policy
from kmesh.result import Result
from kmesh.stages.equivalence import controls
from kmesh.stages.equivalence.invariants import invariant_cases
from kmesh.stages.equivalence.onepath import one_path_cases
from kmesh.stages.equivalence.rag import FrontierArm, expected_recomputed, rag_cases
from kmesh.stages.equivalence.refs import FULL, REPAIR, RefKey, Refs
from kmesh.stages.equivalence.ttft import ttft_cases


def _runner_case(res: Result, setup: ModelSetup, refs: Refs) -> None:
    child = setup.workload.children[0]
    with res.case("runner-matches-transformers", {"model": setup.what, "tokens": len(child.ids)}) as case:
        ids = torch.tensor(child.ids, device=setup.device)
        model = setup.model
        # both sides stop at the same end-of-turn ids (the runner's decode through ChildContext.stop_ids)
        stop = {"eos_token_id": list(setup.ctx.stop_ids)} if setup.ctx.stop_ids else {}
        with torch.no_grad(), transformers_sdpa_policy(model):
            hf_logits = model(ids[None]).logits[0, -1]
            hf = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                                max_new_tokens=setup.ctx.max_new_tokens, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=model.config.eos_token_id or 0, **stop)
            hf_tokens = hf.sequences[0, len(ids):].tolist()
        ref = refs[RefKey(FULL, child.name)]   # the runner's full prefill and decode of this child
        diff = float((ref.logits.double() - hf_logits.double()).abs().max())
        scale = float(hf_logits.double().abs().max())
        bound = float(setup.sec["runner_logits_bound"])
        case.record("logits_max_abs_diff", diff)
        case.record("logits_max_abs", scale)
        # the kernel the recomputed rows' masked attention ran
        case.record("attention_backend", setup.runner.attention)
        # compiled: the runner's fused layer functions, so this case is their check against transformers' modules
        case.record("layer_step", setup.runner.layer_step)
        case.record("sdpa_rule", "both sides: cuDNN only for a causal prefill without mask (kmesh.model.runner)")
        case.check("logits_within_bound", diff <= bound * max(scale, 1.0), value={"diff": diff, "bound_rel": bound})
        case.check("argmax_equal", int(ref.logits.argmax()) == int(hf_logits.argmax()))
        # the same arithmetic (layer_step eager) gives the same tokens; a fused step's rounding may swap a near tie
        # (random weights have many), never a token the bound cannot explain
        agree = tokens_agree(ref.tokens, hf_tokens, [x[0] for x in hf.logits], bound * max(scale, 1.0))
        case.check("greedy_tokens_equal_until_a_near_tie", agree["agree"],
                   value={**agree, "runner": ref.tokens, "transformers": hf_tokens})


def _workload_case(res: Result, setup: ModelSetup) -> None:
    workload = setup.workload
    with res.case("workload", {"seed": workload.seed, "spec": workload.spec.__dict__}) as case:
        case.record("describe", workload.describe())
        case.check("four_segments_416_tokens",
                   sum(seg.tokens for seg in workload.segments) == sum(workload.spec.segment_tokens),
                   value=[seg.tokens for seg in workload.segments])
        case.check("children_prompt_tokens",
                   all(len(ch.ids) == workload.spec.prompt_tokens for ch in workload.children),
                   value=[len(ch.ids) for ch in workload.children])
        starts = [tuple(sl[1] for sl in ch.segment_slices()) for ch in workload.children]
        case.check("placements_differ", len(set(starts)) == len(starts), value=starts)
        case.check("segment_ids_in_children", all(
            list(ch.ids[a:b]) == list(workload.segments[i].ids)
            for ch in workload.children for i, a, b in ch.segment_slices()))


def _child_cases(res: Result, setup: ModelSetup, svc: ServiceSide, refs: Refs) -> dict[str, Any]:
    """Each child twice, (a) in-process and (b) through the service; (a) becomes the child's REPAIR reference."""
    # mask_comparisons: per-layer mask comparisons made; masks_equal: how many of them found the masks equal
    agg = {"mask_comparisons": 0, "masks_equal": 0, "max_abs_diff": 0.0, "tokens_equal": True,
           "identical_children": 0}
    inproc = InProcessSegments(setup.export)
    staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
    private = torch.empty_like(staging)
    for child in setup.workload.children:
        with res.case(f"child-{child.name}", {"placements": [p.__dict__ for p in child.placements]}) as case:
            in_process = run_child(setup.ctx, child, inproc, staging, private)
            with svc.staging(f"child-{child.name}") as service_staging:
                service = run_child(setup.ctx, child,
                                    ServiceSegments(svc.client, service_staging.reg, svc.after_accept),
                                    service_staging.tensor, private)
            case.check("in_process_used_segments", in_process.fallback is None, value=in_process.fallback)
            case.check("service_used_segments", service.fallback is None, value=service.fallback)
            cmp = compare_states(in_process, service)
            case.record("comparison", cmp)
            case.check("bit_identical", identical(cmp), value=cmp["first_unequal_layer"])
            case.check("masks_equal_every_layer", cmp["mask_equal_layers"] == cmp["layers"],
                       value=cmp["mask_equal_layers"])
            case.record("outcome", service.describe())
            case.record("answer", {"expected": child.answer, "text": setup.decode(service.tokens)})
            case.check("staging_released_no_leaks", svc.no_leaks(), value=svc.leaks())
            agg["mask_comparisons"] += cmp["layers"]
            agg["masks_equal"] += cmp["mask_equal_layers"]
            agg["max_abs_diff"] = max(agg["max_abs_diff"], cmp["max_abs_diff"])
            agg["tokens_equal"] &= cmp["tokens_equal"]
            agg["identical_children"] += identical(cmp)
            refs[RefKey(REPAIR, child.name)] = in_process
    return agg


QUALITY_ARMS = ("full", "naive", "stock", "stock-matched", "repair")
STOCK_MATCHED = ("stock's selection rule (equivalence.stock: check layers, top-k over ALL positions by post-RoPE "
                 "deviation, missing positions zeroed, bottom-right mask) with k set per child to the repair arm's "
                 "recomputed count: every position it recomputes after the check layer, restored or not")


def _chance_row(ref: Any, child: Any, setup: ModelSetup, ref_steps: Any, stop: tuple[int, ...], repaired: Any,
                naive: Any, outcomes: list[Any], steps: list[Any]) -> dict[str, Any]:
    """One child's chance runs against the repair: teacher-forced KL to full per seed, their median and spread
    (max - min); each run's budget; and at the first check layer, each cache's distance to the full prefill's
    (kmesh.model.quality.kv_error, of the tensor the rule ranks), the repair's, the chance runs' and naive's."""
    kls = [arm_quality(ref, o, child.answer, setup.decode, answer_matches, ref_steps, st, stop)["kl_teacher_forced"]
           for o, st in zip(outcomes, steps)]
    want = [int(x) for x in repaired.masks.sum(1).tolist()]
    got = [[int(x) for x in o.masks.sum(1).tolist()] for o in outcomes]
    layer, which = int(setup.sec["repair"]["check_layers"][0]), str(setup.sec["repair"].get("deviation", "k"))
    return {"kl_teacher_forced_by_seed": kls, "median": statistics.median(kls), "spread": max(kls) - min(kls),
            "same_budget": all(g == want for g in got), "recomputed_per_layer": {"repair": want, "chance": got},
            "check_layer": {"layer": layer, "tensor": which, "repair": kv_error(ref, repaired, layer, which),
                            "chance_by_seed": [kv_error(ref, o, layer, which) for o in outcomes],
                            "naive": kv_error(ref, naive, layer, which)}}


def _quality_case(res: Result, setup: ModelSetup, refs: Refs) -> tuple[dict[str, Any], dict[str, Any]]:
    """(per-arm summaries, the repair-vs-stock-matched claim as measured)."""
    stop = tuple(setup.ctx.stop_ids)
    out: dict[str, Any] = {}
    claim: dict[str, Any] = {}
    params = {"arms": QUALITY_ARMS, "repair": setup.sec["repair"], "stock": setup.sec["stock"],
              "stock_matched": STOCK_MATCHED, "end_of_turn_ids": list(stop),
              "end_of_turn": ("generation and its measures stop at the model's end-of-turn token" if stop else
                              "this tokenizer has no end-of-turn token (byte tokenizer of random weights): every "
                              "continuation runs max_new_tokens"),
              "teacher_forced": "each arm's prefilled state fed the full arm's continuation; KL and top-1 per step"}
    with res.case("quality", params) as case:
        inproc = InProcessSegments(setup.export)
        staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        private = torch.empty_like(staging)
        stock = RepairConfig.from_dict(setup.sec["stock"])
        stock_ctx = dataclasses.replace(setup.ctx, repair=stock)
        per_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in QUALITY_ARMS}
        fallbacks: dict[str, Any] = {}
        wrong_count: dict[str, dict[str, Any]] = {}
        # each arm's rule, for what it must recompute (computed from the placements, not by the arm's code)
        rules = {"full": FrontierArm("full", "full", None), "naive": FrontierArm("naive", "naive", None),
                 "stock": FrontierArm("stock", "stock", stock), "stock-matched": FrontierArm("stock-matched", "stock",
                                                                                           None),
                 "repair": FrontierArm("repair", "repair", RepairConfig.from_dict(setup.sec["repair"]))}
        reproduces: dict[str, dict[str, Any]] = {}
        rerun_identical: dict[str, bool] = {}
        same_positions: dict[str, bool] = {}
        # chance at the repair's budget: the repair arm with its rows ranked by a seeded random score
        seeds = range(int(setup.sec["chance_seeds"]))
        repair_cfg = RepairConfig.from_dict(setup.sec["repair"])
        chance_ctx = {s: dataclasses.replace(setup.ctx, repair=dataclasses.replace(repair_cfg, selection_seed=s))
                      for s in seeds}
        chance: dict[str, dict[str, Any]] = {}
        for child in setup.workload.children:
            ref = refs[RefKey(FULL, child.name)]
            repaired = refs[RefKey(REPAIR, child.name)]
            matched_ctx = dataclasses.replace(setup.ctx, repair=matched_stock(stock, repaired.masks))
            # the full arm is recomputed, not the reference itself: its row measures the full recompute again
            rerun = full_reference(setup.ctx, child)
            rerun_identical[child.name] = identical(compare_states(ref, rerun))
            outcomes = {"full": rerun,
                        "naive": run_child(setup.ctx, child, inproc, staging, private, arm="naive"),
                        "stock": run_child(stock_ctx, child, inproc, staging, private, arm="stock"),
                        "stock-matched": run_child(matched_ctx, child, inproc, staging, private, arm="stock"),
                        "repair": repaired}
            fallbacks[child.name] = {arm: o.fallback for arm, o in outcomes.items() if o.fallback is not None}
            for arm, outcome in outcomes.items():
                want, got = expected_recomputed(rules[arm], child, repaired.masks), int(outcome.masks[-1].sum())
                if want != got:
                    wrong_count.setdefault(child.name, {})[arm] = {"expected": want, "recomputed": got}
            # at one budget the two rules may pick the same positions; then what differs is how they attend
            same_positions[child.name] = bool(torch.equal(outcomes["stock-matched"].masks, repaired.masks))
            chance_outcomes = [run_child(chance_ctx[s], child, inproc, staging, private, arm="repair") for s in seeds]
            # the reference and every arm teacher-forced along the reference's tokens in one batched forward
            states = [ref, *outcomes.values(), *chance_outcomes]
            ref_steps, *arm_steps = teacher_forced_logits_batch(setup.runner, states, [ref.tokens] * len(states))
            arm_steps, chance_steps = arm_steps[:len(outcomes)], arm_steps[len(outcomes):]
            chance[child.name] = _chance_row(ref, child, setup, ref_steps, stop, repaired, outcomes["naive"],
                                             chance_outcomes, chance_steps)
            # teacher forcing the full state with its own tokens must give back its greedy tokens (near-ties of the
            # compute dtype aside: the batched forward and the step decode round differently)
            reproduces[child.name] = reproduces_greedy(ref_steps, ref.tokens, setup.runner.dtype)
            for (arm, outcome), steps in zip(outcomes.items(), arm_steps):
                per_arm[arm].append({"child": child.name, **arm_quality(ref, outcome, child.answer, setup.decode,
                                                                         answer_matches, ref_steps, steps, stop)})
        out = {arm: summarize(rows) for arm, rows in per_arm.items()}
        case.record("per_child", per_arm)
        case.record("summary", out)
        case.check("arms_used_segments", not any(fallbacks.values()), value=fallbacks)
        case.check("every_arm_recomputed_what_its_rule_says", not wrong_count, value=wrong_count)
        case.check("teacher_forcing_reproduces_full_tokens", all(r["ok"] for r in reproduces.values()),
                   value=reproduces)
        # what the table's KL and agreement are measured against is reproducible, bit for bit
        case.check("full_recompute_bit_identical", all(rerun_identical.values()), value=rerun_identical)
        budgets = {row["child"]: {"repair": row["recomputed_positions"], "stock-matched": m["recomputed_positions"]}
                   for row, m in zip(per_arm["repair"], per_arm["stock-matched"])}
        case.check("stock_matched_budget_equals_repair",
                   all(b["repair"] == b["stock-matched"] for b in budgets.values()), value=budgets)
        case.record("stock_matched_recomputed_the_same_positions_as_repair", same_positions)
        kl_first = {arm: out[arm]["kl_first_token_mean"] for arm in ("repair", "naive")}
        case.check("repair_closer_than_naive", kl_first["repair"] <= kl_first["naive"], value=kl_first)
        # The repair's rule against chance at its own budget, child by child (teacher-forced KL to full): no worse
        # than the seeds' median by more than their spread (max - min, the noise of a selection at this budget).
        # A rule that picks the wrong rows (e.g. the least deviant) loses to chance and fails here by name.
        for row, mine in zip(per_arm["repair"], chance.values()):
            mine["repair"] = row["kl_teacher_forced"]
            mine["within"] = mine["repair"] <= mine["median"] + mine["spread"]
        case.check("chance_budget_equals_repair", all(c["same_budget"] for c in chance.values()),
                   value={k: c["recomputed_per_layer"] for k, c in chance.items()})
        case.check("repair_no_worse_than_chance_at_its_budget", all(c["within"] for c in chance.values()),
                   value=chance)
        # Where it is a law: at the first check layer every earlier layer was recomputed, so the rows the rule keeps
        # restored are off the full prefill by exactly their deviation, and keeping the least deviant ones leaves
        # the least distance of any selection of that size. The repair's cache there is no farther from the full
        # prefill's than any chance run's (rounding allowed: a millionth of naive's distance, nothing repaired).
        at_check = {name: c["check_layer"] for name, c in chance.items()}
        case.check("repair_closest_to_full_at_its_check_layer",
                   all(c["repair"] <= min(c["chance_by_seed"]) + 1e-6 * c["naive"] for c in at_check.values()),
                   value=at_check)
        # and no worse than naive reuse (nothing repaired) beyond the same noise bound, child by child
        vs_naive = {row["child"]: {"repair": row["kl_teacher_forced"], "naive": nv["kl_teacher_forced"],
                                   "bound": chance[row["child"]]["spread"]}
                    for row, nv in zip(per_arm["repair"], per_arm["naive"])}
        case.check("repair_no_worse_than_naive_beyond_noise",
                   all(v["repair"] <= v["naive"] + v["bound"] for v in vs_naive.values()), value=vs_naive)
        # The claim against stock-CacheBlend is made at one budget only (stock-matched), measured and reported
        # met or missed, never a stage check: stock at its own 15 % of T loses by budget, not by design.
        for key in ("kl_first_token_mean", "kl_teacher_forced_mean"):
            r, m = out["repair"][key], out["stock-matched"][key]
            claim[key] = {"repair": r, "stock-matched": m, "met": r < m}
        kl_tf = {arm: [row["kl_teacher_forced"] for row in per_arm[arm]] for arm in ("repair", "stock-matched")}
        claim["children_repair_lower_kl_teacher_forced"] = sum(a < b for a, b in zip(kl_tf["repair"],
                                                                                        kl_tf["stock-matched"]))
        claim["children"] = len(kl_tf["repair"])
        claim["children_same_positions_recomputed"] = sum(same_positions.values())
        case.record("claim_repair_better_than_stock_matched", claim)
    return out, claim


def run(cfg: Config) -> Result:
    res, setup = begin_with_setup("equivalence", cfg, equivalence_setup)
    if setup is None:
        return res
    res.extra.update(model=setup.what, device=str(setup.device), children=len(setup.workload.children),
                     layers=setup.runner.num_layers)
    refs: Refs = {RefKey(FULL, child.name): full_reference(setup.ctx, child) for child in setup.workload.children}
    _runner_case(res, setup, refs)
    _workload_case(res, setup)
    catalog = setup.export.catalog
    with ServiceSide.start(setup.export, setup.device, float(setup.sec["heartbeat_timeout_s"]),
                           int(setup.sec["chunk_bytes"])) as svc:
        with res.case("leader-save", {"objects": len(catalog.entries), "bytes": catalog.nbytes}) as case:
            saved = svc.save_leader()
            case.record("catalog", catalog.describe())
            case.check("store_digests_equal_catalog", all(saved[e.key] == e.sha256 for e in catalog.entries),
                       value={k.decode(): v[:16] for k, v in saved.items()})
            case.check("leader_registrations_released", svc.no_leaks(), value=svc.leaks())
        agg = _child_cases(res, setup, svc, refs)
        with res.case("originals-unchanged", {}) as case:
            now = svc.store_digests(verify=True)
            case.check("every_original_hashes_as_committed",
                       all(now[e.key] == (e.sha256, e.sha256) for e in catalog.entries), value=len(now))
        controls.negative_controls(res, setup, refs)
        agg["failure_controls_passed"] = controls.failure_controls(res, setup, svc, refs)
    # a fresh service (the last control killed this one), unpaced: both roads load as a deployed client does
    with ServiceSide.start(setup.export, setup.device, float(setup.sec["heartbeat_timeout_s"]),
                           int(setup.sec["chunk_bytes"])) as svc:
        svc.unpace()
        svc.save_leader()
        one_path_cases(res, setup, svc)
    res.extra.update(mask_comparisons=agg["mask_comparisons"], masks_equal=agg["masks_equal"],
                     max_abs_diff=agg["max_abs_diff"],
                     tokens_equal=agg["tokens_equal"], identical_children=agg["identical_children"],
                     failure_controls_passed=agg["failure_controls_passed"])
    res.extra["quality"], res.extra["repair_vs_stock_matched"] = _quality_case(res, setup, refs)
    invariant_cases(res, setup, refs)
    res.extra["end_of_turn_ids"] = list(setup.ctx.stop_ids)
    res.extra["ttft"] = ttft_cases(res, setup)
    res.extra["rag"] = rag_cases(res, setup)
    gc.collect()
    return res
