"""Where a small GPU hash request's time goes (H200, 4 x 3 MiB): host time to issue it, CUDA-event time as the
integrity stage measures it, and GPU-only time (queued behind a sleep kernel so the host cost is hidden), with
kmesh.integrity.gpu's graph replay on and off. Medians of interleaved repetitions; prints one JSON object.
    python3 scripts/gpu_hash_overhead.py [--reps 50]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kmesh.bench import Intervals
from kmesh.integrity import gpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    bufs = [torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda") for _ in range(4)]
    out: dict[str, dict[str, float]] = {}
    for algo, kw in (("blake3", {}), ("sha256-tree", {"chunk_bytes": 512})):
        samples: dict[str, list[float]] = {}
        for _ in range(3):                                   # plan + capture outside the samples
            gpu.hash_buffers(algo, bufs, **kw)
        for _ in range(a.reps):
            for replay in (True, False):                     # interleaved: both see the same machine state
                tag = "replay" if replay else "allocating"
                gpu.set_replay(replay)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                p = gpu.hash_async(algo, bufs, **kw)
                t1 = time.perf_counter()
                p.result()
                samples.setdefault(f"{tag}_issue_us", []).append((t1 - t0) * 1e6)
                iv = Intervals("cuda")
                with iv.part("hash"):
                    p = gpu.hash_async(algo, bufs, **kw)
                p.result()
                samples.setdefault(f"{tag}_event_us", []).append(iv.seconds()["hash"] * 1e6)
                torch.cuda._sleep(2_000_000)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                p = gpu.hash_async(algo, bufs, **kw)
                e.record()
                p.result()
                torch.cuda.synchronize()
                samples.setdefault(f"{tag}_gpu_only_us", []).append(s.elapsed_time(e) * 1e3)
        gpu.set_replay(True)
        out[algo] = {k: round(statistics.median(v), 1) for k, v in samples.items()}
    print(json.dumps({"sizes": [3 << 20] * 4, "reps": a.reps, "medians": out, "stats": gpu.stats,
                      "capture_errors": gpu.capture_errors}, indent=1))


if __name__ == "__main__":
    main()
