"""kmesh.integrity on the CPU: registry, the sha256-tree format and its reference, the multi-threaded CPU paths,
corruption detection, GPU request planning/validation (no GPU needed), and the integrity stage end to end."""
from __future__ import annotations

import hashlib
import json

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kmesh.integrity as integ
from kmesh.integrity import DigestMismatchError, IntegrityError, UnknownAlgorithmError, cpu, gpu, tree

CHUNKS = st.sampled_from([64, 128, 256, 1024, 4096])
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_registry_names_and_refusal():
    assert integ.names() == ["blake3", "sha256", "sha256-tree"]
    with pytest.raises(UnknownAlgorithmError, match=r"'md5'.*known: blake3, sha256, sha256-tree"):
        integ.get("md5")
    with pytest.raises(UnknownAlgorithmError):
        integ.verify("sha512", b"abc", b"\0" * 64)
    assert integ.get("sha256-tree").params == ("chunk_bytes",)
    with pytest.raises(IntegrityError, match="no parameter"):
        integ.get("blake3").digest(b"", chunk_bytes=1024)
    with pytest.raises(IntegrityError, match="registered twice"):
        integ.register(integ.Algorithm("blake3", 32, lambda d: b""))


@pytest.mark.parametrize("bad", [None, 0, 32, 100, 3000, 1 << 25, "4096", True, 4096.0])
def test_sha256_tree_chunk_bytes_refused(bad):
    with pytest.raises(IntegrityError, match="chunk_bytes"):
        integ.get("sha256-tree").digest(b"abc", chunk_bytes=bad)


def test_sha256_tree_known_answers():
    """The format by hand with hashlib: empty object, one short chunk, exact chunk, three leaves (odd: carried up),
    five leaves (RFC 6962 split 4 + 1)."""
    H = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    assert tree.reference(b"", 64) == H(b"\x00")
    assert tree.reference(b"abc", 64) == H(b"\x00abc")
    d = bytes(range(64))
    assert tree.reference(d, 64) == H(b"\x00" + d)
    d3 = bytes(range(130))
    l0, l1, l2 = H(b"\x00" + d3[:64]), H(b"\x00" + d3[64:128]), H(b"\x00" + d3[128:])
    assert tree.reference(d3, 64) == H(b"\x01" + H(b"\x01" + l0 + l1) + l2)
    d5 = bytes(range(256)) + b"x"
    ls = [H(b"\x00" + d5[i:i + 64]) for i in range(0, 257, 64)]
    n01, n23 = H(b"\x01" + ls[0] + ls[1]), H(b"\x01" + ls[2] + ls[3])
    assert tree.reference(d5, 64) == H(b"\x01" + H(b"\x01" + n01 + n23) + ls[4])
    # a different format from whole-object SHA-256, and the chunk size matters
    assert tree.reference(d5, 64) != H(d5) and tree.reference(d5, 64) != tree.reference(d5, 128)


@FAST
@given(st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=300))
def test_level_fold_equals_rfc6962_split(leaves):
    """Two definitions of the same tree: level by level with the odd node carried up, and RFC 6962's recursive
    split at the largest power of two."""
    assert tree.fold_levels(list(leaves)) == tree._mth(list(leaves))


@FAST
@given(n=st.integers(0, 70000), chunk=CHUNKS, threads=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_cpu_sha256_tree_equals_reference(n, chunk, threads, seed):
    d = _bytes(n, seed)
    want = tree.reference(d, chunk)
    assert cpu.sha256_tree(d, chunk, threads=threads) == want
    assert integ.get("sha256-tree").digest(d, chunk_bytes=chunk) == want


@FAST
@given(n=st.integers(0, 400000), seed=st.integers(0, 2**32 - 1))
def test_cpu_blake3_all_cores_equals_package(n, seed):
    d = _bytes(n, seed)
    want = blake3.blake3(d.tobytes(), max_threads=1).digest()
    assert cpu.blake3(d) == want and integ.get("blake3").digest(d) == want
    assert cpu.blake3(d, threads=2) == want


@FAST
@given(n=st.integers(0, 200000), seed=st.integers(0, 2**32 - 1))
def test_cpu_sha256_equals_hashlib(n, seed):
    d = _bytes(n, seed)
    assert integ.get("sha256").digest(d) == cpu.sha256(d) == hashlib.sha256(d.tobytes()).digest()


def test_blake3_known_answer():
    # the BLAKE3 team's published digest of the empty input
    assert integ.get("blake3").digest(b"").hex() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


@pytest.mark.parametrize("alg,params", [("sha256", {}), ("sha256-tree", {"chunk_bytes": 1024}), ("blake3", {})])
def test_corruption_truncation_and_wrong_params_detected(alg, params):
    d = _bytes(100_003, 7)
    good = integ.get(alg).digest(d, **params)
    integ.verify(alg, d, good, **params)
    for pos in (0, 1024, 50_000, len(d) - 1):
        bad = d.copy()
        bad[pos] ^= 0x80
        with pytest.raises(DigestMismatchError, match=f"{alg} digest mismatch"):
            integ.verify(alg, bad, good, what="obj-1", **params)
    with pytest.raises(DigestMismatchError):
        integ.verify(alg, d[:-1], good, **params)
    with pytest.raises(DigestMismatchError):
        integ.verify(alg, d, good[:-1] + bytes([good[-1] ^ 1]), **params)
    if alg == "sha256-tree":
        with pytest.raises(DigestMismatchError):
            integ.verify(alg, d, good, chunk_bytes=2048)


def test_pass_tables_cover_every_pass():
    assert [t.tolist() for t in gpu.pass_tables([1])] == [[0, 1]]
    assert [t.tolist() for t in gpu.pass_tables([1, 256, 257])] == [[0, 1, 2, 4], [0, 1, 2, 3]]
    tabs = gpu.pass_tables([65537, 3])
    assert [t.tolist() for t in tabs] == [[0, 257, 258], [0, 2, 3], [0, 1, 2]]
    # sizes per pass: 3 MiB BLAKE3 = 3072 chunks -> 12 blocks -> 1
    assert [int(t[-1]) for t in gpu.pass_tables(gpu.leaf_counts("blake3", [3 << 20] * 4, None))] == [48, 4]
    # the one-launch kernels' tables: `threads` nodes per block
    assert [t.tolist() for t in gpu.pass_tables([1, 64, 65, 3072], threads=64)] == [[0, 1, 2, 4, 52], [0, 1, 2, 3, 4]]


def test_gpu_requests_validated_without_a_gpu():
    with pytest.raises(UnknownAlgorithmError):
        gpu.hash_async("md5", [])
    with pytest.raises(gpu.GpuHashError, match="not a device buffer"):
        gpu.hash_async("blake3", [np.zeros(4, np.uint8)])
    with pytest.raises(gpu.GpuHashError, match="serial"):
        gpu.hash_async("blake3", [], mode="serial")
    with pytest.raises(gpu.GpuHashError, match="mode"):
        gpu.hash_async("sha256", [], mode="parallel")
    with pytest.raises(IntegrityError, match="chunk_bytes"):
        gpu.hash_async("sha256-tree", [np.zeros(4, np.uint8)], chunk_bytes=100)
    with pytest.raises(IntegrityError, match="no parameter"):
        gpu.hash_async("blake3", [np.zeros(4, np.uint8)], chunk_bytes=1024)
    import torch

    with pytest.raises(gpu.GpuHashError, match="CUDA tensor"):
        gpu.device_buffer(torch.zeros(4))


class _FakeCai:
    def __init__(self, ptr, shape, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "|u1", "strides": strides,
                                         "version": 3}


def test_device_buffer_from_array_interface():
    b = gpu.device_buffer(_FakeCai(4096, (10, 3)))
    assert (b.ptr, b.nbytes) == (4096, 30)
    with pytest.raises(gpu.GpuHashError, match="contiguous"):
        gpu.device_buffer(_FakeCai(4096, (10, 3), (1, 10)))


def _small_cfg(tmp_path, **extra):
    from kmesh.config import load_config

    over = {"results_dir": str(tmp_path), "integrity": {
        "trials": 3, "warmup": 1, "set": {"objects": 4, "object_bytes": 65536 + 17}, "big_bytes": 1 << 20,
        "sweep_chunk_bytes": [256, 4096], "sweep_trials": 3, "check_chunk_bytes": [64], **extra}}
    return load_config(profile="cpu", overrides=over)


def test_stage_runs_and_renders(tmp_path):
    from kmesh.report.render import render_all
    from kmesh.stages import integrity

    cfg = _small_cfg(tmp_path)
    res = integrity.run(cfg)
    s = res.summary()
    assert s["ok"] and s["failed"] == 0, [c.to_dict() for c in res.cases if c.passed is False]
    assert s["digests_match"] is True and s["trials"] == 3 and s["best_chunk_bytes"] in (256, 4096)
    assert set(s["arms"]) == {"cpu-sha256", "cpu-sha256-tree", "cpu-blake3"}
    assert all(set(v) == {"set", "big"} and v["set"]["gbps"] > 0 for v in s["arms"].values())
    # the GPU-only cases are skips the cpu profile allows, with why (never left out)
    assert [c.id for c in res.cases if c.skipped] == ["gpu-digests", "bench-big-gpu-sha256"]
    assert {a["case"] for a in s["skips_allowed"]} == {"gpu-digests", "bench-big-gpu-sha256"}
    t = res.timings["arms_set"]
    assert len(t["orders"]) == 3 and len({o[0] for o in t["orders"]}) == 3     # order rotates
    out = tmp_path / "cpu" / "integrity" / "result.json"
    res.write(out)
    json.loads(out.read_text())
    written = {p.name for p in render_all(cfg)}
    assert {"integrity_arms_set.md", "integrity_arms_big.md", "integrity_sweep_sha256_tree.md",
            "integrity_sweep_sha256_tree.png"} <= written


def test_stage_catches_a_wrong_digest(tmp_path, monkeypatch):
    """An arm that returns a wrong digest fails its bench case and digests_match."""
    from kmesh.stages import integrity
    from kmesh.stages.integrity import arms as integrity_arms

    real = integrity_arms.cpu.blake3
    monkeypatch.setattr(integrity_arms.cpu, "blake3", lambda d, threads=None: real(d)[:-1] + b"\x00")
    res = integrity.run(_small_cfg(tmp_path))
    s = res.summary()
    assert not s["ok"] and s["digests_match"] is False
    failed = {c.id for c in res.cases if c.passed is False}
    assert "bench-set" in failed and "bench-big" in failed
