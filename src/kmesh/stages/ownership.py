"""Stage `ownership` (write-up §22): cross-process ownership of shared state by the cache service.

Every case runs against a real service process and real client processes (kmesh.harness.worker), steered
through kmesh.harness.service: copies are paced chunk by chunk through a gate the stage controls, so "a copy
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
from kmesh.harness.service import Harness
from kmesh.harness.worker import Worker, pattern, sha
from kmesh.result import Case, Result
from kmesh.service import descriptor
from kmesh.service.errors import ServiceError
from kmesh.service.handles import HostBuffer

BLOCKS = 8  # registration = one object: 2 layers x 8 blocks x 2 heads x 16 tokens x 128 ch x bf16 = 128 KiB
LAYOUT = descriptor.example(num_blocks=BLOCKS)
NBYTES = descriptor.nbytes(LAYOUT)
LIFECYCLE = ["registered", "active", "closing", "drained", "released"]


class Ctx:
    """One harness plus the bookkeeping the cases share (objects made so far, fresh instance numbers)."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self._instance = 100
        self._alloc = 1 << 40
        self.objects: dict[bytes, int] = {}  # key -> seed

    def instance(self) -> int:
        self._instance += 1
        return self._instance

    def obj(self, key: bytes, seed: int) -> bytes:
        """An original of NBYTES bytes = pattern(seed), saved by the stage process itself (its own memfd)."""
        if key in self.objects:
            return key
        admin = self.harness.admin
        buf = HostBuffer(NBYTES, name="kmesh-producer")
        buf.write(0, pattern(seed, NBYTES))
        self._alloc += 1
        ref = admin.register_host(buf, alloc_id=self._alloc, generation=1, layout=LAYOUT)
        req = admin.save(ref, key, 0, NBYTES)
        self.harness.accepted(NBYTES)
        self.harness.finish()
        assert admin.wait(req)["state"] == "done"
        admin.close(ref)
        self.harness.wait_released(ref.reg)
        buf.close()
        self.objects[key] = seed
        return key

    def expect(self, key: bytes) -> str:
        return sha(pattern(self.objects[key], NBYTES))

    # -- worker helpers ---------------------------------------------------------------------------------
    def client(self, mem: str, seed: int, instance: int | None = None, name: str = "kv", nbytes: int = NBYTES,
               alloc_id: int = 1, generation: int = 1, activate: bool = True) -> tuple[Worker, dict[str, Any]]:
        worker = self.harness.worker(instance if instance is not None else self.instance(), cuda=mem == "cuda")
        ref = self.register(worker, mem, seed, name, nbytes, alloc_id, generation, activate)
        return worker, ref

    def register(self, worker: Worker, mem: str, seed: int, name: str = "kv", nbytes: int = NBYTES, alloc_id: int = 1,
                 generation: int = 1, activate: bool = True, address: int | None = None) -> dict[str, Any]:
        worker.call("alloc", name=name, nbytes=nbytes, seed=seed, device="cuda" if mem == "cuda" else "cpu",
                    **({"address": address} if address else {}))
        layout = LAYOUT if nbytes == NBYTES else descriptor.example(num_blocks=nbytes * BLOCKS // NBYTES)
        return worker.call("register", name=name, alloc_id=alloc_id, generation=generation, layout=layout,
                           activate=activate)

    def load(self, worker: Worker, ref: dict[str, Any], key: bytes, offset: int = 0) -> int:
        """A load that must be accepted (it is accounted with the gate)."""
        req = worker.call("load", reg=ref["reg"], key=key, offset=offset)
        self.harness.accepted(NBYTES)
        return req

    def try_load(self, worker: Worker, ref: dict[str, Any], key: bytes, offset: int = 0) -> int:
        """A load that must be refused: for refuse(..., harness, NBYTES), which accounts it should it be accepted."""
        return worker.call("load", reg=ref["reg"], key=key, offset=offset)

    def load_mid(self, worker: Worker, ref: dict[str, Any], key: bytes, chunks: int = 2) -> int:
        """Start a load and let exactly `chunks` of its chunks through: it is then provably mid-copy."""
        req = self.load(worker, ref, key)
        self.harness.grant(chunks)
        self.harness.wait_chunks(req, chunks)
        return req

    def finish_wait(self, worker: Worker, req: int) -> dict[str, Any]:
        self.harness.finish()
        return worker.call("wait", req=req)


def refuse(case: Case, name: str, fn: Callable[[], Any], expected: str, harness: Harness | None = None,
           nbytes: int = 0) -> None:
    """Check that fn is refused with the ServiceError named `expected` (the value records what happened).

    fn may try a copy of nbytes (a load or save; pass the harness): if the service wrongly accepts it, the
    copy is recorded with the gate (harness.accepted) like any accepted copy, so it runs and drains with the next
    finish() and the token accounting stays right. Without that, one wrong acceptance would starve every
    later copy of its tokens and turn one real failure into a cascade of timeouts in later cases."""
    if nbytes and harness is None:
        raise ValueError("a refusal that tries a copy needs the harness to account for it")
    try:
        fn()
        got = "accepted"
    except ServiceError as e:
        got = type(e).__name__
    if got == "accepted" and nbytes:
        harness.accepted(nbytes)  # type: ignore[union-attr]
    case.check(name, got == expected, value=got)


def _states(reg: dict[str, Any] | None) -> list[str]:
    return [step[0] for step in (reg or {}).get("history", []) if step[0] != "release-deferred"]


def _end(ctx: Ctx, case: Case, *workers: Worker) -> None:
    for worker in workers:
        worker.exit()
    st = ctx.harness.wait_until("the registry to empty", lambda s: not s["registrations"] and not s["copies_running"])
    leaks = ctx.harness.leaks(st)
    case.check("nothing_leaked", ctx.harness.no_leaks(st), value=leaks)


# -- cases ----------------------------------------------------------------------------------------------
def case_register_use_close(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-A", 11)
    worker, ref = ctx.client(mem, seed=21, activate=False)
    case.check("state_after_register", harness.reg(ref["reg"])["state"] == "registered")
    refuse(case, "work_before_activate_refused", lambda: ctx.try_load(worker, ref, key), "RegistrationStateError",
           harness, NBYTES)
    worker.call("activate", reg=ref["reg"])
    case.check("state_after_activate", harness.reg(ref["reg"])["state"] == "active")
    save = worker.call("save", reg=ref["reg"], key=b"from-client-" + mem.encode(), offset=0, nbytes=NBYTES)
    harness.accepted(NBYTES)
    case.check("save_done", ctx.finish_wait(worker, save)["state"] == "done")
    ctx.objects[b"from-client-" + mem.encode()] = 21
    req = ctx.load(worker, ref, key)
    case.check("load_done", ctx.finish_wait(worker, req)["state"] == "done")
    case.check("loaded_bytes_are_the_original", worker.call("digest", name="kv") == ctx.expect(key))
    worker.call("fill", name="kv", seed=99, n=NBYTES)
    req = ctx.load(worker, ref, b"from-client-" + mem.encode())
    ctx.finish_wait(worker, req)
    case.check("saved_then_loaded_roundtrip", worker.call("digest", name="kv") == sha(pattern(21, NBYTES)))
    worker.call("close", reg=ref["reg"])
    st = harness.wait_released(ref["reg"])
    path = _states(harness.reg(ref["reg"], st))
    case.check("lifecycle_path", path == LIFECYCLE, value=path)
    _end(ctx, case, worker)


def case_private_copies(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-A", 11)
    child_a, ref_a = ctx.client(mem, seed=31)
    child_b, ref_b = ctx.client(mem, seed=32)
    for worker, ref in ((child_a, ref_a), (child_b, ref_b)):
        ctx.finish_wait(worker, ctx.load(worker, ref, key))
    child_a.call("fill", name="kv", seed=33, n=NBYTES)  # child A mutates its private copy
    case.check("mutating_child_changed", child_a.call("digest", name="kv") == sha(pattern(33, NBYTES)))
    case.check("other_child_unaffected", child_b.call("digest", name="kv") == ctx.expect(key))
    child_c, ref_c = ctx.client(mem, seed=34)
    ctx.finish_wait(child_c, ctx.load(child_c, ref_c, key))
    case.check("later_child_gets_original", child_c.call("digest", name="kv") == ctx.expect(key))
    obj = next(o for o in harness.status(verify=True)["store"]["objects"] if o["key"] == key)
    case.check("original_unchanged", obj["sha256_now"] == obj["sha256"] == ctx.expect(key), value=obj["sha256"])
    for worker, ref in ((child_a, ref_a), (child_b, ref_b), (child_c, ref_c)):
        worker.call("close", reg=ref["reg"])
    _end(ctx, case, child_a, child_b, child_c)


def case_same_address_new_gen(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-B", 12)
    worker = harness.worker(ctx.instance(), cuda=mem == "cuda")
    addr = worker.call("alloc", name="a", nbytes=NBYTES, seed=41, device="cuda" if mem == "cuda" else "cpu")["address"]
    r1 = worker.call("register", name="a", alloc_id=addr, generation=1, layout=LAYOUT)
    if mem == "cuda":
        # Device memory is recycled by torch's caching allocator: the same address is the same physical
        # memory, so the client may free it only after the service released it (the client contract).
        ctx.finish_wait(worker, ctx.load(worker, r1, key))
        worker.call("close", reg=r1["reg"])
        harness.wait_released(r1["reg"])
        case.check("old_handle_closed", harness.status()["cuda_handles_open"] == 0)
        worker.call("free", name="a")
        addr2 = worker.call("alloc", name="b", nbytes=NBYTES, seed=42, device="cuda")["address"]
    else:
        # Host memory: the old allocation goes away WHILE a copy into it runs; the service's own mapping keeps
        # that memfd alive, and the new allocation is mapped at the very same address.
        l1 = ctx.load_mid(worker, r1, key)
        worker.call("free", name="a")
        addr2 = worker.call("alloc", name="b", nbytes=NBYTES, seed=42, address=addr)["address"]
    case.check("same_address", addr2 == addr, value=hex(addr))
    r2 = worker.call("register", name="b", alloc_id=addr, generation=2, layout=LAYOUT)
    case.check("new_registration_id", r2["reg"] != r1["reg"], value=[r1["reg"], r2["reg"]])
    old = harness.reg(r1["reg"])
    case.check("old_generation_not_active", old["state"] in ("closing", "released"), value=old["state"])
    refuse(case, "old_generation_refused", lambda: worker.call("load", as_ref=r1, key=key, offset=0),
           "RegistrationClosedError", harness, NBYTES)
    refuse(case, "new_id_old_generation_refused",
           lambda: worker.call("load", as_ref={**r2, "gen": 1}, key=key, offset=0), "StaleGenerationError",
           harness, NBYTES)
    refuse(case, "reregister_same_generation_refused",
           lambda: worker.call("register", name="b", alloc_id=addr, generation=2, layout=LAYOUT),
           "StaleGenerationError")
    if mem != "cuda":
        case.check("old_copy_still_in_flight", old["in_flight"] == [l1] and old["mapped"], value=old)
        done = ctx.finish_wait(worker, l1)
        case.check("old_copy_completed", done["state"] == "done")
        case.check("new_allocation_untouched_by_old_copy", worker.call("digest", name="b") == sha(pattern(42, NBYTES)))
        harness.wait_released(r1["reg"])
    l2 = ctx.load_mid(worker, r2, key)
    ctx.finish_wait(worker, l2)
    case.check("new_generation_gets_data", worker.call("digest", name="b") == ctx.expect(key))
    worker.call("close", reg=r2["reg"])
    _end(ctx, case, worker)


def case_replacement_same_instance(ctx: Ctx, case: Case, mem: str) -> None:
    """An instance number names one live client. (a) A claim on a live client's instance is refused and the
    holder keeps working; (b) once the holder's process is gone the instance is free at once: the replacement
    is a new client that cannot reach the old registration, which closes, drains and is released; (c) an
    admin takeover of a live instance loses the old client: its registration closes and drains, never moves."""
    harness, key, cuda = ctx.harness, ctx.obj(b"orig-A", 11), mem == "cuda"
    inst = ctx.instance()
    holder, holder_ref = ctx.client(mem, seed=51, instance=inst)
    l1 = ctx.load_mid(holder, holder_ref, key)
    # (a) refused while the holder lives
    replacement = harness.spawn(cuda=cuda)
    refuse(case, "claim_on_live_instance_refused", lambda: replacement.call("connect", instance=inst),
           "InstanceInUseError")
    refuse(case, "takeover_without_admin_refused", lambda: replacement.call("connect", instance=inst, takeover=True),
           "NotAuthorizedError")
    st = harness.status()
    holder_status = next(x for x in st["clients"] if x["client"] == holder.info["client"])
    case.check("holder_still_live", holder_status["live"] and harness.reg(holder_ref["reg"], st)["state"] == "active",
               value=holder_status)
    harness.grant(1)
    case.check("holder_copy_goes_on", harness.wait_chunks(l1, 3)["chunks_done"] >= 3)
    # (b) the holder dies mid-copy; its replacement claims the instance right away
    holder.kill()
    replacement.info = replacement.call("connect", instance=inst)
    case.check("replacement_is_a_new_client", replacement.info["client"] != holder.info["client"],
               value=replacement.info["client"])
    st = harness.status()
    old = harness.reg(holder_ref["reg"], st)
    case.check("old_registration_closing_not_released", old["state"] == "closing" and old["in_flight"] == [l1],
               value=old["state"])
    case.check("old_reason_death_or_disconnect", old["reason"] in ("client died", "disconnect"), value=old["reason"])
    refuse(case, "replacement_cannot_use_old", lambda: replacement.call("load", as_ref=holder_ref, key=key, offset=0),
           "NotOwnerError", harness, NBYTES)
    refuse(case, "replacement_cannot_close_old", lambda: replacement.call("close", as_ref=holder_ref), "NotOwnerError")
    refuse(case, "replacement_cannot_wait_old_request", lambda: replacement.call("wait", req=l1), "NotOwnerError")
    replacement_ref = ctx.register(replacement, mem, seed=52, alloc_id=1, generation=1)
    case.check("replacement_gets_new_registration", replacement_ref["reg"] != holder_ref["reg"],
               value=[holder_ref["reg"], replacement_ref["reg"]])
    harness.finish()
    st = harness.wait_released(holder_ref["reg"])
    case.check("old_lifecycle_path", _states(harness.reg(holder_ref["reg"], st)) == LIFECYCLE,
               value=_states(harness.reg(holder_ref["reg"], st)))
    refuse(case, "released_old_not_reachable", lambda: replacement.call("close", as_ref=holder_ref), "NotOwnerError")
    case.check("replacement_memory_untouched", replacement.call("digest", name="kv") == sha(pattern(52, NBYTES)))
    # (c) an admin takes over the instance from its live holder (b) while b's copy runs
    l2 = ctx.load_mid(replacement, replacement_ref, key)
    taker = harness.spawn(cuda=cuda)
    taker.info = taker.call("connect", instance=inst, takeover=True, admin=harness.service.admin_token())
    st = harness.status()
    lost = next(x for x in st["clients"] if x["client"] == replacement.info["client"])
    case.check("taken_over_client_lost", not lost["live"] and "taken over" in (lost["lost_reason"] or ""),
               value=lost["lost_reason"])
    old = harness.reg(replacement_ref["reg"], st)
    case.check("taken_over_registration_closing_with_copy", old["state"] == "closing" and old["in_flight"] == [l2],
               value=old["state"])
    refuse(case, "taken_over_client_refused", lambda: ctx.try_load(replacement, replacement_ref, key),
           "ClientLostError", harness, NBYTES)
    refuse(case, "new_holder_cannot_use_old", lambda: taker.call("load", as_ref=replacement_ref, key=key, offset=0),
           "NotOwnerError", harness, NBYTES)
    refuse(case, "new_holder_cannot_wait_old_request", lambda: taker.call("wait", req=l2), "NotOwnerError")
    harness.finish()
    st = harness.wait_released(replacement_ref["reg"])
    case.check("taken_over_lifecycle_path", _states(harness.reg(replacement_ref["reg"], st)) == LIFECYCLE,
               value=_states(harness.reg(replacement_ref["reg"], st)))
    case.check("old_copy_landed_in_old_memory", replacement.call("digest", name="kv") == ctx.expect(key))
    taker_ref = ctx.register(taker, mem, seed=53, alloc_id=1, generation=1)
    ctx.finish_wait(taker, ctx.load(taker, taker_ref, key))
    case.check("new_holder_registration_works", taker.call("digest", name="kv") == ctx.expect(key))
    taker.call("close", reg=taker_ref["reg"])
    _end(ctx, case, replacement, taker)


def case_close_in_flight(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-B", 12)
    worker, ref = ctx.client(mem, seed=61)
    l1 = ctx.load_mid(worker, ref, key)
    closed = worker.call("close", reg=ref["reg"])
    case.check("close_reply_closing_with_copy", closed["state"] == "closing" and closed["in_flight"] == [l1],
               value=closed)
    refuse(case, "new_load_refused", lambda: ctx.try_load(worker, ref, key), "RegistrationClosedError", harness, NBYTES)
    refuse(case, "new_save_refused",
           lambda: worker.call("save", reg=ref["reg"], key=b"x", offset=0, nbytes=NBYTES), "RegistrationClosedError",
           harness, NBYTES)
    harness.grant(1)
    job = harness.wait_chunks(l1, 3)
    st = harness.status()
    case.check("copy_progresses_after_close", job["chunks_done"] >= 3, value=job["chunks_done"])
    case.check("still_mapped_while_copying",
               harness.reg(ref["reg"], st)["mapped"] and harness.reg(ref["reg"], st)["state"] == "closing")
    done = ctx.finish_wait(worker, l1)
    case.check("accepted_copy_completed", done["state"] == "done")
    case.check("data_complete", worker.call("digest", name="kv") == ctx.expect(key))
    st = harness.wait_released(ref["reg"])
    case.check("lifecycle_path", _states(harness.reg(ref["reg"], st)) == LIFECYCLE,
               value=_states(harness.reg(ref["reg"], st)))
    _end(ctx, case, worker)


def case_cancel_running_copy(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-A", 11)
    worker, ref = ctx.client(mem, seed=71)
    l1 = ctx.load_mid(worker, ref, key)
    cancel = worker.call("cancel", req=l1)
    case.check("cancel_acknowledged_copy_running", cancel["state"] == "running" and cancel["cancel_requested"],
               value=cancel)
    refuse(case, "destination_not_reusable", lambda: ctx.try_load(worker, ref, key), "DestinationBusyError",
           harness, NBYTES)
    refuse(case, "range_not_readable_either",
           lambda: worker.call("save", reg=ref["reg"], key=b"y", offset=0, nbytes=NBYTES), "DestinationBusyError",
           harness, NBYTES)
    harness.grant(1)
    case.check("copy_continues_after_cancel", harness.wait_chunks(l1, 3)["chunks_done"] >= 3)
    done = ctx.finish_wait(worker, l1)
    case.check("ends_cancelled_after_drain", done["state"] == "cancelled", value=done["state"])
    case.check("copy_ran_to_the_end", worker.call("digest", name="kv") == ctx.expect(key))
    case.check("reservation_gone", harness.status()["reservations"] == 0)
    worker.call("fill", name="kv", seed=72, n=NBYTES)
    l2 = ctx.load(worker, ref, key)
    case.check("destination_reusable_after_drain", ctx.finish_wait(worker, l2)["state"] == "done")
    case.check("second_copy_data", worker.call("digest", name="kv") == ctx.expect(key))
    worker.call("close", reg=ref["reg"])
    _end(ctx, case, worker)


def case_heartbeat_lost(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-B", 12)
    worker, ref = ctx.client(mem, seed=81)
    l1 = ctx.load_mid(worker, ref, key)
    worker.call("pause_heartbeats")
    t0 = time.monotonic()
    st = harness.wait_until("heartbeat loss", lambda s: harness.reg(ref["reg"], s)["state"] != "active",
                            timeout=10 * harness.heartbeat_timeout_s + 5)
    case.record("seconds_to_detect", time.monotonic() - t0)
    reg = harness.reg(ref["reg"], st)
    case.check("closing_on_heartbeat_loss", reg["state"] == "closing" and reg["reason"] == "heartbeat lost",
               value=reg["reason"])
    time.sleep(3 * harness.heartbeat_timeout_s)
    reg = harness.reg(ref["reg"])
    case.check("not_released_while_copy_runs", reg["state"] == "closing" and reg["mapped"]
               and reg["in_flight"] == [l1], value=reg["state"])
    refuse(case, "silent_client_refused", lambda: ctx.try_load(worker, ref, key), "ClientLostError", harness, NBYTES)
    harness.finish()
    st = harness.wait_released(ref["reg"])
    case.check("lifecycle_path", _states(harness.reg(ref["reg"], st)) == LIFECYCLE,
               value=_states(harness.reg(ref["reg"], st)))
    case.check("copy_completed_into_client", worker.call("digest", name="kv") == ctx.expect(key))
    _end(ctx, case, worker)


def case_foreign_client(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-A", 11)
    owner, owner_ref = ctx.client(mem, seed=91)
    l1 = ctx.load(owner, owner_ref, key)
    ctx.finish_wait(owner, l1)
    before = harness.reg(owner_ref["reg"])
    foreign, _ = ctx.client(mem, seed=92)
    refuse(case, "foreign_load_refused", lambda: foreign.call("load", as_ref=owner_ref, key=key, offset=0),
           "NotOwnerError", harness, NBYTES)
    refuse(case, "foreign_close_refused", lambda: foreign.call("close", as_ref=owner_ref), "NotOwnerError")
    refuse(case, "foreign_wait_refused", lambda: foreign.call("wait", req=l1), "NotOwnerError")
    refuse(case, "foreign_cancel_refused", lambda: foreign.call("cancel", req=l1), "NotOwnerError")
    owner_token = owner.info["token"]  # A's secret, as if leaked to B
    refuse(case, "other_token_refused", lambda: foreign.call("call", op="heartbeat", token=owner_token), "AuthError")
    refuse(case, "random_token_refused", lambda: foreign.call("call", op="heartbeat", token=os.urandom(32)),
           "AuthError")
    from kmesh.service.client import ServiceClient

    with ServiceClient.open(harness.socket_path) as raw:
        refuse(case, "no_hello_refused", lambda: raw.call("heartbeat", token=owner_token), "SequenceError")
    # Same uid, no admin token: a (buggy) worker must not stop the service, evict others' originals or read
    # every client's registrations.
    refuse(case, "ordinary_client_cannot_shutdown", lambda: foreign.call("call", op="shutdown", fields={}),
           "NotAuthorizedError")
    refuse(case, "ordinary_client_cannot_evict", lambda: foreign.call("evict", key=key), "NotAuthorizedError")
    refuse(case, "ordinary_client_cannot_read_all", lambda: foreign.call("status", scope="all"), "NotAuthorizedError")
    after = harness.reg(owner_ref["reg"])
    case.check("registration_unchanged", after == before, value=after["state"])
    ctx.finish_wait(owner, ctx.load(owner, owner_ref, key))
    case.check("owner_still_served", owner.call("digest", name="kv") == ctx.expect(key))
    owner.call("close", reg=owner_ref["reg"])
    _end(ctx, case, owner, foreign)


def case_foreign_uid(ctx: Ctx, case: Case) -> None:
    if os.getuid() != 0:
        case.skip("needs root to run a client under another uid")
    uid = 65534
    case.check("socket_mode_0600", (os.stat(ctx.harness.socket_path).st_mode & 0o777) == 0o600,
               value=oct(os.stat(ctx.harness.socket_path).st_mode & 0o777))
    case.check("other_uid_cannot_connect", _as_uid(uid, ctx.harness.socket_path) == "PermissionError")
    # Second layer: even through a deliberately world-writable socket, SO_PEERCRED refuses the uid.
    from kmesh.service import process

    # The directory (runtime dir + service log) is this case's own: removed when the case ends, however it ends.
    with tempfile.TemporaryDirectory(prefix="kmesh-open-") as tmp:
        parent = Path(tmp)
        os.chmod(parent, 0o711)
        sp = process.start(parent / "rt", socket_mode=0o666, log_path=parent / "service.log")
        try:
            got = _as_uid(uid, sp.socket_path)
            case.check("peer_uid_refused_by_service", got == "auth", value=got)
            with sp.admin_client() as adm:
                st = adm.status("all")
            case.check("refusal_counted", st["stats"]["refused_connections"] == 1)
            case.check("registry_untouched", len(st["clients"]) == 1 and not st["registrations"])
        finally:
            sp.stop()


def _as_uid(uid: int, sock_path: Path) -> str:
    """In a forked child running as uid: connect and read the service's answer. Returns the error code the
    service sent, "PermissionError" if the socket could not be reached, or what else happened."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: plain syscalls only
        try:
            os.close(read_fd)
            os.setgid(uid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            try:
                sock.connect(str(sock_path))
            except PermissionError:
                out = "PermissionError"
            else:
                head = sock.recv(12, socket.MSG_WAITALL)
                body = msgpack.unpackb(sock.recv(struct.unpack(">I", head[8:12])[0], socket.MSG_WAITALL))
                out = body["error"]["code"] if not body["ok"] else "accepted"
            os.write(write_fd, out.encode())
        except BaseException as e:  # noqa: BLE001 - report anything, never return into the stage
            os.write(write_fd, f"{type(e).__name__}: {e}".encode()[:200])
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    while chunk := os.read(read_fd, 256):
        data += chunk
    os.close(read_fd)
    os.waitpid(pid, 0)
    return data.decode()


def case_sigkill_mid_copy(ctx: Ctx, case: Case, mem: str) -> None:
    harness, key = ctx.harness, ctx.obj(b"orig-B", 12)
    big = NBYTES if mem != "cuda" else NBYTES * 2048  # 256 MiB on the GPU, so its release shows in free memory
    free0 = _gpu_free() if mem == "cuda" else None
    worker, ref = ctx.client(mem, seed=101, nbytes=big)
    l1 = ctx.load_mid(worker, ref, key)
    worker.kill()
    st = harness.wait_until("the service to see the death", lambda s: harness.reg(ref["reg"], s)["state"] != "active")
    reg = harness.reg(ref["reg"], st)
    case.check("closing_not_released", reg["state"] == "closing" and reg["mapped"] and reg["in_flight"] == [l1],
               value=reg)
    # The socket's EOF and the pidfd's exit report race each other; either one closes the registration.
    case.check("reason_death_or_disconnect", reg["reason"] in ("client died", "disconnect"), value=reg["reason"])
    if mem == "cuda":
        case.check("dead_clients_memory_still_open", st["cuda_handles_open"] == 1)
    else:
        case.check("dead_clients_memory_still_mapped", st["memfd_mappings"] >= 1, value=st["memfd_mappings"])
    harness.finish()
    st = harness.wait_released(ref["reg"])
    case.check("lifecycle_path", _states(harness.reg(ref["reg"], st)) == LIFECYCLE,
               value=_states(harness.reg(ref["reg"], st)))
    case.check("copy_finished_before_release", harness.request(l1, st) is None and st["copies_running"] == 0)
    if mem == "cuda":
        time.sleep(0.5)
        free1 = _gpu_free()
        case.check("device_memory_returned", free1 >= free0 - (64 << 20), value={"before": free0, "after": free1})
    _end(ctx, case)


def case_death_seen_by_pidfd(ctx: Ctx, case: Case) -> None:
    """The dead client's socket stays open (a child inherited it), so no EOF arrives: only the pidfd can tell
    the service that the client process is gone."""
    harness, key = ctx.harness, ctx.obj(b"orig-B", 12)
    worker, ref = ctx.client("memfd", seed=121)
    holder = None
    try:  # from the fork on: whatever fails, the holder is killed (it would outlive the stage)
        holder = worker.call("fork_holder")
        l1 = ctx.load_mid(worker, ref, key)
        worker.kill()
        st = harness.wait_until("the service to see the death",
                                lambda s: harness.reg(ref["reg"], s)["state"] != "active")
        reg = harness.reg(ref["reg"], st)
        try:
            os.kill(holder, 0)  # the holder must still be there: else an EOF could have told the service instead
            holder_alive = True
        except ProcessLookupError:
            holder_alive = False
        case.check("socket_holder_alive", holder_alive, value=holder)
        case.check("reason_client_died", reg["reason"] == "client died", value=reg["reason"])
        case.check("closing_not_released", reg["state"] == "closing" and reg["in_flight"] == [l1], value=reg["state"])
        harness.finish()
        st = harness.wait_released(ref["reg"])
        case.check("lifecycle_path", _states(harness.reg(ref["reg"], st)) == LIFECYCLE,
                   value=_states(harness.reg(ref["reg"], st)))
    finally:
        if holder is not None:
            try:
                os.kill(holder, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _end(ctx, case)


def _gpu_free() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def case_eviction_keeps_pinned(ctx: Ctx, case: Case) -> None:
    harness = ctx.harness
    key = ctx.obj(b"evictable", 13)
    worker, ref = ctx.client("memfd", seed=111)
    l1 = ctx.load_mid(worker, ref, key)
    out = harness.admin.evict(key)
    case.check("pinned_object_kept", out["evicted"] == 0 and out["kept"] == [key], value=out)
    done = ctx.finish_wait(worker, l1)
    case.check("copy_from_kept_object_complete", done["state"] == "done" and worker.call("digest", name="kv")
               == ctx.expect(key))
    out = harness.admin.evict(key)
    case.check("unpinned_object_evicted", out["evicted"] == 1, value=out)
    del ctx.objects[key]
    refuse(case, "evicted_object_gone", lambda: ctx.try_load(worker, ref, key), "ObjectMissingError", harness, NBYTES)
    worker.call("close", reg=ref["reg"])
    _end(ctx, case, worker)


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
                 chunk_bytes=int(sec.get("chunk_bytes", 16384)), log_dir=out_dir) as harness:
        res.extra["service_pid"] = harness.service.pid
        ctx = Ctx(harness)
        for case_id, fn, per_mem in CASES:
            for mem in (mems if per_mem else [None]):
                cid = f"{case_id}/{mem}" if mem else case_id
                with res.case(cid, {"memory": mem or "memfd", "device": device, "layout": LAYOUT,
                                    "chunk_bytes": harness.chunk_bytes}) as case:
                    fn(ctx, case, mem) if mem else fn(ctx, case)
        st = harness.status()
        res.extra["service_stats"] = st["stats"]
        res.extra["final_leaks"] = harness.leaks(st)
    res.timings["seconds"] = time.perf_counter() - t0
    return res
