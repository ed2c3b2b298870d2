"""Stage `storage` (write-up §24, second half): the children of the equivalence workload restore their shared
segments from object files on disk through two storage routes, in matched pairs, with outputs bit-identical to
the in-process reference; plus the raw O_DIRECT floor and read-once serving.

Cases:
  setup                 model, workload and leader export exactly as the equivalence stage builds them
  objects-saved         one object file per segment (kmesh.storage.objfile): sizes, padding, digests, read back
  routes                the two arms as built here and what they run (I/O call, O_DIRECT, cuFile mode)
  reference             every child through kmesh.child.run_child from the in-process source
  arrival-<arm> (2)     poisoned landing + private buffers, objects holding the COMPLEMENT of the segment bytes:
                        what arrives is exactly those bytes, read by the route under test (bytes counted)
  control-<bad file>    wrong magic / version, short file, digest mismatch, lying header, replaced while open,
                        missing: the specific storage error, the child recomputes (run_child) = full reference
  pairs                 7 matched pairs alternating order, 4 children per arm, page cache dropped before every
                        child; parts read ⊂ check ⊂ restore ⊂ outer; every run compared bit for bit
  floor                 the staging arm's restore vs the same bytes read with O_DIRECT alone (matched pairs)
  floor-io              that O_DIRECT floor read through io_uring vs os.preadv (same bytes, matched pairs); a
                        skip with the probe's reason where io_uring cannot run
  checksum-*            checksum arms (CPU SHA-256 vs GPU SHA-256 / sha256-tree / BLAKE3) and the hash
                        overlapped with the reads, matched pairs (kmesh.stages.storage_checksum_cases)
  read-once             four concurrent children, singleflight + retention vs forced eviction; reads counted;
                        every child's private copy = the leader's bytes (kmesh.storage.tier, threads)
  read-once-service     the same through the cache service process: its disk tier, group retention, four
                        client connections loading at once; disk reads counted by the service
"""
from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

from kmesh.bench import Intervals, run_pairs
from kmesh.child import (ChildContext, ChildOutcome, check_canaries, full_reference, new_cache, prefill_and_decode,
                         run_child)
from kmesh.config import Config
from kmesh.errors import StageError
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import compare_states, identical
from kmesh.model.runner import LayerRunner
from kmesh.result import Result
from kmesh.modelsetup import ModelSetup, SetupSpec, begin_with_setup, build_setup
from kmesh.segments import InProcessSegments, restore_child
from kmesh.service.harness import Harness
from kmesh.stages import storage_checksum_cases, storage_floor, storage_readonce, storage_service
from kmesh.stages.storage_child import release_checked, route_restore, timed_child
from kmesh.stages.storage_objects import ObjectSet, StorageSegments, save_objects
from kmesh.storage import cufile, objfile, routes, uring
from kmesh.storage.errors import RouteUnavailableError, StorageError
from kmesh.storage.tier import TieredObjects
from kmesh.transfer.engine import TransferEngine
from kmesh.workload import WorkloadSpec, build


@dataclasses.dataclass
class Setup(ModelSetup):
    root: Path = Path()                            # where the stage's object files live
    io: routes.IOSettings = routes.IOSettings()


def _setup(cfg: Config) -> Setup:
    eq, sec = cfg.section("equivalence"), cfg.section("storage")
    base = build_setup(cfg, SetupSpec(
        section="storage", key_prefix=b"kmesh-storage/leader", model_sec=eq, workload=eq.get("workload", {}),
        repair=eq["repair"], max_new_tokens=int(sec["max_new_tokens"]),
        restore_backend=eq.get("restore_backend", "torch"), device=sec["device"]))
    root = Path(sec["objects_dir"]) if sec.get("objects_dir") else cfg.results_dir / cfg.profile / "storage" / "objects"
    return Setup(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelSetup)}, root=root,
                 io=routes.IOSettings.of(sec.get("io")))


def _objects_case(res: Result, s: Setup) -> ObjectSet:
    pad_to = s.sec.get("pad_to")
    with res.case("objects-saved", {"algorithm": s.sec["algorithm"], "pad_to": pad_to,
                                    "directory": str(s.root)}) as c:
        shutil.rmtree(s.root, ignore_errors=True)
        objs = save_objects(s.export, s.root / "segments", s.sec["algorithm"], pad_to)
        c.record("objects", objs.describe())
        raw = s.export.raw.cpu()
        ok = True
        for e, p, h in zip(objs.catalog.entries, objs.paths, objs.headers):
            h2, buf = objfile.read_object(p)
            ok &= h2 == h and bytes(buf[:e.nbytes]) == raw[e.offset:e.offset + e.nbytes].numpy().tobytes()
        c.check("read_back_equal", ok)
        c.check("padded_4k", all(h.padded_nbytes % objfile.ALIGN == 0 for h in objs.headers))
        if pad_to:
            c.check("padded_to_size", all(h.padded_nbytes == pad_to for h in objs.headers),
                    value=[h.padded_nbytes for h in objs.headers])
        c.check("files_on_disk_sizes",
                all(os.path.getsize(p) == h.file_nbytes for p, h in zip(objs.paths, objs.headers)))
        return objs
    raise StageError("objects could not be saved")


def _build_arms(names: list[str], s: Setup, probe_dir: Path) -> tuple[dict[str, routes.Route], dict[str, str]]:
    built: dict[str, routes.Route] = {}
    missing: dict[str, str] = {}
    for name in names:
        try:
            r = routes.build(name, s.device, probe_dir=probe_dir, io=s.io)
        except RouteUnavailableError as e:
            missing[name] = str(e)
            continue
        built[r.arm] = r
    return built, missing


def _routes_case(res: Result, s: Setup, objs: ObjectSet) -> tuple[dict[str, routes.Route], dict[str, Any]]:
    """The requested arms; where one cannot run here (e.g. cuFile cannot register a file in the objects'
    directory), the profile's `fallback_arms` run instead and the result says so: never under the lost arm's name."""
    probe_dir = objs.paths[0].parent
    mode = (cufile.detect(probe_dir=probe_dir) if s.device.type == "cuda"
            else cufile.unavailable("cpu profile: no CUDA device"))
    info: dict[str, Any] = {"direct_mode": {"mode": mode.mode, "arm": mode.arm, "reason": mode.reason,
                                            "props": mode.props}}
    with res.case("routes", {"requested": s.sec["arms"], "device": str(s.device),
                             "fallback_arms": s.sec.get("fallback_arms"), "io": dataclasses.asdict(s.io)}) as c:
        c.record("io_uring_probe", uring.probe().as_dict())
        built, missing = _build_arms(list(s.sec["arms"]), s, probe_dir)
        for name, why in missing.items():
            c.record(f"unavailable:{name}", why)
        info["unavailable"] = missing
        if missing and s.sec.get("fallback_arms"):
            for r in built.values():
                r.close()
            built, fb_missing = _build_arms(list(s.sec["fallback_arms"]), s, probe_dir)
            info["fallback"] = {"requested": list(s.sec["arms"]), "ran": list(built), "why": missing,
                                "fallback_unavailable": fb_missing,
                                "comparison": s.sec.get("fallback_note", "the profile's fallback arms")}
            c.record("fallback", info["fallback"])
        c.record("arms", {a: r.describe() for a, r in built.items()})
        info["io_engine"] = {a: r.describe()["io_engine"]["engine"] for a, r in built.items()}
        c.record("io_engine", info["io_engine"])
        c.check("two_arms_built", len(built) == 2, value=list(built))
        if s.device.type == "cuda":
            c.check("direct_arm_named_by_mode", all(a != "direct" for a in built), value=list(built))
    return built, info


def _unavailable_arrival_cases(res: Result, missing: dict[str, str]) -> None:
    """The arrival check of an arm that could not run is a skip with exactly the reason the arm is missing
    (allowed only where the profile's allow_skips names it)."""
    for name, why in missing.items():
        with res.case(f"arrival-{name}", {"route": name}) as c:
            c.skip(why)


def _arrival_case(res: Result, s: Setup, objs: ObjectSet, route: routes.Route) -> bool:
    with res.case(f"arrival-{route.arm}", {"poison": [0xA5, 0x5A], "objects": "complemented segment bytes"}) as c:
        comp = save_objects(s.export, s.root / "arrival", s.sec["algorithm"], s.sec.get("pad_to"),
                            transform=lambda t: t ^ 0xFF)
        landing = route.landing(comp.total_padded)
        private = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
        landing.fill_(0xA5)
        private.fill_(0x5A)
        routes.drop_page_cache(comp.paths)
        before = route.bytes_read
        owner = f"arrival-{route.arm}"
        route_restore(s.ctx, s.workload.children[0], comp, route, landing, private, None, owner)
        release_checked(s.ctx, owner, landing, private)
        want = (s.export.raw ^ 0xFF).to(s.device)
        c.check("private_holds_complemented_bytes", bool(torch.equal(private, want)))
        c.check("not_the_export_bytes", not bool(torch.equal(private, s.export.raw.to(s.device))))
        c.check("route_read_every_padded_byte", route.bytes_read - before == comp.total_padded,
                value={"read": route.bytes_read - before, "padded": comp.total_padded})
        pads = [landing[sl + h.payload_nbytes:sl + h.padded_nbytes] for sl, h in zip(comp.slots, comp.headers)]
        c.check("landing_padding_arrived_zero", all(not bool(p.any()) for p in pads))
        shutil.rmtree(s.root / "arrival", ignore_errors=True)
    return res.cases[-1].passed is True


def _bad_files(objs: ObjectSet) -> dict[str, Any]:
    """name -> (mutate(path), expected storage error name); object 1 of a copy is damaged."""
    def raw_edit(fn):
        def go(p: Path) -> None:
            b = bytearray(p.read_bytes())
            fn(b)
            p.write_bytes(bytes(b))
        return go

    def lie(p: Path) -> None:          # a consistent header (valid own checksum) that understates the payload
        import hashlib
        import json
        b = bytearray(p.read_bytes())
        _, ver, n, _ = struct.unpack_from("<8sII32s", b)
        d = json.loads(b[48:48 + n])
        d["padded_nbytes"] -= objfile.ALIGN
        body = json.dumps(d, sort_keys=True).encode()
        head = struct.pack("<8sII32s", objfile.MAGIC, ver, len(body), hashlib.sha256(body).digest()) + body
        b[:objfile.HEADER_BYTES] = head.ljust(objfile.HEADER_BYTES, b"\0")
        p.write_bytes(bytes(b))

    def flip_at(i: int):
        def f(b: bytearray) -> None:
            b[i] ^= 0x01
        return f

    return {
        "wrong-magic": (raw_edit(flip_at(0)), "BadMagicError"),
        "wrong-version": (raw_edit(lambda b: struct.pack_into("<I", b, 8, objfile.VERSION + 1)), "BadVersionError"),
        "short-file": (lambda p: os.truncate(p, os.path.getsize(p) - objfile.ALIGN), "ShortFileError"),
        "digest-mismatch": (raw_edit(flip_at(objfile.HEADER_BYTES + 1000)), "ObjectCorruptError"),
        "lying-header": (lie, "HeaderLieError"),
        "replaced-while-open": (None, "ObjectReplacedError"),
        "missing": (lambda p: p.unlink(), "ObjectNotFoundError"),
    }


def _control_cases(res: Result, s: Setup, objs: ObjectSet, route: routes.Route) -> int:
    child = s.workload.children[0]
    full = full_reference(s.ctx, child)
    staging = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
    private = torch.empty_like(staging)
    passed = 0
    for name, (mutate, err) in _bad_files(objs).items():
        with res.case(f"control-{name}", {"object": 1, "route": route.arm, "expect": err}) as c:
            d = s.root / f"control-{name}"
            shutil.rmtree(d, ignore_errors=True)
            bad = save_objects(s.export, d, s.sec["algorithm"], s.sec.get("pad_to"))
            after_read = None
            if mutate is not None:
                mutate(bad.paths[1])
            else:   # another object renamed over the path after it was opened and read
                def after_read(i: int, f: Any) -> None:
                    if i == 1:
                        objfile.write_object(bad.paths[1], b"\0" * 8192, bad.headers[1].key)
            out = run_child(s.ctx, child, StorageSegments(bad, route, after_read), staging, private)
            c.record("outcome", out.describe())
            c.check("fell_back", out.fallback is not None, value=out.fallback)
            c.check("specific_error", err in (out.fallback or ""), value=out.fallback)
            c.check("recomputed_equals_full_reference", out.tokens == full.tokens and
                    bool(torch.equal(out.logits, full.logits)), value=out.tokens)
            c.check("nothing_pending", not s.ctx.engine.pending(f"child-{child.name}"))
            shutil.rmtree(d, ignore_errors=True)
        passed += res.cases[-1].passed is True
    return passed


def _paired_summary(t: Any) -> dict[str, Any]:
    return {part: {"median_diff_s": v["median_diff"], "median_ratio": v["median_ratio"],
                   "b_faster": v["b_faster"], "pairs": v["pairs"]} for part, v in t.summary().items()}


def run(cfg: Config) -> Result:
    res, s = begin_with_setup("storage", cfg, _setup)
    if s is None:
        return res
    timing_cfg = cfg.section("timing")
    pairs, warmup = int(s.sec.get("pairs", timing_cfg["pairs"])), int(s.sec.get("warmup", timing_cfg["warmup"]))
    dev = "cuda" if s.device.type == "cuda" else "cpu"
    res.extra.update(model=s.what, device=str(s.device), children=len(s.workload.children),
                     max_new_tokens=s.ctx.max_new_tokens)
    objs = _objects_case(res, s)
    res.extra["object_bytes"] = {"payload": [h.payload_nbytes for h in objs.headers],
                                 "padded": [h.padded_nbytes for h in objs.headers],
                                 "per_child_padded": objs.total_padded}
    res.extra["notes"] = {
        "object_sizes": (f"objects padded to {s.sec['pad_to']} B (the write-up's 3 MiB)" if s.sec.get("pad_to") else
                         "objects are the real segment sizes of this profile's model, padded to 4 KiB only"),
        "eviction": "before every child: the object files' pages dropped from the OS page cache "
                    "(POSIX_FADV_DONTNEED); the route arms keep no RAM-tier copy, so every child reads the disk",
        "io": routes.IO_NOTE,
        "max_new_tokens": s.ctx.max_new_tokens,
    }
    built, info = _routes_case(res, s, objs)
    res.extra.update(arms=list(built), direct_mode=info["direct_mode"], unavailable=info.get("unavailable", {}),
                     io_settings=dataclasses.asdict(s.io), io_uring_probe=uring.probe().as_dict())
    if "fallback" in info:
        res.extra["arms_fallback"] = info["fallback"]

    refs: dict[str, ChildOutcome] = {}
    with res.case("reference", {"source": "in-process", "runner": "kmesh.child.run_child"}) as c:
        src = InProcessSegments(s.export)
        staging = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
        private = torch.empty_like(staging)
        for child in s.workload.children:
            refs[child.name] = run_child(s.ctx, child, src, staging, private)
        c.check("reference_used_segments", all(o.fallback is None for o in refs.values()))
    arrivals = [_arrival_case(res, s, objs, r) for r in built.values()]
    res.extra["arrival_checks_passed"] = sum(arrivals)
    _unavailable_arrival_cases(res, info.get("unavailable", {}))
    if built:
        res.extra["failure_controls_passed"] = _control_cases(res, s, objs, next(iter(built.values())))

    identical_runs, compared = [0], [0]
    if len(built) == 2:
        (a_name, a_route), (b_name, b_route) = built.items()
        landings = {a: r.landing(objs.total_padded) for a, r in built.items()}
        private = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)

        def fn(arm: str, child: Any, iv: Intervals) -> None:
            out = timed_child(s.ctx, child, objs, built[arm], landings[arm], private, iv)
            compared[0] += 1
            identical_runs[0] += identical(compare_states(refs[child.name], out))

        with res.case("pairs", {"arms": [a_name, b_name], "pairs": pairs, "warmup": warmup,
                                "between": "page cache dropped (POSIX_FADV_DONTNEED) before every child"}) as c:
            t = run_pairs(fn, (a_name, b_name), s.workload.children, pairs=pairs, warmup=warmup, device=dev,
                          between=lambda: routes.drop_page_cache(objs.paths), progress=False)
            res.timings["routes"] = t.to_dict()
            c.check("outputs_identical_every_run", identical_runs[0] == compared[0],
                    value=[identical_runs[0], compared[0]])
            c.check("nesting_read_check_restore_outer", t.parents == {"outer": None, "restore": "outer",
                                                                      "check": "restore", "read": "check"},
                    value=t.parents)
            c.check("no_live_holds", s.ctx.engine.live_holds() == 0)
            res.extra["paired"] = _paired_summary(t)
        res.extra["pairs"] = pairs
        res.extra["runs_compared"] = compared[0]
    if s.sec["floor_arm"] in built:   # also when the other arm could not be built here: the floor still says much
        storage_floor.floor_case(res, s, objs, built, pairs, warmup, dev, refs)
    _floor_io_case(res, s, objs, pairs, warmup, dev)
    # per arm, the engine that actually ran its reads (after every timed case)
    res.extra["io_engine"] = {a: r.describe()["io_engine"] for a, r in built.items()}
    res.extra["outputs_identical"] = compared[0] > 0 and identical_runs[0] == compared[0]
    storage_checksum_cases.run_cases(res, s, refs, pairs, warmup)
    _read_once_case(res, s, refs, pairs, warmup)
    if s.sec.get("read_once_service", True):
        _read_once_service_case(res, s, refs, pairs, warmup)
    for r in built.values():
        r.close()
    gc.collect()
    return res


def _floor_io_case(res: Result, s: Setup, objs: ObjectSet, pairs: int, warmup: int, dev: str) -> None:
    """The floor's O_DIRECT read of every object through io_uring (the profile's queue depth and chunk) vs
    os.preadv: the same padded bytes into two aligned landings, matched pairs alternating order."""
    arms = ("preadv", "io_uring")
    with res.case("floor-io", {"arms": list(arms), "queue_depth": s.io.queue_depth,
                               "chunk_bytes": s.io.chunk_bytes, "o_direct": True,
                               "padded_bytes_per_read": objs.total_padded}) as c:
        try:
            rs = {"preadv": routes.DirectIORoute(io=dataclasses.replace(s.io, engine="preadv")),
                  "io_uring": routes.DirectIORoute(io=dataclasses.replace(s.io, engine="uring"))}
        except RouteUnavailableError as e:
            res.extra["io_pair"] = {"unavailable": str(e)}
            c.record("io_uring_unavailable", str(e))
            _io_fallback_checks(c, s, objs)
            return
        lands = {a: r.landing(objs.total_padded) for a, r in rs.items()}

        def read_all(arm: str) -> None:
            for i, p in enumerate(objs.paths):
                with rs[arm].open(p) as f:
                    rs[arm].read(f, lands[arm][objs.slots[i]:objs.slots[i] + f.header.padded_nbytes])

        def fn(arm: str, child: Any, iv: Intervals) -> None:
            with iv.part("load"):
                read_all(arm)

        try:
            for a, poison in zip(arms, (0xA5, 0x5A)):   # untimed: both deliver the same, verified bytes
                lands[a].fill_(poison)
                read_all(a)
            c.check("same_bytes_both_engines", bool(torch.equal(lands["preadv"], lands["io_uring"])))
            bad = []
            for i, h in enumerate(objs.headers):
                try:
                    h.verify(rs["io_uring"].host_bytes(lands["io_uring"][objs.slots[i]:objs.slots[i] + h.padded_nbytes]))
                except StorageError as e:
                    bad.append(f"{i}: {e}")
            c.check("io_uring_bytes_verified", not bad, value=bad)
            t = run_pairs(fn, arms, s.workload.children, pairs=pairs, warmup=warmup, device=dev,
                          between=lambda: routes.drop_page_cache(objs.paths), progress=False)
            res.timings["floor_io"] = t.to_dict()
            sm = t.summary()["load"]
            c.check("timed_every_pair", sm["pairs"] == pairs)
            engines = {a: r.describe()["io_engine"] for a, r in rs.items()}
            c.record("io_engine", engines)
            c.check("engines_as_named", engines["preadv"]["engine"] == "preadv" and engines["preadv"]["preadv_calls"] > 0
                    and engines["io_uring"]["engine"] == "io_uring" and engines["io_uring"]["preadv_calls"] == 0
                    and sum(engines["io_uring"]["sqes"].values()) > 0, value=engines)
            res.extra["io_pair"] = {"median_ratio_uring_over_preadv": sm["median_ratio"],
                                    "median_diff_s": sm["median_diff"], "pairs": sm["pairs"],
                                    "median_preadv_s": sm["median_a"], "median_uring_s": sm["median_b"],
                                    "fixed_buffers": engines["io_uring"]["fixed_buffers"],
                                    "fixed_reason": engines["io_uring"]["fixed_reason"],
                                    "queue_depth": s.io.queue_depth, "chunk_bytes": s.io.chunk_bytes}
        finally:
            for r in rs.values():
                r.close()


def _io_fallback_checks(c: Any, s: Setup, objs: ObjectSet) -> None:
    """No io_uring here: what `auto` does instead is checked — preadv, the probe's reason, the same bytes."""
    r = routes.DirectIORoute(io=dataclasses.replace(s.io, engine="auto"))
    try:
        land = r.landing(objs.total_padded)
        land.fill_(0xA5)
        for i, p in enumerate(objs.paths):
            with r.open(p) as f:
                dst = land[objs.slots[i]:objs.slots[i] + f.header.padded_nbytes]
                r.read(f, dst)
                f.header.verify(r.host_bytes(dst))
        e = r.describe()["io_engine"]
        c.check("auto_reads_preadv_with_reason", e["engine"] == "preadv" and bool(e["fallback_reason"])
                and e["preadv_calls"] == len(objs.paths), value=e)
    finally:
        r.close()


def _repair_from(s: Setup, child: Any, private: torch.Tensor, source: str) -> ChildOutcome:
    """Restore + repair one child from its private copy of the segments (the read-once cases' check)."""
    cache = new_cache(s.ctx, child)
    restored = restore_child(cache, s.ctx.catalog, private, child, s.ctx.runner, s.ctx.restore_backend)
    out, tokens = prefill_and_decode(s.ctx, child, cache, restored, "kmesh")
    check_canaries(cache, len(child.ids) + s.ctx.max_new_tokens - 1)
    k, v = cache.stacked(len(child.ids))
    return ChildOutcome(child.name, source, "kmesh", k, v, out.logits.clone(), tokens, out.masks.clone(), restored)


def _read_once_service_case(res: Result, s: Setup, refs: dict[str, ChildOutcome], pairs: int, warmup: int) -> None:
    n = len(s.workload.children)
    eq = s.cfg.section("equivalence")
    with res.case("read-once-service", {"children": n, "concurrent": True, "arms": list(storage_service.ARMS),
                                        "service": "real process, disk tier + group retention"}) as c:
        disk = s.root / "service-disk"
        shutil.rmtree(disk, ignore_errors=True)
        with Harness(device=str(s.device), heartbeat_timeout_s=float(eq["heartbeat_timeout_s"]),
                     chunk_bytes=int(eq["chunk_bytes"]), store_bytes=1 << 31, disk_dir=disk) as h:
            sc = storage_service.ServiceChildren(h, s.export, s.device, n)
            try:
                c.check("leader_spilled_to_disk", len(list(disk.glob("*.kmo"))) == len(s.export.catalog.entries))
                privates = [torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
                            for _ in range(n)]
                t, reads = sc.run_pairs(privates, pairs, warmup)
                res.timings["read_once_service"] = t.to_dict()
                c.record("reads", reads)
                once = [r["read-once"] for r in reads]
                forced = [r["forced-eviction"] for r in reads]
                c.check("read_once_one_read_per_object", all(x == 1 for r in once for x in r), value=once)
                c.check("forced_eviction_reads_per_child", all(x == n for r in forced for x in r), value=forced)
                res.extra["reads_per_object_read_once_service"] = max(x for r in once for x in r)
                # loads that found their object's read-back in flight in the service and joined it (the rest
                # found the RAM copy the first read installed): per pair, summed over the objects
                res.extra["joins_read_once_service"] = [sum(r["joins"]["read-once"]) for r in reads]
                res.extra["paired_read_once_service"] = _paired_summary(t)
                sc.read_once(privates, "verify")
                same = sum(identical(compare_states(refs[ch.name], _repair_from(s, ch, p, "service:read-once")))
                           for ch, p in zip(s.workload.children, privates))
                c.check("private_copies_repair_to_reference", same == n, value=same)
            finally:
                sc.close()
            c.check("service_no_leaks", h.no_leaks(), value=h.leaks())


def _read_once_case(res: Result, s: Setup, refs: dict[str, ChildOutcome], pairs: int, warmup: int) -> None:
    with res.case("read-once", {"children": len(s.workload.children), "concurrent": True,
                                "arms": list(storage_readonce.ARMS)}) as c:
        tier = TieredObjects(s.root / "tier", route=routes.DirectIORoute(io=s.io))
        raw = s.export.raw.cpu()
        for e in s.export.catalog.entries:
            tier.put(e.key, raw[e.offset:e.offset + e.nbytes].contiguous().numpy(), keep=False,
                     algorithm=s.sec["algorithm"], pad_to=s.sec.get("pad_to"))
        privates = [torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
                    for _ in s.workload.children]
        t, reads = storage_readonce.run_pairs(tier, s.export.catalog, privates, pairs, warmup)
        res.timings["read_once"] = t.to_dict()
        c.record("reads", reads)
        once = [r["read-once"]["reads_per_object"] for r in reads]
        forced = [r["forced-eviction"]["reads_per_object"] for r in reads]
        n = len(s.workload.children)
        c.check("read_once_one_read_per_object", all(x == 1 for r in once for x in r), value=once)
        c.check("forced_eviction_reads_per_child", all(x == n for r in forced for x in r), value=forced)
        res.extra["reads_per_object_read_once"] = max(x for r in once for x in r)
        res.extra["reads_per_object_forced"] = max(x for r in forced for x in r)
        res.extra["paired_read_once"] = _paired_summary(t)
        # every child's private copy from one more read-once group, restored + repaired = the reference
        tier.reset_counters()
        storage_readonce.read_once(tier, s.export.catalog, privates, "verify")
        # the private copies hold exactly the leader's bytes (the service case below also repairs from them)
        want = s.export.raw.to(s.device)
        same = sum(bool(torch.equal(p, want)) for p in privates)
        c.check("private_copies_equal_leader_bytes", same == n, value=same)
        c.check("private_copies_distinct_memory", len({p.data_ptr() for p in privates}) == n)
        c.record("tier", tier.describe())
        tier.route.close()
