"""Registry in process: generations, instance claims, the drain / release lifecycle, tombstones, violations.

No sockets: a fake unmap callback (which can be told to refuse, like a mapping whose views are still alive)
stands in for the server's. The service tests run the same Registry in a subprocess, where mutation testing
cannot see it; these tests pin its rules directly.
"""
from __future__ import annotations

from typing import Any

import pytest

from kmesh.service.errors import (CapacityError, InstanceInUseError, NotOwnerError, RegistrationClosedError,
                                  StaleGenerationError, UnknownRegistrationError)
from kmesh.service.identity import Peer
from kmesh.service.protocol import clip
from kmesh.service.registry import IN_FLIGHT_LISTED, Client, Registration, Registry, State

TOKEN = b"t" * 32
ALLOC = 0x7F00_0000_1000


class FakeUnmap:
    """The unmap callback: records what it released; while `refuse` is set it raises (views / holds alive)."""

    def __init__(self) -> None:
        self.refuse: str | None = None
        self.released: list[tuple[int, Any, Any]] = []  # (reg id, memory, handle) as unmap saw them

    def __call__(self, reg: Registration) -> None:
        if self.refuse is not None:
            raise RuntimeError(self.refuse)
        self.released.append((reg.reg_id, reg.memory, reg.handle))


def make(**kw: Any) -> tuple[Registry, FakeUnmap]:
    unmap = FakeUnmap()
    return Registry(unmap, **kw), unmap


def peer(pid: int = 1) -> Peer:
    return Peer(pid, 1000, 1000, -1, "none")


def client(r: Registry, instance: int | None = 1, conn_id: int = 1, **kw: Any) -> Client:
    return r.add_client(instance, f"c{instance}", peer(conn_id), TOKEN, conn_id, 0.0, **kw)


def reg(r: Registry, c: Client, alloc: int = ALLOC, gen: int = 1, handle: Any = "fd") -> Registration:
    return r.register(c, alloc, gen, "memfd", 4096, {"L": 2}, b"digest", b"geometry", handle)


def active(r: Registry, c: Client, alloc: int = ALLOC, gen: int = 1) -> Registration:
    x = reg(r, c, alloc, gen)
    r.activate(x, object())
    return x


def path(history: Any) -> list[tuple[str, str]]:
    return [(h[0], h[1]) for h in history]


# -- register: fields, the latest-generation rule, supersession ----------------------------------------------
def test_register_keeps_exactly_what_the_client_sent() -> None:
    r, _ = make()
    c = client(r)
    x = r.register(c, ALLOC, 3, "cuda_ipc", 8192, {"L": 4}, b"dg", b"geo", {"h": 1})
    assert (x.client_id, x.alloc_id, x.generation, x.kind, x.nbytes) == (c.client_id, ALLOC, 3, "cuda_ipc", 8192)
    assert (x.layout, x.layout_digest, x.geometry, x.handle) == ({"L": 4}, b"dg", b"geo", {"h": 1})
    assert x.state is State.REGISTERED and x.memory is None and path(x.history) == [("registered", "register")]
    assert r.resolve(c, x.reg_id, 3) is x and r.regs[x.reg_id] is x and c.regs == {x.reg_id}


def test_generation_must_advance_per_client_and_allocation() -> None:
    r, _ = make()
    a, b = client(r, 1, 1), client(r, 2, 2)
    g5 = reg(r, a, gen=5)
    for stale in (1, 5):  # equal or lower: a new allocation needs a new generation
        with pytest.raises(StaleGenerationError, match="does not advance past 5"):
            reg(r, a, gen=stale)
    assert g5.state is State.REGISTERED  # a refused registration supersedes nothing
    reg(r, a, alloc=ALLOC + 4096, gen=1)  # another allocation id: its own sequence
    reg(r, b, gen=1)  # another client: its own namespace
    assert reg(r, a, gen=6).generation == 6


def test_a_new_generation_supersedes_every_older_one_of_that_allocation_only() -> None:
    r, unmap = make()
    c = client(r)
    g1 = active(r, c, gen=1)
    r.begin_work(g1, 11)  # a copy accepted before supersession
    other = active(r, c, alloc=ALLOC + 4096)
    g2 = reg(r, c, gen=2)  # registered, never activated
    assert g1.state is State.CLOSING and g1.reason == "superseded by generation 2"
    assert g2.state is State.REGISTERED and other.state is State.ACTIVE
    g3 = reg(r, c, gen=3)
    # g2 had no work and no mapping: closing -> drained -> released at once; g1 still drains its copy
    assert g2.reg_id not in r.regs and r.tombstones[g2.reg_id].reason == "superseded by generation 3"
    assert g1.state is State.CLOSING and g1.reason == "superseded by generation 2"  # first reason kept
    assert g3.state is State.REGISTERED and other.state is State.ACTIVE
    r.end_work(g1, 11)
    assert g1.state is State.RELEASED and [u[0] for u in unmap.released] == [g2.reg_id, g1.reg_id]
    assert c.regs == {other.reg_id, g3.reg_id} and r.violations() == []


def test_released_generations_still_count_as_seen() -> None:
    r, _ = make()
    c = client(r)
    g1 = reg(r, c, gen=1)
    r.close(g1, "closed by client")
    assert g1.state is State.RELEASED
    with pytest.raises(StaleGenerationError):
        reg(r, c, gen=1)


def test_resolve_checks_owner_then_generation_and_tombstones_answer_for_released() -> None:
    r, _ = make()
    a, b = client(r, 1, 1), client(r, 2, 2)
    x = reg(r, a, gen=2)
    with pytest.raises(NotOwnerError):
        r.resolve(b, x.reg_id, 2)
    with pytest.raises(StaleGenerationError, match="is generation 2, request names 1"):
        r.resolve(a, x.reg_id, 1)
    with pytest.raises(UnknownRegistrationError):
        r.resolve(a, x.reg_id + 100, 2)
    r.close(x, "closed by client")
    with pytest.raises(RegistrationClosedError, match=r"released \(closed by client\)"):
        r.resolve(a, x.reg_id, 2)
    with pytest.raises(NotOwnerError):
        r.resolve(b, x.reg_id, 2)


def test_capacity_per_client_and_in_all_counts_unreleased_registrations() -> None:
    r, _ = make(max_regs_per_client=2, max_regs=100)
    c = client(r)
    x, _y = reg(r, c, alloc=1), reg(r, c, alloc=2)
    with pytest.raises(CapacityError):  # the per-client limit alone refuses
        reg(r, c, alloc=3)
    r.close(x, "closed by client")  # released: its slot is free again
    reg(r, c, alloc=3)

    r, _ = make(max_regs_per_client=10, max_regs=2)
    a, b, d = client(r, 1, 1), client(r, 2, 2), client(r, 3, 3)
    reg(r, a)
    reg(r, b)
    with pytest.raises(CapacityError):  # the service-wide limit alone refuses
        reg(r, d)
    assert r.counters["registered"] == 2 and d.regs == set()


# -- the lifecycle: close, in-flight work, deferred release, tombstones ---------------------------------------
def test_full_lifecycle_path_and_tombstone() -> None:
    r, unmap = make()
    c = client(r)
    x = reg(r, c, gen=4, handle="fd-9")
    mem = object()
    r.activate(x, mem)
    r.begin_work(x, 1)
    r.begin_work(x, 2)
    assert r.close(x, "closed by client") is State.CLOSING and x.memory is mem
    r.end_work(x, 1)
    assert x.state is State.CLOSING and unmap.released == []  # copy 2 still runs: memory stays mapped
    r.end_work(x, 2)
    assert unmap.released == [(x.reg_id, mem, "fd-9")]  # unmap saw the mapping, then it is dropped
    assert x.state is State.RELEASED and x.memory is None and x.handle is None
    expected = [("registered", "register"), ("active", "activate"), ("closing", "closed by client"),
                ("drained", "no copies in flight"), ("released", "unmapped")]
    assert path(x.history) == expected
    assert x.reg_id not in r.regs and c.regs == set() and r.violations() == []
    t = r.tombstones[x.reg_id]
    assert (t.reg_id, t.client_id, t.alloc_id, t.generation, t.reason) == (
        x.reg_id, c.client_id, ALLOC, 4, "closed by client")
    assert list(t.history) == expected and isinstance(t.seq, int)


def test_release_waits_for_unmap_and_records_one_bounded_deferral() -> None:
    r, unmap = make()
    c = client(r)
    x = active(r, c)
    unmap.refuse = "views alive " + "x" * 300
    r.close(x, "closed by client")
    r.settle_all()
    r.settle(x)
    assert x.state is State.DRAINED and x.memory is not None and r.counters["release_deferred"] == 3
    deferrals = [h for h in x.history if h[0] == "release-deferred"]
    assert len(deferrals) == 1  # retried every tick: one note, not one per tick
    assert deferrals[0][1].startswith("RuntimeError: views alive") and len(deferrals[0][1]) == 200
    assert r.violations() == []
    unmap.refuse = None
    r.settle_all()
    assert x.state is State.RELEASED and [u[0] for u in unmap.released] == [x.reg_id]
    assert [h[0] for h in x.history][-3:] == ["drained", "release-deferred", "released"]
    assert r.counters["release_deferred"] == 3 and r.counters["released"] == 1


def test_settle_all_touches_only_drained_registrations() -> None:
    r, unmap = make()
    c = client(r)
    busy, idle = active(r, c, alloc=1), active(r, c, alloc=2)
    r.begin_work(busy, 1)
    unmap.refuse = "views alive"
    r.close(busy, "closed by client")
    r.close(idle, "closed by client")
    untouched = active(r, c, alloc=3)
    unmap.refuse = None
    r.settle_all()
    assert idle.state is State.RELEASED and busy.state is State.CLOSING and untouched.state is State.ACTIVE


def test_counters_count_each_event_once() -> None:
    r, unmap = make()
    assert r.counters == {"registered": 0, "released": 0, "release_deferred": 0, "taken_over_clients": 0,
                          "instance_refusals": 0}
    a = client(r, 7, 1)
    for alloc in (1, 2):
        r.close(reg(r, a, alloc=alloc), "closed by client")
    for _ in range(2):
        with pytest.raises(InstanceInUseError):
            client(r, 7, 2)
    client(r, 7, 3, takeover=True)
    client(r, 7, 4, takeover=True)
    unmap.refuse = "busy"
    b = client(r, 8, 5)
    r.close(active(r, b), "closed by client")
    assert r.counters == {"registered": 3, "released": 2, "release_deferred": 1, "taken_over_clients": 2,
                          "instance_refusals": 2}


def test_tombstones_are_bounded_oldest_first_in_release_order() -> None:
    r, _ = make(max_tombstones=2)
    c = client(r)
    xs = [reg(r, c, alloc=a) for a in (1, 2, 3)]
    for x in (xs[1], xs[0], xs[2]):  # release order differs from id order
        r.close(x, "closed by client")
    assert list(r.tombstones) == [xs[0].reg_id, xs[2].reg_id]  # the first released was dropped
    seqs = [t.seq for t in r.tombstones.values()]
    assert seqs == sorted(seqs) and len(set(seqs)) == 2 and all(isinstance(s, int) for s in seqs)
    with pytest.raises(UnknownRegistrationError):  # forgotten, not "released"
        r.resolve(c, xs[1].reg_id, 1)
    with pytest.raises(RegistrationClosedError):
        r.resolve(c, xs[2].reg_id, 1)


def test_ignore_in_flight_fault_drains_with_copies_running_and_violations_catch_it() -> None:
    r, unmap = make()
    c = client(r)
    x = active(r, c)
    r.begin_work(x, 1)
    r.close(x, "closed by client")
    assert x.state is State.CLOSING  # the real rule: copies in flight keep it closing

    r, unmap = make(ignore_in_flight=True)
    c = client(r)
    x = active(r, c)
    r.begin_work(x, 1)
    unmap.refuse = "busy"  # stop at drained so the bad state stays visible
    r.close(x, "closed by client")
    assert x.state is State.DRAINED
    assert r.violations() == [f"reg {x.reg_id}: copies in flight while drained"]


# -- clients: instance claims, takeover, loss, disconnect, forgetting -----------------------------------------
def test_add_client_keeps_name_and_token_and_anonymous_clients_never_collide() -> None:
    r, _ = make()
    c = r.add_client(3, "vllm-0", peer(42), b"s" * 32, 9, 5.0)
    assert (c.instance, c.name, c.peer.pid, c.token, c.conn_id, c.last_seen, c.live) == (
        3, "vllm-0", 42, b"s" * 32, 9, 5.0, True)
    anon = [r.add_client(None, "", peer(), TOKEN, 10 + i, 0.0) for i in range(2)]
    assert len({c.client_id, *(a.client_id for a in anon)}) == 3 and r.holder(3) is c
    assert r.counters["instance_refusals"] == 0


def test_takeover_loses_the_old_client_and_its_registrations_drain() -> None:
    r, _ = make()
    old = client(r, 7, 1)
    busy, idle = active(r, old, alloc=1), active(r, old, alloc=2)
    r.begin_work(busy, 1)
    with pytest.raises(InstanceInUseError):
        client(r, 7, 2)
    assert old.live and busy.state is State.ACTIVE
    new = client(r, 7, 2, takeover=True)
    assert r.holder(7) is new and not old.live and old.lost_reason == f"taken over by client {new.client_id}"
    assert busy.state is State.CLOSING and busy.reason == old.lost_reason and idle.state is State.RELEASED
    assert new.regs == set() and r.violations() == []
    r.lose_client(old, "client died")  # later news about the old client changes nothing
    assert old.lost_reason.startswith("taken over") and busy.reason == old.lost_reason
    r.end_work(busy, 1)
    assert busy.state is State.RELEASED and r.holder(7) is new


def test_a_lost_instance_can_be_claimed_without_takeover() -> None:
    r, _ = make()
    old = client(r, 7, 1)
    r.lose_client(old, "heartbeat lost")
    assert r.holder(7) is None
    assert client(r, 7, 2).client_id != old.client_id


def test_lost_client_registrations_close_with_the_loss_reason() -> None:
    r, _ = make()
    c = client(r)
    x = active(r, c)
    r.begin_work(x, 1)
    r.lose_client(c, "heartbeat lost")
    assert x.state is State.CLOSING and x.reason == "heartbeat lost" and c.lost_reason == "heartbeat lost"
    assert ("closing", "heartbeat lost") in path(x.history)
    with pytest.raises(RegistrationClosedError):
        r.begin_work(x, 2)
    assert r.violations() == []


def test_disconnect_names_the_reason_and_keeps_an_earlier_one() -> None:
    r, _ = make()
    c = client(r)
    x = active(r, c)
    r.begin_work(x, 1)  # keeps the client around after the disconnect
    r.detach_connection(c)
    assert c.conn_id is None and not c.live and c.lost_reason == "disconnect" and x.reason == "disconnect"

    d = client(r, 2, 2)
    y = active(r, d)
    r.begin_work(y, 1)
    r.lose_client(d, "client died")
    r.detach_connection(d)
    assert d.lost_reason == "client died" and y.reason == "client died"


def test_a_lost_client_is_forgotten_only_when_detached_and_all_its_registrations_released() -> None:
    r, _ = make()
    c = client(r, 1, 1)
    x = active(r, c)
    r.begin_work(x, 1)
    r.lose_client(c, "heartbeat lost")  # its connection is still attached
    assert r.clients.get(c.client_id) is c
    r.detach_connection(c)
    assert r.clients.get(c.client_id) is c  # a registration still drains: the owner stays listed
    assert r.violations() == []
    r.end_work(x, 1)
    assert c.client_id not in r.clients and r.violations() == []


def test_detaching_a_client_with_idle_registrations_releases_them_and_forgets_it() -> None:
    r, unmap = make()
    c = client(r)
    xs = [active(r, c, alloc=a) for a in (1, 2)]
    r.detach_connection(c)  # every close releases at once; the last release forgets the client
    assert [u[0] for u in unmap.released] == [x.reg_id for x in xs]
    assert c.client_id not in r.clients and r.tombstones[xs[0].reg_id].reason == "disconnect"


def test_forgetting_a_client_drops_only_its_generation_records() -> None:
    r, _ = make()
    a, b = client(r, 1, 1), client(r, 2, 2)
    r.close(reg(r, a, gen=3), "closed by client")
    r.close(reg(r, b, gen=3), "closed by client")
    r.detach_connection(a)
    assert a.client_id not in r.clients
    assert not any(k[0] == a.client_id for k in r._latest_gen)
    with pytest.raises(StaleGenerationError):  # b's latest generation survives a's departure
        reg(r, b, gen=3)


# -- violations: the invariant checker status reports ----------------------------------------------------------
def test_violations_name_each_broken_invariant() -> None:
    r, _ = make()
    assert r.violations() == []
    c = client(r)
    x, y, z = active(r, c, alloc=1), active(r, c, alloc=2), reg(r, c, alloc=3)
    assert r.violations() == []
    x.memory = None  # active but unmapped
    c.regs.discard(y.reg_id)  # the owner does not list it
    z.state = State.RELEASED  # released yet still listed (and unmapped, as released is)
    assert r.violations() == [f"reg {x.reg_id}: mapped=False in state active",
                              f"reg {y.reg_id}: owner {c.client_id} does not list it",
                              f"reg {z.reg_id}: released but still listed",
                              f"reg {z.reg_id}: mapped=False in state released"]
    r2, _ = make()
    d = client(r2)
    w = reg(r2, d)
    d.live = False  # lost without closing its registrations
    assert r2.violations() == [f"reg {w.reg_id}: client {d.client_id} lost but registration still registered"]
    w.state = State.CLOSING
    w.memory = object()
    assert r2.violations() == []  # closing is what a lost client's registration should be



# -- what status and list show: descriptions and the summary must tell the true state --------------------------
def test_descriptions_show_state_work_and_mapping_truthfully() -> None:
    r, unmap = make()
    c = r.add_client(5, "vllm-0", peer(42), TOKEN, 9, 0.0)
    x = active(r, c)
    for req in range(IN_FLIGHT_LISTED + 6, 0, -1):
        r.begin_work(x, req)
    r.close(x, "closed by client")
    d = x.describe()
    assert {k: d[k] for k in ("reg", "client", "alloc_id", "gen", "kind", "nbytes", "state", "reason", "mapped")} == {
        "reg": x.reg_id, "client": c.client_id, "alloc_id": ALLOC, "gen": 1, "kind": "memfd", "nbytes": 4096,
        "state": "closing", "reason": "closed by client", "mapped": True}
    assert d["in_flight"] == list(range(1, IN_FLIGHT_LISTED + 1)) and d["in_flight_count"] == IN_FLIGHT_LISTED + 6
    assert d["history"] == [["registered", "register"], ["active", "activate"], ["closing", "closed by client"]]
    assert reg(r, c, alloc=2).describe()["mapped"] is False
    assert c.describe() == {"client": c.client_id, "instance": 5, "name": "vllm-0", "pid": 42, "uid": 1000,
                            "live": True, "lost_reason": None, "connected": True, "regs": sorted(c.regs),
                            "copies_done": {"loads": 0, "load_bytes": 0, "saves": 0, "save_bytes": 0}}
    c.count_copy("load", 4096)
    c.count_copy("save", 100)
    assert c.describe()["copies_done"] == {"loads": 1, "load_bytes": 4096, "saves": 1, "save_bytes": 100}
    r.detach_connection(c)
    cd = c.describe()
    assert (cd["live"], cd["lost_reason"], cd["connected"]) == (False, "disconnect", False)
    long = "y" * 5000
    y = active(r, client(r, 6, 6), alloc=3)
    r.close(y, long)
    t = r.tombstones[y.reg_id].describe()
    assert {k: t[k] for k in ("reg", "client", "alloc_id", "gen", "state", "in_flight", "in_flight_count",
                              "mapped")} == {"reg": y.reg_id, "client": y.client_id, "alloc_id": 3, "gen": 1,
                                             "state": "released", "in_flight": [], "in_flight_count": 0,
                                             "mapped": False}
    assert t["reason"] == clip(long) and len(t["reason"]) < len(long)  # bounded, as listed items must be
    assert [h[0] for h in t["history"]] == ["registered", "active", "closing", "drained", "released"]
    assert t["history"][2][1] == clip(long)


def test_summary_counts_by_state_for_one_client_or_all() -> None:
    r, unmap = make()
    a, b = client(r, 1, 1), client(r, 2, 2)
    reg(r, a, alloc=1)
    busy = active(r, a, alloc=2)
    r.begin_work(busy, 1)
    r.close(busy, "closed by client")
    unmap.refuse = "views alive"
    r.close(active(r, b, alloc=1), "closed by client")  # stays drained
    unmap.refuse = None
    r.close(reg(r, b, alloc=2), "closed by client")  # released
    r.begin_work(active(r, b, alloc=3), 2)
    r.lose_client(b, "heartbeat lost")  # closing, its copy still runs
    s = r.summary()
    assert s["by_state"] == {"registered": 1, "active": 0, "closing": 2, "drained": 1}
    assert s["counts"] == {"clients": 2, "clients_live": 1, "registrations": 4, "released": 1}
    assert s["counters"] == r.counters and s["counters"] is not r.counters
    sa = r.summary(a.client_id)
    assert sa["by_state"] == {"registered": 1, "active": 0, "closing": 1, "drained": 0}
    assert sa["counts"] == {"clients": 1, "clients_live": 1, "registrations": 2, "released": 0}
    sb = r.summary(b.client_id)
    assert sb["by_state"] == {"registered": 0, "active": 0, "closing": 1, "drained": 1}
    assert sb["counts"] == {"clients": 1, "clients_live": 0, "registrations": 2, "released": 1}


def test_per_client_views_match_the_global_ones_through_the_tombstone_cap() -> None:
    """A client's own registrations and tombstones come from per-client indexes (their cost is what the client
    holds, not the service's history); they must say exactly what filtering the global tables says, also after the
    cap has dropped the oldest tombstones."""
    r, _ = make(max_tombstones=5)
    a, b = client(r, 1, conn_id=1), client(r, 2, conn_id=2)
    for gen in range(1, 5):            # a: 4 burials, b: 3 (interleaved), then one live each
        x = active(r, a, gen=gen)
        r.close(x, "closed by client")
        if gen < 4:
            y = active(r, b, alloc=ALLOC + 4096, gen=gen)
            r.close(y, "closed by client")
    live_a, live_b = active(r, a, gen=9), active(r, b, alloc=ALLOC + 4096, gen=9)
    assert len(r.tombstones) == 5      # 7 buried, the 2 oldest dropped
    for c, live in ((a, live_a), (b, live_b)):
        want = [t for t in r.tombstones.values() if t.client_id == c.client_id]
        assert r.tombstones_of(c.client_id) == want
        assert r.summary(c.client_id)["counts"]["released"] == len(want)
        assert r.regs_of(c.client_id) == [live]
    assert r.tombstones_of(None) == list(r.tombstones.values())
    assert r.summary()["counts"]["released"] == 5
    assert sum(len(r.tombstones_of(c.client_id)) for c in (a, b)) == 5
