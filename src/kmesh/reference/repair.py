"""A CacheBlend-style repair replayed in float64, from its rule, against what a repair implementation computed.

The repair under test (kmesh.model.blend, its group form, the engine's) leaves three things: the per-layer masks of
the positions it recomputed, the request's K/V cache after the prefill, and the next-token logits. `replay` walks the
layers again with kmesh.reference.decoder and the rule as the module doc of kmesh.model.blend states it, written here
without its code:

- before the first check layer every position is recomputed;
- at check layer i the recomputed rows' fresh K (or V) is compared with the restored one, ‖fresh − restored‖² over
  heads and channels; positions without restored data and the last position always stay; of the restored rest the
  ceil(ratio_i × restored) largest deviations stay, the others reuse their restored K/V from then on;
- recomputed rows attend over every earlier position (a key at position <= the query's), whatever that slot holds.

The replay follows the implementation's own masks (so one divergence does not hide the layers after it) and reports,
per layer, how far the recomputed rows' K/V are from float64, whether the selection at each check layer is the
reference's top-k (ties within the stated rounding band allowed), whether rows it did not recompute still hold their
restored bytes, and the logits' distance. It judges nothing itself: the stage sets the bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kmesh.reference.decoder import DecoderReferenceError, Float64Decoder

__all__ = ["RepairReplay", "replay", "rel_err"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (float64; 0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-300))


@dataclass
class RepairReplay:
    k_rel_err: list[float] = field(default_factory=list)     # per layer, the recomputed rows' K vs float64
    v_rel_err: list[float] = field(default_factory=list)
    logits_rel_err: float = math.nan
    # per check layer: {"layer", "kept", "expected_kept", "missing", "extra", "near_cut", "cut", "band", "ok"}
    selections: list[dict[str, Any]] = field(default_factory=list)
    forced_always_recomputed: bool = True    # missing and last positions in every layer's mask
    masks_follow_rule: bool = True           # all rows before the first check layer, unchanged between checks
    reused_rows_untouched: bool = True       # rows not recomputed at a layer hold their restored K/V bit for bit
    problems: list[str] = field(default_factory=list)

    @property
    def selection_ok(self) -> bool:
        return all(s["ok"] for s in self.selections)

    def describe(self) -> dict[str, Any]:
        return {"k_rel_err_max": max(self.k_rel_err, default=0.0), "v_rel_err_max": max(self.v_rel_err, default=0.0),
                "logits_rel_err": self.logits_rel_err, "selections": self.selections,
                "forced_always_recomputed": self.forced_always_recomputed,
                "masks_follow_rule": self.masks_follow_rule, "reused_rows_untouched": self.reused_rows_untouched,
                "problems": self.problems[:8]}


def _keep_count(ratio: float, forced: int, restored: int) -> int:
    return forced + math.ceil(ratio * restored)


def _selection(dev: torch.Tensor, rows: torch.Tensor, forced: torch.Tensor, keep: int, got: torch.Tensor,
               band: float) -> dict[str, Any]:
    """The reference's top-`keep` of float64 deviations `dev` over positions `rows` (forced ones always kept),
    against the positions `got` the implementation kept. A position on either side whose deviation is within
    `band` of the cut (the k-th largest) is a tie: the two may order it differently by rounding alone."""
    score = dev.masked_fill(forced, float("inf"))
    order = torch.argsort(score, descending=True, stable=True)
    keep = min(keep, rows.numel())
    want = set(rows[order[:keep]].tolist())
    have = set(got.tolist())
    cut = float(score[order[keep - 1]]) if keep else math.inf
    near = {int(p) for p, d in zip(rows.tolist(), dev.tolist()) if abs(d - cut) <= band and math.isfinite(cut)}
    missing, extra = sorted(want - have), sorted(have - want)
    ok = len(have) == len(want) and set(missing) <= near and set(extra) <= near
    return {"kept": len(have), "expected_kept": len(want), "missing": missing[:16], "extra": extra[:16],
            "near_cut": len(near), "cut": cut, "band": band, "ok": ok}


def replay(dec: Float64Decoder, ids: torch.Tensor, restored: torch.Tensor, masks: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, before_k: torch.Tensor, before_v: torch.Tensor, check_layers: Sequence[int],
           ratios: Sequence[float], deviation: str, logits: torch.Tensor, band_factor: float = 4.0) -> RepairReplay:
    """Replay a repair arm's prefill (see module doc). ids [T]; restored bool [T]; masks bool [layers, T] the
    positions it recomputed; k, v [layers, T, kv_heads, D] its cache after the prefill; before_k, before_v the same
    slots before it (the restored K/V); logits its next-token logits. `band_factor` scales the tie band at a check
    layer: the deviation's rounding, from the largest K (or V) error this layer's kept rows show against float64."""
    dev_ = dec.device
    T, L = ids.numel(), dec.num_layers
    if masks.shape != (L, T) or k.shape[:2] != (L, T) or restored.shape != (T,):
        raise DecoderReferenceError(f"replay: masks [{L}, {T}], k/v [{L}, {T}, ...] and restored [{T}] expected, got "
                                    f"{tuple(masks.shape)}, {tuple(k.shape)}, {tuple(restored.shape)}")
    masks, restored = masks.to(dev_), restored.to(dev_)
    out = RepairReplay()
    forced = ~restored
    forced[T - 1] = True
    n_forced, n_restored = int(forced.sum()), int((~forced).sum())
    checks = list(check_layers)
    active = torch.arange(T, device=dev_)
    h = dec.embed(ids)
    for layer in range(L):
        want_rows = masks[layer].nonzero()[:, 0]
        if not bool(masks[layer][forced].all()):
            out.forced_always_recomputed = False
            out.problems.append(f"layer {layer}: a position without restored data (or the last) not recomputed")
        q, kk, vv = dec.qkv(layer, h, active)
        if layer in checks:
            i = checks.index(layer)
            fresh, old = (kk, before_k[layer]) if deviation == "k" else (vv, before_v[layer])
            dev = ((fresh - old.to(dev_)[active].double()) ** 2).sum(dim=(1, 2))
            # the rounding of a deviation: |Δdev| <= 2·‖f − r‖·‖e‖ + ‖e‖², ‖e‖ from the kept rows' error here
            kept_in_active = masks[layer][active]
            got_fresh = (k if deviation == "k" else v)[layer].to(dev_)[active[kept_in_active]].double()
            e = float((got_fresh - fresh[kept_in_active]).flatten(1).norm(dim=1).max()) if kept_in_active.any() else 0.0
            keep = _keep_count(float(ratios[i]), n_forced, n_restored)
            cut_dev = dev.masked_fill(forced[active], float("inf")).sort(descending=True).values
            cut = float(cut_dev[min(keep, active.numel()) - 1]) if keep else 0.0
            band = band_factor * (2 * math.sqrt(max(cut, 0.0)) * e + e * e) if math.isfinite(cut) else 0.0
            sel = _selection(dev, active, forced[active], keep, want_rows, band)
            out.selections.append({"layer": layer, **sel})
            rows = kept_in_active          # follow the implementation's selection from here on
            active, h, q, kk, vv = active[rows], h[rows], q[rows], kk[rows], vv[rows]
        elif not torch.equal(active, want_rows):
            out.masks_follow_rule = False
            out.problems.append(f"layer {layer}: recomputed {want_rows.numel()} positions, the rule {active.numel()}")
            if not bool(torch.isin(want_rows, active).all()):   # rows back that an earlier layer already dropped
                raise DecoderReferenceError(f"layer {layer}: recomputes positions an earlier layer did not")
            rows = masks[layer][active]   # follow it: the rows it dropped here reuse what the slots hold
            active, h, q, kk, vv = active[rows], h[rows], q[rows], kk[rows], vv[rows]
        k_l, v_l = k[layer].to(dev_), v[layer].to(dev_)
        out.k_rel_err.append(rel_err(k_l[active], kk))
        out.v_rel_err.append(rel_err(v_l[active], vv))
        reused = ~masks[layer] & restored
        if not (torch.equal(k_l[reused], before_k[layer].to(dev_)[reused])
                and torch.equal(v_l[reused], before_v[layer].to(dev_)[reused])):
            out.reused_rows_untouched = False
            out.problems.append(f"layer {layer}: a restored row it did not recompute changed")
        keys, values = k_l.double(), v_l.double()
        keys[active], values[active] = kk, vv     # the recomputed rows' own float64 K/V, the rest as it holds them
        pos = torch.arange(T, device=dev_)
        h = dec.finish(layer, h, dec.attend(q, active, keys, values, pos))
    if active.numel() == 0 or int(active[-1]) != T - 1:
        # its logits come from another row than the last position's: a named failure, not a crash
        out.forced_always_recomputed = False
        out.problems.append("the last position was not recomputed at the last layer")
        out.logits_rel_err = math.inf
        return out
    out.logits_rel_err = rel_err(logits.to(dev_), dec.logits(h[-1:])[0])
    return out
