"""cuFile (GPUDirect Storage) through `cuda.bindings.cufile`: run-time mode detection and the read itself.

Mode (what a cuFile read really does on this machine), from cuFileDriverGetProperties and cuFile's config:
  nvidia-fs  the nvidia-fs kernel module is loaded (props.nvfs major version > 0): DMA from the drive to the GPU
  p2pdma     no nvidia-fs, but cuFile is configured for PCI P2PDMA and the driver reports NVMe P2P support
  compat     neither: cuFile reads into its own host bounce buffers and copies to the GPU — a staging route
             under another name, so the arm is reported as `cufile-compat`, never as direct
A machine without CUDA, libcufile or the bindings has no direct route; `detect()` says why.
`classify()` is pure (tested with fake property values); `detect()` asks the real library.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
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


def detect(lib: Any | None = None) -> Mode:
    """Open the cuFile driver and classify what a read would do. Never raises: no cuFile is a Mode too."""
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
    return classify(props.nvfs.major_version, props.nvfs.dstatusflags,
                    _bool_param(lib, "USE_PCI_P2PDMA"), _bool_param(lib, "FORCE_COMPAT_MODE"))


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
