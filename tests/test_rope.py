"""kmesh.rope: shifting cached keys equals fresh rotation at the new position.

References are independent of the code under test: a float64 complex-number rotation written here
(pairs as complex numbers times e^{i·p·ω}), and, under the `vllm` marker, vLLM 0.32's own get_rope
tables and forward (its CPU op and forward_native).
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from kmesh.errors import KMeshError
from kmesh.rope import (
    RopeConfig,
    RopeError,
    RopeRangeError,
    apply_rotation,
    measure_accuracy,
    rotate,
    shift,
    shift_tables,
)

MAX32K = 32768
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
LINEAR = {"rope_type": "linear", "factor": 4.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 16384}

# (id, RopeConfig): SmolLM2 / Qwen2 shapes, both pairings, partial rotary, every scaling type;
# all tables reach at least 32k positions.
CONFIGS = {
    "smollm2": RopeConfig(64, 64, 1e5, "neox", None, MAX32K),
    "qwen2": RopeConfig(64, 64, 1e6, "neox", None, MAX32K),
    "gptj": RopeConfig(64, 64, 1e4, "gptj", None, MAX32K),
    "partial-neox": RopeConfig(80, 32, 1e4, "neox", None, MAX32K),
    "partial-gptj": RopeConfig(80, 32, 1e4, "gptj", None, MAX32K),
    "llama3": RopeConfig(128, 128, 5e5, "neox", LLAMA3, MAX32K),
    "yarn": RopeConfig(64, 64, 1e6, "neox", YARN, MAX32K),
    "linear": RopeConfig(64, 64, 1e4, "neox", LINEAR, MAX32K),
    "dynamic": RopeConfig(64, 64, 1e4, "neox", DYNAMIC, MAX32K),
}


def ref_rotate(x: torch.Tensor, pos: torch.Tensor, rope: RopeConfig, mscale: float = 1.0) -> torch.Tensor:
    """float64 rotation through complex numbers: a second code path, not kmesh.rope's."""
    x = x.to(torch.float64)
    rd, half = rope.rotary_dim, rope.rotary_dim // 2
    xr = x[..., :rd]
    if rope.style == "neox":
        z = torch.complex(xr[..., :half], xr[..., half:])
    else:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    angle = pos.to(torch.float64)[:, None] * rope.inv_freq()[None, :]
    z = z * torch.polar(torch.full_like(angle, mscale), angle)[:, None, :]
    out = x.clone()
    if rope.style == "neox":
        out[..., :rd] = torch.cat((z.real, z.imag), dim=-1)
    else:
        out[..., :rd] = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return out


def rel_l2(got: torch.Tensor, ref: torch.Tensor, rd: int) -> torch.Tensor:
    """Per (token, head) relative L2 error over the rotary channels."""
    d = got[..., :rd].to(torch.float64) - ref[..., :rd]
    return d.norm(dim=-1) / ref[..., :rd].norm(dim=-1)


def positions_pair(n: int, max_pos: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, max_pos, (n,), generator=g)
    new = torch.randint(0, max_pos, (n,), generator=g)
    # Always include the longest forward and backward moves, and a zero move.
    old[:3] = torch.tensor([0, max_pos - 1, 77])
    new[:3] = torch.tensor([max_pos - 1, 0, 77])
    return old, new


# --- (a) float64 reference ------------------------------------------------------------------------

def test_inv_freq_default_matches_closed_form():
    rope = CONFIGS["smollm2"]
    i = torch.arange(32, dtype=torch.float64)
    closed = 1e5 ** (-2 * i / 64)
    assert rope.inv_freq().dtype == torch.float64 and rope.inv_freq().shape == (32,)
    # float32 frequency (as vLLM computes it), widened: within float32 rounding of the exact value
    assert torch.allclose(rope.inv_freq(), closed, rtol=3e-7, atol=0)


def test_scaled_inv_freq_shapes_the_way_each_method_says():
    base = RopeConfig(64, 64, 1e4, "neox", None, MAX32K).inv_freq()
    assert torch.equal(CONFIGS["linear"].inv_freq(), base / 4.0)
    # dynamic (vLLM's static NTK form): a larger base -> every frequency but the first slower
    dyn = CONFIGS["dynamic"].inv_freq()
    assert dyn[0] == base[0] and bool((dyn[1:] < base[1:]).all())
    assert torch.equal(RopeConfig(64, 64, 1e4, "neox", {"rope_type": "dynamic", "factor": 2.0}, MAX32K).inv_freq(),
                       base)  # without max_trained_positions vLLM's formula leaves the base unchanged
    # llama3: wavelength < orig/high_freq keeps ω; > orig/low_freq divides it by the factor
    l3, l3_base = CONFIGS["llama3"].inv_freq(), RopeConfig(128, 128, 5e5, "neox", None, MAX32K).inv_freq()
    wavelen = 2 * math.pi / l3_base
    assert torch.equal(l3[wavelen < 8192 / 4], l3_base[wavelen < 8192 / 4])
    assert torch.allclose(l3[wavelen > 8192], l3_base[wavelen > 8192] / 8, rtol=1e-6)
    # yarn: fastest channels extrapolate (unchanged), slowest interpolate (÷ factor)
    y, y_base = CONFIGS["yarn"].inv_freq(), RopeConfig(64, 64, 1e6, "neox", None, MAX32K).inv_freq()
    assert torch.equal(y[:3], y_base[:3])
    assert torch.allclose(y[-3:], y_base[-3:] / 4, rtol=1e-6)


def _f32_ulp(v: float) -> Fraction:
    return Fraction(float(np.spacing(np.float32(v))))


def _exact_yarn(theta32: list[float], s: float, ctx: float, base: float, fast: float, slow: float,
                truncate: bool) -> list[Fraction]:
    """YaRN NTK-by-parts (Peng et al. 2023) in exact rational arithmetic on the float32 base frequencies;
    only the band edges i(r) = d·ln(L/(2πr))/(2·ln b) are float64 (then floored / ceiled when truncating)."""
    d = 2 * len(theta32)
    lo, hi = (d * math.log(ctx / (2 * math.pi * r)) / (2 * math.log(base)) for r in (fast, slow))
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = Fraction(max(lo, 0)), Fraction(min(hi, d - 1))
    out = []
    for i, t in enumerate(theta32):
        g = Fraction(int(i <= lo)) if hi == lo else min(max((hi - i) / (hi - lo), Fraction(0)), Fraction(1))
        out.append(Fraction(t) * g + Fraction(t) / Fraction(s) * (1 - g))
    return out


def _exact_llama31(theta32: list[float], s: float, ctx: float, low: float, high: float) -> list[Fraction]:
    """Llama 3.1's three-band rule (wavelength λ = 2π/θ against L/high and L/low), blended exactly; λ itself
    is float64 (π is not rational)."""
    out = []
    for t in theta32:
        lam = 2 * math.pi / t
        if lam < ctx / high:
            out.append(Fraction(t))
        elif lam > ctx / low:
            out.append(Fraction(t) / Fraction(s))
        else:
            mu = Fraction(ctx / lam - low) / Fraction(high - low) if high != low else Fraction(0)
            out.append((1 - mu) * Fraction(t) / Fraction(s) + mu * Fraction(t))
    return out


SCALED_SWEEP = (
    [("yarn", rd, b, f, L, fast, slow, tr) for rd in (32, 64, 128) for b in (1e4, 1e6) for f in (2.0, 4.0, 40.0)
     for L in (2048, 32768) for fast, slow in ((32, 1), (16, 2)) for tr in (True, False)]
    + [("llama3", rd, b, f, L, lo, hi, None) for rd in (64, 128) for b in (1e4, 5e5) for f in (2.0, 8.0, 3.0)
       for L in (2048, 8192) for lo, hi in ((1.0, 4.0), (0.5, 8.0), (2.0, 2.0))]
)


def test_scaled_inv_freq_is_the_published_formula_rounded_once():
    """llama3 / yarn ω = the float32 nearest to the formula evaluated exactly on the engine's float32 base
    frequencies (an independent rational-arithmetic reference); kept channels equal the base bit for bit."""
    for kind, rd, b, f, L, x, y, tr in SCALED_SWEEP:
        if kind == "yarn":
            sc = {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": L, "beta_fast": x,
                  "beta_slow": y, "truncate": tr}
        else:
            sc = {"rope_type": "llama3", "factor": f, "original_max_position_embeddings": L, "low_freq_factor": x,
                  "high_freq_factor": y}
        got = RopeConfig(rd, rd, b, "neox", sc, 4 * L).inv_freq().tolist()
        base32 = RopeConfig(rd, rd, b, "neox", None, 4 * L).inv_freq().tolist()
        exact = (_exact_yarn(base32, f, L, b, x, y, tr) if kind == "yarn" else _exact_llama31(base32, f, L, x, y))
        assert all(float(np.float32(g)) == g for g in got)  # float32 values
        # nearest float32: within half an ulp, up to our float64 evaluation error (a blend of float32 values
        # and a small-denominator weight can sit on a rounding tie, where float64 decides either way)
        off = [i for i, (g, q) in enumerate(zip(got, exact))
               if abs(Fraction(g) - q) > _f32_ulp(g) / 2 + q * Fraction(1, 2**50)]
        assert not off, (kind, rd, b, f, L, x, y, tr, off)
        assert all(g == t for g, t, q in zip(got, base32, exact) if q == Fraction(t))  # kept channels: bit for bit
        assert got[0] == base32[0] and got[-1] != base32[-1]  # fastest channel kept, slowest scaled


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fresh_rotate_matches_float64_reference(name):
    rope = CONFIGS[name]
    x = torch.randn(64, 3, rope.head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos, _ = positions_pair(64, MAX32K, 2)
    m = rope.attention_mscale()
    assert torch.allclose(rotate(x, pos, rope), ref_rotate(x, pos, rope, m), rtol=0, atol=1e-12)
    err = rel_l2(rotate(x.float(), pos, rope), ref_rotate(x.float(), pos, rope, m), rope.rotary_dim)
    assert float(err.max()) <= 1e-6


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_shift_within_1e5_up_to_32k(name):
    rope = CONFIGS[name]
    n = 512
    x = torch.randn(n, 3, rope.head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    old, new = positions_pair(n, MAX32K, 4)
    assert bool((new < old).any()) and bool((new > old).any())  # backward and forward shifts
    m = rope.attention_mscale()
    cached = ref_rotate(x, old, rope, m).float()
    moved = shift(cached, old, new, rope)
    assert moved.dtype == torch.float32 and moved.shape == cached.shape
    err = rel_l2(moved, ref_rotate(x, new, rope, m), rope.rotary_dim)
    assert float(err.max()) <= 1e-5, f"{name}: max relative error {float(err.max()):.3g} at 32k"
    # non-rotary channels untouched
    assert torch.equal(moved[..., rope.rotary_dim:], cached[..., rope.rotary_dim:])


def test_pairing_matters_neox_vs_gptj():
    """A shift with the wrong pairing is far off: the reference check above can tell them apart."""
    neox, gptj = CONFIGS["gptj"], RopeConfig(64, 64, 1e4, "neox", None, MAX32K)
    x = torch.randn(16, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    old, new = positions_pair(16, 4096, 6)
    cached = ref_rotate(x, old, neox)
    wrong = shift(cached, old, new, gptj)
    assert float(rel_l2(wrong, ref_rotate(x, new, neox), 64)[3:].min()) > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["partial-neox", "partial-gptj"])
def test_non_rotary_channels_bit_identical(name, dtype):
    rope = CONFIGS[name]
    k = torch.randn(32, 2, rope.head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    # special values in the pass-through channels must survive bit for bit
    k[0, 0, rope.rotary_dim:rope.rotary_dim + 4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    before = k.clone()
    old, new = positions_pair(32, MAX32K, 8)
    out = shift(k, old, new, rope)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    assert torch.equal(out[..., rope.rotary_dim:].view(bits), k[..., rope.rotary_dim:].view(bits))
    assert torch.equal(k.view(bits), before.view(bits))  # input not modified
    assert out.data_ptr() != k.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_shift_is_identity(dtype):
    rope = CONFIGS["yarn"]  # mscale must not leak into a shift
    k = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
    pos = torch.tensor([0, 1, 5, 100, 4096, 20000, 32766, 32767])
    assert torch.equal(shift(k, pos, pos, rope), k)


# --- (b) one rotation from the original positions, never chained ----------------------------------

def test_tables_depend_only_on_the_move():
    rope = CONFIGS["qwen2"]
    old, new = positions_pair(64, MAX32K // 2, 10)
    c1, s1 = shift_tables(old, new, rope)
    c2, s2 = shift_tables(old + 16000, new + 16000, rope)
    assert c1.dtype == torch.float32 and c1.shape == (64, 32)
    assert torch.equal(c1, c2) and torch.equal(s1, s2)
    d = (new - old).double()[:, None] * rope.inv_freq()[None, :]
    assert torch.equal(c1, torch.cos(d).float()) and torch.equal(s1, torch.sin(d).float())


def test_shift_equals_direct_rotation_not_a_chain():
    """Moving by d = sum of many small moves: one rotation by d stays at fp32 rounding; chaining the
    small moves accumulates error ~100x larger. The shift must be the former."""
    rope = CONFIGS["smollm2"]
    x = torch.randn(4, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    old = torch.tensor([0, 10, 1000, 30000])
    steps = 400
    new = old + steps
    cached = ref_rotate(x, old, rope).float()
    ref = ref_rotate(x, new, rope)
    direct = shift(cached, old, new, rope)
    chained, cur = cached, old
    for _ in range(steps):
        chained = shift(chained, cur, cur + 1, rope)
        cur = cur + 1
    assert torch.equal(cur, new)
    direct_err = float(rel_l2(direct, ref, 64).max())
    chained_err = float(rel_l2(chained, ref, 64).max())
    assert direct_err <= 3e-7
    assert chained_err > 10 * direct_err


def test_float64_angles_are_needed_at_32k():
    """The same shift with angles formed in float32 (new·ω - old·ω) breaks the 1e-5 bound at 32k,
    so the bound above really tests the float64 angle path."""
    rope = CONFIGS["smollm2"]
    x = torch.randn(64, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    old, new = positions_pair(64, MAX32K, 13)
    cached = ref_rotate(x, old, rope).float()
    w = rope.inv_freq().float()
    angle32 = new.float()[:, None] * w - old.float()[:, None] * w
    naive = apply_rotation(cached, torch.cos(angle32), torch.sin(angle32), rope)
    ref = ref_rotate(x, new, rope)
    assert float(rel_l2(naive, ref, 64).max()) > 1e-4
    assert float(rel_l2(shift(cached, old, new, rope), ref, 64).max()) <= 1e-6


def test_round_trip_returns_the_key():
    rope = CONFIGS["llama3"]
    k = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(14))
    old, new = positions_pair(32, MAX32K, 15)
    back = shift(shift(k, old, new, rope), new, old, rope)
    assert float(rel_l2(back, k.double(), 128).max()) <= 1e-6


# --- yarn mscale trap ------------------------------------------------------------------------------

def test_yarn_mscale_is_not_applied_by_shift():
    rope = CONFIGS["yarn"]
    m = rope.attention_mscale()
    assert m == pytest.approx(0.1 * math.log(4.0) + 1.0)  # ~1.139 for factor 4
    assert CONFIGS["qwen2"].attention_mscale() == 1.0
    x = torch.randn(64, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(16))
    old, new = positions_pair(64, MAX32K, 17)
    cached = ref_rotate(x, old, rope, m).float()  # engine-made key: carries mscale once
    ref = ref_rotate(x, new, rope, m)
    ours = shift(cached, old, new, rope)
    assert float(rel_l2(ours, ref, 64).max()) <= 1e-5
    # shift is a pure rotation: norms preserved
    assert torch.allclose(ours.double().norm(dim=-1), cached.double().norm(dim=-1), rtol=1e-6)
    # re-using an mscale-carrying table for the move applies mscale twice: a ~14% error
    c, s = shift_tables(old, new, rope)
    trap = apply_rotation(cached, c * m, s * m, rope)
    trap_err = rel_l2(trap, ref, 64)
    assert 0.13 < float(trap_err.min()) and float(trap_err.max()) < 0.15


# --- (c) errors ------------------------------------------------------------------------------------

def test_positions_out_of_range():
    rope = CONFIGS["smollm2"]
    k = torch.zeros(2, 1, 64)
    ok = torch.tensor([0, MAX32K - 1])
    for bad in (torch.tensor([0, MAX32K]), torch.tensor([-1, 5])):
        with pytest.raises(RopeRangeError, match="outside"):
            shift(k, bad, ok, rope)
        with pytest.raises(RopeRangeError):
            shift(k, ok, bad, rope)
        with pytest.raises(RopeRangeError):
            rotate(k, bad, rope)
    assert issubclass(RopeRangeError, RopeError) and issubclass(RopeError, KMeshError)


def test_bad_shapes_and_types():
    rope = CONFIGS["partial-neox"]
    k = torch.zeros(3, 2, 80)
    p3 = torch.tensor([0, 1, 2])
    cases = [
        lambda: shift(k, p3, torch.tensor([0, 1]), rope),               # length mismatch
        lambda: shift(k[:2], p3, p3, rope),                             # tokens vs positions
        lambda: shift(torch.zeros(3, 2, 64), p3, p3, rope),             # wrong head_dim
        lambda: shift(torch.zeros(80), p3, p3, rope),                   # no token axis
        lambda: shift(k.to(torch.uint8), p3, p3, rope),                 # raw bytes (fp8 storage)
        lambda: shift(k, p3.float(), p3, rope),                         # float positions
        lambda: shift(k, p3[None], p3[None], rope),                     # 2-D positions
        lambda: apply_rotation(k, torch.ones(3, 15), torch.zeros(3, 16), rope),
        lambda: apply_rotation(k, torch.ones(3, 16), torch.zeros(3, 16, device="meta"), rope),
        lambda: rotate(k, torch.tensor([0, 1]), rope),
    ]
    for i, bad in enumerate(cases):
        with pytest.raises(RopeError):
            bad()
            pytest.fail(f"case {i} did not raise")
    assert torch.equal(k, torch.zeros(3, 2, 80))


@pytest.mark.parametrize("kwargs", [
    dict(head_dim=64, rotary_dim=63, theta=1e4, style="neox", scaling=None, max_position=10),
    dict(head_dim=64, rotary_dim=128, theta=1e4, style="neox", scaling=None, max_position=10),
    dict(head_dim=64, rotary_dim=64, theta=1e4, style="rot", scaling=None, max_position=10),
    dict(head_dim=64, rotary_dim=64, theta=1e4, style="neox", scaling=None, max_position=0),
    dict(head_dim=64, rotary_dim=64, theta=0.5, style="neox", scaling=None, max_position=10),
    dict(head_dim=64, rotary_dim=64, theta=1e4, style="neox", scaling={"rope_type": "longrope"}, max_position=10),
    dict(head_dim=64, rotary_dim=64, theta=1e4, style="neox", scaling={"rope_type": "yarn", "factor": 4.0},
         max_position=10),
    dict(head_dim=64, rotary_dim=64, theta=1e4, style="neox", scaling={"rope_type": "linear", "factor": -1.0},
         max_position=10),
    dict(head_dim=64, rotary_dim=64, theta=1e4, style="neox", max_position=10,
         scaling={**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
])
def test_bad_config(kwargs):
    with pytest.raises(RopeError):
        RopeConfig(**kwargs)


# --- HF config reading -----------------------------------------------------------------------------

def test_from_hf_config_dicts():
    smol = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000.0,
            "max_position_embeddings": 8192, "rope_scaling": None}
    assert RopeConfig.from_hf_config(smol) == RopeConfig(64, 64, 1e5, "neox", None, 8192)
    qwen_yarn = {"hidden_size": 896, "num_attention_heads": 14, "max_position_embeddings": 32768,
                 "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768}}
    r = RopeConfig.from_hf_config(qwen_yarn)
    assert (r.head_dim, r.rotary_dim, r.theta, r.max_position, r.scaling_type) == (64, 64, 1e6, 131072, "yarn")
    legacy_linear = {"head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 1e4,
                     "max_position_embeddings": 4096, "partial_rotary_factor": 0.5,
                     "rope_scaling": {"type": "linear", "factor": 2.0}}
    r = RopeConfig.from_hf_config(legacy_linear)
    assert (r.head_dim, r.rotary_dim, r.max_position, r.scaling) == (128, 64, 8192, {"rope_type": "linear", "factor": 2.0})
    with pytest.raises(RopeError):
        RopeConfig.from_hf_config({"hidden_size": 64, "num_attention_heads": 1})  # no max_position_embeddings


def test_measure_accuracy_reports_what_it_measures():
    rope = CONFIGS["qwen2"]
    r32 = measure_accuracy(rope, torch.float32, MAX32K, 256, seed=0)
    assert r32["shift_exact_max_rel_l2"] <= 1e-5 and r32["shift_fresh_max_rel_l2"] <= 1e-5
    r16 = measure_accuracy(rope, torch.bfloat16, MAX32K, 256, seed=0)
    # bf16 errors are rounding-sized: within a few unit roundoffs, far above fp32's
    u = r16["unit_roundoff"]
    assert 100 * r32["shift_exact_max_rel_l2"] < r16["shift_exact_max_rel_l2"] <= 2 * u
    assert r16["shift_fresh_max_rel_l2"] <= r16["fresh_max_rel_l2"] + u
    # a fresh rotation that is wrong shows up in the numbers (the measurement can fail)
    bad = measure_accuracy(rope, torch.float32, MAX32K, 64, seed=0,
                           fresh=lambda x, p: rotate(x, torch.clamp(p + 1, max=MAX32K - 1), rope))
    assert bad["fresh_max_rel_l2"] > 1e-3
    with pytest.raises(RopeRangeError):
        measure_accuracy(rope, torch.float32, MAX32K + 1, 8, seed=0)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    rope = CONFIGS["partial-gptj"]
    k = torch.randn(64, 2, 80, generator=torch.Generator().manual_seed(18))
    old, new = positions_pair(64, MAX32K, 19)
    cpu = shift(k, old, new, rope)
    gpu = shift(k.cuda(), old.cuda(), new.cuda(), rope)
    assert gpu.device.type == "cuda"
    assert torch.allclose(gpu.cpu(), cpu, rtol=0, atol=1e-6)
    assert torch.equal(gpu.cpu()[..., 32:], k[..., 32:])
    r = measure_accuracy(rope, torch.bfloat16, MAX32K, 128, seed=0, device="cuda")
    assert r["shift_exact_max_rel_l2"] <= 2 * r["unit_roundoff"]


# --- (d) against vLLM 0.32's own rotary embedding ---------------------------------------------------
# HF-shaped configs (transformers-5 `rope_parameters`), fed unchanged to RopeConfig.from_hf_config and,
# as the Llama/Qwen2 model code does, to vLLM's get_rope(head_dim, max_position_embeddings, ...).

def _hf(hidden: int, heads: int, max_pos: int, **rope_parameters) -> dict:
    return {"hidden_size": hidden, "num_attention_heads": heads, "max_position_embeddings": max_pos,
            "rope_parameters": rope_parameters}


VLLM_CASES = {
    "smollm2": (_hf(576, 9, 8192, rope_theta=1e5, rope_type="default"), True),
    "qwen2.5": (_hf(896, 14, 32768, rope_theta=1e6, rope_type="default"), True),
    "llama3.1": (_hf(4096, 32, 131072, rope_theta=5e5, **LLAMA3), True),
    "qwen2-yarn": (_hf(896, 14, 32768, rope_theta=1e6, rope_type="yarn", factor=4.0,
                       original_max_position_embeddings=32768), True),
    "linear": (_hf(2048, 32, 8192, rope_theta=1e4, rope_type="linear", factor=4.0), True),
    "dynamic": (_hf(2048, 32, 32768, rope_theta=1e4, rope_type="dynamic", factor=2.0,
                    max_trained_positions=16384), True),
    "partial-gptj": (_hf(1280, 16, 32768, rope_theta=1e4, rope_type="default", partial_rotary_factor=0.5), False),
}


@pytest.fixture(scope="module")
def vllm_get_rope():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        yield get_rope


def _pair(name: str, get_rope, dtype=torch.float32):
    import dataclasses

    cfg, neox = VLLM_CASES[name]
    rope = RopeConfig.from_hf_config(cfg)
    if not neox:
        rope = dataclasses.replace(rope, style="gptj")
    theirs = get_rope(rope.head_dim, max_position=cfg["max_position_embeddings"], is_neox_style=neox,
                      rope_parameters=cfg["rope_parameters"], dtype=dtype)
    return rope, theirs


def _vllm_fresh(theirs, path: str):
    """vLLM's fresh rotation of keys x [T, H, D]: the dispatched CPU op, or forward_native."""
    def fresh(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        q, k = x.reshape(t, h * d).clone(), x.reshape(t, h * d).clone()
        fn = theirs if path == "cpu_op" else theirs.forward_native
        _, k = fn(pos, q, k)
        return k.reshape(t, h, d)
    return fresh


def _angle_bound(rope: RopeConfig, pos: torch.Tensor) -> torch.Tensor:
    # vLLM forms angles in float32: |error| <= 2^-24·p·ω per rounding (two roundings for linear's p/f);
    # a rotation error δ moves a vector by |δ| relative.
    return (2.0 ** -23 * pos.double() * float(rope.inv_freq().max()) + 2e-6)[:, None]


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(VLLM_CASES))
def test_tables_match_vllm(name, vllm_get_rope):
    rope, theirs = _pair(name, vllm_get_rope)
    cache = theirs.cos_sin_cache
    assert rope.max_position == cache.shape[0]
    assert rope.attention_mscale() == pytest.approx(getattr(theirs, "mscale", 1.0), rel=1e-12)
    half = rope.rotary_dim // 2
    rows = torch.cat([torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(20))[:2048],
                      torch.arange(cache.shape[0] - 8, cache.shape[0])])
    # vLLM's float32 angle, re-formed from OUR frequencies: matches to cos/sin rounding only if our
    # float32 frequencies equal vLLM's bit for bit (one ulp off moves angle ~1e5 by ~1e-2).
    w = rope.inv_freq()
    if rope.scaling_type == "linear":
        f = rope.scaling["factor"]
        angle32 = (rows.float() / f)[:, None] * (w * f).float()[None, :]
    else:
        angle32 = rows.float()[:, None] * w.float()[None, :]
    slack = torch.zeros_like(angle32, dtype=torch.float64)
    if rope.scaling_type in ("llama3", "yarn"):
        # Not bit for bit here, by design: kmesh.rope forms the llama3/yarn blend in float64 from the published
        # formulas and rounds once; vLLM's float32 chain (its own operation order, which we do not copy) can
        # land one float32 ulp away on blended channels. Allowed: <= 1 ulp per channel, and in the table
        # exactly the angle difference that ulp makes through vLLM's float32 angle formation.
        theirs_w = theirs._compute_inv_freq(theirs.scaling_factor if rope.scaling_type == "yarn" else theirs.base)
        ulps = (w.float().view(torch.int32).long() - theirs_w.float().view(torch.int32).long()).abs()
        assert int(ulps.max()) <= 1, ulps.tolist()
        assert int((ulps == 0).sum()) >= half - 4, ulps.tolist()  # kept / pure-interpolation channels: exact
        slack = (angle32.double() - (rows.float()[:, None] * theirs_w.float()[None, :]).double()).abs()
    m = rope.attention_mscale()
    a = angle32.double()
    assert bool(((cache[rows, :half].double() - torch.cos(a) * m).abs() <= 3e-7 + slack * m).all())
    assert bool(((cache[rows, half:].double() - torch.sin(a) * m).abs() <= 3e-7 + slack * m).all())


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(VLLM_CASES))
def test_fresh_rotation_matches_vllm_fp32(name, vllm_get_rope, record_property):
    rope, theirs = _pair(name, vllm_get_rope)
    n = 256
    top = min(rope.max_position, MAX32K)
    x = torch.randn(n, 2, rope.head_dim, generator=torch.Generator().manual_seed(21))
    pos, _ = positions_pair(n, top, 22)
    ref = ref_rotate(x, pos, rope, rope.attention_mscale())
    ours = rotate(x, pos, rope)
    for path in ("cpu_op", "native"):
        got = _vllm_fresh(theirs, path)(x, pos)
        assert torch.equal(got[..., rope.rotary_dim:], x[..., rope.rotary_dim:])
        assert bool((rel_l2(got, ours.double(), rope.rotary_dim) <= _angle_bound(rope, pos)).all()), path
        record_property(f"vllm_{path}_fp32_max_rel_l2", float(rel_l2(got, ref, rope.rotary_dim).max()))
    ours_err = float(rel_l2(ours, ref, rope.rotary_dim).max())
    assert ours_err <= 1e-5
    record_property("ours_fp32_fresh_max_rel_l2", ours_err)


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(VLLM_CASES))
def test_bf16_shift_no_worse_than_vllm_fresh_bf16(name, vllm_get_rope, record_property):
    rope, theirs = _pair(name, vllm_get_rope, torch.bfloat16)
    top = min(rope.max_position, MAX32K)
    r32 = measure_accuracy(rope, torch.float32, top, 512, seed=23)
    assert r32["shift_exact_max_rel_l2"] <= 1e-5 and r32["shift_fresh_max_rel_l2"] <= 1e-5
    lines = [f"{name}: fp32 shift max rel {r32['shift_exact_max_rel_l2']:.2e}"]
    record_property("fp32_shift_max_rel_l2", r32["shift_exact_max_rel_l2"])
    for path in ("cpu_op", "native"):
        r = measure_accuracy(rope, torch.bfloat16, top, 512, seed=23, fresh=_vllm_fresh(theirs, path))
        u = r["unit_roundoff"]  # one bf16 rounding, relative: the 1-ulp-level allowance
        # keys cached by vLLM's own bf16 rotation at the old positions, then shifted by us
        assert r["shift_fresh_max_rel_l2"] <= r["fresh_max_rel_l2"] + u
        assert r["shift_fresh_mean_rel_l2"] <= r["fresh_mean_rel_l2"] + u
        # keys rounded once from an exact rotation, then shifted by us
        assert r["shift_exact_max_rel_l2"] <= r["fresh_max_rel_l2"] + u
        for k in ("fresh_max_rel_l2", "shift_fresh_max_rel_l2", "shift_exact_max_rel_l2", "fresh_mean_rel_l2",
                  "shift_fresh_mean_rel_l2"):
            record_property(f"bf16_{path}_{k}", r[k])
        lines.append(f"bf16 [{path}] vLLM fresh {r['fresh_max_rel_l2']:.2e} (mean {r['fresh_mean_rel_l2']:.2e}); "
                     f"our shift of vLLM keys {r['shift_fresh_max_rel_l2']:.2e} "
                     f"(mean {r['shift_fresh_mean_rel_l2']:.2e}); of exact keys {r['shift_exact_max_rel_l2']:.2e}")
    print("\n  ".join(lines))


@pytest.mark.vllm
def test_yarn_mscale_trap_against_vllm(vllm_get_rope):
    """Keys cached by vLLM's yarn rotation carry mscale; moving them with vLLM's own cos/sin cache
    row for the move applies it twice (~14% off); our shift matches vLLM's fresh rotation."""
    rope, theirs = _pair("qwen2-yarn", vllm_get_rope)
    assert theirs.mscale == pytest.approx(1 + 0.1 * math.log(4.0))
    n = 256
    x = torch.randn(n, 2, rope.head_dim, generator=torch.Generator().manual_seed(24))
    old, new = positions_pair(n, MAX32K, 25)
    fresh = _vllm_fresh(theirs, "cpu_op")
    cached, want = fresh(x, old), fresh(x, new)
    ours = shift(cached, old, new, rope)
    assert bool((rel_l2(ours, want.double(), 64) <= _angle_bound(rope, old) + _angle_bound(rope, new)).all())
    fwd = new > old
    cos_sin = theirs.cos_sin_cache[(new - old)[fwd]]
    naive = apply_rotation(cached[fwd], cos_sin[:, :32], cos_sin[:, 32:], rope)
    err = rel_l2(naive, want[fwd].double(), 64)
    assert 0.13 < float(err.min()) and float(err.max()) < 0.15


@pytest.mark.vllm
def test_from_transformers_config_objects(vllm_get_rope):
    from transformers import LlamaConfig, Qwen2Config

    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5,
                       max_position_embeddings=8192)
    assert RopeConfig.from_hf_config(smol) == RopeConfig(64, 64, 1e5, "neox", None, 8192)
    qwen = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                       rope_theta=1e6)
    r = RopeConfig.from_hf_config(qwen)
    theirs = vllm_get_rope(64, max_position=qwen.max_position_embeddings, rope_parameters=qwen.rope_parameters,
                           dtype=torch.float32)
    assert (r.theta, r.scaling_type, r.max_position) == (1e6, "yarn", theirs.cos_sin_cache.shape[0])
    assert r.attention_mscale() == pytest.approx(theirs.mscale)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_equals_dequantize_rotate_requantize(fp8):
    rope = CONFIGS["partial-neox"]
    limit = torch.finfo(fp8).max
    real = torch.randn(256, 2, 80, generator=torch.Generator().manual_seed(26)) * 3
    old, new = positions_pair(256, MAX32K, 27)

    def quant(v: torch.Tensor, scale: float) -> torch.Tensor:
        return (v / scale).clamp(-limit, limit).to(fp8)

    for scale, exact in ((2.0 ** -6, True), (float(real.abs().max()) / limit, False)):
        q = quant(real, scale)
        via_fp32 = quant(shift(q.float() * scale, old, new, rope), scale)
        direct = shift(q, old, new, rope)
        assert direct.dtype == fp8
        a, b = direct.float(), via_fp32.float()
        assert not bool(a.isnan().any() or a.isinf().any())
        if exact:
            assert torch.equal(direct.view(torch.uint8), via_fp32.view(torch.uint8))
        else:  # double rounding through the scale may flip a tie: rare, and one fp8 step at most
            differ = a != b
            assert float(differ.float().mean()) < 1e-3
            fi = torch.finfo(fp8)
            step = torch.maximum(a.abs(), b.abs()).clamp(min=fi.tiny) * fi.eps  # one step, subnormals too
            assert bool(((a - b).abs() <= step)[differ].all())
        assert torch.equal(direct[..., 32:].view(torch.uint8), q[..., 32:].view(torch.uint8))
    # a pair at the format's limit, turned by 1 rad, grows past it (cos 1 + sin 1 ≈ 1.38): saturate
    k = torch.zeros(1, 1, 80, dtype=fp8)
    k[0, 0, 0] = k[0, 0, 16] = limit
    out = shift(k, torch.tensor([5]), torch.tensor([6]), rope).float()
    assert out[0, 0, 16] == limit and torch.isfinite(out).all()
