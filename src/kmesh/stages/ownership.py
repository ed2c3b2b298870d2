"""Stage `ownership` (write-up §22): cross-process ownership of shared state by the cache service.

Every case runs against a real service process and real client processes (kmesh.service.worker), steered
through kmesh.service.harness: copies are paced chunk by chunk through a gate the stage controls, so "a copy
is in flight" is arranged, then checked, never assumed. Contents are deterministic patterns the stage
computes itself (`pattern(seed, n)`), so every data check compares against an independent reference.

Cases (each for host memory "memfd"; on the cuda profile again for device memory "cuda" via CUDA IPC):
  register-use-close        registered -> active -> closing -> drained -> released; saved == loaded bytes
  private-copies            children mutate their loaded copies; the original and other children unaffected
  same-address-new-gen      a new allocation at the same address is a new registration; the old is refused
  replacement-same-instance a live client's instance is refused to a claimant; after the holder dies (or an
                            admin takes it over) the newcomer gets it but never the old registration
  close-in-flight           close stops new work; the accepted copy completes; released only after
  cancel-running-copy       cancel keeps the destination reserved until the copy drained
  heartbeat-lost-mid-copy   silence -> closing; not released while the copy runs
  foreign-client            other client's registration / request / token refused; registry unchanged
  foreign-uid               (once; needs root) another uid cannot connect, or is refused by SO_PEERCRED
  sigkill-mid-copy          SIGKILLed client: closing until drained, then reclaimed with nothing leaked
  death-seen-by-pidfd       (once) the dead client's socket lives on in a child: the pidfd alone reports it
  eviction-keeps-pinned     (once) eviction never frees an original a running copy reads
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgpack

from kmesh.config import Config
from kmesh.result import Case, Result
from kmesh.service import descriptor
from kmesh.service.errors import ServiceError
from kmesh.service.handles import HostBuffer
from kmesh.service.harness import Harness
from kmesh.service.worker import Worker, pattern, sha

BLOCKS = 8  # registration = one object: 2 layers x 8 blocks x 2 heads x 16 tokens x 128 ch x bf16 = 128 KiB
LAYOUT = descriptor.example(num_blocks=BLOCKS)
N = descriptor.nbytes(LAYOUT)
LIFECYCLE = ["registered", "active", "closing", "drained", "released"]


class Ctx:
    """One harness plus the bookkeeping the cases share (objects made so far, fresh instance numbers)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self._instance = 100
        self._alloc = 1 << 40
        self.objects: dict[bytes, int] = {}  # key -> seed

    def instance(self) -> int:
        self._instance += 1
        return self._instance

    def obj(self, key: bytes, seed: int) -> bytes:
        """An original of N bytes = pattern(seed), saved by the stage process itself (its own memfd)."""
        if key in self.objects:
            return key
        a = self.h.admin
        buf = HostBuffer(N, name="kmesh-producer")
        buf.write(0, pattern(seed, N))
        self._alloc += 1
        ref = a.register_host(buf, alloc_id=self._alloc, generation=1, layout=LAYOUT)
        req = a.save(ref, key, 0, N)
        self.h.accepted(N)
        self.h.finish()
        assert a.wait(req)["state"] == "done"
        a.close(ref)
        self.h.wait_released(ref.reg)
        buf.close()
        self.objects[key] = seed
        return key

    def expect(self, key: bytes) -> str:
        return sha(pattern(self.objects[key], N))

    # -- worker helpers ---------------------------------------------------------------------------------
    def client(self, mem: str, seed: int, instance: int | None = None, name: str = "kv", nbytes: int = N,
               alloc_id: int = 1, generation: int = 1, activate: bool = True) -> tuple[Worker, dict[str, Any]]:
        w = self.h.worker(instance if instance is not None else self.instance(), cuda=mem == "cuda")
        ref = self.register(w, mem, seed, name, nbytes, alloc_id, generation, activate)
        return w, ref

    def register(self, w: Worker, mem: str, seed: int, name: str = "kv", nbytes: int = N, alloc_id: int = 1,
                 generation: int = 1, activate: bool = True, address: int | None = None) -> dict[str, Any]:
        w.call("alloc", name=name, nbytes=nbytes, seed=seed, device="cuda" if mem == "cuda" else "cpu",
               **({"address": address} if address else {}))
        layout = LAYOUT if nbytes == N else descriptor.example(num_blocks=nbytes * BLOCKS // N)
        return w.call("register", name=name, alloc_id=alloc_id, generation=generation, layout=layout,
                      activate=activate)

    def load(self, w: Worker, ref: dict[str, Any], key: bytes, offset: int = 0) -> int:
        """A load that must be accepted (it is accounted with the gate)."""
        req = w.call("load", reg=ref["reg"], key=key, offset=offset)
        self.h.accepted(N)
        return req

    def try_load(self, w: Worker, ref: dict[str, Any], key: bytes, offset: int = 0) -> int:
        """A load that must be refused: for refuse(..., h, N), which accounts it should it be accepted."""
        return w.call("load", reg=ref["reg"], key=key, offset=offset)

    def load_mid(self, w: Worker, ref: dict[str, Any], key: bytes, chunks: int = 2) -> int:
        """Start a load and let exactly `chunks` of its chunks through: it is then provably mid-copy."""
        req = self.load(w, ref, key)
        self.h.grant(chunks)
        self.h.wait_chunks(req, chunks)
        return req

    def finish_wait(self, w: Worker, req: int) -> dict[str, Any]:
        self.h.finish()
        return w.call("wait", req=req)


def refuse(c: Case, name: str, fn: Callable[[], Any], expected: str, h: Harness | None = None,
           nbytes: int = 0) -> None:
    """Check that fn is refused with the ServiceError named `expected` (the value records what happened).

    fn may try a copy of nbytes (a load or save; pass the harness h): if the service wrongly accepts it, the
    copy is recorded with the gate (h.accepted) like any accepted copy, so it runs and drains with the next
    finish() and the token accounting stays right. Without that, one wrong acceptance would starve every
    later copy of its tokens and turn one real failure into a cascade of timeouts in later cases."""
    if nbytes and h is None:
        raise ValueError("a refusal that tries a copy needs the harness to account for it")
    try:
        fn()
        got = "accepted"
    except ServiceError as e:
        got = type(e).__name__
    if got == "accepted" and nbytes:
        h.accepted(nbytes)  # type: ignore[union-attr]
    c.check(name, got == expected, value=got)


def _states(r: dict[str, Any] | None) -> list[str]:
    return [h[0] for h in (r or {}).get("history", []) if h[0] != "release-deferred"]


def _end(ctx: Ctx, c: Case, *workers: Worker) -> None:
    for w in workers:
        w.exit()
    st = ctx.h.wait_until("the registry to empty", lambda s: not s["registrations"] and not s["copies_running"])
    leaks = ctx.h.leaks(st)
    c.check("nothing_leaked", ctx.h.no_leaks(st), value=leaks)


# -- cases ----------------------------------------------------------------------------------------------
def case_register_use_close(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-A", 11)
    w, ref = ctx.client(mem, seed=21, activate=False)
    c.check("state_after_register", h.reg(ref["reg"])["state"] == "registered")
    refuse(c, "work_before_activate_refused", lambda: ctx.try_load(w, ref, key), "RegistrationStateError", h, N)
    w.call("activate", reg=ref["reg"])
    c.check("state_after_activate", h.reg(ref["reg"])["state"] == "active")
    save = w.call("save", reg=ref["reg"], key=b"from-client-" + mem.encode(), offset=0, nbytes=N)
    h.accepted(N)
    c.check("save_done", ctx.finish_wait(w, save)["state"] == "done")
    ctx.objects[b"from-client-" + mem.encode()] = 21
    req = ctx.load(w, ref, key)
    c.check("load_done", ctx.finish_wait(w, req)["state"] == "done")
    c.check("loaded_bytes_are_the_original", w.call("digest", name="kv") == ctx.expect(key))
    w.call("fill", name="kv", seed=99, n=N)
    req = ctx.load(w, ref, b"from-client-" + mem.encode())
    ctx.finish_wait(w, req)
    c.check("saved_then_loaded_roundtrip", w.call("digest", name="kv") == sha(pattern(21, N)))
    w.call("close", reg=ref["reg"])
    st = h.wait_released(ref["reg"])
    path = _states(h.reg(ref["reg"], st))
    c.check("lifecycle_path", path == LIFECYCLE, value=path)
    _end(ctx, c, w)


def case_private_copies(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-A", 11)
    a, ra = ctx.client(mem, seed=31)
    b, rb = ctx.client(mem, seed=32)
    for w, r in ((a, ra), (b, rb)):
        ctx.finish_wait(w, ctx.load(w, r, key))
    a.call("fill", name="kv", seed=33, n=N)  # child A mutates its private copy
    c.check("mutating_child_changed", a.call("digest", name="kv") == sha(pattern(33, N)))
    c.check("other_child_unaffected", b.call("digest", name="kv") == ctx.expect(key))
    cc, rc = ctx.client(mem, seed=34)
    ctx.finish_wait(cc, ctx.load(cc, rc, key))
    c.check("later_child_gets_original", cc.call("digest", name="kv") == ctx.expect(key))
    obj = next(o for o in h.status(verify=True)["store"]["objects"] if o["key"] == key)
    c.check("original_unchanged", obj["sha256_now"] == obj["sha256"] == ctx.expect(key), value=obj["sha256"])
    for w, r in ((a, ra), (b, rb), (cc, rc)):
        w.call("close", reg=r["reg"])
    _end(ctx, c, a, b, cc)


def case_same_address_new_gen(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-B", 12)
    w = h.worker(ctx.instance(), cuda=mem == "cuda")
    addr = w.call("alloc", name="a", nbytes=N, seed=41, device="cuda" if mem == "cuda" else "cpu")["address"]
    r1 = w.call("register", name="a", alloc_id=addr, generation=1, layout=LAYOUT)
    if mem == "cuda":
        # Device memory is recycled by torch's caching allocator: the same address is the same physical
        # memory, so the client may free it only after the service released it (the client contract).
        ctx.finish_wait(w, ctx.load(w, r1, key))
        w.call("close", reg=r1["reg"])
        h.wait_released(r1["reg"])
        c.check("old_handle_closed", h.status()["cuda_handles_open"] == 0)
        w.call("free", name="a")
        addr2 = w.call("alloc", name="b", nbytes=N, seed=42, device="cuda")["address"]
    else:
        # Host memory: the old allocation goes away WHILE a copy into it runs; the service's own mapping keeps
        # that memfd alive, and the new allocation is mapped at the very same address.
        l1 = ctx.load_mid(w, r1, key)
        w.call("free", name="a")
        addr2 = w.call("alloc", name="b", nbytes=N, seed=42, address=addr)["address"]
    c.check("same_address", addr2 == addr, value=hex(addr))
    r2 = w.call("register", name="b", alloc_id=addr, generation=2, layout=LAYOUT)
    c.check("new_registration_id", r2["reg"] != r1["reg"], value=[r1["reg"], r2["reg"]])
    old = h.reg(r1["reg"])
    c.check("old_generation_not_active", old["state"] in ("closing", "released"), value=old["state"])
    refuse(c, "old_generation_refused", lambda: w.call("load", as_ref=r1, key=key, offset=0),
           "RegistrationClosedError", h, N)
    refuse(c, "new_id_old_generation_refused",
           lambda: w.call("load", as_ref={**r2, "gen": 1}, key=key, offset=0), "StaleGenerationError", h, N)
    refuse(c, "reregister_same_generation_refused",
           lambda: w.call("register", name="b", alloc_id=addr, generation=2, layout=LAYOUT), "StaleGenerationError")
    if mem != "cuda":
        c.check("old_copy_still_in_flight", old["in_flight"] == [l1] and old["mapped"], value=old)
        done = ctx.finish_wait(w, l1)
        c.check("old_copy_completed", done["state"] == "done")
        c.check("new_allocation_untouched_by_old_copy", w.call("digest", name="b") == sha(pattern(42, N)))
        h.wait_released(r1["reg"])
    l2 = ctx.load_mid(w, r2, key)
    ctx.finish_wait(w, l2)
    c.check("new_generation_gets_data", w.call("digest", name="b") == ctx.expect(key))
    w.call("close", reg=r2["reg"])
    _end(ctx, c, w)


def case_replacement_same_instance(ctx: Ctx, c: Case, mem: str) -> None:
    """An instance number names one live client. (a) A claim on a live client's instance is refused and the
    holder keeps working; (b) once the holder's process is gone the instance is free at once: the replacement
    is a new client that cannot reach the old registration, which closes, drains and is released; (c) an
    admin takeover of a live instance loses the old client: its registration closes and drains, never moves."""
    h, key, cuda = ctx.h, ctx.obj(b"orig-A", 11), mem == "cuda"
    inst = ctx.instance()
    a, ra = ctx.client(mem, seed=51, instance=inst)
    l1 = ctx.load_mid(a, ra, key)
    # (a) refused while the holder lives
    b = h.spawn(cuda=cuda)
    refuse(c, "claim_on_live_instance_refused", lambda: b.call("connect", instance=inst), "InstanceInUseError")
    refuse(c, "takeover_without_admin_refused", lambda: b.call("connect", instance=inst, takeover=True),
           "NotAuthorizedError")
    st = h.status()
    holder = next(x for x in st["clients"] if x["client"] == a.info["client"])
    c.check("holder_still_live", holder["live"] and h.reg(ra["reg"], st)["state"] == "active", value=holder)
    h.grant(1)
    c.check("holder_copy_goes_on", h.wait_chunks(l1, 3)["chunks_done"] >= 3)
    # (b) the holder dies mid-copy; its replacement claims the instance right away
    a.kill()
    b.info = b.call("connect", instance=inst)
    c.check("replacement_is_a_new_client", b.info["client"] != a.info["client"], value=b.info["client"])
    st = h.status()
    old = h.reg(ra["reg"], st)
    c.check("old_registration_closing_not_released", old["state"] == "closing" and old["in_flight"] == [l1],
            value=old["state"])
    c.check("old_reason_death_or_disconnect", old["reason"] in ("client died", "disconnect"), value=old["reason"])
    refuse(c, "replacement_cannot_use_old", lambda: b.call("load", as_ref=ra, key=key, offset=0), "NotOwnerError",
           h, N)
    refuse(c, "replacement_cannot_close_old", lambda: b.call("close", as_ref=ra), "NotOwnerError")
    refuse(c, "replacement_cannot_wait_old_request", lambda: b.call("wait", req=l1), "NotOwnerError")
    rb = ctx.register(b, mem, seed=52, alloc_id=1, generation=1)
    c.check("replacement_gets_new_registration", rb["reg"] != ra["reg"], value=[ra["reg"], rb["reg"]])
    h.finish()
    st = h.wait_released(ra["reg"])
    c.check("old_lifecycle_path", _states(h.reg(ra["reg"], st)) == LIFECYCLE, value=_states(h.reg(ra["reg"], st)))
    refuse(c, "released_old_not_reachable", lambda: b.call("close", as_ref=ra), "NotOwnerError")
    c.check("replacement_memory_untouched", b.call("digest", name="kv") == sha(pattern(52, N)))
    # (c) an admin takes over the instance from its live holder (b) while b's copy runs
    l2 = ctx.load_mid(b, rb, key)
    d = h.spawn(cuda=cuda)
    d.info = d.call("connect", instance=inst, takeover=True, admin=h.service.admin_token())
    st = h.status()
    lost = next(x for x in st["clients"] if x["client"] == b.info["client"])
    c.check("taken_over_client_lost", not lost["live"] and "taken over" in (lost["lost_reason"] or ""),
            value=lost["lost_reason"])
    old = h.reg(rb["reg"], st)
    c.check("taken_over_registration_closing_with_copy", old["state"] == "closing" and old["in_flight"] == [l2],
            value=old["state"])
    refuse(c, "taken_over_client_refused", lambda: ctx.try_load(b, rb, key), "ClientLostError", h, N)
    refuse(c, "new_holder_cannot_use_old", lambda: d.call("load", as_ref=rb, key=key, offset=0), "NotOwnerError",
           h, N)
    refuse(c, "new_holder_cannot_wait_old_request", lambda: d.call("wait", req=l2), "NotOwnerError")
    h.finish()
    st = h.wait_released(rb["reg"])
    c.check("taken_over_lifecycle_path", _states(h.reg(rb["reg"], st)) == LIFECYCLE,
            value=_states(h.reg(rb["reg"], st)))
    c.check("old_copy_landed_in_old_memory", b.call("digest", name="kv") == ctx.expect(key))
    rd = ctx.register(d, mem, seed=53, alloc_id=1, generation=1)
    ctx.finish_wait(d, ctx.load(d, rd, key))
    c.check("new_holder_registration_works", d.call("digest", name="kv") == ctx.expect(key))
    d.call("close", reg=rd["reg"])
    _end(ctx, c, b, d)


def case_close_in_flight(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-B", 12)
    w, r = ctx.client(mem, seed=61)
    l1 = ctx.load_mid(w, r, key)
    closed = w.call("close", reg=r["reg"])
    c.check("close_reply_closing_with_copy", closed["state"] == "closing" and closed["in_flight"] == [l1],
            value=closed)
    refuse(c, "new_load_refused", lambda: ctx.try_load(w, r, key), "RegistrationClosedError", h, N)
    refuse(c, "new_save_refused",
           lambda: w.call("save", reg=r["reg"], key=b"x", offset=0, nbytes=N), "RegistrationClosedError", h, N)
    h.grant(1)
    job = h.wait_chunks(l1, 3)
    st = h.status()
    c.check("copy_progresses_after_close", job["chunks_done"] >= 3, value=job["chunks_done"])
    c.check("still_mapped_while_copying", h.reg(r["reg"], st)["mapped"] and h.reg(r["reg"], st)["state"]
            == "closing")
    done = ctx.finish_wait(w, l1)
    c.check("accepted_copy_completed", done["state"] == "done")
    c.check("data_complete", w.call("digest", name="kv") == ctx.expect(key))
    st = h.wait_released(r["reg"])
    c.check("lifecycle_path", _states(h.reg(r["reg"], st)) == LIFECYCLE, value=_states(h.reg(r["reg"], st)))
    _end(ctx, c, w)


def case_cancel_running_copy(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-A", 11)
    w, r = ctx.client(mem, seed=71)
    l1 = ctx.load_mid(w, r, key)
    cancel = w.call("cancel", req=l1)
    c.check("cancel_acknowledged_copy_running", cancel["state"] == "running" and cancel["cancel_requested"],
            value=cancel)
    refuse(c, "destination_not_reusable", lambda: ctx.try_load(w, r, key), "DestinationBusyError", h, N)
    refuse(c, "range_not_readable_either",
           lambda: w.call("save", reg=r["reg"], key=b"y", offset=0, nbytes=N), "DestinationBusyError", h, N)
    h.grant(1)
    c.check("copy_continues_after_cancel", h.wait_chunks(l1, 3)["chunks_done"] >= 3)
    done = ctx.finish_wait(w, l1)
    c.check("ends_cancelled_after_drain", done["state"] == "cancelled", value=done["state"])
    c.check("copy_ran_to_the_end", w.call("digest", name="kv") == ctx.expect(key))
    c.check("reservation_gone", h.status()["reservations"] == 0)
    w.call("fill", name="kv", seed=72, n=N)
    l2 = ctx.load(w, r, key)
    c.check("destination_reusable_after_drain", ctx.finish_wait(w, l2)["state"] == "done")
    c.check("second_copy_data", w.call("digest", name="kv") == ctx.expect(key))
    w.call("close", reg=r["reg"])
    _end(ctx, c, w)


def case_heartbeat_lost(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-B", 12)
    w, r = ctx.client(mem, seed=81)
    l1 = ctx.load_mid(w, r, key)
    w.call("pause_heartbeats")
    t0 = time.monotonic()
    st = h.wait_until("heartbeat loss", lambda s: h.reg(r["reg"], s)["state"] != "active",
                      timeout=10 * h.heartbeat_timeout_s + 5)
    c.record("seconds_to_detect", time.monotonic() - t0)
    reg = h.reg(r["reg"], st)
    c.check("closing_on_heartbeat_loss", reg["state"] == "closing" and reg["reason"] == "heartbeat lost",
            value=reg["reason"])
    time.sleep(3 * h.heartbeat_timeout_s)
    reg = h.reg(r["reg"])
    c.check("not_released_while_copy_runs", reg["state"] == "closing" and reg["mapped"]
            and reg["in_flight"] == [l1], value=reg["state"])
    refuse(c, "silent_client_refused", lambda: ctx.try_load(w, r, key), "ClientLostError", h, N)
    h.finish()
    st = h.wait_released(r["reg"])
    c.check("lifecycle_path", _states(h.reg(r["reg"], st)) == LIFECYCLE, value=_states(h.reg(r["reg"], st)))
    c.check("copy_completed_into_client", w.call("digest", name="kv") == ctx.expect(key))
    _end(ctx, c, w)


def case_foreign_client(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-A", 11)
    a, ra = ctx.client(mem, seed=91)
    l1 = ctx.load(a, ra, key)
    ctx.finish_wait(a, l1)
    before = h.reg(ra["reg"])
    b, _ = ctx.client(mem, seed=92)
    refuse(c, "foreign_load_refused", lambda: b.call("load", as_ref=ra, key=key, offset=0), "NotOwnerError", h, N)
    refuse(c, "foreign_close_refused", lambda: b.call("close", as_ref=ra), "NotOwnerError")
    refuse(c, "foreign_wait_refused", lambda: b.call("wait", req=l1), "NotOwnerError")
    refuse(c, "foreign_cancel_refused", lambda: b.call("cancel", req=l1), "NotOwnerError")
    a_token = a.info["token"]  # A's secret, as if leaked to B
    refuse(c, "other_token_refused", lambda: b.call("call", op="heartbeat", token=a_token), "AuthError")
    refuse(c, "random_token_refused", lambda: b.call("call", op="heartbeat", token=os.urandom(32)), "AuthError")
    from kmesh.service.client import ServiceClient

    with ServiceClient.open(h.socket_path) as raw:
        refuse(c, "no_hello_refused", lambda: raw.call("heartbeat", token=a_token), "SequenceError")
    # Same uid, no admin token: a (buggy) worker must not stop the service, evict others' originals or read
    # every client's registrations.
    refuse(c, "ordinary_client_cannot_shutdown", lambda: b.call("call", op="shutdown", fields={}),
           "NotAuthorizedError")
    refuse(c, "ordinary_client_cannot_evict", lambda: b.call("evict", key=key), "NotAuthorizedError")
    refuse(c, "ordinary_client_cannot_read_all", lambda: b.call("status", scope="all"), "NotAuthorizedError")
    after = h.reg(ra["reg"])
    c.check("registration_unchanged", after == before, value=after["state"])
    ctx.finish_wait(a, ctx.load(a, ra, key))
    c.check("owner_still_served", a.call("digest", name="kv") == ctx.expect(key))
    a.call("close", reg=ra["reg"])
    _end(ctx, c, a, b)


def case_foreign_uid(ctx: Ctx, c: Case) -> None:
    if os.getuid() != 0:
        c.skip("needs root to run a client under another uid")
    uid = 65534
    c.check("socket_mode_0600", (os.stat(ctx.h.socket_path).st_mode & 0o777) == 0o600,
            value=oct(os.stat(ctx.h.socket_path).st_mode & 0o777))
    c.check("other_uid_cannot_connect", _as_uid(uid, ctx.h.socket_path) == "PermissionError")
    # Second layer: even through a deliberately world-writable socket, SO_PEERCRED refuses the uid.
    from kmesh.service import process

    # The directory (runtime dir + service log) is this case's own: removed when the case ends, however it ends.
    with tempfile.TemporaryDirectory(prefix="kmesh-open-") as tmp:
        parent = Path(tmp)
        os.chmod(parent, 0o711)
        sp = process.start(parent / "rt", socket_mode=0o666, log_path=parent / "service.log")
        try:
            got = _as_uid(uid, sp.socket_path)
            c.check("peer_uid_refused_by_service", got == "auth", value=got)
            with sp.admin_client() as adm:
                st = adm.status("all")
            c.check("refusal_counted", st["stats"]["refused_connections"] == 1)
            c.check("registry_untouched", len(st["clients"]) == 1 and not st["registrations"])
        finally:
            sp.stop()


def _as_uid(uid: int, sock_path: Path) -> str:
    """In a forked child running as uid: connect and read the service's answer. Returns the error code the
    service sent, "PermissionError" if the socket could not be reached, or what else happened."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: plain syscalls only
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(str(sock_path))
            except PermissionError:
                out = "PermissionError"
            else:
                head = s.recv(12, socket.MSG_WAITALL)
                body = msgpack.unpackb(s.recv(struct.unpack(">I", head[8:12])[0], socket.MSG_WAITALL))
                out = body["error"]["code"] if not body["ok"] else "accepted"
            os.write(w, out.encode())
        except BaseException as e:  # noqa: BLE001 - report anything, never return into the stage
            os.write(w, f"{type(e).__name__}: {e}".encode()[:200])
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 256):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data.decode()


def case_sigkill_mid_copy(ctx: Ctx, c: Case, mem: str) -> None:
    h, key = ctx.h, ctx.obj(b"orig-B", 12)
    big = N if mem != "cuda" else N * 2048  # 256 MiB on the GPU, so its release shows in free memory
    free0 = _gpu_free() if mem == "cuda" else None
    w, r = ctx.client(mem, seed=101, nbytes=big)
    l1 = ctx.load_mid(w, r, key)
    w.kill()
    st = h.wait_until("the service to see the death", lambda s: h.reg(r["reg"], s)["state"] != "active")
    reg = h.reg(r["reg"], st)
    c.check("closing_not_released", reg["state"] == "closing" and reg["mapped"] and reg["in_flight"] == [l1],
            value=reg)
    # The socket's EOF and the pidfd's exit report race each other; either one closes the registration.
    c.check("reason_death_or_disconnect", reg["reason"] in ("client died", "disconnect"), value=reg["reason"])
    if mem == "cuda":
        c.check("dead_clients_memory_still_open", st["cuda_handles_open"] == 1)
    else:
        c.check("dead_clients_memory_still_mapped", st["memfd_mappings"] >= 1, value=st["memfd_mappings"])
    h.finish()
    st = h.wait_released(r["reg"])
    c.check("lifecycle_path", _states(h.reg(r["reg"], st)) == LIFECYCLE, value=_states(h.reg(r["reg"], st)))
    c.check("copy_finished_before_release", h.request(l1, st) is None and st["copies_running"] == 0)
    if mem == "cuda":
        time.sleep(0.5)
        free1 = _gpu_free()
        c.check("device_memory_returned", free1 >= free0 - (64 << 20), value={"before": free0, "after": free1})
    _end(ctx, c)


def case_death_seen_by_pidfd(ctx: Ctx, c: Case) -> None:
    """The dead client's socket stays open (a child inherited it), so no EOF arrives: only the pidfd can tell
    the service that the client process is gone."""
    h, key = ctx.h, ctx.obj(b"orig-B", 12)
    w, r = ctx.client("memfd", seed=121)
    holder = None
    try:  # from the fork on: whatever fails, the holder is killed (it would outlive the stage)
        holder = w.call("fork_holder")
        l1 = ctx.load_mid(w, r, key)
        w.kill()
        st = h.wait_until("the service to see the death", lambda s: h.reg(r["reg"], s)["state"] != "active")
        reg = h.reg(r["reg"], st)
        os.kill(holder, 0)  # raises if the holder is gone: then an EOF could have told the service instead
        c.check("socket_holder_alive", True, value=holder)
        c.check("reason_client_died", reg["reason"] == "client died", value=reg["reason"])
        c.check("closing_not_released", reg["state"] == "closing" and reg["in_flight"] == [l1], value=reg["state"])
        h.finish()
        st = h.wait_released(r["reg"])
        c.check("lifecycle_path", _states(h.reg(r["reg"], st)) == LIFECYCLE, value=_states(h.reg(r["reg"], st)))
    finally:
        if holder is not None:
            try:
                os.kill(holder, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _end(ctx, c)


def _gpu_free() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def case_eviction_keeps_pinned(ctx: Ctx, c: Case) -> None:
    h = ctx.h
    key = ctx.obj(b"evictable", 13)
    w, r = ctx.client("memfd", seed=111)
    l1 = ctx.load_mid(w, r, key)
    out = h.admin.evict(key)
    c.check("pinned_object_kept", out["evicted"] == 0 and out["kept"] == [key], value=out)
    done = ctx.finish_wait(w, l1)
    c.check("copy_from_kept_object_complete", done["state"] == "done" and w.call("digest", name="kv")
            == ctx.expect(key))
    out = h.admin.evict(key)
    c.check("unpinned_object_evicted", out["evicted"] == 1, value=out)
    del ctx.objects[key]
    refuse(c, "evicted_object_gone", lambda: ctx.try_load(w, r, key), "ObjectMissingError", h, N)
    w.call("close", reg=r["reg"])
    _end(ctx, c, w)


CASES: list[tuple[str, Callable[..., None], bool]] = [  # (id, function, runs per memory kind)
    ("register-use-close", case_register_use_close, True),
    ("private-copies", case_private_copies, True),
    ("same-address-new-gen", case_same_address_new_gen, True),
    ("replacement-same-instance", case_replacement_same_instance, True),
    ("close-in-flight", case_close_in_flight, True),
    ("cancel-running-copy", case_cancel_running_copy, True),
    ("heartbeat-lost-mid-copy", case_heartbeat_lost, True),
    ("foreign-client", case_foreign_client, True),
    ("foreign-uid", case_foreign_uid, False),
    ("sigkill-mid-copy", case_sigkill_mid_copy, True),
    ("death-seen-by-pidfd", case_death_seen_by_pidfd, False),
    ("eviction-keeps-pinned", case_eviction_keeps_pinned, False),
]


def run(cfg: Config) -> Result:
    sec = cfg.section("ownership")
    device = sec.get("device", "cpu")
    mems = ["memfd", "cuda"] if device == "cuda" else ["memfd"]
    res = Result.begin("ownership", cfg)
    out_dir = cfg.stage_dir("ownership")
    t0 = time.perf_counter()
    with Harness(device=device, heartbeat_timeout_s=float(sec.get("heartbeat_timeout_s", 0.5)),
                 chunk_bytes=int(sec.get("chunk_bytes", 16384)), log_dir=out_dir) as h:
        res.extra["service_pid"] = h.service.pid
        ctx = Ctx(h)
        for case_id, fn, per_mem in CASES:
            for mem in (mems if per_mem else [None]):
                cid = f"{case_id}/{mem}" if mem else case_id
                with res.case(cid, {"memory": mem or "memfd", "device": device, "layout": LAYOUT,
                                    "chunk_bytes": h.chunk_bytes}) as c:
                    fn(ctx, c, mem) if mem else fn(ctx, c)
        st = h.status()
        res.extra["service_stats"] = st["stats"]
        res.extra["final_leaks"] = h.leaks(st)
    res.timings["seconds"] = time.perf_counter() - t0
    return res
