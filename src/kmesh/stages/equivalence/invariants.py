"""Cases repair-self-consistent and repair-matches-float64: the repair held to its algorithm, not to itself.

The child cases compare a repaired child with itself (in-process vs the service) and the quality case compares arms
by figures; neither fails when the repair computes the wrong thing the same way twice. These cases check the
algorithm's invariants against references the repair does not share code with:

repair-self-consistent  a child whose restored positions hold the K/V its OWN full prefill computed (nothing to
                        repair: same preceding text, same positions) must give the full prefill's K/V at every layer
                        and its next-token logits, within the dtype's rounding, at the repair's ratio and at 1.0
                        (every row selected: the repair is then a full prefill through its masked path)
repair-matches-float64  the child's repaired outcome (the child-<name> case's in-process run) replayed in float64 by
                        kmesh.reference.repair: every recomputed row's K/V and the logits within a bound of the replay,
                        the selection at each check layer the reference's top-k of the float64 deviation (ties within
                        the stated rounding band), positions without restored data and the last always recomputed, the
                        masks as the rule shapes them, restored rows it did not recompute left as restored
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kmesh.harness.child import new_cache, prefill, restore_child
from kmesh.harness.modelsetup import ModelSetup
from kmesh.model.blend import RepairConfig
from kmesh.reference.decoder import Float64Decoder
from kmesh.reference.repair import rel_err, replay
from kmesh.result import Result
from kmesh.stages.equivalence.refs import FULL, REPAIR, RefKey, Refs


def _restored_mask(child: Any) -> torch.Tensor:
    """bool [T]: the positions where the child placed a shared segment."""
    mask = torch.zeros(len(child.ids), dtype=torch.bool)
    for _, a, b in child.segment_slices():
        mask[a:b] = True
    return mask


def _self_consistent(res: Result, setup: ModelSetup, refs: Refs, children: list[Any], bound: float) -> None:
    base = setup.ctx.repair
    ratio_sets = {"configured": base.ratios(), "every_row": (1.0,) * len(base.check_layers)}
    params = {"children": [c.name for c in children], "ratios": {k: list(v) for k, v in ratio_sets.items()},
              "bound_rel": bound, "restored": "the child's own full-prefill K/V at its segment positions"}
    with res.case("repair-self-consistent", params) as case:
        worst: dict[str, dict[str, float]] = {}
        for child in children:
            full = refs[RefKey(FULL, child.name)]
            restored = _restored_mask(child)
            T = len(child.ids)
            idx = restored.nonzero()[:, 0].to(setup.device)
            for label, ratios in ratio_sets.items():
                ctx = dataclasses.replace(setup.ctx, repair=RepairConfig(base.check_layers, tuple(ratios),
                                                                          base.deviation))
                cache = new_cache(ctx, child)
                for layer in range(setup.runner.num_layers):
                    cache.k[layer][idx] = full.k[layer][idx]
                    cache.v[layer][idx] = full.v[layer][idx]
                out = prefill(ctx, child, cache, restored, "repair")
                k, v = cache.stacked(T)
                diffs = {"k": rel_err(k, full.k), "v": rel_err(v, full.v), "logits": rel_err(out.logits, full.logits),
                         "recomputed_last_layer": int(out.masks[-1].sum())}
                worst[f"{child.name}/{label}"] = diffs
        case.record("per_child_and_ratio", worst)
        case.check("kv_equal_full_prefill_within_rounding",
                   all(max(d["k"], d["v"]) <= bound for d in worst.values()),
                   value={k: max(d["k"], d["v"]) for k, d in worst.items()})
        case.check("logits_equal_full_prefill_within_rounding", all(d["logits"] <= bound for d in worst.values()),
                   value={k: d["logits"] for k, d in worst.items()})


def _matches_float64(res: Result, setup: ModelSetup, refs: Refs, children: list[Any], sec: dict[str, Any]) -> None:
    conf = setup.ctx.repair
    rows_bound, logits_bound = float(sec["rows_rel_bound"]), float(sec["logits_rel_bound"])
    band = float(sec.get("tie_band_factor", 4.0))
    params = {"children": [c.name for c in children], "repair": dataclasses.asdict(conf),
              "reference": "kmesh.reference.decoder (float64, explicit causal mask, own RoPE) driven by "
                           "kmesh.reference.repair (the selection rule written apart from kmesh.model.blend)",
              "rows_rel_bound": rows_bound, "logits_rel_bound": logits_bound, "tie_band_factor": band}
    with res.case("repair-matches-float64", params) as case:
        dec = Float64Decoder(setup.model, setup.runner.rope, setup.device)
        report: dict[str, Any] = {}
        for child in children:
            got = refs[RefKey(REPAIR, child.name)]
            T = len(child.ids)
            # the restored K/V before the repair overwrote any of it: the same restore into a fresh poisoned cache
            scratch = new_cache(setup.ctx, child)
            restored = restore_child(scratch, setup.export.catalog, setup.export.raw, child, setup.runner,
                                     setup.ctx.restore_backend)
            before_k, before_v = scratch.stacked(T)
            del scratch
            ids = torch.tensor(child.ids, device=setup.device)
            rep = replay(dec, ids, restored, got.masks, got.k, got.v, before_k, before_v, conf.check_layers,
                         conf.ratios(), conf.deviation, got.logits, band)
            report[child.name] = {"restored_as_in_the_child": bool(torch.equal(restored, got.restored.cpu())),
                                  **rep.describe(), "selection_ok": rep.selection_ok}
        case.record("per_child", report)
        rows = {n: max(r["k_rel_err_max"], r["v_rel_err_max"]) for n, r in report.items()}
        case.check("restored_positions_as_in_the_child", all(r["restored_as_in_the_child"] for r in report.values()))
        case.check("recomputed_rows_kv_within_bound", all(x <= rows_bound for x in rows.values()), value=rows)
        case.check("logits_within_bound", all(r["logits_rel_err"] <= logits_bound for r in report.values()),
                   value={n: r["logits_rel_err"] for n, r in report.items()})
        case.check("selection_is_reference_top_k", all(r["selection_ok"] for r in report.values()),
                   value={n: r["selections"] for n, r in report.items()})
        case.check("forced_positions_always_recomputed",
                   all(r["forced_always_recomputed"] for r in report.values()))
        case.check("masks_follow_rule", all(r["masks_follow_rule"] for r in report.values()),
                   value={n: r["problems"] for n, r in report.items() if r["problems"]})
        case.check("reused_rows_hold_restored_kv", all(r["reused_rows_untouched"] for r in report.values()))


def invariant_cases(res: Result, setup: ModelSetup, refs: Refs) -> None:
    """Both cases over the first `invariants.children` children (see module doc)."""
    sec = setup.sec["invariants"]
    children = list(setup.workload.children)[: int(sec["children"])]
    _self_consistent(res, setup, refs, children, float(sec["self_consistent_bound"]))
    _matches_float64(res, setup, refs, children, sec)
