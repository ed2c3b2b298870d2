"""kmesh.kv.rope: shifting cached keys equals fresh rotation at the new position.

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
from kmesh.kv.rope import (RopeConfig, RopeError, RopeRangeError, apply_rotation, measure_accuracy, rotate, shift,
                           shift_tables)

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
    """float64 rotation through complex numbers: a second code path, not kmesh.kv.rope's."""
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
    assert ((r.head_dim, r.rotary_dim, r.max_position, r.scaling)
            == (128, 64, 8192, {"rope_type": "linear", "factor": 2.0}))
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
        # Not bit for bit here, by design: kmesh.kv.rope forms the llama3/yarn blend in float64 from the published
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


# --- settings decide the rotation: each checked against kmesh.reference.rotary or by hand ----------------
# Every RopeConfig below is built inside its test (not at import), so the frequencies, mscale and guards are
# computed while the test runs.

from types import SimpleNamespace  # noqa: E402

from kmesh.reference import rotary as refrot  # noqa: E402

L2K = 2048  # a yarn context where the default beta_fast (32, not 33) moves the band edge: floor 8.06 vs 7.96
FREQ_CASES = [
    (64, 1e4, None), (16, 1e4, None), (128, 5e5, None), (32, 1e6, None),
    (64, 1e4, {"rope_type": "linear", "factor": 4.0}), (64, 1e4, {"rope_type": "linear", "factor": 0.5}),
    (128, 5e5, dict(LLAMA3)), (64, 1e4, {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}),
    # yarn with the defaults (beta_fast 32, beta_slow 1, truncate on) left to the code
    (64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L2K}),
    (64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L2K, "truncate": False}),
    (64, 1e4, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": L2K, "beta_fast": 16,
               "beta_slow": 2}),
    # short original context: i(beta_fast) < 1, the band starts at channel 0
    (64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
    # slow base: the band [5.7, 17.7] is wider than the channels and clipped at d - 1 = 15 (not d/2 - 1)
    (16, 10.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    # L < 2π: both edges clip to channel 0, a zero-width band (a step: channel 0 kept, the rest interpolated)
    (64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6}),
    (64, 1e4, {"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 16384}),
    (64, 1e4, {"rope_type": "dynamic", "factor": 2.0}),
]


def test_frequencies_equal_the_independent_reference_for_every_setting():
    for rd, theta, sc in FREQ_CASES:
        rope = RopeConfig(rd + 16, rd, theta, "neox", None if sc is None else dict(sc), MAX32K)
        want = refrot.frequencies(rd, theta, sc, MAX32K)
        got = rope.inv_freq()
        assert got.dtype == torch.float64 and got.shape == (rd // 2,), (rd, theta, sc)
        # dynamic's base b' is not a float32, and torch's float32 pow is not correctly rounded: 1 ulp allowed
        allowed = 1 if sc and sc["rope_type"] == "dynamic" else 0
        assert refrot.ulp_distance_f32(got, want) <= allowed, (rd, theta, sc)
    # the base rule by hand for one channel: ω_1 = 1 / 10000^(2/16), float32
    assert RopeConfig(16, 16, 1e4, "neox", None, 8).inv_freq()[1] == float(np.float32(1 / 1e4 ** (2 / 16)))
    # inv_freq() is a copy: writing to it does not change the config's rotation
    rope = RopeConfig(64, 64, 1e4, "neox", None, MAX32K)
    rope.inv_freq().zero_()
    assert torch.equal(rope.inv_freq(), refrot.frequencies(64, 1e4))


def test_scaled_frequencies_sit_where_each_method_puts_them():
    """Hand-checked band placement, independent of both implementations' arithmetic."""
    d = 64
    base = torch.tensor(refrot.base_frequencies(d, 1e4), dtype=torch.float64)
    f32 = lambda t: t.float().double()  # noqa: E731
    yarn = lambda L, **kw: RopeConfig(d, d, 1e4, "neox", {"rope_type": "yarn", "factor": 4.0,  # noqa: E731
                                                          "original_max_position_embeddings": L, **kw}, MAX32K)
    # L = 2048: i(32) = 8.06, i(1) = 20.1 -> band [8, 21]: channels <= 8 kept, >= 21 divided by 4, linear between
    w = yarn(L2K).inv_freq()
    assert torch.equal(w[:9], base[:9]) and torch.equal(w[21:], f32(base[21:] / 4))
    g = (21 - torch.arange(9, 21, dtype=torch.float64)) / 13
    assert torch.equal(w[9:21], f32(base[9:21] * g + base[9:21] / 4 * (1 - g)))
    # truncate=False keeps the fractional edges i(32) = 8.06, i(1) = 20.1
    lo, hi = (d * math.log(L2K / (2 * math.pi * r)) / (2 * math.log(1e4)) for r in (32, 1))
    g = ((hi - torch.arange(32, dtype=torch.float64)) / (hi - lo)).clamp(0, 1)
    assert torch.allclose(yarn(L2K, truncate=False).inv_freq(), base * g + base / 4 * (1 - g), rtol=1e-7, atol=0)
    # L = 6 < 2π: zero-width band at channel 0
    w = yarn(6).inv_freq()
    assert w[0] == base[0] and torch.equal(w[1:], f32(base[1:] / 4))
    # the clipped band: i(32) = 5.66 -> 5, i(1) = 17.7 -> 18, clipped to 15: γ_i = (15 - i) / 10 from channel 5
    b10 = torch.tensor(refrot.base_frequencies(16, 10.0), dtype=torch.float64)
    w = RopeConfig(16, 16, 10.0, "neox", {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 1024}, 4096).inv_freq()
    g = (15 - torch.arange(5, 8, dtype=torch.float64)) / 10
    assert torch.equal(w[:6], b10[:6]) and torch.equal(w[5:], f32(b10[5:] * g + b10[5:] / 4 * (1 - g)))
    # linear: every channel divided by the factor, exactly
    assert torch.equal(RopeConfig(d, d, 1e4, "neox", {"rope_type": "linear", "factor": 0.5}, 8).inv_freq(), base * 2)


def test_llama3_step_counts_a_channel_on_the_edge_as_low_frequency():
    """low == high: a step at r = high turns; a channel making exactly `high` turns is interpolated (÷ factor)."""
    base = refrot.base_frequencies(16, 1e4)
    L = 397.3835052149487  # chosen so that channel 3 makes exactly 2 turns over L
    assert base[3] * (L / (2 * math.pi)) == 2.0
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
          "original_max_position_embeddings": L}
    w = RopeConfig(16, 16, 1e4, "neox", sc, 1024).inv_freq().tolist()
    assert w[:3] == base[:3]
    assert w[3:] == [float(np.float32(t / 8)) for t in base[3:]]


def test_attention_mscale_by_hand():
    def m(sc):
        return RopeConfig(64, 64, 1e4, "neox", sc, MAX32K).attention_mscale()
    y = {"rope_type": "yarn", "original_max_position_embeddings": 4096}
    assert m({**y, "factor": 4.0}) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert m({**y, "factor": 1.5}) == pytest.approx(0.1 * math.log(1.5) + 1)  # any extension > 1, not only > 2
    assert m({**y, "factor": 0.5}) == 1.0  # not extended: no temperature change
    assert m({**y, "factor": 4.0, "attention_factor": 2.0}) == 2.0  # explicit value wins
    # DeepSeek: ratio of two temperatures (0.1·m·ln s + 1) / (0.1·m_all·ln s + 1)
    ds = {**y, "factor": 40.0, "mscale": 0.8, "mscale_all_dim": 0.5}
    assert m(ds) == pytest.approx((0.08 * math.log(40) + 1) / (0.05 * math.log(40) + 1))
    assert m(ds) == pytest.approx(refrot.attention_factor(ds))
    assert m({**y, "factor": 40.0, "mscale": 0.707}) == pytest.approx(0.1 * math.log(40) + 1)  # one alone: plain
    assert m({**y, "factor": 40.0, "mscale_all_dim": 0.707}) == pytest.approx(0.1 * math.log(40) + 1)
    for sc in (None, {"rope_type": "linear", "factor": 4.0}, dict(LLAMA3), {"rope_type": "dynamic", "factor": 2.0}):
        assert m(sc) == 1.0, sc


def test_fresh_rotation_carries_the_attention_factor_once():
    """rotate = m·z·e^{ipω} (reference); with m = 2 the norm doubles; shift of such keys never rescales."""
    for sc in ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L2K},
               {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L2K, "attention_factor": 2.0}):
        rope = RopeConfig(64, 64, 1e4, "neox", sc, 8192)
        x = torch.randn(16, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(40))
        pos, new = positions_pair(16, 8192, 41)
        fresh = rotate(x, pos, rope)
        assert torch.allclose(fresh, refrot.fresh_rotation(x, pos, rope), rtol=0, atol=1e-12)
        m = refrot.attention_factor(sc)
        assert torch.allclose(fresh.norm(dim=-1), m * x.norm(dim=-1), rtol=1e-12)
        moved = shift(fresh, pos, new, rope)  # float32 tables: float32-sized error, and no second factor
        assert float(rel_l2(moved, refrot.fresh_rotation(x, new, rope), 64).max()) < 1e-6


def _f32_rotation(x: np.ndarray, c: np.ndarray, s: np.ndarray, style: str, rd: int) -> np.ndarray:
    """Each product and sum rounded to float32 (numpy float32 arithmetic), pairs as the style says."""
    half = rd // 2
    xr = x[..., :rd]
    x1, x2 = (xr[..., :half], xr[..., half:]) if style == "neox" else (xr[..., 0::2], xr[..., 1::2])
    c, s = c[:, None, :], s[:, None, :]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = x.copy()
    if style == "neox":
        out[..., :half], out[..., half:rd] = o1, o2
    else:
        out[..., 0:rd:2], out[..., 1:rd:2] = o1, o2
    return out


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_float32_keys_rotate_in_float32_and_float64_keys_in_float64(style):
    """The documented arithmetic: float32 math (bit-exact against numpy float32) unless a float64 is involved."""
    rope = RopeConfig(40, 32, 1e4, style, None, MAX32K)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(8, 3, 40, generator=g)
    ang = torch.rand(8, 16, generator=g, dtype=torch.float64) * 6
    c, s = torch.cos(ang).float(), torch.sin(ang).float()
    want = _f32_rotation(x.numpy(), c.numpy(), s.numpy(), style, 32)
    assert np.array_equal(apply_rotation(x, c, s, rope).numpy(), want)
    # rotate: float32 tables f32(cos(p·ω)) from the reference ω, then float32 math
    pos = torch.tensor([0, 1, 7, 100, 1000, 5000, 20000, MAX32K - 1])
    a = pos.double()[:, None] * refrot.frequencies(32, 1e4)[None, :]
    want = _f32_rotation(x.numpy(), torch.cos(a).float().numpy(), torch.sin(a).float().numpy(), style, 32)
    assert np.array_equal(rotate(x, pos, rope).numpy(), want)
    # float64 keys with float32 tables: float64 math throughout
    x64 = x.double() / 3
    want64 = _f32_rotation(x64.numpy(), c.double().numpy(), s.double().numpy(), style, 32)
    assert np.array_equal(apply_rotation(x64, c, s, rope).numpy(), want64)
    # float32 keys with float64 tables: float64 math, then one rounding to float32
    want = _f32_rotation(x.double().numpy(), c.double().numpy(), s.double().numpy(), style, 32).astype(np.float32)
    got = apply_rotation(x, c.double(), s.double(), rope)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


def test_shift_tables_are_float32_cos_sin_of_the_move():
    rope = RopeConfig(64, 64, 1e6, "neox", {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": L2K}, 8192)
    old = torch.tensor([0, 8191, 5, 300], dtype=torch.int32)  # int32 positions: the move is formed in int64
    new = torch.tensor([8191, 0, 5, 17], dtype=torch.int32)
    c, s = shift_tables(old, new, rope)
    a = torch.tensor([8191.0, -8191.0, 0.0, -283.0], dtype=torch.float64)[:, None] * refrot.frequencies(
        64, 1e6, rope.scaling)[None, :]
    assert c.dtype == s.dtype == torch.float32 and c.shape == s.shape == (4, 32)
    assert torch.equal(c, torch.cos(a).float()) and torch.equal(s, torch.sin(a).float())  # no mscale in a move


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_shift_matches_reference_for_any_key_rank(style):
    """[T, D], [T, H, D] with T != H, [T, L, H, D]: one rotation per token, broadcast over the rest."""
    rope = RopeConfig(48, 32, 1e4, style, {"rope_type": "linear", "factor": 2.0}, 8192)
    g = torch.Generator().manual_seed(43)
    old, new = positions_pair(6, 8192, 44)
    for shape in ((6, 48), (6, 2, 48), (6, 3, 2, 48)):
        x = torch.randn(*shape, dtype=torch.float64, generator=g)
        cached = refrot.fresh_rotation(x, old, rope)
        got = shift(cached, old, new, rope)
        assert got.shape == x.shape and torch.equal(got[..., 32:], x[..., 32:])
        assert float(rel_l2(got, refrot.fresh_rotation(x, new, rope), 32).max()) < 1e-6, shape  # float32 tables
        assert torch.allclose(rotate(x, new, rope), refrot.fresh_rotation(x, new, rope), rtol=0, atol=1e-12)
    # no tokens: nothing to do, and no error
    empty = torch.zeros(0, dtype=torch.int64)
    assert shift(torch.zeros(0, 2, 48), empty, empty, rope).shape == (0, 2, 48)


def test_bad_positions_and_tables_are_refused_and_named():
    rope = RopeConfig(64, 64, 1e4, "neox", None, 100)
    k = torch.zeros(1, 1, 64)
    ok = torch.tensor([99])
    with pytest.raises(RopeRangeError, match=r"^old_pos holds position 100\b"):  # a single token is checked too
        shift(k, torch.tensor([100]), ok, rope)
    with pytest.raises(RopeRangeError, match=r"^new_pos holds position -1\b"):
        shift(k, ok, torch.tensor([-1]), rope)
    two = torch.zeros(2, 1, 64)
    with pytest.raises(RopeRangeError, match=r"^new_pos holds position -3\b"):  # the offending one is named
        shift(two, torch.tensor([0, 1]), torch.tensor([0, -3]), rope)
    with pytest.raises(RopeRangeError, match=r"^new_pos holds position 100\b"):
        shift(two, torch.tensor([0, 1]), torch.tensor([0, 100]), rope)
    with pytest.raises(RopeRangeError, match=r"^positions holds position 100\b"):
        rotate(k, torch.tensor([100]), rope)
    with pytest.raises(RopeError):
        shift(k, torch.tensor([True]), ok, rope)  # bool is not a position
    with pytest.raises(RopeError):
        rotate(torch.tensor(1.0), ok, rope)  # no token axis
    x = torch.zeros(4, 2, 64)
    c = torch.ones(4, 32)
    with pytest.raises(RopeError):
        apply_rotation(x, c, torch.zeros(32, 4), rope)  # sin transposed: same size, wrong layout
    with pytest.raises(RopeError):
        apply_rotation(x, torch.zeros(32, 4), c, rope)
    with pytest.raises(RopeError):
        apply_rotation(x, c, [0.0] * 4, rope)
    with pytest.raises(RopeError):
        apply_rotation(x, [0.0] * 4, c, rope)


def test_fp8_saturates_both_signs():
    """A pair at ∓limit turned by 1 rad: the growing component (≈ ±1.38·limit) saturates to ±limit."""
    rope = RopeConfig(32, 32, 1e4, "neox", None, 16)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(fp8).max
        for sign in (1.0, -1.0):
            k = torch.zeros(1, 1, 32, dtype=fp8)
            k[0, 0, 0] = k[0, 0, 16] = sign * limit
            out = shift(k, torch.tensor([5]), torch.tensor([6]), rope).float()
            assert out[0, 0, 16] == sign * limit and bool(torch.isfinite(out).all()), (fp8, sign)
            # the shrinking component: limit·(cos 1 - sin 1), rounded to the format
            assert out[0, 0, 0] == torch.tensor(sign * limit * (math.cos(1) - math.sin(1))).to(fp8).float()


@pytest.mark.parametrize("kwargs", [
    dict(head_dim=64, rotary_dim=0),
    dict(head_dim=0, rotary_dim=0),
    dict(head_dim=64.0, rotary_dim=64),
    dict(rotary_dim=64.0),
    dict(theta=1.0), dict(theta=float("inf")), dict(theta="10000"),
    dict(max_position=0), dict(max_position=8.0),
    dict(scaling={"rope_type": "linear", "factor": float("inf")}),
    dict(scaling={"rope_type": "linear", "factor": 0.0}),
    dict(scaling={"rope_type": "dynamic", "factor": 2.0, "alpha": 1.0}),
    dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8}),
])
def test_guards_refuse(kwargs):
    with pytest.raises(RopeError):
        RopeConfig(**{**dict(head_dim=64, rotary_dim=64, theta=1e4, style="neox", scaling=None, max_position=8),
                      **kwargs})


def test_guards_accept_the_edges_of_the_valid_ranges():
    for kw in (dict(head_dim=2, rotary_dim=2), dict(rotary_dim=64), dict(theta=1.5), dict(max_position=1),
               dict(style="gptj"), dict(scaling={"rope_type": "linear", "factor": 0.5}),
               dict(scaling={**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0})):
        full = {**dict(head_dim=64, rotary_dim=64, theta=1e4, style="neox", scaling=None, max_position=8), **kw}
        rope = RopeConfig(**full)
        assert rope.inv_freq().shape == (full["rotary_dim"] // 2,)
        want = refrot.frequencies(full["rotary_dim"], full["theta"], full["scaling"], 8)
        assert torch.allclose(rope.inv_freq(), want, rtol=1e-6, atol=0), kw


def test_scaling_is_normalised_and_owned():
    """Legacy 'type', int factor, rope_theta/partial_rotary_factor/rope_dim (not scaling fields) are cleaned up;
    the config keeps its own copy, so the caller editing its dict later changes nothing."""
    sc = {"type": "yarn", "factor": 4, "original_max_position_embeddings": L2K, "rope_theta": 1e4,
          "partial_rotary_factor": 0.5, "rope_dim": 32}
    rope = RopeConfig(64, 64, 1e4, "neox", sc, MAX32K)
    assert rope.scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L2K}
    assert type(rope.scaling["factor"]) is float and rope.scaling_type == "yarn"
    before = rope.inv_freq()
    sc["factor"] = 16.0
    assert rope.scaling["factor"] == 4.0 and torch.equal(rope.inv_freq(), before)
    assert torch.equal(before, refrot.frequencies(64, 1e4, {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": L2K}))
    assert rope.attention_mscale() == pytest.approx(0.1 * math.log(4.0) + 1)
    for plain in ({}, {"rope_type": "default"}, {"type": "default"}, {"factor": 2.0}):
        r = RopeConfig(64, 64, 1e4, "neox", plain, 8)
        assert r.scaling is None and r.scaling_type == "default", plain
        assert torch.equal(r.inv_freq(), refrot.frequencies(64, 1e4))
    dyn = RopeConfig(64, 64, 1e4, "neox", {"rope_type": "dynamic", "factor": 2.0}, 8)
    assert dyn.scaling == {"rope_type": "dynamic", "factor": 2.0}


def test_from_hf_config_reads_what_decides_the_rotation():
    # no rope_theta anywhere: the HF default 10000
    r = RopeConfig.from_hf_config({"hidden_size": 512, "num_attention_heads": 8, "max_position_embeddings": 64})
    assert r == RopeConfig(64, 64, 1e4, "neox", None, 64)
    assert torch.equal(r.inv_freq(), refrot.frequencies(64, 1e4))
    # attribute-style config object (not a Mapping), also without rope_theta
    obj = SimpleNamespace(hidden_size=512, num_attention_heads=8, max_position_embeddings=64)
    assert RopeConfig.from_hf_config(obj) == RopeConfig(64, 64, 1e4, "neox", None, 64)
    obj = SimpleNamespace(hidden_size=512, num_attention_heads=8, max_position_embeddings=64, rope_theta=5e5,
                          partial_rotary_factor=0.5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    r = RopeConfig.from_hf_config(obj)
    assert (r.theta, r.rotary_dim, r.max_position, r.scaling) == (5e5, 32, 128, {"rope_type": "linear", "factor": 2.0})
    # explicit head_dim wins over hidden_size / heads (Qwen3 shape)
    r = RopeConfig.from_hf_config({"head_dim": 128, "hidden_size": 2048, "num_attention_heads": 32,
                                   "max_position_embeddings": 64, "rope_theta": 1e6})
    assert (r.head_dim, r.rotary_dim) == (128, 128)
    # rope_parameters win over legacy rope_scaling; rope_dim sets the rotary width; a null factor means 1
    cfg = {"hidden_size": 512, "num_attention_heads": 8, "max_position_embeddings": 1024,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "partial_rotary_factor": None,
           "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1000,
                               "rope_theta": 1e5, "rope_dim": 16}}
    r = RopeConfig.from_hf_config(cfg)
    assert (r.theta, r.head_dim, r.rotary_dim, r.max_position, r.scaling_type) == (1e5, 64, 16, 2000, "yarn")
    assert torch.equal(r.inv_freq(), refrot.frequencies(16, 1e5, r.scaling))
    cfg["rope_parameters"] = {"rope_theta": 1e5}
    assert RopeConfig.from_hf_config(cfg).rotary_dim == 64  # partial_rotary_factor None: all channels
    cfg["rope_parameters"] = {"rope_theta": 1e5, "partial_rotary_factor": 0.25}  # transformers-5 keeps it here
    assert RopeConfig.from_hf_config(cfg).rotary_dim == 16
    for bad in ({"hidden_size": 512, "max_position_embeddings": 64},                 # no head count
                {"num_attention_heads": 8, "max_position_embeddings": 64},           # no hidden size
                {"head_dim": 64, "max_position_embeddings": 64, "partial_rotary_factor": 1.5},
                {"head_dim": 64, "max_position_embeddings": 64, "partial_rotary_factor": -0.5},
                # an out-of-range factor is refused even where rope_dim would make it unused
                {"head_dim": 64, "max_position_embeddings": 64, "partial_rotary_factor": 1.5,
                 "rope_parameters": {"rope_dim": 32}}):
        with pytest.raises(RopeError):
            RopeConfig.from_hf_config(bad)


def _errors_by_hand(got: torch.Tensor, want: torch.Tensor, rd: int) -> dict[str, float]:
    d = (got.double() - want)[..., :rd]
    w = want[..., :rd]
    l2 = d.norm(dim=-1) / w.norm(dim=-1)
    elem = d.abs().amax(dim=-1) / w.abs().amax(dim=-1)
    return {"max_rel_l2": float(l2.max()), "mean_rel_l2": float(l2.mean()), "max_rel_elem": float(elem.max())}


def test_measure_accuracy_reports_the_errors_of_what_it_ran():
    """Record what measure_accuracy hands its fresh/reference rotations, recompute every reported number by
    hand from that, and check the sampling promises (extreme moves, positions in range, seeded)."""
    rope = RopeConfig(48, 32, 1e4, "gptj", None, 4096)  # partial: errors over rotary channels only
    calls = []

    def reference(x, pos):
        calls.append(("reference", x.clone(), pos.clone()))
        return refrot.fresh_rotation(x, pos, rope)

    def fresh(x, pos):  # a fresh rotation in the measured dtype, off by a small angle so errors are visible
        calls.append(("fresh", x.clone(), pos.clone()))
        return refrot.fresh_rotation(x.double(), torch.clamp(pos + 1, max=4095), rope).to(x.dtype)

    r = measure_accuracy(rope, torch.bfloat16, 4096, 12, seed=5, fresh=fresh, reference=reference)
    refs = [c for c in calls if c[0] == "reference"]
    frs = [c for c in calls if c[0] == "fresh"]
    assert len(refs) == 2 and len(frs) == 2
    x = refs[0][1]
    assert x.dtype == torch.float64 and x.shape == (12, 2, 48)  # two heads by default
    assert torch.equal(x.to(torch.bfloat16).double(), x)  # keys exactly representable in the measured dtype
    assert all(torch.equal(c[1], x) for c in refs)
    assert all(c[1].dtype == torch.bfloat16 and torch.equal(c[1].double(), x) for c in frs)
    by_first = {int(c[2][0]): c[2] for c in refs}
    old, new = by_first[0], by_first[4095]  # the extreme moves 0 -> max-1 and max-1 -> 0 are always in
    assert int(old[1]) == 4095 and int(new[1]) == 0
    assert {int(c[2][0]) for c in frs} == {0, 4095}
    assert int(torch.cat([old, new]).min()) >= 0 and int(torch.cat([old, new]).max()) < 4096
    ref_new = refrot.fresh_rotation(x, new, rope)
    cached_exact = refrot.fresh_rotation(x, old, rope).to(torch.bfloat16)
    cached_fresh = fresh(x.to(torch.bfloat16), old)
    for name, got in (("shift_exact", shift(cached_exact, old, new, rope)),
                      ("fresh", fresh(x.to(torch.bfloat16), new)),
                      ("shift_fresh", shift(cached_fresh, old, new, rope))):
        for k, v in _errors_by_hand(got, ref_new, 32).items():
            assert r[f"{name}_{k}"] == pytest.approx(v, rel=1e-12), (name, k)
    assert r["fresh_max_rel_l2"] > 0.1 > r["shift_exact_max_rel_l2"]  # the numbers tell the cases apart
    assert {k: r[k] for k in ("dtype", "max_pos", "n", "heads", "seed", "scaling", "style", "rotary_dim",
                              "unit_roundoff")} == {"dtype": "bfloat16", "max_pos": 4096, "n": 12, "heads": 2,
                                                    "seed": 5, "scaling": "default", "style": "gptj",
                                                    "rotary_dim": 32, "unit_roundoff": 2.0 ** -8}
    # seeded: the same call reports the same numbers
    assert measure_accuracy(rope, torch.bfloat16, 4096, 12, seed=5, fresh=fresh, reference=reference) == r


def test_measure_accuracy_samples_the_whole_range_and_checks_its_arguments():
    rope = RopeConfig(16, 16, 1e4, "neox", None, 64)
    seen = []
    r = measure_accuracy(rope, torch.float32, 2, 2, seed=0, heads=1,
                         reference=lambda x, p: (seen.append(p.clone()), refrot.fresh_rotation(x, p, rope))[1])
    assert r["max_pos"] == 2 and r["n"] == 2 and r["heads"] == 1  # smallest allowed range and count
    seen.clear()
    measure_accuracy(rope, torch.float32, 2, 64, seed=0,
                     reference=lambda x, p: (seen.append(p.clone()), refrot.fresh_rotation(x, p, rope))[1])
    assert all(set(p[2:].tolist()) == {0, 1} for p in seen)  # random positions cover [0, max_pos), 0 included
    for bad in (dict(max_pos=1), dict(max_pos=65), dict(n=1)):
        with pytest.raises(RopeError):
            measure_accuracy(rope, torch.float32, **{**dict(max_pos=64, n=8, seed=0), **bad})


def test_configs_hash_by_value():
    """Equal configs (scaling dicts included) hash alike, so they work as dict keys / in sets."""
    a = RopeConfig(64, 64, 1e4, "neox", {"rope_type": "linear", "factor": 2.0}, 8)
    b = RopeConfig(64, 64, 1e4, "neox", {"type": "linear", "factor": 2}, 8)
    assert a == b and hash(a) == hash(b) and len({a, b, RopeConfig(64, 64, 1e4, "neox", None, 8)}) == 2
