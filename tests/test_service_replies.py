"""Replies are bounded by design: a client's valid request never costs it its connection or registrations.

Issue 8 item 1: `status` used to answer with every stored object, every job and every registration in one
frame; past 64 KiB (protocol.MAX_PAYLOAD) the service's own reply raised FrameTooLargeError, the connection
was dropped as if the client had sent garbage, and every registration of the client closed ("disconnect").
These tests run a real service process (kmesh.service.process.start) and talk to it over real sockets.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from kmesh.service import descriptor, process
from kmesh.service.handles import HostBuffer

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
