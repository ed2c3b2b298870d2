"""Stage `group` (write-up §25): a request group executed layer-major, bit-identical to serial, with failure
isolation, batched group math, scaling pairs and the bytes a group holds.

Cases:
  setup                 model + workload (the equivalence stage's: same leader, 4 shared segments), leader saved
                        through a real cache service (the shared originals in its host-RAM tier)
  serial-in-process     each child alone (kmesh.child.run_child), segments from inside the model process
  serial-service        each child alone, segments through the service (cross-process: memfd / CUDA IPC)
  group-layer-major     all children as one group: members × segments loads from the shared originals (16 for
                        4 × 4), every member checked by the group barrier (kmesh.stages.group_load) before any
                        restored input is released, private copies, layer-major blend_group (each finished
                        layer written back to the member's private destination blocks by an async copy), then
                        decode. K/V, logits, tokens and the mask of every layer equal both serial paths bit for bit
  comparisons-can-fail  one flipped bit of the group's K / mask / logits is caught by the same comparison
  originals-unchanged   every original re-hashed in the store equals its committed digest, after the group runs
  group-failure         the same group, child B fails after its first layer (injected), with its layer-0
                        write-back still pending (a gated copy): B drains it, discards its restored and partial
                        state, recomputes fully without reuse (tokens = full-recompute reference); A, C, D
                        unaffected (bit-identical to serial); afterwards the service's own counters show no
                        handle open and nothing pending
  batched-agreement     batched group math (kmesh.model.group) vs the unbatched layer-major path: rotation and
                        deviation bit-identical; K/V/logits bound measured; masks and tokens equal
  scaling-<N>           matched pairs per group size (kmesh.stages.group_bench): serial vs layer-major,
                        serial vs batched; peak memory per arm
  bytes-held            store bytes once + private repaired copies per child vs N; what diffs would save
"""
from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from kmesh.child import (POISON, ChildContext, ChildOutcome, outcome_of, full_reference, new_cache, prefill_and_decode,
                         run_child)
from kmesh.config import Config
from kmesh.errors import KMeshError
from kmesh.model.blend import RepairConfig
from kmesh.model.group import InjectedMemberFault, Member, blend_group
from kmesh.model.quality import compare_states, identical
from kmesh.model.runner import KVCache, LayerRunner
from kmesh.result import Case, Result
from kmesh.modelsetup import ModelSetup, SetupSpec, begin_with_setup, build_setup
from kmesh.segments import Export, InProcessSegments, ServiceSegments, restore_child
from kmesh.service.harness import Harness
from kmesh.stages.group import bench as group_bench
from kmesh.service_side import ServiceSide
from kmesh.stages.group.load import GroupLoad
from kmesh.transfer.engine import TransferEngine
from kmesh.transfer.faults import ChunkGate, FaultPlan
from kmesh.workload import Child, Workload, WorkloadSpec, build


class GroupConfigError(KMeshError):
    """The group section names a failure the group cannot have (unknown member, no layer after it)."""


@dataclass
class GroupSetup(ModelSetup):
    """workload.children[:group.children] are the group; the rest only widen the scaling runs."""

    @property
    def group(self) -> tuple[Child, ...]:
        return self.workload.children[: int(self.sec["children"])]


def _setup(cfg: Config) -> GroupSetup:
    sec = cfg.section("group")
    eq = {**cfg.section("equivalence"), "model": sec["model"]}
    widest = max([int(sec["children"]), *[int(n) for n in sec["scaling"]["sizes"]]])
    base = build_setup(cfg, SetupSpec(
        section="group", key_prefix=b"kmesh-group/leader", model_sec=eq,
        workload={**sec["workload"], "children": widest}, repair=sec["repair"],
        max_new_tokens=int(sec["max_new_tokens"]), restore_backend=sec.get("restore_backend", "torch"),
        device=sec["device"]))
    setup = GroupSetup(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelSetup)})
    names = [c.name for c in setup.group]
    fail = sec["failure"]
    if fail["child"] not in names or not 0 <= int(fail["after_layer"]) < setup.runner.num_layers - 1:
        raise GroupConfigError(f"group.failure: child {fail['child']!r} must be one of {names} and after_layer "
                               f"{fail['after_layer']} a layer before the model's last ({setup.runner.num_layers - 1})")
    return setup


# -- the group path ---------------------------------------------------------------------------------------

class Writeback:
    """after_layer hook: a member's finished layer (one contiguous range of its LBNHC working cache) goes to
    its private destination blocks by an async engine copy, overlapping the next layer's compute. An
    injected fault fires right after the chosen member's chosen layer was submitted."""

    def __init__(self, engines: dict[str, TransferEngine], caches: dict[str, KVCache],
                 dests: dict[str, torch.Tensor], fail: dict[str, int] | None = None) -> None:
        self.engines, self.caches, self.dests, self.fail = engines, caches, dests, fail or {}
        lay = next(iter(caches.values())).layout
        self.layer_bytes = lay.byte_strides["L"]

    def __call__(self, name: str, layer: int) -> None:
        a, b = layer * self.layer_bytes, (layer + 1) * self.layer_bytes
        self.engines[name].submit(self.caches[name].raw[a:b], self.dests[name][a:b], owner=f"group-{name}")
        if self.fail.get(name) == layer:
            raise InjectedMemberFault(f"member {name} failed after layer {layer} (injected)")


@dataclass
class GroupRun:
    outcomes: dict[str, ChildOutcome]
    admission: dict[str, Any]
    failure: dict[str, Any]
    loads: int
    order_layer_major: bool
    writeback_equal: dict[str, bool]


def _layer_major(order: list[tuple[int, str]]) -> bool:
    """No member entered layer l+1 before every live member finished layer l."""
    layers = [layer for layer, _ in order]
    return layers == sorted(layers)


def run_group(s: GroupSetup, svc: ServiceSide, children: tuple[Child, ...], fail: dict[str, int] | None = None,
              gated: str | None = None) -> GroupRun:
    """The group path end to end (module doc, group-layer-major / group-failure)."""
    r, cat, dev = s.runner, s.export.catalog, s.device
    names = [c.name for c in children]
    by = {c.name: c for c in children}
    privates = {n: torch.empty(cat.nbytes, dtype=torch.uint8, device=dev) for n in names}
    with GroupLoad(svc, cat, names) as g:
        g.load_all()
        admission = g.admit()
        g.copy_private(s.ctx.engine, privates)
    caches = {n: new_cache(s.ctx, by[n]) for n in names}
    restored = {n: restore_child(caches[n], cat, privates[n], by[n], r, s.ctx.restore_backend) for n in names}
    dests = {n: torch.full_like(caches[n].raw, 0xA5) for n in names}
    gate = ChunkGate() if gated else None
    engines = {n: s.ctx.engine for n in names}
    if gated:   # the failing member's copies wait at a gate: its layer-0 write-back is provably pending
        engines[gated] = TransferEngine(str(dev), FaultPlan(chunk_bytes=1 << 16), gate=gate)
    hook = Writeback(engines, caches, dests, fail)
    members = [Member(n, torch.tensor(by[n].ids, device=dev), caches[n], restored[n]) for n in names]
    out = blend_group(r, members, s.ctx.repair, after_layer=hook)
    failure: dict[str, Any] = {}
    outcomes: dict[str, ChildOutcome] = {}
    wb_equal: dict[str, bool] = {}
    try:
        for n in names:
            owner = f"group-{n}"
            if n in out.failed:
                events = [f"failed-after-layer:{out.failed[n][0]}"]
                pending = engines[n].pending(owner)
                events.append(f"pending-at-failure:{len(pending)}")
                if gate is not None and n == gated:
                    gate.open()          # the held copy may finish now; the member waits for it
                engines[n].drain(pending, timeout=60.0)
                events.append(f"pending-before-recompute:{len(engines[n].pending(owner))}")
                cache = r.cache_over(caches[n].raw, caches[n].layout, fill=POISON)   # restored state discarded
                dests[n].fill_(0xA5)
                none = torch.zeros(len(by[n].ids), dtype=torch.bool)
                res, tokens = prefill_and_decode(s.ctx, by[n], cache, none, "full")
                events.append("recompute")
                outcomes[n] = outcome_of(s.ctx, by[n], "service", "full", cache, none, res, tokens,
                                       out.failed[n][1], events)
                failure[n] = {"layer": out.failed[n][0], "reason": out.failed[n][1], "events": events,
                              "pending_at_failure": len(pending)}
                continue
            engines[n].drain(owner=owner, timeout=60.0)
            wb_equal[n] = bool(torch.equal(dests[n], caches[n].raw))   # every layer's write-back landed
            res = out.results[n]
            tokens = r.decode(caches[n], len(by[n].ids), res.logits, s.ctx.max_new_tokens)
            outcomes[n] = outcome_of(s.ctx, by[n], "service", "kmesh", caches[n], restored[n], res, tokens, None,
                                   ["group-admitted", "private-copy-drained", "restored", "layer-major"])
    finally:
        if gate is not None:
            gate.open()
            engines[gated].close()
    return GroupRun(outcomes, admission, failure, admission["loads"], _layer_major(out.order), wb_equal)


# -- cases -----------------------------------------------------------------------------------------------------

def _serial(res: Result, s: GroupSetup, svc: ServiceSide) -> tuple[dict[str, ChildOutcome], dict[str, ChildOutcome]]:
    cat = s.export.catalog
    staging = torch.empty(cat.nbytes, dtype=torch.uint8, device=s.device)
    private = torch.empty_like(staging)
    inproc, service = {}, {}
    with res.case("serial-in-process", {"children": [c.name for c in s.group]}) as c:
        src = InProcessSegments(s.export)
        for child in s.group:
            inproc[child.name] = run_child(s.ctx, child, src, staging, private)
        c.check("segments_used", all(o.fallback is None for o in inproc.values()),
                value={n: o.fallback for n, o in inproc.items()})
    with res.case("serial-service", {"children": [c.name for c in s.group]}) as c:
        for child in s.group:
            with svc.staging(f"serial-{child.name}") as st:
                service[child.name] = run_child(s.ctx, child, ServiceSegments(svc.client, st.reg, svc.after_accept),
                                                st.tensor, private)
        c.check("segments_used", all(o.fallback is None for o in service.values()),
                value={n: o.fallback for n, o in service.items()})
        cmps = {n: compare_states(inproc[n], service[n]) for n in service}
        c.record("comparison", cmps)
        c.check("bit_identical_to_in_process", all(identical(x) for x in cmps.values()))
        c.check("no_service_leaks", svc.no_leaks(), value=svc.leaks())
    return inproc, service


def _compare_group(c: Case, run: GroupRun, refs: dict[str, dict[str, ChildOutcome]], names: list[str]) -> dict[str, Any]:
    agg = {"mask_comparisons": 0, "kv_layer_comparisons": 0, "max_abs_diff": 0.0, "all_identical": True}
    per: dict[str, Any] = {}
    for ref_name, ref in refs.items():
        for n in names:
            cmp = compare_states(ref[n], run.outcomes[n])
            per[f"{n}-vs-{ref_name}"] = cmp
            agg["mask_comparisons"] += cmp["layers"]
            agg["kv_layer_comparisons"] += 2 * cmp["layers"]
            agg["max_abs_diff"] = max(agg["max_abs_diff"], cmp["max_abs_diff"])
            agg["all_identical"] &= identical(cmp)
    c.record("comparisons", per)
    return agg


def _group_case(res: Result, s: GroupSetup, svc: ServiceSide, inproc: dict[str, ChildOutcome],
                service: dict[str, ChildOutcome]) -> tuple[dict[str, Any], GroupRun | None]:
    names = [c.name for c in s.group]
    agg: dict[str, Any] = {}
    run: GroupRun | None = None
    with res.case("group-layer-major", {"children": names, "segments": len(s.export.catalog.entries)}) as c:
        run = run_group(s, svc, s.group)
        c.record("admission", run.admission)
        c.check("placements_loaded", run.loads == len(names) * len(s.export.catalog.entries), value=run.loads)
        c.check("executed_layer_major", run.order_layer_major)
        c.check("writeback_equals_working_cache", all(run.writeback_equal.values()), value=run.writeback_equal)
        c.check("segments_used", all(o.fallback is None for o in run.outcomes.values()))
        agg = _compare_group(c, run, {"serial-in-process": inproc, "serial-service": service}, names)
        c.check("bit_identical_to_both_serial_paths", agg["all_identical"], value=agg["max_abs_diff"])
        c.check("no_service_leaks", svc.no_leaks(), value=svc.leaks())
        agg["placements"] = run.loads
    return agg, run


def _negative(res: Result, run: GroupRun, inproc: dict[str, ChildOutcome]) -> None:
    with res.case("comparisons-can-fail", {}) as c:
        n = next(iter(run.outcomes))
        base = run.outcomes[n]

        def flipped(t: torch.Tensor) -> torch.Tensor:
            out = t.clone()
            if out.dtype == torch.bool:
                out.view(-1)[0] = ~out.view(-1)[0]
            else:
                out.view(-1).view(torch.uint8)[3] ^= 0x01
            return out

        for field_ in ("k", "masks", "logits"):
            cmp = compare_states(inproc[n], dataclasses.replace(base, **{field_: flipped(getattr(base, field_))}))
            c.check(f"{field_}_bit_flip_caught", not identical(cmp))


def _failure_case(res: Result, s: GroupSetup, svc: ServiceSide, inproc: dict[str, ChildOutcome],
                  fulls: dict[str, ChildOutcome]) -> dict[str, Any]:
    sec = s.sec["failure"]
    who, after = sec["child"], int(sec["after_layer"])
    out: dict[str, Any] = {"failure_case_passed": False}
    with res.case("group-failure", {"fails": who, "after_layer": after}) as c:
        run = run_group(s, svc, s.group, fail={who: after}, gated=who)
        f = run.failure.get(who, {})
        c.record("failure", f)
        ok = [c.check("failed_member_left_after_its_layer", f.get("layer") == after, value=f.get("layer")),
              c.check("work_was_pending_at_failure", f.get("pending_at_failure", 0) >= 1,
                      value=f.get("pending_at_failure")),
              c.check("drained_before_recompute", "pending-before-recompute:0" in f.get("events", [])
                      and f.get("events", [""])[-1] == "recompute", value=f.get("events")),
              c.check("failed_member_tokens_equal_full_reference", run.outcomes[who].tokens == fulls[who].tokens),
              c.check("failed_member_kv_equal_full_reference", torch.equal(run.outcomes[who].k, fulls[who].k)
                      and torch.equal(run.outcomes[who].v, fulls[who].v))]
        others = {n: compare_states(inproc[n], o) for n, o in run.outcomes.items() if n != who}
        c.record("others_vs_serial", others)
        ok.append(c.check("others_bit_identical_to_serial", all(identical(x) for x in others.values()),
                          value={n: x["first_unequal_layer"] for n, x in others.items()}))
        ok.append(c.check("executed_layer_major", run.order_layer_major))
        leaks = svc.leaks()
        st = svc.h.status()
        handles = leaks["registrations"] + leaks["memfd_mappings"] + leaks["cuda_handles_open"]
        pending = leaks["copies_running"] + leaks["reservations"] + len(st["requests_running"])
        c.record("service_counters", leaks)
        ok.append(c.check("handles_open_after_zero", handles == 0, value=handles))
        ok.append(c.check("pending_after_zero", pending == 0, value=pending))
        ok.append(c.check("engine_nothing_pending", not s.ctx.engine.pending() and s.ctx.engine.live_holds() == 0))
        out.update(failure_case_passed=all(ok), handles_open_after=handles, pending_after=pending,
                   others_mask_comparisons=sum(x["mask_equal_layers"] for x in others.values()))
    return out


def _originals_case(res: Result, s: GroupSetup, svc: ServiceSide) -> bool:
    with res.case("originals-unchanged", {}) as c:
        now = svc.store_digests(verify=True)
        ok = c.check("every_original_hashes_as_committed",
                     all(now.get(e.key) == (e.sha256, e.sha256) for e in s.export.catalog.entries), value=len(now))
    return ok


def run(cfg: Config) -> Result:
    res, s = begin_with_setup("group", cfg, _setup, model=cfg.section("group")["model"])
    if s is None:
        return res
    res.extra.update(model=s.what, device=str(s.device), children=len(s.group), layers=s.runner.num_layers)
    fulls = {ch.name: full_reference(s.ctx, ch) for ch in s.group}
    with ExitStack() as stack:
        h = stack.enter_context(Harness(device=str(s.device), heartbeat_timeout_s=float(s.sec["heartbeat_timeout_s"]),
                                        chunk_bytes=int(s.sec["chunk_bytes"]), store_bytes=1 << 31))
        svc = stack.enter_context(ServiceSide(h, s.export, s.device))
        with res.case("leader-save", {"objects": len(s.export.catalog.entries)}) as c:
            saved = svc.save_leader()
            c.check("store_digests_equal_catalog", all(saved[e.key] == e.sha256 for e in s.export.catalog.entries))
        store_bytes = int(h.status()["store"]["used_bytes"])
        inproc, service = _serial(res, s, svc)
        agg, run_ = _group_case(res, s, svc, inproc, service)
        if run_ is not None:
            _negative(res, run_, inproc)
        fail = _failure_case(res, s, svc, inproc, fulls)
        unchanged = _originals_case(res, s, svc)
    res.extra.update(placements=agg.get("placements"), mask_comparisons=agg.get("mask_comparisons"),
                     kv_layer_comparisons=agg.get("kv_layer_comparisons"), max_abs_diff=agg.get("max_abs_diff"),
                     originals_unchanged=unchanged, **fail)
    res.extra["batched_bound"] = group_bench.batched_agreement(res, s, inproc, run_.outcomes if run_ else {})
    res.extra["scaling"] = group_bench.scaling(res, s)
    res.extra["bytes_held"] = group_bench.bytes_held(res, s, store_bytes)
    return res
