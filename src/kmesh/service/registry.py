"""Clients and their registrations, and THE lifecycle state machine of a registration.

    registered --activate--> active --close--> closing --last copy drained--> drained --unmapped--> released
         \\______________________close_______________/

A registration is (client, allocation id, generation) and gets a service-wide id that is never reused.
Every state change goes through Registry._move(), which refuses transitions not in NEXT; nothing else in the
service assigns `state`. Rules the transitions enforce:
  - closing accepts no new work, but copies accepted before go on (`in_flight`);
  - client death (pidfd), disconnect, heartbeat loss, supersession and shutdown all lead to closing, never
    straight to released; release happens only from drained, and only once the memory could be unmapped
    (the unmap callback refuses while any view or transfer hold remains: the registration stays drained and
    is retried);
  - an instance number names at most one live client: a claim on a live client's instance is refused
    (InstanceInUseError) unless it is a takeover (admin); a client may also be anonymous (no instance). The
    newcomer is always a new client (new id, new token): a taken-over client is lost (its registrations close
    and drain) and its registrations stay unreachable, never transferred.
"""
from __future__ import annotations

import enum
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from kmesh.service.errors import (CapacityError, ClientLostError, InstanceInUseError, InternalError, NotOwnerError,
                                  RegistrationClosedError, RegistrationStateError, StaleGenerationError,
                                  UnknownRegistrationError)
from kmesh.service.identity import Peer
from kmesh.service.protocol import clip

IN_FLIGHT_LISTED = 64  # copy ids a listed registration names (all are counted): keeps the item bounded


class State(str, enum.Enum):
    REGISTERED = "registered"
    ACTIVE = "active"
    CLOSING = "closing"
    DRAINED = "drained"
    RELEASED = "released"


NEXT: dict[State, tuple[State, ...]] = {
    State.REGISTERED: (State.ACTIVE, State.CLOSING),
    State.ACTIVE: (State.CLOSING,),
    State.CLOSING: (State.DRAINED,),
    State.DRAINED: (State.RELEASED,),
    State.RELEASED: (),
}


@dataclass(eq=False)
class Registration:
    reg_id: int
    client_id: int
    alloc_id: int
    generation: int
    kind: str                 # "memfd" | "cuda_ipc"
    nbytes: int
    layout: dict[str, Any]
    layout_digest: bytes
    geometry: bytes
    handle: Any               # what the client sent: an fd (memfd) or the CUDA handle dict
    memory: Any = None        # MappedMemfd | MappedCuda while active/closing/drained
    state: State = State.REGISTERED
    reason: str | None = None  # why it left active
    in_flight: set[int] = field(default_factory=set)  # accepted copy requests not yet drained
    history: list[tuple[str, str, float]] = field(default_factory=list)
    _itemsize: int = 0        # the layout's element size, once asked (every load and save checks it)

    def itemsize(self) -> int:
        """The layout's element size (read from `layout` once: it never changes)."""
        if not self._itemsize:
            from kmesh.service import descriptor

            self._itemsize = descriptor.itemsize(self.layout)
        return self._itemsize

    def describe(self) -> dict[str, Any]:
        return {"reg": self.reg_id, "client": self.client_id, "alloc_id": self.alloc_id, "gen": self.generation,
                "kind": self.kind, "nbytes": self.nbytes, "state": self.state.value, "reason": clip(self.reason),
                "in_flight": sorted(self.in_flight)[:IN_FLIGHT_LISTED], "in_flight_count": len(self.in_flight),
                "mapped": self.memory is not None, "history": [[h[0], clip(h[1])] for h in self.history]}


@dataclass(eq=False)
class Client:
    client_id: int
    instance: int | None  # None: anonymous
    name: str
    peer: Peer
    token: bytes
    conn_id: int | None
    last_seen: float
    live: bool = True
    lost_reason: str | None = None
    regs: set[int] = field(default_factory=set)
    # copies this client's requests completed ("done": every byte in place), counted by the service itself: what a
    # client's own report of what it loaded or saved is cross-checked against
    copies_done: dict[str, int] = field(default_factory=lambda: {"loads": 0, "load_bytes": 0, "saves": 0,
                                                                 "save_bytes": 0})

    def count_copy(self, kind: str, nbytes: int) -> None:
        """One completed copy of `kind` ("load" or "save") of `nbytes` bytes."""
        self.copies_done[f"{kind}s"] += 1
        self.copies_done[f"{kind}_bytes"] += nbytes

    def describe(self) -> dict[str, Any]:
        return {"client": self.client_id, "instance": self.instance, "name": self.name, "pid": self.peer.pid,
                "uid": self.peer.uid, "live": self.live, "lost_reason": clip(self.lost_reason),
                "connected": self.conn_id is not None, "regs": sorted(self.regs), "copies_done": dict(self.copies_done)}


@dataclass(frozen=True)
class Tombstone:
    """What stays of a released registration: enough to answer 'released' / 'not yours' and to show the
    path it took."""

    reg_id: int
    client_id: int
    alloc_id: int
    generation: int
    reason: str | None
    history: tuple[tuple[str, str], ...]
    seq: int = 0  # order of release: the cursor of `list released`

    def describe(self) -> dict[str, Any]:
        return {"reg": self.reg_id, "client": self.client_id, "alloc_id": self.alloc_id, "gen": self.generation,
                "state": State.RELEASED.value, "reason": clip(self.reason), "in_flight": [], "in_flight_count": 0,
                "mapped": False,
                "history": [[h[0], clip(h[1])] for h in self.history]}


Unmap = Callable[[Registration], None]  # releases reg.memory / reg.handle; raises while still in use


class Registry:
    def __init__(self, unmap: Unmap, max_regs_per_client: int = 64, max_regs: int = 4096,
                 max_tombstones: int = 16384, ignore_in_flight: bool = False) -> None:
        self._unmap = unmap
        # Fault injection for negative controls only: treat closing as drained although copies run (the
        # "no in-flight accounting on unregister" flaw); the stage's checks must catch it.
        self.ignore_in_flight = ignore_in_flight
        self.max_regs_per_client, self.max_regs, self.max_tombstones = max_regs_per_client, max_regs, max_tombstones
        self.clients: dict[int, Client] = {}
        self.regs: dict[int, Registration] = {}
        self.tombstones: OrderedDict[int, Tombstone] = OrderedDict()
        # the same tombstones by client: a client's own status and lists cost what it holds, not the service's whole
        # history (a long fuzz measured 309 -> 10 requests/s as 16,384 tombstones were scanned per status)
        self._tombs_of: dict[int, OrderedDict[int, Tombstone]] = {}
        self._latest_gen: dict[tuple[int, int], int] = {}
        self._client_ids = itertools.count(1)
        self._reg_ids = itertools.count(1)
        self._tomb_seq = itertools.count(1)
        self.counters = {"registered": 0, "released": 0, "release_deferred": 0, "taken_over_clients": 0,
                         "instance_refusals": 0}

    # -- clients ------------------------------------------------------------------------------------
    def holder(self, instance: int) -> Client | None:
        """The live client that holds this instance number, if any."""
        return next((c for c in self.clients.values() if c.live and c.instance == instance), None)

    def add_client(self, instance: int | None, name: str, peer: Peer, token: bytes, conn_id: int, now: float,
                   takeover: bool = False) -> Client:
        """A new client. instance None: anonymous. A live client's instance is refused (InstanceInUseError)
        unless takeover (the caller checked the admin capability): then the old client is lost, its
        registrations close and drain, and it stays a different client with its own registrations."""
        old = self.holder(instance) if instance is not None else None
        if old is not None and not takeover:
            self.counters["instance_refusals"] += 1
            raise InstanceInUseError(f"instance {instance} is held by live client {old.client_id} (pid "
                                     f"{old.peer.pid}); connect without an instance, or take over as admin")
        c = Client(next(self._client_ids), instance, name, peer, token, conn_id, now)
        if old is not None:
            self.counters["taken_over_clients"] += 1
            self.lose_client(old, f"taken over by client {c.client_id}")
        self.clients[c.client_id] = c
        return c

    def lose_client(self, c: Client, reason: str) -> None:
        """Client dead / disconnected / silent / taken over: it does no more work; its registrations close
        (accepted copies go on) and are released once drained."""
        if c.live:
            c.live, c.lost_reason = False, reason
        for reg_id in sorted(c.regs):
            self.close(self.regs[reg_id], reason)
        self._forget_if_done(c)

    def detach_connection(self, c: Client) -> None:
        c.conn_id = None
        self.lose_client(c, c.lost_reason or "disconnect")

    def require_live(self, c: Client) -> None:
        if not c.live:
            raise ClientLostError(f"client {c.client_id} was declared lost ({c.lost_reason}); reconnect")

    def _forget_if_done(self, c: Client) -> None:
        if not c.live and not c.regs and c.conn_id is None:
            self.clients.pop(c.client_id, None)
            for key in [k for k in self._latest_gen if k[0] == c.client_id]:
                del self._latest_gen[key]

    # -- registrations ------------------------------------------------------------------------------
    def register(self, c: Client, alloc_id: int, generation: int, kind: str, nbytes: int, layout: dict[str, Any],
                 layout_digest: bytes, geometry: bytes, handle: Any) -> Registration:
        self.require_live(c)
        latest = self._latest_gen.get((c.client_id, alloc_id), 0)
        if generation <= latest:
            raise StaleGenerationError(f"alloc {alloc_id:#x}: generation {generation} does not advance past "
                                       f"{latest}; a new allocation needs a new generation")
        if len(c.regs) >= self.max_regs_per_client or len(self.regs) >= self.max_regs:
            raise CapacityError(f"registration limit reached ({len(c.regs)} for this client, "
                                f"{len(self.regs)} in all)")
        reg = Registration(next(self._reg_ids), c.client_id, alloc_id, generation, kind, nbytes, layout,
                           layout_digest, geometry, handle)
        reg.history.append((State.REGISTERED.value, "register", time.monotonic()))
        # The older generations of this allocation id stop taking work now; their copies still drain.
        for old_id in sorted(c.regs):
            old = self.regs[old_id]
            if old.alloc_id == alloc_id:
                self.close(old, f"superseded by generation {generation}")
        self._latest_gen[(c.client_id, alloc_id)] = generation
        self.regs[reg.reg_id] = reg
        c.regs.add(reg.reg_id)
        self.counters["registered"] += 1
        return reg

    def resolve(self, c: Client, reg_id: int, generation: int) -> Registration:
        """The caller's registration reg_id of exactly this generation, in any state but released."""
        reg = self.regs.get(reg_id)
        if reg is None:
            tomb = self.tombstones.get(reg_id)
            if tomb is None:
                raise UnknownRegistrationError(f"no registration {reg_id}")
            if tomb.client_id != c.client_id:
                raise NotOwnerError(f"registration {reg_id} belongs to another client")
            raise RegistrationClosedError(f"registration {reg_id} was released ({tomb.reason})")
        if reg.client_id != c.client_id:
            raise NotOwnerError(f"registration {reg_id} belongs to another client")
        if reg.generation != generation:
            raise StaleGenerationError(f"registration {reg_id} is generation {reg.generation}, request names "
                                       f"{generation}")
        return reg

    @staticmethod
    def require_active(reg: Registration) -> None:
        if reg.state is State.REGISTERED:
            raise RegistrationStateError(f"registration {reg.reg_id} is not activated yet")
        if reg.state is not State.ACTIVE:
            raise RegistrationClosedError(f"registration {reg.reg_id} is {reg.state.value} ({reg.reason}): "
                                          f"no new work")

    def activate(self, reg: Registration, memory: Any) -> None:
        if reg.state is not State.REGISTERED:
            raise RegistrationStateError(f"registration {reg.reg_id} is {reg.state.value}, not registered")
        reg.memory = memory
        self._move(reg, State.ACTIVE, "activate")

    def close(self, reg: Registration, reason: str) -> State:
        """Stop new work; release once drained. Idempotent (a second close keeps the first reason)."""
        if reg.state in (State.REGISTERED, State.ACTIVE):
            reg.reason = reason
            self._move(reg, State.CLOSING, reason)
            self.settle(reg)
        return reg.state

    # -- in-flight accounting -------------------------------------------------------------------------
    def begin_work(self, reg: Registration, req_id: int) -> None:
        self.require_active(reg)
        reg.in_flight.add(req_id)

    def end_work(self, reg: Registration, req_id: int) -> None:
        reg.in_flight.discard(req_id)
        self.settle(reg)

    def settle(self, reg: Registration) -> None:
        """Advance closing -> drained -> released as far as the facts allow."""
        if reg.state is State.CLOSING and (not reg.in_flight or self.ignore_in_flight):
            self._move(reg, State.DRAINED, "no copies in flight")
        if reg.state is State.DRAINED:
            try:
                self._unmap(reg)
            except Exception as e:  # still referenced (views/holds): stay drained, retry on a later tick
                self.counters["release_deferred"] += 1
                if reg.history[-1][0] != "release-deferred":
                    reg.history.append(("release-deferred", f"{type(e).__name__}: {e}"[:200], time.monotonic()))
                return
            reg.memory = reg.handle = None
            self._move(reg, State.RELEASED, "unmapped")
            self._bury(reg)

    def settle_all(self) -> None:
        for reg in [r for r in self.regs.values() if r.state is State.DRAINED]:
            self.settle(reg)

    def _bury(self, reg: Registration) -> None:
        del self.regs[reg.reg_id]
        tomb = Tombstone(reg.reg_id, reg.client_id, reg.alloc_id, reg.generation, reg.reason,
                         tuple((h[0], h[1]) for h in reg.history), next(self._tomb_seq))
        self.tombstones[reg.reg_id] = tomb
        self._tombs_of.setdefault(reg.client_id, OrderedDict())[reg.reg_id] = tomb
        while len(self.tombstones) > self.max_tombstones:
            old_id, old = self.tombstones.popitem(last=False)
            mine = self._tombs_of.get(old.client_id)
            if mine is not None:
                mine.pop(old_id, None)
                if not mine:
                    del self._tombs_of[old.client_id]
        self.counters["released"] += 1
        c = self.clients.get(reg.client_id)
        if c is not None:
            c.regs.discard(reg.reg_id)
            self._forget_if_done(c)

    def _move(self, reg: Registration, new: State, why: str) -> None:
        if new not in NEXT[reg.state]:
            raise InternalError(f"registration {reg.reg_id}: illegal transition {reg.state.value} -> {new.value}")
        reg.state = new
        reg.history.append((new.value, why, time.monotonic()))

    # -- views --------------------------------------------------------------------------------------------
    def summary(self, client_id: int | None = None) -> dict[str, Any]:
        """Counts by state and counters, for one client or all (bounded: the items are listed page by page)."""
        by_state = {s.value: 0 for s in State if s is not State.RELEASED}
        for r in self.regs_of(client_id):
            by_state[r.state.value] += 1
        if client_id is None:
            mine, released = list(self.clients.values()), len(self.tombstones)
        else:
            one = self.clients.get(client_id)
            mine, released = ([one] if one is not None else []), len(self._tombs_of.get(client_id, ()))
        return {"by_state": by_state, "counters": dict(self.counters),
                "counts": {"clients": len(mine), "clients_live": sum(c.live for c in mine),
                           "registrations": sum(by_state.values()), "released": released}}

    def regs_of(self, client_id: int | None) -> list[Registration]:
        """One client's live registrations (None: everyone's), from its own index."""
        if client_id is None:
            return list(self.regs.values())
        c = self.clients.get(client_id)
        return [self.regs[r] for r in sorted(c.regs) if r in self.regs] if c is not None else []

    def tombstones_of(self, client_id: int | None) -> list[Tombstone]:
        """Released registrations kept (bury order), one client's or everyone's."""
        if client_id is None:
            return list(self.tombstones.values())
        return list(self._tombs_of.get(client_id, {}).values())

    def violations(self) -> list[str]:
        """Invariants that must hold between any two events (checked by status and by tests)."""
        out = []
        for r in self.regs.values():
            if r.state is State.RELEASED:
                out.append(f"reg {r.reg_id}: released but still listed")
            if r.in_flight and r.state not in (State.ACTIVE, State.CLOSING):
                out.append(f"reg {r.reg_id}: copies in flight while {r.state.value}")
            if (r.memory is None) != (r.state is State.REGISTERED):
                out.append(f"reg {r.reg_id}: mapped={r.memory is not None} in state {r.state.value}")
            c = self.clients.get(r.client_id)
            if c is None or r.reg_id not in c.regs:
                out.append(f"reg {r.reg_id}: owner {r.client_id} does not list it")
            if c is not None and not c.live and r.state in (State.REGISTERED, State.ACTIVE):
                out.append(f"reg {r.reg_id}: client {c.client_id} lost but registration still {r.state.value}")
        return out
