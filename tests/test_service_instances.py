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


def test_hello_frees_the_instance_of_a_client_already_gone_before_its_event_is_handled(tmp_path: Path) -> None:
    """The service's own view may lag (the dead client's pidfd event, its heartbeat deadline not yet handled):
    hello checks the holder itself, so a replacement is not refused for that lag. In-process, so the lag is
    certain: the selector never runs here."""
    import os
    import signal
    import socket
    import time

    from kmesh.service import identity
    from kmesh.service.errors import InstanceInUseError, NotAuthorizedError
    from kmesh.service.protocol import parse_request
    from kmesh.service.server import Conn, Service, ServiceOptions

    svc = Service(ServiceOptions(tmp_path / "rt", heartbeat_timeout_s=5.0))
    svc.admin_token = b"a" * 32
    socks: list[socket.socket] = []
    child = os.fork()
    if child == 0:
        signal.pause()
        os._exit(0)

    def hello(peer: identity.Peer | None = None, **fields):
        s, t = socket.socketpair()
        socks.extend((s, t))
        conn = Conn(len(socks), s, peer or identity.peer_of(s))
        svc.conns[conn.cid] = conn
        svc._op_hello(conn, parse_request({"op": "hello", "seq": 1, **fields}, []))
        return conn.client

    try:
        dead = hello(identity.Peer(child, os.getuid(), os.getgid(), os.pidfd_open(child), "pidfd_open"), instance=9)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        child = 0
        new = hello(instance=9)  # the pidfd says the holder has exited: it is lost first
        assert new.client_id != dead.client_id and not dead.live and dead.lost_reason == "client died"
        silent = hello(instance=10)
        silent.last_seen = time.monotonic() - 6.0  # heartbeat overdue, the tick has not run
        assert hello(instance=10).live and not silent.live and silent.lost_reason == "heartbeat lost"
        live = hello(instance=11)
        with pytest.raises(InstanceInUseError):
            hello(instance=11)
        with pytest.raises(NotAuthorizedError):
            hello(instance=11, takeover=True)
        with pytest.raises(NotAuthorizedError):
            hello(instance=11, takeover=True, admin=b"b" * 32)
        assert live.live
        boss = hello(instance=11, takeover=True, admin=b"a" * 32)
        assert boss.live and not live.live and live.lost_reason == f"taken over by client {boss.client_id}"
        assert all(hello().live for _ in range(3)) and boss.live  # anonymous ones never collide
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        for conn in list(svc.conns.values()):
            svc._drop_conn(conn)
        svc.copies.close()
        for s in socks:
            s.close()
