"""Storage routes: bring an object file's padded payload into a landing buffer, and say what actually ran.

    route = build("odirect", device)       # buffered | odirect (CPU arms) | staging | staging-buffered | direct
    land = route.landing(total_bytes)      # aligned host (pinned on CUDA) or device memory, allocated once
    f = route.open(path)                   # header checked
    route.read(f, land[off:off + f.header.padded_nbytes])
    f.header.verify(route.host_bytes(dst)) # the integrity check reads host bytes (device routes copy back first)
    route.describe()                       # arm as run, I/O call, O_DIRECT, mode, reads and bytes

Reads are os.preadv (no io_uring: no maintained Python binding is installed here; `describe()` says so). preadv
returns only once the I/O completed, which is the explicit I/O-completion wait the device copy that follows
must have: an I/O is never a CUDA stream event. The device copy itself is the caller's (kmesh.transfer: a ticket,
holds on both buffers until drained). The `direct` route is cuFile: its arm name comes from the detected mode
(`cufile-compat` when cuFile stages through host memory); with no cuFile, or a cuFile that cannot register a
file handle in the objects' directory (the probe in kmesh.storage.cufile), it raises RouteUnavailableError:
the direct route never falls back to another route under its name. `staging-buffered` is the staging route
with ordinary buffered reads (page cache) into the same pinned buffer: the comparison a machine without a
usable cuFile can still run.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from kmesh.storage import cufile
from kmesh.storage.aligned import AlignedBuffer
from kmesh.storage.errors import RouteIOError, RouteUnavailableError, ShortFileError
from kmesh.storage.objfile import ALIGN, HEADER_BYTES, ObjectFile

IO_NOTE = "os.preadv (io_uring not used: no maintained Python io_uring binding is installed)"


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the OS page cache (clean pages: the files were fsynced), so buffered reads
    are cold reads from the disk, as O_DIRECT ones are."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def preadv_full(fd: int, dst: torch.Tensor, offset: int) -> int:
    """Read dst.numel() bytes at offset into the (host, contiguous uint8) tensor; short reads continue."""
    mv = memoryview(dst.numpy()).cast("B")
    done = 0
    while done < mv.nbytes:
        try:
            n = os.preadv(fd, [mv[done:]], offset + done)
        except OSError as e:
            raise RouteIOError(f"preadv at {offset + done}: {e}") from e
        if n == 0:
            raise ShortFileError(f"end of file after {done} of {mv.nbytes} bytes")
        done += n
    return done


class Route:
    """A host-landing route: open with `flags`, read with preadv into an aligned host buffer."""

    arm = "route"
    route = "host"
    flags = 0
    pin = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.reads = 0
        self.bytes_read = 0
        self._buf: AlignedBuffer | None = None

    def landing(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.nbytes < nbytes:
            self.close()
            self._buf = AlignedBuffer(nbytes, pin=self.pin)
        return self._buf.tensor[:nbytes]

    def open(self, path: Path) -> ObjectFile:
        return ObjectFile.open(path, self.flags)

    def read(self, f: ObjectFile, dst: torch.Tensor) -> int:
        if dst.numel() != f.header.padded_nbytes or dst.data_ptr() % ALIGN:
            raise RouteIOError(f"landing slice of {dst.numel()} B at {dst.data_ptr():#x} does not fit "
                               f"{f.header.padded_nbytes} aligned bytes")
        n = preadv_full(f.fd, dst, HEADER_BYTES)
        self.reads += 1
        self.bytes_read += n
        return n

    def host_bytes(self, dst: torch.Tensor) -> memoryview:
        return memoryview(dst.numpy()).cast("B")

    def describe(self) -> dict[str, Any]:
        return {"arm": self.arm, "route": self.route, "io": IO_NOTE, "o_direct": bool(self.flags & os.O_DIRECT),
                "landing": "pinned host" if self.pin else "aligned host", "device": str(self.device),
                "reads": self.reads, "bytes_read": self.bytes_read}

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None


class BufferedRoute(Route):
    """CPU arm A: ordinary buffered reads (through the page cache, which the stage evicts before every child)."""

    arm = route = "buffered"


class DirectIORoute(Route):
    """CPU arm B and the raw floor: O_DIRECT reads into aligned host memory, no page cache."""

    arm = route = "odirect"
    flags = os.O_DIRECT


class StagingRoute(Route):
    """CUDA: O_DIRECT reads into a page-locked host buffer; the caller's device copy follows each read."""

    arm = route = "staging"
    flags = os.O_DIRECT
    pin = True


class StagingBufferedRoute(Route):
    """CUDA: buffered reads (through the page cache, dropped before every child) into a page-locked host buffer;
    the caller's device copy follows each read, as in `staging`."""

    arm = route = "staging-buffered"
    pin = True


class CuFileRoute(Route):
    """CUDA: cuFile reads into registered device memory. The arm is named after the detected mode."""

    route = "direct"
    flags = os.O_DIRECT

    def __init__(self, device: torch.device | str, mode: cufile.Mode, lib: Any) -> None:
        super().__init__(device)
        if mode.mode is None:
            raise RouteUnavailableError(f"direct route unavailable: {mode.reason}")
        self.mode, self.lib, self.arm = mode, lib, mode.arm
        self._dev: torch.Tensor | None = None
        self._handles: dict[int, cufile.CuFileHandle] = {}

    def landing(self, nbytes: int) -> torch.Tensor:
        if self._dev is None or self._dev.numel() < nbytes:
            self.close()
            self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.lib.buf_register(self._dev.data_ptr(), nbytes, 0)
        return self._dev[:nbytes]

    def read(self, f: ObjectFile, dst: torch.Tensor) -> int:
        if self._dev is None or dst.numel() != f.header.padded_nbytes:
            raise RouteIOError("landing slice does not fit the object")
        torch.cuda.synchronize(self.device)       # earlier stream work on the landing (e.g. its poison) is done
        h = cufile.CuFileHandle(self.lib, f.fd)
        try:
            base = self._dev.data_ptr()
            n = self.lib.read(h.fh, base, dst.numel(), HEADER_BYTES, dst.data_ptr() - base)
            torch.cuda.synchronize(self.device)   # cuFileRead is synchronous; nothing else may be reordered
        finally:
            h.close()
        # cuda-bindings' read() checks cuFileRead's status and (in the 12.9-13.x releases) returns nothing; where
        # it returns the byte count, a short read is refused here. Either way the digest check that follows
        # covers every padded byte of a landing slot the stage poisoned before.
        if n is not None and n != dst.numel():
            raise RouteIOError(f"cuFileRead returned {n} of {dst.numel()} bytes")
        self.reads += 1
        self.bytes_read += dst.numel()
        return dst.numel()

    def host_bytes(self, dst: torch.Tensor) -> memoryview:
        # the whole padded object comes back for the CPU checksum, as in the write-up's DMA-BUF route
        return memoryview(dst.cpu().numpy()).cast("B")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "io": "cuFileRead", "landing": "device (cuFile-registered)",
                "mode": self.mode.mode, "direct": self.mode.direct, "mode_reason": self.mode.reason,
                "mode_props": self.mode.props}

    def close(self) -> None:
        if self._dev is not None:
            self.lib.buf_deregister(self._dev.data_ptr())
            self._dev = None


ROUTES = {"buffered": BufferedRoute, "odirect": DirectIORoute, "staging": StagingRoute,
          "staging-buffered": StagingBufferedRoute}
CUDA_ROUTES = ("staging", "staging-buffered", "direct")


def build(name: str, device: torch.device | str = "cpu", probe_dir: Path | str | None = None) -> Route:
    """A route by name; `direct` detects the cuFile mode and registers a probe file in `probe_dir` (default: the
    temp directory; give the objects' directory). Raises RouteUnavailableError with what was found."""
    device = torch.device(device)
    if name in CUDA_ROUTES and device.type != "cuda":
        raise RouteUnavailableError(f"route {name!r} needs a CUDA device, not {device}")
    if name == "direct":
        mode = cufile.detect(probe_dir=probe_dir if probe_dir is not None else tempfile.gettempdir())
        if mode.mode is None:
            raise RouteUnavailableError(f"direct route unavailable: {mode.reason}")
        return CuFileRoute(device, mode, cufile.load_lib())
    try:
        return ROUTES[name](device)
    except KeyError:
        raise RouteUnavailableError(f"unknown route {name!r} (known: {', '.join([*ROUTES, 'direct'])})") from None
