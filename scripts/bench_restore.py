"""GPU benchmark of restore: the restore_rope kernel vs a plain device copy of the same bytes, and vs the torch path.

    python scripts/bench_restore.py --out results/cuda/bench_restore [--pairs 7] [--shapes qwen05b,mha-large]
        [--variants ",-DRESTORE_ROT_CHUNK=16"]   # tuning: extra nvcc flags per kernel variant; "" = as the kernels stage builds

Design (kmesh.bench, DESIGN §5): per shape, two comparisons of matched pairs, arm order alternating,
one warm-up pair excluded:
  copy  vs kernel : torch's device-to-device copy of exactly the segment's bytes (the bandwidth ceiling:
                    it reads and writes every byte once, as a restore must) against the kernel;
  torch vs kernel : kmesh.restore's torch path against the kernel, same validated plan.
Each timed interval is a CUDA-event pair around `reps` back-to-back executions, preceded (outside the
interval) by a GPU sleep so that host-side launch work is queued ahead and the events time the GPU only.
Time per execution = interval / reps. Reported: medians of the per-pair times, the median of the
paired ratios, how many pairs the kernel won, and bandwidth = bytes counted / time (bytes = segment
read + cells written + tables; for the copy: read + write of the same segment bytes).
Validation and the shift tables (shared by both arms: `plan_restore`) are timed separately.
After timing, the kernel's buffer must equal the torch path's buffer byte for byte (every variant).
Variants (compile-time tunables of kernels/restore_rope.cu) each get both comparisons; the goals are
checked on the first variant (the default build); the last table names the fastest variant per shape.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kmesh.bench import run_pairs
from kmesh.config import load_config
from kmesh.layout import KVLayout
from kmesh.restore import KVSegment, plan_restore
from kmesh.result import Result
from kmesh.rope import RopeConfig

SHAPES = {
    # name: (layers, tokens, kv_heads, head_dim, dtype, order, block_size)
    "qwen05b": (24, 8192, 2, 64, "bfloat16", "LBNHC", 16),       # Qwen2.5-0.5B-shaped: 96 MiB of K+V
    "mha-large": (32, 4096, 8, 128, "bfloat16", "LBNHC", 16),    # Llama-8B-shaped MHA cache: 512 MiB
    "qwen05b-fp8": (24, 8192, 2, 64, "fp8_e4m3", "LBNHC", 16),   # 48 MiB
}
SLEEP_CYCLES = 20_000_000   # ~10 ms at ~2 GHz: enough queue-ahead for the longest host-side launch sequence


def build(shape: str, seed: int):
    L, T, H, D, dtype, order, n = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = (T + 1000 + n - 1) // n + 8
    lay = KVLayout.paged(order, L, blocks, n, H, D, dtype, k_scale=0.0625, v_scale=0.03125)
    store = lay.storage_dtype
    if dtype.startswith("fp8"):
        k = torch.randint(0, 0x7F, (T, L, H, D), generator=g, device="cuda", dtype=torch.uint8)
        v = torch.randint(0, 0x7F, (T, L, H, D), generator=g, device="cuda", dtype=torch.uint8)
    else:
        k = torch.randn(T, L, H, D, generator=g, device="cuda").to(store)
        v = torch.randn(T, L, H, D, generator=g, device="cuda").to(store)
    old = torch.arange(T, device="cuda")
    new = old + 1000
    table = torch.randperm(blocks, generator=g, device="cuda")
    slots = table[new // n] * n + new % n
    seg = KVSegment(k, v, old, dtype, lay.k_scale, lay.v_scale)
    rope = RopeConfig(D, D, 1e6, "neox", None, 32768)
    raw = torch.randint(0, 256, (lay.nbytes,), generator=g, device="cuda", dtype=torch.uint8)
    return lay, seg, slots, new, rope, raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (bench_restore.json, bench_restore.md)")
    ap.add_argument("--pairs", type=int, default=None, help="matched pairs (default: config timing.pairs)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20, help="executions per timed interval (copy/kernel)")
    ap.add_argument("--torch-reps", type=int, default=3, help="executions per interval in torch-vs-kernel")
    ap.add_argument("--variants", default="", help="comma-separated nvcc flag sets; the first is the default build")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_restore: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = load_config(profile="cuda")
    pairs = args.pairs or cfg.data["timing"]["pairs"]
    warmup = cfg.data["timing"]["warmup"]
    from kmesh.cuda import configure, kernel_info
    from kmesh.cuda.restore_rope import launch_restore

    variants = args.variants.split(",")

    def use_variant(flags: str) -> None:
        os.environ["KMESH_KERNEL_FLAGS"] = flags
        configure(None)

    res = Result.begin("bench_restore", cfg)
    res.extra["design"] = __doc__.split("Design", 1)[1].strip()
    res.extra["gpu"] = torch.cuda.get_device_name()
    rows = []
    for si, shape in enumerate(args.shapes.split(",")):
        with res.case(shape, dict(zip(("layers", "tokens", "kv_heads", "head_dim", "dtype", "order", "block_size"),
                                      SHAPES[shape]))) as c:
            lay, seg, slots, new, rope, raw = build(shape, cfg.seed + si)
            t0 = time.perf_counter()
            plan = plan_restore(raw, lay, seg, slots, new, rope)
            torch.cuda.synchronize()
            c.record("plan_seconds", time.perf_counter() - t0)
            counted = plan.bytes_moved()
            seg_bytes = seg.nbytes
            src = torch.randint(0, 256, (seg_bytes,), device="cuda", dtype=torch.uint8)
            dst = torch.empty_like(src)
            ops = {"copy": lambda: dst.copy_(src), "kernel": lambda: launch_restore(plan),
                   "torch": lambda: plan.run("torch")}

            def timed(reps_of):
                def fn(arm, child, iv):
                    torch.cuda._sleep(SLEEP_CYCLES)
                    with iv.part("exec"):
                        for _ in range(reps_of[arm]):
                            ops[arm]()
                return fn

            per_variant = {}
            for flags in variants:
                use_variant(flags)
                launch = launch_restore(plan)   # compiles/loads this variant outside the timing
                reps1 = {"copy": args.reps, "kernel": args.reps}
                t_ck = run_pairs(timed(reps1), ("copy", "kernel"), [shape], pairs=pairs, warmup=warmup,
                                 device="cuda", progress=False)
                copy_t = [x / reps1["copy"] for x in t_ck.per_pair("copy", "exec")]
                kern_t = [x / reps1["kernel"] for x in t_ck.per_pair("kernel", "exec")]
                ratio = statistics.median(c_ / k_ for c_, k_ in zip(copy_t, kern_t))
                reps2 = {"torch": args.torch_reps, "kernel": args.torch_reps}
                t_tk = run_pairs(timed(reps2), ("torch", "kernel"), [shape], pairs=pairs, warmup=warmup,
                                 device="cuda", progress=False)
                torch_t = [x / reps2["torch"] for x in t_tk.per_pair("torch", "exec")]
                kern2_t = [x / reps2["kernel"] for x in t_tk.per_pair("kernel", "exec")]
                # correctness of this variant: both paths into identically poisoned buffers, whole buffers equal
                a = torch.randint(0, 256, raw.shape, device="cuda", dtype=torch.uint8)
                b = a.clone()
                plan_restore(a, lay, seg, slots, new, rope).run("torch")
                launch_restore(plan_restore(b, lay, seg, slots, new, rope))
                torch.cuda.synchronize()
                differ = int((a != b).sum())
                del a, b
                name = flags or "default"
                per_variant[name] = {
                    "launch": launch, "copy_s": statistics.median(copy_t), "kernel_s": statistics.median(kern_t),
                    "copy_GBps": 2 * seg_bytes / statistics.median(copy_t) / 1e9,
                    "kernel_GBps": counted["total"] / statistics.median(kern_t) / 1e9,
                    "time_ratio_copy_over_kernel": ratio,
                    "bandwidth_ratio_kernel_over_copy": ratio * counted["total"] / (2 * seg_bytes),
                    "kernel_won_vs_copy": sum(k_ < c_ for c_, k_ in zip(copy_t, kern_t)),
                    "torch_s": statistics.median(torch_t), "kernel_s_in_torch_pairs": statistics.median(kern2_t),
                    "speedup_vs_torch": statistics.median(t_ / k_ for t_, k_ in zip(torch_t, kern2_t)),
                    "kernel_won_vs_torch": sum(k_ < t_ for t_, k_ in zip(torch_t, kern2_t)),
                    "differing_bytes_vs_torch": differ, "pairs": pairs, "bytes": counted}
                c.check(f"kernel_equals_torch_bytes[{name}]", differ == 0, differ)
                res.timings[f"{shape}:copy_vs_kernel[{name}]"] = t_ck.to_dict()
                res.timings[f"{shape}:torch_vs_kernel[{name}]"] = t_tk.to_dict()
            summary = per_variant[variants[0] or "default"]
            ok = {k: v for k, v in per_variant.items() if v["differing_bytes_vs_torch"] == 0}
            best = min(ok, key=lambda k: ok[k]["kernel_s"]) if ok else None
            c.record("summary", summary)
            c.record("variants", per_variant)
            c.record("fastest_variant", best)
            c.check("bandwidth_goal_85pct_of_copy", summary["bandwidth_ratio_kernel_over_copy"] >= 0.85,
                    summary["bandwidth_ratio_kernel_over_copy"])
            c.check("speedup_goal_20x_torch", summary["speedup_vs_torch"] >= 20, summary["speedup_vs_torch"])
            use_variant(variants[0])
            rows.append((shape, seg_bytes, summary, per_variant, best))
            raw = plan = seg = src = dst = None   # free this shape's buffers before the next one
            torch.cuda.empty_cache()
    res.extra["kernel"] = kernel_info("restore_rope")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res.write(out / "bench_restore.json")
    head = ("| shape | segment MiB | variant | copy GB/s | kernel GB/s | kernel/copy bandwidth | copy/kernel time | "
            "kernel µs | torch µs | speedup vs torch | pairs won (copy, torch) | bytes ≠ torch |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def row(shape: str, nb: int, name: str, s: dict) -> str:
        return (f"| {shape} | {nb / 2**20:.0f} | {name} | {s['copy_GBps']:.0f} | {s['kernel_GBps']:.0f} | "
                f"{s['bandwidth_ratio_kernel_over_copy']:.3f} | {s['time_ratio_copy_over_kernel']:.3f} | "
                f"{s['kernel_s'] * 1e6:.1f} | {s['torch_s'] * 1e6:.0f} | {s['speedup_vs_torch']:.1f}× | "
                f"{s['kernel_won_vs_copy']}/{s['pairs']}, {s['kernel_won_vs_torch']}/{s['pairs']} | "
                f"{s['differing_bytes_vs_torch']} |")
    for shape, nb, _, pv, _ in rows:
        lines += [row(shape, nb, name, v) for name, v in pv.items()]
    lines += ["", "Fastest variant per shape (byte-identical to the torch path):", "", head, lines[1]]
    lines += [row(shape, nb, best, pv[best]) for shape, nb, _, pv, best in rows if best is not None]
    (out / "bench_restore.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
