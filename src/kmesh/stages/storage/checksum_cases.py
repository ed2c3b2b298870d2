"""The storage stage's checksum cases (issue 11 items 5 and 6), configured by `storage.checksums`:

  checksum-objects              one object set per algorithm the arms use; each header records its algorithm
                                (and sha256-tree's chunk size); read back and verified
  checksums-<A>-vs-<B> (each)   matched pairs, baseline A (cpu-sha256, the write-up's check) vs each compared
                                arm B; complete restoration (outer) and its parts; every run = the reference
  checksum-overlap              the non-overlapped arm vs the same check overlapped with the reads
  checksum-corrupt              every arm refuses an object with one flipped byte; nothing left pending or held

Switched off by config, these cases are skips naming the switch (kmesh.result.Result.disabled), allowed only
where the profile says why: `storage.checksums: null` skips checksum-objects, checksums-compare (the family of
compared arms), checksum-overlap and checksum-corrupt; `compare: []` skips checksums-compare; no `overlap`
skips checksum-overlap. After checksum-objects failed, the cases that need its objects are skips saying so.

The arms are kmesh.stages.storage.checksums'. The cpu profile runs fewer pairs on fewer children here (the
stage's 60 s budget); the cuda profile decodes fewer tokens after the repair (`max_new_tokens`, with its own
in-process references) so that the GPU call stays within its time; the result records pairs, children and
tokens used.
"""
from __future__ import annotations

import dataclasses
import shutil
from typing import Any

import torch

from kmesh.bench import PairedTiming
from kmesh.errors import StageError
from kmesh.harness.child import ChildOutcome, run_child
from kmesh.harness.workload import Child
from kmesh.kv.sources import InProcessSegments
from kmesh.result import Result
from kmesh.stages.storage import checksums as sc
from kmesh.stages.storage.setup import Setup, tree_chunk_bytes
from kmesh.storage import objfile, routes


def _paired(timing: PairedTiming) -> dict[str, Any]:
    return {part: {"median_a_s": v["median_a"], "median_b_s": v["median_b"], "median_diff_s": v["median_diff"],
                   "median_ratio": v["median_ratio"], "b_faster": v["b_faster"], "pairs": v["pairs"]}
            for part, v in timing.summary().items()}


NESTING = {"outer": None, "restore": "outer", "read": "restore", "verify": "restore"}
# The compared arms' pairs (checksums-<baseline>-vs-<arm>, one per arm) when no arm is configured
COMPARE_FAMILY = "checksums-compare"
# What `storage.checksums: null` turns off: every case of this module (the warm-up is no case of its own)
DISABLED_IDS = ("checksum-objects", COMPARE_FAMILY, "checksum-overlap", "checksum-corrupt")


def _pairs_case(res: Result, case_id: str, timing_key: str, pair_run: sc.PairRun, arms: tuple[str, str],
                children: list[Child], pairs: int, warmup: int, setup: Setup) -> dict[str, Any] | None:
    """One case of matched pairs of two checksum arms; its paired summary, or None where the case failed."""
    with res.case(case_id, {"arms": list(arms), "pairs": pairs, "warmup": warmup,
                            "children": [c.name for c in children]}) as case:
        runs_before, same_before = pair_run.compared, pair_run.identical_runs
        timing = pair_run(arms[0], arms[1], children, pairs, warmup)
        res.timings[timing_key] = timing.to_dict()
        runs, same = pair_run.compared - runs_before, pair_run.identical_runs - same_before
        case.check("outputs_identical_every_run", runs > 0 and same == runs, value=[same, runs])
        case.check("nesting", timing.parents == NESTING, value=timing.parents)
        case.check("no_live_holds", setup.ctx.engine.live_holds() == 0)
        return _paired(timing)
    return None


def run_cases(res: Result, setup: Setup, refs: dict[str, ChildOutcome], pairs: int, warmup: int) -> None:
    conf = setup.sec.get("checksums")
    if conf is None:
        res.disabled("storage.checksums", None, DISABLED_IDS)
        return
    conf = dict(conf)
    baseline, compare = conf["baseline"], list(conf.get("compare", []))
    overlap = list(conf.get("overlap", []))
    if not compare:
        res.disabled("storage.checksums.compare", [], [COMPARE_FAMILY])
    if len(overlap) != 2:
        res.disabled("storage.checksums.overlap", conf.get("overlap"), ["checksum-overlap"])
    pairs, warmup = int(conf.get("pairs", pairs)), int(conf.get("warmup", warmup))
    children = setup.workload.children[:int(conf.get("children", len(setup.workload.children)))]
    names = list(dict.fromkeys([baseline, *compare, *overlap]))
    chunk = tree_chunk_bytes(setup)
    info: dict[str, Any] = {"baseline": baseline, "compare": compare, "overlap": overlap, "pairs": pairs,
                            "warmup": warmup, "children": [c.name for c in children],
                            "children_of_workload": len(setup.workload.children)}
    res.extra["checksums"] = info
    mnt = int(conf.get("max_new_tokens", setup.ctx.max_new_tokens))
    info["max_new_tokens"] = mnt
    ctx = setup.ctx
    if mnt != setup.ctx.max_new_tokens:
        # fewer decoded tokens than the route pairs: own in-process references with the same count
        ctx = dataclasses.replace(setup.ctx, max_new_tokens=mnt)
        src = InProcessSegments(setup.export)
        staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        refs = {c.name: run_child(ctx, c, src, staging, torch.empty_like(staging)) for c in children}
        if any(o.fallback is not None for o in refs.values()):
            raise StageError("checksum references fell back to recompute")
    root = setup.root / "checksums"
    with res.case("checksum-objects", {"arms": names, "tree_chunk_bytes": chunk}) as case:
        arms = {n: sc.arm_named(n, setup.device) for n in names}
        info["algorithms"] = {n: a.algorithm for n, a in arms.items()}
        sets = sc.save_sets(setup.export, root, sorted({a.algorithm for a in arms.values()}),
                            setup.sec.get("pad_to"), chunk)
        recorded = {algo: sorted({(h.algorithm, tuple(sorted(h.params.items()))) for h in o.headers})
                    for algo, o in sets.items()}
        case.record("recorded", {k: [[a, dict(p)] for a, p in v] for k, v in recorded.items()})
        case.check("headers_record_algorithm",
                   all(v == [(k, (("chunk_bytes", chunk),) if k == "sha256-tree" else ())]
                       for k, v in recorded.items()),
                   value=list(recorded))
        ok = True
        for objs in sets.values():
            for path, header in zip(objs.paths, objs.headers):
                read_header, _ = objfile.read_object(path)     # verified with the recorded algorithm
                ok &= read_header == header
        case.check("read_back_verified", ok)
    if res.cases[-1].passed is not True:
        later = ((["checksum-warmup"] if conf.get("warm_arms") else [])
                 + [f"checksums-{baseline}-vs-{arm_b}" for arm_b in compare]
                 + (["checksum-overlap"] if len(overlap) == 2 else []) + ["checksum-corrupt"])
        for case_id in later:
            res.skip_case(case_id, {}, "not run: its objects failed (see case checksum-objects)")
        return
    route = routes.build(setup.sec.get("checksum_route", "staging" if setup.device.type == "cuda" else "odirect"),
                         setup.device)
    bufs = sc.Buffers(route, max(o.total_padded for o in sets.values()), setup.export.catalog.nbytes, setup.device)
    pair_run = sc.PairRun(ctx, sets, bufs, refs, setup.device)
    try:
        if conf.get("warm_arms"):     # one untimed child per arm (kernel loads, plans) when the pairs have no warm-up
            with res.case("checksum-warmup", {"arms": names, "child": children[0].name}) as case:
                runs_before, same_before = pair_run.compared, pair_run.identical_runs
                pair_run.warm(names, children[0])
                case.check("outputs_identical", pair_run.compared - runs_before == len(names) and
                           pair_run.identical_runs - same_before == len(names))
        info["paired"] = {}
        for arm_b in compare:
            paired = _pairs_case(res, f"checksums-{baseline}-vs-{arm_b}", f"checksum_{arm_b}", pair_run,
                                 (baseline, arm_b), children, pairs, warmup, setup)
            if paired is not None:
                info["paired"][arm_b] = paired
        if len(overlap) == 2:
            paired = _pairs_case(res, "checksum-overlap", "checksum_overlap", pair_run, (overlap[0], overlap[1]),
                                 children, pairs, warmup, setup)
            if paired is not None:
                info["overlap_paired"] = paired
        with res.case("checksum-corrupt", {"object": 1, "flipped": "one payload byte", "arms": names}) as case:
            why = {}
            for name in names:
                arm = sc.arm_named(name, setup.device)
                bad = sc.corrupt_copy(sets[arm.algorithm], setup.export, root / f"corrupt-{arm.algorithm}",
                                      setup.sec.get("pad_to"))
                why[name] = sc.refused(ctx, children[0], bad, bufs, arm)
                shutil.rmtree(bad.paths[0].parent, ignore_errors=True)
            case.record("errors", why)
            case.check("every_arm_refuses", all(v is not None and "ObjectCorruptError" in v for v in why.values()),
                       value=why)
            case.check("nothing_pending_or_held",
                       not setup.ctx.engine.pending() and setup.ctx.engine.live_holds() == 0)
        info["outputs_identical"] = pair_run.compared > 0 and pair_run.identical_runs == pair_run.compared
        info["runs_compared"] = pair_run.compared
        blake = next((b for b in compare if sc.ARMS[b].algorithm == "blake3" and sc.ARMS[b].where == "gpu"), None)
        if blake is not None and blake in info["paired"]:
            outer = info["paired"][blake]["outer"]
            # issue 11's goal (reported, not a threshold): GPU BLAKE3 faster in complete restoration in every pair
            info["goal_gpu_blake3_faster_every_pair"] = outer["b_faster"] == outer["pairs"]
    finally:
        info["route"] = route.describe()      # reads and bytes over every checksum run
        bufs.close()
        route.close()
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
