"""Admin is a capability, not a uid: across real processes, an ordinary client of the service's own uid cannot
shut the service down, evict shared originals or read every client's status; the holder of the admin token
(the runtime dir's 0600 file) can. The refusals change nothing (registry, store, liveness)."""
from __future__ import annotations

import os

import pytest

from kmesh.harness.service import Harness
from kmesh.harness.worker import pattern, sha
from kmesh.service import descriptor
from kmesh.service.errors import NotAuthorizedError
from kmesh.service.process import ADMIN_TOKEN_NAME

LAYOUT = descriptor.example(num_blocks=4)
N = descriptor.nbytes(LAYOUT)


def _view(st: dict) -> dict:
    return {"regs": [(r["reg"], r["client"], r["state"], r["mapped"]) for r in st["registrations"]],
            "clients": sorted((c["client"], c["live"]) for c in st["clients"]),
            "objects": [(o["key"], o["state"], o["pins"], o["sha256"]) for o in st["store"]["objects"]],
            "stopping": st["stopping"]}


@pytest.mark.timeout(120)
def test_ordinary_client_cannot_shutdown_evict_or_see_all_while_admin_can() -> None:
    h = Harness(heartbeat_timeout_s=30.0)
    try:
        token_file = h.service.runtime_dir / ADMIN_TOKEN_NAME
        assert token_file.parent == h.socket_path.parent
        assert token_file.stat().st_mode & 0o777 == 0o600 and token_file.stat().st_uid == os.getuid()
        # an original owned by client A, and client B: both ordinary worker processes of our uid
        a, ref = h.worker_with_original(1, b"shared", LAYOUT, N, seed=3, name="owner")
        b = h.worker(instance=2, name="buggy")
        before = _view(h.status())

        attempts = {
            "shutdown": lambda w, **adm: w.call("call", op="shutdown", fields=adm),
            "evict_key": lambda w, **adm: w.call("call", op="evict", fields={"key": b"shared", **adm}),
            "evict_all": lambda w, **adm: w.call("call", op="evict", fields=adm),
            "status_all": lambda w, **adm: w.call("call", op="status", fields={"scope": "all", **adm}),
            "list_all": lambda w, **adm: w.call("call", op="list", fields={"what": "registrations", "scope": "all",
                                                                           **adm}),
            "list_objects": lambda w, **adm: w.call("call", op="list", fields={"what": "objects", **adm}),
        }
        for w in (a, b):  # not even the object's owner
            for name, attempt in attempts.items():
                for adm in ({}, {"admin": os.urandom(32)}, {"admin": w.info["token"]}):
                    with pytest.raises(NotAuthorizedError):
                        attempt(w, **adm)
                        pytest.fail(f"{name} {adm} accepted from an ordinary client")
        # the client library's own methods, without the token, are refused the same way
        with pytest.raises(NotAuthorizedError):
            b.call("evict", key=b"shared")
        with pytest.raises(NotAuthorizedError):
            b.call("status", scope="all")
        assert b.call("status", scope="self")["registrations"] == []  # its own status stays open to it

        st = h.status()
        assert h.service.alive() and _view(st) == before, "a refused admin op changed the service"
        assert st["stats"]["errors"]["not_authorized"] == 2 * len(attempts) * 3 + 2
        a.call("fill", name="kv", seed=9, n=N)  # the original is still there and still served
        req = a.call("load", reg=ref["reg"], key=b"shared", offset=0)
        h.accepted(N)
        h.finish()
        assert a.call("wait", req=req)["state"] == "done" and a.call("digest", name="kv") == sha(pattern(3, N))

        # the capability is the token, not the process: a worker handed the token may act as admin
        tok = h.service.admin_token()
        assert attempts["status_all"](b, admin=tok)["counts"]["registrations"] == 1
        assert [r["reg"] for r in attempts["list_all"](b, admin=tok)["items"]] == [ref["reg"]]
        assert [o["key"] for o in attempts["list_objects"](b, admin=tok)["items"]] == [b"shared"]
        # the admin (the harness, which read the token file) evicts and shuts down
        assert h.admin.evict(b"shared") == {"evicted": 1, "kept": []}
        a.call("close", reg=ref["reg"])
        h.wait_released(ref["reg"])
        for w in (a, b):
            w.exit()
        assert h.admin.shutdown()["state"] == "stopping"
        assert h.service.proc.wait(timeout=20) == 0
        assert not token_file.exists() and not h.socket_path.exists()
    finally:
        h.close()


@pytest.mark.timeout(120)
def test_the_service_counts_each_clients_completed_copies() -> None:
    """Per client, the copies the service itself completed (what a connector's own report of what it loaded is
    cross-checked against, issue 45 finding 6): done loads and saves with their bytes; a refused load adds nothing."""
    from kmesh.service.errors import ObjectMissingError

    h = Harness(heartbeat_timeout_s=30.0)
    try:
        _, _ = h.worker_with_original(1, b"shared", LAYOUT, N, seed=3, name="owner")
        b = h.worker(instance=2, name="reader")
        b.call("alloc", name="kv", nbytes=N, seed=5)
        ref = b.call("register", name="kv", alloc_id=1, generation=1, layout=LAYOUT)
        for _ in range(2):
            req = b.call("load", reg=ref["reg"], key=b"shared", offset=0)
            h.accepted(N)
            h.finish()
            assert b.call("wait", req=req)["state"] == "done"
        with pytest.raises(ObjectMissingError):
            b.call("load", reg=ref["reg"], key=b"nobody-saved-this", offset=0)
        done = {c["name"]: c["copies_done"] for c in h.status()["clients"]}
        assert done["owner"] == {"loads": 0, "load_bytes": 0, "saves": 1, "save_bytes": N}
        assert done["reader"] == {"loads": 2, "load_bytes": 2 * N, "saves": 0, "save_bytes": 0}
    finally:
        h.close()
