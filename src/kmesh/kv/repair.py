"""The repair's entry point: a request's prefill over restored K/V, through a small model interface.

`repair()` runs CacheBlend-style selective recomputation (kmesh.model.blend, arms repair / naive / stock / epic /
full) over any model that offers the layer-wise steps `RepairModel` names: the harness's LayerRunner
(kmesh.model.runner) implements it, and so can an engine's own loaded model. `repair_span()` is the vLLM connector's
use: the span [0, E) of a prompt whose shared segments were restored (by kmesh.kv.load) into a buffer in the
engine's geometry, repaired in the model's dtype, its K/V handed back for the engine's blocks (`write_span`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from kmesh.kv.layout import DTYPES, KVLayout
from kmesh.kv.restore import KVSegment, capture, restore
from kmesh.kv.rope import RopeConfig
from kmesh.model.blend import BlendResult, RepairConfig, blend


class RepairModel(Protocol):
    """What the repair needs of a model: its shape, a cache of its own, and the layer-wise steps blend() takes."""

    num_layers: int
    device: torch.device
    dtype: torch.dtype
    dtype_name: str
    rope: RopeConfig

    def new_cache(self, capacity: int, block_size: int = ..., fill: float = ...) -> Any: ...
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...
    def qkv(self, *args: Any, **kw: Any) -> Any: ...
    def check_qkv(self, *args: Any, **kw: Any) -> Any: ...
    def kept_qv(self, *args: Any, **kw: Any) -> Any: ...
    def rotary(self, *args: Any, **kw: Any) -> Any: ...
    def attend(self, *args: Any, **kw: Any) -> Any: ...
    def finish_layer(self, *args: Any, **kw: Any) -> Any: ...
    def logits(self, *args: Any, **kw: Any) -> Any: ...


def repair(model: RepairModel, ids: torch.Tensor, cache: Any, restored: torch.Tensor, config: RepairConfig,
           arm: str = "repair", chunks: Sequence[tuple[int, int]] | None = None) -> BlendResult:
    """Prefill `ids` over `cache`, whose positions `restored` marks hold restored K/V, with repair `arm`."""
    return blend(model, ids, cache, restored, config, arm, chunks=chunks)


@dataclass
class Repaired:
    segment: KVSegment          # K/V of positions [0, E) in the model's dtype
    logits: torch.Tensor        # next-token logits after the span (for agreement checks)
    recomputed: list[int]       # per layer
    masks: torch.Tensor | None = None       # bool [layers, E]: the positions recomputed at each layer
    restored: torch.Tensor | None = None    # bool [E]: the positions that held restored K/V
    before: KVSegment | None = None         # keep_restored: K/V of [0, E) as restored, before the repair


def kv_digest(seg: KVSegment) -> str:
    """sha256 of a segment's K then V bytes: tells whether two repairs handed over the very same K/V."""
    h = hashlib.sha256()
    for t in (seg.k, seg.v):
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _to_dtype(seg: KVSegment, dtype_name: str, torch_dtype: torch.dtype) -> KVSegment:
    if seg.dtype == dtype_name:
        return seg
    return KVSegment(seg.k.to(torch_dtype), None if seg.v is None else seg.v.to(torch_dtype), seg.positions,
                     dtype_name)


@torch.no_grad()
def repair_span(model: RepairModel, ids: Sequence[int], span_raw: torch.Tensor, span_layout: KVLayout,
                restored: torch.Tensor, config: RepairConfig, keep_restored: bool = False) -> Repaired:
    """Repair the span `ids` (= prompt[0:E]): `span_raw` (slot = position, `span_layout`) holds restored K/V at the
    positions `restored` marks; they move into the model's own cache in its dtype, every other position starts as
    poison (a position nobody wrote cannot pass), and repair() recomputes what it must. K/V of every position, and
    with `keep_restored` a copy of the span as restored (what a check of the repair compares with)."""
    E = len(ids)
    cache = model.new_cache(E, fill=float("nan"))
    pos = restored.nonzero().flatten()
    if len(pos):
        seg = _to_dtype(capture(span_raw, span_layout, pos, pos), model.dtype_name, model.dtype)
        restore(cache.raw, cache.layout, seg, pos, pos, model.rope)          # model cache: slot = position
    every = torch.arange(E)
    before = capture(cache.raw, cache.layout, every, every) if keep_restored else None
    out = repair(model, torch.tensor(list(ids)), cache, restored, config, arm="repair")
    return Repaired(capture(cache.raw, cache.layout, every, every), out.logits, out.counts(), out.masks.clone(),
                    restored.clone(), before)


def write_span(engine_raw: torch.Tensor, engine_layout: KVLayout, seg: KVSegment, slots: torch.Tensor,
               rope: RopeConfig) -> None:
    """Repaired K/V (model dtype) into the engine's slots, in the engine's dtype (positions unchanged)."""
    seg = _to_dtype(seg, engine_layout.dtype, DTYPES[engine_layout.dtype].storage)
    restore(engine_raw, engine_layout, seg, slots, seg.positions, rope)
