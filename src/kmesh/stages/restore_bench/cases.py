"""Inputs and arms of the restore benchmark (stage `restore_bench`): one seeded restore per shape.

A shape is a paged cache (vLLM's default NHD order LBNHC), a segment of `tokens` tokens saved at positions
0..T-1 and restored at +1000 into blocks scattered by a random block table; the cache starts as random bytes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from kmesh.errors import StageError
from kmesh.kv.layout import KVLayout
from kmesh.kv.restore import KVSegment, RestorePlan, capture, plan_restore
from kmesh.kv.rope import RopeConfig

SHIFT = 1000          # every token moves by this many positions (all of them rotate)
SLEEP_CYCLES = 20_000_000   # ~10 ms GPU sleep queued before each CUDA interval: the events then time the GPU only


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    kv_heads: int
    head_dim: int
    dtype: str
    order: str = "LBNHC"
    block_size: int = 16

    def params(self) -> dict[str, Any]:
        return asdict(self)


SHAPES: dict[str, Shape] = {
    # The H200 figures (docs/measurements/restore_h200.md) are for the first three.
    "qwen05b": Shape(24, 8192, 2, 64, "bfloat16"),        # Qwen2.5-0.5B-shaped: 96 MiB of K+V
    "mha-large": Shape(32, 4096, 8, 128, "bfloat16"),     # Llama-8B-shaped MHA cache: 512 MiB
    "qwen05b-fp8": Shape(24, 8192, 2, 64, "fp8_e4m3"),    # 48 MiB
    # CPU-sized (the cpu profile's budget): the same model shape, fewer tokens.
    "qwen05b-512": Shape(24, 512, 2, 64, "bfloat16"),     # 6 MiB
    "qwen05b-512-fp8": Shape(24, 512, 2, 64, "fp8_e4m3"),  # 3 MiB
}


def shape(name: str) -> Shape:
    if name not in SHAPES:
        raise StageError(f"restore_bench: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]


@dataclass
class Bench:
    """One shape's restore, validated and ready to run, plus the copy arm's buffers of the same bytes."""

    layout: KVLayout
    segment: KVSegment
    slots: torch.Tensor
    new_positions: torch.Tensor
    rope: RopeConfig
    raw: torch.Tensor          # the cache (random bytes), target of the timed restores
    plan: RestorePlan
    copy_src: torch.Tensor     # exactly segment.nbytes random bytes
    copy_dst: torch.Tensor

    @property
    def seg_bytes(self) -> int:
        return self.segment.nbytes

    def fresh_plan(self, raw: torch.Tensor) -> RestorePlan:
        return plan_restore(raw, self.layout, self.segment, self.slots, self.new_positions, self.rope)


def build(spec: Shape, seed: int, device: str) -> Bench:
    gen = torch.Generator(device=device).manual_seed(seed)
    T, block = spec.tokens, spec.block_size
    blocks = (T + SHIFT + block - 1) // block + 8
    lay = KVLayout.paged(spec.order, spec.layers, blocks, block, spec.kv_heads, spec.head_dim, spec.dtype,
                         k_scale=0.0625, v_scale=0.03125)
    shp = (T, spec.layers, spec.kv_heads, spec.head_dim)
    if spec.dtype.startswith("fp8"):   # finite fp8 bytes (no NaN codes): sign 0, all exponents/mantissas below 0x7F
        k = torch.randint(0, 0x7F, shp, generator=gen, device=device, dtype=torch.uint8)
        v = torch.randint(0, 0x7F, shp, generator=gen, device=device, dtype=torch.uint8)
    else:
        k = torch.randn(shp, generator=gen, device=device).to(lay.storage_dtype)
        v = torch.randn(shp, generator=gen, device=device).to(lay.storage_dtype)
    old = torch.arange(T, device=device)
    new = old + SHIFT
    table = torch.randperm(blocks, generator=gen, device=device)
    slots = table[new // block] * block + new % block
    seg = KVSegment(k, v, old, spec.dtype, lay.k_scale, lay.v_scale)
    rope = RopeConfig(spec.head_dim, spec.head_dim, 1e6, "neox", None, 32768)
    raw = torch.randint(0, 256, (lay.nbytes,), generator=gen, device=device, dtype=torch.uint8)
    plan = plan_restore(raw, lay, seg, slots, new, rope)
    src = torch.randint(0, 256, (seg.nbytes,), generator=gen, device=device, dtype=torch.uint8)
    return Bench(lay, seg, slots, new, rope, raw, plan, src, torch.empty_like(src))


def timed(ops: dict[str, Callable[[], None]], reps: dict[str, int], device: str) -> Callable[..., None]:
    """A kmesh.bench run function: `reps[arm]` back-to-back executions of `ops[arm]` in one interval."""
    def run_arm(arm: str, _child: object, iv: Any) -> None:
        if device == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)
        with iv.part("exec"):
            for _ in range(reps[arm]):
                ops[arm]()
    return run_arm


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def check_restored(bench: Bench, run: Callable[[RestorePlan], None]) -> dict[str, int]:
    """Restore into a freshly poisoned cache and compare bytes with what must be there.

    values_differ: restored V cells vs the segment's V (a restore copies values unchanged);
    outside_differ: bytes outside the destination cells vs the poison (nothing else may be written).
    Returns the poisoned-and-restored buffer's byte counts; the buffer itself is returned under "_buf".
    """
    gen = torch.Generator(device=bench.raw.device).manual_seed(12345)
    poison = torch.randint(0, 256, bench.raw.shape, generator=gen, device=bench.raw.device, dtype=torch.uint8)
    buf = poison.clone()
    run(bench.fresh_plan(buf))
    got = capture(buf, bench.layout, bench.slots, bench.new_positions)
    values_differ = int((_as_bytes(got.v) != _as_bytes(bench.segment.v)).sum())
    # Expected whole buffer: the poison with exactly the destination cells replaced by what the restore wrote.
    expect = poison.clone()
    flat = bench.layout.elements(expect)
    bb, nn = bench.layout.split_slots(bench.slots)
    bench.layout.k_tensor(flat)[:, bb, nn] = got.k.transpose(0, 1)
    bench.layout.v_tensor(flat)[:, bb, nn] = got.v.transpose(0, 1)
    outside_differ = int((expect != buf).sum())
    return {"values_differ": values_differ, "outside_differ": outside_differ, "_buf": buf}  # type: ignore[dict-item]
