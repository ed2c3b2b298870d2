"""The integrity kernels on a GPU: every GPU digest equals the CPU reference (hashlib, the blake3 package, the
plain-Python sha256-tree), incl. poisoned outputs and poisoned bytes past each object, misaligned starts, 1 GiB,
the async API on a side stream, and the integrity stage on the cuda profile (small sizes)."""
from __future__ import annotations

import hashlib

import blake3
import numpy as np
import pytest

from kmesh.integrity import DigestMismatchError, cpu, tree

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


def _dev(torch, n, seed):
    host = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return host, torch.from_numpy(host).cuda()


def test_boundary_lengths_poisoned_misaligned(torch):
    """The stage's own GPU case: all lengths, misalignments 0/1/3, two tail poisons, poisoned outputs."""
    from kmesh.result import Case
    from kmesh.stages.integrity.gpu import check_gpu_digests

    c = Case("gpu-digests")
    check_gpu_digests(c, 20261130, [256, 1024])
    assert c.passed, {k: v for k, v in c.checks.items() if v["ok"] is False}


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 256 * 1024, 256 * 1024 + 1, 3 << 20])
def test_blake3_lengths_equal_package(torch, n):
    from kmesh.integrity import gpu

    host, dev = _dev(torch, n, n)
    assert gpu.hash_buffer("blake3", dev, poison=True) == blake3.blake3(host.tobytes()).digest()


def test_one_gib(torch):
    from kmesh.integrity import gpu

    host, dev = _dev(torch, 1 << 30, 5)
    assert gpu.hash_buffer("blake3", dev, poison=True) == blake3.blake3(host, max_threads=blake3.blake3.AUTO).digest()
    assert gpu.hash_buffer("sha256-tree", dev, chunk_bytes=65536) == cpu.sha256_tree(host, 65536)
    assert gpu.hash_buffer("sha256-tree", dev, chunk_bytes=65536) == tree.reference(host, 65536)


def test_sha256_serial_equals_concurrent_equals_hashlib(torch):
    from kmesh.integrity import gpu

    host, dev = _dev(torch, 4 * (3 << 20), 9)
    objs = [dev[i * (3 << 20):(i + 1) * (3 << 20)] for i in range(4)]
    want = [hashlib.sha256(host[i * (3 << 20):(i + 1) * (3 << 20)]).digest() for i in range(4)]
    assert gpu.hash_buffers("sha256", objs, mode="serial", poison=True) == want
    assert gpu.hash_buffers("sha256", objs, mode="concurrent", poison=True) == want


def test_lengths_inside_larger_buffers(torch):
    from kmesh.integrity import gpu

    host, dev = _dev(torch, 1 << 20, 3)
    bufs = [dev, dev[4096:]]
    for alg, kw, ref in (("blake3", {}, lambda b: blake3.blake3(b).digest()),
                         ("sha256", {}, lambda b: hashlib.sha256(b).digest()),
                         ("sha256-tree", {"chunk_bytes": 4096}, lambda b: tree.reference(b, 4096))):
        got = gpu.hash_buffers(alg, bufs, lengths=[1000, 70001], **kw)
        assert got == [ref(host[:1000].tobytes()), ref(host[4096:4096 + 70001].tobytes())], alg
    with pytest.raises(gpu.GpuHashError, match="outside"):
        gpu.hash_buffers("blake3", bufs, lengths=[1 << 21, 1])


def test_async_on_side_streams(torch):
    from kmesh.integrity import gpu

    host, dev = _dev(torch, 3 << 20, 4)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    p = gpu.hash_async("blake3", [dev], stream=s)
    assert p.result() == [blake3.blake3(host).digest()] and p.done()
    # a cupy stream works as well
    import cupy

    cs = cupy.cuda.Stream(non_blocking=True)
    assert gpu.hash_async("sha256", [dev], stream=cs).result() == [hashlib.sha256(host).digest()]


def test_corrupt_object_named(torch):
    from kmesh.integrity import gpu

    _, dev = _dev(torch, 1 << 20, 6)
    objs = [dev[i << 18:(i + 1) << 18].clone() for i in range(4)]
    good = gpu.hash_buffers("blake3", objs)
    objs[3][77] ^= 1
    with pytest.raises(DigestMismatchError, match="object 3"):
        gpu.verify_buffers("blake3", objs, good)


def test_stage_cuda_profile_small(tmp_path, torch):
    from kmesh.config import load_config
    from kmesh.stages import integrity

    cfg = load_config(profile="cuda", overrides={"results_dir": str(tmp_path), "integrity": {
        "trials": 3, "sweep_trials": 3, "big_bytes": 64 << 20, "big_whole_sha256_trials": 1,
        "sweep_chunk_bytes": [1024, 65536], "check_chunk_bytes": [256]}})
    res = integrity.run(cfg)
    s = res.summary()
    assert s["ok"] and s["all_passed"], [c.to_dict() for c in res.cases if c.passed is not True]
    assert s["digests_match"] is True
    for arm in ("cpu-sha256", "gpu-sha256-serial", "gpu-sha256-concurrent", "gpu-sha256-tree", "gpu-blake3",
                "cpu-blake3"):
        assert s["arms"][arm]["set"]["gbps"] > 0
    assert "big" in s["arms"]["gpu-blake3"] and "big" in s["arms"]["gpu-sha256-concurrent"]
    assert set(s["goals"]) >= {"blake3_12MiB_le_30us", "blake3_1GiB_ge_1TBps", "sha256_tree_12MiB_le_80us"}


@pytest.mark.parametrize("algorithm,kw", [("blake3", {}), ("sha256-tree", {"chunk_bytes": 512}),
                                          ("sha256", {}), ("sha256", {"mode": "serial"})])
def test_graph_replay_hashes_the_bytes_there_now(torch, algorithm, kw):
    """A repeated request (same buffers) replays its plan's captured graph: every replay hashes the bytes the
    buffers hold at that moment (rewritten between requests), equal to the CPU reference and to the allocating
    path; a request made while the previous one's digests are unread does not share its buffers."""
    from kmesh.integrity import get, gpu

    sizes = [3 << 20, (1 << 20) + 5, 4096, 1]
    base = torch.empty(sum(sizes) + 64, dtype=torch.uint8, device="cuda")
    offs = np.cumsum([0] + sizes[:-1]).tolist()
    objs = [base[o:o + n] for o, n in zip(offs, sizes)]
    ref = get(algorithm)
    params = {k: v for k, v in kw.items() if k == "chunk_bytes"}

    def want() -> list[bytes]:
        return [ref.digest(o.cpu().numpy(), **params) for o in objs]

    gpu.clear_plans()
    before = dict(gpu.stats)
    for seed in range(4):
        base.copy_(torch.randint(0, 256, base.shape, dtype=torch.uint8, device="cuda"))
        assert gpu.hash_buffers(algorithm, objs, **kw) == want(), seed
    assert gpu.stats["captures"] - before["captures"] == 1 and not gpu.capture_errors
    assert gpu.stats["graph_launches"] - before["graph_launches"] == 3
    p1 = gpu.hash_async(algorithm, objs, **kw)             # replay, digests left unread ...
    p2 = gpu.hash_async(algorithm, objs, **kw)             # ... so this one allocates
    assert gpu.stats["allocating"] - before["allocating"] == 2
    assert p2.result() == p1.result() == want()
    prev = gpu.set_replay(False)
    try:
        assert gpu.hash_buffers(algorithm, objs, **kw) == want()
    finally:
        gpu.set_replay(prev)
    gpu.clear_plans()


@pytest.mark.parametrize("threads", [64, 128, 256])
@pytest.mark.parametrize("algorithm, kw", [("blake3", {}), ("sha256-tree", {"chunk_bytes": 512})])
def test_one_launch_equals_passes_and_reference(torch, monkeypatch, threads, algorithm, kw):
    """The one-launch kernel of every block size against the per-pass kernels and the CPU reference, on objects
    of one leaf, one block, one block + 1 leaf and enough blocks for a fold of several rounds, misaligned by 3."""
    from kmesh.integrity import get, gpu

    monkeypatch.setitem(gpu.SET_THREADS, algorithm, threads)
    leaf = 1024 if algorithm == "blake3" else kw["chunk_bytes"]
    sizes = [0, 1, leaf * threads, leaf * threads + 1, leaf * threads * (threads + 2) + 7, 3 << 20]
    host, dev = _dev(torch, sum(sizes) + 3, threads)
    offs = (3 + np.cumsum([0] + sizes[:-1])).tolist()
    objs = [dev[o:o + n] for o, n in zip(offs, sizes)]
    want = [get(algorithm).digest(host[o:o + n], **kw) for o, n in zip(offs, sizes)]
    gpu.clear_plans()
    assert gpu.hash_buffers(algorithm, objs, poison=True, **kw) == want
    for _ in range(5):   # replays: a graph of the one kernel, its counters left zeroed for the next
        assert gpu.hash_buffers(algorithm, objs, **kw) == want
    prev = gpu.set_one_launch(False)
    try:
        assert gpu.hash_buffers(algorithm, objs, **kw) == want
    finally:
        gpu.set_one_launch(prev)
    gpu.clear_plans()


@pytest.mark.parametrize("algorithm, kw", [("blake3", {}), ("sha256-tree", {"chunk_bytes": 512}), ("sha256", {})])
def test_set_request_hashes_the_bytes_there_now(torch, algorithm, kw):
    """A SetRequest launched again and again hashes what the buffers hold at each launch; a second launch before
    the result is refused; verify() names the object that changed."""
    from kmesh.integrity import get, gpu
    from kmesh.integrity.gpu import GpuHashError

    sizes = [3 << 20, (1 << 20) + 5, 4096, 1]
    base = torch.empty(sum(sizes), dtype=torch.uint8, device="cuda")
    offs = np.cumsum([0] + sizes[:-1]).tolist()
    objs = [base[o:o + n] for o, n in zip(offs, sizes)]
    req = gpu.prepare(algorithm, objs, **kw)
    for seed in range(6):
        base.copy_(torch.randint(0, 256, base.shape, dtype=torch.uint8, device="cuda"))
        req.launch()
        if seed == 0:
            with pytest.raises(GpuHashError, match="unread"):
                req.launch()
        want = [get(algorithm).digest(o.cpu().numpy(), **kw) for o in objs]
        assert req.result() == want, seed
    with pytest.raises(GpuHashError, match="nothing launched"):
        req.result()
    objs[2][7] ^= 1
    req.launch()
    with pytest.raises(DigestMismatchError, match="object 2"):
        req.verify(want)


def test_a_childs_arrival_digests_in_one_call_equal_each_segments_own():
    """kmesh.kv.digests.arrival_digest: the child path's one blake3 call for every segment of a child (CUDA views
    of one staging buffer, unaligned lengths and offsets) gives each segment's own digest, host and GPU alike."""
    import torch

    from kmesh.kv.digests import arrival_digest, arrival_digests

    staging = torch.randint(0, 256, (3 * 65536 + 123,), dtype=torch.uint8, device="cuda")
    cuts = [0, 65536, 2 * 65536 + 7, staging.numel()]
    views = [staging[a:b] for a, b in zip(cuts, cuts[1:])]
    got = arrival_digests("blake3", views)
    assert got == [arrival_digest("blake3", v.cpu()) for v in views]
    assert got == [blake3.blake3(v.cpu().numpy().tobytes()).hexdigest() for v in views]
