"""GPU: where the time of one child's prefill goes, per arm (full / kmesh), at 4k and 16k tokens.

torch.profiler (CUDA activity) over 3 eager blends per arm after 2 warm-ups; prints the top kernels by total
CUDA time and writes them as JSON to argv[1], with each arm's kernel-time sum and CUDA-graph replay time.
"""
import json
import sys

import torch
from gpu_timing import timed
from torch.profiler import ProfilerActivity, profile

from kmesh.config import load_config
from kmesh.model.blend import blend
from kmesh.model.graphs import GraphedBlend
from kmesh.segments import restore_child
from kmesh.stages import equivalence as eq
from kmesh.workload import build

cfg = load_config(profile="cuda")
eq.deterministic_kernels()
s = eq._setup(cfg)
r = s.runner
out = {}
for T in (4096, 16384):
    wl = build(s.tok, cfg.seed, s.workload.spec.scaled(T))
    ex = eq.leader_prefill(r, wl, f"kmesh-eq/bp-{T}".encode())
    child = wl.children[0]
    ids = torch.tensor(child.ids, device=s.device)
    cache = r.new_cache(T, wl.spec.block_size)
    restored = restore_child(cache, ex.catalog, ex.raw, child, r, "cuda")
    none = torch.zeros(T, dtype=torch.bool)
    for arm, rmask in (("full", none), ("kmesh", restored)):
        for _ in range(2):
            blend(r, ids, cache, rmask, s.ctx.repair, arm)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                blend(r, ids, cache, rmask, s.ctx.repair, arm)
            torch.cuda.synchronize()
        ka = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in ka) / 3 / 1e3
        top = [{"name": e.key[:120], "ms_per_blend": e.device_time_total / 3 / 1e3, "calls_per_blend": e.count / 3}
               for e in ka[:18]]
        g = GraphedBlend(r, ids, cache, rmask, s.ctx.repair, arm)
        replay_ms = timed(g.replay, reps=10)
        out[f"{T}_{arm}"] = {"kernel_ms_sum": total, "graph_replay_ms_median": replay_ms, "top": top}
        print(T, arm, round(total, 2), "graph", round(replay_ms, 2), flush=True)
        for t in top[:12]:
            print("   ", round(t["ms_per_blend"], 3), t["calls_per_blend"], t["name"][:90], flush=True)
        del g
        restore_child(cache, ex.catalog, ex.raw, child, r, "cuda")
json.dump(out, open(sys.argv[1], "w"), indent=1)
