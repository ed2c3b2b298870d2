"""Shared host memory segments (POSIX shm under /dev/shm, or memfd) seen as torch tensors, with leak counting.

    seg = Segment.create(nbytes, name="kmesh-x")     # or Segment.create(nbytes) for an anonymous memfd
    t = seg.tensor(torch.float32, (256, 1024))        # a view; the mapping stays while any view lives
    other = Segment.attach("kmesh-x")                 # in another process (or Segment.from_fd(fd))
    del t; seg.close(); seg.unlink()

Views are made through a memoryview, so unmapping while a tensor still points into the mapping is refused
(SegmentBusyError) instead of leaving a dangling pointer. `tag` = (st_dev, st_ino) names the same memory
in every process that maps it, whatever address it lands at.
"""
from __future__ import annotations

import fcntl
import math
import mmap
import os
import re
import threading
from pathlib import Path

import torch

from kmesh.errors import KMeshError

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class ShmError(KMeshError):
    """A shared memory segment could not be created, attached or used as asked."""


class SegmentNotFoundError(ShmError):
    """attach() named a segment that does not exist."""


class SegmentBusyError(ShmError):
    """close() while tensor views into the mapping are still alive."""


_live_lock = threading.Lock()
_live: dict[int, "Segment"] = {}


class Segment:
    """One mapped shared memory object (named /dev/shm file or memfd)."""

    def __init__(self, fd: int, size: int, name: str | None, owner: bool) -> None:
        self.fd = fd
        self.size = size
        self.name = name
        self.owner = owner  # created here (may unlink)
        st = os.fstat(fd)
        self.tag: tuple[int, int] = (st.st_dev, st.st_ino)
        self._mm: mmap.mmap | None = mmap.mmap(fd, size) if size else None
        # One probe view for the base address; released at once so it pins nothing.
        probe = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8) if size else None
        self.address = probe.data_ptr() if probe is not None else 0
        del probe
        with _live_lock:
            _live[id(self)] = self

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def create(cls, size: int, name: str | None = None) -> "Segment":
        """A new zero-filled segment: named (/dev/shm/<name>, must not exist) or, without a name, a memfd."""
        if size < 0:
            raise ShmError(f"segment size must be >= 0, got {size}")
        if name is None:
            fd = os.memfd_create("kmesh-seg", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        else:
            _check_name(name)
            try:
                fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError as e:
                raise ShmError(f"shm segment {name!r} already exists") from e
        try:
            os.ftruncate(fd, size)
            if name is None:
                # Fixed size from here on: a peer we pass this fd to (the cache service) must never see it
                # shrink under its mapping (SIGBUS) — it refuses memfds without these seals.
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            return cls(fd, size, name, owner=True)
        except BaseException:
            os.close(fd)
            if name is not None:
                (SHM_DIR / name).unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing named segment (its full size)."""
        _check_name(name)
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise SegmentNotFoundError(f"no shm segment named {name!r}") from e
        return cls(fd, os.fstat(fd).st_size, name, owner=False)

    @classmethod
    def from_fd(cls, fd: int) -> "Segment":
        """Map a segment received as a file descriptor (memfd passed by fork/exec or SCM_RIGHTS); takes the fd."""
        return cls(fd, os.fstat(fd).st_size, None, owner=False)

    # -- use ----------------------------------------------------------------------------------------
    def tensor(self, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None,
               offset: int = 0) -> torch.Tensor:
        """A tensor view of bytes [offset, offset + prod(shape) * itemsize) of the mapping."""
        if self._mm is None:
            raise ShmError("segment is closed or empty")
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = (self.size - offset) // itemsize if shape is None else math.prod(shape)
        if offset < 0 or offset % itemsize or offset + count * itemsize > self.size:
            raise ShmError(f"view of {count} x {dtype} at offset {offset} does not fit a {self.size}-byte segment "
                           f"(or is misaligned)")
        flat = torch.frombuffer(memoryview(self._mm), dtype=dtype, count=count, offset=offset)
        return flat if shape is None else flat.view(shape)

    def contains(self, address: int, nbytes: int = 1) -> bool:
        return self._mm is not None and self.address <= address and address + nbytes <= self.address + self.size

    def close(self) -> None:
        """Unmap and close the fd. Raises SegmentBusyError while views are alive (drop them first)."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError as e:
                raise SegmentBusyError(f"segment {self.name or self.tag}: tensor views are still alive") from e
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with _live_lock:
            _live.pop(id(self), None)

    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings elsewhere stay valid until closed). No-op for memfd."""
        if self.name is not None:
            (SHM_DIR / self.name).unlink(missing_ok=True)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ShmError(f"shm name {name!r} must be 1-200 of [A-Za-z0-9._-] (no slash)")


def segment_at(address: int, nbytes: int = 1) -> tuple[Segment, int] | None:
    """The live segment of this process mapping [address, address + nbytes), and the offset in it."""
    with _live_lock:
        for seg in _live.values():
            if seg.contains(address, nbytes):
                return seg, address - seg.address
    return None


# -- leak counting ----------------------------------------------------------------------------------
def live_segments() -> int:
    """Segments mapped (not yet closed) by this process."""
    with _live_lock:
        return len(_live)


def dev_shm_entries(prefix: str) -> list[str]:
    """Names in /dev/shm starting with prefix (named segments that exist, whoever maps them)."""
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def open_fds(pid: int | str = "self") -> int:
    """Open file descriptors of a process (default: this one)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def mapped_shm(pid: int | str = "self", prefix: str = "") -> int:
    """Mappings of /dev/shm files (with prefix) and memfds in a process, from /proc/<pid>/maps."""
    n = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(maxsplit=5)[5:] or [""]
            p = path[0]
            if p.startswith(f"/dev/shm/{prefix}") or (not prefix and p.startswith("/memfd:")):
                n += 1
    return n
