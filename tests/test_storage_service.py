"""The cache service's disk tier (a real service process): commits spill to object files, RAM-only eviction,
read-back on load (verified, counted), group retention vs forced eviction, a corrupt file refused with a typed
error while the service stays up."""
from __future__ import annotations

import pytest
import torch

from kmesh.harness.service import Harness
from kmesh.service import descriptor
from kmesh.service.client import ServiceClient
from kmesh.service.errors import ObjectMissingError
from kmesh.service.handles import HostBuffer
from kmesh.storage import objfile

LAYOUT = descriptor.example(num_blocks=4)
N = descriptor.nbytes(LAYOUT)
KEY = b"shared/segment-0"


def _obj(h: Harness, key: bytes = KEY) -> dict:
    return next(o for o in h.status()["store"]["objects"] if o["key"] == key)


def _copy(h: Harness, cl: ServiceClient, req: int) -> dict:
    h.accepted(N)
    h.finish()
    return cl.wait(req, timeout=30.0)


def test_disk_tier_spill_evict_read_back_retain(tmp_path):
    disk = tmp_path / "disk"
    data = torch.randint(0, 256, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    with Harness(disk_dir=disk, chunk_bytes=1 << 20) as h:
        cl = ServiceClient.connect(h.socket_path, name="disk-tier-test")
        buf = HostBuffer(N, name="disk-tier-test")
        t = buf.as_tensor()
        t.copy_(data)
        ref = cl.register_host(buf, alloc_id=buf.address, generation=1, layout=LAYOUT)
        assert _copy(h, cl, cl.save(ref, KEY, 0, N))["state"] == "done"
        path = disk / f"{KEY.hex()}.kmo"
        hdr, payload = objfile.read_object(path)              # committed = spilled, in the object-file format
        assert hdr.key == KEY and bytes(payload[:N]) == data.numpy().tobytes()
        o = _obj(h)
        assert o["in_ram"] and o["on_disk"] and o["disk_reads"] == 0

        assert h.admin.evict(KEY, tier="ram")["evicted"] == 1   # RAM copy gone, object still listed
        o = _obj(h)
        assert not o["in_ram"] and o["state"] == "committed"
        t.zero_()
        assert _copy(h, cl, cl.load(ref, KEY, 0))["state"] == "done"
        assert torch.equal(t, data) and _obj(h)["disk_reads"] == 1
        t.zero_()
        assert _copy(h, cl, cl.load(ref, KEY, 0))["state"] == "done"   # a RAM hit: no second read
        assert torch.equal(t, data) and _obj(h)["disk_reads"] == 1

        h.admin.retain("group-1", KEY)
        assert h.admin.evict(tier="ram")["kept"] == [KEY]              # retained across the group
        assert h.admin.evict(tier="ram", force=True)["evicted"] == 1   # a benchmark's forced cold read
        assert h.admin.unretain("group-1")["released"] == 1
        assert _copy(h, cl, cl.load(ref, KEY, 0))["state"] == "done"
        assert _obj(h)["disk_reads"] == 2
        assert h.status(verify=True)["store"]["counters"]["disk_reads"] == 2

        # a corrupt object file: the load is refused with a typed error, nothing is copied, the service lives
        assert h.admin.evict(KEY, tier="ram")["evicted"] == 1
        raw = bytearray(path.read_bytes()); raw[objfile.HEADER_BYTES + 11] ^= 1; path.write_bytes(raw)
        t.fill_(0x77)
        with pytest.raises(ObjectMissingError, match="ObjectCorruptError"):
            cl.load(ref, KEY, 0)
        assert bool((t == 0x77).all()) and h.service.alive() and not _obj(h)["in_ram"]

        assert h.admin.evict(KEY)["evicted"] == 1                      # full eviction removes the file too
        assert not path.exists()
        cl.close(ref)
        h.wait_released(ref.reg, timeout=30.0)
        buf.close()
        cl.close_connection()


def test_store_without_disk_tier_refuses_ram_only_eviction_quietly(tmp_path):
    from kmesh.service.store import Store

    s = Store(1 << 20)
    o = s.begin_put(b"k", 4096, {}, b"g")
    s.commit(o)
    assert s.evict(b"k", tier="ram") == {"evicted": [], "kept": [b"k"]}   # no file to read it back from
    assert s.evict(b"k") == {"evicted": [b"k"], "kept": []}


def test_retain_is_admin_only_and_needs_a_committed_object(tmp_path):
    from kmesh.service.errors import NotAuthorizedError

    with Harness(disk_dir=tmp_path / "disk") as h:
        cl = ServiceClient.connect(h.socket_path, name="not-admin")
        for call in (lambda: cl.retain("g", KEY), lambda: cl.unretain("g"),
                     lambda: cl.evict(tier="ram", force=True)):
            with pytest.raises(NotAuthorizedError):
                call()
        with pytest.raises(ObjectMissingError):
            h.admin.retain("g", b"never-saved")
        assert h.admin.unretain("no-such-group")["released"] == 0
        assert h.service.alive()
        cl.close_connection()
