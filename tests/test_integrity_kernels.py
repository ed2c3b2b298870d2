"""The integrity CUDA kernels without a GPU: they compile for sm_90 (a syntax or type error fails here), and their
own __host__ __device__ code, sequenced as the GPU runs it (tests/integrity_host/harness.cu), gives exactly
hashlib's / the blake3 package's / the plain-Python sha256-tree reference's digests. Skips without nvcc."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmesh.integrity import tree
from kmesh.stages.kernels import compile_cubin, kernel_entry_points

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"sha256": ["sha256_whole"], "sha256_tree": ["sha256_tree_leaves", "sha256_tree_nodes"],
           "blake3": ["blake3_chunks", "blake3_parents"]}
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_sm90(name, tmp_path):
    src = ROOT / "kernels" / f"{name}.cu"
    assert kernel_entry_points(src.read_text()) == KERNELS[name]
    info = compile_cubin(NVCC, "-gencode=arch=compute_90,code=sm_90", src, tmp_path / f"{name}.cubin")
    assert info["returncode"] == 0, info["stderr_tail"]
    assert (tmp_path / f"{name}.cubin").stat().st_size > 0
    used = [ln for ln in info["ptxas"] if "Used" in ln and "registers" in ln]
    assert len(used) >= len(KERNELS[name]), info["ptxas"]      # ptxas reported every entry point


def test_loader_tracks_included_headers(tmp_path, monkeypatch):
    from kmesh.cuda import loader

    srcs = loader.local_sources(ROOT / "kernels" / "blake3.cu")
    assert {p.name for p in srcs} == {"blake3.cu", "integrity_tree.cuh"}
    assert {p.name for p in loader.local_sources(ROOT / "kernels" / "sha256_tree.cu")} == \
        {"sha256_tree.cu", "sha256_common.cuh", "integrity_tree.cuh"}
    # a cubin newer than its .cu but older than an included header is stale
    (tmp_path / "h.cuh").write_text("#pragma once\n")
    cu = tmp_path / "k.cu"
    cu.write_text('#include "h.cuh"\n')
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"x")
    os.utime(cu, (1000, 1000))
    os.utime(cubin, (2000, 2000))
    os.utime(tmp_path / "h.cuh", (1500, 1500))
    assert loader._fresh(cubin, cu)
    os.utime(tmp_path / "h.cuh", (3000, 3000))
    assert not loader._fresh(cubin, cu)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity-host") / "harness"
    cmd = [NVCC, "-std=c++17", "-O2", "-gencode=arch=compute_90,code=sm_90",
           str(ROOT / "tests" / "integrity_host" / "harness.cu"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_host(harness, tmp_path, mode, objs, chunk=0, mis=0):
    f = tmp_path / "objs.bin"
    f.write_bytes(b"".join(o.tobytes() for o in objs))
    proc = subprocess.run([str(harness), mode, str(chunk), str(mis), str(f), *(str(len(o)) for o in objs)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [bytes.fromhex(x) for x in proc.stdout.split()]


def want(mode, objs, chunk=0):
    if mode == "sha256":
        return [hashlib.sha256(o).digest() for o in objs]
    if mode == "blake3":
        return [blake3.blake3(o.tobytes()).digest() for o in objs]
    return [tree.reference(o, chunk) for o in objs]


BOUNDARIES = [0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 1023, 1024, 1025, 2047, 2048, 2049, 3072,
              256 * 1024 - 1, 256 * 1024, 256 * 1024 + 1, 3 * 1024 * 1024]


@pytest.mark.parametrize("mis", [0, 1, 3, 4])
def test_host_sha256_and_blake3_boundaries(harness, tmp_path, mis):
    data = np.random.default_rng(11).integers(0, 256, max(BOUNDARIES), dtype=np.uint8)
    objs = [data[:n] for n in BOUNDARIES]      # all lengths in one "launch": objects of different pass counts
    for mode in ("sha256", "blake3"):
        assert run_host(harness, tmp_path, mode, objs, mis=mis) == want(mode, objs), mode


@pytest.mark.parametrize("chunk", [64, 256, 4096])
def test_host_sha256_tree_boundaries(harness, tmp_path, chunk):
    data = np.random.default_rng(12).integers(0, 256, 256 * 256 * 64 + 1, dtype=np.uint8)
    lens = sorted({0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk, 255 * chunk + 5, 256 * chunk, 256 * chunk + 1,
                   257 * chunk, 1000 * chunk + 3} | ({256 * 256 * 64 + 1} if chunk == 64 else set()))
    objs = [data[:n] for n in lens if n <= len(data)]
    for mis in (0, 1):
        assert run_host(harness, tmp_path, "sha256-tree", objs, chunk, mis) == want("sha256-tree", objs, chunk)


def test_host_blake3_three_passes(harness, tmp_path):
    """256² + 1 chunks: the chunk pass, a parent pass, and a final pass; and 3 MiB objects as the bench uses."""
    data = np.random.default_rng(13).integers(0, 256, 256 * 256 * 1024 + 1, dtype=np.uint8)
    objs = [data, data[:3 << 20], data[:256 * 256 * 1024]]
    assert run_host(harness, tmp_path, "blake3", objs) == want("blake3", objs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(0, 600_000), min_size=1, max_size=5), chunk=st.sampled_from([64, 256, 1024, 65536]),
       mis=st.integers(0, 15), seed=st.integers(0, 2**32 - 1))
def test_host_random_lengths(harness, tmp_path, lens, chunk, mis, seed):
    rng = np.random.default_rng(seed)
    objs = [rng.integers(0, 256, n, dtype=np.uint8) for n in lens]
    for mode in ("sha256", "blake3", "sha256-tree"):
        assert run_host(harness, tmp_path, mode, objs, chunk, mis) == want(mode, objs, chunk), mode
