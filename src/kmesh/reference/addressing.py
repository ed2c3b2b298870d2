"""Where a K/V element of a paged KV cache lives, computed from first principles.

An independent check of `kmesh.kv.layout`: it reads only a layout's data fields (packing, order, sizes,
dtype name, offset, layer_stride / block_stride overrides) and never calls its methods, so a bug in
`KVLayout.split_slots`, its strides or its vLLM-style views cannot hide here too.

Model (DESIGN §2): logical axes L (layer), B (block), H (kv-head), N (token in block), C (channel);
`order` names their memory order, outermost first, C innermost. One "cell" = the C channels of one
(L, B, H, N): paged and cpu hold K and V (head_dim + head_dim_v channels), mla one latent (head_dim).
Dense strides: an axis advances by the product of the extents inside it; a given layer_stride /
block_stride replaces that axis' stride (padded pages, shared buffers), and axes outside it are dense
over the replaced one. Inside a cell:
  paged, mla: K channel c at c, V channel c at head_dim + c        (elements)
  cpu:        per (L, B, H) an [N, 2D] area (N must be next to C): K stored transposed, element [c, n] at
              c·N + n; then V plainly, element [n, c] at N·D + n·D + c
Slot s addresses block s // block_size, offset s % block_size (plain integer arithmetic; s >= 0).
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import torch

from kmesh.errors import KMeshError

__all__ = [
    "ELEMENT_BYTES", "STORAGE_DTYPES", "AddressError", "element_bytes", "block_and_offset", "blocks_and_offsets",
    "cell_bytes", "axis_strides", "byte_offset", "element_offsets", "read", "touched_mask", "destination_bytes",
]

# Bytes per stored element, by dtype name (fp8 formats are stored one byte each).
ELEMENT_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# What those bytes are read back as (fp8: the raw uint8, compared byte for byte).
STORAGE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                          "bfloat16": torch.bfloat16, "fp8_e4m3": torch.uint8,
                                          "fp8_e5m2": torch.uint8}
Part = Literal["k", "v"]


class AddressError(KMeshError):
    """A layout this reference cannot address, a negative slot, or an address outside the buffer."""


def element_bytes(dtype: str) -> int:
    if dtype not in ELEMENT_BYTES:
        raise AddressError(f"unknown dtype {dtype!r}")
    return ELEMENT_BYTES[dtype]


def block_and_offset(slot: int, block_size: int) -> tuple[int, int]:
    """(block, offset in block) of one slot."""
    if slot < 0:
        raise AddressError(f"slot {slot} is padding (< 0) and addresses nothing")
    block = slot // block_size
    return block, slot - block * block_size


def blocks_and_offsets(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """block_and_offset for an integer tensor of slots (all >= 0)."""
    s = slots.to(torch.int64)
    if s.numel() and int(s.min()) < 0:
        raise AddressError("slots must be >= 0 (padding slots address nothing)")
    block = s // block_size
    return block, s - block * block_size


def _channels(layout: Any, part: Part) -> int:
    if part == "k":
        return layout.head_dim
    if layout.packing == "mla" or not layout.head_dim_v:
        raise AddressError("this layout holds no V (MLA latent)")
    return layout.head_dim_v


def cell_bytes(layout: Any) -> int:
    """Bytes of one (layer, block, head, token) cell."""
    per = layout.head_dim if layout.packing == "mla" else layout.head_dim + layout.head_dim_v
    return per * element_bytes(layout.dtype)


def axis_strides(layout: Any) -> dict[str, int]:
    """Bytes between consecutive indices of L, B, H and N."""
    order = layout.order
    if len(order) != 5 or order[-1] != "C" or sorted(order[:4]) != sorted("LBHN"):
        raise AddressError(f"order {order!r} is not a permutation of LBHN followed by C")
    extent = {"L": layout.num_layers, "B": layout.num_blocks, "H": layout.num_kv_heads, "N": layout.block_size}
    given = {"L": layout.layer_stride, "B": layout.block_stride}
    strides: dict[str, int] = {}
    step = cell_bytes(layout)           # what the innermost axis advances by
    for axis in order[3::-1]:           # N..L of the order, innermost first
        strides[axis] = given.get(axis) or step
        step = strides[axis] * extent[axis]
    return strides


def byte_offset(layout: Any, part: Part, layer: int, slot: int, head: int, channel: int) -> int:
    """Byte address (from the buffer's byte 0) of one K or V element: plain Python integers."""
    block, n = block_and_offset(slot, layout.block_size)
    _channels(layout, part)
    return _address(layout, part, layer, block, n, head, channel)


def _address(layout: Any, part: Part, l: Any, b: Any, n: Any, h: Any, c: Any) -> Any:
    """The address formula itself, on Python ints or broadcasting int64 tensors alike."""
    s, es = axis_strides(layout), element_bytes(layout.dtype)
    area = layout.offset + l * s["L"] + b * s["B"] + h * s["H"]
    if layout.packing == "cpu":
        if layout.order[3] != "N":
            raise AddressError(f"cpu packing needs N next to C, order is {layout.order}")
        N, D = layout.block_size, layout.head_dim
        inside = c * N + n if part == "k" else N * D + n * D + c
        return area + inside * es
    inside = c if part == "k" else layout.head_dim + c
    return area + n * s["N"] + inside * es


def element_offsets(layout: Any, part: Part, slots: torch.Tensor, layers: Sequence[int],
                    device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [T, L', H, C]: byte address of every K (or V) element of the slots in the given layers
    (byte_offset's formula, broadcast over tensors)."""
    dev = torch.device(device) if device is not None else slots.device
    C = _channels(layout, part)
    b, n = blocks_and_offsets(slots.to(dev), layout.block_size)
    l = torch.as_tensor(list(layers), dtype=torch.int64, device=dev)
    h = torch.arange(layout.num_kv_heads, dtype=torch.int64, device=dev)
    c = torch.arange(C, dtype=torch.int64, device=dev)
    b, n = b[:, None, None, None], n[:, None, None, None]
    l, h, c = l[None, :, None, None], h[None, None, :, None], c[None, None, None, :]
    return _address(layout, part, l, b, n, h, c)


def _byte_index(layout: Any, part: Part, slots: torch.Tensor, layers: Sequence[int], size: int,
                device: torch.device) -> torch.Tensor:
    # [T, L', H, C, element bytes] addresses of every byte, bounds-checked (a CUDA gather would not say).
    es = element_bytes(layout.dtype)
    first = element_offsets(layout, part, slots, layers, device)
    idx = first[..., None] + torch.arange(es, dtype=torch.int64, device=device)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise AddressError(f"{part.upper()} addresses [{int(idx.min())}, {int(idx.max())}] fall outside the "
                           f"{size}-byte buffer")
    return idx


def read(raw: torch.Tensor, layout: Any, slots: torch.Tensor,
         layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K [T, L', H, Dk] and V [T, L', H, Dv] (None for MLA) of the slots, gathered byte by byte from raw."""
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise AddressError(f"raw must be a 1-D uint8 byte buffer, got {raw.dtype} {tuple(raw.shape)}")
    out = []
    for part in ("k", "v"):
        if part == "v" and (layout.packing == "mla" or not layout.head_dim_v):
            out.append(None)
            continue
        idx = _byte_index(layout, part, slots, layers, raw.numel(), raw.device)
        bytes_ = raw[idx].contiguous()                     # [..., element bytes]
        out.append(bytes_.view(STORAGE_DTYPES[layout.dtype]).squeeze(-1))
    return out[0], out[1]


def touched_mask(nbytes: int, layout: Any, slots: torch.Tensor, layers: Sequence[int],
                 device: torch.device | str | None = None) -> torch.Tensor:
    """bool [nbytes]: True exactly for the bytes of the slots' K and V (all heads) in the given layers."""
    dev = torch.device(device) if device is not None else slots.device
    mask = torch.zeros(nbytes, dtype=torch.bool, device=dev)
    parts: tuple[Part, ...] = ("k",) if layout.packing == "mla" or not layout.head_dim_v else ("k", "v")
    for part in parts:
        mask[_byte_index(layout, part, slots, layers, nbytes, dev).flatten()] = True
    return mask


def destination_bytes(layout: Any, tokens: int, layers: int) -> int:
    """Bytes a restore of `tokens` tokens × `layers` layers writes: every head's K and V channels."""
    return tokens * layers * layout.num_kv_heads * cell_bytes(layout)
