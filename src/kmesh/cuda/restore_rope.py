"""Launch kernels/restore_rope.cu for a validated `kmesh.restore.RestorePlan` (same semantics as its torch path).

The plan has already checked shapes, slots, positions and dtypes; this checks what only the kernel needs
(CUDA tensors on one device, int32-sized grids) and picks the 16-byte vector path when strides and
alignment allow it, else the element-wise path. Launches go on torch's current stream.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kmesh.cuda.loader import KernelLoadError, extra_flags, get_function

if TYPE_CHECKING:
    from kmesh.restore import RestorePlan

KERNEL = "restore_rope"
ENTRY = {"float32": "restore_rope_f32", "float16": "restore_rope_f16", "bfloat16": "restore_rope_bf16",
         "fp8_e4m3": "restore_rope_e4m3", "fp8_e5m2": "restore_rope_e5m2"}
THREADS = 256


def tunables() -> dict[str, int]:
    """The kernel's compile-time tunables as built (defaults of restore_rope.cu unless $KMESH_KERNEL_FLAGS
    overrides them): U = rows whose loads one thread issues before storing, fp8 chunk bytes."""
    out = {"RESTORE_U": 4, "RESTORE_FP8_CHUNK": 16, "RESTORE_FP8_X2": 0}
    for f in extra_flags():
        if f.startswith("-D") and "=" in f and f[2:].split("=")[0] in out:
            k, v = f[2:].split("=", 1)
            out[k] = int(v)
    return out


def chunk_elements(lay) -> int:
    """Elements per vector chunk of the fast path for this layout's dtype."""
    nbytes = tunables()["RESTORE_FP8_CHUNK"] if lay.fp8_dtype is not None else 16
    return nbytes // lay.element_size
_INT32 = 2**31 - 1
_streams: dict[int, Any] = {}


def vector_path_ok(plan: "RestorePlan") -> bool:
    """True when every K/V access can be a 16-byte load/store (channel stride 1, widths and offsets aligned)."""
    lay, rope = plan.layout, plan.rope
    vec = chunk_elements(lay)
    ks = lay.k_strides()
    if ks.channel != 1:
        return False
    # offset, layer, block, head, token strides (channel strides are 1 here)
    st = list(ks.as_tuple()[:5])
    if lay.head_dim_v:
        vs = lay.v_strides()
        if vs.channel != 1:
            return False
        st += list(vs.as_tuple()[:5])
    widths = [lay.head_dim, lay.head_dim_v, lay.rope_offset, lay.head_dim - lay.rope_offset - rope.rotary_dim,
              rope.rotary_dim // 2 if rope.style == "neox" else rope.rotary_dim]
    ptrs = [plan.flat.data_ptr(), plan.segment.k.data_ptr(), plan.cos.data_ptr(), plan.sin.data_ptr()]
    if plan.segment.v is not None:
        ptrs.append(plan.segment.v.data_ptr())
    return (all(w % vec == 0 for w in widths) and all(s % vec == 0 for s in st)
            and all(p % (vec * lay.element_size) == 0 for p in ptrs) and all(p % 16 == 0 for p in ptrs[2:4]))


def launch_shape(plan: "RestorePlan", fast: bool) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, items per row): one block z-slice per token, x over a row's items, y over its L·H rows."""
    lay, rope = plan.layout, plan.rope
    vec = chunk_elements(lay)
    rot, dk, dv = rope.rotary_dim, lay.head_dim, lay.head_dim_v
    if fast:
        items = (rot // 2 // vec if rope.style == "neox" else rot // vec) + (dk - rot) // vec + dv // vec
    else:
        items = rot // 2 + (dk - rot) + dv
    T, L, H, _ = plan.segment.k.shape
    rows = L * H
    bx = min(items, THREADS)
    per_thread = tunables()["RESTORE_U"] if fast else 1
    by = max(1, min((rows + per_thread - 1) // per_thread, THREADS // bx))
    bz = max(1, THREADS // (bx * by))
    return ((T + bz - 1) // bz, 1, 1), (bx, by, bz), items


def _stream(device: torch.device) -> Any:
    import cupy

    ptr = torch.cuda.current_stream(device).cuda_stream
    if ptr not in _streams:
        with warnings.catch_warnings():  # cupy 14 deprecates ExternalStream; it still works and cupy 13 has no successor
            warnings.simplefilter("ignore", DeprecationWarning)
            _streams[ptr] = cupy.cuda.ExternalStream(ptr, device.index)
    return _streams[ptr]


def launch_restore(plan: "RestorePlan", force_slow: bool = False) -> dict[str, Any]:
    """Run the kernel for `plan`; returns the launch it made (entry point, path, grid, block)."""
    from kmesh.restore import DeviceMismatchError, RestoreError

    lay, seg, rope = plan.layout, plan.segment, plan.rope
    dev = plan.flat.device
    if dev.type != "cuda":
        raise DeviceMismatchError(f"the cuda backend needs a CUDA cache, got {dev}")
    k = seg.k.contiguous()
    v = seg.v.contiguous() if seg.v is not None else None
    tensors = [k, plan.slots, plan.cos, plan.sin] + ([v] if v is not None else [])
    if any(t.device != dev for t in tensors):
        raise DeviceMismatchError(f"every restore input must be on {dev}")
    T, L, H, _ = k.shape
    if T * L * H == 0:
        return {"rows": 0}
    if T > _INT32 or T * L * H > _INT32 or lay.num_slots > _INT32:
        raise RestoreError(f"{T}×{L}×{H} rows or {lay.num_slots} slots exceed the kernel's int32 indexing")
    slots = plan.slots.contiguous()
    moved = plan.moved.contiguous()  # bool: one byte 0/1 per token, read as unsigned char
    fast = (not force_slow) and vector_path_ok(plan) and k.data_ptr() % 16 == 0 and \
        (v is None or v.data_ptr() % 16 == 0)
    grid, block, items = launch_shape(plan, fast)
    fn = get_function(KERNEL, ENTRY[lay.dtype], dev.index or 0)
    ks, vs = lay.k_strides(), (lay.v_strides() if lay.head_dim_v else None)
    ptr = lambda t: np.uint64(t.data_ptr() if t is not None else 0)  # noqa: E731
    args = (ptr(plan.flat), ptr(k), ptr(v), ptr(slots), ptr(moved), ptr(plan.cos), ptr(plan.sin),
            *(np.int64(x) for x in ks.as_tuple()),
            *(np.int64(x) for x in (vs.as_tuple() if vs else (0,) * 6)),
            *(np.int32(x) for x in (T, L, H, lay.head_dim, lay.head_dim_v, lay.block_size, plan.first_layer,
                                    lay.rope_offset, rope.rotary_dim, rope.style == "neox", fast)),
            # the same float32 numbers as plan.k_scale / plan.k_inv_scale (double -> float32, nearest even)
            np.float32(float(lay.k_scale)), np.float32(float(1.0 / lay.k_scale)))
    import cupy

    try:
        with cupy.cuda.Device(dev.index or 0), _stream(dev):
            fn(grid, block, args)
    except KernelLoadError:
        raise
    except Exception as e:
        raise RestoreError(f"restore_rope launch failed: {type(e).__name__}: {e}") from e
    return {"entry": ENTRY[lay.dtype], "path": "vector" if fast else "element", "grid": grid, "block": block,
            "items_per_row": items, "chunk_elements": chunk_elements(lay) if fast else 1, "tunables": tunables()}
