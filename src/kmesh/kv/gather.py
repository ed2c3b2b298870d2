"""A restore planned on the host and run as one launch, with no device synchronisation on the hot path.

    plan = plan_gather(cache_raw, cache_layout, private_raw, export_layout, src_slots, old_pos, dst_slots, new_pos,
                       rope)                  # every check on host data: numpy / ints / CPU tensors
    plan.run("cuda")                          # one kernel launch reads the rows where they lie in `private_raw`
    plan.run("torch")                         # the reference: capture + kmesh.kv.restore's torch path

`kmesh.kv.restore.plan_restore` validates device tensors on the device: each min/max/unique is a host sync, and the
segment must first be captured (a gather copy) out of the source. Here the plan knows every slot and position
on the host, so it checks them there, builds its small tables there (slots, source row offsets, moved flags,
shift tables in float64 → float32, the fp8 scales) and moves them to the device in ONE copy from pinned memory,
queued on the current stream: nothing waits on the device. The kernel (kernels/restore_rope.cu, `src_tok`) then
gathers each token's rows straight from the source buffer.

Refusals are those of `capture` + `plan_restore` on the same inputs: the same exception types, raised before the
first byte is written (tests/test_restore_gather.py checks the parity case by case).
"""
from __future__ import annotations

import numbers
import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kmesh.kv.errors import (DeviceMismatchError, DuplicateSlotError, LayerRangeError, PositionError, RestoreError,
                             SegmentError, SlotError, SlotRangeError)
from kmesh.kv.layout import KVLayout
from kmesh.kv.restore import (Index, RestorePlan, as_index, destination_view, run_torch, capture, check_compatible,
                              check_slot_range)
from kmesh.kv.rope import RopeConfig, host_shift_tables

__all__ = ["GatherPlan", "plan_gather", "gather_supported", "clear_plan_cache", "plan_cache_bytes",
           "PLAN_CACHE_ENTRIES", "PLAN_CACHE_BYTES"]

Backend = Literal["torch", "cuda"]
_ALIGN = 16  # bytes: every table in the packed buffer starts 16-byte aligned (the kernel loads float4 tables)


def _host_index(x: Index, name: str, error: type[RestoreError]) -> np.ndarray:
    """x as a host int64 array (a device tensor is copied back: one sync, the caller's choice)."""
    return as_index(x, name, torch.device("cpu"), error).numpy()


@dataclass
class GatherPlan:
    """A validated restore of rows read in place from a paged source; device tables uploaded, nothing written."""

    layout: KVLayout
    flat: torch.Tensor            # destination cache as storage elements
    src_layout: KVLayout
    src_flat: torch.Tensor        # source buffer as storage elements
    rope: RopeConfig
    first_layer: int
    tokens: int
    # host copies of what the device tables hold (int64 / bool / float32)
    host_slots: np.ndarray
    host_src_slots: np.ndarray
    host_old: np.ndarray
    host_moved: np.ndarray
    # device views into one uploaded buffer
    slots: torch.Tensor           # int64 [T] (−1 = skip)
    src_tok: torch.Tensor         # int64 [T]: element offset of token t's (block, offset) in the source
    moved: torch.Tensor           # bool [T]
    cos: torch.Tensor             # float32 [T, rotary_dim // 2]
    sin: torch.Tensor
    k_scale: torch.Tensor         # float32 scalars
    k_inv_scale: torch.Tensor
    _tables: torch.Tensor = field(repr=False, default=None)  # the device buffer the views above share
    launch_memo: dict | None = field(repr=False, default=None)  # launches made for these tables (kernel launcher)

    @property
    def gather_ok(self) -> bool:
        """The kernel can read this plan's source in place (see gather_supported)."""
        return gather_supported(self.src_layout)

    @property
    def num_layers(self) -> int:
        return self.src_layout.num_layers

    @property
    def num_written_tokens(self) -> int:
        return int((self.host_slots >= 0).sum())

    @property
    def segment_nbytes(self) -> int:
        lay = self.src_layout
        return self.tokens * lay.num_layers * lay.num_kv_heads * (lay.head_dim + lay.head_dim_v) * lay.element_size

    def run(self, backend: Backend = "torch") -> None:
        if backend == "cuda":
            from kmesh.cuda.restore_rope import launch_restore

            launch_restore(self)
        elif backend == "torch":
            run_torch(self.as_restore_plan())
        else:
            raise RestoreError(f"backend must be 'torch' or 'cuda', got {backend!r}")

    def as_restore_plan(self) -> RestorePlan:
        """The same restore as kmesh.kv.restore's plan: the rows captured into a segment (a copy), the same tables."""
        dev = self.flat.device
        src_raw = self.src_flat.view(torch.uint8)
        seg = capture(src_raw, self.src_layout, torch.from_numpy(self.host_src_slots).to(dev),
                      torch.from_numpy(self.host_old).to(dev))
        return RestorePlan(self.layout, seg, self.rope, self.flat, self.slots, self.moved, self.cos, self.sin,
                           self.first_layer, self.k_scale, self.k_inv_scale)


def gather_supported(src_layout: KVLayout) -> bool:
    """The kernel's gather reads rows with contiguous channels whose K and V share one per-token offset."""
    if src_layout.head_dim_v == 0:
        return src_layout.k_strides().channel == 1
    ks, vs = src_layout.k_strides(), src_layout.v_strides()
    return ks.channel == 1 and vs.channel == 1 and ks.block == vs.block and ks.token == vs.token


@dataclass
class _Tables:
    """What a plan's indices give, checked and uploaded once (kept per geometry: see plan_gather)."""

    host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]   # slots, src slots, old positions, moved
    buf: torch.Tensor
    views: list[torch.Tensor]
    stream: Any = None      # CUDA: the stream the upload was queued on, and an event after it
    uploaded: Any = None
    launches: dict = field(default_factory=dict)   # kmesh.cuda.restore_rope's launches of these tables


# A child restored segment by segment (kmesh.harness.child) keys one plan per segment: a 16k-token RAG child
# of 60 chunks
# holds 60. With 64 entries, two such children timed in turn evicted each other's plans (LRU) and every restore
# call checked and uploaded its tables again: 1.25 ms a segment on the H200 instead of ~0.35. Bounded by count and
# by the bytes of the uploaded tables (device memory; ~70 KB for a 256-token segment of a 64-dim head).
PLAN_CACHE_ENTRIES = 1024
PLAN_CACHE_BYTES = 256 << 20
_plan_cache: OrderedDict[tuple, _Tables] = OrderedDict()
_plan_cache_bytes = 0


def clear_plan_cache() -> None:
    """Forget every cached plan (the next plan_gather of any geometry checks and uploads anew)."""
    global _plan_cache_bytes
    _plan_cache.clear()
    _plan_cache_bytes = 0


def plan_cache_bytes() -> int:
    """Bytes of the uploaded tables the cached plans hold."""
    return _plan_cache_bytes


def _remember(key: tuple, tables: _Tables) -> None:
    global _plan_cache_bytes
    _plan_cache[key] = tables
    _plan_cache_bytes += tables.buf.nbytes
    while len(_plan_cache) > PLAN_CACHE_ENTRIES or (_plan_cache_bytes > PLAN_CACHE_BYTES and len(_plan_cache) > 1):
        _, old = _plan_cache.popitem(last=False)
        _plan_cache_bytes -= old.buf.nbytes


def _cache_key(layout: KVLayout, src_layout: KVLayout, rope: RopeConfig, first_layer: object, dev: torch.device,
               indices: tuple) -> tuple | None:
    parts = []
    for x in indices:
        if not (isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim == 1):
            return None   # only int64 host arrays are keyed by their bytes (others are checked each time)
        parts.append(x.tobytes())
    if type(first_layer) is not int:
        return None
    return (layout, src_layout, rope, first_layer, str(dev), *parts)


def plan_gather(raw: torch.Tensor, layout: KVLayout, src_raw: torch.Tensor, src_layout: KVLayout,
                src_slots: Index, old_positions: Index, slots: Index, new_positions: Index, rope: RopeConfig,
                first_layer: int = 0) -> GatherPlan:
    """Check a restore of source rows `src_slots` (saved at `old_positions`, every layer of `src_layout`) into
    `slots` of `raw` at `new_positions`, on the host; raise what capture + plan_restore would raise.

    The checked indices and their device tables are kept per geometry (layouts, rope, first layer, device and
    the index arrays' bytes, for int64 numpy indices; the last PLAN_CACHE_ENTRIES), so a child arrangement seen
    before costs only the buffer checks and the launch; the buffers themselves are checked every time."""
    flat = destination_view(raw, layout)
    src_flat = destination_view(src_raw, src_layout)
    dev = raw.device
    if src_raw.device != dev:
        raise DeviceMismatchError(f"source on {src_raw.device}, cache on {dev}")
    key = _cache_key(layout, src_layout, rope, first_layer, dev, (src_slots, old_positions, slots, new_positions))
    tables = _plan_cache.get(key) if key is not None else None
    if tables is None:
        tables = _check_and_upload(layout, src_layout, src_slots, old_positions, slots, new_positions, rope,
                                   first_layer, dev)
        if key is not None:
            _remember(key, tables)
    else:
        _plan_cache.move_to_end(key)
        if tables.stream is not None and torch.cuda.current_stream(dev) != tables.stream:
            torch.cuda.current_stream(dev).wait_event(tables.uploaded)   # queued, not waited for on the host
    slots_h, src_slots_h, old_h, moved_h = tables.host
    d_slots, d_tok, d_moved, d_cos, d_sin, d_scales = tables.views
    half = rope.rotary_dim // 2
    T = int(slots_h.size)
    return GatherPlan(layout, flat, src_layout, src_flat, rope, int(first_layer), T, slots_h, src_slots_h, old_h,
                      moved_h, d_slots, d_tok, d_moved.view(torch.bool), d_cos.view(T, half), d_sin.view(T, half),
                      d_scales[0], d_scales[1], tables.buf, tables.launches)


def _check_and_upload(layout: KVLayout, src_layout: KVLayout, src_slots: Index, old_positions: Index, slots: Index,
                      new_positions: Index, rope: RopeConfig, first_layer: object, dev: torch.device) -> _Tables:
    src_slots_h = _host_index(src_slots, "slots", SlotError)
    if src_slots_h.size and (int(src_slots_h.min()) < 0 or int(src_slots_h.max()) >= src_layout.num_slots):
        raise SlotRangeError(f"capture slots must be in [0, {src_layout.num_slots})")
    old_h = _host_index(old_positions, "positions", PositionError)
    T = int(src_slots_h.size)
    if old_h.size != T:   # what KVSegment refuses
        raise SegmentError(f"positions must be [T={T}], got ({old_h.size},)")
    L = src_layout.num_layers
    check_compatible(layout, src_layout.dtype, src_layout.num_kv_heads, src_layout.head_dim, src_layout.head_dim_v,
                     src_layout.k_scale, src_layout.v_scale, rope)
    if not isinstance(first_layer, numbers.Integral) or isinstance(first_layer, (bool, np.bool_)):
        raise LayerRangeError(f"first_layer must be an integer, got {type(first_layer).__name__}")
    first_layer = operator.index(first_layer)
    if first_layer < 0 or first_layer + L > layout.num_layers:
        raise LayerRangeError(f"segment layers [{first_layer}, {first_layer}+{L}) do not fit the cache's "
                              f"{layout.num_layers} layers")
    slots_h = _host_index(slots, "slots", SlotError)
    if slots_h.size != T:
        raise SlotError(f"{slots_h.size} slots for {T} tokens")
    if T:
        check_slot_range(int(slots_h.min()), int(slots_h.max()), layout)
        used = np.sort(slots_h[slots_h >= 0])
        repeated = used[1:][used[1:] == used[:-1]]
        if repeated.size:
            slot = int(repeated[0])
            raise DuplicateSlotError(f"destination slot {slot} is targeted {int((used == slot).sum())} times")
    new_h = _host_index(new_positions, "new_positions", PositionError)
    if new_h.size != T:
        raise PositionError(f"{new_h.size} new positions for {T} tokens")
    cos, sin = host_shift_tables(old_h, new_h, rope)   # raises RopeRangeError for positions off the table
    moved_h = old_h != new_h
    ks = src_layout.k_strides()
    src_tok = src_slots_h // src_layout.block_size * ks.block + src_slots_h % src_layout.block_size * ks.token
    buf, views = _upload(dev, [slots_h, src_tok, moved_h.astype(np.uint8), cos, sin,
                               np.array([layout.k_scale, 1.0 / layout.k_scale], dtype=np.float32)])
    tables = _Tables((slots_h, src_slots_h, old_h, moved_h), buf, views)
    if dev.type == "cuda":
        tables.stream = torch.cuda.current_stream(dev)
        tables.uploaded = torch.cuda.Event()
        tables.uploaded.record(tables.stream)
    return tables


def _upload(device: torch.device, arrays: list[np.ndarray]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Pack host arrays (each 16-byte aligned) into one buffer and move it to `device` in one copy: on CUDA from
    pinned memory, queued on the current stream (torch keeps the pinned block until the copy is done).
    Returns the device buffer and one typed view per array."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    cuda = device.type == "cuda"
    host = torch.empty(max(end, _ALIGN), dtype=torch.uint8, pin_memory=cuda)
    hv = host.numpy()
    for a, off in zip(arrays, offsets):
        hv[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    buf = host.to(device, non_blocking=True) if cuda else host
    views = [buf[off:off + a.nbytes].view(_TORCH[a.dtype.str]) for a, off in zip(arrays, offsets)]
    return buf, views


_TORCH = {np.dtype(np.int64).str: torch.int64, np.dtype(np.uint8).str: torch.uint8,
          np.dtype(np.float32).str: torch.float32}
