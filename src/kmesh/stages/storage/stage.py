"""Stage `storage` (write-up §24, second half): the children of the equivalence workload restore their shared
segments from object files on disk through two storage routes, in matched pairs, with outputs bit-identical to
the in-process reference; plus the raw O_DIRECT floor and read-once serving.

Cases:
  setup                 model, workload and leader export exactly as the equivalence stage builds them
  objects-saved         one object file per segment (kmesh.storage.objfile): sizes, padding, digests, read back
  routes                the two arms as built here and what they run (I/O call, O_DIRECT, cuFile mode)
  reference             every child through kmesh.harness.child.run_child from the in-process source
  arrival-<arm> (2)     poisoned landing + private buffers, objects holding the COMPLEMENT of the segment bytes:
                        what arrives is exactly those bytes, read by the route under test (bytes counted)
  control-<bad file>    wrong magic / version, short file, digest mismatch, lying header, replaced while open,
                        missing: the specific storage error, the child recomputes (run_child) = full reference
                        (arrival and controls: kmesh.stages.storage.controls)
  pairs                 7 matched pairs alternating order, 4 children per arm, page cache dropped before every
                        child; parts read ⊂ check ⊂ restore ⊂ outer; every run compared bit for bit
  floor                 the staging arm's restore vs the same bytes read with O_DIRECT alone (matched pairs)
  floor-io              that O_DIRECT floor read through io_uring vs os.preadv (same bytes, matched pairs); a
                        skip with the probe's reason where io_uring cannot run (both: kmesh.stages.storage.floor)
  checksum-*            checksum arms (CPU SHA-256 vs GPU SHA-256 / sha256-tree / BLAKE3) and the hash
                        overlapped with the reads, matched pairs (kmesh.stages.storage.checksum_cases)
  read-once             four concurrent children, singleflight + retention vs forced eviction; reads counted;
                        every child's private copy = the leader's bytes (kmesh.stages.storage.readonce)
  read-once-service     the same through the cache service process: its disk tier, group retention, four
                        client connections loading at once; disk reads counted by the service
                        (kmesh.stages.storage.service)

A case that cannot run here, or that a switch turns off (read_once_service: false, checksums: null), is a skip
with the reason (kmesh.result: Result.skip_case / Result.disabled), allowed only by the profile's allow_skips.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kmesh.bench import Intervals, run_pairs
from kmesh.config import Config
from kmesh.errors import StageError
from kmesh.harness.child import ChildOutcome, run_child
from kmesh.harness.modelsetup import begin_with_setup
from kmesh.harness.workload import Child
from kmesh.kv.sources import InProcessSegments
from kmesh.model.quality import compare_states, identical
from kmesh.result import Result
from kmesh.stages.storage import checksum_cases, controls, floor, readonce, service
from kmesh.stages.storage.child import timed_child
from kmesh.stages.storage.objects import ObjectSet, save_objects
from kmesh.stages.storage.setup import Setup, paired_summary, storage_setup, timing_device
from kmesh.storage import cufile, objfile, routes, uring
from kmesh.storage.errors import RouteUnavailableError


def _objects_case(res: Result, setup: Setup) -> ObjectSet:
    pad_to = setup.sec.get("pad_to")
    with res.case("objects-saved", {"algorithm": setup.sec["algorithm"], "pad_to": pad_to,
                                    "directory": str(setup.root)}) as case:
        shutil.rmtree(setup.root, ignore_errors=True)
        objs = save_objects(setup.export, setup.root / "segments", setup.sec["algorithm"], pad_to)
        case.record("objects", objs.describe())
        raw = setup.export.raw.cpu()
        ok = True
        for entry, path, header in zip(objs.catalog.entries, objs.paths, objs.headers):
            read_header, payload = objfile.read_object(path)
            ok &= read_header == header and \
                bytes(payload[:entry.nbytes]) == raw[entry.offset:entry.offset + entry.nbytes].numpy().tobytes()
        case.check("read_back_equal", ok)
        case.check("padded_4k", all(h.padded_nbytes % objfile.ALIGN == 0 for h in objs.headers))
        if pad_to:
            case.check("padded_to_size", all(h.padded_nbytes == pad_to for h in objs.headers),
                       value=[h.padded_nbytes for h in objs.headers])
        case.check("files_on_disk_sizes",
                   all(os.path.getsize(p) == h.file_nbytes for p, h in zip(objs.paths, objs.headers)))
        return objs
    raise StageError("objects could not be saved")


def _build_arms(names: list[str], setup: Setup, probe_dir: Path) -> tuple[dict[str, routes.Route], dict[str, str]]:
    built: dict[str, routes.Route] = {}
    missing: dict[str, str] = {}
    for name in names:
        try:
            route = routes.build(name, setup.device, probe_dir=probe_dir, io=setup.io)
        except RouteUnavailableError as e:
            missing[name] = str(e)
            continue
        built[route.arm] = route
    return built, missing


def _routes_case(res: Result, setup: Setup, objs: ObjectSet) -> tuple[dict[str, routes.Route], dict[str, Any]]:
    """The requested arms; where one cannot run here (e.g. cuFile cannot register a file in the objects'
    directory), the profile's `fallback_arms` run instead and the result says so: never under the lost arm's name."""
    probe_dir = objs.paths[0].parent
    mode = (cufile.detect(probe_dir=probe_dir) if setup.device.type == "cuda"
            else cufile.unavailable("cpu profile: no CUDA device"))
    info: dict[str, Any] = {"direct_mode": {"mode": mode.mode, "arm": mode.arm, "reason": mode.reason,
                                            "props": mode.props}}
    with res.case("routes", {"requested": setup.sec["arms"], "device": str(setup.device),
                             "fallback_arms": setup.sec.get("fallback_arms"),
                             "io": dataclasses.asdict(setup.io)}) as case:
        case.record("io_uring_probe", uring.probe().as_dict())
        built, missing = _build_arms(list(setup.sec["arms"]), setup, probe_dir)
        for name, why in missing.items():
            case.record(f"unavailable:{name}", why)
        info["unavailable"] = missing
        if missing and setup.sec.get("fallback_arms"):
            for route in built.values():
                route.close()
            built, fallback_missing = _build_arms(list(setup.sec["fallback_arms"]), setup, probe_dir)
            info["fallback"] = {"requested": list(setup.sec["arms"]), "ran": list(built), "why": missing,
                                "fallback_unavailable": fallback_missing,
                                "comparison": setup.sec.get("fallback_note", "the profile's fallback arms")}
            case.record("fallback", info["fallback"])
        case.record("arms", {arm: route.describe() for arm, route in built.items()})
        info["io_engine"] = {arm: route.describe()["io_engine"]["engine"] for arm, route in built.items()}
        case.record("io_engine", info["io_engine"])
        case.check("two_arms_built", len(built) == 2, value=list(built))
        if setup.device.type == "cuda":
            case.check("direct_arm_named_by_mode", all(arm != "direct" for arm in built), value=list(built))
    return built, info


def _references(res: Result, setup: Setup) -> dict[str, ChildOutcome]:
    refs: dict[str, ChildOutcome] = {}
    with res.case("reference", {"source": "in-process", "runner": "kmesh.harness.child.run_child"}) as case:
        src = InProcessSegments(setup.export)
        staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        private = torch.empty_like(staging)
        for child in setup.workload.children:
            refs[child.name] = run_child(setup.ctx, child, src, staging, private)
        case.check("reference_used_segments", all(o.fallback is None for o in refs.values()))
    return refs


def _pairs_case(res: Result, setup: Setup, objs: ObjectSet, built: dict[str, routes.Route],
                refs: dict[str, ChildOutcome], pairs: int, warmup: int) -> tuple[int, int]:
    """The two route arms in matched pairs; returns (runs identical to the reference, runs compared)."""
    (a_name, _), (b_name, _) = built.items()
    landings = {arm: route.landing(objs.total_padded) for arm, route in built.items()}
    private = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
    identical_runs, compared = 0, 0

    def run_arm(arm: str, child: Child, iv: Intervals) -> None:
        nonlocal identical_runs, compared
        out = timed_child(setup.ctx, child, objs, built[arm], landings[arm], private, iv)
        compared += 1
        identical_runs += identical(compare_states(refs[child.name], out))

    with res.case("pairs", {"arms": [a_name, b_name], "pairs": pairs, "warmup": warmup,
                            "between": "page cache dropped (POSIX_FADV_DONTNEED) before every child"}) as case:
        timing = run_pairs(run_arm, (a_name, b_name), setup.workload.children, pairs=pairs, warmup=warmup,
                           device=timing_device(setup), between=lambda: routes.drop_page_cache(objs.paths),
                           progress=False)
        res.timings["routes"] = timing.to_dict()
        case.check("outputs_identical_every_run", identical_runs == compared, value=[identical_runs, compared])
        case.check("nesting_read_check_restore_outer", timing.parents == {"outer": None, "restore": "outer",
                                                                          "check": "restore", "read": "check"},
                   value=timing.parents)
        case.check("no_live_holds", setup.ctx.engine.live_holds() == 0)
        res.extra["paired"] = paired_summary(timing)
    res.extra["pairs"] = pairs
    res.extra["runs_compared"] = compared
    return identical_runs, compared


def run(cfg: Config) -> Result:
    res, setup = begin_with_setup("storage", cfg, storage_setup)
    if setup is None:
        return res
    timing_cfg = cfg.section("timing")
    pairs = int(setup.sec.get("pairs", timing_cfg["pairs"]))
    warmup = int(setup.sec.get("warmup", timing_cfg["warmup"]))
    res.extra.update(model=setup.what, device=str(setup.device), children=len(setup.workload.children),
                     max_new_tokens=setup.ctx.max_new_tokens)
    objs = _objects_case(res, setup)
    res.extra["object_bytes"] = {"payload": [h.payload_nbytes for h in objs.headers],
                                 "padded": [h.padded_nbytes for h in objs.headers],
                                 "per_child_padded": objs.total_padded}
    res.extra["notes"] = {
        "object_sizes": (f"objects padded to {setup.sec['pad_to']} B (the write-up's 3 MiB)" if setup.sec.get("pad_to")
                         else "objects are the real segment sizes of this profile's model, padded to 4 KiB only"),
        "eviction": "before every child: the object files' pages dropped from the OS page cache "
                    "(POSIX_FADV_DONTNEED); the route arms keep no RAM-tier copy, so every child reads the disk",
        "io": routes.IO_NOTE,
        "max_new_tokens": setup.ctx.max_new_tokens,
    }
    built, info = _routes_case(res, setup, objs)
    res.extra.update(arms=list(built), direct_mode=info["direct_mode"], unavailable=info.get("unavailable", {}),
                     io_settings=dataclasses.asdict(setup.io), io_uring_probe=uring.probe().as_dict())
    if "fallback" in info:
        res.extra["arms_fallback"] = info["fallback"]

    refs = _references(res, setup)
    arrivals = [controls.arrival_case(res, setup, route) for route in built.values()]
    res.extra["arrival_checks_passed"] = sum(arrivals)
    controls.unavailable_arrival_cases(res, info.get("unavailable", {}))
    if built:
        res.extra["failure_controls_passed"] = controls.control_cases(res, setup, next(iter(built.values())))

    if len(built) == 2:
        identical_runs, compared = _pairs_case(res, setup, objs, built, refs, pairs, warmup)
    else:
        identical_runs, compared = 0, 0
        res.skip_case("pairs", {"arms": list(built)}, f"two arms needed, {len(built)} built here (see case routes)")
    floor_arm = setup.sec["floor_arm"]
    if floor_arm in built:   # also when the other arm could not be built here: the floor still says much
        floor.floor_case(res, setup, objs, built, pairs, warmup, refs)
    else:
        res.skip_case("floor", {"arm": floor_arm}, f"storage.floor_arm: {floor_arm!r} was not built here "
                      f"(arms built: {list(built)}; why: {info.get('unavailable', {}).get(floor_arm, 'not an arm')})")
    floor.floor_io_case(res, setup, objs, pairs, warmup)
    # per arm, the engine that actually ran its reads (after every timed case)
    res.extra["io_engine"] = {arm: route.describe()["io_engine"] for arm, route in built.items()}
    res.extra["outputs_identical"] = compared > 0 and identical_runs == compared
    checksum_cases.run_cases(res, setup, refs, pairs, warmup)
    readonce.read_once_case(res, setup, pairs, warmup)
    if setup.sec.get("read_once_service", True):
        service.read_once_service_case(res, setup, refs, pairs, warmup)
    else:
        res.disabled("storage.read_once_service", False, ["read-once-service"])
    for route in built.values():
        route.close()
    gc.collect()
    return res
