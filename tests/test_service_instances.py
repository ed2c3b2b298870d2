"""Instance numbers never collide by accident (issue 8 item 2), across real processes and sockets.

A client that gives no instance number is anonymous and collides with no one; a claim on the instance of a
client that is still live is refused (instance_in_use) and the live client keeps working; the instance is
free again once its holder is lost (process gone: pidfd; or heartbeat overdue), or an admin takes it over.
The old client's registrations then close and drain: they never transfer to the newcomer.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from kmesh.service import descriptor, process
from kmesh.service.errors import ServiceError
from kmesh.service.handles import HostBuffer

LAYOUT = descriptor.example(num_blocks=1)
N = descriptor.nbytes(LAYOUT)


@pytest.fixture
def sp():
    d = Path(tempfile.mkdtemp(prefix="kmesh-ins-"))
    s = process.start(d / "rt", heartbeat_timeout_s=30.0)
    try:
        yield s
    finally:
        s.stop(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


def _active(c, reg: int) -> bool:
    return any(r["reg"] == reg and r["state"] == "active" for r in c.status("self")["registrations"])


@pytest.mark.timeout(60)
def test_two_default_clients_do_not_collide(sp) -> None:
    buf = HostBuffer(N)
    try:
        with sp.client(name="first") as a:
            ref = a.register_host(buf, alloc_id=1, generation=1, layout=LAYOUT)
            with sp.client(name="second") as b:  # an unrelated tool with the same defaults
                assert b.client_id != a.client_id
                assert a.heartbeat() and _active(a, ref.reg), "the first default client lost its registration"
            with sp.admin_client(name="tool") as adm:  # admin tools are anonymous too
                adm.status("all")
            assert _active(a, ref.reg)
            a.close(ref)
    finally:
        buf.close()


@pytest.mark.timeout(60)
def test_claim_on_a_live_instance_is_refused_and_the_holder_keeps_working(sp) -> None:
    buf = HostBuffer(N)
    try:
        with sp.client(instance=5, name="holder") as a:
            ref = a.register_host(buf, alloc_id=1, generation=1, layout=LAYOUT)
            with pytest.raises(ServiceError) as e:
                sp.client(instance=5, name="claimant").close_connection()
            assert e.value.code == "instance_in_use", e.value
            assert a.heartbeat() and _active(a, ref.reg)
            a.close(ref)
    finally:
        buf.close()
