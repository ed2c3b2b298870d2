"""vLLM's own fresh rotary embedding, as the comparator for KMesh's shift accuracy (issue §21: "bf16 no worse
than vLLM's own fresh bf16 rotation + 1 ulp-level rounding")."""
from __future__ import annotations

from typing import Callable

import torch

from kmesh.kv.rope import RopeConfig

Fresh = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def vllm_fresh_rotation(rope: RopeConfig, dtype: torch.dtype) -> Fresh:
    """fresh(x [T, H, D], positions [T]) -> keys as vLLM's rotary embedding (its dispatched CPU op) rotates them.

    Only unscaled ("default") ropes are built here; the scaled variants are compared in tests/test_rope.py."""
    if rope.scaling_type not in (None, "default"):
        raise ValueError(f"only default rope is built here, got {rope.scaling_type!r}")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_type": "default", "rope_theta": rope.theta}
    if rope.rotary_dim != rope.head_dim:
        params["partial_rotary_factor"] = rope.rotary_dim / rope.head_dim
    with set_current_vllm_config(VllmConfig()):
        theirs = get_rope(rope.head_dim, max_position=rope.max_position, is_neox_style=rope.style == "neox",
                          rope_parameters=params, dtype=dtype)

    def fresh(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        q, k = x.reshape(t, h * d).clone(), x.reshape(t, h * d).clone()
        _, k = theirs(pos, q, k)
        return k.reshape(t, h, d)

    return fresh
