"""Where the time of one child's prefill goes, per arm (full / kmesh), at 4k and 16k tokens (GPU).

For each prompt length the equivalence workload is scaled to it, the leader prefilled and child A restored
(kmesh.segments.restore_child, cuda backend). Per arm: 2 eager warm-up blends, then torch.profiler (CUDA activity)
over 3 eager blends, then the same blend as one CUDA graph (kmesh.model.graphs) replayed 10 times.

Output (JSON, --out; printed as well), one entry `<T>_<arm>`: kernel_ms_sum (all CUDA kernel time per blend, ms),
graph_replay_ms_median (the blend's wall time on the GPU with launch overhead gone) and top (the 18 kernels with
the most CUDA time: name, ms_per_blend, calls_per_blend). kernel_ms_sum well below the eager time means launches
dominate; the kmesh arm's top rows against the full arm's say which kernels repair adds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kmesh.diagnostics._common import add_config_options, load, parser, require_cuda, timed, write_json
from kmesh.model.blend import blend
from kmesh.model.graphs import GraphedBlend
from kmesh.modelsetup import deterministic_kernels, equivalence_setup, leader_prefill
from kmesh.segments import restore_child
from kmesh.workload import build

PROMPT_TOKENS = (4096, 16384)
PROFILED = 3       # eager blends inside the profiler, per arm
TOP = 18           # kernels kept per arm


def main(argv: list[str] | None = None) -> int:
    options = parser("blend_profile", __doc__)
    add_config_options(options)
    options.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = options.parse_args(argv)
    require_cuda("blend_profile")
    cfg = load(args)
    deterministic_kernels()
    setup = equivalence_setup(cfg)
    runner = setup.runner
    out: dict[str, Any] = {}
    for prompt_len in PROMPT_TOKENS:
        workload = build(setup.tok, cfg.seed, setup.workload.spec.scaled(prompt_len))
        export = leader_prefill(runner, workload, f"kmesh-eq/bp-{prompt_len}".encode())
        child = workload.children[0]
        ids = torch.tensor(child.ids, device=setup.device)
        cache = runner.new_cache(prompt_len, workload.spec.block_size)
        restored = restore_child(cache, export.catalog, export.raw, child, runner, "cuda")
        nothing_restored = torch.zeros(prompt_len, dtype=torch.bool)
        for arm, restored_mask in (("full", nothing_restored), ("kmesh", restored)):
            for _ in range(2):
                blend(runner, ids, cache, restored_mask, setup.ctx.repair, arm)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(PROFILED):
                    blend(runner, ids, cache, restored_mask, setup.ctx.repair, arm)
                torch.cuda.synchronize()
            events = sorted(prof.key_averages(), key=lambda event: -event.device_time_total)
            total_ms = sum(event.device_time_total for event in events) / PROFILED / 1e3
            top = [{"name": event.key[:120], "ms_per_blend": event.device_time_total / PROFILED / 1e3,
                    "calls_per_blend": event.count / PROFILED} for event in events[:TOP]]
            graph = GraphedBlend(runner, ids, cache, restored_mask, setup.ctx.repair, arm)
            replay_ms = timed(graph.replay, reps=10)
            out[f"{prompt_len}_{arm}"] = {"kernel_ms_sum": total_ms, "graph_replay_ms_median": replay_ms, "top": top}
            print(prompt_len, arm, round(total_ms, 2), "graph", round(replay_ms, 2), flush=True)
            for row in top[:12]:
                print("   ", round(row["ms_per_blend"], 3), row["calls_per_blend"], row["name"][:90], flush=True)
            del graph
            # the blends wrote recomputed rows into the cache: the next arm starts from the restored state again
            restore_child(cache, export.catalog, export.raw, child, runner, "cuda")
    write_json(args.out, out)
    return 0
