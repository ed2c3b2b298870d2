"""Stage `remote` (issue 25): the cache service's remote tier on Mooncake Store, shared by two hosts, every arrival
verified.

Two service processes stand for two hosts (own runtime and disk dirs), both pointed at one Mooncake master started
here on loopback (kmesh.storage.remote; the services reach it by address, as they would across machines). Host A's
leader saves the equivalence workload's segments; A's remote tier publishes each committed object (the object-file
image: header and digest as on disk). Host B's children load through B's service, which fetches an object it does
not hold once, checks it and installs it.

Cases:
  setup                 model, workload and leader export as the equivalence stage builds them
  reference             every child through kmesh.harness.child.run_child from the in-process source
  hosts                 the master and both hosts up; A's leader saved; every object published once, none failed
  fetch-once            B's children load at once (threads released together): one fetch per object across the
                        group, every child's private copy = A's leader bytes, every child repaired = reference
  pairs                 matched rounds of four arms on host B, per child: `remote` (B holds nothing: fetched),
                        `disk` (B's disk tier, page cache dropped), `ram` (B's RAM) and `full` (no restore, the whole
                        prompt recomputed); part first-token (load ⊂ first-token for the restore arms), every run's
                        outcome compared bit for bit; fetches per remote child counted
  fail-tampered         one object's bytes flipped through the store's own API: B refuses it (rejected, nothing
                        installed), the child recomputes = full reference
  fail-evicted          one object removed from the store: a miss, the child recomputes
  fail-hung-store       the master frozen (SIGSTOP) while a child loads, for one call timeout + 1 s: the store
                        agent's call times out, the child recomputes; thawed, the next child restores
  fail-unreachable      the master killed: the child's load fails at once, it recomputes
  fail-master-restarted the master started again (it forgot every object): a miss, the child recomputes; the
                        operator republishes and the next child restores = reference
Every failure case: both services alive, nothing leaked on either host, nothing unverified installed on B.
"""
from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from typing import Any

import torch

from kmesh.bench import Intervals, PairedTiming, rotate
from kmesh.config import Config
from kmesh.harness.child import (ChildOutcome, full_reference, new_cache, outcome_of, prefill, prefill_and_decode,
                                 prefill_from_segments, restore_child, run_child)
from kmesh.harness.modelsetup import ModelSetup, begin_with_setup, equivalence_setup
from kmesh.harness.workload import Child
from kmesh.kv.sources import InProcessSegments
from kmesh.model.quality import compare_states, identical
from kmesh.result import Result
from kmesh.stages.remote.hosts import TwoHosts
from kmesh.storage.remote import RemoteStoreError, unavailable_reason

ARMS = ("remote", "disk", "ram", "full")
CASES = ("reference", "hosts", "fetch-once", "pairs", "fail-tampered", "fail-evicted", "fail-hung-store",
         "fail-unreachable", "fail-master-restarted", "teardown")


def _same(ref: ChildOutcome, out: ChildOutcome) -> bool:
    return identical(compare_states(ref, out))


def _references(res: Result, setup: ModelSetup) -> tuple[dict[str, ChildOutcome], dict[str, ChildOutcome]]:
    refs, fulls = {}, {}
    with res.case("reference", {"source": "in-process", "runner": "kmesh.harness.child.run_child"}) as case:
        src = InProcessSegments(setup.export)
        staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        private = torch.empty_like(staging)
        for child in setup.workload.children:
            refs[child.name] = run_child(setup.ctx, child, src, staging, private)
            fulls[child.name] = full_reference(setup.ctx, child)
        case.check("reference_used_segments", all(o.fallback is None for o in refs.values()))
    return refs, fulls


def _hosts_case(res: Result, setup: ModelSetup, cfg: Config, sec: dict[str, Any]) -> TwoHosts | None:
    n = len(setup.export.catalog.entries)
    made: list[TwoHosts] = []
    with res.case("hosts", {"objects": n, "segment_bytes": int(sec["segment_bytes"]),
                            "hosts": "two service processes, own runtime and disk dirs"}) as case:
        made.append(TwoHosts(setup, cfg.stage_dir("remote") / "work", sec, len(setup.workload.children)))
        hosts = made[0]
        case.record("master", {"rpc": hosts.master.spec().master, "metadata": hosts.master.spec().metadata})
        saved = hosts.save_leader()
        k = saved["remote"]["counters"]
        case.record("publish", {"seconds": round(saved["seconds"], 4), "bytes": k["bytes_published"],
                                "counters": k})
        case.check("every_object_published_once", k["published"] == n and k["publish_failures"] == 0,
                   {"published": k["published"], "failures": k["publish_failures"], "objects": n})
        case.check("store_holds_every_object", all(hosts.operator.exists(key) for key in hosts.keys))
        case.check("b_holds_nothing_yet", not hosts.held_by_b())
    if not made:
        return None
    if not res.cases[-1].passed:
        made[0].close()
        return None
    return made[0]


def _fetch_once_case(res: Result, setup: ModelSetup, hosts: TwoHosts, refs: dict[str, ChildOutcome]) -> None:
    children = setup.workload.children
    with res.case("fetch-once", {"children": len(children), "concurrent": True}) as case:
        privates = [torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
                    for _ in children]
        for p in privates:
            p.fill_(0x5A)
        before = hosts.remote_counters(hosts.b)
        barrier, errors = threading.Barrier(len(children)), []

        def one(i: int) -> None:
            try:
                barrier.wait(timeout=60)
                hosts.load_child(i, privates[i])
            except Exception as e:  # reported below, with the others'
                errors.append(f"child {i}: {type(e).__name__}: {e}")
        threads = [threading.Thread(target=one, args=(i,), name=f"remote-child-{i}") for i in range(len(children))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = hosts.remote_counters(hosts.b)
        delta = {k: after[k] - before[k] for k in after}
        case.record("b_remote_counters", delta)
        case.check("children_loaded", not errors, errors)
        case.check("one_fetch_per_object", delta["fetches"] == delta["fetched"] == len(hosts.keys)
                   and delta["fetch_rejected"] == 0, {"fetches": delta["fetches"], "objects": len(hosts.keys)})
        raw = setup.export.raw
        case.check("private_copies_are_a_leader_bytes", all(torch.equal(p, raw) for p in privates))
        held = hosts.held_by_b()
        case.check("b_installed_verified_copies", all(held[k]["fetched"] and held[k]["sha256"] ==
                                                      hosts.a_digests[k] for k in hosts.keys))
        same = 0
        for child, private in zip(children, privates):
            cache = new_cache(setup.ctx, child)
            restored = restore_child(cache, setup.ctx.catalog, private, child, setup.ctx.runner,
                                     setup.ctx.restore_backend)
            blended, tokens = prefill_and_decode(setup.ctx, child, cache, restored, "repair")
            out = outcome_of(setup.ctx, child, "remote:fetch-once", "repair", cache, restored, blended, tokens,
                             None, [])
            same += _same(refs[child.name], out)
        case.check("children_repair_to_reference", same == len(children), same)
        res.extra["fetches_per_object_across_children"] = delta["fetches"] / len(hosts.keys)


def _timed_child(setup: ModelSetup, hosts: TwoHosts, arm: str, child: Child, index: int,
                 iv: Intervals) -> ChildOutcome:
    private = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
    private.fill_(0x5A)
    cache = new_cache(setup.ctx, child)
    if arm == "full":
        restored = torch.zeros(len(child.ids), dtype=torch.bool)
        with iv.part("first-token"):
            res = prefill(setup.ctx, child, cache, restored, "full")
        tokens = setup.ctx.runner.decode(cache, len(child.ids), res.logits, setup.ctx.max_new_tokens,
                                         stop_ids=setup.ctx.stop_ids)
        return outcome_of(setup.ctx, child, "none", "full", cache, restored, res, tokens, None, ["recompute"])
    events: list[str] = []
    with iv.part("first-token"):
        restored, res = prefill_from_segments(setup.ctx, child, hosts.source(index), hosts.staging[index].tensor,
                                              private, cache, "repair", f"remote-{arm}-{child.name}", events,
                                              part=iv.part)
    tokens = setup.ctx.runner.decode(cache, len(child.ids), res.logits, setup.ctx.max_new_tokens,
                                     stop_ids=setup.ctx.stop_ids)
    return outcome_of(setup.ctx, child, f"remote:{arm}", "repair", cache, restored, res, tokens, None, events)


def _prepare(hosts: TwoHosts, arm: str, index: int) -> None:
    """Untimed: put host B in the arm's state for the next child."""
    if arm == "remote":
        hosts.forget_on_b()
        return
    if arm in ("disk", "ram") and len(hosts.held_by_b()) < len(hosts.keys):
        scratch = torch.empty_like(hosts.staging[index].tensor)
        hosts.load_child(index, scratch)      # fetched once, untimed: the arm times B's own tiers
    if arm == "disk":
        hosts.cold_disk_on_b()


def _common(t: PairedTiming) -> PairedTiming:
    """The pairs of two arms restricted to the parts both timed (the full arm times first-token alone)."""
    shared = [p for p in t.parts() if all(p in pair[a] for pair in t.pairs for a in (t.arm_a, t.arm_b))]
    pairs = [{"order": pair["order"], **{a: {k: v for k, v in pair[a].items() if k in shared}
                                          for a in (t.arm_a, t.arm_b)}} for pair in t.pairs]
    return PairedTiming(t.arm_a, t.arm_b, pairs, {k: v for k, v in t.parents.items() if k in shared}, t.warmup,
                        t.shared_with)


def _pairs_case(res: Result, setup: ModelSetup, hosts: TwoHosts, refs: dict[str, ChildOutcome],
                fulls: dict[str, ChildOutcome], pairs: int, warmup: int, timed_children: int) -> None:
    children = setup.workload.children[:timed_children]
    with res.case("pairs", {"arms": list(ARMS), "pairs": pairs, "warmup": warmup, "children": len(children),
                            "order": "rotated (kmesh.bench.rotate)"}) as case:
        wrong: list[str] = []
        fetches: list[int] = []
        parents: dict[str, str | None] = {}

        def run_arm(arm: str, round_index: int) -> dict[str, list[float]]:
            per_part: dict[str, list[float]] = {}
            for i, child in enumerate(children):
                _prepare(hosts, arm, i)
                before = hosts.remote_counters(hosts.b)["fetched"]
                iv = Intervals("cuda" if setup.device.type == "cuda" else "cpu")
                out = _timed_child(setup, hosts, arm, child, i, iv)
                if arm == "remote":
                    fetches.append(hosts.remote_counters(hosts.b)["fetched"] - before)
                ref = fulls[child.name] if arm == "full" else refs[child.name]
                if not _same(ref, out):
                    wrong.append(f"round {round_index} {arm} {child.name}")
                for name, seconds in iv.seconds().items():
                    per_part.setdefault(name, []).append(seconds)
                for name, parent in iv.parents.items():
                    parents.setdefault(name, parent)
            return per_part

        rounds = rotate(ARMS, pairs, warmup, run_arm, label="remote arms")
        summary = {}
        for other in ("disk", "ram", "full"):
            t = _common(rounds.paired("remote", other))
            t.parents.update({k: v for k, v in parents.items() if k in t.parents or k in t.parts()})
            res.timings[f"remote_vs_{other}"] = t.to_dict()
            summary[other] = t.summary()["first-token"]
        medians = {arm: statistics.median(statistics.median(r[arm]["first-token"]) for r in rounds.records)
                   for arm in ARMS}
        case.record("first_token_median_s", medians)
        case.record("paired_vs_remote", summary)
        case.check("every_run_equals_its_reference", not wrong, wrong)
        case.check("remote_children_fetch_each_object_once", fetches and all(f == len(hosts.keys) for f in fetches),
                   fetches)
        # per arm: median first-token time; vs the remote arm: median of the per-pair ratios other/remote and the
        # pairs the remote arm won
        res.extra["remote_arms"] = {arm: {"median_ms": 1e3 * medians[arm], "pairs": pairs,
                                          "ratio_vs_remote": 1.0 if arm == "remote" else summary[arm]["median_ratio"],
                                          "remote_faster": None if arm == "remote"
                                          else pairs - summary[arm]["b_faster"]} for arm in ARMS}


def _failure(res: Result, setup: ModelSetup, hosts: TwoHosts, case_id: str, refs: dict[str, ChildOutcome],
             fulls: dict[str, ChildOutcome], fault: Any, expect: str, undo: Any = None,
             recovers: bool = False) -> dict[str, Any]:
    """One failure scenario on child 0: `fault()` breaks the store, B holds nothing, the child runs through B's
    service (run_child: a failed load ends in a recompute); then `undo()` and the checks."""
    child = setup.workload.children[0]
    with res.case(case_id, {"child": child.name, "expect": expect}) as case:
        hosts.forget_on_b()
        before = hosts.remote_counters(hosts.b)
        held_before = hosts.held_by_b()
        fault()
        private = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        t0 = time.monotonic()
        out = run_child(setup.ctx, child, hosts.source(0), hosts.staging[0].tensor, private)
        seconds = time.monotonic() - t0
        if undo is not None:
            undo()
        after = hosts.remote_counters(hosts.b)
        delta = {k: after[k] - before[k] for k in after}
        held = hosts.held_by_b()
        case.record("child", {"fallback": out.fallback, "events": out.events[-6:], "seconds": round(seconds, 3)})
        case.record("b_remote_counters", delta)
        case.check("load_failed_as_expected", out.fallback is not None and expect in out.fallback, out.fallback)
        case.check("child_recomputed_equals_full", _same(fulls[child.name], out))
        case.check("nothing_unverified_installed",
                   all(o["sha256"] == hosts.a_digests.get(k) for k, o in held.items()),
                   {k.hex() if isinstance(k, bytes) else k: o["sha256"] for k, o in held.items()
                    if k not in held_before})
        case.check("services_alive", hosts.alive())
        leaks = hosts.leaks()
        case.check("nothing_leaked", leaks == hosts.expected_holdings(), {"now": leaks,
                                                                         "expected": hosts.expected_holdings()})
        recovered = None
        if recovers:   # the store is whole again: the next child restores from it
            hosts.forget_on_b()
            again = run_child(setup.ctx, child, hosts.source(0), hosts.staging[0].tensor, private)
            recovered = again.fallback is None and _same(refs[child.name], again)
            case.check("next_child_restores_from_store", recovered, again.fallback)
        res.extra.setdefault("remote_faults", {})[case_id] = {
            # what the child's load got, past the segment source's wrapping ("... from the remote tier: <cause>")
            "error": (out.fallback or "none").split("remote tier: ", 1)[-1][:120], "fallback_s": round(seconds, 3),
            "b_counters": {k: v for k, v in delta.items() if v}, "recomputed_equal_full": _same(fulls[child.name], out),
            "held_as_at_start": leaks == hosts.expected_holdings(), "recovered": recovered}
        return delta


def _failure_cases(res: Result, setup: ModelSetup, hosts: TwoHosts, refs: dict[str, ChildOutcome],
                   fulls: dict[str, ChildOutcome]) -> None:
    from kmesh.storage.objfile import HEADER_BYTES

    key0 = hosts.keys[0]
    images = {k: hosts.operator.fetch(k) for k in hosts.keys}   # the operator's copies, to put back

    def tamper() -> None:
        bad = bytearray(images[key0])
        bad[HEADER_BYTES + 17] ^= 0x40
        hosts.operator.overwrite(key0, bytes(bad))
    d = _failure(res, setup, hosts, "fail-tampered", refs, fulls, tamper, "RemoteRejectedError",
                 undo=lambda: hosts.operator.overwrite(key0, images[key0]), recovers=True)
    res.extra["fail_tampered_rejected"] = d["fetch_rejected"]

    def evict() -> None:
        time.sleep(hosts.master.lease_ms / 1000 + 0.2)   # past the store's lease on what it served last
        hosts.operator.remove(key0)
    _failure(res, setup, hosts, "fail-evicted", refs, fulls, evict, "here or in the remote tier",
             undo=lambda: hosts.operator.publish(key0, images[key0]), recovers=True)

    pid = hosts.master.proc.pid if hosts.master.proc is not None else None
    # frozen for one call timeout and a second more: long enough that the fetch's call times out, short of the
    # master's client TTL (10 s), after which a thawed master would drop the store node's segment as dead
    thaw = threading.Timer(float(hosts.sec["call_timeout_s"]) + 1.0, lambda: os.kill(pid, signal.SIGCONT))

    def freeze() -> None:
        os.kill(pid, signal.SIGSTOP)
        thaw.start()

    def unfreeze() -> None:
        thaw.join()
        os.kill(pid, signal.SIGCONT)   # (again: harmless) the master runs before the next case
    _failure(res, setup, hosts, "fail-hung-store", refs, fulls, freeze, "the store agent hung", undo=unfreeze,
             recovers=True)
    _failure(res, setup, hosts, "fail-unreachable", refs, fulls, hosts.master.kill,
             "could not be fetched from the remote tier")

    def republish() -> None:
        # the operator's part, right after the restart: a put can be refused for a moment while the store node's
        # memory registers with the new master (code -800 seen once), so each key is tried again for up to 5 s
        for k, img in images.items():
            for attempt in range(10):
                try:
                    hosts.operator.publish(k, img)
                    break
                except RemoteStoreError:
                    if attempt == 9:
                        raise
                    time.sleep(0.5)
    _failure(res, setup, hosts, "fail-master-restarted", refs, fulls, hosts.restart_master,
             "here or in the remote tier", undo=republish, recovers=True)


def run(cfg: Config) -> Result:
    sec = cfg.section("remote")
    reason = unavailable_reason()
    if reason is not None:
        res = Result.begin("remote", cfg)
        for case_id in ("setup", *CASES):
            res.skip_case(case_id, None, reason)
        return res
    res, setup = begin_with_setup("remote", cfg, equivalence_setup)
    if setup is None:
        return res
    refs, fulls = _references(res, setup)
    timing = cfg.section("timing")
    pairs, warmup = int(sec.get("pairs") or timing["pairs"]), int(sec.get("warmup", timing["warmup"]))
    hosts = _hosts_case(res, setup, cfg, sec)
    if hosts is None:
        return res
    try:
        _fetch_once_case(res, setup, hosts, refs)
        _pairs_case(res, setup, hosts, refs, fulls, pairs, warmup, int(sec.get("timed_children", 4)))
        _failure_cases(res, setup, hosts, refs, fulls)
    finally:
        with res.case("teardown", {"what": "children's registrations closed, both services and the master stopped"}) \
                as case:
            exits = hosts.close()
            case.check("services_exit_cleanly", exits == {"a": 0, "b": 0}, exits)
    return res
