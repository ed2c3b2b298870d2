"""The restore kernel's contiguous-segment path of another revision vs this tree's, paired on one GPU (GPU).

    git show fbfb82f:kernels/restore_rope.cu > scratch/restore_rope_old.cu        # here; scratch/ travels untracked
    python -m kmesh diagnose kernel_pair --old-source scratch/restore_rope_old.cu --out $OUT/kernel_pair.json

Both sources are compiled for sm_90 and launched on the same validated plan (kmesh.kv.restore), bf16, the qwen05b and
mha-large shapes of restore_bench (24 × 8192 × 2 × 64 and 32 × 4096 × 8 × 128: a segment saved at 0..T-1, restored at
+1000 into blocks scattered by a seeded block table); the outputs are compared byte for byte first. Then 2 warm-up
and 15 kept pairs, order alternating, each interval 20 launches timed by CUDA events after a queued GPU sleep (the
host's launch work hidden). The old kernel takes the parameters of its revision: this tree's trailing gather
parameters are left off. Output: median µs per launch of each, the median per-pair ratio new / old, pairs new won.
"""
from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import numpy as np
import torch

from kmesh.diagnostics._common import parser, require_cuda, write_json

SHAPES = {"qwen05b": (24, 8192, 2, 64), "mha-large": (32, 4096, 8, 128)}
SHIFT, REPS, PAIRS, WARMUP, SLEEP_CYCLES = 1000, 20, 15, 2, 20_000_000


def _plan(layers: int, tokens: int, heads: int, dim: int, seed: int):
    from kmesh.kv.layout import KVLayout
    from kmesh.kv.restore import KVSegment, plan_restore
    from kmesh.kv.rope import RopeConfig

    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = (tokens + SHIFT + 15) // 16 + 8
    lay = KVLayout.paged("LBNHC", layers, blocks, 16, heads, dim, "bfloat16")
    k = torch.randn(tokens, layers, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(tokens, layers, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    old = torch.arange(tokens, device="cuda")
    new = old + SHIFT
    slots = torch.randperm(blocks, generator=gen, device="cuda")[new // 16] * 16 + new % 16
    raw = torch.randint(0, 256, (lay.nbytes,), generator=gen, device="cuda", dtype=torch.uint8)
    rope = RopeConfig(dim, dim, 1e6, "neox", None, 32768)
    return plan_restore(raw, lay, KVSegment(k, v, old, "bfloat16"), slots, new, rope), raw


def main(argv: list[str] | None = None) -> int:
    options = parser("kernel_pair", __doc__)
    options.add_argument("--old-source", type=Path, default=Path("scratch/restore_rope_old.cu"),
                         help="the other revision's kernels/restore_rope.cu")
    options.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    args = options.parse_args(argv)
    require_cuda("kernel_pair")
    import cupy

    from kmesh.cuda import restore_rope as rr

    modules = {}
    for name, src in (("old", args.old_source), ("new", Path("kernels/restore_rope.cu"))):
        cubin = Path(f"/tmp/kernel_pair_{name}.cubin")
        subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", str(src),
                        "-o", str(cubin)], check=True)
        modules[name] = cupy.RawModule(path=str(cubin))
    report = {}
    for shape_name, dims in SHAPES.items():
        plan, raw = _plan(*dims, seed=7)
        src = rr.source_of(plan)
        fast = rr.vector_path_ok(plan, src)
        _, block, _ = rr.launch_shape(plan, fast)
        (t0, nt, grid), = rr.token_ranges(plan, fast)
        args_new = rr.kernel_args(plan, src, plan.slots, plan.moved, fast, t0, nt)
        launches = {"old": (modules["old"].get_function("restore_rope_bf16"), args_new[:-5]),
                    "new": (modules["new"].get_function("restore_rope_bf16"), args_new)}
        outs = {}
        for name, (fn, a) in launches.items():
            buf = raw.clone()
            fn(grid, block, (np.uint64(buf.data_ptr()),) + tuple(a[1:]))
            torch.cuda.synchronize()
            outs[name] = buf
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(WARMUP + PAIRS):
            for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
                fn, a = launches[name]
                torch.cuda._sleep(SLEEP_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(REPS):
                    fn(grid, block, a)
                end.record()
                torch.cuda.synchronize()
                if i >= WARMUP:
                    times[name].append(start.elapsed_time(end) / REPS * 1e3)
        ratios = [n / o for o, n in zip(times["old"], times["new"])]
        report[shape_name] = {"bytes_equal": bool(torch.equal(outs["old"], outs["new"])),
                              "old_us": statistics.median(times["old"]), "new_us": statistics.median(times["new"]),
                              "median_ratio_new_over_old": statistics.median(ratios),
                              "new_faster": sum(r < 1 for r in ratios), "pairs": len(ratios),
                              "old_us_all": times["old"], "new_us_all": times["new"]}
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if not kk.endswith("_all")} for k, v in report.items()},
                     indent=1))
    if args.out is not None:
        write_json(args.out, report)
    return 0
