"""How close two requests' outputs are: exact state comparison and the quality metrics of the repair arms.

Exact: `compare_states` — every layer's K and V, the next-token logits, generated tokens and per-layer
recompute masks must be bit-identical (torch.equal; NaN-safe through the byte views).

Quality, each arm against the full-recompute reference (`arm_quality`, `summarize`):
  first token      top-1 agreement and KL(P_full ‖ P_arm) of the next-token distribution after the prompt
                   (float64).
  teacher-forced   the same two along the FULL arm's generated continuation: each arm's prefilled state is fed
                   the full arm's tokens and its next-token distribution is compared with full's at every step
                   (`teacher_forced_logits`; mean KL over steps, fraction of steps with equal argmax) — a repair
                   that is right for token 1 and drifts afterwards shows here, where the first-token figures and
                   the arm's own greedy tokens cannot show it (those stop comparing once they diverge).
  generation       the first position where the arm's greedy tokens differ from full's (= length when they never
                   do) and whether its text contains the workload's answer. Both read the continuation only up to
                   and including the model's end-of-turn token (`until_end_of_turn`): what follows the end of the
                   turn is not the model's answer.
  recomputed       positions recomputed after the last check layer (at the last layer), as a fraction of all
                   positions and of the restored positions (None when the arm restored nothing), and the fraction
                   of all layer × position cells recomputed (the layers before the check layer recompute
                   everything).
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Collection, Sequence

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


def kv_error(ref: Any, out: Any, layer: int, which: str = "k") -> float:
    """Σ (out − ref)² of one layer's K (or V) over every position, head and channel, in float64: how far an arm's
    cache at that layer is from the full prefill's (ChildOutcomes)."""
    a, b = (ref.k, out.k) if which == "k" else (ref.v, out.v)
    return float(((b[layer].double() - a[layer].double()) ** 2).sum())


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


def kl_per_step(ref_steps: torch.Tensor, steps: torch.Tensor) -> list[float]:
    """KL(P_ref ‖ P) of every row of two [steps, vocab] logit tensors, float64."""
    if ref_steps.shape != steps.shape:
        raise ValueError(f"teacher-forced logits of shapes {tuple(ref_steps.shape)} and {tuple(steps.shape)}")
    p = torch.log_softmax(ref_steps.double(), -1)
    q = torch.log_softmax(steps.double(), -1)
    return [float(x) for x in (p.exp() * (p - q)).sum(-1)]


def until_end_of_turn(tokens: Sequence[int], stop_ids: Collection[int]) -> list[int]:
    """The tokens up to and including the first end-of-turn token (all of them when there is none)."""
    stop = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stop:
            return list(tokens[:i + 1])
    return list(tokens)


def first_divergence(ref: Sequence[int], got: Sequence[int], stop_ids: Collection[int] = ()) -> int:
    """Index of the first token where `got` differs from `ref`, both read up to their end-of-turn token
    (= the shorter length when one is a prefix of the other)."""
    ref, got = until_end_of_turn(ref, stop_ids), until_end_of_turn(got, stop_ids)
    return next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), min(len(ref), len(got)))


def tokens_agree(got: Sequence[int], reference: Sequence[int], reference_logits: Sequence[torch.Tensor],
                 bound: float) -> dict[str, Any]:
    """Greedy tokens of a second code path against a reference path's, allowing exactly what rounding within
    `bound` (max |logit difference| allowed between the paths) allows: every reference token equal, or equal up
    to a first divergence at a step where the reference's two best logits lie within 2 × bound of each other
    (each may move by `bound`, so the pair can swap). Nothing after a divergence is compared: the two then
    continue from different prefixes. reference_logits[i]: the reference's logits [vocab] that chose its token i."""
    first = next((i for i, t in enumerate(reference) if i >= len(got) or got[i] != t), None)
    out: dict[str, Any] = {"first_divergence": first, "bound": bound}
    if first is None:
        return {**out, "agree": True, "margin": None}
    if first >= len(got) or first >= len(reference_logits):
        return {**out, "agree": False, "margin": None}
    top = reference_logits[first].double().topk(2).values
    margin = float(top[0] - top[1])
    return {**out, "agree": margin <= 2 * bound, "margin": margin}


def teacher_forced_logits(runner: Any, outcome: Any, tokens: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """Next-token logits [len(tokens), vocab] of `outcome`'s prefilled state (its K/V of the prompt and its
    next-token logits) along the given continuation (kmesh.model.runner.LayerRunner.teacher_forced), in a
    fresh cache: the outcome itself is not touched."""
    # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
    with torch.no_grad():
        T = outcome.k.shape[1]
        cache = runner.new_cache(T + len(tokens), block_size)
        for layer in range(outcome.k.shape[0]):
            cache.write_prefix(layer, outcome.k[layer].to(runner.device), outcome.v[layer].to(runner.device))
        return runner.teacher_forced(cache, T, outcome.logits.to(runner.device), tokens)


def _batched_prefix(runner: Any, outcomes: Sequence[Any], extra: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K, V [layers, B, T + extra, kv_heads, D] holding every outcome's prefilled K/V in slots [0, T) (NaN after:
    a slot read before it is written shows), and T. The outcomes are not touched."""
    if not outcomes:
        raise ValueError("no outcomes to batch")
    T = outcomes[0].k.shape[1]
    if any(o.k.shape != outcomes[0].k.shape for o in outcomes):
        raise ValueError(f"outcomes of different shapes cannot share a batch: {[tuple(o.k.shape) for o in outcomes]}")
    L, _, H, D = outcomes[0].k.shape
    k = torch.full((L, len(outcomes), T + extra, H, D), float("nan"), dtype=runner.dtype, device=runner.device)
    v = torch.full_like(k, float("nan"))
    for b, o in enumerate(outcomes):
        k[:, b, :T] = o.k.to(runner.device)
        v[:, b, :T] = o.v.to(runner.device)
    return k, v, T


def teacher_forced_logits_batch(runner: Any, outcomes: Sequence[Any],
                                tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """teacher_forced_logits of every outcome (all of one prompt length) along its own continuation tokens[b], as
    one batched forward (LayerRunner.extend_batch): [len(tokens[b]), vocab] per outcome. Shorter continuations are
    padded at their end; a position sees only what precedes it, so padding changes no row it returns. Each row
    equals the one-at-a-time result up to float rounding (tests/test_quality_batch.py bounds it)."""
    if len(tokens) != len(outcomes):
        raise ValueError(f"{len(outcomes)} outcomes but {len(tokens)} continuations")
    if any(len(t) == 0 for t in tokens):
        raise ValueError("teacher forcing needs at least one token")
    first = [o.logits.to(runner.device)[None] for o in outcomes]
    n = max(len(t) for t in tokens) - 1
    if n == 0:
        return first
    fed = [[int(x) for x in t[:-1]] + [0] * (n - len(t) + 1) for t in tokens]
    k, v, T = _batched_prefix(runner, outcomes, n)
    steps = runner.extend_batch(k, v, T, torch.tensor(fed, device=runner.device))
    return [torch.cat([f, steps[b, :len(t) - 1]]) for b, (f, t) in enumerate(zip(first, tokens))]


def decode_batch(runner: Any, outcomes: Sequence[Any], max_new_tokens: int,
                 stop_ids: Collection[int] = ()) -> list[list[int]]:
    """Every outcome's greedy continuation (LayerRunner.decode's rule: the first token from its prefill logits,
    then one step per token, ending after max_new_tokens or at the first end-of-turn token), all rows stepped
    together so each step reads the weights once. A row that has ended is carried along (its steps are
    discarded; its K/V lives in this batch's own buffer, never the outcome's). A token may differ from the row's
    own `decode` only at a near-tie of the compute dtype (reproduces_greedy's tolerance)."""
    stop = frozenset(int(t) for t in stop_ids)
    tokens = [[int(o.logits.argmax())] for o in outcomes]
    steps = max_new_tokens - 1
    if steps <= 0 or all(t[-1] in stop for t in tokens):
        return tokens
    k, v, T = _batched_prefix(runner, outcomes, steps)
    for i in range(steps):
        live = [t[-1] not in stop for t in tokens]
        if not any(live):
            break
        last = torch.tensor([[t[-1]] for t in tokens], device=runner.device)
        nxt = runner.extend_batch(k, v, T + i, last)[:, 0].argmax(-1).tolist()
        for row, (t, alive) in enumerate(zip(tokens, live)):
            if alive:
                t.append(int(nxt[row]))
    return tokens


# Relative rounding unit of each compute dtype: a logit computed two ways (one batched forward vs one step at a
# time) may differ by a few of these times its magnitude, so a greedy step whose top two logits are closer than that
# is a near-tie either path may break its own way.
ROUNDING_UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TIE_UNITS = 16


def reproduces_greedy(steps: torch.Tensor, tokens: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
    """Does teacher forcing along `tokens` (logits [len(tokens), vocab]) give `tokens` back as its argmax?

    Every step must, except a near-tie: the teacher-forced logit of the greedy token is within
    TIE_UNITS · ROUNDING_UNIT[dtype] · max|logit| of the step's largest. A greedy token that trails by more is a real
    disagreement (the two paths computed different states). Returns {"ok", "steps", "disagree": [{step, gap,
    tolerance}]}."""
    want = torch.as_tensor(list(tokens), dtype=torch.long, device=steps.device)
    logits = steps.float()
    top = logits.max(-1).values
    gap = top - logits.gather(-1, want[:, None])[:, 0]
    tol = TIE_UNITS * ROUNDING_UNIT[dtype] * logits.abs().max(-1).values
    rows = [{"step": i, "gap": float(gap[i]), "tolerance": float(tol[i])}
            for i in (logits.argmax(-1) != want).nonzero()[:, 0].tolist()]
    return {"ok": all(r["gap"] <= r["tolerance"] for r in rows), "steps": len(tokens), "disagree": rows}


def recomputed(out: Any) -> dict[str, Any]:
    """What an outcome recomputed (see module doc): counts from its per-layer masks and restored mask."""
    last = out.masks[-1].cpu()
    restored = out.restored.cpu().bool()
    n_restored = int(restored.sum())
    n = int(last.sum())
    return {"recomputed_positions": n, "positions": int(last.numel()), "restored_positions": n_restored,
            "recomputed_fraction_of_positions": n / last.numel(),
            "recomputed_fraction_of_restored": int((last & restored).sum()) / n_restored if n_restored else None,
            "recomputed_fraction_of_layer_positions": float(out.masks.float().mean()),
            "recomputed_per_layer": [int(x) for x in out.masks.sum(1).tolist()]}


def arm_quality(ref: Any, out: Any, answer: str, decode: Callable[[list[int]], str],
                matches: Callable[[str, str], bool], ref_steps: torch.Tensor, out_steps: torch.Tensor,
                stop_ids: Collection[int] = ()) -> dict[str, Any]:
    """One arm's outcome against the full reference (module doc). `ref_steps` / `out_steps`: both states'
    teacher-forced logits along the reference's own continuation (teacher_forced_logits)."""
    text = decode(until_end_of_turn(out.tokens, stop_ids))
    kls = kl_per_step(ref_steps, out_steps)
    agree = (ref_steps.argmax(-1) == out_steps.argmax(-1)).tolist()
    return {"top1_agree": int(ref.logits.argmax()) == int(out.logits.argmax()),
            "kl": kl_divergence(ref.logits, out.logits),
            "kl_teacher_forced": statistics.fmean(kls), "kl_teacher_forced_max": max(kls),
            "top1_teacher_forced": sum(agree) / len(agree), "teacher_forced_steps": len(kls),
            "kl_per_step": kls,
            "first_divergence": first_divergence(ref.tokens, out.tokens, stop_ids),
            "exact_match": matches(text, answer), "text": text, **recomputed(out)}


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def summarize(per_child: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm summary over children (module doc): first-token and teacher-forced top-1 / KL, generation,
    recomputed fractions."""
    n = len(per_child)
    return {"children": n,
            "top1_first_token": sum(c["top1_agree"] for c in per_child) / n,
            "kl_first_token_mean": statistics.fmean(c["kl"] for c in per_child),
            "top1_teacher_forced": statistics.fmean(c["top1_teacher_forced"] for c in per_child),
            "kl_teacher_forced_mean": statistics.fmean(c["kl_teacher_forced"] for c in per_child),
            "first_divergence_median": statistics.median(c["first_divergence"] for c in per_child),
            "exact_match": sum(c["exact_match"] for c in per_child) / n,
            "recomputed_positions": [c["recomputed_positions"] for c in per_child],
            "recomputed_fraction_of_positions_mean": statistics.fmean(c["recomputed_fraction_of_positions"]
                                                                       for c in per_child),
            "recomputed_fraction_of_restored_mean": _mean([c["recomputed_fraction_of_restored"] for c in per_child]),
            "recomputed_fraction_of_layer_positions_mean": statistics.fmean(
                c["recomputed_fraction_of_layer_positions"] for c in per_child)}
