"""Storage routes: bring an object file's padded payload into a landing buffer, and say what actually ran.

    route = build("odirect", device, io=IOSettings("auto", 8, 512 << 10))
                                           # buffered | odirect (CPU arms) | staging | staging-buffered | direct
    land = route.landing(total_bytes)      # aligned host (pinned on CUDA) or device memory, allocated once
    route.landing_kind()                   # what the landing is: memory, pinned, alignment, allocator, huge pages
    f = route.open(path)                   # header checked
    route.read(f, land[off:off + f.header.padded_nbytes])
    f.header.verify(route.host_bytes(dst)) # the integrity check reads host bytes (device routes copy back first)
    route.describe()                       # arm as run, I/O engine as run, O_DIRECT, mode, reads and bytes

Host routes read through an I/O engine chosen per route (`io`): "uring" = io_uring (kmesh.storage.uring:
chunks of `chunk_bytes` with up to `queue_depth` in flight; READV_FIXED from the landing buffer, registered
once when it is allocated, where the kernel and RLIMIT_MEMLOCK allow), refused with RouteUnavailableError
where io_uring cannot run; "preadv" = os.preadv; "auto" = io_uring where the probe says it works, else
preadv with the probe's reason. `describe()["io_engine"]` says which ran and why. Either engine returns only
once the I/O completed: the explicit I/O-completion wait the device copy that follows must have (an I/O is
never a CUDA stream event). The device copy itself is the caller's (kmesh.transfer: a ticket, holds on both
buffers until drained). The `direct` route is cuFile: its arm name comes from the detected mode
(`cufile-compat` when cuFile stages through host memory); with no cuFile, or a cuFile that cannot register a
file handle in the objects' directory (the probe in kmesh.storage.cufile), it raises RouteUnavailableError:
the direct route never falls back to another route under its name. `staging-buffered` is the staging route
with ordinary buffered reads (page cache) into the same pinned buffer: the comparison a machine without a
usable cuFile can still run.

A route made with `landing_like=other` reads with its own flags and engine but lands in memory allocated the
way `other` allocates its own (other.new_landing): the raw floor of an arm (kmesh.stages.storage.floor) reads
into the same kind of memory as the arm it bounds — pinned where the arm's is pinned — so a difference between
the two is the work above the read, not the memory the read lands in.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from kmesh.storage import cufile, uring
from kmesh.storage.aligned import AlignedBuffer
from kmesh.storage.errors import RouteIOError, RouteUnavailableError, ShortFileError
from kmesh.storage.objfile import ALIGN, HEADER_BYTES, ObjectFile

IO_NOTE = ("host routes read through io_uring (liburing binding; READV_FIXED from the registered landing where "
           "the kernel allows) or os.preadv, per route: describe()['io_engine'] says which ran and why")
ENGINES = ("auto", "uring", "preadv")


@dataclasses.dataclass(frozen=True)
class IOSettings:
    """How a host route reads: engine auto | uring | preadv; io_uring queue depth and chunk size."""

    engine: str = "auto"
    queue_depth: int = 8
    chunk_bytes: int = 512 << 10

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise RouteUnavailableError(f"unknown I/O engine {self.engine!r} (known: {', '.join(ENGINES)})")
        if self.queue_depth < 1 or self.chunk_bytes < ALIGN or self.chunk_bytes % ALIGN:
            raise RouteUnavailableError(f"io: queue_depth {self.queue_depth} must be >= 1 and chunk_bytes "
                                        f"{self.chunk_bytes} a positive multiple of {ALIGN}")

    @classmethod
    def of(cls, io: "IOSettings | dict[str, Any] | str | None") -> "IOSettings":
        """From a config mapping (storage.io), an engine name, or None (the defaults)."""
        if io is None:
            return cls()
        if isinstance(io, IOSettings):
            return io
        if isinstance(io, str):
            return cls(engine=io)
        return cls(**{k: io[k] for k in ("engine", "queue_depth", "chunk_bytes") if k in io})


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
    """A host-landing route: open with `flags`, read with the route's I/O engine into an aligned host buffer
    (allocated by `landing_like.new_landing` where given, else by its own)."""

    arm = "route"
    route = "host"
    flags = 0
    pin = False

    def __init__(self, device: torch.device | str = "cpu",
                 io: IOSettings | dict[str, Any] | str | None = None, landing_like: "Route | None" = None) -> None:
        self.device = torch.device(device)
        self.reads = 0
        self.bytes_read = 0
        self._buf: AlignedBuffer | None = None
        self._landing_source: Route = landing_like if landing_like is not None else self
        self.io = IOSettings.of(io)
        self._ring: uring.UringReader | None = None
        self._ring_lock = threading.Lock()
        self.engine, self.fallback_reason = self._choose_engine()
        self.fixed_reason: str | None = None if self.engine != "io_uring" else "no landing buffer registered yet"
        self.ops = {"preadv": 0}

    def _choose_engine(self) -> tuple[str, str | None]:
        """The engine, decided now; the ring is made now too (a process's open files then include it from the
        route's construction on, as the service's leak check expects)."""
        if self.io.engine == "preadv":
            return "preadv", None
        p = uring.probe()
        why = f"io_uring unavailable: {p.reason} (kernel {p.kernel})"
        if p.available:
            try:
                self._reader()
                return "io_uring", None
            except RouteUnavailableError as e:
                why = f"io_uring ring for this route: {e}"
        if self.io.engine == "uring":
            raise RouteUnavailableError(f"route {self.arm!r} with io=uring: {why}")
        return "preadv", why

    def _reader(self) -> uring.UringReader:
        """The route's ring, made on first use (and again in a forked child, which must not share it)."""
        with self._ring_lock:
            if self._ring is None or self._ring.closed or self._ring._pid != os.getpid():
                self._ring = uring.UringReader(self.io.queue_depth, self.io.chunk_bytes)
            return self._ring

    def _register_landing(self) -> None:
        if self.engine != "io_uring" or self._buf is None:
            return
        p = uring.probe()
        if not p.fixed:
            self.fixed_reason = p.fixed_reason
            return
        self.fixed_reason = self._reader().register(self._buf.address, self._buf.nbytes)

    def new_landing(self, nbytes: int) -> AlignedBuffer:
        """A landing buffer as this route allocates its own: aligned host memory, page-locked where `pin`."""
        return AlignedBuffer(nbytes, pin=self.pin)

    def landing(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.nbytes < nbytes:
            self._drop_landing()
            self._buf = self._landing_source.new_landing(nbytes)
            self._register_landing()
        return self._buf.tensor[:nbytes]

    def landing_kind(self) -> dict[str, Any]:
        """What the allocated landing is, read from the buffer itself (not from the class): memory, page-locked
        or not, alignment, allocator, huge pages asked for. RouteIOError before landing() allocated one."""
        if self._buf is None:
            raise RouteIOError(f"route {self.arm!r} has no landing buffer yet (call landing() first)")
        return {"memory": "host", "pinned": self._buf.pinned, "align": ALIGN,
                "allocator": f"{type(self._landing_source).__name__}.new_landing (AlignedBuffer)",
                "hugepages_advised": self._buf.hugepages}

    def open(self, path: Path) -> ObjectFile:
        return ObjectFile.open(path, self.flags)

    def read(self, f: ObjectFile, dst: torch.Tensor) -> int:
        if dst.numel() != f.header.padded_nbytes or dst.data_ptr() % ALIGN:
            raise RouteIOError(f"landing slice of {dst.numel()} B at {dst.data_ptr():#x} does not fit "
                               f"{f.header.padded_nbytes} aligned bytes")
        if self.engine == "io_uring":   # O_DIRECT: chunks in parallel; buffered: one read (readahead)
            n = self._reader().read(f.fd, dst, HEADER_BYTES, whole=not self.flags & os.O_DIRECT)
        else:
            n = preadv_full(f.fd, dst, HEADER_BYTES)
            self.ops["preadv"] += 1
        self.reads += 1
        self.bytes_read += n
        return n

    def host_bytes(self, dst: torch.Tensor) -> memoryview:
        return memoryview(dst.numpy()).cast("B")

    def io_engine(self) -> dict[str, Any]:
        """The I/O engine as it ran: engine, fixed buffers, queue depth, chunk, op counts, reasons."""
        d: dict[str, Any] = {"requested": self.io.engine, "engine": self.engine,
                             "fallback_reason": self.fallback_reason, "preadv_calls": self.ops["preadv"]}
        if self.engine == "io_uring":
            r = self._ring
            ops = dict(r.ops) if r is not None else {"readv_fixed": 0, "readv": 0}
            d.update(queue_depth=self.io.queue_depth, binding=uring.BINDING,
                     chunk_bytes=self.io.chunk_bytes if self.flags & os.O_DIRECT else "whole read (buffered)",
                     wait=uring.WAIT,
                     fixed_buffers=r is not None and r.registered, fixed_reason=self.fixed_reason,
                     sqes=ops, resubmits=r.resubmits if r is not None else 0)
        return d

    def describe(self) -> dict[str, Any]:
        e = self.io_engine()
        if e["engine"] == "io_uring":
            io = (f"io_uring READV{'_FIXED (registered landing)' if e['fixed_buffers'] else ''}, "
                  f"qd {e['queue_depth']}, chunk {e['chunk_bytes']}")
        else:
            io = "os.preadv" + (f" ({e['fallback_reason']})" if e["fallback_reason"] else "")
        return {"arm": self.arm, "route": self.route, "io": io, "io_engine": e,
                "o_direct": bool(self.flags & os.O_DIRECT),
                "landing": "pinned host" if self._landing_source.pin else "aligned host", "device": str(self.device),
                "reads": self.reads, "bytes_read": self.bytes_read}

    def _drop_landing(self) -> None:
        """Unregister the landing from the ring first, then unpin and unmap it."""
        if self._ring is not None and not self._ring.closed:
            self._ring.unregister()
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    def close(self) -> None:
        """Landing (unregistered, unpinned, unmapped) and ring released; closing twice is safe."""
        self._drop_landing()
        if self._ring is not None:
            self._ring.close()
            self._ring = None


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
        super().__init__(device, io="preadv")    # cuFileRead does the I/O: no ring for this route
        if mode.mode is None:
            raise RouteUnavailableError(f"direct route unavailable: {mode.reason}")
        self.mode, self.lib, self.arm = mode, lib, mode.arm
        self._dev: torch.Tensor | None = None
        self._handles: dict[int, cufile.CuFileHandle] = {}

    def new_landing(self, nbytes: int) -> AlignedBuffer:
        raise RouteUnavailableError(f"route {self.arm!r} lands in cuFile-registered device memory: a host route "
                                    "cannot read into memory of that kind")

    def landing(self, nbytes: int) -> torch.Tensor:
        if self._dev is None or self._dev.numel() < nbytes:
            self.close()
            self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.lib.buf_register(self._dev.data_ptr(), nbytes, 0)
        return self._dev[:nbytes]

    def landing_kind(self) -> dict[str, Any]:
        if self._dev is None:
            raise RouteIOError(f"route {self.arm!r} has no landing buffer yet (call landing() first)")
        return {"memory": "device", "device": str(self._dev.device), "registered": "cuFile",
                "allocator": "CuFileRoute.landing (torch.empty + cuFileBufRegister)"}

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
        return {**super().describe(), "io": "cuFileRead", "io_engine": {"engine": "cuFileRead"},
                "landing": "device (cuFile-registered)",
                "mode": self.mode.mode, "direct": self.mode.direct, "mode_reason": self.mode.reason,
                "mode_props": self.mode.props}

    def close(self) -> None:
        if self._dev is not None:
            self.lib.buf_deregister(self._dev.data_ptr())
            self._dev = None


ROUTES = {"buffered": BufferedRoute, "odirect": DirectIORoute, "staging": StagingRoute,
          "staging-buffered": StagingBufferedRoute}
CUDA_ROUTES = ("staging", "staging-buffered", "direct")


def build(name: str, device: torch.device | str = "cpu", probe_dir: Path | str | None = None,
          io: IOSettings | dict[str, Any] | str | None = None) -> Route:
    """A route by name; `direct` detects the cuFile mode and registers a probe file in `probe_dir` (default: the
    temp directory; give the objects' directory). `io` picks the host routes' I/O engine (IOSettings.of).
    Raises RouteUnavailableError with what was found (also for io="uring" where io_uring cannot run)."""
    device = torch.device(device)
    if name in CUDA_ROUTES and device.type != "cuda":
        raise RouteUnavailableError(f"route {name!r} needs a CUDA device, not {device}")
    if name == "direct":
        mode = cufile.detect(probe_dir=probe_dir if probe_dir is not None else tempfile.gettempdir())
        if mode.mode is None:
            raise RouteUnavailableError(f"direct route unavailable: {mode.reason}")
        return CuFileRoute(device, mode, cufile.load_lib())
    try:
        cls = ROUTES[name]
    except KeyError:
        raise RouteUnavailableError(f"unknown route {name!r} (known: {', '.join([*ROUTES, 'direct'])})") from None
    return cls(device, io=io)
