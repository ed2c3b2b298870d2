"""A Llama / Qwen2 decoder in float64, written apart from kmesh.model.runner: the reference a repair is held to.

It reads only the checkpoint's weight tensors and config numbers and computes every step from the published
formulas: RMSNorm (x / √(mean x² + ε) · w), the q/k/v projections (with Qwen2's biases), RoPE through
kmesh.reference.rotary (never kmesh.kv.rope or the checkpoint's rotary module), attention as softmax(q·kᵀ/√D)
with an explicit boolean mask built here from positions (key position <= query position), grouped K/V heads by
index arithmetic, the SiLU-gated MLP and the tied or untied head. Nothing of the runner's (its kernels, fused
steps, masks, SDPA) is called, so a mistake there cannot also be here.

Rows are computed one subset at a time, exactly as a repair computes them: `qkv` for hidden rows at given
positions, `attend` of those queries over keys at given positions, `finish` for the rest of the layer.
"""
from __future__ import annotations

from typing import Any

import torch

from kmesh.errors import KMeshError
from kmesh.reference.rotary import fresh_rotation

__all__ = ["DecoderReferenceError", "Float64Decoder"]


class DecoderReferenceError(KMeshError):
    """A model this reference does not cover, or inputs of the wrong shape."""


def _f64(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.detach().to(device=device, dtype=torch.float64)


class Float64Decoder:
    """The weights of a transformers Llama / Qwen2 model as float64 tensors, and one decoder layer's math.

    `rope` is the runner's RopeConfig (its data fields only: theta, rotary_dim, style, scaling, max_position are
    what kmesh.reference.rotary reads). Weights are converted one layer at a time when first used and kept."""

    def __init__(self, model: Any, rope: Any, device: torch.device | str | None = None) -> None:
        cfg = model.config
        if cfg.model_type not in ("llama", "qwen2"):
            raise DecoderReferenceError(f"the float64 reference knows llama and qwen2, not {cfg.model_type!r}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise DecoderReferenceError(f"the float64 reference knows the SiLU MLP, not {cfg.hidden_act!r}")
        self.model, self.rope = model, rope
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.num_layers = int(cfg.num_hidden_layers)
        self.heads, self.kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps = float(cfg.rms_norm_eps)
        self._layers: dict[int, dict[str, torch.Tensor | None]] = {}
        inner = model.model
        self._embed = _f64(inner.embed_tokens.weight, self.device)
        self._norm = _f64(inner.norm.weight, self.device)
        self._head = _f64(model.lm_head.weight, self.device)

    def _layer(self, layer: int) -> dict[str, torch.Tensor | None]:
        if not 0 <= layer < self.num_layers:
            raise DecoderReferenceError(f"layer {layer} outside the model's {self.num_layers}")
        if layer not in self._layers:
            blk, dev = self.model.model.layers[layer], self.device
            att, mlp = blk.self_attn, blk.mlp
            self._layers[layer] = {
                "ln1": _f64(blk.input_layernorm.weight, dev), "ln2": _f64(blk.post_attention_layernorm.weight, dev),
                **{f"{n}": _f64(getattr(att, f"{n}_proj").weight, dev) for n in ("q", "k", "v", "o")},
                **{f"{n}_bias": _f64(getattr(att, f"{n}_proj").bias, dev) for n in ("q", "k", "v", "o")},
                **{n: _f64(getattr(mlp, f"{n}_proj").weight, dev) for n in ("gate", "up", "down")},
            }
        return self._layers[layer]

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * w

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = x @ w.T
        return y if b is None else y + b

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """float64 hidden rows [n, hidden] of token ids [n]."""
        return self._embed[ids.to(self.device)]

    def qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-RoPE q [n, heads, D], k and v [n, kv_heads, D] of float64 hidden rows h at `positions`."""
        w, n = self._layer(layer), h.shape[0]
        if positions.shape != (n,):
            raise DecoderReferenceError(f"{n} rows need {n} positions, got {tuple(positions.shape)}")
        x = self._rms(h, w["ln1"])
        q = self._linear(x, w["q"], w["q_bias"]).view(n, self.heads, self.head_dim)
        k = self._linear(x, w["k"], w["k_bias"]).view(n, self.kv_heads, self.head_dim)
        v = self._linear(x, w["v"], w["v_bias"]).view(n, self.kv_heads, self.head_dim)
        pos = positions.to(self.device)
        return fresh_rotation(q, pos, self.rope), fresh_rotation(k, pos, self.rope), v

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_pos: torch.Tensor) -> torch.Tensor:
        """softmax(q·kᵀ/√D) v, query at position p seeing the keys at positions <= p: [n, heads·D]."""
        n, m = q.shape[0], k.shape[0]
        if k.shape != v.shape or k_pos.shape != (m,) or q_pos.shape != (n,):
            raise DecoderReferenceError("attend: k, v [m, kv_heads, D] and positions [n], [m] expected")
        kv_of_head = torch.arange(self.heads, device=self.device) // (self.heads // self.kv_heads)
        kk, vv = k[:, kv_of_head], v[:, kv_of_head]                           # [m, heads, D]
        scores = torch.einsum("nhd,mhd->hnm", q, kk) / self.head_dim ** 0.5
        seen = k_pos.to(self.device)[None, :] <= q_pos.to(self.device)[:, None]   # [n, m]
        if not bool(seen.any(1).all()):
            raise DecoderReferenceError("a query sees no key (every key position is after it)")
        weights = torch.softmax(scores.masked_fill(~seen[None], float("-inf")), dim=-1)
        return torch.einsum("hnm,mhd->nhd", weights, vv).reshape(n, self.heads * self.head_dim)

    def finish(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o-projection and residual, then the post-attention norm, SiLU-gated MLP and residual."""
        w = self._layer(layer)
        h = h + self._linear(attn, w["o"], w["o_bias"])
        x = self._rms(h, w["ln2"])
        gate = x @ w["gate"].T
        return h + (gate * torch.sigmoid(gate) * (x @ w["up"].T)) @ w["down"].T

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits [n, vocab] of the final hidden rows."""
        return self._rms(h, self._norm) @ self._head.T

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The plain causal forward of ids [T]: (K, V [layers, T, kv_heads, D], next-token logits [vocab])."""
        T = ids.shape[0]
        pos = torch.arange(T, device=self.device)
        h = self.embed(ids)
        ks, vs = [], []
        for layer in range(self.num_layers):
            q, k, v = self.qkv(layer, h, pos)
            ks.append(k)
            vs.append(v)
            h = self.finish(layer, h, self.attend(q, pos, k, v, pos))
        return torch.stack(ks), torch.stack(vs), self.logits(h[-1:])[0]
