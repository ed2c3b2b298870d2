"""Where each token's K and V live in a paged KV cache: one `KVLayout` for every arrangement vLLM 0.32 allocates.

A cache is one flat byte buffer. Logically it holds, per layer L, block B, kv-head H and token-in-block N,
a K vector of `head_dim` channels and a V vector of `head_dim_v` channels. vLLM gives every layer a view
[B, H, N, C] over that buffer, with the axes [L, B, H, N] placed in memory in one of six orders
(`ORDERS`, outermost first; C is always innermost). What C holds depends on the packing:

- "paged": C = [K | V] per token (K = C[:D], V = C[D:]) — every GPU backend (flash-attn, flashinfer, triton).
- "cpu":   vLLM's CPU attention backend. Per (block, head) its [N, 2D] cell area is read as two planes
           (`view(B, H, 2N, D).chunk(2, dim=2)`); the CPU cache writer stores K TRANSPOSED in the first
           plane (element [c, n] at c·N + n) and V plainly in the second (element [n, c] at N·D + n·D + c).
- "mla":   one latent vector per token and a single head (V absent); its last `rope_dim` channels are the
           rotated part (`rope_offset` = kv_lora_rank).

fp8 caches (e4m3 / e5m2) are stored as uint8 with per-tensor scales (stored = fp8(x / scale)).
Slot = block × block_size + offset; slot −1 is padding and addresses nothing.

Two independent ways in, on purpose: `k_tensor`/`v_tensor` (strided 5-D views used by restore and the
kernel) and `layer_views`/`read_tokens`/`touched_bytes` (vLLM's own per-layer views and split, used to
check). The contract test holds both against the pinned vLLM.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Sequence

import torch

from kmesh.errors import KMeshError

__all__ = [
    "ORDERS", "PACKINGS", "DTYPES", "LayoutError", "MisalignedLayoutError", "Strides", "KVLayout",
    "storage_bytes", "dequantize", "quantize",
]

# Memory order of the logical axes [L, B, H, N] (C innermost), outermost first — vLLM's KVCacheLayout names.
ORDERS: tuple[str, ...] = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
PACKINGS: tuple[str, ...] = ("paged", "cpu", "mla")
Packing = Literal["paged", "cpu", "mla"]


@dataclass(frozen=True)
class _DType:
    storage: torch.dtype           # what the bytes are viewed as
    fp8: torch.dtype | None        # the float8 format behind uint8 storage
    max_finite: float | None       # requantization clamps here (saturating, like the CUDA satfinite cast)


DTYPES: dict[str, _DType] = {
    "float32": _DType(torch.float32, None, None),
    "float16": _DType(torch.float16, None, None),
    "bfloat16": _DType(torch.bfloat16, None, None),
    "fp8_e4m3": _DType(torch.uint8, torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": _DType(torch.uint8, torch.float8_e5m2, 57344.0),
}


class LayoutError(KMeshError):
    """A layout is inconsistent (unknown order/packing/dtype, bad sizes) or a buffer does not fit it."""


class MisalignedLayoutError(LayoutError):
    """An offset or stride is not a whole number of elements, or a buffer is not element-aligned."""


@dataclass(frozen=True)
class Strides:
    """Element address of channel c of token n in block b, head h, layer l:
    offset + l·layer + b·block + h·head + n·token + c·channel."""

    offset: int
    layer: int
    block: int
    head: int
    token: int
    channel: int

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        return (self.offset, self.layer, self.block, self.head, self.token, self.channel)


@dataclass(frozen=True)
class KVLayout:
    """One KV cache arrangement. Strides in bytes; None means dense, as vLLM computes them without padding.

    `layer_stride`/`block_stride`/`offset` take vLLM's KVCacheTensor values where pages are padded or
    groups share a buffer (see `from_layer_views`).
    """

    packing: Packing
    order: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int                  # K channels (MLA: kv_lora_rank + rope_dim)
    head_dim_v: int                # V channels (MLA: 0)
    dtype: str                     # a DTYPES key
    rope_offset: int = 0           # first rotated K channel (MLA: kv_lora_rank)
    k_scale: float = 1.0           # fp8 per-tensor scales (ignored for float dtypes)
    v_scale: float = 1.0
    layer_stride: int | None = None
    block_stride: int | None = None
    offset: int = 0
    _bytes: dict[str, int] = field(init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise LayoutError(f"packing must be one of {PACKINGS}, got {self.packing!r}")
        if self.order not in ORDERS:
            raise LayoutError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.dtype not in DTYPES:
            raise LayoutError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise LayoutError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.head_dim_v, int) or self.head_dim_v < 0:
            raise LayoutError(f"head_dim_v must be an int >= 0, got {self.head_dim_v!r}")
        if self.packing == "mla":
            if self.num_kv_heads != 1 or self.head_dim_v != 0:
                raise LayoutError("mla packing holds one latent per token: num_kv_heads=1, head_dim_v=0")
            if not 0 < self.rope_offset < self.head_dim:
                raise LayoutError(f"mla rope_offset (kv_lora_rank) must be in (0, {self.head_dim}), "
                                  f"got {self.rope_offset}")
        else:
            if self.head_dim_v <= 0:
                raise LayoutError(f"{self.packing} packing needs head_dim_v > 0")
            if self.rope_offset != 0:
                raise LayoutError(f"rope_offset is an MLA notion; {self.packing} rotates from channel 0")
        if self.packing == "cpu":
            if self.head_dim_v != self.head_dim:
                raise LayoutError("cpu packing stores K and V planes of equal width (head_dim_v == head_dim)")
            if not self.order.endswith("NC"):
                raise LayoutError(f"cpu packing needs each (block, head) [N, C] area contiguous; "
                                  f"order {self.order} does not keep N next to C")
        for name in ("k_scale", "v_scale"):
            s = getattr(self, name)
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
                raise LayoutError(f"{name} must be a finite number > 0, got {s!r}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise LayoutError(f"offset must be an int >= 0, got {self.offset!r}")
        object.__setattr__(self, "_bytes", self._byte_strides())
        es = self.element_size
        for name, v in (("offset", self.offset), *self._bytes.items()):
            if v % es:
                raise MisalignedLayoutError(f"{name} {v} bytes is not a multiple of the {es}-byte element")

    def _byte_strides(self) -> dict[str, int]:
        cell = self.cell_channels * self.element_size
        shape = {"L": self.num_layers, "B": self.num_blocks, "H": self.num_kv_heads, "N": self.block_size}
        fixed = {"L": self.layer_stride, "B": self.block_stride}
        strides: dict[str, int] = {}
        running = cell
        for axis in reversed(self.order[:-1]):  # innermost first; C has stride = element
            s = fixed.get(axis) or running
            if not isinstance(s, int) or s <= 0:
                raise LayoutError(f"{axis} stride must be a positive int, got {s!r}")
            strides[axis] = s
            running = s * shape[axis]
        return strides

    @classmethod
    def paged(cls, order: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
              head_dim: int, dtype: str, **kw: Any) -> "KVLayout":
        return cls("paged", order, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                   kw.pop("head_dim_v", head_dim), dtype, **kw)

    @classmethod
    def cpu(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
            dtype: str, order: str = "LBHNC", **kw: Any) -> "KVLayout":
        return cls("cpu", order, num_layers, num_blocks, block_size, num_kv_heads, head_dim, head_dim, dtype, **kw)

    @classmethod
    def mla(cls, order: str, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int,
            rope_dim: int, dtype: str, **kw: Any) -> "KVLayout":
        return cls("mla", order, num_layers, num_blocks, block_size, 1, kv_lora_rank + rope_dim, 0, dtype,
                   rope_offset=kv_lora_rank, **kw)

    @classmethod
    def from_layer_views(cls, views: Sequence[torch.Tensor], packing: Packing, head_dim: int, dtype: str,
                         **kw: Any) -> "KVLayout":
        """The layout behind vLLM's registered per-layer caches (each [B, H, N, C], one shared storage).

        What a connector calls in register_kv_caches: the order and the layer/block strides are read off
        the tensors' strides and addresses, relative to the start of their common storage.
        """
        if not views:
            raise LayoutError("need at least one layer view")
        v0 = views[0]
        if v0.dim() != 4:
            raise LayoutError(f"layer views must be [B, H, N, C], got shape {tuple(v0.shape)}")
        store = v0.untyped_storage()
        for v in views:
            if v.untyped_storage().data_ptr() != store.data_ptr():
                raise LayoutError("layer views do not share one storage (one allocation per cache expected)")
            if v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype:
                raise LayoutError("layer views differ in shape, strides or dtype")
        es = v0.element_size()
        if v0.stride(3) != 1:
            raise LayoutError(f"channel axis must be innermost (stride 1), got strides {v0.stride()}")
        B, H, N, C = v0.shape
        starts = [v.data_ptr() - store.data_ptr() for v in views]
        lstride = starts[1] - starts[0] if len(views) > 1 else None
        if len(views) > 1 and any(b - a != lstride for a, b in zip(starts, starts[1:])):
            raise LayoutError("layer views are not evenly spaced in memory")
        if lstride is not None and lstride <= 0:   # aliased (shared) or descending: not distinct layers
            raise LayoutError(f"layer views must lie at increasing addresses; layer 1 starts {lstride} bytes "
                              f"after layer 0")
        byte = {"B": v0.stride(0) * es, "H": v0.stride(1) * es, "N": v0.stride(2) * es,
                "L": lstride if lstride is not None else 0}
        sizes = {"L": len(views), "B": B, "H": H, "N": N}
        # Axes of size 1 have no meaningful stride; order the rest by stride, largest first.
        if lstride is None:
            order_axes = ["L", *sorted(("B", "H", "N"), key=lambda a: -byte[a])]
        else:
            order_axes = sorted(("L", "B", "H", "N"), key=lambda a: -byte[a])
        order = "".join(order_axes) + "C"
        if order not in ORDERS:
            raise LayoutError(f"layer views have axis order {order}, which no vLLM KVCacheLayout has")
        hv = kw.pop("head_dim_v", 0 if packing == "mla" else head_dim)
        layout = cls(packing, order, len(views), B, N, H, head_dim, hv, dtype,
                     layer_stride=lstride if lstride else None, block_stride=byte["B"], offset=starts[0], **kw)
        if layout.cell_channels != C or layout.storage_dtype.itemsize != es:
            raise LayoutError(f"views hold C={C} channels of {es}-byte elements; layout expects "
                              f"{layout.cell_channels} of {layout.storage_dtype.itemsize}")
        for axis in ("H", "N"):
            if sizes[axis] > 1 and layout.byte_strides[axis] != byte[axis]:
                raise LayoutError(f"{axis} stride {byte[axis]} does not match a dense {order} layout "
                                  f"({layout.byte_strides[axis]})")
        return layout

    # ------------------------------------------------------------------ derived facts
    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype].storage.itemsize

    @property
    def storage_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype].storage

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype].fp8

    @property
    def cell_channels(self) -> int:
        """C of vLLM's per-layer view [B, H, N, C] in elements."""
        return self.head_dim + self.head_dim_v

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def byte_strides(self) -> dict[str, int]:
        """Bytes between consecutive L, B, H, N indices."""
        return dict(self._bytes)

    @property
    def nbytes(self) -> int:
        """Smallest buffer (from byte 0) that holds every cell."""
        s, cell = self._bytes, self.cell_channels * self.element_size
        last = (self.num_layers - 1) * s["L"] + (self.num_blocks - 1) * s["B"] + \
            (self.num_kv_heads - 1) * s["H"] + (self.block_size - 1) * s["N"]
        return self.offset + last + cell

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_bytes", None)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        return cls(**d)

    def with_(self, **changes: Any) -> "KVLayout":
        return replace(self, **changes)

    # ------------------------------------------------------------------ path 1: strided addressing
    def _element(self, axis: str) -> int:
        return self._bytes[axis] // self.element_size

    def k_strides(self) -> Strides:
        """Element strides of K (for the kernel and the strided views)."""
        cached = self.__dict__.get("_k_strides")   # a frozen layout's strides never change; launches ask often
        if cached is None:
            cached = self.__dict__["_k_strides"] = self._k_strides()
        return cached

    def v_strides(self) -> Strides:
        cached = self.__dict__.get("_v_strides")
        if cached is None:
            cached = self.__dict__["_v_strides"] = self._v_strides()
        return cached

    def _k_strides(self) -> Strides:
        L, B, H, N = (self._element(a) for a in "LBHN")
        off = self.offset // self.element_size
        if self.packing == "cpu":  # K plane stored transposed: [c, n] at c·N + n
            return Strides(off, L, B, H, 1, self.block_size)
        return Strides(off, L, B, H, N, 1)

    def _v_strides(self) -> Strides:
        if self.head_dim_v == 0:
            raise LayoutError("this layout has no V (MLA)")
        L, B, H, N = (self._element(a) for a in "LBHN")
        off = self.offset // self.element_size
        if self.packing == "cpu":  # V plane after the K plane: [n, c] at N·D + n·D + c
            return Strides(off + self.block_size * self.head_dim, L, B, H, self.head_dim, 1)
        return Strides(off + self.head_dim, L, B, H, N, 1)

    def _strided(self, flat: torch.Tensor, st: Strides, channels: int) -> torch.Tensor:
        self.check_buffer(flat, elements=True)
        return flat.as_strided((self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, channels),
                               (st.layer, st.block, st.token, st.head, st.channel), st.offset)

    def k_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """K of the whole cache as a [L, B, N, H, head_dim] view over the flat element buffer."""
        return self._strided(flat, self.k_strides(), self.head_dim)

    def v_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """V as a [L, B, N, H, head_dim_v] view (not for MLA)."""
        return self._strided(flat, self.v_strides(), self.head_dim_v)

    def elements(self, raw: torch.Tensor) -> torch.Tensor:
        """The raw byte buffer viewed as storage elements (uint8 for fp8), from byte 0."""
        self.check_buffer(raw)
        es = self.element_size
        return raw[: raw.numel() // es * es].view(self.storage_dtype)

    def check_buffer(self, buf: torch.Tensor, elements: bool = False) -> None:
        """A buffer this layout may address: 1-D, contiguous, large enough, element-aligned."""
        if not isinstance(buf, torch.Tensor):
            raise LayoutError(f"buffer must be a torch.Tensor, got {type(buf).__name__}")
        want = self.storage_dtype if elements else (torch.uint8, torch.int8)
        if (buf.dtype != want) if elements else (buf.dtype not in want):
            raise LayoutError(f"buffer dtype {buf.dtype}, expected {want}")
        if buf.dim() != 1 or not buf.is_contiguous():
            raise LayoutError(f"buffer must be 1-D and contiguous, got shape {tuple(buf.shape)} "
                              f"strides {buf.stride()}")
        size = buf.numel() * buf.element_size()
        if size < self.nbytes:
            raise LayoutError(f"buffer holds {size} bytes, layout needs {self.nbytes}")
        if buf.data_ptr() % self.element_size:
            raise MisalignedLayoutError(f"buffer address {buf.data_ptr():#x} is not {self.element_size}-byte aligned")

    def split_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset-in-block) of each slot (slots must be >= 0)."""
        return torch.div(slots, self.block_size, rounding_mode="floor"), torch.remainder(slots, self.block_size)

    # ------------------------------------------------------------------ path 2: vLLM's per-layer views
    def layer_views(self, raw: torch.Tensor) -> list[torch.Tensor]:
        """One [B, H, N, C] view per layer over the raw bytes, as vLLM's allocate_kv_cache builds them."""
        self.check_buffer(raw)
        s, C = self._bytes, self.cell_channels * self.element_size
        views = []
        for layer in range(self.num_layers):
            v = raw.as_strided((self.num_blocks, self.num_kv_heads, self.block_size, C),
                               (s["B"], s["H"], s["N"], 1), raw.storage_offset() + self.offset + layer * s["L"])
            views.append(v.view(self.storage_dtype))
        return views

    def split_view(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(K, V) of one layer view, each [B, N, H, D] — split the way vLLM's attention backends do."""
        B, H, N, _ = view.shape
        D = self.head_dim
        if self.packing == "mla":
            return view.transpose(1, 2), None
        if self.packing == "cpu":
            kc, vc = view.view(B, H, 2 * N, D).chunk(2, dim=2)    # [B, H, N, D] planes
            k = kc.reshape(B, H, D, N).permute(0, 3, 1, 2)        # K plane holds K^T
            return k, vc.transpose(1, 2)
        k, v = view.transpose(1, 2).split([D, self.head_dim_v], dim=-1)
        return k, v

    def read_tokens(self, raw: torch.Tensor, slots: torch.Tensor,
                    layers: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K [T, L', H, D] and V (None for MLA) of the given slots (all >= 0), through the layer views."""
        layers = range(self.num_layers) if layers is None else layers
        b, n = self.split_slots(slots.to(torch.int64))
        ks, vs = [], []
        for layer in layers:
            k, v = self.split_view(self.layer_views(raw)[layer])
            ks.append(k[b, n])
            if v is not None:
                vs.append(v[b, n])
        return torch.stack(ks, 1), (torch.stack(vs, 1) if vs else None)

    def write_tokens(self, raw: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                     layers: Sequence[int] | None = None) -> None:
        """Store K/V [T, L', H, D] into the slots through the layer views (no rotation; a test helper)."""
        layers = list(range(self.num_layers) if layers is None else layers)
        b, n = self.split_slots(slots.to(torch.int64))
        views = self.layer_views(raw)
        for i, layer in enumerate(layers):
            kv, vv = self.split_view(views[layer])
            kv[b, n] = k[:, i]
            if vv is not None and v is not None:
                vv[b, n] = v[:, i]

    def touched_bytes(self, raw_like: torch.Tensor, slots: torch.Tensor,
                      layers: Sequence[int] | None = None) -> torch.Tensor:
        """bool [nbytes of raw_like]: True for every byte of the slots' K and V (all heads, given layers)."""
        mark = torch.zeros_like(raw_like, dtype=torch.uint8)
        b, n = self.split_slots(slots[slots >= 0].to(torch.int64))
        layers = range(self.num_layers) if layers is None else layers
        views = self.layer_views(mark)
        for layer in layers:
            for part in self.split_view(views[layer]):
                if part is not None:
                    part[b, n] = _all_bytes_set(part[b, n])
        return mark.ne(0)


def _all_bytes_set(x: torch.Tensor) -> torch.Tensor:
    # Elements whose every byte is 0x01, whatever the dtype, so a byte mask can be read back.
    byte = torch.ones(x.element_size(), dtype=torch.uint8, device=x.device)
    return byte.view(x.dtype).expand_as(x).clone()


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind a tensor (e.g. one of vLLM's layer views) as a 1-D uint8 tensor."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def dequantize(q: torch.Tensor, fmt: torch.dtype, scale: float | torch.Tensor) -> torch.Tensor:
    """float32 values of fp8 bytes (uint8) stored as fp8(x / scale)."""
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32, device=q.device)
    return q.view(fmt).to(torch.float32) * s


def quantize(x: torch.Tensor, fmt: torch.dtype, inv_scale: float | torch.Tensor) -> torch.Tensor:
    """uint8 fp8 bytes of x·inv_scale, saturated to the format's largest finite value, rounded to nearest even."""
    inv = inv_scale if isinstance(inv_scale, torch.Tensor) else \
        torch.tensor(inv_scale, dtype=torch.float32, device=x.device)
    top = 448.0 if fmt == torch.float8_e4m3fn else 57344.0
    return (x.to(torch.float32) * inv).clamp(-top, top).to(fmt).view(torch.uint8)
