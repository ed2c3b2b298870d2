"""The integrity microbenchmark's data sets, arms and trial loop (stage `integrity`).

Design (stated in every table): each trial runs every arm once on the same bytes; the order rotates by one arm per
trial (trial t starts with arm t mod k); `warmup` trials first, discarded. One arm run = hash every object of the
set and have its digests on the host. Per arm: the median over trials; against the baseline arm (CPU SHA-256) the
median of the per-trial ratios arm / baseline and in how many trials the arm was faster (kmesh.bench.paired_stats:
trials are the matched pairs). On CUDA the interval is two CUDA events on torch's current stream: GPU arms enqueue
their kernels and the 32-byte-per-object digest download inside it (the host waits after the end event), CPU arms
download the objects device→host into pinned memory, wait, and hash inside it (the end event is recorded after).
GPU request plans (object descriptors and per-pass block tables, kmesh.integrity.gpu) are uploaded in the warm-up
trial and reused, as a storage route reusing its staging buffers would.
"""
from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kmesh.bench import Intervals, paired_stats
from kmesh.integrity import cpu, tree

BASELINE = "cpu-sha256"


@dataclass
class DataSet:
    """Deterministic synthetic objects: host bytes (references, CPU arms on the cpu profile) and, on CUDA, the same
    bytes on the device plus pinned host buffers the CPU arms download into."""

    name: str
    host: list[np.ndarray]
    dev: list[Any] | None = None
    pinned: list[Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(h.nbytes) for h in self.host)

    def describe(self) -> dict[str, Any]:
        return {"objects": len(self.host), "object_bytes": [int(h.nbytes) for h in self.host], "bytes": self.nbytes,
                "sha256_of_objects": [hashlib.sha256(h).hexdigest()[:16] for h in self.host]}


def make_set(name: str, sizes: Sequence[int], seed: int, device: str) -> DataSet:
    """Objects of `sizes` bytes from a seeded generator (numpy PCG64 on the host; torch's seeded CUDA generator on
    the device, then copied down once for the references)."""
    if device == "cuda":
        import torch

        generator = torch.Generator(device="cuda")
        generator.manual_seed(seed)
        dev = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=generator) for n in sizes]
        host = [d.cpu().numpy() for d in dev]
        pinned = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
        return DataSet(name, host, dev, pinned)
    rng = np.random.default_rng(seed)
    return DataSet(name, [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes])


def references(ds: DataSet, chunk_bytes: int) -> dict[str, list[bytes]]:
    """Digests by the independent references: hashlib, the blake3 package, the plain-Python sha256-tree."""
    import blake3

    return {"sha256": [hashlib.sha256(h).digest() for h in ds.host],
            "blake3": [blake3.blake3(h, max_threads=blake3.blake3.AUTO).digest() for h in ds.host],
            "sha256-tree": [tree.reference(h, chunk_bytes) for h in ds.host]}


@dataclass(frozen=True)
class Arm:
    name: str
    algorithm: str
    run: Callable[[DataSet, Intervals], list[bytes]] = field(repr=False, compare=False)
    where: str = "cpu"
    ref: str = ""            # key of the reference digests (default: the algorithm)

    @property
    def ref_key(self) -> str:
        return self.ref or self.algorithm


def _download(ds: DataSet) -> list[Any]:
    """Device objects into the pinned host buffers, waited for: what a CPU check of GPU-resident bytes costs."""
    import torch

    for pinned, dev in zip(ds.pinned, ds.dev):
        pinned.copy_(dev, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return [p.numpy() for p in ds.pinned]


def cpu_arm(name: str, algorithm: str, fn: Callable[[Any], bytes], on_device: bool, ref: str = "") -> Arm:
    def run(ds: DataSet, iv: Intervals) -> list[bytes]:
        with iv.part("hash"):
            objs = _download(ds) if on_device else ds.host
            return [fn(o) for o in objs]
    return Arm(name, algorithm, run, "cpu", ref)


def gpu_arm(name: str, algorithm: str, ref: str = "", **kw: Any) -> Arm:
    def run(ds: DataSet, iv: Intervals) -> list[bytes]:
        from kmesh.integrity import gpu

        with iv.part("hash"):
            pending = gpu.hash_async(algorithm, ds.dev, **kw)
        return pending.result()
    return Arm(name, algorithm, run, "gpu", ref)


def gpu_request_arm(name: str, algorithm: str, **kw: Any) -> Arm:
    """A caller that hashes the same buffers again and again: one SetRequest per data set (prepared, i.e. planned
    and captured, outside the interval), then per trial its launch() inside the interval and result() after."""
    requests: dict[tuple, Any] = {}

    def run(ds: DataSet, iv: Intervals) -> list[bytes]:
        from kmesh.integrity import gpu

        key = tuple((t.data_ptr(), t.numel()) for t in ds.dev)   # the buffers it was prepared for, not the object
        req = requests.get(key)
        if req is None:
            req = requests[key] = gpu.prepare(algorithm, ds.dev, **kw)
        with iv.part("hash"):
            req.launch()
        return req.result()
    return Arm(name, algorithm, run, "gpu")


def make_arms(names: Sequence[str], on_device: bool, chunk_bytes: int) -> list[Arm]:
    table = {
        "cpu-sha256": lambda: cpu_arm("cpu-sha256", "sha256", cpu.sha256, on_device),
        "cpu-sha256-tree": lambda: cpu_arm("cpu-sha256-tree", "sha256-tree",
                                           lambda o: cpu.sha256_tree(o, chunk_bytes), on_device),
        "cpu-blake3": lambda: cpu_arm("cpu-blake3", "blake3", cpu.blake3, on_device),
        "gpu-sha256-serial": lambda: gpu_arm("gpu-sha256-serial", "sha256", mode="serial"),
        "gpu-sha256-concurrent": lambda: gpu_arm("gpu-sha256-concurrent", "sha256", mode="concurrent"),
        "gpu-sha256-tree": lambda: gpu_arm("gpu-sha256-tree", "sha256-tree", chunk_bytes=chunk_bytes),
        "gpu-blake3": lambda: gpu_arm("gpu-blake3", "blake3"),
        "gpu-sha256-tree-request": lambda: gpu_request_arm("gpu-sha256-tree-request", "sha256-tree",
                                                           chunk_bytes=chunk_bytes),
        "gpu-blake3-request": lambda: gpu_request_arm("gpu-blake3-request", "blake3"),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown integrity arm(s) {unknown}; known: {sorted(table)}")
    return [table[n]() for n in names]


def sweep_arms(chunks: Sequence[int], on_device: bool) -> list[Arm]:
    """One sha256-tree arm per chunk size: the GPU kernel on CUDA, the multi-threaded CPU implementation otherwise."""
    if on_device:
        return [gpu_arm(f"gpu-sha256-tree@{c}", "sha256-tree", ref=f"sha256-tree@{c}", chunk_bytes=c) for c in chunks]
    return [cpu_arm(f"cpu-sha256-tree@{c}", "sha256-tree", lambda o, c=c: cpu.sha256_tree(o, c), False,
                    ref=f"sha256-tree@{c}") for c in chunks]


def run_trials(arms: Sequence[Arm], ds: DataSet, refs: dict[str, list[bytes]], trials: int, warmup: int,
               device: str) -> dict[str, Any]:
    """Every arm once per trial, order rotating; seconds per arm per trial and whether every digest matched."""
    times: dict[str, list[float]] = {a.name: [] for a in arms}
    orders, mismatches = [], []
    for trial in range(warmup + trials):
        first = (trial - warmup) % len(arms)
        order = list(arms[first:]) + list(arms[:first])
        for arm in order:
            iv = Intervals(device)
            got = arm.run(ds, iv)
            want = refs[arm.ref_key]
            if got != want:
                mismatches.append({"trial": trial - warmup, "arm": arm.name,
                                   "objects": [i for i, (a, b) in enumerate(zip(got, want)) if a != b]})
            if trial >= warmup:
                times[arm.name].append(iv.seconds()["hash"])
        if trial >= warmup:
            orders.append([a.name for a in order])
    return {"times_s": times, "orders": orders, "mismatches": mismatches}


def summarize(raw: dict[str, Any], nbytes: int, baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """Per arm: median ms, GB/s at the median, and (baseline present) the paired ratio against the baseline."""
    out: dict[str, dict[str, Any]] = {}
    base = raw["times_s"].get(baseline)
    for name, ts in raw["times_s"].items():
        med = statistics.median(ts)
        row: dict[str, Any] = {"median_ms": med * 1e3, "gbps": nbytes / med / 1e9, "trials": len(ts),
                               "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3}
        if base is not None and name != baseline:
            paired = paired_stats(base, ts)
            row.update(ratio_vs_baseline=paired["median_ratio"], speedup_vs_baseline=1.0 / paired["median_ratio"],
                       faster_than_baseline=paired["b_faster"])
        out[name] = row
    return out
