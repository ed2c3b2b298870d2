"""Routes: CPU arms read real files (buffered and O_DIRECT), cuFile mode detection with fake libraries."""
from __future__ import annotations

import ctypes
import tempfile

import pytest
import torch

from kmesh.storage import cufile, routes, uring
from kmesh.storage.errors import ObjectCorruptError, RouteUnavailableError
from kmesh.storage.objfile import write_object


@pytest.fixture
def objects(tmp_path):
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate([5000, 12288, 70001]):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        p = tmp_path / f"o{i}.kmo"
        out.append((p, write_object(p, data.numpy(), f"k{i}".encode()), data))
    return out


@pytest.mark.parametrize("io", ["preadv", "uring"])
@pytest.mark.parametrize("name", ["buffered", "odirect"])
def test_cpu_routes_deliver_verified_bytes_into_poisoned_landing(objects, name, io):
    if io == "uring" and not uring.probe().available:
        pytest.skip(uring.probe_reason())
    r = routes.build(name, io=io)
    total = sum(h.padded_nbytes for _, h, _ in objects)
    land = r.landing(total)
    land.fill_(0xA5)
    routes.drop_page_cache([p for p, _, _ in objects])
    off = 0
    for p, h, data in objects:
        try:
            f = r.open(p)
        except OSError as e:
            pytest.skip(f"no O_DIRECT here: {e}")
        with f:
            dst = land[off:off + h.padded_nbytes]
            assert r.read(f, dst) == h.padded_nbytes
            f.header.verify(r.host_bytes(dst))
            f.check_unchanged()
            assert torch.equal(dst[:data.numel()], data) and not dst[data.numel():].any()
        off += h.padded_nbytes
    d = r.describe()
    assert d["arm"] == name and d["reads"] == 3 and d["bytes_read"] == total
    assert d["o_direct"] == (name == "odirect")
    e = d["io_engine"]
    if io == "preadv":
        assert "preadv" in d["io"] and e["engine"] == "preadv" and e["preadv_calls"] == 3
    else:   # the landing was registered: every chunk was a READV_FIXED (where the kernel has it)
        assert e["engine"] == "io_uring" and e["fixed_buffers"] == uring.probe().fixed
        assert e["sqes"]["readv_fixed" if e["fixed_buffers"] else "readv"] == 3 and e["preadv_calls"] == 0
    r.close()


def test_corrupt_payload_caught_after_route_read(objects):
    p, h, _ = objects[1]
    raw = bytearray(p.read_bytes()); raw[4096 + 7] ^= 1; p.write_bytes(raw)
    r = routes.build("odirect")
    land = r.landing(h.padded_nbytes)
    with r.open(p) as f:
        r.read(f, land)
        with pytest.raises(ObjectCorruptError):
            f.header.verify(r.host_bytes(land))


def test_misaligned_landing_refused(objects):
    p, h, _ = objects[0]
    r = routes.build("odirect")
    land = r.landing(h.padded_nbytes + 4096)
    with r.open(p) as f, pytest.raises(routes.RouteIOError):
        r.read(f, land[1:1 + h.padded_nbytes])


def test_gpu_routes_need_cuda_on_cpu():
    for name in ("staging", "direct"):
        with pytest.raises(RouteUnavailableError):
            routes.build(name, "cpu")
    with pytest.raises(RouteUnavailableError):
        routes.build("nope")


@pytest.mark.parametrize("nvfs,flags,p2p,force,mode,arm,direct", [
    (2, 0, False, False, "nvidia-fs", "cufile-nvfs", True),
    (0, 1 << cufile.NVME_P2P_SUPPORTED_BIT, True, False, "p2pdma", "cufile-p2pdma", True),
    (0, 1 << cufile.NVME_P2P_SUPPORTED_BIT, False, False, "compat", "cufile-compat", False),  # P2PDMA off
    (0, 0, True, False, "compat", "cufile-compat", False),                                     # no NVMe P2P
    (0, 0, None, None, "compat", "cufile-compat", False),
    (2, 0, False, True, "compat", "cufile-compat", False),                                     # forced compat
])
def test_classify(nvfs, flags, p2p, force, mode, arm, direct):
    m = cufile.classify(nvfs, flags, p2p, force)
    assert (m.mode, m.arm, m.direct) == (mode, arm, direct) and m.reason


class FakeCuFile:
    """Just enough of cuda.bindings.cufile for detect(): fills CUfileDrvProps_t like the library does."""

    class BoolConfigParameter:
        USE_PCI_P2PDMA = 7
        FORCE_COMPAT_MODE = 8

    def __init__(self, nvfs=0, flags=0, params=None, open_error=None, register_error=None, log_lines=()):
        self.nvfs, self.flags, self.params, self.open_error = nvfs, flags, params or {}, open_error
        self.register_error, self.log_lines = register_error, log_lines
        self.registered, self.deregistered, self.flags_seen = [], [], []

    def handle_register(self, descr_ptr):
        import fcntl
        fd = cufile.CUfileDescr.from_address(descr_ptr).handle.fd
        self.flags_seen.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        if self.register_error:   # as libcufile does: a log line in the CWD's cufile.log, then the error
            with open("cufile.log", "a") as f:
                f.writelines(ln + "\n" for ln in self.log_lines)
            raise self.register_error
        self.registered.append(fd)
        return 1000 + fd

    def handle_deregister(self, fh):
        self.deregistered.append(fh)

    def driver_open(self):
        if self.open_error:
            raise self.open_error

    def driver_get_properties(self, ptr):
        props = cufile.DrvProps.from_address(ptr)
        props.nvfs.major_version, props.nvfs.dstatusflags = self.nvfs, self.flags

    def get_parameter_bool(self, p):
        if p not in self.params:
            raise RuntimeError("parameter not supported by this libcufile")
        return self.params[p]


def test_detect_with_fake_libraries():
    assert cufile.detect(FakeCuFile(nvfs=2)).arm == "cufile-nvfs"
    m = cufile.detect(FakeCuFile(flags=1 << cufile.NVME_P2P_SUPPORTED_BIT, params={7: True, 8: False}))
    assert m.mode == "p2pdma" and m.props["use_pci_p2pdma"] is True
    m = cufile.detect(FakeCuFile())                      # the H200 host: no nvidia-fs, no P2PDMA, virtio disk
    assert m.arm == "cufile-compat" and not m.direct and m.props["use_pci_p2pdma"] is None
    m = cufile.detect(FakeCuFile(open_error=RuntimeError("CU_FILE_DRIVER_NOT_INITIALIZED")))
    assert m.mode is None and m.arm == "direct-unavailable" and "DRIVER_NOT_INITIALIZED" in m.reason


H200_LOG = ["01-12-2026 10:00:00:001 [pid=7 tid=7] ERROR  cufio-udev:67 udev property not found: ID_FS_USAGE vda",
            "01-12-2026 10:00:00:002 [pid=7 tid=7] NOTICE  cufio-drv:720 something harmless",
            "01-12-2026 10:00:00:003 [pid=7 tid=7] ERROR  cufio:303 cuFileHandleRegister error, failed to allocate "
            "file object"]


@pytest.fixture
def log_in_cwd(tmp_path, monkeypatch):
    """cuFile's default log place (the CWD), no configured log file or directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("CUFILE_LOGFILE_PATH", raising=False)
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(tmp_path / "no-such-cufile.json"))
    return cwd


def test_probe_registration_fails_mode_unavailable_with_reason(tmp_path, log_in_cwd):
    objdir = tmp_path / "objects"
    objdir.mkdir()
    lib = FakeCuFile(register_error=RuntimeError("cuFileError: HANDLE_NOT_REGISTERED (5027)"), log_lines=H200_LOG)
    m = cufile.detect(lib, probe_dir=objdir)
    assert m.mode is None and m.arm == cufile.UNREGISTRABLE_ARM == "cufile-unavailable" and not m.direct
    assert "HANDLE_NOT_REGISTERED (5027)" in m.reason and str(objdir) in m.reason
    assert "ID_FS_USAGE vda" in m.reason and "failed to allocate file object" in m.reason
    assert "something harmless" not in m.reason                      # ERROR lines only
    assert m.props["classified_mode"] == "compat" and m.props["probe"] == "failed"
    import os
    assert lib.flags_seen and all(f & os.O_DIRECT for f in lib.flags_seen)   # the probe fd is O_DIRECT
    assert list(objdir.iterdir()) == []                              # the probe file is gone
    with pytest.raises(RouteUnavailableError, match="needs a CUDA device"):
        routes.build("direct", "cpu", probe_dir=objdir)


def test_probe_reads_only_new_log_errors_and_configured_dir(tmp_path, log_in_cwd, monkeypatch):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    (logdir / "cufile.log").write_text("old ERROR  cufio:1 an error from an earlier process\n")
    conf = tmp_path / "cufile.json"
    conf.write_text('{ // comment\n "logging": { "dir": "%s", "level": "ERROR" } }' % logdir)
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(conf))
    assert cufile.log_paths()[0] == logdir / "cufile.log"

    class LogsThere(FakeCuFile):
        def handle_register(self, descr_ptr):
            with open(logdir / "cufile.log", "a") as f:
                f.write("new ERROR  cufio-fs:777 error getting volume attributes\n")
            raise RuntimeError("HANDLE_NOT_REGISTERED")

    m = cufile.detect(LogsThere(), probe_dir=tmp_path)
    assert "volume attributes" in m.reason and "earlier process" not in m.reason


def test_probe_without_log_says_so(tmp_path, log_in_cwd):
    m = cufile.detect(FakeCuFile(register_error=RuntimeError("HANDLE_NOT_REGISTERED")), probe_dir=tmp_path)
    assert m.arm == "cufile-unavailable" and "no ERROR lines in cufile.log" in m.reason


def test_probe_registration_succeeds_keeps_classified_mode(tmp_path, log_in_cwd):
    for lib, arm, direct in ((FakeCuFile(), "cufile-compat", False), (FakeCuFile(nvfs=2), "cufile-nvfs", True)):
        m = cufile.detect(lib, probe_dir=tmp_path)
        assert (m.arm, m.direct) == (arm, direct) and m.props["probe"] == "registered"
        assert len(lib.registered) == 1 and lib.deregistered == [1000 + lib.registered[0]]
    assert [p.name for p in tmp_path.iterdir()] == ["cwd"]


def test_probe_directory_problems_are_reasons(tmp_path, log_in_cwd):
    m = cufile.detect(FakeCuFile(), probe_dir=tmp_path / "missing")
    assert m.arm == "cufile-unavailable" and "cannot create a probe file" in m.reason


def test_detect_real_library_never_raises():
    m = cufile.detect(probe_dir=tempfile.gettempdir())
    assert m.arm in ("direct-unavailable", "cufile-unavailable", *cufile.ARMS.values()) and m.reason


def test_drvprops_layout_matches_cufile_h():
    # nvfs {uint, uint, size_t, size_t, uint, uint} + 6 uints
    assert ctypes.sizeof(cufile._Nvfs) == 32 and ctypes.sizeof(cufile.DrvProps) == 56


def _poisoned_verified_read(r: routes.Route, obj: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The object through the route into a poisoned landing, digest-checked; (landing, expected payload)."""
    p, h, data = obj
    land = r.landing(h.padded_nbytes)
    land.fill_(0xA5)
    with r.open(p) as f:
        r.read(f, land)
        f.header.verify(r.host_bytes(land))
    return land, data


@pytest.mark.gpu
def test_staging_route_on_cuda(objects):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    r = routes.build("staging", "cuda")
    land, data = _poisoned_verified_read(r, objects[2])
    dev = land.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev[:data.numel()].cpu(), data) and r.describe()["landing"] == "pinned host"
    r.close()


@pytest.mark.gpu
def test_staging_route_io_uring_into_pinned_registered_landing(objects):
    """io_uring (fixed buffers where allowed) into the cudaHostRegister'ed landing, then the device copy; close
    unregisters from the ring before unpinning; a second route works after it."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    if not uring.probe().available:
        pytest.skip(uring.probe_reason())
    for _ in range(2):
        r = routes.build("staging", "cuda", io="uring")
        land, data = _poisoned_verified_read(r, objects[2])
        dev = land.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev[:data.numel()].cpu(), data)
        e = r.describe()["io_engine"]
        assert e["engine"] == "io_uring" and r.describe()["landing"] == "pinned host"
        assert e["fixed_buffers"] == (e["fixed_reason"] is None), e
        r.close()
        r.close()


@pytest.mark.gpu
def test_direct_route_on_cuda_reports_mode(objects):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    try:
        r = routes.build("direct", "cuda", probe_dir=objects[0][0].parent)
    except RouteUnavailableError as e:
        # the H200 container: cuFile is there but cannot register a file (its reason names the error); the stage
        # then runs its fallback arms. Anything else (no cuFile at all) is also a reason, never a silent pass.
        assert "direct route unavailable" in str(e)
        pytest.skip(str(e))
    land, data = _poisoned_verified_read(r, objects[2])
    assert torch.equal(land[:data.numel()].cpu(), data)
    d = r.describe()
    assert d["arm"] in cufile.ARMS.values() and d["mode"] in cufile.ARMS
    r.close()
