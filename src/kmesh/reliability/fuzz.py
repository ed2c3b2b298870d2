"""Stateful protocol fuzz (issue 26 item 2): sequences of VALID requests in orders nobody wrote down, from several
clients of one real service process, each reply checked against a plain-Python model of the ownership rules.

    counts = run_fuzz(service_process, examples=25, steps=40)     # {"rule:outcome": steps}; raises on a divergence

The model (no KMesh code): which client owns which registration, its generation, whether it may take work (active)
or not (closed by its client, superseded by a newer generation of its allocation, released when its client
disconnected), which objects the store holds with which bytes, which keys a retention group holds. Every step's
outcome must be the one the model predicts — success with the right bytes, or exactly the error type the ownership
rules name (NotOwnerError for another client's registration, live or released; RegistrationClosedError for one's
own that takes no work; StaleGenerationError; ObjectExistsError; ObjectMissingError) — and after every step the
service lists exactly the model's active registrations. Hypothesis drives the sequences and shrinks a divergence to
a minimal one (keep it as a regression test). The run is derandomized: the same arguments give the same sequences.
"""
from __future__ import annotations

import dataclasses
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kmesh.errors import KMeshError
from kmesh.harness.worker import pattern
from kmesh.service import descriptor
from kmesh.service.errors import (NotOwnerError, ObjectExistsError, ObjectMissingError, RegistrationClosedError,
                                  ServiceError, StaleGenerationError)
from kmesh.service.handles import HostBuffer


class FuzzDivergence(KMeshError, AssertionError):
    """The service answered a step otherwise than the ownership model says it must."""


def expect_error(want: type[BaseException] | tuple[type[BaseException], ...], call: Callable[[], Any],
                 what: str) -> BaseException:
    """Run call; it must raise `want` (a divergence otherwise: accepted, or another error)."""
    try:
        call()
    except want as e:
        return e
    except ServiceError as e:
        raise FuzzDivergence(f"{what}: the model says {_names(want)}, "
                             f"the service raised {type(e).__name__}: {e}") from e
    raise FuzzDivergence(f"{what}: the model says {_names(want)}, the service accepted it")


def _names(want: Any) -> str:
    return " or ".join(w.__name__ for w in (want if isinstance(want, tuple) else (want,)))


LAYOUT = descriptor.example(num_blocks=1)
N = descriptor.nbytes(LAYOUT)
CLIENTS = 3


@dataclass
class MReg:
    slot: int
    epoch: int            # which connection of the slot registered it
    reg_id: int
    gen: int
    alloc: int
    buf: HostBuffer
    ref: object             # the RegRef the service handed out
    state: str = "active"   # active | closed | superseded | released


@dataclass
class MClient:
    conn: object
    epoch: int
    allocs: dict[int, int] = field(default_factory=dict)   # alloc id -> latest generation
    contents: dict[int, bytes] = field(default_factory=dict)   # reg id -> what its buffer holds


class _Service:
    """The run's service and counts (hypothesis builds a machine per sequence, with no arguments)."""

    sp: Any = None
    runs = 0
    nonce = b""
    outcomes: Counter = Counter()   # "rule:outcome" over every step of every sequence


class OwnershipMachine(RuleBasedStateMachine):
    regs = Bundle("regs")

    def __init__(self) -> None:
        super().__init__()
        _Service.runs += 1
        self.run = _Service.runs
        self.sp = _Service.sp
        self.admin = self.sp.admin_client(name=f"fuzz-admin-{self.run}")
        self.clients = [self._connect(i, 0) for i in range(CLIENTS)]
        self.objects: dict[bytes, bytes] = {}
        self.retained: dict[str, set[bytes]] = {}
        self.all_regs: list[MReg] = []
        self.next_key = 0
        self.buffers: list[HostBuffer] = []

    def _connect(self, slot: int, epoch: int) -> MClient:
        return MClient(self.sp.client(name=f"fuzz-{self.run}-{slot}-{epoch}"), epoch)

    def teardown(self) -> None:
        for c in self.clients:
            c.conn.close_connection()
        for group in list(self.retained):
            self.admin.unretain(group)
        self.admin.close_connection()
        for b in self.buffers:
            b.close()

    # -- helpers -------------------------------------------------------------------------------------------
    def _key(self) -> bytes:
        self.next_key += 1
        return b"fz-%s-%d-%d" % (_Service.nonce, self.run, self.next_key)   # unique across runs on one service

    def _expect(self, what: str, want: type[ServiceError] | None, call):
        _Service.outcomes[f"{what}:{'accepted' if want is None else want.__name__}"] += 1
        if want is None:
            try:
                return call()
            except ServiceError as e:
                raise FuzzDivergence(f"{what}: the model says accepted, "
                                     f"the service raised {type(e).__name__}: {e}") from e
        expect_error(want, call, what)
        return None

    def _refusal(self, slot: int, r: MReg) -> type[ServiceError] | None:
        """What a save/load through registration r, sent by client `slot`, must end in (None: accepted)."""
        c = self.clients[slot]
        if r.slot != slot or r.epoch != c.epoch:
            return NotOwnerError
        return None if r.state == "active" else RegistrationClosedError

    # -- rules ---------------------------------------------------------------------------------------------
    @precondition(lambda self: len([r for r in self.all_regs if r.state == "active"]) < 12)
    @rule(target=regs, slot=st.integers(0, CLIENTS - 1), replace=st.booleans(), fill=st.integers(0, 1 << 20))
    def register(self, slot, replace, fill):
        c = self.clients[slot]
        if replace and c.allocs:
            alloc = sorted(c.allocs)[fill % len(c.allocs)]
        else:
            alloc = len(c.allocs) + 1
        gen = c.allocs.get(alloc, 0) + 1
        buf = HostBuffer(N, name="kmesh-fuzz")
        self.buffers.append(buf)
        data = pattern(fill, N)
        buf.write(0, data)
        ref = c.conn.register_host(buf, alloc_id=alloc, generation=gen, layout=LAYOUT)
        for old in self.all_regs:   # the older generations of this allocation take no new work
            if old.slot == slot and old.epoch == c.epoch and old.alloc == alloc and old.state == "active":
                old.state = "superseded"
        c.allocs[alloc] = gen
        _Service.outcomes["register:accepted" if gen == 1 else "register:replaced"] += 1
        r = MReg(slot, c.epoch, ref.reg, ref.gen, alloc, buf, ref)
        c.contents[r.reg_id] = data
        self.all_regs.append(r)
        return r

    @precondition(lambda self: any(c.allocs for c in self.clients))
    @rule(slot=st.integers(0, CLIENTS - 1), go=st.sampled_from([False, False, True]))
    def register_stale_generation(self, slot, go):
        c = self.clients[slot]
        if not go:    # a rule without a bundle argument is drawn far more often than one with: thin it out
            return
        if not c.allocs:
            return
        alloc = sorted(c.allocs)[0]
        buf = HostBuffer(N, name="kmesh-fuzz")
        self.buffers.append(buf)
        self._expect("register", StaleGenerationError,
                     lambda: c.conn.register_host(buf, alloc_id=alloc, generation=c.allocs[alloc], layout=LAYOUT))

    def _sender(self, r: MReg, other: int) -> int:
        """Mostly the registration's owner (other == 0), else another client: both sides of the rules get steps."""
        return r.slot if other == 0 else (r.slot + other) % CLIENTS

    @rule(r=regs, other=st.sampled_from([0, 0, 0, 1, 2]), fresh=st.booleans(), pick=st.integers(0, 1 << 20))
    def save(self, r, other, fresh, pick):
        slot = self._sender(r, other)
        key = self._key() if fresh or not self.objects else sorted(self.objects)[pick % len(self.objects)]
        ref = self._ref(r)
        c = self.clients[slot]
        want = self._refusal(slot, r) or (ObjectExistsError if key in self.objects else None)
        req = self._expect("save", want, lambda: c.conn.save(ref, key, 0, N))
        if req is not None:
            state = c.conn.wait(req, timeout=30)["state"]
            if state != "done":
                raise FuzzDivergence(f"save of {key!r} ended {state}")
            self.objects[key] = c.contents[r.reg_id]

    @rule(r=regs, other=st.sampled_from([0, 0, 0, 1, 2]), present=st.sampled_from([True, True, False]),
          pick=st.integers(0, 1 << 20))
    def load(self, r, other, present, pick):
        slot = self._sender(r, other)
        key = sorted(self.objects)[pick % len(self.objects)] if present and self.objects else self._key()
        ref = self._ref(r)
        c = self.clients[slot]
        want = self._refusal(slot, r) or (None if key in self.objects else ObjectMissingError)
        req = self._expect("load", want, lambda: c.conn.load(ref, key, 0))
        if req is not None:
            state = c.conn.wait(req, timeout=30)["state"]
            if state != "done":
                raise FuzzDivergence(f"load of {key!r} ended {state}")
            got = r.buf.read(0, N)
            if got != self.objects[key]:
                raise FuzzDivergence(f"load of {key!r}: other bytes than the object holds")
            c.contents[r.reg_id] = got

    @rule(r=regs, other=st.sampled_from([0, 0, 1, 2]))
    def close(self, r, other):
        slot = self._sender(r, other)
        c = self.clients[slot]
        ref = self._ref(r)
        if r.slot != slot or r.epoch != c.epoch:
            self._expect("close", NotOwnerError, lambda: c.conn.close(ref))
        elif r.state == "active":
            self._expect("close", None, lambda: c.conn.close(ref))
            r.state = "closed"
        else:   # already closing or released: either way it takes no work, and a close may not revive it
            try:
                c.conn.close(ref)
            except RegistrationClosedError:
                pass   # released already: refused as closed, and it stays so

    @rule(r=regs, other=st.sampled_from([0, 0, 1]), go=st.sampled_from([False, True]))
    def stale_generation_use(self, r, other, go):
        """The right registration id with another generation."""
        if not go:
            return
        slot = self._sender(r, other)
        c = self.clients[slot]
        bad = dataclasses.replace(r.ref, gen=r.gen + 1)
        if r.slot != slot or r.epoch != c.epoch:
            want = NotOwnerError
        elif r.state in ("active", "closed", "superseded"):
            want = (StaleGenerationError, RegistrationClosedError)   # closed/superseded may be released already
        else:
            want = RegistrationClosedError
        _Service.outcomes[f"stale-use:{r.state}"] += 1
        expect_error(want, lambda: c.conn.load(bad, self._key(), 0), "stale-use")

    @rule(slot=st.integers(0, CLIENTS - 1), go=st.sampled_from([False, False, False, False, True]))
    def disconnect(self, slot, go):
        if not go:   # a rule without a bundle argument is drawn far more often than one with: thin it out
            return
        c = self.clients[slot]
        _Service.outcomes["disconnect"] += 1
        c.conn.close_connection()
        for r in self.all_regs:
            if r.slot == slot and r.epoch == c.epoch:
                r.state = "released"
        self.clients[slot] = self._connect(slot, c.epoch + 1)

    @precondition(lambda self: self.objects)
    @rule(group=st.sampled_from(["g1", "g2"]), pick=st.integers(0, 1 << 20),
          present=st.sampled_from([True, True, False]))
    def retain(self, group, pick, present):
        key = sorted(self.objects)[pick % len(self.objects)] if present and self.objects else self._key()
        if key in self.objects:
            self._expect("retain", None, lambda: self.admin.retain(group, key))
            self.retained.setdefault(group, set()).add(key)
        else:
            self._expect("retain", ObjectMissingError, lambda: self.admin.retain(group, key))

    @precondition(lambda self: self.retained)
    @rule(group=st.sampled_from(["g1", "g2"]))
    def unretain(self, group):
        self.admin.unretain(group)
        self.retained.pop(group, None)

    @precondition(lambda self: self.objects)
    @rule(pick=st.integers(0, 1 << 20), present=st.sampled_from([True, True, False]))
    def evict(self, pick, present):
        held = sorted(k for keys in self.retained.values() for k in keys if k in self.objects)
        if held and pick % 2:   # half the time a retained key, so "kept" is reached as often as "evicted"
            key = held[pick // 2 % len(held)]
        else:
            key = sorted(self.objects)[pick % len(self.objects)] if present and self.objects else self._key()
        if key not in self.objects:
            self._expect("evict", ObjectMissingError, lambda: self.admin.evict(key))
            return
        out = self.admin.evict(key)
        held = any(key in keys for keys in self.retained.values())
        _Service.outcomes["evict:kept-retained" if held else "evict:evicted"] += 1
        if (out["evicted"], bool(out["kept"])) != ((0, True) if held else (1, False)):
            raise FuzzDivergence(f"evict of {key!r} ({'retained' if held else 'not retained'}) answered {out}")
        if not held:
            del self.objects[key]

    @staticmethod
    def _ref(r: MReg):
        return r.ref

    # -- after every step ----------------------------------------------------------------------------------
    @invariant()
    def registrations_are_the_models(self):
        for slot, c in enumerate(self.clients):
            listed = {x["reg"] for x in c.conn.status("self")["registrations"] if x["state"] == "active"}
            want = {r.reg_id for r in self.all_regs if r.slot == slot and r.epoch == c.epoch and r.state == "active"}
            if listed != want:
                raise FuzzDivergence(f"client {slot} is listed with active registrations {sorted(listed)}, "
                                     f"the model says {sorted(want)}")



# every kind of outcome the rules name, reached at least once by a run of the CI size (else the fuzz proves little)
MUST_REACH = {"register:accepted", "register:replaced", "register:StaleGenerationError", "save:accepted",
              "save:NotOwnerError", "save:RegistrationClosedError", "save:ObjectExistsError", "load:accepted",
              "load:NotOwnerError", "load:RegistrationClosedError", "load:ObjectMissingError", "close:accepted",
              "close:NotOwnerError", "stale-use:active", "disconnect", "retain:accepted", "evict:evicted",
              "evict:kept-retained", "evict:ObjectMissingError"}


def steps_of(counts: dict[str, int]) -> int:
    """Requests made: every counted outcome but the batch count."""
    return sum(v for k, v in counts.items() if k != "batches")


def run_fuzz(service: Any, examples: int = 40, steps: int = 50, shrink: bool = True, seed: int = 0,
             max_batches: int = 4, min_steps: int = 0,
             on_batch: Callable[[dict[str, Any]], None] | None = None) -> dict[str, int]:
    """Batches of `examples` sequences of up to `steps` steps against a running service (kmesh.service.process):
    at least until `min_steps` requests were made, then until every outcome kind of MUST_REACH was reached or
    `max_batches` batches ran (the caller checks MUST_REACH). Returns the count of every "rule:outcome". Batch b is
    derandomized from `seed + b` (the same seed, the same sequences). After each batch `on_batch` gets {"batch",
    "steps", "total_steps", "seconds"}: a long run's progress, and its rate batch by batch (does the service slow as
    connections come and go?). Raises FuzzDivergence on the first divergence, shrunk to a minimal sequence by
    hypothesis unless shrink=False (a control that only needs to see the divergence)."""
    _Service.sp, _Service.runs, _Service.nonce = service, 0, secrets.token_hex(4).encode()
    _Service.outcomes.clear()
    phases = tuple(Phase) if shrink else (Phase.generate,)
    batch = 0
    while True:
        before, t0 = steps_of(_Service.outcomes), time.monotonic()
        # hypothesis derives a derandomized run's seed from the machine; a class per seed makes the seed ours
        machine = type(f"OwnershipMachineSeed{seed + batch}", (OwnershipMachine,), {})
        run_state_machine_as_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
            suppress_health_check=list(HealthCheck), database=None, phases=phases))
        batch += 1
        _Service.outcomes["batches"] = batch
        total = steps_of(_Service.outcomes)
        if on_batch is not None:
            on_batch({"batch": batch, "steps": total - before, "total_steps": total,
                      "seconds": time.monotonic() - t0})
        reached = not MUST_REACH - set(_Service.outcomes)
        if total >= min_steps and (reached or batch >= max_batches):
            break
        if total == before:   # a batch that made no request would loop for ever
            raise FuzzDivergence(f"batch {batch} made no request")
    return dict(_Service.outcomes)


def outcomes_so_far() -> dict[str, int]:
    """The counts of the last run_fuzz, also when it raised."""
    return dict(_Service.outcomes)
