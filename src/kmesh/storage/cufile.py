"""cuFile (GPUDirect Storage) through `cuda.bindings.cufile`: run-time mode detection and the read itself.

Mode (what a cuFile read really does on this machine), from cuFileDriverGetProperties and cuFile's config:
  nvidia-fs  the nvidia-fs kernel module is loaded (props.nvfs major version > 0): DMA from the drive to the GPU
  p2pdma     no nvidia-fs, but cuFile is configured for PCI P2PDMA and the driver reports NVMe P2P support
  compat     neither: cuFile reads into its own host bounce buffers and copies to the GPU — a staging route
             under another name, so the arm is reported as `cufile-compat`, never as direct
A machine without CUDA, libcufile or the bindings has no direct route; `detect()` says why.
The driver's properties are not enough: cuFile must also be able to register a file handle where the objects
live (it needs the volume's udev attributes, which a container may lack: then not even compat mode runs).
`detect(probe_dir=...)` therefore registers a small O_DIRECT temp file there; if that fails the arm is
`cufile-unavailable` and the reason carries cuFile's error and the last ERROR lines of cufile.log.
`classify()` is pure (tested with fake property values); `detect()` asks the real library.
"""
from __future__ import annotations

import ctypes
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kmesh.storage.errors import RouteIOError, RouteUnavailableError

# CUfileDriverStatusFlags_t bit (cufile.h): the driver can do NVMe peer-to-peer DMA (P2PDMA).
NVME_P2P_SUPPORTED_BIT = 11
ARMS = {"nvidia-fs": "cufile-nvfs", "p2pdma": "cufile-p2pdma", "compat": "cufile-compat"}


class _Nvfs(ctypes.Structure):
    _fields_ = [("major_version", ctypes.c_uint), ("minor_version", ctypes.c_uint),
                ("poll_thresh_size", ctypes.c_size_t), ("max_direct_io_size", ctypes.c_size_t),
                ("dstatusflags", ctypes.c_uint), ("dcontrolflags", ctypes.c_uint)]


class DrvProps(ctypes.Structure):
    """CUfileDrvProps_t (cufile.h)."""

    _fields_ = [("nvfs", _Nvfs), ("fflags", ctypes.c_uint), ("max_device_cache_size", ctypes.c_uint),
                ("per_buffer_cache_size", ctypes.c_uint), ("max_device_pinned_mem_size", ctypes.c_uint),
                ("max_batch_io_size", ctypes.c_uint), ("max_batch_io_timeout_msecs", ctypes.c_uint)]


@dataclass(frozen=True)
class Mode:
    mode: str | None                # nvidia-fs | p2pdma | compat | None (no cuFile at all)
    arm: str                        # the arm name a result records
    direct: bool                    # True only when bytes go drive -> GPU without host staging
    reason: str
    props: dict[str, Any] = field(default_factory=dict)


def classify(nvfs_major: int, dstatusflags: int, use_pci_p2pdma: bool | None, force_compat: bool | None) -> Mode:
    props = {"nvfs_major_version": nvfs_major, "dstatusflags": dstatusflags, "use_pci_p2pdma": use_pci_p2pdma,
             "force_compat_mode": force_compat}
    if force_compat:
        return Mode("compat", ARMS["compat"], False, "cuFile is configured to force compat mode", props)
    if nvfs_major > 0:
        return Mode("nvidia-fs", ARMS["nvidia-fs"], True, f"nvidia-fs {nvfs_major}.x is loaded", props)
    if use_pci_p2pdma and dstatusflags >> NVME_P2P_SUPPORTED_BIT & 1:
        return Mode("p2pdma", ARMS["p2pdma"], True, "no nvidia-fs; cuFile uses PCI P2PDMA (NVMe P2P supported)",
                    props)
    why = "no nvidia-fs module" + ("" if use_pci_p2pdma else ", P2PDMA not enabled in cuFile's config") + \
        ("" if dstatusflags >> NVME_P2P_SUPPORTED_BIT & 1 else ", no NVMe P2P support reported")
    return Mode("compat", ARMS["compat"], False, f"{why}: cuFile stages through host memory", props)


def unavailable(reason: str) -> Mode:
    return Mode(None, "direct-unavailable", False, reason)


UNREGISTRABLE_ARM = "cufile-unavailable"
PROBE_BYTES = 8192


def log_paths() -> list[Path]:
    """Where cuFile writes cufile.log: $CUFILE_LOGFILE_PATH, else logging.dir of its JSON config, else the CWD."""
    out: list[Path] = []
    if os.environ.get("CUFILE_LOGFILE_PATH"):
        out.append(Path(os.environ["CUFILE_LOGFILE_PATH"]))
    conf = Path(os.environ.get("CUFILE_ENV_PATH_JSON", "/etc/cufile.json"))
    try:   # the file carries // comments (not JSON): look for the "logging" section's "dir" only
        m = re.search(r'"logging"\s*:\s*\{[^}]*?"dir"\s*:\s*"([^"]+)"', conf.read_text())
        if m:
            out.append(Path(m.group(1)) / "cufile.log")
    except OSError:
        pass
    out.append(Path.cwd() / "cufile.log")
    return out


def _log_sizes() -> dict[Path, int]:
    sizes = {}
    for p in log_paths():
        try:
            sizes[p] = p.stat().st_size
        except OSError:
            sizes[p] = 0
    return sizes


def log_errors(since: dict[Path, int] | None = None, limit: int = 4) -> list[str]:
    """The last ERROR lines cuFile wrote to cufile.log (only those after `since`'s sizes, when given)."""
    for p in log_paths():
        try:
            with open(p, "rb") as f:
                f.seek((since or {}).get(p, 0))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        errs = [ln.strip() for ln in lines if "ERROR" in ln]
        if errs:
            return [f"{p}: {e}" for e in errs[-limit:]]
    return []


def probe_registration(lib: Any, directory: Path | str) -> str | None:
    """Register (then deregister) a small O_DIRECT temp file in `directory`; None if cuFile accepted it, else why."""
    directory = Path(directory)
    try:
        fd0, name = tempfile.mkstemp(prefix=".kmesh-cufile-probe-", dir=directory)
    except OSError as e:
        return f"cannot create a probe file in {directory}: {e}"
    try:
        with os.fdopen(fd0, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            return f"O_DIRECT open of a probe file in {directory} failed: {e}"
        try:
            sizes = _log_sizes()
            try:
                CuFileHandle(lib, fd).close()
            except RouteIOError as e:
                errs = log_errors(sizes) or log_errors()
                return f"{e} (probe file in {directory})" + (f"; cufile.log: {' | '.join(errs)}" if errs else
                                                             "; no ERROR lines in cufile.log")
            return None
        finally:
            os.close(fd)
    finally:
        os.unlink(name)


def _bool_param(lib: Any, name: str) -> bool | None:
    enum = getattr(lib, "BoolConfigParameter", None)
    p = getattr(enum, name, None) if enum is not None else None
    if p is None:
        return None
    try:
        return bool(lib.get_parameter_bool(int(p)))
    except Exception:
        return None


def load_lib() -> Any:
    """The cuda.bindings.cufile module (raises RouteUnavailableError with the reason)."""
    try:
        from cuda.bindings import cufile
    except Exception as e:  # ImportError, or libcufile.so missing at import
        raise RouteUnavailableError(f"cuda.bindings.cufile not importable: {type(e).__name__}: {e}") from e
    return cufile


def detect(lib: Any | None = None, probe_dir: Path | str | None = None) -> Mode:
    """Open the cuFile driver and classify what a read would do; with `probe_dir`, also register a file handle
    there (module doc). Never raises: no cuFile, or one that cannot register a file, is a Mode too."""
    try:
        lib = lib or load_lib()
        lib.driver_open()
    except RouteUnavailableError as e:
        return unavailable(str(e))
    except Exception as e:
        return unavailable(f"cuFileDriverOpen failed: {type(e).__name__}: {e}")
    props = DrvProps()
    try:
        lib.driver_get_properties(ctypes.addressof(props))
    except Exception as e:
        return unavailable(f"cuFileDriverGetProperties failed: {type(e).__name__}: {e}")
    m = classify(props.nvfs.major_version, props.nvfs.dstatusflags,
                 _bool_param(lib, "USE_PCI_P2PDMA"), _bool_param(lib, "FORCE_COMPAT_MODE"))
    if probe_dir is None:
        return m
    why = probe_registration(lib, probe_dir)
    if why is None:
        return Mode(m.mode, m.arm, m.direct, f"{m.reason}; a file handle registered in {probe_dir}",
                    {**m.props, "probe_dir": str(probe_dir), "probe": "registered"})
    return Mode(None, UNREGISTRABLE_ARM, False,
                f"cuFile would run in {m.mode} mode ({m.reason}), but cannot register a file here: {why}",
                {**m.props, "classified_mode": m.mode, "probe_dir": str(probe_dir), "probe": "failed"})


class _DescrHandle(ctypes.Union):
    _fields_ = [("fd", ctypes.c_int), ("handle", ctypes.c_void_p)]


class CUfileDescr(ctypes.Structure):
    """CUfileDescr_t (cufile.h), built here so the handle registration does not depend on how a given
    cuda-bindings release wraps the struct."""

    _fields_ = [("type", ctypes.c_int), ("handle", _DescrHandle), ("fs_ops", ctypes.c_void_p)]


CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1


class CuFileHandle:
    """A registered cuFile handle over an open fd (O_DIRECT recommended)."""

    def __init__(self, lib: Any, fd: int) -> None:
        self.lib = lib
        self._descr = CUfileDescr(CU_FILE_HANDLE_TYPE_OPAQUE_FD, _DescrHandle(fd=fd), None)
        try:
            self.fh = lib.handle_register(ctypes.addressof(self._descr))
        except Exception as e:
            raise RouteIOError(f"cuFileHandleRegister failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        if self.fh:
            self.lib.handle_deregister(self.fh)
            self.fh = 0
