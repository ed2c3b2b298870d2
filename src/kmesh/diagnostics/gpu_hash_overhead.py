"""Where a small GPU hash request's time goes: host issue time, CUDA-event time, GPU-only time (GPU).

The integrity stage's small set (4 objects of 3 MiB on the GPU), hashed with kmesh.integrity.gpu for blake3 and
sha256-tree (512-byte chunks), with graph replay on and off, interleaved so both see the same machine state
(3 unrecorded requests first build each plan and capture its graph). Per repetition and mode, three samples:
  issue_us     host time of hash_async() alone (the request issued, not finished)
  event_us     CUDA-event time around the request as the integrity stage measures it (kmesh.bench.Intervals)
  gpu_only_us  events around the request queued behind a 2 ms sleep kernel: the host's cost is hidden, what is
               left is the GPU's own work

Output: one JSON object (printed; also written to --out if given) with the medians per algorithm as
`<replay|allocating>_<sample>`, plus gpu.stats (graph launches, captures) and any capture errors. event_us much
above gpu_only_us means the host, not the GPU, sets the stage's small-set time; replay vs allocating says what
graph replay saves of it. docs/measurements/integrity-h200/README.md reads one such file.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from kmesh.bench import Intervals
from kmesh.diagnostics._common import parser, require_cuda, write_json
from kmesh.integrity import gpu

OBJECTS, OBJECT_BYTES = 4, 3 << 20
ALGORITHMS = (("blake3", {}), ("sha256-tree", {"chunk_bytes": 512}))
SLEEP_CYCLES = 2_000_000     # torch.cuda._sleep before the GPU-only sample: long enough to queue the request behind


def samples_of(algorithm: str, options: dict, buffers: list[torch.Tensor], reps: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for _ in range(3):                                   # plan + capture outside the samples
        gpu.hash_buffers(algorithm, buffers, **options)
    for _ in range(reps):
        for replay in (True, False):                     # interleaved: both see the same machine state
            tag = "replay" if replay else "allocating"
            gpu.set_replay(replay)
            torch.cuda.synchronize()
            start = time.perf_counter()
            pending = gpu.hash_async(algorithm, buffers, **options)
            issued = time.perf_counter()
            pending.result()
            samples.setdefault(f"{tag}_issue_us", []).append((issued - start) * 1e6)
            intervals = Intervals("cuda")
            with intervals.part("hash"):
                pending = gpu.hash_async(algorithm, buffers, **options)
            pending.result()
            samples.setdefault(f"{tag}_event_us", []).append(intervals.seconds()["hash"] * 1e6)
            torch.cuda._sleep(SLEEP_CYCLES)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            pending = gpu.hash_async(algorithm, buffers, **options)
            end.record()
            pending.result()
            torch.cuda.synchronize()
            samples.setdefault(f"{tag}_gpu_only_us", []).append(begin.elapsed_time(end) * 1e3)
    gpu.set_replay(True)
    return samples


def main(argv: list[str] | None = None) -> int:
    options = parser("gpu_hash_overhead", __doc__)
    options.add_argument("--reps", type=int, default=50, help="interleaved repetitions (default 50)")
    options.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    args = options.parse_args(argv)
    require_cuda("gpu_hash_overhead")
    buffers = [torch.randint(0, 256, (OBJECT_BYTES,), dtype=torch.uint8, device="cuda") for _ in range(OBJECTS)]
    medians = {}
    for algorithm, algorithm_options in ALGORITHMS:
        samples = samples_of(algorithm, algorithm_options, buffers, args.reps)
        medians[algorithm] = {key: round(statistics.median(values), 1) for key, values in samples.items()}
    report = {"sizes": [OBJECT_BYTES] * OBJECTS, "reps": args.reps, "medians": medians, "stats": gpu.stats,
              "capture_errors": gpu.capture_errors}
    print(json.dumps(report, indent=1))
    if args.out is not None:
        write_json(args.out, report)
    return 0
