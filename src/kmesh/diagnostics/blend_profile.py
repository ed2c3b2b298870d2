"""Where the time of one child's prefill goes, per arm (full / repair), at 4k and 16k tokens (GPU).

For each prompt length the equivalence workload is scaled to it, the leader prefilled and child A restored
(kmesh.harness.child.restore_child, cuda backend). Per arm: 2 eager warm-up blends, then torch.profiler (CUDA activity)
over 3 eager blends, then the same blend as one CUDA graph (kmesh.model.graphs) replayed 10 times.

Output (JSON, --out; printed as well), one entry `<T>_<arm>`: kernel_ms_sum (all CUDA kernel time per blend, ms),
graph_replay_ms_median (the blend's wall time on the GPU with launch overhead gone) and top (the 18 kernels with
the most CUDA time: name, ms_per_blend, calls_per_blend). kernel_ms_sum well below the eager time means launches
dominate; the repair arm's top rows against the full arm's say which kernels repair adds.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kmesh.diagnostics._common import ScaledLeader, load, parser, require_cuda, scaled_leaders, timed, write_json
from kmesh.harness.child import restore_child
from kmesh.harness.modelsetup import ModelSetup, deterministic_kernels, equivalence_setup
from kmesh.model.blend import blend
from kmesh.model.graphs import GraphedBlend

PROMPT_TOKENS = (4096, 16384)
PROFILED = 3       # eager blends inside the profiler, per arm
TOP = 18           # kernels kept per arm


def profile_arms(setup: ModelSetup, scaled: ScaledLeader) -> dict[str, Any]:
    """`<T>_<arm>` -> kernel_ms_sum, graph_replay_ms_median, top for both arms at one prompt length."""
    runner, child, export, length = setup.runner, scaled.child, scaled.export, scaled.prompt_tokens
    ids = torch.tensor(child.ids, device=setup.device)
    cache = runner.new_cache(length, scaled.workload.spec.block_size)
    restored = restore_child(cache, export.catalog, export.raw, child, runner, "cuda")
    out: dict[str, Any] = {}
    for arm, restored_mask in (("full", torch.zeros(length, dtype=torch.bool)), ("repair", restored)):
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
        out[f"{length}_{arm}"] = {"kernel_ms_sum": total_ms, "graph_replay_ms_median": replay_ms, "top": top}
        print(length, arm, round(total_ms, 2), "graph", round(replay_ms, 2), flush=True)
        for row in top[:12]:
            print("   ", round(row["ms_per_blend"], 3), row["calls_per_blend"], row["name"][:90], flush=True)
        del graph
        # the blends wrote recomputed rows into the cache: the next arm starts from the restored state again
        restore_child(cache, export.catalog, export.raw, child, runner, "cuda")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("blend_profile", __doc__, config=True, out=True).parse_args(argv)
    require_cuda("blend_profile")
    cfg = load(args)
    deterministic_kernels()
    setup = equivalence_setup(cfg)
    out: dict[str, Any] = {}
    for scaled in scaled_leaders(setup, PROMPT_TOKENS, "bp"):
        out.update(profile_arms(setup, scaled))
    write_json(args.out, out, cfg)
    return 0
