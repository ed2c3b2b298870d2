"""Routes: CPU arms read real files (buffered and O_DIRECT), cuFile mode detection with fake libraries."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kmesh.storage import cufile, routes
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


@pytest.mark.parametrize("name", ["buffered", "odirect"])
def test_cpu_routes_deliver_verified_bytes_into_poisoned_landing(objects, name):
    r = routes.build(name)
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
    assert d["o_direct"] == (name == "odirect") and "preadv" in d["io"]
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

    def __init__(self, nvfs=0, flags=0, params=None, open_error=None):
        self.nvfs, self.flags, self.params, self.open_error = nvfs, flags, params or {}, open_error

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


def test_detect_real_library_never_raises():
    m = cufile.detect()
    assert m.arm in ("direct-unavailable", *cufile.ARMS.values()) and m.reason


def test_drvprops_layout_matches_cufile_h():
    # nvfs {uint, uint, size_t, size_t, uint, uint} + 6 uints
    assert ctypes.sizeof(cufile._Nvfs) == 32 and ctypes.sizeof(cufile.DrvProps) == 56


@pytest.mark.gpu
def test_staging_route_on_cuda(objects):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    r = routes.build("staging", "cuda")
    p, h, data = objects[2]
    land = r.landing(h.padded_nbytes)
    with r.open(p) as f:
        r.read(f, land)
        f.header.verify(r.host_bytes(land))
    dev = land.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev[:data.numel()].cpu(), data) and r.describe()["landing"] == "pinned host"
    r.close()


@pytest.mark.gpu
def test_direct_route_on_cuda_reports_mode(objects):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    try:
        r = routes.build("direct", "cuda")
    except RouteUnavailableError as e:
        pytest.skip(str(e))
    p, h, data = objects[2]
    land = r.landing(h.padded_nbytes)
    land.fill_(0xA5)
    with r.open(p) as f:
        r.read(f, land)
        f.header.verify(r.host_bytes(land))
    assert torch.equal(land[:data.numel()].cpu(), data)
    d = r.describe()
    assert d["arm"] in cufile.ARMS.values() and d["mode"] in cufile.ARMS
    r.close()
