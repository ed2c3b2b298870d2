"""io_uring reads (kmesh.storage.uring) and the routes' engine choice: real files, real rings, real failures.

Every read lands in a poisoned buffer and is compared byte for byte with the file and with os.preadv; the
io_uring tests skip (never fail) only where the probe says io_uring is unavailable, with its reason.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from kmesh.storage import routes, uring
from kmesh.storage.aligned import AlignedBuffer
from kmesh.storage.errors import RouteIOError, RouteUnavailableError, ShortFileError
from kmesh.storage.objfile import ALIGN, write_object

POISON = 0xA5
needs_uring = pytest.mark.skipif(not uring.probe().available, reason=uring.probe_reason())
needs_fixed = pytest.mark.skipif(not uring.probe().fixed, reason=uring.probe_reason())
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def blob(tmp_path):
    """A 3 MiB + 12 KiB file of random bytes (a 4 KiB multiple: O_DIRECT reads up to its end)."""
    g = torch.Generator().manual_seed(10)
    data = torch.randint(0, 256, ((3 << 20) + 3 * ALIGN,), dtype=torch.uint8, generator=g)
    p = tmp_path / "blob.bin"
    p.write_bytes(data.numpy().tobytes())
    return p, data


def _open(p: Path, direct: bool) -> int:
    try:
        return os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as e:
        pytest.skip(f"no O_DIRECT on {p.parent}: {e}")


def _preadv_copy(fd: int, nbytes: int, offset: int) -> torch.Tensor:
    with AlignedBuffer(nbytes) as b:
        b.tensor.fill_(0x5A)
        routes.preadv_full(fd, b.tensor[:nbytes], offset)
        return b.tensor[:nbytes].clone()


@needs_uring
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("nbytes,offset,land_off", [(ALIGN, 0, 0), (5 * ALIGN, 7 * ALIGN, 3 * ALIGN),
                                                    ((1 << 20) + 9 * ALIGN, 13 * ALIGN, ALIGN),
                                                    ((3 << 20) + 3 * ALIGN, 0, 0)])
def test_uring_read_equals_preadv_and_file(blob, direct, nbytes, offset, land_off):
    p, data = blob
    fd = _open(p, direct)
    try:
        want = _preadv_copy(fd, nbytes, offset)
        assert torch.equal(want, data[offset:offset + nbytes])
        with uring.UringReader(queue_depth=4, chunk_bytes=64 << 10) as r, AlignedBuffer(land_off + nbytes) as b:
            b.tensor.fill_(POISON)
            dst = b.tensor[land_off:land_off + nbytes]
            assert r.read(fd, dst, offset) == nbytes
            assert torch.equal(dst, want)
            assert (b.tensor[:land_off] == POISON).all()          # nothing written before the slice
            chunks = -(-nbytes // (64 << 10))
            assert r.ops == {"readv_fixed": 0, "readv": chunks}   # nothing registered: plain READV per chunk
    finally:
        os.close(fd)


@needs_fixed
def test_odirect_fixed_buffers_many_chunks_beyond_queue_depth(blob):
    """READV_FIXED from the registered buffer, 49 chunks through a queue of depth 3; a slice outside the
    registered buffer is read with plain READV."""
    p, data = blob
    fd = _open(p, True)
    n = data.numel()
    try:
        with uring.UringReader(queue_depth=3, chunk_bytes=64 << 10) as r, AlignedBuffer(n) as b, \
                AlignedBuffer(2 * ALIGN) as other:
            assert r.register(b.address, b.nbytes) is None and r.registered
            for _ in range(2):                                     # the second read reuses the chunk iovecs
                b.tensor.fill_(POISON)
                assert r.read(fd, b.tensor[:n], 0) == n
                assert torch.equal(b.tensor[:n], data)
            assert r.ops == {"readv_fixed": 2 * 49, "readv": 0}
            other.tensor.fill_(POISON)
            r.read(fd, other.tensor, 5 * ALIGN)
            assert torch.equal(other.tensor, data[5 * ALIGN:7 * ALIGN]) and r.ops["readv"] == 1
            r.unregister()
            r.unregister()                                         # twice: safe
            assert not r.registered
    finally:
        os.close(fd)


@needs_uring
def test_whole_read_is_one_sqe(blob):
    p, data = blob
    fd = _open(p, False)
    try:
        with uring.UringReader(queue_depth=2, chunk_bytes=64 << 10) as r, AlignedBuffer(data.numel()) as b:
            b.tensor.fill_(POISON)
            assert r.read(fd, b.tensor[:data.numel()], 0, whole=True) == data.numel()
            assert torch.equal(b.tensor[:data.numel()], data) and r.ops["readv"] + r.ops["readv_fixed"] == 1
    finally:
        os.close(fd)


@needs_uring
def test_short_file_is_short_file_error_and_ring_stays_usable(blob):
    p, data = blob
    fd = _open(p, True)
    n = data.numel()
    try:
        with uring.UringReader(queue_depth=8, chunk_bytes=64 << 10) as r, AlignedBuffer(n + (1 << 20)) as b:
            with pytest.raises(ShortFileError, match=f"after {n} of {n + (1 << 20)} bytes"):
                r.read(fd, b.tensor, 0)                            # 16 chunks past the end of the file
            b.tensor.fill_(POISON)
            assert r.read(fd, b.tensor[:8 * ALIGN], 0) == 8 * ALIGN  # every earlier completion was reaped
            assert torch.equal(b.tensor[:8 * ALIGN], data[:8 * ALIGN])
    finally:
        os.close(fd)


@needs_uring
def test_bad_fd_and_closed_file_are_route_io_errors(blob, tmp_path):
    p, _ = blob
    with uring.UringReader() as r, AlignedBuffer(ALIGN) as b:
        fd = os.open(p, os.O_RDONLY)
        os.close(fd)
        with pytest.raises(RouteIOError, match="EBADF"):
            r.read(fd, b.tensor, 0)
        wfd = os.open(tmp_path / "w.bin", os.O_WRONLY | os.O_CREAT)   # open, but not for reading
        try:
            with pytest.raises(RouteIOError, match="EBADF"):
                r.read(wfd, b.tensor, 0)
        finally:
            os.close(wfd)
    # through a route: the object file closed before the read
    obj = tmp_path / "o.kmo"
    h = write_object(obj, bytes(range(256)) * 40, b"k")
    route = routes.build("odirect", io="uring")
    land = route.landing(h.padded_nbytes)
    f = route.open(obj)
    fd = f.fd
    os.close(fd)
    with pytest.raises(RouteIOError):
        route.read(f, land)
    route.close()


@needs_uring
@pytest.mark.timeout(30)
def test_short_completions_continue_with_the_remainder():
    """A pipe delivers what its writer wrote so far: each short completion is resubmitted for the rest. The
    writer is a thread of this process: it only runs if the wait releases the GIL (else this test hangs)."""
    rfd, wfd = os.pipe()
    pieces = [bytes([i]) * ALIGN * 2 for i in range(1, 4)]

    def writer():
        for piece in pieces:
            os.write(wfd, piece)
            time.sleep(0.05)
        os.close(wfd)

    th = threading.Thread(target=writer)
    try:
        with uring.UringReader(queue_depth=1, chunk_bytes=6 * ALIGN) as r, AlignedBuffer(6 * ALIGN) as b:
            b.tensor.fill_(POISON)
            th.start()
            assert r.read(rfd, b.tensor, 0) == 6 * ALIGN
            assert bytes(b.tensor.numpy()) == b"".join(pieces)
            assert r.resubmits >= 1
    finally:
        th.join()
        os.close(rfd)


@needs_uring
@pytest.mark.timeout(30)
def test_other_threads_run_while_a_read_is_in_flight():
    """The read waits on a pipe that only a Python thread of this process fills, after it has counted 200
    steps: the read completes only if its wait lets that thread run (the binding's own wait would not)."""
    rfd, wfd = os.pipe()
    steps = []

    def ticker():
        for i in range(200):
            steps.append(i)
            time.sleep(0.001)
        os.write(wfd, b"\x11" * ALIGN)
        os.close(wfd)

    th = threading.Thread(target=ticker)
    try:
        with uring.UringReader(queue_depth=1, chunk_bytes=ALIGN) as r, AlignedBuffer(ALIGN) as b:
            b.tensor.fill_(POISON)
            th.start()
            assert r.read(rfd, b.tensor, 0) == ALIGN
            assert len(steps) == 200 and bytes(b.tensor.numpy()) == b"\x11" * ALIGN
    finally:
        th.join()
        os.close(rfd)
    assert "GIL released" in routes.build("odirect", io="uring").describe()["io_engine"]["wait"]


@needs_uring
def test_closed_reader_refuses_and_closing_twice_is_safe():
    r = uring.UringReader()
    r.close()
    r.close()
    with AlignedBuffer(ALIGN) as b, pytest.raises(RouteIOError, match="closed"):
        r.read(0, b.tensor, 0)
    with pytest.raises(ValueError):
        uring.UringReader(chunk_bytes=1000)


@needs_uring
@pytest.mark.parametrize("name", ["odirect", "buffered"])
def test_routes_auto_use_io_uring_and_close_unregisters(tmp_path, name):
    """auto = io_uring here; the registered landing is released on close (unregister, then munmap) and a
    second route in the same process registers its own; landing re-allocation re-registers."""
    g = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (700_001,), dtype=torch.uint8, generator=g)
    p = tmp_path / "o.kmo"
    h = write_object(p, data.numpy(), b"k")
    for _ in range(2):
        r = routes.build(name, io={"engine": "auto", "queue_depth": 4, "chunk_bytes": 128 << 10})
        small = r.landing(ALIGN)                       # then grown: the landing is re-allocated + re-registered
        assert small.numel() == ALIGN
        land = r.landing(h.padded_nbytes)
        land.fill_(POISON)
        with r.open(p) as f:
            assert r.read(f, land) == h.padded_nbytes
            f.header.verify(r.host_bytes(land))
        assert torch.equal(land[:data.numel()], data) and not land[data.numel():].any()
        e = r.describe()["io_engine"]
        assert e["engine"] == "io_uring" and e["requested"] == "auto" and e["fallback_reason"] is None
        assert e["fixed_buffers"] == uring.probe().fixed and e["preadv_calls"] == 0
        if name == "odirect":        # chunks in parallel
            assert (e["queue_depth"], e["chunk_bytes"]) == (4, 128 << 10)
            assert sum(e["sqes"].values()) == -(-h.padded_nbytes // (128 << 10))
        else:                        # buffered: one read, the page cache's readahead sizes the disk I/O
            assert e["chunk_bytes"] == "whole read (buffered)" and sum(e["sqes"].values()) == 1
        ring = r._ring
        r.close()
        assert ring.closed and not ring.registered and r._buf is None
        r.close()


def test_forced_fallback_auto_uses_preadv_and_says_why(monkeypatch, tmp_path):
    fake = dataclasses.replace(uring.probe(), available=False, reason="seccomp says no (test)", fixed=False,
                               fixed_reason="io_uring unavailable")
    monkeypatch.setattr(uring, "probe", lambda: fake)
    with pytest.raises(RouteUnavailableError, match="seccomp says no"):
        routes.build("odirect", io="uring")
    r = routes.build("odirect", io="auto")
    p = tmp_path / "o.kmo"
    h = write_object(p, b"\x07" * 10_000, b"k")
    land = r.landing(h.padded_nbytes)
    land.fill_(POISON)
    with r.open(p) as f:
        r.read(f, land)
    assert bytes(land[:10_000].numpy()) == b"\x07" * 10_000
    d = r.describe()
    assert d["io_engine"]["engine"] == "preadv" and "seccomp says no" in d["io_engine"]["fallback_reason"]
    assert "seccomp says no" in d["io"] and d["io_engine"]["preadv_calls"] == 1 and r._ring is None
    r.close()


@needs_uring
def test_registration_failure_reads_plain_readv_and_says_why(monkeypatch, tmp_path):
    def refuse(self, address, nbytes):
        return "io_uring_register_buffers failed: [Errno 12] ENOMEM (test)"

    monkeypatch.setattr(uring.UringReader, "register", refuse)
    r = routes.build("odirect", io="uring")
    p = tmp_path / "o.kmo"
    h = write_object(p, b"\x09" * 9000, b"k")
    land = r.landing(h.padded_nbytes)
    with r.open(p) as f:
        r.read(f, land)
    assert bytes(land[:9000].numpy()) == b"\x09" * 9000
    e = r.describe()["io_engine"]
    assert e["engine"] == "io_uring" and not e["fixed_buffers"] and "ENOMEM (test)" in e["fixed_reason"]
    assert e["sqes"] == {"readv_fixed": 0, "readv": 1}
    r.close()


def test_io_settings_validation():
    assert routes.IOSettings.of(None) == routes.IOSettings("auto", 8, 512 << 10)
    assert routes.IOSettings.of("preadv").engine == "preadv"
    assert routes.IOSettings.of({"engine": "uring", "queue_depth": 2}).queue_depth == 2
    for bad in ({"engine": "aio"}, {"queue_depth": 0}, {"chunk_bytes": 5000}):
        with pytest.raises(RouteUnavailableError):
            routes.IOSettings.of(bad)


# --- real refusals in a child process: CAP_IPC_LOCK dropped, so RLIMIT_MEMLOCK applies ----------------------

_CHILD = textwrap.dedent("""
    import json, resource, sys
    limit = int(sys.argv[1])
    if limit >= 0:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    from kmesh.storage import routes, uring
    out = {"probe": uring.probe().as_dict()}
    try:
        routes.build("odirect", io="uring")
        out["uring"] = "built"
    except Exception as e:
        out["uring"] = f"{type(e).__name__}: {e}"
    r = routes.build("odirect", io="auto")
    land = r.landing(16 << 20)
    with r.open(sys.argv[2]) as f:
        n = r.read(f, land[:f.header.padded_nbytes])
    out["bytes"] = bytes(land[:n].numpy()).hex()
    out["io_engine"] = r.describe()["io_engine"]
    r.close()
    print(json.dumps(out))
""")


def _child(limit: int, obj: Path) -> dict:
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to drop CAP_IPC_LOCK in a child process")
    cmd = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", sys.executable, "-c", _CHILD,
           str(limit), str(obj)]
    # keep the parent's path after ours: where packages are installed by PYTHONPATH (the GPU host's --target
    # dir), liburing is found there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    if p.returncode != 0 and "setpriv" in p.stderr:
        pytest.skip(f"setpriv refused here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_fixed
def test_memlock_too_small_for_the_landing_falls_back_to_plain_readv(tmp_path):
    obj = tmp_path / "o.kmo"
    payload = bytes(range(256)) * 100
    h = write_object(obj, payload, b"k")
    out = _child(4 << 20, obj)          # 4 MiB of locked memory: the ring fits, a 16 MiB landing does not
    e = out["io_engine"]
    assert out["probe"]["available"] and out["uring"] == "built"
    assert e["engine"] == "io_uring" and not e["fixed_buffers"] and "ENOMEM" in e["fixed_reason"], e
    assert e["sqes"]["readv"] == 1 and e["sqes"]["readv_fixed"] == 0
    assert bytes.fromhex(out["bytes"])[:len(payload)] == payload and len(out["bytes"]) == 2 * h.padded_nbytes


@needs_uring
def test_no_locked_memory_means_no_ring_auto_reads_preadv(tmp_path):
    obj = tmp_path / "o.kmo"
    payload = b"\x42" * 5000
    write_object(obj, payload, b"k")
    out = _child(0, obj)
    if out["probe"]["available"]:
        pytest.skip("this kernel sets up rings without locked memory: nothing to refuse")
    assert "io_uring_queue_init failed" in out["probe"]["reason"]
    assert out["uring"].startswith("RouteUnavailableError") and "io_uring unavailable" in out["uring"]
    e = out["io_engine"]
    assert e["engine"] == "preadv" and "io_uring_queue_init failed" in e["fallback_reason"]
    assert e["preadv_calls"] == 1 and bytes.fromhex(out["bytes"])[:5000] == payload


@needs_fixed
@pytest.mark.timeout(60)
def test_forked_child_makes_its_own_ring_and_leaves_the_parents_alone(tmp_path):
    """A route used in a forked child reads through a new ring there; the child's close() does not unregister
    the parent's fixed buffers, which the parent then still reads from."""
    g = torch.Generator().manual_seed(8)
    data = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=g)
    p = tmp_path / "o.kmo"
    h = write_object(p, data.numpy(), b"k")
    want = data.numpy().tobytes()
    r = routes.build("odirect", io="uring")
    land = r.landing(h.padded_nbytes)
    parent_ring = r._ring
    pid = os.fork()
    if pid == 0:                       # child: no torch ops (its thread pool does not survive fork); exit code
        code = 1
        try:
            r.close()                  # the inherited landing and ring: released in this process only
            mine = r.landing(h.padded_nbytes)
            ctypes.memset(mine.data_ptr(), POISON, mine.numel())
            with r.open(p) as f:
                r.read(f, mine)
            ok = bytes(mine.numpy()[:len(want)]) == want and r._ring is not parent_ring
            r.close()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert r._ring is parent_ring and parent_ring.registered
    land.fill_(POISON)
    with r.open(p) as f:
        r.read(f, land)
    assert torch.equal(land[:data.numel()], data)
    assert r.describe()["io_engine"]["sqes"]["readv_fixed"] >= 1
    r.close()


def test_a_binding_that_crashes_is_found_in_a_child_and_refused(monkeypatch):
    """The liburing wheel died of SIGILL in `Ring()` on a CPU without AVX-512, taking the suite and the service
    with it. Its calls now run first in a child process: a crash there makes io_uring unavailable, with the reason,
    and this process never makes them."""
    if uring._L is None:
        pytest.skip(uring._IMPORT_ERROR or "no liburing")
    try:
        monkeypatch.setattr(uring, "_SMOKE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
        uring.binding_crash.cache_clear()
        why = uring.binding_crash()
        assert why is not None and "SIGILL" in why and "AVX-512" in why
        with pytest.raises(RouteUnavailableError, match="SIGILL"):
            uring.UringReader(queue_depth=2, chunk_bytes=ALIGN)
        monkeypatch.setattr(uring, "_SMOKE", "raise RuntimeError('binding fault')")
        uring.binding_crash.cache_clear()
        assert "RuntimeError: binding fault" in uring.binding_crash()
        monkeypatch.setattr(uring, "_SMOKE", "pass")
        uring.binding_crash.cache_clear()
        assert uring.binding_crash() is None
    finally:
        uring.binding_crash.cache_clear()
