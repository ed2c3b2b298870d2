"""Stage `synthetic` (§21): restore into every KV arrangement × dtype × shift and prove nothing else changed.

Each case builds a cache of one arrangement (vLLM GPU orders, the CPU backend's planes, MLA latents),
poisons every byte with random data, restores a random segment whose keys were rotated at their old
positions (float64, then rounded to the cache dtype), and checks:
  (a) values_bit_identical      V read back == the segment's V bytes
  (b) keys_vs_float64           per (token, layer, head) rotary part: ‖k − k_ref‖/‖k_ref‖ ≤ 2u + 8u_f32,
                                k_ref = fresh float64 rotation of the un-rotated key at the new position
      keys_unmoved_bit_identical  tokens whose position does not change keep their key bytes (shift "none")
  (c) canary_untouched          every byte outside the destination cells (other slots, other layers,
                                padding, guard bytes before/after the layout) equals the poison
  (d) unrotated_channels_identical  key channels outside the rotary range are the segment's bytes
The cached keys and k_ref both come from kmesh.reference.rotary (complex-number rotation, frequencies
from the published formulas), never from kmesh.rope, so only the restore under test uses kmesh.rope's
shift; case rope-reference-frequencies proves the reference's ω equal kmesh's bit for bit for every
rope variant used (else a float32 case could not be judged: 1 ulp of ω × 300 positions exceeds its bound).
Read-back, the canary mask and the expected destination byte count go through kmesh.reference.addressing
(byte addresses from first principles), never through KVLayout's methods, which restore itself uses: a bug
in the layout's slot addressing would otherwise move the writes and the checks together.
  layer_views_agree_with_reference  vLLM-style layer views (KVLayout.read_tokens) read the same K/V
With `check_kernel` (cuda profile) the same plan also runs through kernels/restore_rope.cu — its 16-byte
vector path and its element path — into identically poisoned buffers, and each must equal the torch
path's buffer byte for byte.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from kmesh.config import Config
from kmesh.errors import StageError
from kmesh.layout import KVLayout, dequantize, quantize
from kmesh.reference import addressing
from kmesh.reference import rotary as rotary_ref
from kmesh.restore import KVSegment, plan_restore, restore
from kmesh.result import Case, Result
from kmesh.rope import RopeConfig

ARRANGEMENTS = ("paged:LBHNC", "paged:LBNHC", "paged:LHBNC", "paged:BLHNC", "paged:BLNHC", "paged:BHLNC",
                "cpu:LBHNC", "mla:LBNHC", "mla:BLHNC")
DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
SHIFTS = ("none", "forward", "backward", "crossing", "partial")
BLOCK_SIZES = (16, 32, 64)
CPU_BLOCK_SIZES = (128, 32, 64)   # vLLM's CPU engine allocates 128-token blocks; its kernels take multiples of 32
ROPES = ("neox", "gptj", "partial", "llama3", "yarn")
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "fp8_e4m3": 2.0**-4,
                 "fp8_e5m2": 2.0**-3}
HEADS, HEAD_DIM, KV_LORA_RANK, ROPE_DIM = 2, 64, 128, 64
CACHE_LAYERS, SEGMENT_LAYERS = 4, 3
GUARD = 256   # poisoned bytes before and after the layout's own bytes


@dataclass(frozen=True)
class CaseSpec:
    arrangement: str
    dtype: str
    block_size: int
    shift: str
    rope: str
    first_layer: int

    @property
    def id(self) -> str:
        return f"{self.arrangement.replace(':', '-')}-{self.dtype}-b{self.block_size}-{self.shift}-{self.rope}"


def case_specs() -> list[CaseSpec]:
    """Every arrangement × every shift; dtypes, block sizes and rope variants rotate so each arrangement
    sees all five dtypes and all three block sizes (45 cases)."""
    specs = []
    for (i, arr), (j, shift) in itertools.product(enumerate(ARRANGEMENTS), enumerate(SHIFTS)):
        blocks = CPU_BLOCK_SIZES if arr.startswith("cpu") else BLOCK_SIZES
        specs.append(CaseSpec(arr, DTYPES[(i + j) % 5], blocks[(i + 2 * j) % 3], shift, ROPES[(2 * i + j) % 5],
                              first_layer=(i + j) % 2))
    return specs


def rope_for(name: str, head_dim: int) -> RopeConfig:
    if name == "neox":
        return RopeConfig(head_dim, head_dim, 10000.0, "neox", None, 8192)
    if name == "gptj":
        return RopeConfig(head_dim, head_dim, 10000.0, "gptj", None, 8192)
    if name == "partial":
        return RopeConfig(head_dim, head_dim // 2, 1e6, "neox", None, 8192)
    if name == "llama3":
        return RopeConfig(head_dim, head_dim, 500000.0, "neox",
                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024}, 8192)
    if name == "yarn":
        return RopeConfig(head_dim, head_dim, 10000.0, "neox",
                          {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192)
    raise StageError(f"unknown rope variant {name!r}")


def positions_for(shift: str, n: int) -> tuple[int, int, int, int]:
    """(tokens, old start, new start, trailing padding tokens) of a shift kind for block size n."""
    return {
        "none": (2 * n + 7, 40, 40, 0),
        "forward": (2 * n + 7, 5, 5 + 3 * n + 11, 0),
        "backward": (2 * n + 7, 300, 17, 0),
        "crossing": (n + 6, 100, n - 3, 0),            # starts 3 tokens before a block edge
        "partial": (2 * n + 5, 64, 64 + n // 2 + 1, 3),  # last block partly filled, then 3 padding tokens
    }[shift]


@dataclass
class CaseData:
    spec: CaseSpec
    layout: KVLayout
    rope: RopeConfig
    segment: KVSegment
    x64: torch.Tensor          # un-rotated keys [T, L', H, Dk] (float64, exactly representable in dtype)
    slots: torch.Tensor        # int64 [T], −1 for padding
    new_pos: torch.Tensor
    poison: torch.Tensor       # uint8 [nbytes + GUARD]; the layout starts GUARD bytes in


def build_case(spec: CaseSpec, seed: int, device: str | torch.device) -> CaseData:
    gen = torch.Generator().manual_seed(seed)
    packing, order = spec.arrangement.split(":")
    n = spec.block_size
    T_real, old0, new0, pad = positions_for(spec.shift, n)
    T = T_real + pad
    num_blocks = (new0 + T_real + n - 1) // n + 3     # spare blocks stay untouched (canary area)
    mla = packing == "mla"
    H = 1 if mla else HEADS
    Dk = KV_LORA_RANK + ROPE_DIM if mla else HEAD_DIM
    rope = rope_for(spec.rope, ROPE_DIM if mla else HEAD_DIM)
    fp8 = spec.dtype.startswith("fp8")
    L = SEGMENT_LAYERS

    # Un-rotated keys, exactly representable in the cache dtype, then rotated at the old positions in float64.
    x = torch.randn(T, L, H, Dk, generator=gen, dtype=torch.float64)
    vals = torch.randn(T, L, H, 0 if mla else HEAD_DIM, generator=gen, dtype=torch.float64)
    top = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}.get(spec.dtype)
    k_scale = float(x.abs().max() / (top / 2)) if fp8 else 1.0
    v_scale = float(vals.abs().max() / (top / 2)) if fp8 and vals.numel() else 1.0
    tmp = KVLayout("mla" if mla else packing, order, CACHE_LAYERS, num_blocks, n, H, Dk, 0 if mla else HEAD_DIM,
                   spec.dtype, rope_offset=KV_LORA_RANK if mla else 0, k_scale=k_scale, v_scale=v_scale,
                   offset=GUARD)
    x = _representable(x, tmp)
    old = torch.arange(old0, old0 + T, dtype=torch.int64)
    new = torch.arange(new0, new0 + T, dtype=torch.int64)
    rs = tmp.rope_offset
    rotated = x.clone()
    rotated[..., rs:] = rotary_ref.fresh_rotation(x[..., rs:].reshape(T, L * H, -1), old, rope).reshape(T, L, H, -1)
    k = _store(rotated, tmp, tmp.k_scale)
    v = _store(vals, tmp, tmp.v_scale) if not mla else None

    # vLLM-style slot mapping: a request's logical block i sits in physical block table[i].
    table = torch.randperm(num_blocks, generator=gen)
    slots = table[new // n] * n + new % n
    slots[T_real:] = -1
    poison = torch.randint(0, 256, (tmp.nbytes + GUARD,), dtype=torch.uint8, generator=gen)
    seg = KVSegment(k, v, old, spec.dtype, tmp.k_scale, tmp.v_scale)
    return CaseData(spec, tmp, rope, seg.to(device), x, slots.to(device), new.to(device), poison.to(device))


def _representable(x: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    if layout.fp8_dtype is not None:
        return dequantize(quantize(x, layout.fp8_dtype, 1.0 / layout.k_scale), layout.fp8_dtype,
                          layout.k_scale).double()
    return x.to(layout.storage_dtype).double()


def _store(x: torch.Tensor, layout: KVLayout, scale: float) -> torch.Tensor:
    if layout.fp8_dtype is not None:
        return quantize(x.float(), layout.fp8_dtype, float(1.0 / scale))
    return x.to(layout.storage_dtype)


RestoreFn = Callable[..., Any]


def check_case(c: Case, d: CaseData, raw: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Checks (a)–(d) on a restored buffer `raw` (GUARD-padded). Returns the measured key error."""
    lay, seg, spec = d.layout, d.segment, d.spec
    layers = list(range(spec.first_layer, spec.first_layer + SEGMENT_LAYERS))
    keep = d.slots >= 0
    real_slots = d.slots[keep]
    k_got, v_got = addressing.read(raw, lay, real_slots, layers)
    k_views, v_views = lay.read_tokens(raw, real_slots, layers)
    c.check(prefix + "layer_views_agree_with_reference",
            _same_bytes(k_views, k_got) and (v_got is None or _same_bytes(v_views, v_got)))
    # (a) values
    if seg.v is not None:
        c.check(prefix + "values_bit_identical", _same_bytes(v_got, seg.v[keep]))
    # (b) keys against float64
    rs, rd = lay.rope_offset, d.rope.rotary_dim
    T = int(keep.sum())
    H = lay.num_kv_heads
    keep_cpu = keep.cpu()
    ref = rotary_ref.fresh_rotation(d.x64[keep_cpu][..., rs:].reshape(T, SEGMENT_LAYERS * H, -1),
                                    d.new_pos.cpu()[keep_cpu], d.rope)
    ref = ref.reshape(T, SEGMENT_LAYERS, H, -1)[..., :rd].to(raw.device)
    got = k_got[..., rs:rs + rd]
    got = dequantize(got, lay.fp8_dtype, lay.k_scale).double() if lay.fp8_dtype is not None else got.double()
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    err = float(rel.nan_to_num(nan=math.inf).max())   # bytes that read back as NaN are an infinite error
    bound = 2 * UNIT_ROUNDOFF[spec.dtype] + 8 * UNIT_ROUNDOFF["float32"]
    c.check(prefix + "keys_vs_float64", err <= bound, {"max_rel_l2": err, "bound": bound})
    moved = (seg.positions != d.new_pos)[keep]
    if bool((~moved).any()):
        c.check(prefix + "keys_unmoved_bit_identical", _same_bytes(k_got[~moved], seg.k[keep][~moved]))
    # (d) channels the rope does not touch
    other = torch.ones(lay.head_dim, dtype=torch.bool, device=raw.device)
    other[rs:rs + rd] = False
    if bool(other.any()):
        c.check(prefix + "unrotated_channels_identical", _same_bytes(k_got[..., other], seg.k[keep][..., other]),
                int(other.sum()))
    # (c) canary: everything outside the destination cells is still the poison
    mask = addressing.touched_mask(raw.numel(), lay, real_slots, layers, raw.device)
    untouched = torch.equal(raw[~mask], d.poison[~mask])
    c.check(prefix + "canary_untouched", untouched,
            {"outside_bytes": int((~mask).sum()), "changed": int((raw[~mask] != d.poison[~mask]).sum())})
    expected = addressing.destination_bytes(lay, T, SEGMENT_LAYERS)
    c.check(prefix + "destination_bytes_expected", int(mask.sum()) == expected,
            {"marked": int(mask.sum()), "expected": expected})
    return {"max_rel_l2": err, "bound": bound}


def _same_bytes(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    # Bits, not values: poison may read back as NaN (never equal to itself), and -0.0 == 0.0.
    if a is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_case(c: Case, d: CaseData, restore_fn: RestoreFn = restore, check_kernel: bool = False) -> dict[str, float]:
    """Restore with `restore_fn` (torch path by default) into a poisoned buffer and check it; returns the
    torch path's key error."""
    raw = d.poison.clone()
    restore_fn(raw, d.layout, d.segment, d.slots, d.new_pos, d.rope, first_layer=d.spec.first_layer)
    c.record("layout", {"order": d.layout.order, "packing": d.layout.packing, "num_blocks": d.layout.num_blocks,
                        "nbytes": d.layout.nbytes, "tokens": d.segment.num_tokens,
                        "padding_tokens": int((d.slots < 0).sum()), "rotary_dim": d.rope.rotary_dim,
                        "style": d.rope.style, "scaling": d.rope.scaling_type})
    err = check_case(c, d, raw)
    c.record("key_error", err)
    if not check_kernel:
        return err
    from kmesh.cuda.restore_rope import launch_restore

    for path, slow in (("kernel_vector_or_auto", False), ("kernel_element", True)):
        out = d.poison.clone()
        plan = plan_restore(out, d.layout, d.segment, d.slots, d.new_pos, d.rope, first_layer=d.spec.first_layer)
        launch = launch_restore(plan, force_slow=slow)
        torch.cuda.synchronize()
        c.record(f"{path}_launch", launch)
        same = torch.equal(out, raw)
        c.check(f"{path}_equals_torch_bytes", same, {"differing_bytes": int((out != raw).sum())})
        if not slow:
            check_case(c, d, out, prefix="kernel_")
    return err


# The models KMesh serves (SmolLM2-135M: theta 1e5; Qwen2.5: theta 1e6), head_dim 64, positions up to 32k.
ACCURACY_ROPES = {"smollm2": 1e5, "qwen2.5": 1e6}
ACCURACY_MAX_POS = 32768


def frequency_case(res: Result) -> None:
    """The reference's ω and attention factor equal kmesh.rope's, bit for bit, for every rope the stage uses
    (the restore cases judge kmesh's float32 shift against the reference: an ω off by one float32 ulp times a
    shift of ~300 positions would already exceed their bound)."""
    used = {f"{name}-d{dim}": rope_for(name, dim) for name in ROPES for dim in sorted({HEAD_DIM, ROPE_DIM})}
    used.update({f"accuracy-{name}": _accuracy_rope(theta) for name, theta in ACCURACY_ROPES.items()})
    with res.case("rope-reference-frequencies", {"variants": sorted(used)}) as c:
        worst = 0
        for name, rope in used.items():
            ours = rotary_ref.frequencies(rope.rotary_dim, rope.theta, rope.scaling, rope.max_position)
            theirs = rope.inv_freq()
            ulp = rotary_ref.ulp_distance_f32(ours, theirs)
            factor = rotary_ref.attention_factor(rope.scaling)
            worst = max(worst, ulp)
            c.check(f"omega_and_attention_factor_equal_{name}",
                    torch.equal(ours, theirs) and factor == rope.attention_mscale(),
                    {"max_ulp": ulp, "channels": ours.numel(), "theta": rope.theta, "style": rope.style,
                     "scaling": rope.scaling_type, "attention_factor": factor,
                     "kmesh_attention_factor": rope.attention_mscale()})
        c.record("max_ulp", worst)


def _accuracy_rope(theta: float) -> RopeConfig:
    return RopeConfig(64, 64, theta, "neox", None, ACCURACY_MAX_POS)


def rope_accuracy_cases(res: Result, seed: int, device: str) -> None:
    """Shift accuracy against float64 (issue §21, recorded): fp32 ≤ 1e-5 relative up to 32k; bf16 no worse than
    a fresh bf16 rotation (vLLM's own where vLLM is installed, else KMesh's) + one bf16 rounding. The float64
    ground truth is kmesh.reference.rotary, never kmesh.rope."""
    from kmesh.rope import measure_accuracy
    from kmesh.vllm import available as vllm_available

    for k, (name, theta) in enumerate(ACCURACY_ROPES.items()):
        rope = _accuracy_rope(theta)

        def reference(xs: torch.Tensor, pos: torch.Tensor, rope: RopeConfig = rope) -> torch.Tensor:
            return rotary_ref.fresh_rotation(xs, pos, rope)

        with res.case(f"rope-accuracy-{name}", {"theta": theta, "max_pos": ACCURACY_MAX_POS, "tokens": 1024}) as c:
            r32 = measure_accuracy(rope, torch.float32, ACCURACY_MAX_POS, 1024, seed + 1000 + k, device=device,
                                   reference=reference)
            c.check("fp32_shift_max_rel_le_1e-5", r32["shift_exact_max_rel_l2"] <= 1e-5, r32)
            if vllm_available() and device == "cpu":
                from kmesh.vllm.rope_reference import vllm_fresh_rotation

                comparator, fresh = "vllm", vllm_fresh_rotation(rope, torch.bfloat16)
            else:  # the GPU machine has no vLLM: compare with KMesh's own fresh rotation, and say so
                comparator, fresh = "kmesh-rotate", None
            r16 = measure_accuracy(rope, torch.bfloat16, ACCURACY_MAX_POS, 1024, seed + 2000 + k, device=device,
                                   fresh=fresh, reference=reference)
            c.record("bf16_comparator", comparator)
            c.record("float64_reference", "kmesh.reference.rotary")
            u = r16["unit_roundoff"]
            c.check("bf16_shift_of_fresh_keys_no_worse_than_fresh_plus_1_rounding",
                    r16["shift_fresh_max_rel_l2"] <= r16["fresh_max_rel_l2"] + u, r16)
            c.check("bf16_shift_of_exact_keys_no_worse_than_fresh_plus_1_rounding",
                    r16["shift_exact_max_rel_l2"] <= r16["fresh_max_rel_l2"] + u,
                    {k: r16[k] for k in ("shift_exact_max_rel_l2", "fresh_max_rel_l2", "unit_roundoff")})


def run(cfg: Config) -> Result:
    res = Result.begin("synthetic", cfg)
    sec = cfg.section("synthetic")
    device = sec.get("device", "cpu")
    check_kernel = bool(sec.get("check_kernel", False))
    if device == "cuda" and not torch.cuda.is_available():
        raise StageError("synthetic: profile asks for device 'cuda' but torch sees no CUDA device")
    if check_kernel:
        if device != "cuda":
            raise StageError("synthetic: check_kernel needs device 'cuda'")
        from kmesh.cuda import configure, kernel_info

        configure(cfg.results_dir / cfg.profile / "kernels")
    specs = case_specs()
    res.extra["device"] = device
    res.extra["check_kernel"] = check_kernel
    res.extra["design"] = ("each case: poison whole buffer (random bytes, guard regions both sides), restore "
                           "(torch path) a segment rotated by an independent complex-number RoPE reference "
                           "(kmesh.reference.rotary; its ω equal kmesh's bit for bit), read back through an independent byte-address reference (kmesh.reference."
                           "addressing), check values bit-identical, keys vs float64 within 2u+8u_f32, "
                           "canary outside destination cells, unrotated channels identical, vLLM-style layer "
                           "views agree with the reference"
                           + ("; kernel vector and element paths must equal the torch buffer byte for byte"
                              if check_kernel else ""))
    frequency_case(res)
    worst: dict[str, float] = {}
    for i, spec in enumerate(specs):
        with res.case(spec.id, asdict(spec)) as c:
            d = build_case(spec, cfg.seed + i, device)
            e = run_case(c, d, check_kernel=check_kernel)
            worst[spec.dtype] = max(worst.get(spec.dtype, 0.0), e["max_rel_l2"] / e["bound"])
    res.extra["worst_key_error_over_bound"] = worst
    rope_accuracy_cases(res, cfg.seed, device)
    res.extra["arrangements"] = list(ARRANGEMENTS)
    if check_kernel:
        res.extra["kernel"] = kernel_info("restore_rope")
    if len(specs) < 32:
        raise StageError(f"synthetic needs at least 32 cases, has {len(specs)}")
    return res
