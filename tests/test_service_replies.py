"""Replies are bounded by design: a client's valid request never costs it its connection or registrations.

Issue 8 item 1: `status` used to answer with every stored object, every job and every registration in one
frame; past 64 KiB (protocol.MAX_PAYLOAD) the service's own reply raised FrameTooLargeError, the connection
was dropped as if the client had sent garbage, and every registration of the client closed ("disconnect").
These tests run a real service process (kmesh.service.process.start) and talk to it over real sockets.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from kmesh.service import descriptor, identity, process
from kmesh.service.errors import CapacityError, NotAuthorizedError
from kmesh.service.handles import HostBuffer
from kmesh.service.jobs import CopyJob
from kmesh.service.protocol import (ITEM_MAX, KEY_MAX, MAX_PAYLOAD, PAGE_BUDGET, U32, U63, U64, cut_page, ok_reply,
                                    pack_frame, packed_size)
from kmesh.service.registry import Client, Registration, State, Tombstone
from kmesh.service.server import MAX_REGS_PER_CLIENT
from kmesh.service.store import Original

LAYOUT = descriptor.example(num_blocks=1)  # 16 KiB of bf16
N = descriptor.nbytes(LAYOUT)


def _key(i: int) -> bytes:
    return (b"k%05d-" % i).ljust(255, b"x")  # 255-byte keys: the reproduction


@pytest.fixture
def rundir():
    d = Path(tempfile.mkdtemp(prefix="kmesh-rep-"))  # short: socket paths are limited to 107 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(120)
def test_status_after_220_saves_with_255_byte_keys_keeps_the_client(rundir: Path) -> None:
    sp = process.start(rundir / "rt", heartbeat_timeout_s=30.0)
    try:
        with sp.client(instance=1, name="saver") as c, sp.admin_client(instance=2, name="admin") as adm:
            buf = HostBuffer(N)
            buf.write(0, b"\x01\x02")
            ref = c.register_host(buf, alloc_id=1, generation=1, layout=LAYOUT)
            for i in range(220):
                assert c.wait(c.save(ref, _key(i), offset=0, nbytes=2))["state"] == "done"
            mine = c.status("self")  # > 64 KiB as one frame before the fix
            reg = next(r for r in mine["registrations"] if r["reg"] == ref.reg)
            assert reg["state"] == "active" and reg["reason"] != "disconnect", reg
            assert len(mine["requests"]) == 220
            everything = adm.status("all")
            assert {o["key"] for o in everything["store"]["objects"]} >= {_key(i) for i in range(220)}
            reg = next(r for r in everything["registrations"] if r["reg"] == ref.reg)
            assert reg["state"] == "active" and reg["reason"] is None, reg
            # the same connection still works for ordinary work
            buf.write(0, b"\0\0")
            assert c.wait(c.load(ref, _key(7), offset=0))["state"] == "done" and buf.read(0, 2) == b"\x01\x02"
            c.close(ref)
            buf.close()
    finally:
        assert sp.stop(timeout=30) == 0


def _pages(c, what: str, scope: str = "self", **opts) -> tuple[list[dict], int, int]:
    """Every item of a list by hand, page by page; returns (items, pages, largest packed page in bytes)."""
    items, pages, largest, after = [], 0, 0, None
    while True:
        page = c.list_page(what, scope, after=after, **opts)
        pages += 1
        largest = max(largest, packed_size(page))
        items += page["items"]
        if page["next"] is None:
            return items, pages, largest
        after = page["next"]


@pytest.mark.timeout(120)
def test_every_op_answers_with_store_jobs_and_registrations_at_their_limits(rundir: Path) -> None:
    """Small limits, big items: 240 originals with 255-byte keys (the store's object limit), more finished
    copies than the job history keeps, registrations at the per-client and the global limit. Every op still
    answers, every list comes in pages that fit, and the client keeps its registrations."""
    objects, jobs, per_client, total = 240, 250, 4, 6
    sp = process.start(rundir / "rt", heartbeat_timeout_s=30.0, max_objects=objects, max_jobs=jobs,
                       max_regs_per_client=per_client, max_regs=total, eviction="none")   # the limit refuses
    bufs: list[HostBuffer] = []
    try:
        with sp.client(name="at-limits") as c, sp.admin_client(name="admin") as adm, \
                sp.client(name="other") as o:  # anonymous clients: no instance to collide on
            def reg() -> tuple[HostBuffer, object]:
                b = HostBuffer(N)
                bufs.append(b)
                b.write(0, b"\x01\x02")
                return b, c.register_host(b, alloc_id=len(bufs), generation=1, layout=LAYOUT)

            refs = [reg()[1] for _ in range(per_client)]
            with pytest.raises(CapacityError, match="registration limit"):  # per client
                reg()
            ob = HostBuffer(N)
            bufs.append(ob)
            orefs = [o.register_host(ob, alloc_id=i + 1, generation=1, layout=LAYOUT)
                     for i in range(total - per_client)]
            with pytest.raises(CapacityError, match="registration limit"):  # in all
                o.register_host(ob, alloc_id=99, generation=1, layout=LAYOUT)
            for i in range(objects):
                assert c.wait(c.save(refs[i % per_client], _key(i), offset=0, nbytes=2))["state"] == "done"
            with pytest.raises(CapacityError, match="objects"):
                c.save(refs[0], _key(objects), offset=0, nbytes=2)
            for i in range(jobs - objects + 5):  # more finished copies than the history keeps
                assert c.wait(c.load(refs[1], _key(i), offset=2))["state"] == "done"

            # every op answers, on the same connections
            t0 = time.monotonic()
            assert c.ping()["pong"] and c.heartbeat()["deadline_s"] == 30.0
            mine = c.status("self")
            assert mine["consistent"] and len(mine["registrations"]) == per_client
            assert len(mine["requests"]) == jobs  # the history is bounded by max_jobs
            everything = adm.status("all", verify=True)
            assert everything["consistent"] and everything["counts"]["objects"] == objects
            assert all(x["sha256_now"] == x["sha256"] for x in everything["store"]["objects"])
            assert everything["store"]["nobjects"] == objects and everything["limits"]["max_objects"] == objects
            largest = 0
            for what, who, scope in (("objects", adm, "all"), ("requests", c, "self"), ("requests", adm, "all"),
                                     ("registrations", c, "self"), ("registrations", adm, "all"),
                                     ("clients", adm, "all"), ("released", adm, "all")):
                items, npages, big = _pages(who, what, scope)
                largest = max(largest, big)
                ids = [x[{"objects": "key", "requests": "req", "clients": "client"}.get(what, "reg")] for x in items]
                assert len(ids) == len(set(ids)), f"{what}: an item listed twice across pages"
                if what == "objects":
                    assert set(ids) == {_key(i) for i in range(objects)}
                if what == "requests":
                    assert len(ids) == jobs
                if what in ("objects", "requests"):
                    assert npages > 1, (what, npages)  # these did not fit one frame as one list
            with pytest.raises(NotAuthorizedError):
                c.list_page("objects")  # the store is an admin's view
            with pytest.raises(NotAuthorizedError):
                c.list_page("registrations", "all")
            req = c.load(refs[2], _key(3), offset=4)
            assert c.wait(req)["state"] == "done"
            assert c.cancel(req)["state"] == "done"  # cancel of a finished copy: its state
            assert adm.evict(_key(0)) == {"evicted": 1, "kept": []}
            assert c.wait(c.save(refs[0], _key(objects), offset=0, nbytes=2))["state"] == "done"  # room again
            c.close(refs[3])
            _wait(lambda: len(c.status("self")["registrations"]) == per_client - 1)
            refs[3] = reg()[1]  # a released registration frees its slot
            elapsed = time.monotonic() - t0
            st = adm.status("all")
            regs = {r["reg"]: r for r in st["registrations"]}
            for r in refs + orefs:
                assert regs[r.reg]["state"] == "active" and regs[r.reg]["reason"] is None, regs[r.reg]
            assert st["stats"]["internal_errors"] == 0 and "frame_too_large" not in st["stats"]["errors"]
            assert largest < MAX_PAYLOAD // 2, largest
            print(f"largest page {largest} bytes; every op at the limits answered in {elapsed:.2f} s")
            for r in refs:
                c.close(r)
            for r in orefs:
                o.close(r)
    finally:
        assert sp.stop(timeout=30) == 0
        for b in bufs:
            b.close()


def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_every_listed_item_at_its_worst_fits_the_page_budget() -> None:
    """Items at their largest (256-byte keys, the longest texts, the most ids) stay under ITEM_MAX, and a page
    of them cut by cut_page packs into one frame."""
    import torch

    big = U63
    long_text = "x" * 5000
    peer = identity.Peer(2 ** 31 - 1, 2 ** 31 - 1, 2 ** 31 - 1, -1, "SO_PEERPIDFD")
    client = Client(big, 2 ** 31 - 1, "n" * 64, peer, b"t" * 32, big, 0.0, live=False, lost_reason=long_text,
                    regs={big - i for i in range(MAX_REGS_PER_CLIENT)})
    reg = Registration(big, big, U64, big, "cuda_ipc", 1 << 46, {}, b"d" * 32, b"g" * 32, None,
                       state=State.CLOSING, reason=long_text, in_flight={big - i for i in range(4096)})
    reg.history = [(s, long_text, 0.0) for s in ("registered", "active", "closing", "drained", "release-deferred",
                                                 "released")]
    tomb = Tombstone(big, big, U64, big, long_text, tuple((h[0], h[1]) for h in reg.history), big)
    obj = Original(b"k" * KEY_MAX, 1 << 46, {}, b"g" * 32, torch.zeros(4, dtype=torch.uint8), "committed", big,
                   "f" * 64, big)
    job = CopyJob(big, big, "load", reg, obj, 1 << 46, 1 << 46, cancel_requested=True, error=long_text)
    items = {"client": client.describe(), "registration": reg.describe(), "released": tomb.describe(),
             "object": obj.describe(verify=True), "request": job.describe()}
    sizes = {k: packed_size(v) for k, v in items.items()}
    assert all(n <= ITEM_MAX for n in sizes.values()), sizes
    for name, item in items.items():
        page, nxt = cut_page(((i, lambda: item) for i in range(10_000)), limit=1024)
        assert nxt is not None and page
        frame = pack_frame(ok_reply(U32, {"items": page, "next": big, "version": big}))  # raises if too large
        assert len(frame) <= PAGE_BUDGET + ITEM_MAX + 64 < MAX_PAYLOAD, (name, len(frame))
    print(f"worst-case item bytes {sizes}")


def test_an_oversized_reply_is_a_non_fatal_typed_error(tmp_path: Path) -> None:
    """The last line of defence: should any reply still outgrow a frame, the client gets reply_too_large (not
    fatal) on a connection that stays open."""
    import selectors
    import socket

    from kmesh.service.client import read_frame
    from kmesh.service.protocol import unpack_body
    from kmesh.service.server import Conn, Service, ServiceOptions

    svc = Service(ServiceOptions(tmp_path / "rt"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ours.setblocking(False)
        conn = Conn(1, ours, identity.peer_of(ours))
        svc.conns[1] = conn
        svc.sel.register(ours, selectors.EVENT_READ, ("conn", conn))
        svc._send(conn, ok_reply(7, {"blob": b"x" * MAX_PAYLOAD}))
        reply = unpack_body(read_frame(theirs)[1])
        assert reply["ok"] is False and reply["seq"] == 7 and reply["fatal"] is False
        assert reply["error"]["code"] == "reply_too_large", reply
        assert 1 in svc.conns and not conn.closing
        assert svc.stats["errors"] == {"reply_too_large": 1}
        svc._send(conn, ok_reply(8, {"small": True}))  # and the connection still carries replies
        assert unpack_body(read_frame(theirs)[1]) == {"seq": 8, "ok": True, "result": {"small": True}}
    finally:
        svc._drop_conn(conn)
        svc.copies.close()
        theirs.close()
