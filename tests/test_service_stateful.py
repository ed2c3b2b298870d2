"""Stateful protocol fuzz (issue 26 item 2): sequences of VALID requests in orders nobody wrote down, from several
clients of one real service process, each reply checked against a plain-Python model of the ownership rules.

The model (no KMesh code): which client owns which registration, its generation, whether it may take work (active)
or not (closed by its client, superseded by a newer generation of its allocation, released when its client
disconnected), which objects the store holds with which bytes, which keys a retention group holds. Every step's
outcome must be the one the model predicts — success with the right bytes, or exactly the error type the ownership
rules name (NotOwnerError for another client's registration, live or released; RegistrationClosedError for one's
own that takes no work; StaleGenerationError; ObjectExistsError; ObjectMissingError) — and after every step the
service still answers. Hypothesis shrinks a divergence to a minimal sequence; a found one is kept below as a test.
CI: 25 sequences of up to 40 steps (fixed seed); KMESH_FUZZ_EXAMPLES / KMESH_FUZZ_STEPS give the long form.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kmesh.service import descriptor, process
from kmesh.service.errors import (NotOwnerError, ObjectExistsError, ObjectMissingError, RegistrationClosedError,
                                  ServiceError, StaleGenerationError)
from kmesh.service.handles import HostBuffer
from kmesh.service.worker import pattern

LAYOUT = descriptor.example(num_blocks=1)
N = descriptor.nbytes(LAYOUT)
CLIENTS = 3
EXAMPLES = int(os.environ.get("KMESH_FUZZ_EXAMPLES", "25"))
STEPS = int(os.environ.get("KMESH_FUZZ_STEPS", "40"))


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
    sp = None
    runs = 0
    outcomes: Counter = Counter()   # "rule:outcome" over every step of every sequence


@pytest.fixture(scope="module", autouse=True)
def service(tmp_path_factory):
    sp = process.start(Path(tmp_path_factory.mktemp("fuzz")) / "rt", store_bytes=512 * N, heartbeat_timeout_s=60.0)
    _Service.sp = sp
    yield sp
    sp.stop()


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
        return b"fz-%d-%d" % (self.run, self.next_key)

    def _expect(self, what: str, want: type[ServiceError] | None, call):
        _Service.outcomes[f"{what}:{'accepted' if want is None else want.__name__}"] += 1
        if want is None:
            return call()
        with pytest.raises(want):
            call()
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
    @rule(slot=st.integers(0, CLIENTS - 1))
    def register_stale_generation(self, slot):
        c = self.clients[slot]
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
            assert c.conn.wait(req, timeout=30)["state"] == "done"
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
            assert c.conn.wait(req, timeout=30)["state"] == "done"
            got = r.buf.read(0, N)
            assert got == self.objects[key], "a load delivered other bytes than the object holds"
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
                pass

    @rule(r=regs, other=st.sampled_from([0, 0, 1]))
    def stale_generation_use(self, r, other):
        """The right registration id with another generation."""
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
        with pytest.raises(want):
            c.conn.load(bad, self._key(), 0)

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
        key = sorted(self.objects)[pick % len(self.objects)] if present and self.objects else self._key()
        if key not in self.objects:
            self._expect("evict", ObjectMissingError, lambda: self.admin.evict(key))
            return
        out = self.admin.evict(key)
        held = any(key in keys for keys in self.retained.values())
        _Service.outcomes["evict:kept-retained" if held else "evict:evicted"] += 1
        assert (out["evicted"], bool(out["kept"])) == ((0, True) if held else (1, False)), out
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
            assert listed == want, (slot, listed, want)


# every kind of outcome the rules name, reached at least once by the CI form (else the fuzz proves little)
MUST_REACH = {"register:accepted", "register:replaced", "register:StaleGenerationError", "save:accepted",
              "save:NotOwnerError", "save:RegistrationClosedError", "save:ObjectExistsError", "load:accepted",
              "load:NotOwnerError", "load:RegistrationClosedError", "load:ObjectMissingError", "close:accepted",
              "close:NotOwnerError", "stale-use:active", "disconnect", "retain:accepted", "evict:evicted",
              "evict:kept-retained", "evict:ObjectMissingError"}


@pytest.mark.timeout(900)
def test_valid_request_sequences_follow_the_ownership_model():
    _Service.outcomes.clear()
    run_state_machine_as_test(OwnershipMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    steps = sum(_Service.outcomes.values())
    print(f"fuzz: {EXAMPLES} sequences, {steps} checked steps: {dict(sorted(_Service.outcomes.items()))}")
    assert not MUST_REACH - set(_Service.outcomes), f"never reached: {sorted(MUST_REACH - set(_Service.outcomes))}"
    assert _Service.sp.alive()
