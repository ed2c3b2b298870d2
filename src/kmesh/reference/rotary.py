"""Rotary position embedding from the published formulas, as complex numbers in float64.

An independent reference for kmesh.kv.rope: it reads only a rope's data fields (rotary_dim, theta, style,
scaling, max_position) and computes its own frequencies and yarn attention factor, so a bug in
kmesh.kv.rope (a reversed angle, a wrong pairing, a wrong blend) cannot also be in the reference.

Rotation (Su et al., RoFormer 2021): channel pair i of a key is the complex number z_i = x_a + i·x_b,
with pairs (i, i + d/2) ("neox", GPT-NeoX / Llama) or (2i, 2i + 1) ("gptj"); at position p it becomes
m · z_i · exp(i·p·ω_i), m = the attention factor (yarn; 1 otherwise). Channels >= rotary_dim pass through.

Frequencies. The engine (vLLM 0.32, also transformers) keeps ω in float32, and a restore is judged
against float32 bounds (an ω one ulp off, times a shift of 300 positions, already exceeds them), so the
reference must reproduce the engine's float32 ω exactly. It does so by following the engine's definition
of the arithmetic, not its code:
  base ω_i = 1 / b^(2i/d), each step a float32 operation, correctly rounded: e = f32(2i / d),
             q = f32(f32(b)^e), ω = f32(1 / q)   (evaluated here in float64 and rounded once per step)
  linear   ω_i / s (exact in float64: the engine divides the positions by s, the same angle)
  llama3   Meta's Llama 3.1 `apply_scaling` on the base ω, in float64, rounded once to float32
  yarn     NTK-by-parts (Peng et al. 2023, reference code: find_correction_range + linear ramp mask) on
           the base ω, in float64, rounded once to float32; attention factor 0.1·ln(s) + 1
  dynamic  NTK base b' = b·(s·P/P_trained − (s − 1))^(d/(d−2)), then the base rule with b'
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from kmesh.errors import KMeshError

__all__ = [
    "RotaryReferenceError", "round_f32", "base_frequencies", "frequencies", "attention_factor",
    "rotate_complex", "fresh_rotation", "ulp_distance_f32",
]


class RotaryReferenceError(KMeshError):
    """Settings this reference does not cover, or tensors of the wrong shape."""


def round_f32(v: float) -> float:
    """The float32 nearest to v (ties to even), as a Python float."""
    return float(np.float32(v))


def base_frequencies(rotary_dim: int, theta: float) -> list[float]:
    """Unscaled ω_i, i < rotary_dim/2, as the engine's float32 operations produce them (see module doc)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise RotaryReferenceError(f"rotary_dim must be a positive even int, got {rotary_dim}")
    b = round_f32(theta)
    out = []
    for i in range(rotary_dim // 2):
        e = round_f32((2 * i) / rotary_dim)
        q = round_f32(b**e)
        out.append(round_f32(1.0 / q))
    return out


def _rope_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _llama3(base: list[float], s: float, context: float, low: float, high: float) -> list[float]:
    # Meta, Llama 3.1 reference `apply_scaling`: keep short wavelengths, divide long ones by s, blend between.
    low_wavelen, high_wavelen = context / low, context / high
    out = []
    for w in base:
        wavelen = 2 * math.pi / w
        if wavelen < high_wavelen:
            out.append(w)
        elif wavelen > low_wavelen:
            out.append(round_f32(w / s))
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(round_f32((1 - smooth) * w / s + smooth * w))
    return out


def _yarn(base: list[float], s: float, context: float, theta: float, beta_fast: float, beta_slow: float,
          truncate: bool) -> list[float]:
    # YaRN reference code: the channel index at which a frequency makes r turns over the original context,
    # a linear ramp between the indices for beta_fast and beta_slow turns; mask = 1 keeps (extrapolates) ω.
    d = 2 * len(base)

    def correction_dim(turns: float) -> float:
        return (d * math.log(context / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as the reference code: avoid a zero-width ramp (a step at `low`)
    out = []
    for i, w in enumerate(base):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1.0 - ramp
        out.append(round_f32((w / s) * (1 - keep) + w * keep))
    return out


def frequencies(rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                max_position: int | None = None) -> torch.Tensor:
    """float64 [rotary_dim // 2]: ω of each channel pair (float32 values, see module doc)."""
    kind = _rope_type(scaling)
    if kind == "default":
        return torch.tensor(base_frequencies(rotary_dim, theta), dtype=torch.float64)
    assert scaling is not None
    s = float(scaling["factor"])
    if kind == "linear":
        return torch.tensor(base_frequencies(rotary_dim, theta), dtype=torch.float64) / s
    if kind == "llama3":
        w = _llama3(base_frequencies(rotary_dim, theta), s, float(scaling["original_max_position_embeddings"]),
                    float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]))
        return torch.tensor(w, dtype=torch.float64)
    if kind == "yarn":
        w = _yarn(base_frequencies(rotary_dim, theta), s, float(scaling["original_max_position_embeddings"]),
                  theta, float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1),
                  bool(scaling.get("truncate", True)))
        return torch.tensor(w, dtype=torch.float64)
    if kind == "dynamic":
        if max_position is None:
            raise RotaryReferenceError("dynamic scaling needs max_position (the table length)")
        trained = float(scaling.get("max_trained_positions", max_position))
        b = theta * ((s * max_position / trained) - (s - 1)) ** (rotary_dim / (rotary_dim - 2))
        return torch.tensor(base_frequencies(rotary_dim, b), dtype=torch.float64)
    raise RotaryReferenceError(f"no reference for rope scaling {kind!r}")


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """yarn's attention factor (Peng et al. 2023: √(1/t) = 0.1·ln(s) + 1; DeepSeek: a ratio of two such
    factors with multipliers mscale / mscale_all_dim; or given explicitly). 1 for every other type."""
    if _rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    s = float(scaling["factor"])

    def factor(m: float) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return factor(float(scaling["mscale"])) / factor(float(scaling["mscale_all_dim"]))
    return factor(1.0)


def rotate_complex(x: torch.Tensor, positions: torch.Tensor, omega: torch.Tensor, style: str,
                   scale: float = 1.0) -> torch.Tensor:
    """float64 copy of x [T, ..., D] with its first 2·len(omega) channels rotated to positions [T]:
    each pair as z = x_a + i·x_b times scale·exp(i·p·ω)."""
    if style not in ("neox", "gptj"):
        raise RotaryReferenceError(f"style must be 'neox' or 'gptj', got {style!r}")
    if x.dim() < 2 or positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise RotaryReferenceError(f"x must be [T, ..., D] and positions [T], got {tuple(x.shape)} and "
                                   f"{tuple(positions.shape)}")
    half = omega.numel()
    rd = 2 * half
    if rd > x.shape[-1]:
        raise RotaryReferenceError(f"{rd} rotary channels but x has {x.shape[-1]}")
    x = x.to(torch.float64)
    part = x[..., :rd]
    a, b = (part[..., :half], part[..., half:]) if style == "neox" else (part[..., 0::2], part[..., 1::2])
    z = torch.complex(a, b)
    # p·ω is exact in float64 (a float32 ω has 24 significant bits, a position far fewer than 29).
    angle = positions.to(device=x.device, dtype=torch.float64)[:, None] * omega.to(x.device, torch.float64)[None, :]
    angle = angle.reshape((x.shape[0],) + (1,) * (x.dim() - 2) + (half,))
    turned = z * torch.polar(torch.full_like(angle, scale), angle)
    out = x.clone()
    if style == "neox":
        out[..., :half], out[..., half:rd] = turned.real, turned.imag
    else:
        out[..., 0:rd:2], out[..., 1:rd:2] = turned.real, turned.imag
    return out


def fresh_rotation(x: torch.Tensor, positions: torch.Tensor, rope: Any) -> torch.Tensor:
    """How the engine rotates a new key at `positions` (attention factor included), in float64, for a rope
    described by the fields of a kmesh.kv.rope.RopeConfig (rotary_dim, theta, style, scaling, max_position)."""
    omega = frequencies(rope.rotary_dim, rope.theta, rope.scaling, rope.max_position)
    return rotate_complex(x, positions, omega, rope.style, attention_factor(rope.scaling))


def ulp_distance_f32(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in float32 ulps (units in the last place) between two tensors of float32 values."""
    def ordered(t: torch.Tensor) -> np.ndarray:
        bits = t.detach().cpu().to(torch.float32).numpy().view(np.int32).astype(np.int64)
        return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)   # monotone in the float's value
    if a.shape != b.shape:
        raise RotaryReferenceError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return int(np.abs(ordered(a) - ordered(b)).max()) if a.numel() else 0
