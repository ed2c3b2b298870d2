"""GPU parts of stage `integrity`: every kernel's digests against the CPU references (poisoned outputs and tails,
misaligned starts, async on a side stream, corruption), and the single whole-object SHA-256 timing of the big
object (one chain of 64-byte blocks: too slow for the rotating trials)."""
from __future__ import annotations

import hashlib
import statistics
from typing import Any

import numpy as np

from kmesh.integrity import DigestMismatchError, tree
from kmesh.result import Case, Result

MAX_CHECK_BYTES = 64 * 1024 * 1024 + 1
SHA256_CHECK_BYTES = 4 * 1024 * 1024 + 1


def _views(torch: Any, data: Any, lengths: list[int], mis: int, tail: int) -> tuple[list[Any], list[Any]]:
    """Per length a device buffer holding the data at offset `mis`, bytes after it set to `tail`; the views hashed."""
    bases, views = [], []
    for length in lengths:
        base = torch.full((length + mis + 64,), tail, dtype=torch.uint8, device="cuda")
        base[mis:mis + length].copy_(data[:length])
        bases.append(base)
        views.append(base[mis:mis + length])
    return bases, views


def check_gpu_digests(case: Case, seed: int, chunks: list[int]) -> None:
    import blake3
    import torch

    from kmesh.integrity import gpu
    from kmesh.integrity.boundaries import boundary_lengths

    lengths = sorted({n for ch in chunks for n in boundary_lengths(ch) if n <= MAX_CHECK_BYTES})
    host = np.random.default_rng(seed + 3).integers(0, 256, max(lengths), dtype=np.uint8)
    data = torch.from_numpy(host).cuda()
    refs: dict[str, list[bytes]] = {
        "sha256": [hashlib.sha256(host[:n]).digest() for n in lengths],
        "blake3": [blake3.blake3(host[:n]).digest() for n in lengths],
        **{f"sha256-tree@{ch}": [tree.reference(host[:n], ch) for n in lengths] for ch in chunks}}
    calls = [("sha256", "sha256", {"mode": "concurrent"}), ("sha256", "sha256", {"mode": "serial"}),
             ("blake3", "blake3", {})] + [(f"sha256-tree@{ch}", "sha256-tree", {"chunk_bytes": ch}) for ch in chunks]
    case.record("lengths", lengths)
    bad: dict[str, list[Any]] = {}
    for mis in (0, 1, 3):
        for tail in (0xA5, 0x5A):
            bases, views = _views(torch, data, lengths, mis, tail)
            for key, alg, kw in calls:
                if kw.get("mode") == "serial" and (mis, tail) != (0, 0xA5):
                    continue  # the serial arm is the same kernel one object per launch: checked once
                # whole-object SHA-256 is one thread per object (~1.5 µs per 64-byte block): lengths <= 4 MiB + 1
                idx = [i for i, n in enumerate(lengths) if alg != "sha256" or n <= SHA256_CHECK_BYTES]
                got = gpu.hash_buffers(alg, [views[i] for i in idx], poison=True, **kw)
                wrong = [lengths[i] for i, g in zip(idx, got) if g != refs[key][i]]
                if wrong:
                    bad.setdefault(f"{key}/{kw.get('mode', '')}/mis{mis}/tail{tail:#x}", []).extend(wrong)
            del bases, views
    case.check("every_gpu_digest_equals_reference", not bad, bad)

    # one buffer, own stream, async; the caller's other work is not waited for
    side = torch.cuda.Stream()
    obj = data[:3 * 1024 * 1024]
    torch.cuda.synchronize()
    pend = {alg: gpu.hash_async(alg, [obj], stream=side, **kw)
            for alg, kw in (("sha256", {}), ("blake3", {}), ("sha256-tree", {"chunk_bytes": chunks[0]}))}
    want = {"sha256": hashlib.sha256(host[:len(obj)]).digest(), "blake3": blake3.blake3(host[:len(obj)]).digest(),
            "sha256-tree": tree.reference(host[:len(obj)], chunks[0])}
    case.check("async_side_stream_equal", all(p.result() == [want[a]] for a, p in pend.items()))
    case.check("hash_buffer_equal", gpu.hash_buffer("blake3", obj) == want["blake3"])

    # corruption of one byte of object 2 of 4 is found and named
    objs = [data[i * 1024 * 1024:(i + 1) * 1024 * 1024].clone() for i in range(4)]
    for alg, kw in (("sha256", {}), ("blake3", {}), ("sha256-tree", {"chunk_bytes": chunks[0]})):
        good = gpu.hash_buffers(alg, objs, **kw)
        objs[2][123457] ^= 0x10
        try:
            gpu.verify_buffers(alg, objs, good, **kw)
            caught = None
        except DigestMismatchError as e:
            caught = str(e)
        objs[2][123457] ^= 0x10
        case.check(f"{alg}_corruption_detected", caught is not None and "object 2" in caught, caught)
        case.check(f"{alg}_restored_verifies", gpu.hash_buffers(alg, objs, **kw) == good)


def whole_sha256_big(res: Result, ds: Any, trials: int) -> dict[str, Any]:
    """The one-thread whole-object SHA-256 of the big object, `trials` times (serial = concurrent for one object)."""
    import torch

    from kmesh.integrity import gpu

    want = hashlib.sha256(ds.host[0]).digest()
    times, ok = [], True
    with res.case("bench-big-gpu-sha256", {"bytes": ds.nbytes, "trials": trials}) as case:
        gpu.plan_for("sha256", ds.dev)  # plan built before timing; module loaded by the earlier cases
        # (no warm-up run: one chain of the big object takes seconds; the first timed call is the warm one's twin)
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pending = gpu.hash_async("sha256", ds.dev)
            end.record()
            ok &= pending.result() == [want]
            times.append(start.elapsed_time(end) / 1e3)
        case.check("digest_matches", ok)
        case.record("times_s", times)
    med = statistics.median(times) if times else float("nan")
    return {"median_ms": med * 1e3, "gbps": ds.nbytes / med / 1e9, "trials": len(times),
            "note": "one object = one chain: serial and concurrent are the same launch; measured outside the rotation"}
