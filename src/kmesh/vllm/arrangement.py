"""The engine's KV arrangement, read off what vLLM hands the connector (never assumed), and the staging layouts.

vLLM gives `register_kv_caches` one tensor per attention layer. Which packing those bytes follow depends on the
attention backend that reads them (the CPU backend keeps a K plane then a V plane per (block, head); the GPU
backends pack [K|V] per token), so the packing comes from the layer's backend and the order, strides and
offsets from the tensors (kmesh.layout.KVLayout.from_layer_views). Anything else — a backend we have not
checked, MLA latents, fp8 caches, views that disagree with the model's heads or head size — is refused here,
at registration, with the reason: loading into an arrangement we only think we understand would be silent
garbage.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from kmesh.errors import KMeshError
from kmesh.layout import KVLayout, LayoutError, storage_bytes

# Backends whose reading of the layer view tests/test_vllm_layout_contract.py checks against vLLM's sources.
BACKEND_PACKING = {"CPU_ATTN": "cpu", "FLASH_ATTN": "paged", "TRITON_ATTN": "paged", "FLEX_ATTENTION": "paged"}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
RECORD_LAYOUT = dict(packing="paged", order="LBNHC", num_layers=1, block_size=1, num_kv_heads=1, head_dim=32,
                     head_dim_v=32, dtype="float32")      # one 256-byte cell per record


class ArrangementError(KMeshError):
    """The engine's KV caches are in an arrangement the connector does not understand."""


@dataclass(frozen=True)
class EngineCache:
    """The engine's KV caches as one byte buffer + the layout that addresses it (slot = block·N + offset)."""

    raw: torch.Tensor
    layout: KVLayout
    layer_names: tuple[str, ...]
    backend: str

    @property
    def block_size(self) -> int:
        return self.layout.block_size


def layer_index(name: str) -> int:
    """Layer number in a vLLM layer name ('model.layers.7.self_attn.attn' -> 7)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise ArrangementError(f"cannot tell the layer number of KV cache {name!r}")
    return int(found[0])


def _backend_name(layer: Any) -> str:
    backend = getattr(layer, "attn_backend", None) or getattr(getattr(layer, "impl", None), "backend", None)
    if backend is None:
        return "unknown"
    try:
        return str(backend.get_name())
    except Exception:                      # a backend class without get_name(): say what it is
        return getattr(backend, "__name__", type(backend).__name__)


def detect(kv_caches: Mapping[str, torch.Tensor], layers: Mapping[str, Any], num_kv_heads: int, head_dim: int,
           num_layers: int) -> EngineCache:
    """The EngineCache behind vLLM's per-layer caches; ArrangementError for anything not understood.

    layers: layer name -> vLLM attention layer (the static forward context), for each layer's backend."""
    if not kv_caches:
        raise ArrangementError("vLLM registered no KV caches")
    names = tuple(sorted(kv_caches, key=layer_index))
    if [layer_index(n) for n in names] != list(range(num_layers)):
        raise ArrangementError(f"expected KV caches for layers 0..{num_layers - 1}, got {list(names)[:4]}… "
                               f"({len(names)} caches; hybrid or shared-KV models are not supported)")
    backends = {_backend_name(layers.get(n)) for n in names}
    if len(backends) != 1:
        raise ArrangementError(f"layers use different attention backends {sorted(backends)}")
    backend = backends.pop()
    packing = BACKEND_PACKING.get(backend)
    if packing is None:
        raise ArrangementError(f"attention backend {backend!r} is not one whose KV arrangement KMesh has checked "
                               f"(known: {sorted(BACKEND_PACKING)}); refusing to load into it")
    views = [kv_caches[n] for n in names]
    v0 = views[0]
    if v0.dtype not in _DTYPES:
        raise ArrangementError(f"KV cache dtype {v0.dtype} is not supported by the connector "
                               f"(fp8 caches need per-layer scales it does not read yet)")
    if v0.dim() != 4 or v0.shape[1] != num_kv_heads or v0.shape[3] != 2 * head_dim:
        raise ArrangementError(f"KV cache views of shape {tuple(v0.shape)} are not [blocks, {num_kv_heads} kv-heads, "
                               f"block_size, 2×{head_dim}] as the {backend} backend lays out this model")
    try:
        layout = KVLayout.from_layer_views(views, packing, head_dim, _DTYPES[v0.dtype])
    except LayoutError as e:
        raise ArrangementError(f"KV cache views do not form a known arrangement: {e}") from e
    return EngineCache(storage_bytes(v0), layout, names, backend)


def staging_layout(engine: KVLayout, blocks: int) -> KVLayout:
    """The engine's per-block geometry with the block axis outermost (all layers of one block contiguous):
    one engine block = one contiguous byte range = one saved object."""
    order = "B" + engine.order.replace("B", "")
    return KVLayout(engine.packing, order, engine.num_layers, blocks, engine.block_size, engine.num_kv_heads,
                    engine.head_dim, engine.head_dim_v, engine.dtype, engine.rope_offset, engine.k_scale,
                    engine.v_scale)


def record_layout(records: int) -> KVLayout:
    return KVLayout(num_blocks=records, **RECORD_LAYOUT)
