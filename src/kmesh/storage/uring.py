"""io_uring reads into aligned host memory, through the `liburing` package (Python binding of C liburing).

    p = probe()                          # cached: io_uring itself, fixed buffers, and why not
    with UringReader(queue_depth=8, chunk_bytes=512 << 10) as ring:
        ring.register(buf.address, buf.nbytes)   # once per landing buffer; returns why not, or None
        ring.read(fd, dst, offset)              # every chunk submitted together; returns when ALL completed
        ring.unregister()                       # before the memory is unpinned / unmapped

A read splits [offset, offset + nbytes) into chunks of `chunk_bytes` (4 KiB multiples, as O_DIRECT needs), keeps
up to `queue_depth` of them in flight, and waits for every completion before it returns: that wait is the
explicit I/O-completion point a device copy of the landing relies on. A negative completion is a RouteIOError
(errno text); a short completion continues with the remainder (resubmitted); a completion of 0 bytes is the
end of the file, a ShortFileError: the contract of routes.preadv_full. On an error the reads still in flight
are reaped first, so the kernel writes nothing into the buffer after read() returns. `read(..., whole=True)`
submits it as one read (buffered files: parallel chunks defeat the page cache's readahead).

Binding notes (liburing 2026.3.30), which shape this module:
  * io_uring_prep_read / prep_read_fixed accept only a Python `bytearray`, never foreign memory such as an
    mmap'd landing buffer; the iovec forms (prep_readv, prep_readv_fixed) take any buffer. So reads are
    IORING_OP_READV with one iovec per chunk, and fixed-buffer reads IORING_OP_READV_FIXED (kernel >= 6.15);
    where the kernel lacks READV_FIXED, reads stay plain READV and the probe says why.
  * `Iovec([...])` keeps a buffer export of each item for good (it never releases it). An export of the mmap
    itself would make the landing impossible to unmap, so items are ctypes views made from the address, and one
    Iovec per chunk span is kept and reused (bounded by the distinct spans of a landing buffer).
  * `CQE.res` raises OSError for a negative result; it is turned back into -errno here.
  * The binding holds the GIL inside io_uring_wait_cqe / submit_and_wait: a blocked wait would stall every
    other thread (the pipelined reader overlaps reads with the stage's copies; the read-once tier and the
    service read from threads). So the one blocking call, the wait, is the io_uring_enter syscall itself
    (GETEVENTS, min_complete = the completions wanted) made through ctypes, which releases the GIL; the binding
    then reaps what io_uring_cq_ready says is there without blocking. One wait covers a whole batch: the task
    is woken once, not once per chunk (an eventfd would wake it per completion).
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno as errno_mod
import functools
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from kmesh.storage.errors import RouteIOError, RouteUnavailableError, ShortFileError
from kmesh.storage.objfile import ALIGN

BINDING = "liburing (PyPI) iovec ops"
WAIT = "io_uring_enter(GETEVENTS, min_complete) via ctypes (GIL released), then reaped with the binding"
_SYS_IO_URING_ENTER = 426           # the same number on every architecture of the unified syscall table
_IORING_ENTER_GETEVENTS = 1
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
MAX_FIXED_REGION = 1 << 30          # the kernel refuses a registered buffer over 1 GiB: larger ones are split

try:                                 # the module imports without the package; probe() then says so
    import liburing as _L
    _IMPORT_ERROR: str | None = None
except ImportError as _e:            # pragma: no cover - the package is in the pinned environments
    _L = None
    _IMPORT_ERROR = f"the liburing package cannot be imported: {_e}"


# The binding's calls this module makes, run once in a child process before any in this one: the PyPI wheel is
# built for a CPU level of its own (liburing 2026.3.30 has AVX-512 code, and `Ring()` dies of SIGILL on an AMD EPYC
# without AVX-512), and a crash in-process would take the service or the stage with it, not fall back to preadv.
_SMOKE = """
import os, sys, tempfile, liburing as L
r, c = L.Ring(), L.Cqe()
try:
    L.io_uring_queue_init(2, r)
except OSError as e:
    sys.exit(print("ring refused:", e, file=sys.stderr))   # the in-process probe explains a refused ring
def step(name, fn):
    try:                               # an errno is the kernel's answer, not a fault of the binding: go on
        return fn()
    except OSError as e:
        print(name, e, file=sys.stderr)
try:
    step("probe", L.probe)
    with tempfile.TemporaryFile() as f:
        f.write(bytes(range(256)) * 16)
        f.flush()
        buf = bytearray(4096)
        iov = L.Iovec([buf])
        sqe = L.io_uring_get_sqe(r)
        L.io_uring_prep_readv(sqe, f.fileno(), iov, 0)
        sqe.user_data = 1
        step("submit", lambda: L.io_uring_submit(r))
        step("wait", lambda: L.io_uring_wait_cqe(r, c))
        step("res", lambda: c[0].res)
        L.io_uring_cqe_seen(r, c[0])
finally:
    L.io_uring_queue_exit(r)
"""


@functools.cache
def binding_crash() -> str | None:
    """Why the liburing binding cannot run on this machine (its calls killed a child process), or None."""
    if _L is None:
        return None
    try:
        r = subprocess.run([sys.executable, "-c", _SMOKE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the liburing binding's check in a child process did not complete: {e}"
    if r.returncode >= 0:
        # an exception in the child (other than a refused ring) is a binding fault too: say what it was
        return None if r.returncode == 0 else ("the liburing binding failed in a child process: "
                                               + (r.stderr.strip().splitlines() or ["?"])[-1])
    sig = signal.Signals(-r.returncode).name if -r.returncode in signal.valid_signals() else str(-r.returncode)
    hint = (" (the wheel's code needs CPU instructions this CPU lacks, e.g. AVX-512)" if sig == "SIGILL" else "")
    return f"the liburing binding {getattr(_L, '__version__', '?')} killed a child process with {sig}{hint}"


@dataclasses.dataclass(frozen=True)
class Probe:
    """What this process can use: io_uring (a ring could be set up), fixed buffers (READV_FIXED supported and a
    registration of a small buffer succeeded), and the reason for each that is not."""

    available: bool
    reason: str | None
    fixed: bool
    fixed_reason: str | None
    kernel: str
    io_uring_disabled: str | None
    memlock_limit: str
    binding: str | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _errno_text(e: OSError | int) -> str:
    n = e if isinstance(e, int) else e.errno
    return f"[Errno {n}] {errno_mod.errorcode.get(n, '?')}: {os.strerror(n)}" if n else str(e)


def _sysctl() -> str | None:
    try:
        return Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()
    except OSError:
        return None     # older kernels have no such switch


def _memlock() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    show = lambda v: "unlimited" if v == resource.RLIM_INFINITY else f"{v} B"  # noqa: E731
    return f"soft {show(soft)}, hard {show(hard)}"


def _ring_refusal(e: OSError, disabled: str | None) -> str:
    why = {errno_mod.EPERM: "refused (EPERM: io_uring_disabled, or a seccomp filter of this container)",
           errno_mod.ENOSYS: "no io_uring_setup syscall (ENOSYS: kernel without io_uring, or seccomp)",
           errno_mod.ENOMEM: "ENOMEM setting up the ring (without CAP_IPC_LOCK its pages count against "
                                             f"RLIMIT_MEMLOCK: {_memlock()})"}
    return (f"io_uring_queue_init failed: {_errno_text(e)} — {why.get(e.errno, 'unexpected error')}; "
            f"kernel.io_uring_disabled={disabled}")


@functools.cache
def probe() -> Probe:
    """Set up a ring, ask the kernel which ops it has, register one 4 KiB buffer; cached for the process."""
    kernel, disabled, memlock = os.uname().release, _sysctl(), _memlock()
    binding = getattr(_L, "__version__", None)
    if _L is None:
        return Probe(False, _IMPORT_ERROR, False, _IMPORT_ERROR, kernel, disabled, memlock, None)
    try:
        ring = UringReader(queue_depth=2, chunk_bytes=ALIGN)
    except RouteUnavailableError as e:
        return Probe(False, str(e), False, "io_uring unavailable", kernel, disabled, memlock, binding)
    try:
        try:
            ops = _L.probe() or {}
        except OSError as e:
            ops, ops_err = {}, _errno_text(e)
        else:
            ops_err = None
        if not ops.get("IORING_OP_READV"):
            why = f"kernel lacks IORING_OP_READV ({ops_err or 'opcode probe says unsupported'})"
            return Probe(False, why, False, why, kernel, disabled, memlock, binding)
        if not ops.get("IORING_OP_READV_FIXED"):
            fixed_reason = ("kernel lacks IORING_OP_READV_FIXED (Linux >= 6.15); the binding's READ_FIXED takes "
                            "only a bytearray, not the landing buffer's memory: plain READV")
            return Probe(True, None, False, fixed_reason, kernel, disabled, memlock, binding)
        mm = mmap.mmap(-1, ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            why = ring.register(addr, ALIGN)
            ring.unregister()
        finally:
            ring.forget_views()
            # the ctypes view above holds an export of `mm`: it is gone once the statement's temporary is freed
            try:
                mm.close()
            except BufferError:   # pragma: no cover - CPython frees the temporary at once
                pass
        return Probe(True, None, why is None, why, kernel, disabled, memlock, binding)
    finally:
        ring.close()


def probe_reason() -> str:
    """One line: what io_uring this process has, for a skip reason or a result note."""
    p = probe()
    if not p.available:
        return f"io_uring unavailable: {p.reason} (kernel {p.kernel})"
    return f"io_uring available (kernel {p.kernel}); fixed buffers: {'yes' if p.fixed else p.fixed_reason}"


class UringReader:
    """One io_uring instance: chunked parallel reads into host memory, optionally from registered buffers.

    Not for concurrent use from several threads at once: read() takes a lock (one read in flight per ring)."""

    def __init__(self, queue_depth: int = 8, chunk_bytes: int = 512 << 10) -> None:
        if queue_depth < 1 or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"queue_depth {queue_depth} must be >= 1 and chunk_bytes {chunk_bytes} a positive "
                             f"multiple of {ALIGN}")
        if _L is None:
            raise RouteUnavailableError(_IMPORT_ERROR or "no liburing")
        crash = binding_crash()
        if crash is not None:
            raise RouteUnavailableError(crash)
        self.queue_depth, self.chunk_bytes = int(queue_depth), int(chunk_bytes)
        self._ring = _L.Ring()
        try:
            _L.io_uring_queue_init(self.queue_depth, self._ring)
        except OSError as e:
            self._ring = None
            raise RouteUnavailableError(_ring_refusal(e, _sysctl())) from e
        self._pid = os.getpid()
        self._fd = self._ring.ring_fd
        self._broken: str | None = None
        self._cqe = _L.Cqe()
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []     # registered (address, nbytes), buffer index = position
        self._views: dict[tuple[int, int], Any] = {}  # (address, nbytes) -> Iovec, reused (see module notes)
        self.ops = {"readv_fixed": 0, "readv": 0}
        self.resubmits = 0

    # --- registration -------------------------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        return bool(self._regions)

    def register(self, address: int, nbytes: int) -> str | None:
        """Register [address, address + nbytes) as fixed buffers (1 GiB pieces); returns why not, or None."""
        self._check_open()
        if self._regions:
            self.unregister()
        regions = [(address + o, min(MAX_FIXED_REGION, nbytes - o)) for o in range(0, nbytes, MAX_FIXED_REGION)]
        try:
            _L.io_uring_register_buffers(self._ring, _L.Iovec([_view(a, n) for a, n in regions]))
        except OSError as e:
            hint = " (RLIMIT_MEMLOCK too small to pin it)" if e.errno in (errno_mod.ENOMEM, errno_mod.EPERM) else ""
            return f"io_uring_register_buffers of {nbytes} B failed: {_errno_text(e)}{hint}; memlock {_memlock()}"
        self._regions = regions
        return None

    def unregister(self) -> None:
        """Drop the fixed buffers (before the memory is unpinned or unmapped); safe when none are registered."""
        if self._regions and self._ring is not None:
            self._regions = []
            if os.getpid() == self._pid:     # a forked child's copy must not unregister its parent's buffers
                _L.io_uring_unregister_buffers(self._ring)
        self.forget_views()

    def forget_views(self) -> None:
        self._views.clear()

    def _fixed_index(self, address: int, nbytes: int) -> int | None:
        for i, (a, n) in enumerate(self._regions):
            if a <= address and address + nbytes <= a + n:
                return i
        return None

    # --- reads --------------------------------------------------------------------------------------------
    def _chunks(self, address: int, nbytes: int, offset: int, chunk: int) -> list[list[int]]:
        """[address, file offset, length] pieces: `chunk` bytes each, none crossing a registered region's end."""
        out, pos = [], 0
        while pos < nbytes:
            n = min(chunk, nbytes - pos)
            for a, rn in self._regions:
                if a <= address + pos < a + rn:
                    n = min(n, a + rn - (address + pos))
            out.append([address + pos, offset + pos, n])
            pos += n
        return out

    def _iovec(self, address: int, nbytes: int) -> Any:
        key = (address, nbytes)
        iov = self._views.get(key)
        if iov is None:
            iov = self._views[key] = _L.Iovec([_view(address, nbytes)])
        return iov

    def read(self, fd: int, dst: torch.Tensor, offset: int, whole: bool = False) -> int:
        """Read dst.numel() bytes at file offset into the host uint8 tensor; returns when every chunk completed.
        `whole`: one read for all of it (buffered files: the page cache's readahead sizes the disk I/O, and
        chunks read in parallel defeat it — measured 1.9x slower cold at 8 x 512 KiB)."""
        if dst.device.type != "cpu" or not dst.is_contiguous() or dst.element_size() != 1:
            raise RouteIOError(f"io_uring reads need a contiguous host byte tensor, not {dst.dtype} on {dst.device}")
        with self._lock:
            self._check_open()
            chunk = max(dst.numel(), 1) if whole else self.chunk_bytes
            return self._read(fd, dst.data_ptr(), dst.numel(), offset, chunk)

    def _read(self, fd: int, address: int, nbytes: int, offset: int, chunk: int) -> int:
        pending = self._chunks(address, nbytes, offset, chunk)
        pending.reverse()                               # pop() from the end = in file order
        inflight: dict[int, list[int]] = {}
        failure: str | None = None
        eof_at: int | None = None
        done, tag = 0, 0
        while inflight or (pending and failure is None and eof_at is None):
            queued = 0
            while pending and len(inflight) < self.queue_depth and failure is None and eof_at is None:
                piece = pending.pop()
                sqe = _L.io_uring_get_sqe(self._ring)
                idx = self._fixed_index(piece[0], piece[2])
                iov = self._iovec(piece[0], piece[2])
                if idx is None:
                    _L.io_uring_prep_readv(sqe, fd, iov, piece[1])
                    self.ops["readv"] += 1
                else:
                    _L.io_uring_prep_readv_fixed(sqe, fd, iov, idx, piece[1])
                    self.ops["readv_fixed"] += 1
                tag += 1
                sqe.user_data = tag
                inflight[tag] = piece
                queued += 1
            if queued:
                try:
                    _retry(_L.io_uring_submit, self._ring)
                except OSError as e:
                    # which of this batch reached the kernel is unknown: the ring is not used again (its queue
                    # may still hold them); the reads submitted before are reaped below
                    failure = failure or f"io_uring_submit: {_errno_text(e)}"
                    self._broken = failure
                    for t in list(inflight)[-queued:]:
                        del inflight[t]
                    continue
            if not _L.io_uring_cq_ready(self._ring):
                # the whole batch when nothing waits to be queued, else half of it (the queue stays fed)
                self._wait(len(inflight) if not pending or failure or eof_at is not None
                           else max(1, len(inflight) // 2))
            _L.io_uring_wait_cqe(self._ring, self._cqe)      # one is ready: returns at once
            cqe = self._cqe[0]
            t = cqe.user_data
            try:
                res = cqe.res
            except OSError as e:
                res = -(e.errno or errno_mod.EIO)
            _L.io_uring_cqe_seen(self._ring, cqe)
            piece = inflight.pop(t)
            if res < 0:
                failure = failure or f"io_uring read of {piece[2]} B at {piece[1]}: {_errno_text(-res)}"
            elif res == 0:
                eof_at = piece[1] if eof_at is None else min(eof_at, piece[1])
            else:
                done += res
                if res < piece[2]:                      # short: the remainder goes again, first
                    pending.append([piece[0] + res, piece[1] + res, piece[2] - res])
                    self.resubmits += 1
        if failure is not None:
            raise RouteIOError(failure)
        if eof_at is not None:
            raise ShortFileError(f"end of file at {eof_at} after {done} of {nbytes} bytes")
        return done

    def _wait(self, n: int) -> None:
        """Block, GIL released, until at least n completions are in the completion queue."""
        while True:
            r = _syscall(ctypes.c_long(_SYS_IO_URING_ENTER), ctypes.c_int(self._fd), ctypes.c_uint(0),
                         ctypes.c_uint(n), ctypes.c_uint(_IORING_ENTER_GETEVENTS), ctypes.c_void_p(None),
                         ctypes.c_size_t(0))
            if r >= 0:
                return
            err = ctypes.get_errno()
            if err in (errno_mod.EINTR, errno_mod.EAGAIN, errno_mod.EBUSY):
                continue
            # reads may still be in flight: this ring is not used again
            self._broken = f"io_uring_enter wait: {_errno_text(err)}"
            raise RouteIOError(self._broken)

    # --- lifetime -----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._ring is None:
            raise RouteIOError("io_uring reader is closed")
        if os.getpid() != self._pid:   # a forked child must not share its parent's submission queue
            raise RouteIOError("io_uring ring inherited across fork(); make a new one in this process")
        if self._broken:
            raise RouteIOError(f"io_uring reader unusable after: {self._broken}")

    @property
    def closed(self) -> bool:
        return self._ring is None

    def describe(self) -> dict[str, Any]:
        return {"queue_depth": self.queue_depth, "chunk_bytes": self.chunk_bytes, "registered": self.registered,
                "ops": dict(self.ops), "resubmits": self.resubmits}

    def close(self) -> None:
        """Unregister and exit the ring; closing twice is safe."""
        if self._ring is None:
            return
        try:
            if os.getpid() == self._pid:
                self.unregister()
                _L.io_uring_queue_exit(self._ring)
        finally:
            self._ring = None
            self._views.clear()

    def __enter__(self) -> "UringReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - only when a caller forgot close()
        try:
            self.close()
        except Exception:
            pass


def _view(address: int, nbytes: int) -> memoryview:
    """A byte view of foreign memory that holds no export of the object owning it (see module notes)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _retry(fn: Any, *args: Any) -> Any:
    while True:
        try:
            return fn(*args)
        except InterruptedError:
            continue
