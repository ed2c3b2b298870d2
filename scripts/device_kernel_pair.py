"""Paired timing on the GPU: the restore kernel's contiguous-segment path at an older revision vs this tree, the
qwen05b and mha-large shapes of restore_bench (bf16), 15 kept pairs (2 warm-up), order alternating, CUDA events after
a queued GPU sleep, 20 launches per interval; both kernels' outputs compared byte for byte first.
    git show fbfb82f:kernels/restore_rope.cu > scratch/restore_rope_old.cu     # here (scratch/ travels, untracked)
    run: source scripts/device-env.sh && OLD_SOURCE=scratch/restore_rope_old.cu python3 scripts/device_kernel_pair.py
The old kernel takes the parameters of its revision: the trailing gather parameters of this tree are left off."""
import json, os, statistics, subprocess, sys
import cupy, numpy as np, torch
from kmesh.cuda import restore_rope as rr
from kmesh.stages.restore_bench.cases import build, shape, SLEEP_CYCLES

out = os.environ.get("OUT", "/tmp")
cubins = {}
for name, src in (("old", os.environ.get("OLD_SOURCE", "scratch/restore_rope_old.cu")), ("new", "kernels/restore_rope.cu")):
    cub = f"/tmp/{name}.cubin"
    subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_90,code=sm_90", src,
                    "-o", cub], check=True)
    cubins[name] = cupy.RawModule(path=cub)
res = {}
for sname in ("qwen05b", "mha-large"):
    b = build(shape(sname), 7, "cuda")
    plan = b.plan
    src = rr.source_of(plan)
    fast = rr.vector_path_ok(plan, src)
    _, block, _ = rr.launch_shape(plan, fast)
    (t0, nt, grid), = rr.token_ranges(plan, fast)
    args = rr.kernel_args(plan, src, plan.slots, plan.moved, fast, t0, nt)
    fns = {"old": (cubins["old"].get_function("restore_rope_bf16"), args[:-5]),
           "new": (cubins["new"].get_function("restore_rope_bf16"), args)}
    outs = {}
    for k, (fn, a) in fns.items():
        buf = b.raw.clone()
        a2 = (np.uint64(buf.data_ptr()),) + tuple(a[1:])
        fn(grid, block, a2); torch.cuda.synchronize(); outs[k] = buf
    equal = bool(torch.equal(outs["old"], outs["new"]))
    times = {"old": [], "new": []}
    reps = 20
    for i in range(17):
        order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
        for k in order:
            fn, a = fns[k]
            torch.cuda._sleep(SLEEP_CYCLES)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                fn(grid, block, a)
            e.record(); torch.cuda.synchronize()
            if i >= 2:
                times[k].append(s.elapsed_time(e) / reps * 1e3)
    ratios = [n / o for o, n in zip(times["old"], times["new"])]
    res[sname] = {"bytes_equal": equal, "old_us": statistics.median(times["old"]), "new_us": statistics.median(times["new"]),
                  "median_ratio_new_over_old": statistics.median(ratios), "new_faster": sum(r < 1 for r in ratios),
                  "pairs": len(ratios), "old_us_all": times["old"], "new_us_all": times["new"]}
    print(sname, {k: v for k, v in res[sname].items() if not k.endswith("_all")})
json.dump(res, open(f"{out}/kernel_pair.json", "w"), indent=1)
