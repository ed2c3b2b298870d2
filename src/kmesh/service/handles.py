"""Memory handles that cross the process boundary, and the fd plumbing that carries them.

CPU: a memfd, sealed against shrink/grow, passed with SCM_RIGHTS. The seal is what makes mapping a client's
memory safe for the service: an unsealed file could be truncated under the service's mapping (SIGBUS).
The service maps it with kmesh.transfer.shm.Segment; `HostBuffer` is the client's side of the same memfd and is
torch-free on purpose (a worker that only holds host memory need not pay torch's 2 s import).

GPU: a CUDA IPC handle (cuIpcGetMemHandle) of the allocation that contains the client's tensor, plus the
offset of the tensor in it. The service opens each distinct handle once (refcounted, `CudaIpcTable`) and
closes it when its last registration is released; it checks the allocation's real size (cuMemGetAddressRange)
before trusting a client's nbytes. Driver calls go through ctypes (libcuda), no cupy needed.
"""
from __future__ import annotations

import array
import ctypes
import fcntl
import mmap
import os
import socket
import stat
import weakref
from dataclasses import dataclass
from typing import Any

from kmesh.service.errors import HandleError

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_CMSG_FDS = 4


# -- fd passing --------------------------------------------------------------------------------------
def send_frame(sock: socket.socket, data: bytes, fds: list[int] = ()) -> None:
    """Send one frame; fds ride on its first byte (one sendmsg), the rest follows with sendall."""
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv_some(sock: socket.socket, n: int) -> tuple[bytes, list[int], bool]:
    """Read at most n bytes plus any fds riding on them. Returns (data, fds, ctrunc): ctrunc means the peer
    sent more fds than a frame may carry (the kernel dropped the excess)."""
    data, anc, flags, _ = sock.recvmsg(n, socket.CMSG_SPACE(_CMSG_FDS * 4), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, typ, payload in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    return data, fds, bool(flags & socket.MSG_CTRUNC)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- CPU: memfd ---------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED_NOREPLACE = 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostBuffer:
    """Client side: a sealed memfd mapped at `address` (optionally at a requested address, to reproduce
    'a new allocation at the same address')."""

    def __init__(self, nbytes: int, name: str = "kmesh-kv", address: int | None = None) -> None:
        if nbytes <= 0:
            raise HandleError(f"buffer size must be > 0, got {nbytes}")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            flags = mmap.MAP_SHARED | (_MAP_FIXED_NOREPLACE if address else 0)
            addr = _libc.mmap(address or None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, self.fd, 0)
            if addr in (None, _MAP_FAILED):
                raise HandleError(f"mmap of {nbytes} bytes at {address!r} failed: "
                                  f"{os.strerror(ctypes.get_errno())}")
        except BaseException:
            os.close(self.fd)
            raise
        self.address: int = addr
        self.nbytes = nbytes
        st = os.fstat(self.fd)
        self.tag = (st.st_dev, st.st_ino)

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data))
        ctypes.memmove(self.address + offset, data, len(data))

    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        n = self.nbytes - offset if n is None else n
        self._check(offset, n)
        return ctypes.string_at(self.address + offset, n)

    def as_tensor(self) -> Any:
        """A uint8 torch tensor over the mapping (no copy); valid until close()."""
        import torch

        self._check(0, self.nbytes)
        return torch.frombuffer((ctypes.c_uint8 * self.nbytes).from_address(self.address), dtype=torch.uint8)

    def _check(self, offset: int, n: int) -> None:
        if self.address == 0:
            raise HandleError("buffer is closed")
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise HandleError(f"[{offset}, {offset + n}) outside a {self.nbytes}-byte buffer")

    def close(self) -> None:
        if self.address:
            _libc.munmap(self.address, self.nbytes)
            self.address = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def references_in_self(tag: tuple[int, int]) -> dict[str, list[str]]:
    """What of this process still refers to the memory file `tag` ((st_dev, st_ino), a HostBuffer's tag): its
    lines in /proc/self/maps (a mapping: the memory is still reachable here) and its open fds. Both empty once a
    HostBuffer was closed; the file's name is no identity (every staging of a child shares one), its inode is."""
    dev, ino = tag
    maps: list[str] = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[4] != str(ino):
                continue
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            if (major, minor) == (os.major(dev), os.minor(dev)):
                maps.append(line.rstrip("\n"))
    fds: list[str] = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:   # the fd listdir itself used, closed by now
            continue
        if (st.st_dev, st.st_ino) == tag:
            fds.append(name)
    return {"maps": maps, "fds": fds}


def check_memfd(fd: int, nbytes: int) -> tuple[int, int]:
    """Service side: the fd must be a memfd sealed against shrink and grow, at least nbytes long.
    Returns its (st_dev, st_ino): the identity of that memory whatever address it is mapped at."""
    try:
        st = os.fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as e:
        raise HandleError(f"attached fd is unusable: {e}") from None
    if not stat.S_ISREG(st.st_mode) or not target.startswith("/memfd:"):
        raise HandleError(f"attached fd is not a memfd (it is {target[:80]!r})")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise HandleError(f"cannot read the memfd's seals: {e}") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise HandleError("memfd must be sealed with F_SEAL_SHRINK|F_SEAL_GROW (else it could be truncated "
                          "under the service's mapping)")
    if st.st_size < nbytes:
        raise HandleError(f"memfd holds {st.st_size} bytes, registration declares {nbytes}")
    return st.st_dev, st.st_ino


# -- GPU: CUDA IPC ------------------------------------------------------------------------------------
class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # c_ubyte, not c_char: c_char fields stop at a NUL byte


_cuda: Any = None


def _driver() -> Any:
    global _cuda
    if _cuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise HandleError(f"CUDA driver not available: {e}") from None
        u64 = ctypes.c_uint64
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), u64]
        # cuda.h maps cuIpcOpenMemHandle to the _v2 entry point; older drivers only have the plain one
        lib.ipc_open = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        lib.ipc_open.argtypes = [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [u64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
        for f in ("cuIpcGetMemHandle", "cuIpcCloseMemHandle", "cuMemGetAddressRange_v2"):
            getattr(lib, f).restype = ctypes.c_int
        lib.ipc_open.restype = ctypes.c_int
        _cuda = lib
    return _cuda


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise HandleError(f"{what} failed with CUresult {rc}")


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation that contains device address ptr."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return base.value, size.value


def export_cuda(tensor: Any) -> dict[str, Any]:
    """Client side: the IPC handle of the allocation holding `tensor` and the tensor's offset in it."""
    import torch

    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise HandleError("export_cuda needs a contiguous CUDA tensor")
    torch.cuda.set_device(tensor.device)
    ptr = tensor.data_ptr()
    base, size = address_range(ptr)
    h = _IpcHandle()
    _check(_driver().cuIpcGetMemHandle(ctypes.byref(h), base), "cuIpcGetMemHandle")
    return {"device": tensor.device.index or 0, "ipc_handle": bytes(h.reserved), "offset": ptr - base,
            "alloc_nbytes": size}


class _CudaArray:
    """Exposes device memory through __cuda_array_interface__; torch keeps this object alive while any tensor
    made from it lives, so a weakref to it tells whether views are still out."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


@dataclass
class _Opened:
    base: int
    size: int
    refs: int


class MappedCuda:
    """One registration's view of an opened IPC allocation: `tensor` is its [offset, offset + nbytes) bytes."""

    def __init__(self, table: "CudaIpcTable", key: tuple[int, bytes], tensor: Any, owner: _CudaArray) -> None:
        self.table, self.key, self.tensor = table, key, tensor
        self._owner = weakref.ref(owner)

    def close(self) -> None:
        """Drop our view and, if no other view is alive, the handle's reference. HandleError if views remain."""
        self.tensor = None
        if self._owner() is not None:
            raise HandleError("views of the CUDA mapping are still alive")
        self.table._unref(self.key)


class CudaIpcTable:
    """Service side: each distinct (device, IPC handle) is opened once and closed with its last user."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, bytes], _Opened] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, handle: dict[str, Any], nbytes: int) -> MappedCuda:
        import torch

        dev, raw, offset = handle["device"], handle["ipc_handle"], handle["offset"]
        if dev >= torch.cuda.device_count():
            raise HandleError(f"cuda device {dev} does not exist here ({torch.cuda.device_count()} devices)")
        torch.cuda.set_device(dev)
        torch.cuda.current_stream(dev)  # make the primary context current on this thread
        key = (dev, raw)
        entry = self._open.get(key)
        if entry is None:
            ptr = ctypes.c_uint64()
            h = _IpcHandle.from_buffer_copy(raw)
            _check(_driver().ipc_open(ctypes.byref(ptr), h, 1), "cuIpcOpenMemHandle")  # 1: lazy peer access
            try:
                base, size = address_range(ptr.value)
            except HandleError:
                _driver().cuIpcCloseMemHandle(ptr.value)
                raise
            entry = self._open[key] = _Opened(base, size, 0)
        if offset + nbytes > entry.size:
            if entry.refs == 0:
                self._close(key)
            raise HandleError(f"registration [{offset}, {offset + nbytes}) exceeds the {entry.size}-byte "
                              f"CUDA allocation")
        owner = _CudaArray(entry.base + offset, nbytes)
        tensor = torch.as_tensor(owner, device=f"cuda:{dev}")
        entry.refs += 1
        return MappedCuda(self, key, tensor, owner)

    def _unref(self, key: tuple[int, bytes]) -> None:
        entry = self._open[key]
        entry.refs -= 1
        if entry.refs == 0:
            self._close(key)

    def _close(self, key: tuple[int, bytes]) -> None:
        entry = self._open.pop(key)
        _check(_driver().cuIpcCloseMemHandle(entry.base), "cuIpcCloseMemHandle")


class MappedMemfd:
    """Service side: a checked memfd mapped through kmesh.transfer.shm.Segment; `tensor` covers [0, nbytes)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        from kmesh.transfer.shm import Segment

        try:
            self.tag = check_memfd(fd, nbytes)
            self.segment = Segment.from_fd(fd)  # owns fd from here on (closes it in close())
        except BaseException:
            os.close(fd)
            raise
        self.tensor: Any = self.segment.tensor()[:nbytes]

    def close(self) -> None:
        """Unmap; raises kmesh.transfer.shm.SegmentBusyError (and keeps the mapping) while any view is alive."""
        self.tensor = None
        self.segment.close()
