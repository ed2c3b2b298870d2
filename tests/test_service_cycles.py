"""Randomized lifecycle cycles across real processes, checked against a model of what must be true.

>= 1,000 cycles; each ends a registration's active life (close, replace by a new generation, SIGKILL of the
client process and a replacement claiming its instance at once, or an admin takeover of a live client's instance
after a plain claim on it was refused) while at least
one accepted copy into that registration is provably still running (its chunks have not all been granted by
the gate). After each event the test tries to use the old registration (must be refused); periodically it
lets every copy finish and checks, independently of the service's own bookkeeping:
  - every completed copy's bytes, read back from the client's memory, equal the original's pattern;
  - memory of released registrations (kept mapped by the client) never changes after release (canary);
  - the service lists exactly the registrations the model says are active, nothing else; no holds,
    reservations, pins, stale uses, invariant violations; its fd count and memfd mappings are back to
    what the active registrations need.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kmesh.harness.service import Harness
from kmesh.harness.worker import Worker, pattern, sha
from kmesh.service import descriptor
from kmesh.service.errors import ServiceError

SEED = 7
CYCLES = 500   # ~19 s on the 2-core machine; the reliability stage carries the long runs
SLOTS = 3
OBJ_LAYOUT = descriptor.example(num_blocks=1)
OBJ = descriptor.nbytes(OBJ_LAYOUT)            # 16 KiB originals
REG_LAYOUT = descriptor.example(num_blocks=2)  # registrations hold two of them
REG = descriptor.nbytes(REG_LAYOUT)
CHUNK = 4096                                   # 4 chunks per copy
OBJECTS = {b"orig-%d" % i: 1000 + i for i in range(6)}


@dataclass
class Copy:
    req: int
    end: int          # cumulative gate tokens after which this copy has consumed all of its chunks
    buf: str
    offset: int
    key: bytes
    kind: str


@dataclass
class Reg:
    reg: int
    gen: int
    alloc_id: int
    buf: str
    layout_digest: bytes
    copies: list[Copy] = field(default_factory=list)

    def ref(self) -> dict:
        return {"reg": self.reg, "gen": self.gen, "layout_digest": self.layout_digest}


@dataclass
class Slot:
    instance: int
    w: Worker
    regs: list[Reg] = field(default_factory=list)       # active, newest last
    retired: list[tuple[str, Reg]] = field(default_factory=list)  # (buffer, reg) closed but still mapped here
    canaries: dict[str, int] = field(default_factory=dict)  # buffer -> canary seed written after release
    contents: dict[tuple[str, int], str] = field(default_factory=dict)  # (buf, offset) -> expected sha
    next_buf: int = 0
    next_alloc: int = 1


class Model:
    def __init__(self, h: Harness, rng: random.Random) -> None:
        self.h, self.rng = h, rng
        self.slots = [self.spawn(100 + i) for i in range(SLOTS)]
        self.stats = {"cycles": 0, "in_flight_at_event": 0, "kills": 0, "replacements": 0, "closes": 0,
                      "takeovers": 0, "probes_refused": 0, "stale_uses": 0, "copies": 0, "busy_refused": 0,
                      "bytes_checked": 0, "canaries_checked": 0, "saves": 0, "cancels": 0}
        self.expect_obj = {k: sha(pattern(s, OBJ)) for k, s in OBJECTS.items()}  # loadable originals
        self.pending_saves: dict[bytes, str] = {}  # saved, loadable once their copy has drained
        self.retired_slots: list[Slot] = []        # taken-over processes, kept to check their memory

    def spawn(self, instance: int) -> Slot:
        return Slot(instance, self.h.worker(instance))

    # -- helpers ------------------------------------------------------------------------------------
    def register(self, s: Slot, replaces: Reg | None = None) -> Reg:
        """A fresh allocation, registered under a new id, or (replaces=old) under old's id, next generation."""
        name = f"b{s.next_buf}"
        s.next_buf += 1
        seed = self.rng.randrange(1 << 30)
        s.w.call("alloc", name=name, nbytes=REG, seed=seed)
        for off in (0, OBJ):
            s.contents[(name, off)] = sha(pattern(seed, REG)[off:off + OBJ])
        if replaces is None:
            alloc, gen = s.next_alloc, 1
            s.next_alloc += 1
        else:
            alloc, gen = replaces.alloc_id, replaces.gen + 1
        r = s.w.call("register", name=name, alloc_id=alloc, generation=gen, layout=REG_LAYOUT)
        reg = Reg(r["reg"], r["gen"], alloc, name, r["layout_digest"])
        if replaces is not None:
            self.retire(s, replaces)
        s.regs.append(reg)
        return reg

    def retire(self, s: Slot, reg: Reg) -> None:
        s.regs.remove(reg)
        s.retired.append((reg.buf, reg))

    def start_copies(self, s: Slot, reg: Reg) -> None:
        busy = {c.offset for c in reg.copies if c.end > self.h.granted}
        for off in (0, OBJ):
            if off in busy:
                if self.rng.random() < 0.3:  # a second writer on a reserved range must be refused
                    try:
                        s.w.call("load", reg=reg.reg, key=self.rng.choice(list(self.expect_obj)), offset=off)
                        self.stats["stale_uses"] += 1
                    except ServiceError as e:
                        assert type(e).__name__ == "DestinationBusyError", e
                        self.stats["busy_refused"] += 1
                continue
            if self.rng.random() < 0.15 and (reg.buf, off) in s.contents:  # save: memory -> new original
                key = b"saved-%d" % self.stats["saves"]
                req = s.w.call("save", reg=reg.reg, key=key, offset=off, nbytes=OBJ)
                self.h.accepted(OBJ)
                self.pending_saves[key] = s.contents[(reg.buf, off)]
                reg.copies.append(Copy(req, self.h.owed, reg.buf, off, key, "save"))
                self.stats["saves"] += 1
            else:
                key = self.rng.choice(list(self.expect_obj))
                req = s.w.call("load", reg=reg.reg, key=key, offset=off)
                self.h.accepted(OBJ)
                reg.copies.append(Copy(req, self.h.owed, reg.buf, off, key, "load"))
                s.contents[(reg.buf, off)] = self.expect_obj[key]
            self.stats["copies"] += 1

    def probe(self, w: Worker, ref: dict, expected: tuple[str, ...]) -> None:
        """Use a registration that must no longer take work; any acceptance is a stale-handle use."""
        try:
            w.call("load", as_ref=ref, key=b"orig-0", offset=0)
        except ServiceError as e:
            assert type(e).__name__ in expected, (type(e).__name__, expected)
            self.stats["probes_refused"] += 1
            return
        self.h.accepted(OBJ)
        self.stats["stale_uses"] += 1

    # -- one cycle ------------------------------------------------------------------------------------
    def cycle(self) -> None:
        s = self.rng.choice(self.slots)
        reg = s.regs[-1] if s.regs and self.rng.random() < 0.6 else self.register(s)
        self.start_copies(s, reg)
        if self.rng.random() < 0.3:
            self.start_copies(s, reg)  # both ranges are reserved now: a second writer must be refused
        if self.rng.random() < 0.3:  # cancel one: it must go on running (and keep its range) until drained
            c = self.rng.choice(reg.copies)
            r = s.w.call("cancel", req=c.req)
            assert r["cancel_requested"] or r["state"] != "running", r
            if r["state"] == "running" and c.kind == "save":
                self.pending_saves.pop(c.key, None)  # a cancelled save is never committed
            self.stats["cancels"] += 1
        running = [c for c in reg.copies if c.end > self.h.granted]
        if running:  # let the gate move, but never past the first running copy of this registration
            first = min(running, key=lambda c: c.end)
            self.h.grant(self.rng.randrange(0, first.end - self.h.granted))
        in_flight = any(c.end > self.h.granted for c in reg.copies)
        self.stats["in_flight_at_event"] += in_flight
        event = self.rng.choices(["close", "replace", "kill", "supersede"], [45, 30, 13, 12])[0]
        if event == "close":
            r = s.w.call("close", reg=reg.reg)
            assert r["state"] in ("closing", "drained", "released")
            assert (r["state"] == "closing") or not in_flight, r
            self.retire(s, reg)
            self.probe(s.w, reg.ref(), ("RegistrationClosedError",))
            self.stats["closes"] += 1
        elif event == "replace":
            new = self.register(s, replaces=reg)
            self.probe(s.w, reg.ref(), ("RegistrationClosedError",))
            self.probe(s.w, {**new.ref(), "gen": reg.gen}, ("StaleGenerationError",))
            self.stats["replacements"] += 1
        elif event == "kill":  # the replacement claims the instance at once: the service sees the death then
            s.w.kill()
            i = self.slots.index(s)
            self.slots[i] = n = self.spawn(s.instance)
            self.probe(n.w, reg.ref(), ("NotOwnerError",))
            self.stats["kills"] += 1
        else:  # the old process is alive: a plain claim is refused (and changes nothing), a takeover succeeds
            w = self.h.spawn()
            try:
                w.call("connect", instance=s.instance)
                raise AssertionError(f"claim on live instance {s.instance} accepted")
            except ServiceError as e:
                assert type(e).__name__ == "InstanceInUseError", e
            self.probe(s.w, {**reg.ref(), "gen": reg.gen + 1}, ("StaleGenerationError",))  # still served
            w.info = w.call("connect", instance=s.instance, takeover=True, admin=self.h.service.admin_token())
            i = self.slots.index(s)
            self.slots[i] = n = Slot(s.instance, w)
            self.probe(s.w, reg.ref(), ("ClientLostError",))
            self.probe(n.w, reg.ref(), ("NotOwnerError",))
            s.retired += [(r.buf, r) for r in s.regs]
            s.regs = []
            self.retired_slots.append(s)
            self.stats["takeovers"] += 1
        self.stats["cycles"] += 1

    # -- verification ---------------------------------------------------------------------------------
    def settle_and_verify(self) -> None:
        h = self.h
        h.finish()
        st = h.wait_until("all copies drained and closed registrations released",
                          lambda st: st["copies_running"] == 0 and all(r["state"] == "active"
                                                                       for r in st["registrations"]))
        live_slots = self.slots + self.retired_slots
        # 1. the service's registrations are exactly the model's active ones
        want = {r.reg for s in self.slots for r in s.regs}
        got = {r["reg"] for r in st["registrations"]}
        assert got == want, (sorted(got - want), sorted(want - got))
        # 2. bytes of every copy, read from the client processes' memory
        for s in live_slots:
            bufs = {r.buf for r in s.regs} | {b for b, _ in s.retired}
            for (buf, off), want_sha in s.contents.items():
                if buf in bufs and buf not in s.canaries:
                    assert s.w.call("digest", name=buf, offset=off, n=OBJ) == want_sha, (buf, off)
                    self.stats["bytes_checked"] += OBJ
            for r in s.regs:
                r.copies.clear()
        # 3. released memory never changes again: canary written now, checked next time, then freed
        for s in live_slots:
            for buf, seed in list(s.canaries.items()):
                assert s.w.call("digest", name=buf) == sha(pattern(seed, REG)), f"{buf} written after release"
                self.stats["canaries_checked"] += 1
                s.w.call("free", name=buf)
                del s.canaries[buf]
                s.contents = {k: v for k, v in s.contents.items() if k[0] != buf}
            for buf, _ in s.retired:
                seed = self.rng.randrange(1 << 30)
                s.w.call("fill", name=buf, seed=seed, n=REG)
                s.canaries[buf] = seed
            s.retired.clear()
        # 4. store: what was saved is what the model expects; nothing pinned
        objs = {o["key"]: o for o in st["store"]["objects"]}
        self.expect_obj.update(self.pending_saves)
        self.pending_saves.clear()
        for key, want_sha in self.expect_obj.items():
            assert objs[key]["state"] == "committed" and objs[key]["sha256"] == want_sha, key
        # 5. nothing else held by the service
        leaks = h.leaks(st)
        assert leaks["engine_holds"] == leaks["reservations"] == leaks["store_pins"] == 0, leaks
        assert leaks["stale_uses"] == 0 and leaks["violations"] == 0, leaks
        assert st["memfd_mappings"] == len(want), (st["memfd_mappings"], len(want))
        # each active registration: its memfd, and the duplicate that Python's mmap keeps
        assert leaks["extra_fds"] == 2 * len(want), leaks

    def retire_old_slots(self) -> None:
        for s in self.retired_slots:
            if not s.canaries:
                s.w.exit()
        self.retired_slots = [s for s in self.retired_slots if s.canaries]


def _make_objects(h: Harness) -> None:
    from kmesh.service.handles import HostBuffer

    a = h.admin
    for i, (key, seed) in enumerate(OBJECTS.items()):
        buf = HostBuffer(OBJ)
        buf.write(0, pattern(seed, OBJ))
        ref = a.register_host(buf, alloc_id=i + 1, generation=1, layout=OBJ_LAYOUT)
        req = a.save(ref, key, 0, OBJ)
        h.accepted(OBJ)
        h.finish()
        assert a.wait(req)["state"] == "done"
        a.close(ref)
        h.wait_released(ref.reg)
        buf.close()


@pytest.mark.timeout(300)
def test_randomized_register_replace_close_kill_cycles() -> None:
    rng = random.Random(SEED)
    with Harness(heartbeat_timeout_s=60.0, chunk_bytes=CHUNK) as h:
        _make_objects(h)
        m = Model(h, rng)
        while m.stats["cycles"] < CYCLES:
            m.cycle()
            if m.stats["cycles"] % 40 == 0:
                m.settle_and_verify()
                m.retire_old_slots()
        m.settle_and_verify()
        m.settle_and_verify()  # the last canaries are checked too
        m.retire_old_slots()
        for s in m.slots:
            for r in list(s.regs):
                s.w.call("close", reg=r.reg)
            s.w.exit()
        st = h.wait_until("everything released", lambda st: not st["registrations"])
        assert h.no_leaks(st), h.leaks(st)
        print(f"cycles: {m.stats}; service stats {st['stats']}")
        assert m.stats["cycles"] >= CYCLES
        assert m.stats["in_flight_at_event"] >= CYCLES, m.stats  # every event met a running copy
        assert m.stats["stale_uses"] == 0 and st["stats"]["stale_uses"] == 0
        assert st["stats"]["internal_errors"] == 0
