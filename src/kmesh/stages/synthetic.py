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
from the published formulas), never from kmesh.kv.rope, so only the restore under test uses kmesh.kv.rope's
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
from kmesh.kv.layout import KVLayout, dequantize, quantize
from kmesh.kv.restore import KVSegment, plan_restore, restore
from kmesh.kv.rope import RopeConfig
from kmesh.reference import addressing
from kmesh.reference import rotary as rotary_ref
from kmesh.result import Case, Result

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


def positions_for(shift: str, block_size: int) -> tuple[int, int, int, int]:
    """(tokens, old start, new start, trailing padding tokens) of a shift kind for blocks of `block_size` tokens."""
    return {
        "none": (2 * block_size + 7, 40, 40, 0),
        "forward": (2 * block_size + 7, 5, 5 + 3 * block_size + 11, 0),
        "backward": (2 * block_size + 7, 300, 17, 0),
        "crossing": (block_size + 6, 100, block_size - 3, 0),             # starts 3 tokens before a block edge
        "partial": (2 * block_size + 5, 64, 64 + block_size // 2 + 1, 3),  # last block partly filled, 3 padding
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
    block_size = spec.block_size
    real_tokens, old0, new0, pad = positions_for(spec.shift, block_size)
    num_tokens = real_tokens + pad
    num_blocks = (new0 + real_tokens + block_size - 1) // block_size + 3   # spare blocks stay untouched (canary area)
    mla = packing == "mla"
    num_heads = 1 if mla else HEADS
    Dk = KV_LORA_RANK + ROPE_DIM if mla else HEAD_DIM
    rope = rope_for(spec.rope, ROPE_DIM if mla else HEAD_DIM)
    fp8 = spec.dtype.startswith("fp8")
    num_layers = SEGMENT_LAYERS

    # Un-rotated keys, exactly representable in the cache dtype, then rotated at the old positions in float64.
    unrotated = torch.randn(num_tokens, num_layers, num_heads, Dk, generator=gen, dtype=torch.float64)
    vals = torch.randn(num_tokens, num_layers, num_heads, 0 if mla else HEAD_DIM, generator=gen, dtype=torch.float64)
    top = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}.get(spec.dtype)
    k_scale = float(unrotated.abs().max() / (top / 2)) if fp8 else 1.0
    v_scale = float(vals.abs().max() / (top / 2)) if fp8 and vals.numel() else 1.0
    tmp = KVLayout("mla" if mla else packing, order, CACHE_LAYERS, num_blocks, block_size, num_heads, Dk,
                   0 if mla else HEAD_DIM, spec.dtype, rope_offset=KV_LORA_RANK if mla else 0, k_scale=k_scale,
                   v_scale=v_scale, offset=GUARD)
    unrotated = _representable(unrotated, tmp)
    old = torch.arange(old0, old0 + num_tokens, dtype=torch.int64)
    new = torch.arange(new0, new0 + num_tokens, dtype=torch.int64)
    rs = tmp.rope_offset
    rotated = unrotated.clone()
    rotated[..., rs:] = rotary_ref.fresh_rotation(unrotated[..., rs:].reshape(num_tokens, num_layers * num_heads, -1),
                                                  old, rope).reshape(num_tokens, num_layers, num_heads, -1)
    keys_stored = _store(rotated, tmp, tmp.k_scale)
    values_stored = _store(vals, tmp, tmp.v_scale) if not mla else None

    # vLLM-style slot mapping: a request's logical block i sits in physical block table[i].
    table = torch.randperm(num_blocks, generator=gen)
    slots = table[new // block_size] * block_size + new % block_size
    slots[real_tokens:] = -1
    poison = torch.randint(0, 256, (tmp.nbytes + GUARD,), dtype=torch.uint8, generator=gen)
    seg = KVSegment(keys_stored, values_stored, old, spec.dtype, tmp.k_scale, tmp.v_scale)
    return CaseData(spec, tmp, rope, seg.to(device), unrotated, slots.to(device), new.to(device), poison.to(device))


def _representable(tensor: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    if layout.fp8_dtype is not None:
        return dequantize(quantize(tensor, layout.fp8_dtype, 1.0 / layout.k_scale), layout.fp8_dtype,
                          layout.k_scale).double()
    return tensor.to(layout.storage_dtype).double()


def _store(tensor: torch.Tensor, layout: KVLayout, scale: float) -> torch.Tensor:
    if layout.fp8_dtype is not None:
        return quantize(tensor.float(), layout.fp8_dtype, float(1.0 / scale))
    return tensor.to(layout.storage_dtype)


RestoreFn = Callable[..., Any]


def check_case(case: Case, data: CaseData, raw: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Checks (a)–(d) on a restored buffer `raw` (GUARD-padded). Returns the measured key error."""
    lay, seg, spec = data.layout, data.segment, data.spec
    layers = list(range(spec.first_layer, spec.first_layer + SEGMENT_LAYERS))
    keep = data.slots >= 0
    real_slots = data.slots[keep]
    k_got, v_got = addressing.read(raw, lay, real_slots, layers)
    k_views, v_views = lay.read_tokens(raw, real_slots, layers)
    case.check(prefix + "layer_views_agree_with_reference",
               _same_bytes(k_views, k_got) and (v_got is None or _same_bytes(v_views, v_got)))
    # (a) values
    if seg.v is not None:
        case.check(prefix + "values_bit_identical", _same_bytes(v_got, seg.v[keep]))
    # (b) keys against float64
    rs, rd = lay.rope_offset, data.rope.rotary_dim
    num_tokens = int(keep.sum())
    num_heads = lay.num_kv_heads
    keep_cpu = keep.cpu()
    ref = rotary_ref.fresh_rotation(data.x64[keep_cpu][..., rs:].reshape(num_tokens, SEGMENT_LAYERS * num_heads, -1),
                                    data.new_pos.cpu()[keep_cpu], data.rope)
    ref = ref.reshape(num_tokens, SEGMENT_LAYERS, num_heads, -1)[..., :rd].to(raw.device)
    got = k_got[..., rs:rs + rd]
    got = dequantize(got, lay.fp8_dtype, lay.k_scale).double() if lay.fp8_dtype is not None else got.double()
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    err = float(rel.nan_to_num(nan=math.inf).max())   # bytes that read back as NaN are an infinite error
    bound = 2 * UNIT_ROUNDOFF[spec.dtype] + 8 * UNIT_ROUNDOFF["float32"]
    case.check(prefix + "keys_vs_float64", err <= bound, {"max_rel_l2": err, "bound": bound})
    moved = (seg.positions != data.new_pos)[keep]
    if bool((~moved).any()):
        case.check(prefix + "keys_unmoved_bit_identical", _same_bytes(k_got[~moved], seg.k[keep][~moved]))
    # (d) channels the rope does not touch
    other = torch.ones(lay.head_dim, dtype=torch.bool, device=raw.device)
    other[rs:rs + rd] = False
    if bool(other.any()):
        case.check(prefix + "unrotated_channels_identical", _same_bytes(k_got[..., other], seg.k[keep][..., other]),
                   int(other.sum()))
    # (c) canary: everything outside the destination cells is still the poison
    mask = addressing.touched_mask(raw.numel(), lay, real_slots, layers, raw.device)
    untouched = torch.equal(raw[~mask], data.poison[~mask])
    case.check(prefix + "canary_untouched", untouched,
               {"outside_bytes": int((~mask).sum()), "changed": int((raw[~mask] != data.poison[~mask]).sum())})
    expected = addressing.destination_bytes(lay, num_tokens, SEGMENT_LAYERS)
    case.check(prefix + "destination_bytes_expected", int(mask.sum()) == expected,
               {"marked": int(mask.sum()), "expected": expected})
    return {"max_rel_l2": err, "bound": bound}


def _same_bytes(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    # Bits, not values: poison may read back as NaN (never equal to itself), and -0.0 == 0.0.
    if a is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_case(case: Case, data: CaseData, restore_fn: RestoreFn = restore,
             check_kernel: bool = False) -> dict[str, float]:
    """Restore with `restore_fn` (torch path by default) into a poisoned buffer and check it; returns the
    torch path's key error."""
    raw = data.poison.clone()
    restore_fn(raw, data.layout, data.segment, data.slots, data.new_pos, data.rope, first_layer=data.spec.first_layer)
    case.record("layout", {"order": data.layout.order, "packing": data.layout.packing,
                           "num_blocks": data.layout.num_blocks, "nbytes": data.layout.nbytes,
                           "tokens": data.segment.num_tokens, "padding_tokens": int((data.slots < 0).sum()),
                           "rotary_dim": data.rope.rotary_dim, "style": data.rope.style,
                           "scaling": data.rope.scaling_type})
    err = check_case(case, data, raw)
    case.record("key_error", err)
    if not check_kernel:
        return err
    from kmesh.cuda.restore_rope import launch_restore

    for path, slow in (("kernel_vector_or_auto", False), ("kernel_element", True)):
        out = data.poison.clone()
        plan = plan_restore(out, data.layout, data.segment, data.slots, data.new_pos, data.rope,
                            first_layer=data.spec.first_layer)
        launch = launch_restore(plan, force_slow=slow)
        torch.cuda.synchronize()
        case.record(f"{path}_launch", launch)
        same = torch.equal(out, raw)
        case.check(f"{path}_equals_torch_bytes", same, {"differing_bytes": int((out != raw).sum())})
        if not slow:
            check_case(case, data, out, prefix="kernel_")
    return err


# The models KMesh serves (SmolLM2-135M: theta 1e5; Qwen2.5: theta 1e6), head_dim 64, positions up to 32k.
ACCURACY_ROPES = {"smollm2": 1e5, "qwen2.5": 1e6}
ACCURACY_MAX_POS = 32768


def frequency_case(res: Result) -> None:
    """The reference's ω and attention factor equal kmesh.kv.rope's, bit for bit, for every rope the stage uses
    (the restore cases judge kmesh's float32 shift against the reference: an ω off by one float32 ulp times a
    shift of ~300 positions would already exceed their bound)."""
    used = {f"{name}-d{dim}": rope_for(name, dim) for name in ROPES for dim in sorted({HEAD_DIM, ROPE_DIM})}
    used.update({f"accuracy-{name}": _accuracy_rope(theta) for name, theta in ACCURACY_ROPES.items()})
    with res.case("rope-reference-frequencies", {"variants": sorted(used)}) as case:
        worst = 0
        for name, rope in used.items():
            ours = rotary_ref.frequencies(rope.rotary_dim, rope.theta, rope.scaling, rope.max_position)
            theirs = rope.inv_freq()
            ulp = rotary_ref.ulp_distance_f32(ours, theirs)
            factor = rotary_ref.attention_factor(rope.scaling)
            worst = max(worst, ulp)
            case.check(f"omega_and_attention_factor_equal_{name}",
                       torch.equal(ours, theirs) and factor == rope.attention_mscale(),
                       {"max_ulp": ulp, "channels": ours.numel(), "theta": rope.theta, "style": rope.style,
                        "scaling": rope.scaling_type, "attention_factor": factor,
                        "kmesh_attention_factor": rope.attention_mscale()})
        case.record("max_ulp", worst)


def _accuracy_rope(theta: float) -> RopeConfig:
    return RopeConfig(64, 64, theta, "neox", None, ACCURACY_MAX_POS)


def rope_accuracy_cases(res: Result, seed: int, device: str) -> None:
    """Shift accuracy against float64 (issue §21, recorded): fp32 ≤ 1e-5 relative up to 32k; bf16 no worse than
    a fresh bf16 rotation (vLLM's own where vLLM is installed, else KMesh's) + one bf16 rounding. The float64
    ground truth is kmesh.reference.rotary, never kmesh.kv.rope."""
    from kmesh.kv.rope import measure_accuracy
    from kmesh.vllm import available as vllm_available

    for index, (name, theta) in enumerate(ACCURACY_ROPES.items()):
        rope = _accuracy_rope(theta)

        def reference(xs: torch.Tensor, pos: torch.Tensor, rope: RopeConfig = rope) -> torch.Tensor:
            return rotary_ref.fresh_rotation(xs, pos, rope)

        with res.case(f"rope-accuracy-{name}", {"theta": theta, "max_pos": ACCURACY_MAX_POS, "tokens": 1024}) as case:
            r32 = measure_accuracy(rope, torch.float32, ACCURACY_MAX_POS, 1024, seed + 1000 + index, device=device,
                                   reference=reference)
            case.check("fp32_shift_max_rel_le_1e-5", r32["shift_exact_max_rel_l2"] <= 1e-5, r32)
            if vllm_available() and device == "cpu":
                from kmesh.vllm.rope_reference import vllm_fresh_rotation

                comparator, fresh = "vllm", vllm_fresh_rotation(rope, torch.bfloat16)
            else:  # the GPU machine has no vLLM: compare with KMesh's own fresh rotation, and say so
                comparator, fresh = "kmesh-rotate", None
            r16 = measure_accuracy(rope, torch.bfloat16, ACCURACY_MAX_POS, 1024, seed + 2000 + index, device=device,
                                   fresh=fresh, reference=reference)
            case.record("bf16_comparator", comparator)
            case.record("float64_reference", "kmesh.reference.rotary")
            roundoff = r16["unit_roundoff"]
            case.check("bf16_shift_of_fresh_keys_no_worse_than_fresh_plus_1_rounding",
                       r16["shift_fresh_max_rel_l2"] <= r16["fresh_max_rel_l2"] + roundoff, r16)
            case.check("bf16_shift_of_exact_keys_no_worse_than_fresh_plus_1_rounding",
                       r16["shift_exact_max_rel_l2"] <= r16["fresh_max_rel_l2"] + roundoff,
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
                           "(kmesh.reference.rotary; its ω equal kmesh's bit for bit), read back through an "
                           "independent byte-address reference (kmesh.reference."
                           "addressing), check values bit-identical, keys vs float64 within 2u+8u_f32, "
                           "canary outside destination cells, unrotated channels identical, vLLM-style layer "
                           "views agree with the reference"
                           + ("; kernel vector and element paths must equal the torch buffer byte for byte"
                              if check_kernel else ""))
    frequency_case(res)
    worst: dict[str, float] = {}
    for index, spec in enumerate(specs):
        with res.case(spec.id, asdict(spec)) as case:
            data = build_case(spec, cfg.seed + index, device)
            key_error = run_case(case, data, check_kernel=check_kernel)
            worst[spec.dtype] = max(worst.get(spec.dtype, 0.0), key_error["max_rel_l2"] / key_error["bound"])
    res.extra["worst_key_error_over_bound"] = worst
    rope_accuracy_cases(res, cfg.seed, device)
    res.extra["arrangements"] = list(ARRANGEMENTS)
    if check_kernel:
        res.extra["kernel"] = kernel_info("restore_rope")
    if len(specs) < 32:
        raise StageError(f"synthetic needs at least 32 cases, has {len(specs)}")
    return res
