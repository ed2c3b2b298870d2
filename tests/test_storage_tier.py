"""The disk tier under host RAM: singleflight joins concurrent loads, retention, explicit eviction, bad files."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kmesh.storage.errors import ObjectCorruptError, ObjectNotFoundError, StorageError
from kmesh.storage.routes import DirectIORoute
from kmesh.storage.tier import Singleflight, TieredObjects


class SlowRoute(DirectIORoute):
    """A real O_DIRECT read, slowed so concurrent callers really overlap it."""

    def read(self, f, dst):
        time.sleep(0.05)
        return super().read(f, dst)


def _tier(tmp_path, singleflight=True):
    t = TieredObjects(tmp_path / "objs", route=SlowRoute(), singleflight=singleflight)
    payloads = {}
    for i in range(3):
        key = f"seg-{i}".encode()
        payloads[key] = torch.full((10000 + i,), i + 1, dtype=torch.uint8)
        t.put(key, payloads[key].numpy(), keep=False)
    return t, payloads


def _concurrent(fn, n=4):
    barrier, out, errs = threading.Barrier(n), [None] * n, []

    def run(i):
        barrier.wait()
        try:
            out[i] = fn(i)
        except Exception as e:
            errs.append(e)
    th = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    [x.start() for x in th]
    [x.join() for x in th]
    return out, errs


def test_singleflight_one_read_per_object_for_four_concurrent_children(tmp_path):
    t, payloads = _tier(tmp_path)
    out, errs = _concurrent(lambda i: [t.get(k).clone() for k in payloads])
    assert not errs
    assert all(torch.equal(o[j], p) for o in out for j, p in enumerate(payloads.values()))
    assert dict(t.counters["disk_reads"]) == {k: 1 for k in payloads}
    assert t.counters["joins"] + t.counters["ram_hits"] == 3 * len(payloads) and t.counters["joins"] >= 1


def test_without_singleflight_concurrent_loads_each_read(tmp_path):
    t, payloads = _tier(tmp_path, singleflight=False)
    key = next(iter(payloads))
    _, errs = _concurrent(lambda i: t.get(key))
    assert not errs and t.counters["disk_reads"][key] > 1       # the control: reads are not joined


def test_retention_and_forced_eviction(tmp_path):
    t, payloads = _tier(tmp_path)
    keys = list(payloads)
    for k in keys:
        t.get(k)
    t.retain("group", keys[:2])
    assert t.evict() == [keys[2]] and t.in_ram(keys[0])
    t.get(keys[0])
    assert t.counters["disk_reads"][keys[0]] == 1                 # retained: no second read
    assert sorted(t.evict(force=True)) == sorted(keys[:2])        # a benchmark's forced cold read
    t.get(keys[0])
    assert t.counters["disk_reads"][keys[0]] == 2
    t.release("group")
    with pytest.raises(StorageError):
        t.release("group")


def test_bad_file_nothing_in_ram_every_joiner_gets_the_error(tmp_path):
    t, payloads = _tier(tmp_path)
    key = next(iter(payloads))
    p = t.path(key)
    raw = bytearray(p.read_bytes()); raw[4096 + 3] ^= 0xFF; p.write_bytes(raw)
    out, errs = _concurrent(lambda i: t.get(key))
    assert len(errs) == 4 and all(isinstance(e, ObjectCorruptError) for e in errs)
    assert not t.in_ram(key) and t.counters["disk_reads"][key] == 0
    with pytest.raises(ObjectNotFoundError):
        t.get(b"never-saved")


def test_singleflight_error_shared_and_next_call_retries():
    sf, calls = Singleflight(), []

    def fail():
        calls.append(1)
        time.sleep(0.05)
        raise RuntimeError("io")
    _, errs = _concurrent(lambda i: sf.do("k", fail), n=3)
    assert len(errs) == 3 and len(calls) == 1 and sf.joins == 2
    assert sf.do("k", lambda: 5) == (5, False)                    # a failed flight is not cached
