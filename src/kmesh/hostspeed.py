"""How fast this machine's cores run two fixed workloads, and what they are: the facts that tell apart times of the
two README commands taken on different hosts.

The "2-core machine" is not one machine: sessions and CI get hosts of different generations under one name (a
virtual CPU that calls itself "Intel(R) Xeon(R) Processor"), and the same code's make test time differs by more than
half between them (docs/testing.md, "The two commands' budget"). So every recorded run of the two commands carries
these facts (docs/measurements/two-commands.json), and both commands print them first.

    python -m kmesh host-speed [--json]

Each workload runs on one thread, a warm-up and then the fastest of REPEATS (the least disturbed; noise only adds):
an interpreter loop (the work of imports, Snakemake and the harness) and a float32 matmul at SmolLM2's hidden size
(the work of the model stages).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kmesh.provenance import cpu_model

REPEATS = 3
_LOOP_N = 2_000_000
_MATMUL = (256, 576, 1536, 40)   # rows, hidden, intermediate, repetitions: SmolLM2-135M's MLP shapes


def cpu_flags() -> list[str]:
    """The vector extensions the CPU reports (the ones that change which kernels torch and wheels run)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "amx")))
    except OSError:
        pass
    return []


def _fastest(fn: Any) -> float:
    fn()
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _loop() -> None:
    acc = 0
    for i in range(_LOOP_N):
        acc += i * i & 7


def _matmul() -> None:
    import torch

    rows, hidden, inter, reps = _MATMUL
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, inter, generator=g)
    for _ in range(reps):
        x @ w


def measure() -> dict[str, Any]:
    """The host's CPU, cores, vector extensions and the two workloads' seconds (lower is faster)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul_s = _fastest(_matmul)
    finally:
        torch.set_num_threads(threads)
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "avx512": any(f.startswith("avx512") for f in cpu_flags()),
            "vector_flags": cpu_flags(), "python_loop_s": round(_fastest(_loop), 4), "matmul_s": round(matmul_s, 4)}


def line(m: dict[str, Any]) -> str:
    return (f"{m['cpu']}, {m['cores']} cores, {'with' if m['avx512'] else 'without'} AVX-512; one core runs a fixed "
            f"interpreter loop in {m['python_loop_s']:.3f} s and SmolLM2-sized matmuls in {m['matmul_s']:.3f} s "
            f"(kmesh.hostspeed: lower is faster)")


def main(as_json: bool = False, out: str | None = None) -> int:
    m = measure()
    if out is not None:
        Path(out).write_text(json.dumps(m, indent=1) + "\n")
    print(json.dumps(m) if as_json else line(m))
    return 0
