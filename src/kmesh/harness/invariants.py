"""The repair's invariants, as the model stages check them: a repaired child held to the algorithm, not to itself.

A stage compares a repaired child with itself (in-process vs the service, layer-major vs serial, batched vs
unbatched); none of that fails when every path computes the same wrong thing. These helpers check what any correct
repair must give, against references that share no code with it:

- `self_consistent`: a child whose restored positions hold the K/V its OWN full prefill computed (nothing to repair)
  must give back that prefill's K/V at every layer and its logits, within the dtype's rounding, at the repair's
  ratio and at 1.0 (every row selected: a full prefill through the repair's masked path).
- `replay_outcome`: a repaired child's outcome replayed in float64 (kmesh.reference.repair over
  kmesh.reference.decoder): recomputed rows' K/V and logits against float64, the selection at each check layer
  against a float64 top-k (ties within a stated band), positions without restored data always recomputed, masks as
  the rule shapes them, restored rows it did not recompute left as restored.
- `replay_span`: the same replay of a span repaired by kmesh.kv.repair.repair_span (the vLLM connector's repair).
- `check_replays`: the named checks a case makes of those replays, against the stage's bounds.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from kmesh.harness.child import ChildContext, ChildOutcome, new_cache, prefill, restore_child, restored_mask
from kmesh.harness.workload import Child
from kmesh.kv.repair import Repaired
from kmesh.model.blend import RepairConfig
from kmesh.reference.decoder import Float64Decoder
from kmesh.reference.repair import rel_err, replay
from kmesh.result import Case


def ratio_sets(repair: RepairConfig) -> dict[str, tuple[float, ...]]:
    """The ratios self_consistent runs: the configured ones and every row selected."""
    return {"configured": repair.ratios(), "every_row": (1.0,) * len(repair.check_layers)}


def self_consistent(ctx: ChildContext, child: Child, full: ChildOutcome) -> dict[str, dict[str, float]]:
    """Per ratio set: max relative distance of K, V and logits from the child's full prefill `full`, when its
    segment positions are restored from that very prefill (see module doc)."""
    base = ctx.repair
    restored = restored_mask(child)
    T = len(child.ids)
    idx = restored.nonzero()[:, 0].to(ctx.runner.device)
    out: dict[str, dict[str, float]] = {}
    for label, ratios in ratio_sets(base).items():
        run_ctx = dataclasses.replace(ctx, repair=RepairConfig(base.check_layers, tuple(ratios), base.deviation))
        cache = new_cache(run_ctx, child)
        for layer in range(ctx.runner.num_layers):
            cache.k[layer][idx] = full.k[layer][idx]
            cache.v[layer][idx] = full.v[layer][idx]
        res = prefill(run_ctx, child, cache, restored, "repair")
        k, v = cache.stacked(T)
        out[label] = {"k": rel_err(k, full.k), "v": rel_err(v, full.v), "logits": rel_err(res.logits, full.logits),
                      "recomputed_last_layer": int(res.masks[-1].sum())}
    return out


def check_self_consistent(case: Case, per_run: Mapping[str, Mapping[str, float]], bound: float) -> None:
    """The self-consistency checks over `per_run` ({run: self_consistent's entry}) at relative `bound`."""
    case.record("per_child_and_ratio", dict(per_run))
    case.check("kv_equal_full_prefill_within_rounding", all(max(d["k"], d["v"]) <= bound for d in per_run.values()),
               value={k: max(d["k"], d["v"]) for k, d in per_run.items()})
    case.check("logits_equal_full_prefill_within_rounding", all(d["logits"] <= bound for d in per_run.values()),
               value={k: d["logits"] for k, d in per_run.items()})


def replay_outcome(dec: Float64Decoder, ctx: ChildContext, export: Any, child: Child, got: ChildOutcome,
                   band_factor: float) -> dict[str, Any]:
    """`got` (a repair arm's outcome for `child`, segments from `export`) replayed in float64: the replay's report."""
    T = len(child.ids)
    # the restored K/V before the repair overwrote any of it: the same restore into a fresh poisoned cache
    scratch = new_cache(ctx, child)
    restored = restore_child(scratch, export.catalog, export.raw, child, ctx.runner, ctx.restore_backend)
    before_k, before_v = scratch.stacked(T)
    del scratch
    conf = ctx.repair
    ids = torch.tensor(child.ids, device=ctx.runner.device)
    rep = replay(dec, ids, restored, got.masks, got.k, got.v, before_k, before_v, conf.check_layers, conf.ratios(),
                 conf.deviation, got.logits, band_factor)
    return {"restored_as_in_the_child": bool(torch.equal(restored, got.restored.cpu())), **rep.describe(),
            "selection_ok": rep.selection_ok}


def replay_span(dec: Float64Decoder, ids: Sequence[int], rep: Repaired, config: RepairConfig,
                band_factor: float) -> dict[str, Any]:
    """A span repair's result (kmesh.kv.repair.repair_span with keep_restored: the vLLM connector's own repair)
    replayed in float64: the replay's report."""
    if rep.masks is None or rep.restored is None or rep.before is None or rep.segment.v is None:
        raise ValueError("replay_span needs repair_span(..., keep_restored=True)'s masks, restored mask and copy")
    dev = dec.device
    k, v = rep.segment.k.transpose(0, 1).to(dev), rep.segment.v.transpose(0, 1).to(dev)   # [T, L, ...] -> [L, T, ...]
    bk, bv = rep.before.k.transpose(0, 1).to(dev), rep.before.v.transpose(0, 1).to(dev)   # type: ignore[union-attr]
    out = replay(dec, torch.tensor(list(ids)), rep.restored.cpu(), rep.masks, k, v, bk, bv, config.check_layers,
                 config.ratios(), config.deviation, rep.logits, band_factor)
    return {**out.describe(), "selection_ok": out.selection_ok}


def check_replays(case: Case, report: Mapping[str, Mapping[str, Any]], rows_bound: float,
                  logits_bound: float) -> None:
    """The named checks over replay_outcome's reports ({run: report})."""
    case.record("per_child", dict(report))
    rows = {n: max(r["k_rel_err_max"], r["v_rel_err_max"]) for n, r in report.items()}
    if any("restored_as_in_the_child" in r for r in report.values()):
        case.check("restored_positions_as_in_the_child",
                   all(r.get("restored_as_in_the_child", False) for r in report.values()))
    case.check("recomputed_rows_kv_within_bound", all(x <= rows_bound for x in rows.values()), value=rows)
    case.check("logits_within_bound", all(r["logits_rel_err"] <= logits_bound for r in report.values()),
               value={n: r["logits_rel_err"] for n, r in report.items()})
    case.check("selection_is_reference_top_k", all(r["selection_ok"] for r in report.values()),
               value={n: r["selections"] for n, r in report.items()})
    case.check("forced_positions_always_recomputed", all(r["forced_always_recomputed"] for r in report.values()))
    case.check("masks_follow_rule", all(r["masks_follow_rule"] for r in report.values()),
               value={n: r["problems"] for n, r in report.items() if r["problems"]})
    case.check("reused_rows_hold_restored_kv", all(r["reused_rows_untouched"] for r in report.values()))


REFERENCE = ("kmesh.reference.decoder (float64, explicit causal mask, own RoPE) driven by kmesh.reference.repair "
             "(the selection rule written apart from kmesh.model.blend)")
