"""Find, build if needed, and load a kernel cubin with cupy.RawModule.

Where a cubin comes from, in order:
1. the directory given to `configure()` or in $KMESH_KERNEL_DIR (a stage passes results/<profile>/kernels/),
2. <root>/results/cuda/kernels/<name>.cubin (what `python -m kmesh run kernels --profile cuda` writes),
3. otherwise nvcc compiles kernels/<name>.cu on the fly into <root>/results/.kernel-cache/ (tests, scripts).
A cubin older than its source or any header it includes ("quoted", e.g. kernels/integrity_tree.cuh) is never
used: it is rebuilt. `kernel_info(name)` says what was loaded.
$KMESH_KERNEL_FLAGS (e.g. "-DRESTORE_ROT_CHUNK=16") adds nvcc flags for tuning experiments: then prebuilt cubins
(built without them) are skipped and the source is compiled with the flags.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

from kmesh.errors import KMeshError

GENCODE = "-gencode=arch=compute_90,code=sm_90"
_lock = threading.Lock()
_dir: Path | None = None
_modules: dict[tuple[str, int, str], Any] = {}
_info: dict[str, dict[str, Any]] = {}


class KernelLoadError(KMeshError):
    """A kernel could not be found, built or loaded (no cupy, no nvcc, compile error, missing symbol)."""


def configure(cubin_dir: str | os.PathLike[str] | None) -> None:
    """Look for cubins in this directory first (None: back to the defaults). Drops loaded modules."""
    global _dir
    with _lock:
        _dir = Path(cubin_dir) if cubin_dir is not None else None
        _modules.clear()
        _info.clear()


def _root() -> Path:
    from kmesh.config import find_root

    try:
        return find_root()
    except KMeshError:
        return Path(__file__).resolve().parents[3]


def source_path(name: str) -> Path:
    src = _root() / "kernels" / f"{name}.cu"
    if not src.is_file():
        raise KernelLoadError(f"kernel source {src} not found (set KMESH_ROOT to the KMesh checkout)")
    return src


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)


def local_sources(src: Path) -> list[Path]:
    """src and every file it #includes in quotes, recursively (relative to the including file): what its cubin
    is built from."""
    seen: list[Path] = []
    todo = [src.resolve()]
    while todo:
        p = todo.pop()
        if p in seen or not p.is_file():
            continue
        seen.append(p)
        todo += [(p.parent / m).resolve() for m in _INCLUDE.findall(p.read_text(errors="replace"))]
    return seen


def _fresh(cubin: Path, src: Path) -> bool:
    return cubin.is_file() and cubin.stat().st_size > 0 and \
        cubin.stat().st_mtime >= max(p.stat().st_mtime for p in local_sources(src))


def extra_flags() -> list[str]:
    """Tuning flags from $KMESH_KERNEL_FLAGS (empty in normal runs)."""
    return list(_split_flags(os.environ.get("KMESH_KERNEL_FLAGS", "")))


@functools.lru_cache(maxsize=16)
def _split_flags(text: str) -> tuple[str, ...]:   # once per value: launches ask for the flags each time
    return tuple(shlex.split(text))


def _compile(src: Path) -> Path:
    nvcc = shutil.which(os.environ.get("KMESH_NVCC", "nvcc"))
    if nvcc is None:
        raise KernelLoadError(f"no prebuilt cubin for {src.stem} and no nvcc to build one")
    flags = extra_flags()
    text = b"".join(p.read_bytes() for p in local_sources(src))
    digest = hashlib.sha256(text + GENCODE.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = _root() / "results" / ".kernel-cache"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{src.stem}-{digest}.cubin"
    if out.is_file() and out.stat().st_size > 0:
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", "-lineinfo", *flags, *shlex.split(GENCODE), str(src), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise KernelLoadError(f"nvcc failed for {src}:\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def cubin_for(name: str) -> tuple[Path, str]:
    """(cubin path, how it was found: 'configured' | 'results' | 'compiled')."""
    src = source_path(name)
    candidates = []
    env = os.environ.get("KMESH_KERNEL_DIR")
    for d, how in ((_dir, "configured"), (Path(env) if env else None, "configured"),
                   (_root() / "results" / "cuda" / "kernels", "results")):
        if d is not None:
            candidates.append((d / f"{name}.cubin", how))
    for cubin, how in candidates:
        if not extra_flags() and _fresh(cubin, src):
            return cubin, how
    return _compile(src), "compiled"


def load_module(name: str, device_index: int = 0) -> Any:
    """The cupy.RawModule of kernels/<name>.cu on one device (cached per flags)."""
    key = (name, device_index, os.environ.get("KMESH_KERNEL_FLAGS", ""))
    with _lock:
        if key in _modules:
            return _modules[key]
        try:
            import cupy
        except ImportError as e:
            raise KernelLoadError("cupy is not installed; the CUDA kernels need it") from e
        cubin, how = cubin_for(name)
        try:
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(path=str(cubin))
        except Exception as e:  # cupy raises its own CUDA driver errors
            raise KernelLoadError(f"loading {cubin} failed: {type(e).__name__}: {e}") from e
        _modules[key] = module
        _info[name] = {"cubin": str(cubin), "found": how, "flags": extra_flags(),
                       "sha256": hashlib.sha256(cubin.read_bytes()).hexdigest()}
        return module


def get_function(name: str, entry: str, device_index: int = 0) -> Any:
    module = load_module(name, device_index)
    try:
        return module.get_function(entry)
    except Exception as e:
        raise KernelLoadError(f"{name}.cubin has no entry point {entry!r}: {e}") from e


def kernel_info(name: str) -> dict[str, Any] | None:
    """Where the loaded cubin of `name` came from (None if not loaded)."""
    return dict(_info[name]) if name in _info else None
