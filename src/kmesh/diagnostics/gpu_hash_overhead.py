"""Where a GPU hash request's time goes, per request path: host issue time, CUDA-event time, GPU-only time (GPU).

Sets: `set` = the integrity stage's small set (4 objects of 3 MiB), `big` = one 1 GiB object. Algorithms: blake3 and
sha256-tree (512-byte chunks, the stage's sweep winner). Paths, all through kmesh.integrity.gpu:
  passes       hash_async with the per-pass kernels (set_one_launch(False)), graph replay on
  setN         hash_async with the one-launch kernel of N leaves per block (N = 64, 128, 256), graph replay on
  requestN     a SetRequest (prepare once; launch() + result() per request), the one-launch kernel of N
Per repetition the paths run in a rotating order (matched: every path sees the same machine state), after 3
unrecorded requests per path (plan + capture). Per request three samples:
  issue_us     host time of issuing the request alone (hash_async(), or SetRequest.launch())
  event_us     CUDA-event time around the request as the integrity stage measures it (kmesh.bench.Intervals)
  gpu_only_us  events around the request queued behind a 2 ms sleep kernel: the host's cost is hidden, what is
               left is the GPU's own work
Every request's digests are compared with the CPU reference (the blake3 package, kmesh.integrity.cpu); a mismatch
stops the run. Output: one JSON object (printed; also --out) with per set, algorithm and path the median of each
sample, the GB/s of event_us, and per path the median ratio vs `passes` of paired event_us;
docs/measurements/integrity-h200/README.md reads such files.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kmesh.bench import Intervals
from kmesh.diagnostics._common import parser, require_cuda, write_json
from kmesh.integrity import get, gpu

SETS = {"set": (4, 3 << 20), "big": (1, 1 << 30)}
ALGORITHMS = (("blake3", {}), ("sha256-tree", {"chunk_bytes": 512}))
SLEEP_CYCLES = 2_000_000     # torch.cuda._sleep before the GPU-only sample: long enough to queue the request behind


class DigestError(AssertionError):
    """A path's digests differ from the CPU reference."""


def make_paths(algorithm: str, options: dict, buffers: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """name -> issue(): issues one request and returns its result() callable."""
    paths: dict[str, Callable[[], Any]] = {}

    def via_async(one_launch: bool, threads: int) -> Callable[[], Any]:
        def issue() -> Any:
            prev_one, prev_t = gpu.set_one_launch(one_launch), gpu.SET_THREADS[algorithm]
            gpu.SET_THREADS[algorithm] = threads
            try:
                return gpu.hash_async(algorithm, buffers, **options).result
            finally:
                gpu.set_one_launch(prev_one)
                gpu.SET_THREADS[algorithm] = prev_t
        return issue

    paths["passes"] = via_async(False, gpu.SET_THREADS[algorithm])
    for n in gpu.SET_CHOICES:
        paths[f"set{n}"] = via_async(True, n)
    for n in gpu.SET_CHOICES:
        prev = gpu.SET_THREADS[algorithm]
        gpu.SET_THREADS[algorithm] = n
        try:
            req = gpu.prepare(algorithm, buffers, **options)
        finally:
            gpu.SET_THREADS[algorithm] = prev

        def issue(req: gpu.SetRequest = req) -> Any:
            req.launch()
            return req.result
        paths[f"request{n}"] = issue
    return paths


def samples_of(paths: dict[str, Callable[[], Any]], want: list[bytes], reps: int) -> dict[str, dict[str, list[float]]]:
    names = list(paths)
    samples: dict[str, dict[str, list[float]]] = {n: {"issue_us": [], "event_us": [], "gpu_only_us": []} for n in names}

    def check(name: str, got: list[bytes]) -> None:
        if got != want:
            raise DigestError(f"{name}: digests differ from the CPU reference")

    for name in names:                                   # plans, captures, module loads outside the samples
        for _ in range(3):
            check(name, paths[name]()())
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            issue = paths[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            wait = issue()
            issued = time.perf_counter()
            check(name, wait())
            samples[name]["issue_us"].append((issued - start) * 1e6)
            intervals = Intervals("cuda")
            with intervals.part("hash"):
                wait = issue()
            check(name, wait())
            samples[name]["event_us"].append(intervals.seconds()["hash"] * 1e6)
            torch.cuda._sleep(SLEEP_CYCLES)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            wait = issue()
            end.record()
            check(name, wait())
            torch.cuda.synchronize()
            samples[name]["gpu_only_us"].append(begin.elapsed_time(end) * 1e3)
    return samples


def summarise(samples: dict[str, dict[str, list[float]]], nbytes: int) -> dict[str, Any]:
    base = samples["passes"]["event_us"]
    out: dict[str, Any] = {}
    for name, s in samples.items():
        row = {k: round(statistics.median(v), 2) for k, v in s.items()}
        row["event_GBps"] = round(nbytes / (row["event_us"] * 1e-6) / 1e9, 1)
        row["gpu_only_GBps"] = round(nbytes / (row["gpu_only_us"] * 1e-6) / 1e9, 1)
        row["event_ratio_vs_passes"] = round(statistics.median(b / a for a, b in zip(s["event_us"], base)), 3)
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    options = parser("gpu_hash_overhead", __doc__)
    options.add_argument("--reps", type=int, default=50, help="repetitions on the small set (default 50)")
    options.add_argument("--big-reps", type=int, default=7, help="repetitions on 1 GiB (default 7)")
    options.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    args = options.parse_args(argv)
    require_cuda("gpu_hash_overhead")
    report: dict[str, Any] = {"sets": {k: [n] * c for k, (c, n) in SETS.items()}, "reps": args.reps,
                              "big_reps": args.big_reps, "medians": {}}
    gen = torch.Generator(device="cuda").manual_seed(20261202)
    for set_name, (count, size) in SETS.items():
        buffers = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
                   for _ in range(count)]
        hosts = [b.cpu().numpy() for b in buffers]
        for algorithm, algorithm_options in ALGORITHMS:
            ref = get(algorithm)
            want = [ref.digest(h, **algorithm_options) for h in hosts]
            paths = make_paths(algorithm, algorithm_options, buffers)
            reps = args.reps if set_name == "set" else args.big_reps
            samples = samples_of(paths, want, reps)
            report["medians"].setdefault(set_name, {})[algorithm] = summarise(samples, count * size)
            gpu.clear_plans()
        del buffers, hosts
        torch.cuda.empty_cache()
    report["stats"], report["capture_errors"] = dict(gpu.stats), list(gpu.capture_errors)
    print(json.dumps(report, indent=1))
    if args.out is not None:
        write_json(args.out, report)
    return 0
