"""Arrangements the connector must refuse at registration (and one it must accept), on tensors shaped the way
vLLM hands them over. Engine-free: runs on any host (the GPU host has no vLLM)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

from kmesh.vllm.arrangement import ArrangementError, detect

L, B, H, N, D = 3, 4, 2, 16, 8


def _layers(name: str, isa: str | None = "vec") -> dict[str, Any]:
    """Attention layers of backend `name`; on CPU_ATTN each carries the `isa` vLLM's metadata builder sets
    (None: no attribute)."""
    backend = SimpleNamespace(get_name=lambda: name)
    extra = {"isa": isa} if name == "CPU_ATTN" and isa is not None else {}
    return {f"model.layers.{i}.self_attn.attn": SimpleNamespace(attn_backend=backend, **extra) for i in range(L)}


def _views(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (B, H, N, 2 * D),
           shared: bool = True) -> dict[str, torch.Tensor]:
    per = int(torch.Size(shape).numel())
    raw = torch.zeros(L * per, dtype=dtype)
    def one(i: int) -> torch.Tensor:
        return raw[i * per:(i + 1) * per] if shared else torch.zeros(per, dtype=dtype)

    return {f"model.layers.{i}.self_attn.attn": one(i).view(shape) for i in range(L)}


CASES: dict[str, Callable[[], Any]] = {
    "unknown_backend": lambda: detect(_views(), _layers("FLASHINFER_MLA"), H, D, L),
    "fp8_cache": lambda: detect(_views(torch.uint8), _layers("CPU_ATTN"), H, D, L),
    "wrong_head_count": lambda: detect(_views(shape=(B, H + 1, N, 2 * D)), _layers("CPU_ATTN"), H, D, L),
    "mla_latent": lambda: detect(_views(shape=(B, 1, N, 576)), _layers("CPU_ATTN"), H, D, L),
    "separate_allocations": lambda: detect(_views(shared=False), _layers("CPU_ATTN"), H, D, L),
    "missing_layer": lambda: detect(dict(list(_views().items())[:2]), _layers("CPU_ATTN"), H, D, L),
    # a bfloat16 engine on a CPU with AMX tiles: vLLM packs K and V for AMX tiles (kmesh.vllm.arrangement)
    "cpu_isa_amx": lambda: detect(_views(torch.bfloat16), _layers("CPU_ATTN", "amx"), H, D, L),
    "cpu_isa_unknown": lambda: detect(_views(), _layers("CPU_ATTN", None), H, D, L),
}


def refusals() -> dict[str, str | None]:
    """case -> the ArrangementError message (None: not refused, a defect). Other exceptions propagate."""
    out: dict[str, str | None] = {}
    for name, fn in CASES.items():
        try:
            fn()
            out[name] = None
        except ArrangementError as e:
            out[name] = str(e)
    return out


def accepted() -> tuple[str, str]:
    """The CPU backend's arrangement on well-formed views: (packing, order)."""
    arrangement = detect(_views(), _layers("CPU_ATTN"), H, D, L)
    return arrangement.layout.packing, arrangement.layout.order
