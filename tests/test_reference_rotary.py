"""kmesh.reference.rotary on its own terms (hand-worked rotations, the published band edges and factors,
correctly rounded float32 steps), then against transformers' rope init functions and kmesh.kv.rope."""
import math
from decimal import Decimal, getcontext

import pytest
import torch

from kmesh.kv.rope import RopeConfig, rotate
from kmesh.reference import rotary as ref
from kmesh.stages.synthetic import ACCURACY_ROPES, ROPES, rope_for


def test_rotation_by_hand_neox_and_gptj():
    # rotary_dim 4, theta 1e4: ω = [1, 1e4^(-1/2) = 0.01 (as float32)]. Pair 0 turns by p·1 radian.
    w = ref.frequencies(4, 1e4)
    assert w[0] == 1.0 and w[1] == float(torch.tensor(0.01, dtype=torch.float32))
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)   # channel 4 is not rotary
    c0, s0, c1, s1 = math.cos(1), math.sin(1), math.cos(w[1]), math.sin(w[1])
    # neox pairs (0, 2) and (1, 3): z0 = 1 + 3i, z1 = 2 + 4i, turned counter-clockwise by exp(i·ω)
    neox = ref.rotate_complex(x, torch.tensor([1]), w, "neox")
    want = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 1 * s0 + 3 * c0, 2 * s1 + 4 * c1, 5.0]
    assert torch.allclose(neox[0], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    # gptj pairs (0, 1) and (2, 3): z0 = 1 + 2i, z1 = 3 + 4i
    gptj = ref.rotate_complex(x, torch.tensor([1]), w, "gptj")
    want = [1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1, 3 * s1 + 4 * c1, 5.0]
    assert torch.allclose(gptj[0], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    # the unit vector of pair 0 lands on (cos p, sin p): the direction is positive
    e = ref.rotate_complex(torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([2]), w[:1], "neox")
    assert torch.allclose(e[0], torch.tensor([math.cos(2), math.sin(2)], dtype=torch.float64), atol=1e-15)


def test_rotation_composes_preserves_norm_and_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, dtype=torch.float64, generator=g)
    w = ref.frequencies(64, 1e6)
    p, q = torch.tensor([0, 7, 300, 8000, 31]), torch.tensor([5, 0, 17, 1, 31])
    two = ref.rotate_complex(ref.rotate_complex(x, p, w, "neox"), q, w, "neox")
    assert torch.allclose(two, ref.rotate_complex(x, p + q, w, "neox"), rtol=0, atol=1e-12)
    assert torch.allclose(ref.rotate_complex(x, p, w, "gptj").norm(dim=-1), x.norm(dim=-1), rtol=1e-14)
    m = ref.rotate_complex(x, p, w, "neox", scale=1.5)
    assert torch.allclose(m.norm(dim=-1), 1.5 * x.norm(dim=-1), rtol=1e-14)
    assert torch.equal(ref.rotate_complex(x, torch.zeros(5, dtype=torch.int64), w, "neox"), x)


def _correct_f32(v: Decimal) -> float:
    return ref.round_f32(float(v))   # Decimal -> nearest float64 -> nearest float32 (no tie at 60 digits)


@pytest.mark.parametrize("dim,theta", [(64, 1e4), (64, 1e5), (64, 1e6), (64, 5e5), (32, 1e4), (128, 5e5)])
def test_base_frequencies_are_each_float32_step_correctly_rounded(dim, theta):
    getcontext().prec = 60
    b = Decimal(ref.round_f32(theta))
    for i, w in enumerate(ref.base_frequencies(dim, theta)):
        e = Decimal(ref.round_f32(2 * i / dim))
        q = _correct_f32((e * b.ln()).exp())
        assert w == _correct_f32(Decimal(1) / Decimal(q)), (dim, theta, i)


def test_yarn_band_edges_by_hand():
    # theta 1e4, d 64, s 4, L 2048, beta 32 / 1: i(r) = 64·ln(2048/(2π·r)) / (2·ln 1e4)
    #   i(32) = 64·ln(10.186) / 18.4207 = 8.06 -> floor 8;  i(1) = 64·ln(325.95) / 18.4207 = 20.1 -> ceil 21
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    w, base = ref.frequencies(64, 1e4, sc), ref.base_frequencies(64, 1e4)
    assert [w[i].item() for i in range(9)] == base[:9]                          # kept up to channel 8
    assert all(w[i].item() == ref.round_f32(base[i] / 4) for i in range(21, 32))  # interpolated from 21
    keep = 7 / 13                                                                # channel 14: ramp 6/13
    assert w[14].item() == ref.round_f32(base[14] * keep + base[14] / 4 * (1 - keep))
    assert ref.attention_factor(sc) == 0.1 * math.log(4.0) + 1 == pytest.approx(1.1386294361)


def test_llama3_bands_by_hand():
    # L 1024, low 1, high 4: wavelength < 256 keeps ω, > 1024 divides by 8, between blends by L/λ
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
    w, base = ref.frequencies(64, 5e5, sc), ref.base_frequencies(64, 5e5)
    for i, b in enumerate(base):
        lam = 2 * math.pi / b
        if lam < 256:
            assert w[i].item() == b
        elif lam > 1024:
            assert w[i].item() == b / 8
        else:
            mu = (1024 / lam - 1) / 3
            assert w[i].item() == ref.round_f32((1 - mu) * b / 8 + mu * b)
    assert ref.attention_factor(sc) == 1.0


def test_attention_factor_variants():
    assert ref.attention_factor(None) == 1.0
    assert ref.attention_factor({"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4}) == 1.0
    assert ref.attention_factor({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25}) == 1.25
    ds = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}
    assert ref.attention_factor(ds) == pytest.approx((0.1 * math.log(40) + 1) / (0.0707 * math.log(40) + 1))


def _used_ropes():
    out = {f"{n}": rope_for(n, 64) for n in ROPES}
    out.update({f"accuracy-{n}": RopeConfig(64, 64, t, "neox", None, 32768) for n, t in ACCURACY_ROPES.items()})
    return out


@pytest.mark.parametrize("name", list(_used_ropes()))
def test_equals_kmesh_frequencies_bit_for_bit_where_the_stage_uses_them(name):
    rope = _used_ropes()[name]
    ours = ref.frequencies(rope.rotary_dim, rope.theta, rope.scaling, rope.max_position)
    assert ref.ulp_distance_f32(ours, rope.inv_freq()) == 0 and torch.equal(ours, rope.inv_freq())
    assert ref.attention_factor(rope.scaling) == rope.attention_mscale()
    # and the fresh rotations agree to float64 rounding (kmesh's real-arithmetic path vs complex numbers)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 3, rope.head_dim, dtype=torch.float64, generator=g)
    pos = torch.randint(0, rope.max_position, (40,), generator=g)
    assert torch.allclose(ref.fresh_rotation(x, pos, rope), rotate(x, pos, rope), rtol=0, atol=1e-12)


def test_within_two_float32_ulps_of_transformers():
    # transformers computes ω in a chain of float32 operations (each rounded), the reference rounds the
    # formula once: they differ by at most the chain's few roundings.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for d in (64, 128):
        for theta in (1e4, 5e5, 1e6):
            for f in (2.0, 3.0, 8.0):
                for kind, extra in (("llama3", {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 1024}),
                                    ("yarn", {"original_max_position_embeddings": 2048})):
                    params = {"rope_type": kind, "rope_theta": theta, "factor": f, **extra}
                    cfg = LlamaConfig(hidden_size=8 * d, num_attention_heads=8, head_dim=d,
                                      max_position_embeddings=8192, rope_parameters=params)
                    theirs, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
                    assert ref.ulp_distance_f32(theirs, ref.frequencies(d, theta, params)) <= 2, (kind, d, theta, f)
                    assert factor == pytest.approx(ref.attention_factor(params), rel=1e-15)


def test_ulp_distance():
    a = torch.tensor([1.0, -2.0, 0.0])
    nxt = torch.nextafter(a.float(), torch.tensor(float("inf")))
    assert ref.ulp_distance_f32(a, a) == 0 and ref.ulp_distance_f32(a, nxt) == 1
    assert ref.ulp_distance_f32(torch.tensor([-0.0]), torch.tensor([0.0])) == 0


def test_measure_accuracy_takes_its_ground_truth_from_the_reference():
    from kmesh.kv.rope import measure_accuracy

    rope = RopeConfig(64, 64, 1e6, "neox", None, 32768)
    honest = measure_accuracy(rope, torch.float32, 32768, 64, seed=0,
                              reference=lambda x, p: ref.fresh_rotation(x, p, rope))
    assert honest["shift_exact_max_rel_l2"] <= 1e-5
    # a ground truth turning the other way: the same kmesh shift is now far off, so the parameter is used
    w = ref.frequencies(64, 1e6)
    mirrored = measure_accuracy(rope, torch.float32, 32768, 64, seed=0,
                                reference=lambda x, p: ref.rotate_complex(x, -p, w, "neox"))
    assert mirrored["shift_exact_max_rel_l2"] > 0.1
