"""A full store makes room instead of refusing (issue 26): LRU eviction of originals nobody holds, to the disk
tier or forgotten without one; refused only when no tier can take the save, with an error that says so."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kmesh.service import descriptor, process
from kmesh.service.errors import CapacityError, ObjectMissingError
from kmesh.service.handles import HostBuffer
from kmesh.service.store import Store

LAYOUT = descriptor.validate(descriptor.example(num_blocks=4))
GEOMETRY = descriptor.geometry_digest(LAYOUT)
N = 4096


def _save(s: Store, key: bytes, fill: int) -> None:
    o = s.begin_put(key, N, LAYOUT, GEOMETRY)
    o.tensor.fill_(fill)
    s.commit(o)


def _load(s: Store, key: bytes) -> bytes:
    o = s.acquire(key)
    try:
        return bytes(o.tensor.numpy())
    finally:
        s.release(o)


def test_without_a_disk_tier_the_least_recently_used_are_forgotten():
    s = Store(4 * N, low_watermark=1.0)
    for i in range(4):
        _save(s, b"k%d" % i, i)
    _load(s, b"k0")                               # k0 used after k1..k3: k1 is now the least recently used
    _save(s, b"k4", 4)
    assert set(s.objects) == {b"k0", b"k2", b"k3", b"k4"} and s.counters["lru_forgotten"] == 1
    with pytest.raises(ObjectMissingError):
        s.lookup(b"k1")                           # forgotten, never wrong
    assert _load(s, b"k4") == bytes([4]) * N and _load(s, b"k0") == bytes([0]) * N
    assert s.used_bytes == 4 * N


def test_low_watermark_evicts_down_to_it_in_one_go():
    s = Store(10 * N, high_watermark=1.0, low_watermark=0.5)
    for i in range(10):
        _save(s, b"k%d" % i, i)
    _save(s, b"new", 9)                           # past the high mark: down to 5 objects' worth, then the save
    assert s.counters["lru_forgotten"] == 6 and set(s.objects) == {b"k6", b"k7", b"k8", b"k9", b"new"}


def test_held_originals_are_never_evicted_and_a_refusal_says_what_holds_the_room():
    s = Store(3 * N)
    _save(s, b"pinned", 1)
    _save(s, b"retained", 2)
    pinned = s.acquire(b"pinned")                 # a load in flight
    s.retention.retain("group", b"retained")
    pending = s.begin_put(b"pending", N, LAYOUT, GEOMETRY)   # a save in flight
    with pytest.raises(CapacityError, match="no tier can take it.*pinned by loads 1, being saved 1"):
        s.begin_put(b"more", N, LAYOUT, GEOMETRY)
    assert s.counters["lru_refused"] == 1 and s.counters["lru_forgotten"] == 0
    assert set(s.objects) == {b"pinned", b"retained", b"pending"}
    s.release(pinned)
    s.abort(pending)
    _save(s, b"more", 3)                          # the unpinned original may go now (the retained one stays)
    _save(s, b"again", 4)
    assert b"retained" in s.objects and b"pinned" not in s.objects


def test_with_a_disk_tier_only_ram_copies_go_and_every_original_stays_loadable(tmp_path):
    s = Store(3 * N, disk_dir=tmp_path / "disk", low_watermark=1.0)
    want = {}
    for i in range(8):
        key = b"k%d" % i
        _save(s, key, 10 + i)
        want[key] = bytes([10 + i]) * N
    assert s.counters["lru_spilled"] == 5 and s.counters["lru_forgotten"] == 0
    assert sum(o.in_ram for o in s.objects.values()) == 3 and len(s.objects) == 8
    for key, data in want.items():                # read back from disk (digest-checked) and made room for
        assert _load(s, key) == data
    assert s.counters["disk_reads"] == 8 and s.used_bytes <= s.capacity_bytes


def test_the_object_limit_forgets_the_least_recently_used(tmp_path):
    s = Store(1 << 20, max_objects=3, disk_dir=tmp_path / "disk")
    for i in range(3):
        _save(s, b"k%d" % i, i)
    _save(s, b"k3", 3)
    assert set(s.objects) == {b"k1", b"k2", b"k3"} and s.counters["lru_forgotten"] == 1
    assert not (tmp_path / "disk" / f"{b'k0'.hex()}.kmo").exists()   # its file went with it


def test_an_original_larger_than_the_ram_tier_is_refused_without_evicting_anything():
    s = Store(2 * N)
    _save(s, b"a", 1)
    with pytest.raises(CapacityError, match="larger than the RAM tier"):
        s.begin_put(b"huge", 3 * N, LAYOUT, GEOMETRY)
    assert set(s.objects) == {b"a"} and s.counters["lru_forgotten"] == 0


def test_eviction_none_refuses_as_before():
    s = Store(2 * N, eviction="none")
    _save(s, b"a", 1)
    _save(s, b"b", 2)
    with pytest.raises(CapacityError, match=r"eviction: none"):
        s.begin_put(b"c", N, LAYOUT, GEOMETRY)
    assert set(s.objects) == {b"a", b"b"} and s.counters["lru_refused"] == 0


@pytest.mark.parametrize("kw", [{"eviction": "fifo"}, {"low_watermark": 0.0}, {"low_watermark": 0.9,
                                                                              "high_watermark": 0.8},
                                {"high_watermark": 1.5}])
def test_bad_eviction_settings_are_refused(kw):
    with pytest.raises(ValueError):
        Store(N, **kw)


@pytest.mark.timeout(120)
def test_service_with_a_small_ram_tier_takes_every_save_and_every_load_verifies(tmp_path: Path):
    """Through the service process: 24 saves of 64 KiB into 256 KiB of RAM over a disk tier — none refused, every
    load equal to what was saved (content-addressed keys), the evictions counted in status."""
    layout = descriptor.example(num_blocks=4)
    n = descriptor.nbytes(layout)
    sp = process.start(tmp_path / "rt", store_bytes=4 * n, disk_dir=tmp_path / "disk", heartbeat_timeout_s=30.0)
    try:
        with sp.client(name="eviction") as c, sp.admin_client(name="admin") as adm:
            buf = HostBuffer(n)
            ref = c.register_host(buf, alloc_id=1, generation=1, layout=layout)
            t = buf.as_tensor()
            keys = []
            for i in range(24):
                t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
                key = hashlib.sha256(bytes(t.numpy())).digest()
                assert c.wait(c.save(ref, key, offset=0, nbytes=n))["state"] == "done"
                keys.append(key)
            for key in reversed(keys):
                t.fill_(0)
                assert c.wait(c.load(ref, key, offset=0))["state"] == "done"
                assert hashlib.sha256(bytes(t.numpy())).digest() == key
            store = adm.status("all")["store"]
            assert store["counters"]["lru_spilled"] >= 20 and store["counters"]["lru_refused"] == 0
            assert store["used_bytes"] <= store["capacity_bytes"] and store["nobjects"] == 24
            assert store["eviction"] == {"policy": "lru", "high_watermark": 1.0, "low_watermark": 0.9}
    finally:
        sp.stop()
