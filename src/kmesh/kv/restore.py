"""Restore saved KV segments into destination slots of any `KVLayout`, moving keys to their new positions.

    seg = capture(raw, layout, src_slots, positions)            # what a save would keep
    restore(raw2, layout2, seg, dst_slots, new_positions, rope)  # keys rotated by (new - old)·ω

A segment is tokens × layers × kv-heads × channels (+ the positions its keys were rotated at). Restore
writes it into `dst_slots` (−1 = padding: skipped) of layers [first_layer, first_layer + L'):
keys' rotary channels are rotated by one rotation from the ORIGINAL positions (kmesh.kv.rope); values,
non-rotary key channels and keys of tokens that do not move are copied byte for byte; nothing
outside the destination cells is written. fp8 keys: dequantize, rotate, requantize with the same scale.

Every input is checked before the first byte is written (`plan_restore`), so a refused restore leaves
the cache exactly as it was. Two executions of one plan with identical results: `backend="torch"`
(reference, CPU or CUDA) and `backend="cuda"` (kernels/restore_rope.cu).
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from kmesh.kv.errors import (DestinationError,  # noqa: F401 (re-exported: callers catch them as kmesh.kv.restore.*)
                             DeviceMismatchError, DtypeMismatchError, DuplicateSlotError, HeadCountError, HeadDimError,
                             LayerRangeError, MisalignedDestinationError, NonContiguousDestinationError, PositionError,
                             RestoreError, ScaleMismatchError, SegmentError, SlotError, SlotRangeError)
from kmesh.kv.layout import DTYPES, KVLayout, LayoutError, MisalignedLayoutError, dequantize, quantize
from kmesh.kv.rope import RopeConfig, apply_rotation, shift_tables

__all__ = [
    "RestoreError", "SegmentError", "HeadCountError", "HeadDimError", "DtypeMismatchError", "ScaleMismatchError",
    "LayerRangeError", "SlotError", "SlotRangeError", "DuplicateSlotError", "PositionError", "DestinationError",
    "NonContiguousDestinationError", "MisalignedDestinationError", "DeviceMismatchError",
    "KVSegment", "RestorePlan", "capture", "plan_restore", "restore",
]

Backend = Literal["torch", "cuda"]
Index = torch.Tensor | np.ndarray | Sequence[int]  # integers only: see as_index


@dataclass(frozen=True)
class KVSegment:
    """Saved attention state: k [T, L, H, Dk], v [T, L, H, Dv] or None (MLA), positions int64 [T].

    Tensors hold the cache's storage dtype (uint8 bytes for fp8, stored as fp8(x / scale)); keys are
    rotated at `positions`.
    """

    k: torch.Tensor
    v: torch.Tensor | None
    positions: torch.Tensor
    dtype: str
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SegmentError(f"segment dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        storage = DTYPES[self.dtype].storage
        if not isinstance(self.k, torch.Tensor) or self.k.dim() != 4:
            raise SegmentError(f"segment k must be a [T, L, H, D] tensor, got "
                               f"{tuple(self.k.shape) if isinstance(self.k, torch.Tensor) else type(self.k).__name__}")
        if self.k.dtype != storage:
            raise DtypeMismatchError(f"segment {self.dtype} keys must be stored as {storage}, got {self.k.dtype}")
        if self.v is not None:
            if not isinstance(self.v, torch.Tensor) or self.v.dim() != 4 or self.v.shape[:3] != self.k.shape[:3]:
                raise SegmentError(f"segment v must be [T, L, H, Dv] matching k {tuple(self.k.shape)}, got "
                                   f"{tuple(self.v.shape) if isinstance(self.v, torch.Tensor) else self.v!r}")
            if self.v.dtype != storage:
                raise DtypeMismatchError(f"segment values must be stored as {storage}, got {self.v.dtype}")
            if self.v.device != self.k.device:
                raise DeviceMismatchError(f"segment k on {self.k.device}, v on {self.v.device}")
        p = self.positions
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.shape[0] != self.k.shape[0]:
            raise SegmentError(f"positions must be [T={self.k.shape[0]}], got "
                               f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
        if p.dtype.is_floating_point or p.dtype == torch.bool or p.dtype.is_complex:
            raise SegmentError(f"positions must be integers, got {p.dtype}")
        for name in ("k_scale", "v_scale"):
            s = getattr(self, name)
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
                raise SegmentError(f"{name} must be a finite number > 0, got {s!r}")

    @property
    def num_tokens(self) -> int:
        return self.k.shape[0]

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        v = 0 if self.v is None else self.v.numel() * self.v.element_size()
        return self.k.numel() * self.k.element_size() + v

    def layers(self, start: int, stop: int) -> "KVSegment":
        """The same tokens, layers [start, stop) only (e.g. for layer-by-layer loading)."""
        return KVSegment(self.k[:, start:stop], None if self.v is None else self.v[:, start:stop],
                         self.positions, self.dtype, self.k_scale, self.v_scale)

    def to(self, device: str | torch.device) -> "KVSegment":
        return KVSegment(self.k.to(device), None if self.v is None else self.v.to(device),
                         self.positions.to(device), self.dtype, self.k_scale, self.v_scale)


def capture(raw: torch.Tensor, layout: KVLayout, slots: Index, positions: Index,
            layers: Index | None = None) -> KVSegment:
    """Copy the K/V of `slots` (all >= 0) out of a cache into a segment, as saved at `positions`."""
    flat = destination_view(raw, layout)
    slots = as_index(slots, "slots", raw.device, SlotError)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= layout.num_slots):
        raise SlotRangeError(f"capture slots must be in [0, {layout.num_slots})")
    lay = list(range(layout.num_layers)) if layers is None else _layer_list(layers, layout.num_layers)
    pos = as_index(positions, "positions", raw.device, PositionError)
    b, n = layout.split_slots(slots)
    # One gather straight into [T, L', H, D]: index the (block, offset) axes of a [B, N, L, H, D] view (a list
    # of layers would first copy every layer of the whole cache, then gather, then transpose: three copies).
    lsel = slice(None) if lay == list(range(layout.num_layers)) else lay

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.permute(1, 2, 0, 3, 4)[b, n][:, lsel].contiguous()

    k = take(layout.k_tensor(flat))
    v = take(layout.v_tensor(flat)) if layout.head_dim_v else None
    return KVSegment(k, v, pos, layout.dtype, layout.k_scale, layout.v_scale)


@dataclass
class RestorePlan:
    """A validated restore, ready to execute (nothing written yet)."""

    layout: KVLayout
    segment: KVSegment
    rope: RopeConfig
    flat: torch.Tensor          # cache as storage elements
    slots: torch.Tensor         # int64 [T] on the cache's device (−1 = skip)
    moved: torch.Tensor         # bool [T]: new position != old position
    cos: torch.Tensor           # float32 [T, rotary_dim // 2]
    sin: torch.Tensor
    first_layer: int
    k_scale: torch.Tensor       # float32 scalars (fp8: dequantize ×scale, requantize ×inv_scale)
    k_inv_scale: torch.Tensor

    @property
    def num_written_tokens(self) -> int:
        return int((self.slots >= 0).sum())

    def bytes_moved(self) -> dict[str, int]:
        """Bytes a restore must read and write at least (segment in, destination cells out)."""
        seg = self.segment.nbytes
        tables = 2 * self.cos.numel() * 4 + self.slots.numel() * 9
        return {"read": seg + tables, "written": seg, "total": 2 * seg + tables}

    def run(self, backend: Backend = "torch") -> None:
        if backend == "torch":
            run_torch(self)
        elif backend == "cuda":
            from kmesh.cuda.restore_rope import launch_restore

            launch_restore(self)
        else:
            raise RestoreError(f"backend must be 'torch' or 'cuda', got {backend!r}")


def plan_restore(raw: torch.Tensor, layout: KVLayout, segment: KVSegment, slots: Index, new_positions: Index,
                 rope: RopeConfig, first_layer: int = 0) -> RestorePlan:
    """Check everything a restore needs, before any write; raise a specific RestoreError (or RopeRangeError)."""
    flat = destination_view(raw, layout)
    dev = raw.device
    if not isinstance(segment, KVSegment):
        raise SegmentError(f"segment must be a KVSegment, got {type(segment).__name__}")
    if segment.k.device != dev:
        raise DeviceMismatchError(f"segment on {segment.k.device}, cache on {dev}")
    T, L, H, Dk = segment.k.shape
    check_compatible(layout, segment.dtype, H, Dk, 0 if segment.v is None else segment.v.shape[3],
                     segment.k_scale, segment.v_scale, rope)
    if not isinstance(first_layer, numbers.Integral) or isinstance(first_layer, (bool, np.bool_)):
        raise LayerRangeError(f"first_layer must be an integer, got {type(first_layer).__name__}")
    first_layer = operator.index(first_layer)  # numpy / other Integral -> int (the CUDA launch packs it)
    if first_layer < 0 or first_layer + L > layout.num_layers:
        raise LayerRangeError(f"segment layers [{first_layer}, {first_layer}+{L}) do not fit the cache's "
                              f"{layout.num_layers} layers")
    slots_t = as_index(slots, "slots", dev, SlotError)
    if slots_t.numel() != T:
        raise SlotError(f"{slots_t.numel()} slots for {T} tokens")
    if T:
        check_slot_range(int(slots_t.min()), int(slots_t.max()), layout)
        used = slots_t[slots_t >= 0]
        uniq, counts = torch.unique(used, return_counts=True)
        if uniq.numel() != used.numel():
            raise DuplicateSlotError(f"destination slot {int(uniq[counts > 1][0])} is targeted "
                                     f"{int(counts.max())} times")
    new_t = as_index(new_positions, "new_positions", dev, PositionError)
    if new_t.numel() != T:
        raise PositionError(f"{new_t.numel()} new positions for {T} tokens")
    old_t = segment.positions.to(device=dev, dtype=torch.int64)
    cos, sin = shift_tables(old_t, new_t, rope)        # raises RopeRangeError for positions off the table
    scale = torch.tensor(float(layout.k_scale), dtype=torch.float32, device=dev)
    inv = torch.tensor(float(1.0 / layout.k_scale), dtype=torch.float32, device=dev)
    return RestorePlan(layout, segment, rope, flat, slots_t, old_t != new_t, cos.contiguous(), sin.contiguous(),
                       first_layer, scale, inv)


def check_slot_range(lo: int, hi: int, layout: KVLayout) -> None:
    """Destination slots (lowest lo, highest hi) lie in [-1, num_slots), -1 being padding; else SlotRangeError."""
    if lo < -1 or hi >= layout.num_slots:
        bad = lo if lo < -1 else hi
        raise SlotRangeError(f"slot {bad} outside [-1, {layout.num_slots}) (num_blocks={layout.num_blocks} "
                             f"× block_size={layout.block_size})")


def check_compatible(layout: KVLayout, dtype: str, heads: int, head_dim: int, head_dim_v: int, k_scale: float,
                     v_scale: float, rope: RopeConfig) -> None:
    """A segment of this dtype / geometry / fp8 scales fits the cache `layout` under `rope`, else the specific
    RestoreError (shared by plan_restore and kmesh.kv.gather, so both refuse alike)."""
    if dtype != layout.dtype:
        raise DtypeMismatchError(f"segment dtype {dtype}, cache dtype {layout.dtype}")
    if heads != layout.num_kv_heads:
        raise HeadCountError(f"segment has {heads} kv-heads, cache has {layout.num_kv_heads}")
    if head_dim != layout.head_dim:
        raise HeadDimError(f"segment keys have {head_dim} channels, cache keys {layout.head_dim}")
    if head_dim_v != layout.head_dim_v:
        raise HeadDimError(f"segment values have {head_dim_v} channels, cache values {layout.head_dim_v}")
    if rope.head_dim != layout.head_dim - layout.rope_offset:
        raise HeadDimError(f"rope covers {rope.head_dim} channels, cache keys have "
                           f"{layout.head_dim - layout.rope_offset} from channel {layout.rope_offset}")
    if layout.fp8_dtype is not None and (k_scale != layout.k_scale or v_scale != layout.v_scale):
        raise ScaleMismatchError(f"segment scales k={k_scale} v={v_scale}, cache scales "
                                 f"k={layout.k_scale} v={layout.v_scale}")


def restore(raw: torch.Tensor, layout: KVLayout, segment: KVSegment, slots: Index, new_positions: Index,
            rope: RopeConfig, first_layer: int = 0, backend: Backend = "torch") -> RestorePlan:
    """Validate, then write the segment into `slots` of `raw` (see module doc). Returns the executed plan."""
    plan = plan_restore(raw, layout, segment, slots, new_positions, rope, first_layer)
    plan.run(backend)
    return plan


# ---------------------------------------------------------------------------------------------------
# Torch reference path


def shifted_keys(plan: RestorePlan) -> torch.Tensor:
    """The keys as they must land: [T, L', H, Dk] in storage dtype; only moved tokens' rotary channels change."""
    seg, lay, rope = plan.segment, plan.layout, plan.rope
    T, L, H, _ = seg.k.shape
    rs, hd, rd = lay.rope_offset, rope.head_dim, rope.rotary_dim
    part = seg.k[..., rs:rs + hd].reshape(T, L * H, hd)
    fmt = lay.fp8_dtype
    x = dequantize(part, fmt, plan.k_scale) if fmt is not None else part
    y = apply_rotation(x, plan.cos, plan.sin, rope)[..., :rd]
    if fmt is not None:
        y = quantize(y, fmt, plan.k_inv_scale)
    out = seg.k.clone()
    region = out[..., rs:rs + rd]
    region[plan.moved] = y.reshape(T, L, H, rd)[plan.moved]
    return out


def run_torch(plan: RestorePlan) -> None:
    lay, seg = plan.layout, plan.segment
    keep = plan.slots >= 0
    b, n = lay.split_slots(plan.slots[keep])
    layers = slice(plan.first_layer, plan.first_layer + seg.num_layers)
    keys = shifted_keys(plan)
    lay.k_tensor(plan.flat)[layers, b, n] = keys[keep].transpose(0, 1)
    if seg.v is not None:
        lay.v_tensor(plan.flat)[layers, b, n] = seg.v[keep].transpose(0, 1)


# ---------------------------------------------------------------------------------------------------
# Input checks


def destination_view(raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    if not isinstance(layout, KVLayout):
        raise RestoreError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if not isinstance(raw, torch.Tensor):
        raise DestinationError(f"destination must be a torch.Tensor of bytes, got {type(raw).__name__}")
    if raw.dtype not in (torch.uint8, torch.int8):
        raise DestinationError(f"destination must be raw bytes (uint8/int8), got {raw.dtype}")
    if raw.dim() != 1 or not raw.is_contiguous():
        raise NonContiguousDestinationError(f"destination must be one contiguous 1-D byte buffer, got shape "
                                            f"{tuple(raw.shape)} strides {raw.stride()}")
    if raw.numel() < layout.nbytes:
        raise DestinationError(f"destination holds {raw.numel()} bytes, layout needs {layout.nbytes}")
    if raw.data_ptr() % layout.element_size:
        raise MisalignedDestinationError(f"destination address {raw.data_ptr():#x} is not "
                                         f"{layout.element_size}-byte aligned for {layout.dtype}")
    try:
        return layout.elements(raw)
    except MisalignedLayoutError as e:
        raise MisalignedDestinationError(str(e)) from e
    except LayoutError as e:
        raise DestinationError(str(e)) from e


_INT64 = (-(1 << 63), (1 << 63) - 1)


def as_index(x: object, name: str, device: torch.device, error: type[RestoreError]) -> torch.Tensor:
    """x as int64 [n] on `device`. Only exact integers are accepted: an integer torch tensor, an integer numpy
    array, or a sequence whose every element is an int (numbers.Integral, not bool). Anything else raises
    `error`, never silently truncates (torch.as_tensor([0.5, 1.7], dtype=int64) would give [0, 1])."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise error(f"{name} must be integers, got a {x.dtype} tensor")
        if x.dtype == torch.uint64 and x.numel() and int(x.cpu().numpy().max()) > _INT64[1]:
            raise error(f"{name} holds a value beyond int64")  # .to(int64) would wrap it to a negative
        t = x
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise error(f"{name} must be integers, got a numpy {x.dtype} array")
        if x.dtype == np.uint64 and x.size and int(x.max()) > _INT64[1]:
            raise error(f"{name} holds a value beyond int64")
        t = torch.from_numpy(x.astype(np.int64))  # a copy: writable, contiguous
    elif isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray)):
        values = list(x)
        for i, v in enumerate(values):
            if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)):
                raise error(f"{name}[{i}] must be an int, got {type(v).__name__} {v!r:.40}")
            if not _INT64[0] <= v <= _INT64[1]:
                raise error(f"{name}[{i}] = {v} is beyond int64")
        t = torch.tensor([operator.index(v) for v in values], dtype=torch.int64)
    else:
        raise error(f"{name} must be an integer tensor, array or sequence of ints, got {type(x).__name__}")
    if t.dim() != 1:
        raise error(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


def _layer_list(layers: object, num_layers: int) -> list[int]:
    """capture's layer list: ints in [0, num_layers) (a negative index would silently read from the end)."""
    lay = as_index(layers, "layers", torch.device("cpu"), LayerRangeError).tolist()
    bad = [v for v in lay if not 0 <= v < num_layers]
    if bad:
        raise LayerRangeError(f"layer {bad[0]} outside the cache's layers [0, {num_layers})")
    return lay
