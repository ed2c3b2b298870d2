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
  negative-controls            one flipped bit in K, V, logits, a mask or a staged byte is caught
  control-<name> (7)           missing, corrupt, truncated object, wrong layout descriptor, service killed
                               mid-load, failure after device work was submitted, cancelled child: each falls
                               back safely (kmesh.child), tokens equal the full-recompute reference, no leak
  quality                      arms full / naive / stock / kmesh on the same prompts (kmesh.model.quality)
  ttft-<T>                     time to first token, matched pairs (kmesh.bench): kmesh repair vs full
                               recompute, and full recompute vs transformers' own forward
"""
from __future__ import annotations

import dataclasses
import gc
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kmesh.child import ChildContext, ChildOutcome, full_reference, run_child
from kmesh.config import Config
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import arm_quality, compare_states, identical, summarize
from kmesh.model.runner import transformers_sdpa_policy
from kmesh.result import Result
from kmesh.modelsetup import ModelSetup, SetupSpec, begin_with_setup, build_setup
from kmesh.segments import InProcessSegments, ServiceSegments
from kmesh.service.harness import Harness
from kmesh.stages.equivalence import controls
from kmesh.service_side import ServiceSide
from kmesh.workload import answer_matches


def _setup(cfg: Config) -> ModelSetup:
    sec = cfg.section("equivalence")
    return build_setup(cfg, SetupSpec(
        section="equivalence", key_prefix=b"kmesh-eq/leader", model_sec=sec, workload=sec.get("workload", {}),
        repair=sec["repair"], max_new_tokens=int(sec["max_new_tokens"]),
        restore_backend=sec.get("restore_backend", "torch"), attention=sec.get("attention", "auto"),
        device=sec["device"]))


def _runner_case(res: Result, s: ModelSetup) -> None:
    child = s.workload.children[0]
    with res.case("runner-matches-transformers", {"model": s.what, "tokens": len(child.ids)}) as c:
        ids = torch.tensor(child.ids, device=s.device)
        with torch.no_grad(), transformers_sdpa_policy(s.model):
            hf_logits = s.model(ids[None]).logits[0, -1]
            hf_tokens = s.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                                         max_new_tokens=s.ctx.max_new_tokens, do_sample=False,
                                         pad_token_id=s.model.config.eos_token_id or 0)[0, len(ids):].tolist()
        ref = full_reference(s.ctx, child)
        diff = float((ref.logits.double() - hf_logits.double()).abs().max())
        scale = float(hf_logits.double().abs().max())
        bound = float(s.sec["runner_logits_bound"])
        c.record("logits_max_abs_diff", diff)
        c.record("logits_max_abs", scale)
        c.record("attention_backend", s.runner.attention)   # the kernel the recomputed rows' masked attention ran
        c.record("sdpa_rule", "both sides: cuDNN only for a causal prefill without mask (kmesh.model.runner)")
        c.check("logits_within_bound", diff <= bound * max(scale, 1.0), value={"diff": diff, "bound_rel": bound})
        c.check("argmax_equal", int(ref.logits.argmax()) == int(hf_logits.argmax()))
        c.check("greedy_tokens_equal", ref.tokens[:len(hf_tokens)] == hf_tokens,
                value={"runner": ref.tokens, "transformers": hf_tokens})


def _workload_case(res: Result, s: ModelSetup) -> None:
    w = s.workload
    with res.case("workload", {"seed": w.seed, "spec": w.spec.__dict__}) as c:
        c.record("describe", w.describe())
        c.check("four_segments_416_tokens", sum(seg.tokens for seg in w.segments) == sum(w.spec.segment_tokens),
                value=[seg.tokens for seg in w.segments])
        c.check("children_prompt_tokens", all(len(ch.ids) == w.spec.prompt_tokens for ch in w.children),
                value=[len(ch.ids) for ch in w.children])
        starts = [tuple(sl[1] for sl in ch.segment_slices()) for ch in w.children]
        c.check("placements_differ", len(set(starts)) == len(starts), value=starts)
        c.check("segment_ids_in_children", all(
            list(ch.ids[a:b]) == list(w.segments[i].ids) for ch in w.children for i, a, b in ch.segment_slices()))


def _child_cases(res: Result, s: ModelSetup, svc: ServiceSide, refs: dict[str, ChildOutcome]) -> dict[str, Any]:
    agg = {"mask_comparisons": 0, "max_abs_diff": 0.0, "tokens_equal": True, "identical_children": 0}
    inproc = InProcessSegments(s.export)
    staging = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
    private = torch.empty_like(staging)
    for child in s.workload.children:
        with res.case(f"child-{child.name}", {"placements": [p.__dict__ for p in child.placements]}) as c:
            a = run_child(s.ctx, child, inproc, staging, private)
            with svc.staging(f"child-{child.name}") as st:
                b = run_child(s.ctx, child, ServiceSegments(svc.client, st.reg, svc.after_accept), st.tensor,
                              private)
            c.check("in_process_used_segments", a.fallback is None, value=a.fallback)
            c.check("service_used_segments", b.fallback is None, value=b.fallback)
            cmp = compare_states(a, b)
            c.record("comparison", cmp)
            c.check("bit_identical", identical(cmp), value=cmp["first_unequal_layer"])
            c.check("masks_equal_every_layer", cmp["mask_equal_layers"] == cmp["layers"], value=cmp["mask_equal_layers"])
            c.record("outcome", b.describe())
            c.record("answer", {"expected": child.answer, "text": s.decode(b.tokens)})
            c.check("staging_released_no_leaks", svc.no_leaks(), value=svc.leaks())
            agg["mask_comparisons"] += cmp["mask_equal_layers"]
            agg["max_abs_diff"] = max(agg["max_abs_diff"], cmp["max_abs_diff"])
            agg["tokens_equal"] &= cmp["tokens_equal"]
            agg["identical_children"] += identical(cmp)
            refs[f"kmesh:{child.name}"] = a
    return agg


def _quality_case(res: Result, s: ModelSetup, refs: dict[str, ChildOutcome]) -> dict[str, Any]:
    arms = ("full", "naive", "stock", "kmesh")
    out: dict[str, Any] = {}
    with res.case("quality", {"arms": arms, "repair": s.sec["repair"], "stock": s.sec["stock"]}) as c:
        inproc = InProcessSegments(s.export)
        staging = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
        private = torch.empty_like(staging)
        stock_ctx = dataclasses.replace(s.ctx, repair=RepairConfig.from_dict(s.sec["stock"]))
        per_arm: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
        for child in s.workload.children:
            ref = refs[f"full:{child.name}"]
            for arm in arms:
                if arm == "full":
                    o = ref
                elif arm == "kmesh":
                    o = refs[f"kmesh:{child.name}"]
                else:
                    o = run_child(stock_ctx if arm == "stock" else s.ctx, child, inproc, staging, private, arm=arm)
                per_arm[arm].append({"child": child.name, **arm_quality(ref, o, child.answer, s.decode,
                                                                         answer_matches)})
        out = {a: summarize(v) for a, v in per_arm.items()}
        c.record("per_child", per_arm)
        c.record("summary", out)
        c.check("full_agrees_with_itself", out["full"]["top1_agreement"] == 1.0 and out["full"]["kl_mean"] == 0.0)
        c.check("kmesh_closer_than_naive", out["kmesh"]["kl_mean"] <= out["naive"]["kl_mean"],
                value={"kmesh": out["kmesh"]["kl_mean"], "naive": out["naive"]["kl_mean"]})
    return out


def run(cfg: Config) -> Result:
    res, s = begin_with_setup("equivalence", cfg, _setup)
    if s is None:
        return res
    res.extra.update(model=s.what, device=str(s.device), children=len(s.workload.children),
                     layers=s.runner.num_layers)
    _runner_case(res, s)
    _workload_case(res, s)
    refs: dict[str, ChildOutcome] = {}
    for child in s.workload.children:
        refs[f"full:{child.name}"] = full_reference(s.ctx, child)
    with ExitStack() as stack:
        h = stack.enter_context(Harness(device=str(s.device), heartbeat_timeout_s=float(s.sec["heartbeat_timeout_s"]),
                                        chunk_bytes=int(s.sec["chunk_bytes"]), store_bytes=1 << 31))
        svc = stack.enter_context(ServiceSide(h, s.export, s.device))
        with res.case("leader-save", {"objects": len(s.export.catalog.entries),
                                      "bytes": s.export.catalog.nbytes}) as c:
            saved = svc.save_leader()
            c.record("catalog", s.export.catalog.describe())
            c.check("store_digests_equal_catalog", all(saved[e.key] == e.sha256 for e in s.export.catalog.entries),
                    value={k.decode(): v[:16] for k, v in saved.items()})
            c.check("leader_registrations_released", svc.no_leaks(), value=svc.leaks())
        agg = _child_cases(res, s, svc, refs)
        with res.case("originals-unchanged", {}) as c:
            now = svc.store_digests(verify=True)
            c.check("every_original_hashes_as_committed",
                    all(now[e.key] == (e.sha256, e.sha256) for e in s.export.catalog.entries), value=len(now))
        controls.negative_controls(res, s, refs)
        agg["failure_controls_passed"] = controls.failure_controls(res, s, svc, refs)
    res.extra.update(mask_comparisons=agg["mask_comparisons"], max_abs_diff=agg["max_abs_diff"],
                     tokens_equal=agg["tokens_equal"], identical_children=agg["identical_children"],
                     failure_controls_passed=agg["failure_controls_passed"])
    res.extra["quality"] = _quality_case(res, s, refs)
    from kmesh.stages.equivalence.ttft import ttft_cases

    res.extra["ttft"] = ttft_cases(res, s)
    gc.collect()
    return res
