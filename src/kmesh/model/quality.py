"""How close two requests' outputs are: exact state comparison and the quality metrics of the repair arms.

Exact: `compare_states` — every layer's K and V, the next-token logits, generated tokens and per-layer
recompute masks must be bit-identical (torch.equal; NaN-safe through the byte views). Quality, each arm
against the full-recompute reference: top-1 next-token agreement, KL(P_full ‖ P_arm) of the next-token
distribution in float64, the first position where generated tokens diverge (= length when they never do),
and whether the generated text contains the workload's answer.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    d = (a.double() - b.double()).abs()
    return float(d.nan_to_num(nan=float("inf")).max()) if d.numel() else 0.0


def compare_states(a: Any, b: Any) -> dict[str, Any]:
    """Bit-for-bit comparison of two ChildOutcomes (see module doc); `layers_*` lists are per layer."""
    L = a.k.shape[0]
    k_eq = [_bytes_equal(a.k[i], b.k[i]) for i in range(L)]
    v_eq = [_bytes_equal(a.v[i], b.v[i]) for i in range(L)]
    m_eq = [bool(torch.equal(a.masks[i], b.masks[i])) for i in range(L)]
    diff = max(max_abs_diff(a.k, b.k), max_abs_diff(a.v, b.v), max_abs_diff(a.logits, b.logits))
    return {"k_equal_layers": sum(k_eq), "v_equal_layers": sum(v_eq), "mask_equal_layers": sum(m_eq),
            "layers": L, "logits_equal": _bytes_equal(a.logits, b.logits), "tokens_equal": a.tokens == b.tokens,
            "restored_equal": bool(torch.equal(a.restored, b.restored)), "max_abs_diff": diff,
            "first_unequal_layer": next((i for i in range(L) if not (k_eq[i] and v_eq[i] and m_eq[i])), None)}


def identical(cmp: dict[str, Any]) -> bool:
    L = cmp["layers"]
    return (cmp["k_equal_layers"] == L and cmp["v_equal_layers"] == L and cmp["mask_equal_layers"] == L
            and cmp["logits_equal"] and cmp["tokens_equal"] and cmp["restored_equal"] and cmp["max_abs_diff"] == 0.0)


def flip_bit(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A copy with one bit flipped, for negative controls (a comparison must catch it): element `index` of a bool
    tensor, else the lowest bit of byte `index` of its storage."""
    out = tensor.clone()
    if out.dtype == torch.bool:
        out.view(-1)[index] = ~out.view(-1)[index]
    else:
        out.view(-1).view(torch.uint8)[index] ^= 0x01
    return out


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def first_divergence(ref: Sequence[int], got: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), min(len(ref), len(got)))


def arm_quality(ref: Any, out: Any, answer: str, decode: Callable[[list[int]], str],
                matches: Callable[[str, str], bool]) -> dict[str, Any]:
    text = decode(out.tokens)
    return {"top1_agree": int(ref.logits.argmax()) == int(out.logits.argmax()),
            "kl": kl_divergence(ref.logits, out.logits), "first_divergence": first_divergence(ref.tokens, out.tokens),
            "exact_match": matches(text, answer), "text": text,
            "recomputed_fraction": float(out.masks.float().mean())}


def summarize(per_child: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm summary over children: top1_agreement, kl_mean, first_divergence_median, exact_match."""
    n = len(per_child)
    return {"children": n,
            "top1_agreement": sum(c["top1_agree"] for c in per_child) / n,
            "kl_mean": statistics.fmean(c["kl"] for c in per_child),
            "first_divergence_median": statistics.median(c["first_divergence"] for c in per_child),
            "exact_match": sum(c["exact_match"] for c in per_child) / n,
            "recomputed_fraction_mean": statistics.fmean(c["recomputed_fraction"] for c in per_child)}
