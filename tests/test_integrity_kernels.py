"""The integrity CUDA kernels without a GPU: they compile for sm_90 (a syntax or type error fails here), and their
own __host__ __device__ code, sequenced as the GPU runs it (tests/integrity_host/harness.cu), gives exactly
hashlib's / the blake3 package's / the plain-Python sha256-tree reference's digests. Skips without nvcc."""
from __future__ import annotations

import ctypes
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
KERNELS = {"sha256": ["sha256_whole"],
           "sha256_tree": ["sha256_tree_leaves", "sha256_tree_nodes"]
           + [f"sha256_tree_set_{n}" for n in (64, 128, 256)],
           "blake3": ["blake3_chunks", "blake3_parents"] + [f"blake3_set_{n}" for n in (64, 128, 256)]}
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@pytest.mark.covered_by_stage("kernels", "compile:blake3", "compile:sha256", "compile:sha256_tree")
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_sm90(name, tmp_path):
    src = ROOT / "kernels" / f"{name}.cu"
    assert kernel_entry_points(src.read_text()) == KERNELS[name]
    info = compile_cubin(NVCC, "-gencode=arch=compute_90,code=sm_90", src, tmp_path / f"{name}.cubin")
    assert info["returncode"] == 0, info["stderr_tail"]
    assert (tmp_path / f"{name}.cubin").stat().st_size > 0
    assert set(KERNELS[name]) <= set(info["compiled_entry_functions"]), info["ptxas"]   # none preprocessed away
    used = [ln for ln in info["ptxas"] if "Used" in ln and "registers" in ln]
    assert len(used) >= len(KERNELS[name]), info["ptxas"]      # ptxas reported every entry point's resources


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
def emu_lib(tmp_path_factory):
    """The host harness as a shared library (one nvcc build for every test here). The tests run its host code
    only (gcc -O2); the PTX nvcc also makes of the device code is never run, so NVVM, most of the build's time,
    builds it unoptimised (-Xcicc -O0; docs/testing.md has the figures)."""
    out = tmp_path_factory.mktemp("integrity-emu") / "libemu.so"
    cmd = [NVCC, "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90,code=compute_90",
           "-Xcicc", "-O0", str(ROOT / "tests" / "integrity_host" / "harness.cu"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def harness(emu_lib):
    return emu_lib


def run_host(lib, tmp_path, mode, objs, chunk=0, mis=0):
    """Digests by the kernels' code on the CPU (emu_hash); each object copied to `mis` bytes past 16-byte alignment."""
    keep, ptrs = [], []
    for o in objs:
        raw = np.zeros(len(o) + mis + 32, dtype=np.uint8)
        start = (-raw.ctypes.data) % 16 + mis
        raw[start:start + len(o)] = o
        keep.append(raw)
        ptrs.append(raw.ctypes.data + start)
    p = np.array(ptrs, dtype=np.uint64)
    n = np.array([len(o) for o in objs], dtype=np.uint64)
    out = np.full(len(objs) * 8, 0xDEADBEEF, dtype=np.uint32)
    rc = lib.emu_hash(mode.encode(), ctypes.c_uint32(chunk), ctypes.c_int(len(objs)),
                      ctypes.c_void_p(p.ctypes.data), ctypes.c_void_p(n.ctypes.data), ctypes.c_void_p(out.ctypes.data))
    assert rc == 0
    raw = out.astype("<u4" if mode == "blake3" else ">u4").tobytes()
    return [raw[32 * i:32 * (i + 1)] for i in range(len(objs))]


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


# ---- kmesh.integrity.gpu end to end on the CPU: a fake cupy whose "device memory" is host memory and whose kernel
# launches run the kernels' own code one launch at a time (emu_* in the shared-library build of the harness).
import sys  # noqa: E402
import types  # noqa: E402


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeArray:
    """A 1-D "device" array over host memory (numpy), with cupy's .data.ptr, slicing and reshape."""

    def __init__(self, a):
        self.a = a

    @property
    def data(self):
        return _Ptr(self.a.ctypes.data)

    def __getitem__(self, k):
        return FakeArray(self.a[k])

    def reshape(self, *shape):
        return FakeArray(self.a.reshape(*shape))


class FakeDeviceBuffer:
    """An input object: host bytes behind a __cuda_array_interface__."""

    def __init__(self, a):
        self.a = a
        self.__cuda_array_interface__ = {"data": (a.ctypes.data, False), "shape": a.shape, "typestr": "|u1",
                                         "strides": None, "version": 3}


class _Ctx:
    def __init__(self, *a, **k):
        self.ptr = a[0] if a else 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class _Event:
    done = True

    def __init__(self, **kw):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        assert self.recorded


def _fake_cupy(launches):
    cp = types.ModuleType("cupy")
    keep = []

    def asarray(a):
        return FakeArray(np.array(a, copy=True))

    def empty(n, dtype):
        a = np.random.default_rng().integers(0, 2**32, n, dtype=np.uint64).astype(dtype)   # garbage, like the device
        return FakeArray(a)

    def pinned(n):
        b = bytearray(n)
        keep.append(b)
        return b

    rt = types.SimpleNamespace(
        memsetAsync=lambda ptr, v, n, s: ctypes.memset(ptr, v, n),
        memcpyAsync=lambda dst, src, n, kind, s: ctypes.memmove(dst, src, n),
        memcpyDeviceToHost=2, getDeviceProperties=lambda dev: {"multiProcessorCount": 132})
    cp.asarray, cp.empty = asarray, empty
    cp.cuda = types.SimpleNamespace(Device=_Ctx, ExternalStream=_Ctx, Stream=_Ctx, Event=_Event, runtime=rt,
                                    get_current_stream=lambda: _Ctx(), alloc_pinned_memory=pinned)
    return cp


def _arg(x):
    if isinstance(x, FakeArray):
        return ctypes.c_uint64(x.data.ptr)
    if isinstance(x, np.int32):
        return ctypes.c_int(int(x))
    if isinstance(x, np.uint32):
        return ctypes.c_uint32(int(x))
    if isinstance(x, np.uint64):
        return ctypes.c_uint64(int(x))
    raise TypeError(f"kernel argument of type {type(x).__name__}")


@pytest.fixture
def emulated_gpu(emu_lib, monkeypatch):
    from kmesh.cuda import loader
    from kmesh.integrity import gpu

    launches = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(launches))

    def get_function(name, entry, device_index=0):
        assert entry in KERNELS[name], (name, entry)
        fn = getattr(emu_lib, f"emu_{entry}")

        def launch(grid, block, args):
            launches.append((entry, grid, block))
            assert grid[1:] == (1, 1) and block[1:] == (1, 1)
            rc = fn(ctypes.c_uint32(grid[0]), ctypes.c_uint32(block[0]), *(_arg(a) for a in args))
            assert rc == 0, f"{entry}: wrong block size {block}"
        return launch

    monkeypatch.setattr(loader, "get_function", get_function)
    gpu.clear_plans()
    yield gpu, launches
    gpu.clear_plans()


def _inputs(lengths, mis, seed):
    rng = np.random.default_rng(seed)
    host, bufs = [], []
    for n in lengths:
        base = rng.integers(0, 256, n + mis + 64, dtype=np.uint8)     # random bytes past the end: never hashed
        host.append(base[mis:mis + n])
        bufs.append(FakeDeviceBuffer(base[mis:mis + n]))
    return host, bufs


@pytest.mark.parametrize("mis", [0, 1])
def test_gpu_module_on_emulated_launches(emulated_gpu, mis):
    gpu, launches = emulated_gpu
    lengths = [0, 1, 63, 64, 65, 1023, 1024, 1025, 3 << 20, 256 * 1024 + 1, 257 * 1024]
    host, bufs = _inputs(lengths, mis, 21)
    assert gpu.hash_buffers("blake3", bufs, stream=0, poison=True) == want("blake3", host)
    assert [e for e, _, _ in launches] == ["blake3_set_128"]     # one launch per request; a small one: 128
    launches.clear()
    prev = gpu.set_one_launch(False)
    try:
        assert gpu.hash_buffers("blake3", bufs, stream=0, poison=True) == want("blake3", host)
    finally:
        gpu.set_one_launch(prev)
    assert [e for e, _, _ in launches] == ["blake3_chunks", "blake3_parents"]
    launches.clear()
    for mode in ("concurrent", "serial"):
        assert gpu.hash_buffers("sha256", bufs, stream=0, mode=mode, poison=True) == want("sha256", host)
    assert len(launches) == 1 + len(lengths)      # one concurrent launch, then one per object
    for chunk in (64, 1024, 65536):
        assert gpu.hash_buffers("sha256-tree", bufs, stream=0, chunk_bytes=chunk, poison=True) == \
            want("sha256-tree", host, chunk)
    got = gpu.hash_buffers("blake3", [bufs[5], bufs[8]], stream=0, lengths=[0, 70001])
    assert got == want("blake3", [host[5][:0], host[8][:70001]])


def test_gpu_module_three_passes_and_corruption(emulated_gpu, monkeypatch):
    gpu, launches = emulated_gpu
    monkeypatch.setitem(gpu.SET_THREADS, "blake3", 64)
    host, bufs = _inputs([256 * 256 * 1024 + 1, 5000], 0, 22)
    prev = gpu.set_one_launch(False)
    try:
        p = gpu.hash_async("blake3", bufs, stream=0)
    finally:
        gpu.set_one_launch(prev)
    assert p.result() == want("blake3", host) and p.done()
    assert [e for e, _, _ in launches] == ["blake3_chunks", "blake3_parents", "blake3_parents"]
    assert [g[0] for _, g, _ in launches] == [257 + 1, 2 + 1, 2]
    launches.clear()
    p = gpu.hash_async("blake3", bufs, stream=0)          # one launch: 1025 leaf blocks, then 17 and 1 by the last
    assert p.result() == want("blake3", host)
    assert launches == [("blake3_set_64", (1025 + 1, 1, 1), (64, 1, 1))]
    good = p.result()
    host[1][17] ^= 4
    from kmesh.integrity import DigestMismatchError

    with pytest.raises(DigestMismatchError, match="object 1"):
        gpu.verify_buffers("blake3", bufs, good, stream=0)


@pytest.mark.parametrize("threads", [64, 128, 256])
@pytest.mark.parametrize("algorithm, kw", [("blake3", {}), ("sha256-tree", {"chunk_bytes": 64}),
                                           ("sha256-tree", {"chunk_bytes": 1024})])
def test_one_launch_equals_reference_for_every_block_size(emulated_gpu, monkeypatch, threads, algorithm, kw):
    """The `*_set_N` kernels' code (blocks run in a scrambled order, the last block of each object folding it):
    objects of one block, of a block and one leaf, and of enough blocks that the fold takes several rounds."""
    gpu, launches = emulated_gpu
    monkeypatch.setitem(gpu.SET_THREADS, algorithm, threads)
    leaf = 1024 if algorithm == "blake3" else kw["chunk_bytes"]
    lengths = [0, 1, leaf * threads, leaf * threads + 1, leaf * threads * (threads + 2) + 7, 3 * leaf + 5]
    host, bufs = _inputs(lengths, 3, threads)
    got = gpu.hash_buffers(algorithm, bufs, stream=0, poison=True, **kw)
    assert got == want(algorithm, host, kw.get("chunk_bytes", 0))
    kname = algorithm.replace("-", "_")
    assert [(e, b[0]) for e, _, b in launches] == [(f"{kname}_set_{threads}", threads)]
    assert launches[0][1][0] == sum(max(1, -(-max(1, -(-n // leaf)) // threads)) for n in lengths)


def test_one_launch_counters_are_zeroed_per_request(emulated_gpu):
    """Each request's per-object counters are zeroed on its stream: `empty` here returns garbage (as the device
    does), so a request that relied on leftover counters would fold at the wrong block and give wrong digests."""
    gpu, launches = emulated_gpu
    host, bufs = _inputs([300 * 1024, 70 * 1024], 0, 5)
    for _ in range(3):
        assert gpu.hash_buffers("blake3", bufs, stream=0) == want("blake3", host)


def test_one_launch_block_size_by_request_size(monkeypatch):
    from kmesh.integrity import gpu

    assert gpu.set_threads_for("blake3", 12288, 132) == 128                 # 4 x 3 MiB: spread over more SMs
    assert gpu.set_threads_for("blake3", 1 << 20, 132) == 256               # 1 GiB
    assert gpu.set_threads_for("sha256-tree", 24576, 132) == 256
    monkeypatch.setitem(gpu.SET_THREADS, "blake3", 96)
    with pytest.raises(gpu.GpuHashError, match="96"):
        gpu.set_threads_for("blake3", 1, 132)
