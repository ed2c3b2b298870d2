"""Interior shared segments for the engine: KMesh's runner repairs the prompt up to the end of the last shared
segment, and the repaired K/V go into the engine's blocks as externally computed tokens.

vLLM only takes external KV for a prefix, so the span [0, E) (E = end of the last shared segment found) is
claimed whole: segments move to their new positions (kmesh.restore shifts the keys), every other position of
the span is computed, and CacheBlend-style selective recomputation (kmesh.model.blend, arm "repair") repairs
the restored ones — all with the engine's own weights loaded into kmesh.model.runner.LayerRunner.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kmesh.model.blend import RepairConfig, blend
from kmesh.model.runner import LayerRunner
from kmesh.restore import KVSegment, capture, restore


@dataclass(frozen=True)
class Placed:
    """A loaded segment (keys rotated at its saved positions) and where the child prompt has it."""

    segment: KVSegment
    start: int        # first position in the child prompt


@dataclass
class Repaired:
    segment: KVSegment          # K/V of positions [0, E) in the runner's dtype
    logits: torch.Tensor        # the runner's next-token logits after the span (for agreement checks)
    recomputed: list[int]       # per layer


def placed_segment(window: Any, record: Any, start: int, span_end: int) -> Placed | None:
    """A verified payload in `window` (at offset 0: the segment's K/V, keys rotated at the record's positions)
    placed at `start` of the child prompt, cut at the span's end; None when nothing of it lies in the span."""
    n = min(int(record.tokens), span_end - start)
    if n <= 0:
        return None
    seg = capture(window.tensor, window.layout, torch.arange(n), torch.arange(record.start, record.start + n))
    return Placed(seg, start)


def kv_digest(seg: KVSegment) -> str:
    """sha256 of a segment's K then V bytes: tells whether two repairs handed over the very same K/V."""
    h = hashlib.sha256()
    for t in (seg.k, seg.v):
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_runner(folder: str | Path, dtype: torch.dtype = torch.float32) -> LayerRunner:
    from transformers import AutoModelForCausalLM

    from kmesh.model.offline import go_offline

    go_offline()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True).eval()
    return LayerRunner(model)


def _to_dtype(seg: KVSegment, dtype_name: str, torch_dtype: torch.dtype) -> KVSegment:
    if seg.dtype == dtype_name:
        return seg
    return KVSegment(seg.k.to(torch_dtype), None if seg.v is None else seg.v.to(torch_dtype), seg.positions,
                     dtype_name)


@torch.no_grad()
def repair_span(runner: LayerRunner, ids: Sequence[int], placed: Sequence[Placed],
                config: RepairConfig) -> Repaired:
    """Blend the span `ids` (= prompt[0:E]) over the placed segments; returns K/V of every span position."""
    E = len(ids)
    cache = runner.new_cache(E, fill=float("nan"))            # poison: a position nobody wrote cannot pass
    restored = torch.zeros(E, dtype=torch.bool)
    for p in placed:
        seg = _to_dtype(p.segment, runner.dtype_name, runner.dtype)
        new = torch.arange(p.start, p.start + seg.num_tokens)
        restore(cache.raw, cache.layout, seg, new, new, runner.rope)      # runner cache: slot = position
        restored[p.start:p.start + seg.num_tokens] = True
    out = blend(runner, torch.tensor(list(ids)), cache, restored, config, arm="repair")
    pos = torch.arange(E)
    return Repaired(capture(cache.raw, cache.layout, pos, pos), out.logits, out.counts())


def write_span(engine_raw: torch.Tensor, engine_layout: Any, seg: KVSegment, slots: torch.Tensor, rope: Any) -> None:
    """Repaired K/V (runner dtype) into the engine's slots, in the engine's dtype (positions unchanged)."""
    from kmesh.layout import DTYPES

    seg = _to_dtype(seg, engine_layout.dtype, DTYPES[engine_layout.dtype].storage)
    restore(engine_raw, engine_layout, seg, slots, seg.positions, rope)
