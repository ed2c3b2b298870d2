"""Launch kernels/restore_rope.cu for a validated `kmesh.kv.restore.RestorePlan` (same semantics as its torch path).

The plan has already checked shapes, slots, positions and dtypes; this checks what only the kernel needs
(CUDA tensors on one device, int32-sized grids) and picks the 16-byte vector path (entry restore_rope_<type>,
a flat grid of units) when strides and alignment allow it, else the element path (restore_rope_<type>_elem).
Launches go on torch's current stream.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kmesh.cuda.loader import KernelLoadError, extra_flags, get_function

if TYPE_CHECKING:
    from kmesh.kv.layout import KVLayout
    from kmesh.kv.restore import RestorePlan

KERNEL = "restore_rope"
ENTRY = {"float32": "restore_rope_f32", "float16": "restore_rope_f16", "bfloat16": "restore_rope_bf16",
         "fp8_e4m3": "restore_rope_e4m3", "fp8_e5m2": "restore_rope_e5m2"}
ELEMENT_SUFFIX = "_elem"
GATHER_SUFFIX = "_gather"   # the vector path reading a paged source in place (kmesh.kv.gather)
ELEMENT_THREADS = 256
CHUNK_BYTES = 16   # copy chunk of the vector path (rotary chunks: RESTORE_ROT_CHUNK / RESTORE_FP8_ROT_CHUNK)
DEFAULT_TUNABLES = {"RESTORE_THREADS": 256, "RESTORE_G": 1, "RESTORE_ROT_CHUNK": 8, "RESTORE_FP8_ROT_CHUNK": 8,
                    "RESTORE_FP8_X2": 1, "RESTORE_EARLY_TABLES": 1, "RESTORE_STREAMING": 1, "RESTORE_FP8_STREAMING": 1,
                    "RESTORE_MIN_BLOCKS": 1}


def tunables() -> dict[str, int]:
    """The kernel's compile-time tunables as built (defaults of restore_rope.cu unless $KMESH_KERNEL_FLAGS
    overrides them; names and meanings in the header of kernels/restore_rope.cu)."""
    return dict(_tunables(tuple(extra_flags())))


@functools.lru_cache(maxsize=16)
def _tunables(flags: tuple[str, ...]) -> dict[str, int]:   # parsed once per flag set: it sits on the launch path
    out = dict(DEFAULT_TUNABLES)
    for f in flags:
        if f.startswith("-D") and "=" in f and f[2:].split("=")[0] in out:
            k, v = f[2:].split("=", 1)
            out[k] = int(v)
    return out


def chunk_elements(lay: "KVLayout") -> int:
    """Elements per 16-byte copy chunk of the vector path for this layout's dtype."""
    return CHUNK_BYTES // lay.element_size


def rot_chunk_elements(lay: "KVLayout") -> int:
    """Elements per rotary chunk of the vector path (RESTORE_ROT_CHUNK bytes; fp8: RESTORE_FP8_ROT_CHUNK)."""
    tun = tunables()
    if lay.fp8_dtype is not None:
        return tun["RESTORE_FP8_ROT_CHUNK"]
    nbytes = tun["RESTORE_ROT_CHUNK"]
    return max(nbytes, 8) // 4 if lay.element_size == 4 else nbytes // lay.element_size  # f32: >= one neox pair


def fast_div(d: int) -> tuple[int, int, int]:
    """(d, m, s) for the kernel's n / d = ((n·m) >> 32 + n) >> s, exact for 0 <= n, d < 2^31."""
    if not 0 < d < 2**31:
        raise ValueError(f"divisor {d} outside (0, 2^31)")
    s = (d - 1).bit_length()
    m = (2**32 * (2**s - d)) // d + 1
    return d, m, s


_INT32 = 2**31 - 1
_streams: dict[int, Any] = {}


@dataclass(frozen=True)
class Source:
    """Where the kernel reads a plan's segment rows: a contiguous [T, L, H, D] segment (tok = None), or rows
    gathered from a paged source buffer (tok: int64 [T] element offsets, per-layer/head element strides)."""

    rows: tuple[int, int, int]           # T, L, H
    k_ptr: int
    v_ptr: int                           # 0: no values (MLA)
    tok: torch.Tensor | None
    strides: tuple[int, int, int, int]   # sk_L, sk_H, sv_L, sv_H (elements; gather only)
    row_starts: tuple[int, ...]          # element strides/offsets every row start is a combination of


def source_of(plan: Any, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> Source:
    """The plan's Source: a GatherPlan reads in place; a RestorePlan reads its segment (`k`, `v`: the contiguous
    tensors the caller keeps alive, default the segment's own)."""
    lay = plan.layout
    if getattr(plan, "src_tok", None) is not None:
        sl = plan.src_layout
        es, base = sl.element_size, plan.src_flat.data_ptr()
        ks = sl.k_strides()
        vs = sl.v_strides() if sl.head_dim_v else None
        starts = (ks.offset, ks.layer, ks.head, ks.block, ks.token) + \
            ((vs.offset, vs.layer, vs.head) if vs else ())
        return Source((plan.tokens, sl.num_layers, sl.num_kv_heads), base + ks.offset * es,
                      base + vs.offset * es if vs else 0, plan.src_tok,
                      (ks.layer, ks.head, vs.layer if vs else 0, vs.head if vs else 0), starts)
    k = plan.segment.k if k is None else k
    v = plan.segment.v if v is None else v
    T, L, H, _ = k.shape
    return Source((T, L, H), k.data_ptr(), 0 if v is None else v.data_ptr(), None, (0, 0, 0, 0),
                  (lay.head_dim, lay.head_dim_v))


def vector_path_ok(plan: "RestorePlan", src: Source | None = None) -> bool:
    """True when every K/V access can be a 16-byte load/store (channel stride 1, widths and offsets aligned)."""
    lay, rope = plan.layout, plan.rope
    src = source_of(plan) if src is None else src
    vec = chunk_elements(lay)
    ks = lay.k_strides()
    if ks.channel != 1:
        return False
    # offset, layer, block, head, token strides (channel strides are 1 here)
    st = list(ks.as_tuple()[:5]) + list(src.row_starts)
    if lay.head_dim_v:
        vs = lay.v_strides()
        if vs.channel != 1:
            return False
        st += list(vs.as_tuple()[:5])
    widths = [lay.head_dim, lay.head_dim_v, lay.rope_offset, lay.head_dim - lay.rope_offset - rope.rotary_dim,
              rope.rotary_dim // 2 if rope.style == "neox" else rope.rotary_dim]
    ptrs = [plan.flat.data_ptr(), src.k_ptr, plan.cos.data_ptr(), plan.sin.data_ptr()]
    if src.v_ptr:
        ptrs.append(src.v_ptr)
    return (all(w % vec == 0 for w in widths) and all(s % vec == 0 for s in st)
            and all(p % (vec * lay.element_size) == 0 for p in ptrs) and all(p % 16 == 0 for p in ptrs[2:4]))


def units_per_row(plan: "RestorePlan") -> tuple[int, int, int]:
    """Vector path, per (token, layer, head) row: (rotary units, plain-key copy units, value copy units)."""
    lay, rope = plan.layout, plan.rope
    vec, rvec = chunk_elements(lay), rot_chunk_elements(lay)
    rot = rope.rotary_dim
    n_rot = rot // 2 // rvec if rope.style == "neox" else rot // rvec
    return n_rot, (lay.head_dim - rot) // vec, lay.head_dim_v // vec


def launch_shape(plan: "RestorePlan", fast: bool) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, items per row) for all tokens. Vector path: a flat grid, `items` = units per row
    (RESTORE_THREADS·RESTORE_G units per block); element path: one block z-slice per token, x over a row's
    items (one pair or element each), y over its L·H rows."""
    lay, rope = plan.layout, plan.rope
    T, L, H = source_of(plan).rows
    rows = L * H
    if fast:
        items = sum(units_per_row(plan))
        tun = tunables()
        per_block = tun["RESTORE_THREADS"] * tun["RESTORE_G"]
        return ((T * rows * items + per_block - 1) // per_block, 1, 1), (tun["RESTORE_THREADS"], 1, 1), items
    items = rope.rotary_dim // 2 + (lay.head_dim - rope.rotary_dim) + lay.head_dim_v
    bx = min(items, ELEMENT_THREADS)
    by = max(1, min(rows, ELEMENT_THREADS // bx))
    bz = max(1, ELEMENT_THREADS // (bx * by))
    return ((T + bz - 1) // bz, 1, 1), (bx, by, bz), items


def _stream(device: torch.device) -> Any:
    import cupy

    ptr = torch.cuda.current_stream(device).cuda_stream
    if ptr not in _streams:
        # cupy 14 deprecates ExternalStream; it still works and cupy 13 has no successor
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            _streams[ptr] = cupy.cuda.ExternalStream(ptr, device.index)
    return _streams[ptr]


def token_ranges(plan: "RestorePlan", fast: bool) -> list[tuple[int, int, tuple[int, int, int]]]:
    """(first token, tokens, grid) of each launch. The vector path numbers its units with 32-bit ints, so a
    restore of >= 2^31 units runs as several launches over token ranges; the element path is one launch."""
    from kmesh.kv.errors import RestoreError

    grid, _, items = launch_shape(plan, fast)
    T, L, H = source_of(plan).rows
    if not fast:
        return [(0, T, grid)]
    per_token = L * H * items
    if per_token > _INT32:
        raise RestoreError(f"{per_token} vector units per token exceed the kernel's int32 indexing")
    step = _INT32 // per_token
    tun = tunables()
    per_block = tun["RESTORE_THREADS"] * tun["RESTORE_G"]
    return [(t0, min(step, T - t0), ((min(step, T - t0) * per_token + per_block - 1) // per_block, 1, 1))
            for t0 in range(0, T, step)]


def kernel_args(plan: "RestorePlan", src: Source, slots: torch.Tensor, moved: torch.Tensor, fast: bool, t0: int,
                nt: int) -> tuple:
    """The kernel's parameters (RESTORE_ROPE_PARAMS order) for tokens [t0, t0 + nt) of `plan`, reading `src`;
    slots, moved: contiguous tensors the caller keeps alive until the launch (moved: bool, one byte per token).
    Pointers into the segment (or the gather's offsets), slots, flags and tables start at token t0."""
    lay, rope = plan.layout, plan.rope
    _, L, H = src.rows
    half = rope.rotary_dim // 2
    ks, vs = lay.k_strides(), (lay.v_strides() if lay.head_dim_v else None)
    if not (slots.is_contiguous() and moved.is_contiguous() and plan.cos.is_contiguous()
            and plan.sin.is_contiguous() and (src.tok is None or src.tok.is_contiguous())):
        raise ValueError("kernel_args needs contiguous slot, flag, offset and table tensors")

    def ptr(t: torch.Tensor | None, per_token: int) -> np.uint64:
        return np.uint64(0 if t is None else t.data_ptr() + t0 * per_token * t.element_size())

    def seg(p: int, per_token: int) -> np.uint64:   # contiguous segment: start at token t0; gather: the base
        return np.uint64(0 if p == 0 else p + (0 if src.tok is not None else t0 * per_token * lay.element_size))

    n_rot, n_kp, n_v = units_per_row(plan) if fast else (0, 0, 0)
    per_token = L * H * (n_rot + n_kp + n_v)
    divisors = (per_token, n_rot, n_kp + n_v, H) if fast else (1, 1, 1, 1)
    return (np.uint64(plan.flat.data_ptr()), seg(src.k_ptr, L * H * lay.head_dim),
            seg(src.v_ptr, L * H * lay.head_dim_v),
            ptr(slots, 1), ptr(moved, 1), ptr(plan.cos, half), ptr(plan.sin, half),
            *(np.int64(x) for x in ks.as_tuple()),
            *(np.int64(x) for x in (vs.as_tuple() if vs else (0,) * 6)),
            *(np.int32(x) for x in (nt, L, H, lay.head_dim, lay.head_dim_v, lay.block_size, plan.first_layer,
                                    lay.rope_offset, rope.rotary_dim, rope.style == "neox")),
            # the same float32 numbers as plan.k_scale / plan.k_inv_scale (double -> float32, nearest even)
            np.float32(float(lay.k_scale)), np.float32(float(1.0 / lay.k_scale)),
            *(np.uint32(x) for x in (nt * per_token, L * H * n_rot, n_kp)),
            *(np.uint32(x) for d in divisors for x in fast_div(max(d, 1))),   # a 0 divisor is never used
            *(np.uint32(x) for x in fast_div(lay.block_size)),
            ptr(src.tok, 1), *(np.int64(x) for x in src.strides))


def launch_restore(plan: "RestorePlan", force_slow: bool = False) -> dict[str, Any]:
    """Run the kernel for `plan`; returns the launch it made (entry point, path, grid, block)."""
    from kmesh.kv.errors import DeviceMismatchError, RestoreError

    dev = plan.flat.device
    if dev.type != "cuda":
        raise DeviceMismatchError(f"the cuda backend needs a CUDA cache, got {dev}")
    gather = getattr(plan, "src_tok", None) is not None
    if gather:
        if not plan.gather_ok:
            raise RestoreError(f"the kernel cannot gather from a {plan.src_layout.packing} source "
                               f"(channels strided, or K and V at different token strides): capture it first")
        k = v = None
        tensors = [plan.src_flat, plan.src_tok, plan.slots, plan.cos, plan.sin]
    else:
        k = plan.segment.k.contiguous()
        v = plan.segment.v.contiguous() if plan.segment.v is not None else None
        tensors = [k, plan.slots, plan.cos, plan.sin] + ([v] if v is not None else [])
    if any(t.device != dev for t in tensors):
        raise DeviceMismatchError(f"every restore input must be on {dev}")
    # A GatherPlan's tables are kept per geometry (kmesh.kv.gather): so is its launch, per buffer pair
    memo = getattr(plan, "launch_memo", None)
    mkey = (plan.flat.data_ptr(), plan.src_flat.data_ptr(), force_slow, tuple(extra_flags())) \
        if memo is not None else None
    made = memo.get(mkey) if memo is not None else None
    if made is None:
        made = _make_launch(plan, k, v, force_slow)
        if memo is not None:
            if len(memo) >= 8:   # a few buffer pairs per geometry is the common case; never grow without bound
                memo.clear()
            memo[mkey] = made
    if made is _NOTHING:
        return {"rows": 0}
    entry, block, launches, info = made
    fn = get_function(KERNEL, entry, dev.index or 0)
    import cupy

    try:
        with cupy.cuda.Device(dev.index or 0), _stream(dev):
            for grid, args in launches:
                fn(grid, block, args)
    except KernelLoadError:
        raise
    except Exception as e:
        raise RestoreError(f"restore_rope launch failed: {type(e).__name__}: {e}") from e
    return dict(info)


_NOTHING = object()   # a restore of no rows: nothing to launch


def _make_launch(plan: Any, k: torch.Tensor | None, v: torch.Tensor | None, force_slow: bool) -> Any:
    """(entry point, block, [(grid, kernel args)] per token range, launch info) for a checked plan."""
    from kmesh.kv.errors import RestoreError

    lay = plan.layout
    src = source_of(plan, k, v)
    T, L, H = src.rows
    if T * L * H == 0:
        return _NOTHING
    if T > _INT32 or T * L * H > _INT32 or lay.num_slots > _INT32:
        raise RestoreError(f"{T}×{L}×{H} rows or {lay.num_slots} slots exceed the kernel's int32 indexing")
    fast = (not force_slow) and vector_path_ok(plan, src) and src.k_ptr % 16 == 0 and src.v_ptr % 16 == 0
    _, block, items = launch_shape(plan, fast)
    entry = ENTRY[lay.dtype] + ((GATHER_SUFFIX if src.tok is not None else "") if fast else ELEMENT_SUFFIX)
    ranges = token_ranges(plan, fast)
    slots, moved = plan.slots.contiguous(), plan.moved.contiguous()
    launches = [(grid, kernel_args(plan, src, slots, moved, fast, t0, nt)) for t0, nt, grid in ranges]
    info = {"entry": entry, "path": "vector" if fast else "element",
            "source": "segment" if src.tok is None else "gather", "grid": ranges[0][2], "launches": len(ranges),
            "block": block, "items_per_row": items, "chunk_elements": chunk_elements(lay) if fast else 1,
            "rot_chunk_elements": rot_chunk_elements(lay) if fast else 1, "tunables": tunables()}
    return entry, block, launches, info
