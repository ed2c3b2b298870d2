"""One child request end to end: stage its shared segments, copy them private, restore, repair, decode.

    out = run_child(ctx, child, source, staging, private)
    restored, res = prefill_from_segments(ctx, child, source, staging, private, cache, "kmesh", owner, events,
                                          part=intervals.part)   # run_child's path up to the first token, timed

Every segment is loaded into staging in catalog order (its size checked on arrival), then all their digests are
checked in one call (one GPU launch set for blake3 on CUDA); the verified segments are then
copied into the private buffer (drained) and restored into the child's model state at once. A failure at segment k
still leaves exactly segments 0..k-1 restored (they are copied and restored before the error propagates). Any
SegmentLoadError or transfer failure on the way ends in a full recompute of the prompt — but only once nothing is
pending on the child's memory: the private copies' tickets are drained first (copy_private_each does so even when
a submit fails after accepting), and if a drain cannot finish the child fails instead of recomputing into memory
a copy may still write. The model state is poisoned (NaN) before use, and the slots past the request are canaries that
must still be NaN afterwards. The recompute runs in the model state as the failure left it — the segments
restored before the failure are still there (`ChildOutcome.written_before_recompute` says where) — and must
overwrite every one of them: a full prefill writes every position of the prompt at every layer, so its result
is the full-recompute reference's whatever the memory held, and a stale slot it missed would show.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection

import torch

from kmesh.errors import KMeshError
from kmesh.harness.workload import Child
from kmesh.kv.catalog import Catalog
from kmesh.kv.errors import SegmentLoadError
from kmesh.kv.load import Destination, LoadStep, PartTimer, Placement, restore_placed, untimed
from kmesh.kv.repair import repair
from kmesh.kv.sources import SegmentSource
from kmesh.model.blend import BlendResult, RepairConfig
from kmesh.model.runner import KVCache, LayerRunner
from kmesh.transfer.engine import TransferEngine
from kmesh.transfer.errors import TransferError

POISON = float("nan")


class ChildStateError(KMeshError):
    """A child's model state broke an invariant (poison left inside the request, a canary overwritten)."""


@dataclass
class ChildContext:
    runner: LayerRunner
    catalog: Catalog
    engine: TransferEngine
    repair: RepairConfig
    max_new_tokens: int
    restore_backend: str = "torch"
    # the model's end-of-turn token ids: a child's continuation ends at the first (empty: always max_new_tokens)
    stop_ids: tuple[int, ...] = ()


@dataclass
class ChildOutcome:
    child: str
    source: str
    arm: str
    k: torch.Tensor              # [layers, T, kv_heads, D] after the prefill (copies)
    v: torch.Tensor
    logits: torch.Tensor         # next-token logits [vocab]
    tokens: list[int]
    masks: torch.Tensor          # bool [layers, T]
    restored: torch.Tensor       # bool [T]: positions whose K/V came from the segments
    fallback: str | None = None  # why the child recomputed fully (None: the segments were used)
    events: list[str] = field(default_factory=list)
    # bool [cache slots]: where the model state held something other than poison when the fallback recompute
    # began (what the failure left there); None when there was no fallback
    written_before_recompute: torch.Tensor | None = None

    def describe(self) -> dict[str, Any]:
        written = self.written_before_recompute
        return {"child": self.child, "source": self.source, "arm": self.arm, "fallback": self.fallback,
                "events": self.events, "tokens": self.tokens, "restored": int(self.restored.sum()),
                "recomputed_per_layer": [int(x) for x in self.masks.sum(1).tolist()],
                "slots_written_before_recompute": None if written is None else int(written.sum())}


def check_canaries(cache: KVCache, used: int) -> None:
    """No NaN inside [0, used) of any layer; every slot after it still NaN (nothing wrote outside)."""
    for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
        if torch.isnan(k[:used]).any() or torch.isnan(v[:used]).any():
            raise ChildStateError(f"layer {layer}: poison left inside the request's {used} slots")
        if not (torch.isnan(k[used:]).all() and torch.isnan(v[used:]).all()):
            raise ChildStateError(f"layer {layer}: a canary slot past {used} was overwritten")


def written_slots(cache: KVCache) -> torch.Tensor:
    """bool [capacity]: the slots where some layer's K or V holds something other than the poison (NaN)."""
    written = torch.zeros(cache.capacity, dtype=torch.bool, device=cache.raw.device)
    for k, v in zip(cache.k, cache.v):
        written |= ~torch.isnan(k).flatten(1).all(1) | ~torch.isnan(v).flatten(1).all(1)
    return written.cpu()


def restored_mask(child: Child) -> torch.Tensor:
    """bool [T]: the positions where the child placed a shared segment (all of them restored)."""
    mask = torch.zeros(len(child.ids), dtype=torch.bool)
    for p in child.placements:
        mask[p.start:p.end] = True
    return mask


def restored_chunks(child: Child, restored: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every segment the child placed that is wholly restored: the chunks the epic arm
    recomputes the heads of (a segment a failure left unrestored is no chunk; its positions are recomputed)."""
    r = restored.cpu()
    return [(p.start, p.end) for p in child.placements if bool(r[p.start:p.end].all())]


def prefill(ctx: ChildContext, child: Child, cache: KVCache, restored: torch.Tensor, arm: str) -> BlendResult:
    """The child's prefill with repair `arm` over its restored positions: the first token's logits."""
    ids = torch.tensor(child.ids, device=ctx.runner.device)
    chunks = restored_chunks(child, restored) if arm == "epic" else None
    return repair(ctx.runner, ids, cache, restored, ctx.repair, arm, chunks=chunks)


def prefill_and_decode(ctx: ChildContext, child: Child, cache: KVCache, restored: torch.Tensor,
                       arm: str) -> tuple[BlendResult, list[int]]:
    res = prefill(ctx, child, cache, restored, arm)
    tokens = ctx.runner.decode(cache, len(child.ids), res.logits, ctx.max_new_tokens, stop_ids=ctx.stop_ids)
    return res, tokens


def placements_of(child: Child) -> list[Placement]:
    """Where the child placed each shared segment, as the load step's placements."""
    return [Placement(seg, a, b - a) for seg, a, b in child.segment_slices()]


def restore_child(cache: KVCache, catalog: Catalog, private: torch.Tensor, child: Child, runner: LayerRunner,
                  backend: str = "torch", segments: Collection[int] | None = None) -> torch.Tensor:
    """Restore the child's segments (every one, or those whose index is in `segments`) from the private copy into
    its cache at the child's positions (kmesh.kv.load.restore_placed, slot = position). Returns the bool [T] mask
    of the positions restored by this call."""
    placements = placements_of(child)
    done = restore_placed(Destination(cache.raw, cache.layout, runner.rope, None, backend), catalog, private,
                          placements, segments)
    restored = torch.zeros(len(child.ids), dtype=torch.bool)
    for p in done:
        restored[p.start:p.start + p.tokens] = True
    return restored


def prefill_from_segments(ctx: ChildContext, child: Child, source: SegmentSource, staging: torch.Tensor,
                          private: torch.Tensor, cache: KVCache, arm: str, owner: str, events: list[str],
                          part: PartTimer = untimed,
                          prefill_fn: Callable[[KVCache, torch.Tensor], BlendResult] | None = None,
                          ) -> tuple[torch.Tensor, BlendResult]:
    """run_child's path from the child's request to its first token's logits: the load step (kmesh.kv.load.LoadStep:
    every segment loaded from `source` into staging in catalog order, every loaded digest checked in one call, the
    verified ones copied private in one batch and one drain, restored at once), then the prefill with repair `arm`.
    Returns (restored mask, prefill result).

    A load, digest or transfer error at segment k propagates (run_child turns it into a recompute) after segments
    0..k-1, verified (and copied) before it, were restored: the model state then holds exactly the segments before
    the failure. `part(name)` times the steps as parts: stage ⊃ load, private-copy, restore; then repair.
    `prefill_fn(cache, restored)` replaces the eager prefill (a CUDA graph of the same blend captured over `cache`)."""
    placements = placements_of(child)
    step = LoadStep(source, staging, ctx.catalog,
                    Destination(cache.raw, cache.layout, ctx.runner.rope, None, ctx.restore_backend), placements,
                    private=private, engine=ctx.engine, owner=owner, part=part, events=events)
    outcome = step.run()
    restored = outcome.positions(len(child.ids), placements)
    if outcome.failure is not None:
        raise outcome.failure
    with part("repair"):
        res = prefill_fn(cache, restored) if prefill_fn is not None else prefill(ctx, child, cache, restored, arm)
    return restored, res


def outcome_of(ctx: ChildContext, child: Child, source: str, arm: str, cache: KVCache, restored: torch.Tensor,
               res: BlendResult, tokens: list[int], fallback: str | None, events: list[str],
               written_before_recompute: torch.Tensor | None = None) -> ChildOutcome:
    T = len(child.ids)
    # decode wrote one slot per token but the last (fewer than max_new_tokens - 1 when it stopped at end-of-turn)
    check_canaries(cache, T + len(tokens) - 1)
    k, v = cache.stacked(T)
    return ChildOutcome(child.name, source, arm, k, v, res.logits.clone(), tokens, res.masks.clone(), restored,
                        fallback, events, written_before_recompute)


def new_cache(ctx: ChildContext, child: Child) -> KVCache:
    # one canary block beyond what prefill + decode write
    need = len(child.ids) + ctx.max_new_tokens - 1
    bs = ctx.catalog.layout.block_size
    return ctx.runner.new_cache(need + bs, bs, fill=POISON)


def full_reference(ctx: ChildContext, child: Child) -> ChildOutcome:
    """The full-recompute reference of one child (no segments)."""
    cache = new_cache(ctx, child)
    restored = torch.zeros(len(child.ids), dtype=torch.bool)
    res, tokens = prefill_and_decode(ctx, child, cache, restored, "full")
    return outcome_of(ctx, child, "none", "full", cache, restored, res, tokens, None, ["recompute"])


def run_child(ctx: ChildContext, child: Child, source: SegmentSource, staging: torch.Tensor,
              private: torch.Tensor, arm: str = "repair", owner: str | None = None) -> ChildOutcome:
    """Restore the child's segments from `source` and repair with `arm`; on any load or transfer failure,
    drain, then recompute the whole prompt in the model state as the failure left it (see module doc)."""
    owner = owner or f"child-{child.name}"
    events: list[str] = []
    cache = new_cache(ctx, child)
    try:
        restored, res = prefill_from_segments(ctx, child, source, staging, private, cache, arm, owner, events)
        tokens = ctx.runner.decode(cache, len(child.ids), res.logits, ctx.max_new_tokens, stop_ids=ctx.stop_ids)
        return outcome_of(ctx, child, source.name, arm, cache, restored, res, tokens, None, events)
    except (SegmentLoadError, TransferError) as e:
        fallback = f"{type(e).__name__}: {e}"
        events.append(f"failed:{type(e).__name__}")
    pending = ctx.engine.pending(owner)
    if pending:
        ctx.engine.drain(pending, timeout=60.0)   # raises (no recompute) if the copy cannot be finished
        events.append("drained-after-failure")
    events.append(f"pending-before-recompute:{len(ctx.engine.pending(owner))}")
    # No re-poisoning: the recompute overwrites whatever the failure left (recorded here, checked by the controls)
    written = written_slots(cache)
    none = torch.zeros(len(child.ids), dtype=torch.bool)
    res, tokens = prefill_and_decode(ctx, child, cache, none, "full")
    events.append("recompute")
    return outcome_of(ctx, child, source.name, "full", cache, none, res, tokens, fallback, events, written)
