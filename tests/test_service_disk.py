"""The service's disk tier with real service processes, real client processes, real sockets and real files:
read-backs of evicted originals run off the loop thread (held open by the disk read gate, the service still
answers everyone), simultaneous loads of one object from four client processes share one read, a corrupt file
fails every joined load alike and loses nothing, and a restart re-adopts what the previous run committed."""
from __future__ import annotations

import select
import subprocess
import sys
import time

import pytest
import torch

from kmesh.harness.service import Harness
from kmesh.harness.worker import pattern, sha
from kmesh.service import descriptor
from kmesh.service.errors import DiskReadError, ShuttingDownError
from kmesh.storage import objfile

LAYOUT = descriptor.example(num_blocks=4)
N = descriptor.nbytes(LAYOUT)
COLD, WARM = b"shared/cold-0", b"shared/warm-0"
SEED_COLD, SEED_WARM, POISON = 11, 12, 99


def _obj(h: Harness, key: bytes) -> dict:
    return next(o for o in h.status()["store"]["objects"] if o["key"] == key)


def _loader(h: Harness, name: str):
    """A client process with a registered, poisoned buffer (a load must overwrite every byte)."""
    w = h.worker(name=name)
    w.call("alloc", name="kv", nbytes=N)
    w.call("fill", name="kv", seed=POISON, n=N)
    ref = w.call("register", name="kv", alloc_id=1, generation=1, layout=LAYOUT)
    return w, ref


def _finish_load(h: Harness, w, req: int) -> str:
    h.accepted(N)
    h.finish()
    return w.call("wait", req=req)["state"]


def _flight(h: Harness, key: bytes, waiters: int) -> dict:
    """Until the service reports a read-back of key in flight with `waiters` parked loads."""
    st = h.wait_until(f"a read of {key!r} with {waiters} waiters",
                      lambda s: any(f["key"] == key and f["waiters"] == waiters for f in s["disk_reads"]["flights"]))
    return next(f for f in st["disk_reads"]["flights"] if f["key"] == key)


def _replied(w) -> bool:
    """Whether the worker's reply to its sent command has arrived (without consuming it)."""
    return bool(select.select([w.proc.stdout], [], [], 0)[0])


def _close(h: Harness, *pairs) -> None:
    for w, ref in pairs:
        w.call("close", reg=ref["reg"])
        h.wait_released(ref["reg"], timeout=30.0)


def test_a_held_read_back_blocks_nobody_else(tmp_path):
    with Harness(disk_dir=tmp_path / "disk", disk_read_gate=True) as h:
        saver, sref = h.worker_with_original(None, COLD, LAYOUT, N, SEED_COLD, name="saver-cold")
        saver2, sref2 = h.worker_with_original(None, WARM, LAYOUT, N, SEED_WARM, name="saver-warm")
        assert h.admin.evict(COLD, tier="ram")["evicted"] == 1
        used = h.status()["store"]["used_bytes"]
        slow, slow_ref = _loader(h, "cold-loader")
        other, other_ref = _loader(h, "warm-loader")

        slow.send("load", reg=slow_ref["reg"], key=COLD, offset=0)   # parked behind a held read
        f = _flight(h, COLD, 1)
        st = h.status()
        assert st["store"]["used_bytes"] == used + N          # capacity reserved when the read started
        assert _obj(h, COLD)["reading"] and not _obj(h, COLD)["in_ram"]
        # the object cannot be dropped while its read runs, not even by a forced full eviction
        assert COLD in h.admin.evict(COLD, force=True)["kept"]

        # meanwhile another client process is served: ping, heartbeat, a load of a RAM-resident original
        assert other.call("call", op="ping")["pong"] is True
        assert "deadline_s" in other.call("call", op="heartbeat")
        req = other.call("load", reg=other_ref["reg"], key=WARM, offset=0)
        assert _finish_load(h, other, req) == "done"
        assert other.call("digest", name="kv") == sha(pattern(SEED_WARM, N))
        # ... all before the held read ended: it is still in flight and the cold load still has no reply
        again = _flight(h, COLD, 1)
        assert again["age_s"] >= f["age_s"] and not _replied(slow)
        assert _obj(h, COLD)["disk_reads"] == 0

        h.allow_disk_reads(1)
        req = slow.result()
        assert _finish_load(h, slow, req) == "done"
        assert slow.call("digest", name="kv") == sha(pattern(SEED_COLD, N))
        o = _obj(h, COLD)
        assert o["in_ram"] and not o["reading"] and o["disk_reads"] == 1 and o["joins"] == 0
        assert h.status()["disk_reads"]["in_flight"] == 0
        _close(h, (saver, sref), (saver2, sref2), (slow, slow_ref), (other, other_ref))
        assert h.no_leaks(), h.leaks()


def test_negative_control_a_read_on_the_loop_thread_answers_nobody(tmp_path):
    """The read_on_loop fault (the serialised design this replaced): the same kind of probe sees another
    process's ping go unanswered until the held read is let go — the test above can tell the two apart."""
    with Harness(disk_dir=tmp_path / "disk", disk_read_gate=True, faults=["read_on_loop"],
                 heartbeat_timeout_s=10.0) as h:
        saver, sref = h.worker_with_original(None, COLD, LAYOUT, N, SEED_COLD, name="saver")
        assert h.admin.evict(COLD, tier="ram")["evicted"] == 1
        slow, slow_ref = _loader(h, "cold-loader")
        other = h.worker(name="pinger")
        slow.send("load", reg=slow_ref["reg"], key=COLD, offset=0)
        blocked = False
        deadline = time.monotonic() + 60   # a busy machine may take seconds to get the load to the service
        while not blocked and time.monotonic() < deadline:   # until a ping finds the loop inside the held read
            other.send("call", op="ping")
            if select.select([other.proc.stdout], [], [], 0.5)[0]:
                other.result()   # answered: the load had not reached the service yet
                continue
            blocked = True
            break
        assert blocked
        h.allow_disk_reads(1)
        assert other.result()["pong"] is True           # answered only once the read ended
        assert _finish_load(h, slow, slow.result()) == "done"
        assert slow.call("digest", name="kv") == sha(pattern(SEED_COLD, N))
        _close(h, (saver, sref), (slow, slow_ref))


def test_four_client_processes_share_one_read(tmp_path):
    with Harness(disk_dir=tmp_path / "disk", disk_read_gate=True) as h:
        saver, sref = h.worker_with_original(None, COLD, LAYOUT, N, SEED_COLD, name="saver")
        assert h.admin.evict(COLD, tier="ram")["evicted"] == 1
        kids = [_loader(h, f"child-{i}") for i in range(4)]
        for w, ref in kids:   # four processes, four connections, one evicted object
            w.send("load", reg=ref["reg"], key=COLD, offset=0)
        f = _flight(h, COLD, 4)
        assert f["joins"] == 3
        for w, _ in kids:
            assert not _replied(w)
        h.allow_disk_reads(1)
        reqs = [w.result() for w, _ in kids]
        h.accepted(4 * N)
        h.finish()
        for (w, _), req in zip(kids, reqs):
            assert w.call("wait", req=req)["state"] == "done"
            assert w.call("digest", name="kv") == sha(pattern(SEED_COLD, N))   # each its own private copy
        o = _obj(h, COLD)
        assert o["disk_reads"] == 1 and o["joins"] == 3
        st = h.status()
        assert st["store"]["counters"]["disk_reads"] == 1 and st["store"]["counters"]["joins"] == 3
        assert st["disk_reads"]["flights"] == [] and st["disk_reads"]["joins"] == 3
        assert len({w.pid for w, _ in kids}) == 4
        _close(h, (saver, sref), *kids)
        assert h.no_leaks(), h.leaks()


def test_corrupt_object_file_fails_every_joined_load_alike_and_loses_nothing(tmp_path):
    disk = tmp_path / "disk"
    with Harness(disk_dir=disk, disk_read_gate=True) as h:
        saver, sref = h.worker_with_original(None, COLD, LAYOUT, N, SEED_COLD, name="saver")
        assert h.admin.evict(COLD, tier="ram")["evicted"] == 1
        used = h.status()["store"]["used_bytes"]
        path = disk / f"{COLD.hex()}.kmo"
        good = path.read_bytes()
        raw = bytearray(good)
        raw[objfile.HEADER_BYTES + 7] ^= 0x10   # one payload bit
        path.write_bytes(raw)
        kids = [_loader(h, f"child-{i}") for i in range(3)]
        for w, ref in kids:
            w.send("load", reg=ref["reg"], key=COLD, offset=0)
        _flight(h, COLD, 3)
        h.allow_disk_reads(1)
        messages = []
        for w, _ in kids:
            with pytest.raises(DiskReadError, match="ObjectCorruptError") as e:
                w.result()
            messages.append(str(e.value))
        assert len(set(messages)) == 1                 # the same typed error for every joined load
        for w, _ in kids:                              # nothing was copied into any client
            assert w.call("digest", name="kv") == sha(pattern(POISON, N))
        st = h.status()
        assert h.service.alive() and st["stats"]["internal_errors"] == 0
        o = _obj(h, COLD)
        assert not o["in_ram"] and not o["reading"] and o["disk_reads"] == 0 and o["state"] == "committed"
        assert st["store"]["used_bytes"] == used        # the reserved capacity came back
        assert st["store"]["counters"]["disk_read_failures"] == 1 and st["disk_reads"]["failed"] == 1

        path.write_bytes(good)                         # repaired: the same object loads (nothing was lost)
        w, ref = kids[0]
        w.send("load", reg=ref["reg"], key=COLD, offset=0)
        _flight(h, COLD, 1)
        h.allow_disk_reads(1)
        assert _finish_load(h, w, w.result()) == "done"
        assert w.call("digest", name="kv") == sha(pattern(SEED_COLD, N))
        _close(h, (saver, sref), *kids)
        assert h.no_leaks(), h.leaks()


def test_client_lost_or_shutdown_during_a_read_back(tmp_path):
    with Harness(disk_dir=tmp_path / "disk", disk_read_gate=True) as h:
        saver, sref = h.worker_with_original(None, COLD, LAYOUT, N, SEED_COLD, name="saver")
        assert h.admin.evict(COLD, tier="ram")["evicted"] == 1
        doomed, ref = _loader(h, "doomed")
        doomed.send("load", reg=ref["reg"], key=COLD, offset=0)
        _flight(h, COLD, 1)
        doomed.kill()                                  # SIGKILL with its load parked
        h.wait_until("the killed client lost", lambda s: s["counts"]["clients_live"] == 2)
        h.allow_disk_reads(1)                          # the read still completes, into the store
        st = h.wait_until("the read settled", lambda s: s["disk_reads"]["in_flight"] == 0)
        assert st["stats"]["parked_loads_dropped"] == 1 and st["stats"]["internal_errors"] == 0
        assert _obj(h, COLD)["in_ram"] and _obj(h, COLD)["disk_reads"] == 1

        # shutdown while a read is held: the parked load gets shutting_down, the service exits cleanly
        assert h.admin.evict(COLD, tier="ram")["evicted"] == 1
        w, wref = _loader(h, "at-shutdown")
        w.send("load", reg=wref["reg"], key=COLD, offset=0)
        _flight(h, COLD, 1)
        h.admin.shutdown()
        with pytest.raises(ShuttingDownError):
            w.result()
        assert h.service.proc.wait(timeout=30) == 0


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_restart_adopts_committed_objects_and_reports_bad_files(tmp_path):
    disk = tmp_path / "disk"
    keep, broken = b"shared/keep", b"shared/broken"
    with Harness(disk_dir=disk) as h:
        w1, r1 = h.worker_with_original(None, keep, LAYOUT, N, SEED_COLD, name="a")
        w2, r2 = h.worker_with_original(None, broken, LAYOUT, N, SEED_WARM, name="b")
        sha_before = _obj(h, keep)["sha256"]
        _close(h, (w1, r1), (w2, r2))
    # between the runs: a damaged header, a stray temp file of a dead writer, a foreign object file, junk
    bad = disk / f"{broken.hex()}.kmo"
    raw = bytearray(bad.read_bytes())
    raw[60] ^= 1
    bad.write_bytes(raw)
    tmp = disk / f".{keep.hex()}.kmo.tmp-{_dead_pid()}-0badc0de"
    tmp.write_bytes(b"half a write")
    foreign = disk / f"{b'foreign'.hex()}.kmo"
    objfile.write_object(foreign, bytes(4096), b"foreign", {"note": "kmesh.storage, not the service"})
    (disk / "notes.txt").write_text("not an object\n")
    short = disk / f"{b'short'.hex()}.kmo"
    short.write_bytes((disk / f"{keep.hex()}.kmo").read_bytes()[:objfile.HEADER_BYTES + 100])

    with Harness(disk_dir=disk) as h:
        st = h.status()
        objs = {o["key"]: o for o in st["store"]["objects"]}
        assert set(objs) == {keep}
        o = objs[keep]
        assert o["state"] == "committed" and o["on_disk"] and o["adopted"] and not o["in_ram"]
        assert o["sha256"] == sha_before and o["nbytes"] == N
        reasons = {r["file"]: r["reason"] for r in st["store"]["disk_rejected"]}
        assert "HeaderCorruptError" in reasons[bad.name]
        assert "removed" in reasons[tmp.name] and not tmp.exists()
        assert "not written by the cache service" in reasons[foreign.name]
        assert "not a <hex key>.kmo" in reasons["notes.txt"]
        assert "ShortFileError" in reasons[short.name]
        assert st["store"]["counters"]["adopted"] == 1 and st["store"]["counters"]["disk_rejected"] == 5
        assert bad.exists() and foreign.exists() and short.exists()   # rejected files are left, not deleted
        w, ref = _loader(h, "after-restart")
        req = w.call("load", reg=ref["reg"], key=keep, offset=0)
        assert _finish_load(h, w, req) == "done"
        assert w.call("digest", name="kv") == sha(pattern(SEED_COLD, N))
        assert _obj(h, keep)["disk_reads"] == 1
        _close(h, (w, ref))
        assert h.no_leaks(), h.leaks()

    with Harness(disk_dir=disk, adopt=False) as h:     # --no-adopt: an empty store over the same files
        st = h.status()
        assert st["store"]["nobjects"] == 0 and st["store"]["counters"]["adopted"] == 0
        assert (disk / f"{keep.hex()}.kmo").exists()


def _store_with_one(disk, key=b"k", n=8192):
    from kmesh.service.store import Store

    s = Store(1 << 20, disk_dir=disk)
    o = s.begin_put(key, n, descriptor.validate(LAYOUT), descriptor.geometry_digest(descriptor.validate(LAYOUT)))
    o.tensor.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    s.commit(o)
    return s, o


def test_store_header_round_trip_and_every_kind_of_unadoptable_header(tmp_path):
    """In-process: the header section re-adopts exactly; each way it can be wrong is refused with its reason."""
    import base64

    import msgpack

    from kmesh.service.store import HEADER_SECTION, Store, header_section

    disk = tmp_path / "d"
    s, o = _store_with_one(disk)
    s2 = Store(1 << 20, disk_dir=disk)
    a = s2.objects[b"k"]
    assert (a.layout, a.geometry, a.sha256, a.nbytes, a.in_ram, a.adopted) == \
           (o.layout, o.geometry, o.sha256, o.nbytes, False, True)
    got = s2.acquire(b"k")                     # the in-process path still reads back synchronously, verified
    assert bytes(got.tensor.numpy()) == bytes(o.tensor.numpy()) and got.disk_reads == 1
    s2.release(got)

    good = header_section(o, o.sha256)[HEADER_SECTION]
    cases = {
        "old": ({"service_layout": {"x": "00"}}, "older service"),
        "version": ({HEADER_SECTION: {**good, "v": 99}}, "header version 99"),
        "base64": ({HEADER_SECTION: {**good, "layout": "!!not base64!!"}}, "unreadable"),
        "schema": ({HEADER_SECTION: {**good, "layout": base64.b64encode(msgpack.packb({"packing": 1})).decode()}},
                   "unreadable"),
        "sha": ({HEADER_SECTION: {**good, "sha256": "zz"}}, "not a hex sha256"),
        "nbytes": ({HEADER_SECTION: {**good, "nbytes": 5}}, "differs from the file's payload"),
        "geometry": ({HEADER_SECTION: {**good, "geometry": "00" * 32}}, "geometry digest does not match"),
    }
    d3 = tmp_path / "d3"
    d3.mkdir()
    for name, (section, _) in cases.items():
        key = name.encode()
        objfile.write_object(d3 / f"{key.hex()}.kmo", bytes(o.nbytes), key, section)
    objfile.write_object(d3 / f"{b'other'.hex()}.kmo", bytes(4096), b"not-other", header_section(o, o.sha256))
    s3 = Store(1 << 20, disk_dir=d3)
    assert s3.objects == {}
    reasons = {r["file"]: r["reason"] for r in s3.disk_rejected}
    for name, (_, why) in cases.items():
        assert why in reasons[f"{name.encode().hex()}.kmo"], (name, reasons)
    assert "names key" in reasons[f"{b'other'.hex()}.kmo"]
    assert s3.counters["disk_rejected"] == len(cases) + 1


def test_store_read_back_reserves_capacity_and_blocks_eviction(tmp_path):
    from kmesh.service.errors import CapacityError, DiskReadError

    s, o = _store_with_one(tmp_path / "d")
    assert s.evict(b"k", tier="ram")["evicted"] == [b"k"] and s.used_bytes == 0
    t = s.begin_read_back(o)
    assert s.used_bytes == o.nbytes and o.reading
    assert s.evict(b"k", force=True)["kept"] == [b"k"]          # not dropped while reading
    with pytest.raises(DiskReadError, match="differs from its commit"):
        s.end_read_back(o, t, "0" * 64, None)                  # a digest that is not the commit's
    assert s.used_bytes == 0 and not o.in_ram and not o.reading
    s.capacity_bytes = o.nbytes - 1
    with pytest.raises(CapacityError):
        s.begin_read_back(o)
    assert s.used_bytes == 0 and not o.reading


def test_read_backs_in_flight_are_limited_and_refused_loads_cost_nothing(tmp_path):
    from kmesh.service.errors import CapacityError

    with Harness(disk_dir=tmp_path / "disk", disk_read_gate=True, limits={"max_disk_reads": 1}) as h:
        saver, sref = h.worker_with_original(None, COLD, LAYOUT, N, SEED_COLD, name="saver-cold")
        saver2, sref2 = h.worker_with_original(None, WARM, LAYOUT, N, SEED_WARM, name="saver-warm")
        assert h.admin.evict(tier="ram")["evicted"] == 2
        a, aref = _loader(h, "a")
        b, bref = _loader(h, "b")
        a.send("load", reg=aref["reg"], key=COLD, offset=0)
        _flight(h, COLD, 1)
        with pytest.raises(CapacityError, match="disk reads in flight"):
            b.call("load", reg=bref["reg"], key=WARM, offset=0)   # a second object: over the limit
        st = h.status()
        assert st["disk_reads"]["in_flight"] == 1 and st["store"]["used_bytes"] == N   # only the first reserved
        h.allow_disk_reads(2)
        assert _finish_load(h, a, a.result()) == "done"
        req = b.call("load", reg=bref["reg"], key=WARM, offset=0)  # the refused load, again: now it runs
        assert _finish_load(h, b, req) == "done"
        assert b.call("digest", name="kv") == sha(pattern(SEED_WARM, N))
        _close(h, (saver, sref), (saver2, sref2), (a, aref), (b, bref))
        assert h.no_leaks(), h.leaks()
