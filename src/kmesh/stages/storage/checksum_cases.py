"""The storage stage's checksum cases (issue 11 items 5 and 6), configured by `storage.checksums`:

  checksum-objects              one object set per algorithm the arms use; each header records its algorithm
                                (and sha256-tree's chunk size); read back and verified
  checksums-<A>-vs-<B> (each)   matched pairs, baseline A (cpu-sha256, the write-up's check) vs each compared
                                arm B; complete restoration (outer) and its parts; every run = the reference
  checksum-overlap              the non-overlapped arm vs the same check overlapped with the reads
  checksum-corrupt              every arm refuses an object with one flipped byte; nothing left pending or held

The arms are kmesh.stages.storage_checksums'. The cpu profile runs fewer pairs on fewer children here (the
stage's 60 s budget); the cuda profile decodes fewer tokens after the repair (`max_new_tokens`, with its own
in-process references) so that the GPU call stays within its time; the result records pairs, children and
tokens used.
"""
from __future__ import annotations

import dataclasses
import shutil
from typing import Any

import torch

from kmesh.child import ChildOutcome, run_child
from kmesh.errors import StageError
from kmesh.result import Result
from kmesh.segments import InProcessSegments
from kmesh.stages import storage_checksums as sc
from kmesh.storage import objfile, routes


def _paired(t: Any) -> dict[str, Any]:
    return {part: {"median_a_s": v["median_a"], "median_b_s": v["median_b"], "median_diff_s": v["median_diff"],
                   "median_ratio": v["median_ratio"], "b_faster": v["b_faster"], "pairs": v["pairs"]}
            for part, v in t.summary().items()}


NESTING = {"outer": None, "restore": "outer", "read": "restore", "verify": "restore"}


def tree_chunk_bytes(s: Any) -> int:
    """The sha256-tree chunk size of the stage's object sets: storage.checksums, else the integrity section's."""
    conf = dict(s.sec.get("checksums") or {})
    return int(conf.get("tree_chunk_bytes", s.cfg.section("integrity").get("tree_chunk_bytes", 65536)))


def run_cases(res: Result, s: Any, refs: dict[str, ChildOutcome], pairs: int, warmup: int) -> None:
    conf = dict(s.sec.get("checksums") or {})
    if not conf:
        return
    baseline, compare = conf["baseline"], list(conf.get("compare", []))
    overlap = list(conf.get("overlap", []))
    pairs, warmup = int(conf.get("pairs", pairs)), int(conf.get("warmup", warmup))
    children = s.workload.children[:int(conf.get("children", len(s.workload.children)))]
    names = list(dict.fromkeys([baseline, *compare, *overlap]))
    chunk = tree_chunk_bytes(s)
    info: dict[str, Any] = {"baseline": baseline, "compare": compare, "overlap": overlap, "pairs": pairs,
                            "warmup": warmup, "children": [c.name for c in children],
                            "children_of_workload": len(s.workload.children)}
    res.extra["checksums"] = info
    mnt = int(conf.get("max_new_tokens", s.ctx.max_new_tokens))
    info["max_new_tokens"] = mnt
    ctx = s.ctx
    if mnt != s.ctx.max_new_tokens:
        # fewer decoded tokens than the route pairs: own in-process references with the same count
        ctx = dataclasses.replace(s.ctx, max_new_tokens=mnt)
        src = InProcessSegments(s.export)
        st = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
        refs = {c.name: run_child(ctx, c, src, st, torch.empty_like(st)) for c in children}
        if any(o.fallback is not None for o in refs.values()):
            raise StageError("checksum references fell back to recompute")
    root = s.root / "checksums"
    with res.case("checksum-objects", {"arms": names, "tree_chunk_bytes": chunk}) as c:
        arms = {n: sc.arm(n, s.device) for n in names}
        info["algorithms"] = {n: a.algorithm for n, a in arms.items()}
        sets = sc.save_sets(s.export, root, sorted({a.algorithm for a in arms.values()}), s.sec.get("pad_to"),
                            chunk)
        recorded = {algo: sorted({(h.algorithm, tuple(sorted(h.params.items()))) for h in o.headers})
                    for algo, o in sets.items()}
        c.record("recorded", {k: [[a, dict(p)] for a, p in v] for k, v in recorded.items()})
        c.check("headers_record_algorithm", all(v == [(k, (("chunk_bytes", chunk),) if k == "sha256-tree" else ())]
                                                for k, v in recorded.items()), value=list(recorded))
        ok = True
        for o in sets.values():
            for p, h in zip(o.paths, o.headers):
                h2, _ = objfile.read_object(p)     # verified with the recorded algorithm
                ok &= h2 == h
        c.check("read_back_verified", ok)
    if res.cases[-1].passed is not True:
        return
    route = routes.build(s.sec.get("checksum_route", "staging" if s.device.type == "cuda" else "odirect"), s.device)
    bufs = sc.Buffers(route, max(o.total_padded for o in sets.values()), s.export.catalog.nbytes, s.device)
    run = sc.PairRun(ctx, sets, bufs, refs, s.device)
    try:
        if conf.get("warm_arms"):     # one untimed child per arm (kernel loads, plans) when the pairs have no warm-up
            with res.case("checksum-warmup", {"arms": names, "child": children[0].name}) as c:
                n0, same0 = run.compared, run.identical_runs
                run.warm(names, children[0])
                c.check("outputs_identical", run.compared - n0 == len(names) and
                        run.identical_runs - same0 == len(names))
        info["paired"] = {}
        for b in compare:
            with res.case(f"checksums-{baseline}-vs-{b}", {"arms": [baseline, b], "pairs": pairs, "warmup": warmup,
                                                          "children": info["children"]}) as c:
                before = (run.compared, run.identical_runs)
                t = run(baseline, b, children, pairs, warmup)
                res.timings[f"checksum_{b}"] = t.to_dict()
                n, same = run.compared - before[0], run.identical_runs - before[1]
                c.check("outputs_identical_every_run", n > 0 and same == n, value=[same, n])
                c.check("nesting", t.parents == NESTING, value=t.parents)
                c.check("no_live_holds", s.ctx.engine.live_holds() == 0)
                info["paired"][b] = _paired(t)
        if len(overlap) == 2:
            with res.case("checksum-overlap", {"arms": overlap, "pairs": pairs, "warmup": warmup,
                                               "children": info["children"]}) as c:
                before = (run.compared, run.identical_runs)
                t = run(overlap[0], overlap[1], children, pairs, warmup)
                res.timings["checksum_overlap"] = t.to_dict()
                n, same = run.compared - before[0], run.identical_runs - before[1]
                c.check("outputs_identical_every_run", n > 0 and same == n, value=[same, n])
                c.check("nesting", t.parents == NESTING, value=t.parents)
                c.check("no_live_holds", s.ctx.engine.live_holds() == 0)
                info["overlap_paired"] = _paired(t)
        with res.case("checksum-corrupt", {"object": 1, "flipped": "one payload byte", "arms": names}) as c:
            why = {}
            for n in names:
                a = sc.arm(n, s.device)
                bad = sc.corrupt_copy(sets[a.algorithm], s.export, root / f"corrupt-{a.algorithm}",
                                      s.sec.get("pad_to"))
                why[n] = sc.refused(ctx, children[0], bad, bufs, a)
                shutil.rmtree(bad.paths[0].parent, ignore_errors=True)
            c.record("errors", why)
            c.check("every_arm_refuses", all(v is not None and "ObjectCorruptError" in v for v in why.values()),
                    value=why)
            c.check("nothing_pending_or_held", not s.ctx.engine.pending() and s.ctx.engine.live_holds() == 0)
        info["outputs_identical"] = run.compared > 0 and run.identical_runs == run.compared
        info["runs_compared"] = run.compared
        blake = next((b for b in compare if sc.ARMS[b].algorithm == "blake3" and sc.ARMS[b].where == "gpu"), None)
        if blake is not None and blake in info["paired"]:
            o = info["paired"][blake]["outer"]
            # issue 11's goal (reported, not a threshold): GPU BLAKE3 faster in complete restoration in every pair
            info["goal_gpu_blake3_faster_every_pair"] = o["b_faster"] == o["pairs"]
    finally:
        info["route"] = route.describe()      # reads and bytes over every checksum run
        bufs.close()
        route.close()
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
