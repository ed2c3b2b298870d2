"""Rotary position embedding (RoPE) settings and the key shift that moves cached keys to new positions.

Cached keys are already rotated by their original position. Moving a key from position p to q is one
rotation by (q - p)·ω, with the angle computed in float64 from the ORIGINAL positions (never a chain
of small shifts, whose rounding would accumulate). Frequencies ω are the float32 values vLLM 0.32's
`get_rope` uses for Llama/Qwen2/SmolLM2 configs (bit for bit; for llama3/yarn, blended channels within
one float32 ulp on those models: see "Scaled frequencies" below), widened to float64, so a shifted key
lands where vLLM's own rotation would have put it.

Trap: yarn's cos/sin cache carries an attention multiplier (mscale, ~1.14 for factor 4). A cached key
already has it; a shift is a pure rotation and must not apply it again. `rotate` (fresh rotation, the
engine's semantics) applies it once; `shift` never does.

Tensors: keys are [T, ..., head_dim] (tokens first, e.g. [T, H, D]); positions are integer [T].
Everything works on CPU and CUDA tensors with plain torch ops. fp8 caches: pass the float8 view (not
the uint8 storage, which is rejected); see apply_rotation for why the scale needs no handling here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import numpy as np
import torch

from kmesh.errors import KMeshError

__all__ = [
    "RopeError",
    "RopeRangeError",
    "RopeConfig",
    "rotate",
    "shift_tables",
    "host_shift_tables",
    "apply_rotation",
    "shift",
    "measure_accuracy",
]

RopeStyle = Literal["neox", "gptj"]
SCALING_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# Keys a scaling dict must carry, per type (as in HF configs / vLLM's get_rope).
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
}


class RopeError(KMeshError):
    """Invalid rotary settings or tensors of the wrong shape/dtype/device for a rotation."""


class RopeRangeError(RopeError):
    """A position is negative or beyond the rotary table (>= max_position)."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings of one attention layer.

    max_position is the length of the table the engine would index (vLLM: max_position_embeddings,
    × factor for linear, original_max_position_embeddings × factor for yarn); positions >= it raise.
    """

    head_dim: int
    rotary_dim: int
    theta: float
    style: RopeStyle
    scaling: dict | None
    max_position: int
    _inv_freq: torch.Tensor = field(init=False, repr=False, compare=False)
    _mscale: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise RopeError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if not isinstance(self.rotary_dim, int) or not 0 < self.rotary_dim <= self.head_dim:
            raise RopeError(f"rotary_dim must be an int in (0, head_dim={self.head_dim}], got {self.rotary_dim!r}")
        if self.rotary_dim % 2:
            raise RopeError(f"rotary_dim must be even (channels rotate in pairs), got {self.rotary_dim}")
        if not (isinstance(self.theta, (int, float)) and math.isfinite(self.theta) and self.theta > 1):
            raise RopeError(f"theta must be a finite number > 1, got {self.theta!r}")
        if self.style not in ("neox", "gptj"):
            raise RopeError(f"style must be 'neox' or 'gptj', got {self.style!r}")
        if not isinstance(self.max_position, int) or self.max_position <= 0:
            raise RopeError(f"max_position must be a positive int, got {self.max_position!r}")
        # Own a normalised copy so later edits to the caller's dict cannot change a frozen config.
        object.__setattr__(self, "scaling", _normalise_scaling(self.scaling))
        object.__setattr__(self, "_inv_freq", _compute_inv_freq(self))
        object.__setattr__(self, "_mscale", _compute_mscale(self.scaling))

    def __hash__(self) -> int:  # scaling is a dict, so the generated hash would fail
        cached = self.__dict__.get("_hash")     # fields are frozen: computed once (plans are keyed by it)
        if cached is None:
            items = tuple(sorted((k, repr(v)) for k, v in (self.scaling or {}).items()))
            cached = self.__dict__["_hash"] = hash((self.head_dim, self.rotary_dim, self.theta, self.style, items,
                                                    self.max_position))
        return cached

    @property
    def scaling_type(self) -> str:
        return "default" if self.scaling is None else self.scaling["rope_type"]

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "RopeConfig":
        """From a Hugging Face PretrainedConfig or its dict (Llama / Qwen2 / SmolLM2 shape).

        Reads transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling`, and
        `partial_rotary_factor`. These families use neox pairing in vLLM.
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
        if not head_dim:
            raise RopeError("config has neither head_dim nor hidden_size/num_attention_heads")
        params = dict(get("rope_parameters") or {})
        legacy = get("rope_scaling")
        if legacy:
            params = {**dict(legacy), **params}
        theta = params.get("rope_theta", get("rope_theta", 10000.0))
        prf = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)) or 1.0
        if not 0.0 < prf <= 1.0:
            raise RopeError(f"partial_rotary_factor must be in (0, 1], got {prf}")
        rotary_dim = int(params.get("rope_dim") or int(head_dim * prf))
        max_pos = get("max_position_embeddings")
        if not max_pos:
            raise RopeError("config has no max_position_embeddings")
        scaling = _normalise_scaling(params)
        rope_type = "default" if scaling is None else scaling["rope_type"]
        # The table length vLLM builds for this type (see each RotaryEmbedding's cache).
        if rope_type == "linear":
            table = math.ceil(max_pos * scaling["factor"])
        elif rope_type == "yarn":
            table = math.ceil(scaling["original_max_position_embeddings"] * scaling["factor"])
        else:
            table = int(max_pos)
        return cls(int(head_dim), rotary_dim, float(theta), "neox", scaling, int(table))

    def inv_freq(self) -> torch.Tensor:
        """float64 [rotary_dim // 2]: angle per position of each channel pair, scaling applied."""
        return self._inv_freq.clone()

    def attention_mscale(self) -> float:
        """yarn's cos/sin multiplier (1.0 for other types). Part of a fresh rotation, never of a shift."""
        return self._mscale


def _normalise_scaling(scaling: Mapping | None) -> dict | None:
    """A scaling dict with 'rope_type' set and numeric fields as floats; None for no scaling."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise RopeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    s = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_dim", "type")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in SCALING_TYPES:
        raise RopeError(f"unsupported rope scaling type {rope_type!r}; supported: {SCALING_TYPES}")
    missing = [k for k in _REQUIRED[rope_type] if scaling.get(k) is None]
    if missing:
        raise RopeError(f"{rope_type} scaling needs {missing}")
    if rope_type == "dynamic" and "alpha" in scaling:
        raise RopeError("dynamic scaling by 'alpha' (NTK-alpha) is not supported")
    factor = float(scaling["factor"])
    if not (math.isfinite(factor) and factor > 0):
        raise RopeError(f"scaling factor must be a positive number, got {scaling['factor']!r}")
    if rope_type == "llama3" and not float(scaling["low_freq_factor"]) <= float(scaling["high_freq_factor"]):
        # the transition band [L/high, L/low] of wavelengths would be inverted (engines disagree on its meaning)
        raise RopeError(f"llama3 low_freq_factor {scaling['low_freq_factor']} exceeds high_freq_factor "
                        f"{scaling['high_freq_factor']}")
    s["rope_type"] = rope_type
    s["factor"] = factor
    return s


def _base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # float32, in the same operation order as vLLM, so frequencies match its tables bit for bit.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _compute_inv_freq(rope: RopeConfig) -> torch.Tensor:
    rd, s, kind = rope.rotary_dim, rope.scaling, rope.scaling_type
    theta = _base_inv_freq(rd, rope.theta)
    if kind == "default":
        return theta.double()
    factor = s["factor"]
    if kind == "linear":
        # vLLM divides positions by the factor; the exact angle is the same as dividing ω.
        return theta.double() / factor
    if kind == "llama3":
        return _llama31_inv_freq(theta.double(), factor, s["original_max_position_embeddings"],
                                 s["low_freq_factor"], s["high_freq_factor"]).float().double()
    if kind == "yarn":
        return _yarn_inv_freq(theta.double(), factor, s["original_max_position_embeddings"], rope.theta,
                              s.get("beta_fast", 32), s.get("beta_slow", 1), s.get("truncate", True)).float().double()
    if kind == "dynamic":
        # vLLM's static NTK form at its table length; equals plain RoPE unless max_trained_positions is set.
        trained = s.get("max_trained_positions", rope.max_position)
        base = rope.theta * ((factor * rope.max_position / trained) - (factor - 1)) ** (rd / (rd - 2))
        return _base_inv_freq(rd, base).double()
    raise RopeError(f"unsupported rope scaling type {kind!r}")


# Scaled frequencies (llama3, yarn) are blends of θ and θ/s. We form the blend in float64 from the engine's
# float32 θ and round it once to float32, the precision the engine keeps ω in: the nearest float32 to the
# formula (tests/test_rope.py checks against exact rational arithmetic). Channels that keep θ are bit-identical
# to vLLM's, θ/s too when s is a power of two. vLLM blends in a chain of float32 operations, so its blended
# channels sit a little off the formula: one ulp from ours on the models we test against it (Llama 3.1, Qwen2
# yarn ×4; an angle error of p·ω·2^-24, the size of vLLM's own float32 angle rounding), a few ulp at other
# settings, tens of ulp for yarn ×40 without truncation. Written from the papers, not from any engine's code.


def _turns(theta: torch.Tensor, context: float) -> torch.Tensor:
    """Rotations r = L/λ = L·θ/(2π) a channel of frequency θ (wavelength λ = 2π/θ) makes over L positions."""
    return theta * (context / (2 * math.pi))


def _llama31_inv_freq(theta: torch.Tensor, s: float, context: float, low: float, high: float) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (Meta's Llama 3.1 release, 2024: the reference
    `apply_scaling`, rope_type "llama3" in model configs). With L the original context, λ = 2π/θ, r = L/λ:

        λ < L / high_freq_factor   (r > high):  ω = θ                     high frequencies are kept
        λ > L / low_freq_factor    (r < low):   ω = θ / s                 low frequencies are interpolated
        otherwise:                              ω = (1 − μ)·θ/s + μ·θ,    μ = (r − low) / (high − low)

    i.e. one ramp μ = clamp((r − low)/(high − low), 0, 1) covers all three cases (μ is 0 or 1 outside).
    """
    r = _turns(theta, context)
    if high == low:  # no transition band: a step at r = high (r == high counts as low frequency)
        mu = (r > high).to(theta.dtype)
    else:
        mu = ((r - low) / (high - low)).clamp(0.0, 1.0)
    return theta * mu + (theta / s) * (1.0 - mu)


def _yarn_inv_freq(theta: torch.Tensor, s: float, context: float, base: float, beta_fast: float,
                   beta_slow: float, truncate: bool) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (Peng, Quesnelle, Fan, Shippole, "YaRN: Efficient Context Window
    Extension of Large Language Models", 2023): a channel that turns often over the original context L
    keeps θ (extrapolation), one that turns less than once is interpolated to θ/s, and channels in between
    blend: ω = γ·θ + (1 − γ)·θ/s. The paper ramps γ between α = beta_slow (1) and β = beta_fast (32) turns;
    its reference implementation, and every engine that runs YaRN models, ramps linearly over the channel
    index instead, between the indices where a channel makes β and α turns. From θ_i = b^(−2i/d) and
    L·θ_i/(2π) = r:

        i(r) = d · ln(L / (2π·r)) / (2 · ln b)          (d = rotary_dim, b = rope base)

    The band [i(β), i(α)] is widened to whole channels (floor / ceil when `truncate`), clipped to
    [0, d − 1] (d − 1, not d/2 − 1: the reference code's bound, which the models were trained with), and
    γ_i = clamp((i(α) − i) / (i(α) − i(β)), 0, 1). A zero-width band is a step: γ = 1 up to i(β), then 0.
    The attention factor 0.1·ln(s) + 1 is separate (_compute_mscale) and never part of ω.
    """
    d = 2 * theta.numel()

    def channel(turns: float) -> float:
        return d * math.log(context / (2 * math.pi * turns)) / (2 * math.log(base))

    first, last = channel(beta_fast), channel(beta_slow)  # i(β) < i(α): fast channels come first
    if truncate:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, d - 1)
    i = torch.arange(theta.numel(), dtype=theta.dtype)
    if last == first:
        gamma = (i <= first).to(theta.dtype)
    else:
        gamma = ((last - i) / (last - first)).clamp(0.0, 1.0)
    return theta * gamma + (theta / s) * (1.0 - gamma)


def _yarn_attention_factor(s: float, m: float = 1.0) -> float:
    """YaRN's attention scale √(1/t) = 0.1·ln(s) + 1 (Peng et al. 2023), with DeepSeek's multiplier m
    (0.1·m·ln(s) + 1; m = 1 in the paper); 1 when the context is not extended (s ≤ 1)."""
    return 0.1 * m * math.log(s) + 1.0 if s > 1 else 1.0


def _compute_mscale(s: dict | None) -> float:
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:  # given explicitly by the model config
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):  # DeepSeek-style configs: ratio of two temperatures
        return _yarn_attention_factor(s["factor"], s["mscale"]) / _yarn_attention_factor(s["factor"],
                                                                                          s["mscale_all_dim"])
    return _yarn_attention_factor(s["factor"])


# ---------------------------------------------------------------------------------------------------
# Positions and tables


def _check_positions(pos: torch.Tensor, rope: RopeConfig, name: str) -> None:
    if not isinstance(pos, torch.Tensor):
        raise RopeError(f"{name} must be a torch.Tensor, got {type(pos).__name__}")
    if pos.dim() != 1:
        raise RopeError(f"{name} must be 1-D [T], got shape {tuple(pos.shape)}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise RopeError(f"{name} must be an integer tensor, got {pos.dtype}")
    if pos.numel() == 0:
        return
    lo, hi = int(pos.min()), int(pos.max())
    if lo < 0 or hi >= rope.max_position:
        bad = lo if lo < 0 else hi
        raise RopeRangeError(f"{name} holds position {bad}, outside [0, {rope.max_position})")


def _tables(angle_pos: torch.Tensor, rope: RopeConfig, dtype: torch.dtype,
            scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    # Angles in float64 (exact for integer positions far beyond any context), rounded once at the end.
    angles = angle_pos.to(torch.float64)[:, None] * rope._inv_freq.to(angle_pos.device)[None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def shift_tables(old_pos: torch.Tensor, new_pos: torch.Tensor, rope: RopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of (new - old)·ω, from the original positions in float64; float32 [T, rotary_dim // 2].

    Pure rotation: yarn's mscale is not applied (the cached key already carries it).
    """
    _check_positions(old_pos, rope, "old_pos")
    _check_positions(new_pos, rope, "new_pos")
    if old_pos.shape != new_pos.shape:
        raise RopeError(f"old_pos {tuple(old_pos.shape)} and new_pos {tuple(new_pos.shape)} differ in length")
    if old_pos.device != new_pos.device:
        raise RopeError(f"old_pos on {old_pos.device} but new_pos on {new_pos.device}")
    delta = new_pos.to(torch.int64) - old_pos.to(torch.int64)
    return _tables(delta, rope, torch.float32)


def host_shift_tables(old_pos: np.ndarray, new_pos: np.ndarray, rope: RopeConfig) -> tuple[np.ndarray, np.ndarray]:
    """shift_tables computed on the host from host positions (int64 arrays): float32 [T, rotary_dim // 2] numpy
    arrays, the same numbers as shift_tables on CPU tensors; raises what it raises. For plans that must not
    wait on a device (kmesh.kv.gather)."""
    for name, pos in (("old_pos", old_pos), ("new_pos", new_pos)):
        if pos.ndim != 1:
            raise RopeError(f"{name} must be 1-D [T], got shape {pos.shape}")
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= rope.max_position):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise RopeRangeError(f"{name} holds position {bad}, outside [0, {rope.max_position})")
    if old_pos.shape != new_pos.shape:
        raise RopeError(f"old_pos {old_pos.shape} and new_pos {new_pos.shape} differ in length")
    # A row depends on the shift alone, and a restored segment shifts all its tokens alike: one row per distinct
    # shift (a handful), then gathered — the same numbers as one row per token.
    shifts, row = np.unique(new_pos.astype(np.int64) - old_pos.astype(np.int64), return_inverse=True)
    cos, sin = _tables(torch.from_numpy(shifts), rope, torch.float32)
    return cos.numpy()[row.reshape(-1)], sin.numpy()[row.reshape(-1)]


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Rotate channels [:rotary_dim] of x [T, ..., head_dim] by per-token tables [T, rotary_dim // 2].

    Math in float32 (float64 when x or the tables are float64), result in x.dtype; channels
    >= rotary_dim are copied bit for bit. Returns a new tensor; x is not modified.
    fp8 x (float8_e4m3fn / e5m2 values) is rotated as stored and saturated to the format's range:
    a scale shared by a channel pair (per tensor, token or head) cancels in a rotation, so this equals
    dequantize -> rotate -> requantize with the same scale (bit for bit for power-of-two scales).
    """
    if not isinstance(x, torch.Tensor) or not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        raise RopeError("x, cos and sin must be torch.Tensors")
    if not x.dtype.is_floating_point:
        raise RopeError(f"x must be floating point (dequantize fp8/uint8 caches first), got {x.dtype}")
    if x.dim() < 2 or x.shape[-1] != rope.head_dim:
        raise RopeError(f"x must be [T, ..., head_dim={rope.head_dim}], got {tuple(x.shape)}")
    half = rope.rotary_dim // 2
    want = (x.shape[0], half)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise RopeError(f"cos/sin must be {want} for x {tuple(x.shape)}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if not (cos.device == sin.device == x.device):
        raise RopeError(f"x on {x.device}, cos on {cos.device}, sin on {sin.device}: must share a device")
    wide = torch.float64 in (x.dtype, cos.dtype, sin.dtype)
    math_dtype = torch.float64 if wide else torch.float32
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.to(math_dtype).reshape(view)
    s = sin.to(math_dtype).reshape(view)
    xr = x[..., : rope.rotary_dim].to(math_dtype)
    if rope.style == "neox":  # pairs (i, i + half)
        x1, x2 = xr[..., :half], xr[..., half:]
    else:  # gptj: pairs (2i, 2i + 1)
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    rotated = torch.cat((o1, o2), dim=-1) if rope.style == "neox" else torch.stack((o1, o2), dim=-1).flatten(-2)
    if x.dtype.itemsize == 1:
        # fp8: a rotation can grow an element by up to √2; saturate like a quantizer instead of overflowing.
        limit = torch.finfo(x.dtype).max
        rotated = rotated.clamp(-limit, limit)
    out = x.clone()
    out[..., : rope.rotary_dim] = rotated.to(x.dtype)
    return out


def shift(k: torch.Tensor, old_pos: torch.Tensor, new_pos: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Move cached (already rotated) keys k [T, ..., head_dim] from old_pos to new_pos in one rotation."""
    cos, sin = shift_tables(old_pos, new_pos, rope)
    return apply_rotation(k, cos, sin, rope)  # checks k's shape, dtype and device against the tables


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Fresh rotation of un-rotated x at positions, as the engine rotates a new key (reference semantics).

    Includes yarn's attention mscale, like vLLM's cos/sin cache. Tables are float64 when x is float64
    (a float64 reference), else float32.
    """
    _check_positions(positions, rope, "positions")
    if not isinstance(x, torch.Tensor):
        raise RopeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() >= 1 and x.shape[0] != positions.shape[0]:
        raise RopeError(f"x has {x.shape[0]} tokens but positions has {positions.shape[0]}")
    table_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = _tables(positions, rope, table_dtype, rope.attention_mscale())
    return apply_rotation(x, cos, sin, rope)


# ---------------------------------------------------------------------------------------------------
# Accuracy measurement (recorded by the synthetic stage and checked by tests)

Fresh = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _rel_errors(got: torch.Tensor, ref: torch.Tensor, rotary_dim: int) -> dict[str, float]:
    # Per (token, head) vector over the rotary channels: L2 relative error, and largest element error
    # relative to the vector's largest |element|.
    g = got[..., :rotary_dim].to(torch.float64)
    r = ref[..., :rotary_dim]
    diff = g - r
    l2 = diff.norm(dim=-1) / r.norm(dim=-1)
    elem = diff.abs().amax(dim=-1) / r.abs().amax(dim=-1)
    return {"max_rel_l2": float(l2.max()), "mean_rel_l2": float(l2.mean()), "max_rel_elem": float(elem.max())}


def measure_accuracy(rope: RopeConfig, dtype: torch.dtype, max_pos: int, n: int, seed: int, *,
                     heads: int = 2, device: str | torch.device = "cpu", fresh: Fresh | None = None,
                     reference: Fresh | None = None) -> dict:
    """Error of `shift` against a float64 reference of fresh rotation at the new position.

    n tokens (× heads) of random keys x (exactly representable in dtype), random old/new positions in
    [0, max_pos) plus the two extreme moves 0 <-> max_pos-1 (so forward and backward shifts up to the
    full range are always in). Reference: `reference(x, new)` on float64 x, a float64 fresh rotation (default
    our own rotate; pass an independent one, e.g. kmesh.reference.rotary.fresh_rotation, so that a bug in
    this module cannot be in the ground truth too). Reports, over rotary channels:
      shift_exact  - shift of keys correctly rounded to dtype after a float64 rotation at old,
      fresh        - a fresh rotation in dtype at new (`fresh(x, new)`; default our `rotate`),
      shift_fresh  - shift of keys made by that same fresh rotation at old (the realistic cache path),
    each as max/mean L2-relative and max element-relative error, plus dtype's unit roundoff.
    """
    if max_pos < 2 or max_pos > rope.max_position:
        raise RopeRangeError(f"max_pos must be in [2, {rope.max_position}], got {max_pos}")
    if n < 2:
        raise RopeError(f"n must be >= 2, got {n}")
    fresh = fresh or (lambda xs, pos: rotate(xs, pos, rope))
    reference = reference or (lambda xs, pos: rotate(xs, pos, rope))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, rope.head_dim, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)
    old = torch.randint(0, max_pos, (n,), generator=gen, dtype=torch.int64)
    new = torch.randint(0, max_pos, (n,), generator=gen, dtype=torch.int64)
    old[0], new[0], old[1], new[1] = 0, max_pos - 1, max_pos - 1, 0
    x, old, new = x.to(device), old.to(device), new.to(device)

    ref_new = reference(x, new)
    cached_exact = reference(x, old).to(dtype)
    cached_fresh = fresh(x.to(dtype), old)
    out: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."), "max_pos": max_pos, "n": n, "heads": heads, "seed": seed,
        "scaling": rope.scaling_type, "style": rope.style, "rotary_dim": rope.rotary_dim,
        "unit_roundoff": torch.finfo(dtype).eps / 2,
    }
    for name, got in (("shift_exact", shift(cached_exact, old, new, rope)),
                      ("fresh", fresh(x.to(dtype), new)),
                      ("shift_fresh", shift(cached_fresh, old, new, rope))):
        out.update({f"{name}_{k}": v for k, v in _rel_errors(got, ref_new, rope.rotary_dim).items()})
    return out
