"""Stage `group` (write-up §25): a request group executed layer-major, bit-identical to serial, with failure
isolation, batched group math, scaling pairs and the bytes a group holds.

Cases:
  setup                 model + workload (the equivalence stage's: same leader, 4 shared segments), leader saved
                        through a real cache service (the shared originals in its host-RAM tier)
  serial-in-process     each child alone (kmesh.harness.child.run_child), segments from inside the model process
  serial-service        each child alone, segments through the service (cross-process: memfd / CUDA IPC)
  group-layer-major     all children as one group: members × segments loads from the shared originals (16 for
                        4 × 4), every member checked by the group barrier (kmesh.stages.group.load) before any
                        restored input is released, private copies, layer-major blend_group (each finished
                        layer written back to the member's private destination blocks by an async copy), then
                        decode. K/V, logits, tokens and the mask of every layer equal both serial paths bit for bit
  comparisons-can-fail  one flipped bit of the group's K / mask / logits is caught by the same comparison
  originals-unchanged   every original re-hashed in the store equals its committed digest, after the group runs
  group-failure         the same group, child B fails after its first layer (injected), with its layer-0
                        write-back still pending (a gated copy): B drains it and recomputes fully without reuse
                        in its working cache as the failure left it (restored segments, its repaired layer:
                        recorded, and the recompute must overwrite them: tokens and K/V = the full-recompute
                        reference made before the group ran); A, C, D
                        unaffected (bit-identical to serial); afterwards the service's own counters show no
                        handle open and nothing pending
  batched-agreement     batched group math (kmesh.model.group) vs the unbatched layer-major path: rotation and
                        deviation bit-identical; K/V/logits bound measured; masks and tokens equal
  repair-matches-float64  the first members' layer-major and batched outcomes replayed in float64 by an
                        independent reference (kmesh.harness.invariants): recomputed rows, selection, logits
  scaling-<N>           matched rounds per group size (kmesh.stages.group.bench): serial, layer-major and
                        batched in every round; serial vs layer-major, serial vs batched over the same serial
                        runs; every arm's spread; peak memory per arm
  rag-setup,            (`group.rag`, required) the same scaling over the RAG-shaped workload: many retrieved
  rag-scaling-<N>       chunks, every child holding all of them in an order of its own, a short private question
  bytes-held            store bytes once + private repaired copies per child vs N; what diffs would save
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kmesh.config import Config
from kmesh.errors import KMeshError
from kmesh.harness.child import ChildOutcome, full_reference, run_child
from kmesh.harness.invariants import REFERENCE, check_replays, replay_outcome
from kmesh.harness.modelsetup import ModelSetup, SetupSpec, begin_with_setup, build_setup
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import Child, RagSpec, build_rag
from kmesh.kv.sources import InProcessSegments, ServiceSegments
from kmesh.model.quality import compare_states, flip_bit, identical, kv_error
from kmesh.reference.decoder import Float64Decoder
from kmesh.result import Case, Result
from kmesh.stages.group import bench
from kmesh.stages.group.path import GroupRun, run_group


class GroupConfigError(KMeshError):
    """The group section names a failure the group cannot have (unknown member, no layer after it)."""


@dataclass
class GroupSetup(ModelSetup):
    """workload.children[:group.children] are the group; the rest only widen the scaling runs."""

    @property
    def group(self) -> tuple[Child, ...]:
        return self.workload.children[: int(self.sec["children"])]


def make_setup(cfg: Config) -> GroupSetup:
    """The equivalence section's model under the group section's workload (widened to the largest scaling size)."""
    sec = cfg.section("group")
    model_sec = {**cfg.section("equivalence"), "model": sec["model"]}
    widest = max([int(sec["children"]), *[int(n) for n in sec["scaling"]["sizes"]]])
    base = build_setup(cfg, SetupSpec(
        section="group", key_prefix=b"kmesh-group/leader", model_sec=model_sec,
        workload={**sec["workload"], "children": widest}, repair=sec["repair"],
        max_new_tokens=int(sec["max_new_tokens"]), restore_backend=sec.get("restore_backend", "torch"),
        device=sec["device"], arrival_digest=sec.get("arrival_digest", "sha256")))
    setup = GroupSetup(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelSetup)})
    names = [child.name for child in setup.group]
    fail = sec["failure"]
    last = setup.runner.num_layers - 1
    if fail["child"] not in names or not 0 <= int(fail["after_layer"]) < last:
        raise GroupConfigError(f"group.failure: child {fail['child']!r} must be one of {names} and after_layer "
                               f"{fail['after_layer']} a layer before the model's last ({last})")
    return setup


def _serial(res: Result, setup: GroupSetup,
            svc: ServiceSide) -> tuple[dict[str, ChildOutcome], dict[str, ChildOutcome]]:
    catalog = setup.export.catalog
    staging = torch.empty(catalog.nbytes, dtype=torch.uint8, device=setup.device)
    private = torch.empty_like(staging)
    inproc: dict[str, ChildOutcome] = {}
    service: dict[str, ChildOutcome] = {}
    names = [child.name for child in setup.group]
    with res.case("serial-in-process", {"children": names}) as case:
        source = InProcessSegments(setup.export)
        for child in setup.group:
            inproc[child.name] = run_child(setup.ctx, child, source, staging, private)
        case.check("segments_used", all(o.fallback is None for o in inproc.values()),
                   value={n: o.fallback for n, o in inproc.items()})
    with res.case("serial-service", {"children": names}) as case:
        for child in setup.group:
            with svc.staging(f"serial-{child.name}") as service_staging:
                service[child.name] = run_child(
                    setup.ctx, child, ServiceSegments(svc.client, service_staging.reg, svc.after_accept),
                    service_staging.tensor, private)
        case.check("segments_used", all(o.fallback is None for o in service.values()),
                   value={n: o.fallback for n, o in service.items()})
        cmps = {n: compare_states(inproc[n], service[n]) for n in service}
        case.record("comparison", cmps)
        case.check("bit_identical_to_in_process", all(identical(x) for x in cmps.values()))
        case.check("no_service_leaks", svc.no_leaks(), value=svc.leaks())
    return inproc, service


def _compare_group(case: Case, group_run: GroupRun, refs: dict[str, dict[str, ChildOutcome]],
                   names: list[str]) -> dict[str, Any]:
    # mask_comparisons: per-layer mask comparisons made; masks_equal: how many of them found the masks equal
    agg = {"mask_comparisons": 0, "masks_equal": 0, "kv_layer_comparisons": 0, "max_abs_diff": 0.0,
           "all_identical": True}
    per: dict[str, Any] = {}
    for ref_name, ref in refs.items():
        for name in names:
            cmp = compare_states(ref[name], group_run.outcomes[name])
            per[f"{name}-vs-{ref_name}"] = cmp
            agg["mask_comparisons"] += cmp["layers"]
            agg["masks_equal"] += cmp["mask_equal_layers"]
            agg["kv_layer_comparisons"] += 2 * cmp["layers"]
            agg["max_abs_diff"] = max(agg["max_abs_diff"], cmp["max_abs_diff"])
            agg["all_identical"] &= identical(cmp)
    case.record("comparisons", per)
    return agg


def _group_case(res: Result, setup: GroupSetup, svc: ServiceSide, inproc: dict[str, ChildOutcome],
                service: dict[str, ChildOutcome]) -> tuple[dict[str, Any], GroupRun | None]:
    names = [child.name for child in setup.group]
    segments = len(setup.export.catalog.entries)
    agg: dict[str, Any] = {}
    group_run: GroupRun | None = None
    with res.case("group-layer-major", {"children": names, "segments": segments}) as case:
        group_run = run_group(setup, svc, setup.group)
        case.record("admission", group_run.admission)
        case.check("placements_loaded", group_run.loads == len(names) * segments, value=group_run.loads)
        case.check("executed_layer_major", group_run.order_layer_major)
        case.check("writeback_equals_working_cache", all(group_run.writeback_equal.values()),
                   value=group_run.writeback_equal)
        case.check("segments_used", all(o.fallback is None for o in group_run.outcomes.values()))
        agg = _compare_group(case, group_run, {"serial-in-process": inproc, "serial-service": service}, names)
        case.check("bit_identical_to_both_serial_paths", agg["all_identical"], value=agg["max_abs_diff"])
        case.check("no_service_leaks", svc.no_leaks(), value=svc.leaks())
        agg["placements"] = group_run.loads
    return agg, group_run


def _negative(res: Result, group_run: GroupRun, inproc: dict[str, ChildOutcome]) -> None:
    with res.case("comparisons-can-fail", {}) as case:
        name = next(iter(group_run.outcomes))
        base = group_run.outcomes[name]
        for field_ in ("k", "masks", "logits"):
            tensor = getattr(base, field_)
            flipped = flip_bit(tensor, 0 if tensor.dtype == torch.bool else 3)   # a mask's first element, byte 3
            cmp = compare_states(inproc[name], dataclasses.replace(base, **{field_: flipped}))
            case.check(f"{field_}_bit_flip_caught", not identical(cmp))


def _failure_case(res: Result, setup: GroupSetup, svc: ServiceSide, inproc: dict[str, ChildOutcome],
                  fulls: dict[str, ChildOutcome]) -> dict[str, Any]:
    sec = setup.sec["failure"]
    who, after = sec["child"], int(sec["after_layer"])
    out: dict[str, Any] = {"failure_case_passed": False}
    with res.case("group-failure", {"fails": who, "after_layer": after}) as case:
        group_run = run_group(setup, svc, setup.group, fail={who: after}, gated=who)
        failure = group_run.failure.get(who, {})
        case.record("failure", failure)
        ok = [case.check("failed_member_left_after_its_layer", failure.get("layer") == after,
                         value=failure.get("layer")),
              case.check("work_was_pending_at_failure", failure.get("pending_at_failure", 0) >= 1,
                         value=failure.get("pending_at_failure")),
              case.check("drained_before_recompute", "pending-before-recompute:0" in failure.get("events", [])
                         and failure.get("events", [""])[-1] == "recompute", value=failure.get("events")),
              # its working cache held its restored segments and repaired layers: the recompute ran over them
              case.check("recomputed_over_partial_state", failure.get("slots_written_before_recompute", 0) > 0,
                         value=failure.get("slots_written_before_recompute")),
              case.check("failed_member_tokens_equal_full_reference",
                         group_run.outcomes[who].tokens == fulls[who].tokens),
              case.check("failed_member_kv_equal_full_reference", torch.equal(group_run.outcomes[who].k, fulls[who].k)
                         and torch.equal(group_run.outcomes[who].v, fulls[who].v))]
        others = {n: compare_states(inproc[n], o) for n, o in group_run.outcomes.items() if n != who}
        case.record("others_vs_serial", others)
        ok.append(case.check("others_bit_identical_to_serial", all(identical(x) for x in others.values()),
                             value={n: x["first_unequal_layer"] for n, x in others.items()}))
        ok.append(case.check("executed_layer_major", group_run.order_layer_major))
        leaks = svc.leaks()
        status = svc.h.status()
        handles = leaks["registrations"] + leaks["memfd_mappings"] + leaks["cuda_handles_open"]
        pending = leaks["copies_running"] + leaks["reservations"] + len(status["requests_running"])
        case.record("service_counters", leaks)
        ok.append(case.check("handles_open_after_zero", handles == 0, value=handles))
        ok.append(case.check("pending_after_zero", pending == 0, value=pending))
        engine = setup.ctx.engine
        ok.append(case.check("engine_nothing_pending", not engine.pending() and engine.live_holds() == 0))
        out.update(failure_case_passed=all(ok), handles_open_after=handles, pending_after=pending,
                   others_mask_comparisons=sum(x["layers"] for x in others.values()),
                   others_masks_equal=sum(x["mask_equal_layers"] for x in others.values()))
    return out


def _originals_case(res: Result, setup: GroupSetup, svc: ServiceSide) -> bool:
    with res.case("originals-unchanged", {}) as case:
        now = svc.store_digests(verify=True)
        ok = case.check("every_original_hashes_as_committed",
                        all(now.get(e.key) == (e.sha256, e.sha256) for e in setup.export.catalog.entries),
                        value=len(now))
    return ok


def _invariants_case(res: Result, setup: GroupSetup, layer_major: dict[str, ChildOutcome],
                     batched: dict[str, ChildOutcome]) -> None:
    """repair-matches-float64: the first `invariants.children` members' layer-major and batched outcomes replayed
    in float64 (kmesh.harness.invariants): the group's two repair paths held to the algorithm, not to each other."""
    sec = setup.sec["invariants"]
    members = list(setup.group)[: int(sec["children"])]
    rows_bound, logits_bound = float(sec["rows_rel_bound"]), float(sec["logits_rel_bound"])
    band = float(sec.get("tie_band_factor", 4.0))
    params = {"members": [m.name for m in members], "paths": ["layer-major", "batched"], "reference": REFERENCE,
              "rows_rel_bound": rows_bound, "logits_rel_bound": logits_bound, "tie_band_factor": band}
    with res.case("repair-matches-float64", params) as case:
        runs = {(path, m): outs.get(m.name) for path, outs in (("layer-major", layer_major), ("batched", batched))
                for m in members}
        missing = sorted(f"{path}/{m.name}" for (path, m), o in runs.items() if o is None)
        if not case.check("every_outcome_present", not missing, value=missing):
            return
        dec = Float64Decoder(setup.runner.model, setup.runner.rope, setup.runner.device)
        report = {f"{path}/{m.name}": replay_outcome(dec, setup.ctx, setup.export, m, o, band)
                  for (path, m), o in runs.items() if o is not None}
        check_replays(case, report, rows_bound, logits_bound)


def _closest_case(res: Result, setup: GroupSetup, fulls: dict[str, ChildOutcome],
                  layer_major: dict[str, ChildOutcome], batched: dict[str, ChildOutcome]) -> None:
    """repair-closest-at-check-layer: the law equivalence's quality case checks, for the group's own repair paths.
    At the first check layer every earlier layer was recomputed, so the rows a repair keeps restored are off the full
    prefill by exactly their deviation: the rule's cache there is no farther from the full prefill's than that of
    chance at its budget (the repair with rows ranked by a seeded random score, RepairConfig.selection_seed) —
    rounding allowed, a millionth of naive's distance. A path that picks the wrong rows fails it by name."""
    sec = setup.sec["invariants"]
    members = list(setup.group)[: int(sec["children"])]
    seeds = range(int(sec["chance_seeds"]))
    repair = setup.ctx.repair
    layer, which = repair.check_layers[0], repair.deviation
    params = {"members": [m.name for m in members], "paths": ["layer-major", "batched"], "chance_seeds": len(seeds),
              "check_layer": layer, "tensor": which}
    with res.case("repair-closest-at-check-layer", params) as case:
        runs = {(path, m.name): outs.get(m.name) for path, outs in (("layer-major", layer_major), ("batched", batched))
                for m in members}
        missing = sorted(f"{path}/{name}" for (path, name), o in runs.items() if o is None)
        if not case.check("every_outcome_present", not missing, value=missing):
            return
        staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        private = torch.empty_like(staging)
        source = InProcessSegments(setup.export)
        rows: dict[str, Any] = {}
        for m in members:
            full = fulls[m.name]
            chance = [run_child(dataclasses.replace(setup.ctx, repair=dataclasses.replace(repair, selection_seed=s)),
                                m, source, staging, private) for s in seeds]
            naive = run_child(setup.ctx, m, source, staging, private, arm="naive")
            base = {"chance_by_seed": [kv_error(full, o, layer, which) for o in chance],
                    "naive": kv_error(full, naive, layer, which)}
            for path in ("layer-major", "batched"):
                rows[f"{path}/{m.name}"] = {"repair": kv_error(full, runs[path, m.name], layer, which), **base}
        case.check("repair_closest_to_full_at_its_check_layer",
                   all(r["repair"] <= min(r["chance_by_seed"]) + 1e-6 * r["naive"] for r in rows.values()),
                   value=rows)


def run(cfg: Config) -> Result:
    res, setup = begin_with_setup("group", cfg, make_setup, model=cfg.section("group")["model"])
    if setup is None:
        return res
    res.extra.update(model=setup.what, device=str(setup.device), children=len(setup.group),
                     layers=setup.runner.num_layers)
    fulls = {child.name: full_reference(setup.ctx, child) for child in setup.group}
    catalog = setup.export.catalog
    with ServiceSide.start(setup.export, setup.device, float(setup.sec["heartbeat_timeout_s"]),
                           int(setup.sec["chunk_bytes"])) as svc:
        with res.case("leader-save", {"objects": len(catalog.entries)}) as case:
            saved = svc.save_leader()
            case.check("store_digests_equal_catalog", all(saved[e.key] == e.sha256 for e in catalog.entries))
        store_bytes = int(svc.h.status()["store"]["used_bytes"])
        inproc, service = _serial(res, setup, svc)
        agg, group_run = _group_case(res, setup, svc, inproc, service)
        if group_run is not None:
            _negative(res, group_run, inproc)
        fail = _failure_case(res, setup, svc, inproc, fulls)
        unchanged = _originals_case(res, setup, svc)
    res.extra.update(placements=agg.get("placements"), mask_comparisons=agg.get("mask_comparisons"),
                     masks_equal=agg.get("masks_equal"),
                     kv_layer_comparisons=agg.get("kv_layer_comparisons"), max_abs_diff=agg.get("max_abs_diff"),
                     originals_unchanged=unchanged, **fail)
    res.extra["batched_bound"], batched = bench.batched_agreement(res, setup, inproc,
                                                                  group_run.outcomes if group_run else {})
    _invariants_case(res, setup, group_run.outcomes if group_run else {}, batched)
    _closest_case(res, setup, fulls, group_run.outcomes if group_run else {}, batched)
    res.extra["scaling"] = bench.scaling(res, setup)
    res.extra["bytes_held"] = bench.bytes_held(res, setup, store_bytes)
    res.extra["rag_scaling"] = _rag_scaling(res, setup)   # group.rag is required: its cases cannot be configured away
    return res


def rag_setup(setup: GroupSetup) -> GroupSetup:
    """The same model over the RAG-shaped workload of `group.rag.workload` (its leader prefilled and exported
    like the stage's own), for the rag-scaling cases."""
    rag = setup.sec["rag"]
    widest = max(int(n) for n in rag["sizes"])
    spec = RagSpec(**{**rag["workload"], "children": widest})
    workload = build_rag(setup.tok, setup.cfg.seed, spec)
    export = setup.export_leader(workload, b"kmesh-group/rag")
    return dataclasses.replace(setup, workload=workload, export=export,
                               ctx=dataclasses.replace(setup.ctx, catalog=export.catalog))


def _rag_scaling(res: Result, setup: GroupSetup) -> dict[str, Any]:
    rag: GroupSetup | None = None
    with res.case("rag-setup", {"workload": setup.sec["rag"]["workload"], "sizes": setup.sec["rag"]["sizes"]}) as case:
        rag = rag_setup(setup)
        restorable = min(len(c.restored_positions()) / len(c.ids) for c in rag.workload.children)
        case.record("workload", {"chunks": len(rag.workload.segments), "prompt_tokens": rag.workload.spec.prompt_tokens,
                                 "restorable_fraction": restorable, "sha256": rag.workload.sha256()})
        case.check("restorable_fraction_at_least_min", restorable >= rag.workload.spec.min_restorable,
                   value=restorable)
    if rag is None:
        return {}
    return bench.scaling(res, rag, sizes=[int(n) for n in setup.sec["rag"]["sizes"]], case_prefix="rag-scaling",
                         timing_prefix="group_rag")
