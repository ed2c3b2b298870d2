"""The storage stage's parts, and the whole stage, on a tiny seeded Qwen2 (CPU): object files as a segment source
for kmesh.harness.child.run_child, the timed route flow against the in-process reference, bad files → recompute, the
arrival check's complemented objects, read-once vs forced eviction read counts.

Model: model.qwen2_random shrunk to 2 layers, hidden 64, 2 KV heads of 16 channels, vocab 300 (ByteTokenizer);
workload: 3 segments of 80 tokens, 2 children of 352 tokens (as tests/test_equivalence_parts.py). ~15 s.
"""
from __future__ import annotations

import pytest
import torch

from kmesh.bench import Intervals
from kmesh.config import load_config
from kmesh.harness.child import full_reference, run_child
from kmesh.kv.sources import InProcessSegments
from kmesh.model.quality import compare_states, identical
from kmesh.stages import storage
from kmesh.stages.storage import controls, readonce, stage
from kmesh.stages.storage.child import route_restore, timed_child
from kmesh.stages.storage.objects import StorageSegments, save_objects
from kmesh.stages.storage.setup import storage_setup
from kmesh.storage import objfile, routes
from kmesh.storage.errors import RouteUnavailableError
from kmesh.storage.tier import TieredObjects

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 512,
        "dtype": "float32"}
WORKLOAD = {"prompt_tokens": 352, "segment_tokens": [80, 80, 80], "children": 2, "block_size": 16}


def _cfg(tmp_path, profile="cpu", **storage_over):
    storage_over.setdefault("floor_variants", ["sequential", "pipelined", "pipelined-device-blake3"])
    storage_over.setdefault("floor_hashers", 2)
    return load_config(profile=profile, overrides={
        "results_dir": str(tmp_path / "results"),
        "model": {"qwen2_random": TINY},
        "equivalence": {"model": "qwen2_random", "workload": WORKLOAD, "byte_token_offset": 0},   # TINY vocab
        "storage": {"pairs": 1, "warmup": 0, "max_new_tokens": 3, **storage_over}})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("storage")
    s = storage_setup(_cfg(tmp))
    objs = save_objects(s.export, tmp / "objs", pad_to=None)
    refs = {}
    staging = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8)
    private = torch.empty_like(staging)
    for child in s.workload.children:
        refs[child.name] = run_child(s.ctx, child, InProcessSegments(s.export), staging, private)
    return s, objs, refs, tmp


def test_storage_source_with_run_child_is_bit_identical(setup):
    s, objs, refs, _ = setup
    staging = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8)
    private = torch.empty_like(staging)
    for name in ("buffered", "odirect"):
        r = routes.build(name)
        for child in s.workload.children:
            out = run_child(s.ctx, child, StorageSegments(objs, r), staging, private)
            assert out.fallback is None and identical(compare_states(refs[child.name], out))
        assert r.describe()["reads"] == len(objs.paths) * len(s.workload.children)
        r.close()


def test_timed_route_flow_nested_parts_and_identical(setup):
    s, objs, refs, _ = setup
    r = routes.build("odirect")
    land = r.landing(objs.total_padded)
    private = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8)
    child = s.workload.children[1]
    iv = Intervals("cpu")
    out = timed_child(s.ctx, child, objs, r, land, private, iv)
    assert identical(compare_states(refs[child.name], out))
    assert iv.parents == {"outer": None, "restore": "outer", "check": "restore", "read": "check"}
    sec = iv.seconds()
    assert sec["read"] <= sec["check"] <= sec["restore"] <= sec["outer"]
    assert s.ctx.engine.live_holds() == 0
    r.close()


def test_bad_object_falls_back_to_full_recompute(setup):
    s, objs, refs, tmp = setup
    bad = save_objects(s.export, tmp / "bad", pad_to=None)
    raw = bytearray(bad.paths[2].read_bytes()); raw[objfile.HEADER_BYTES + 9] ^= 4; bad.paths[2].write_bytes(raw)
    child = s.workload.children[0]
    staging = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8)
    out = run_child(s.ctx, child, StorageSegments(bad, routes.build("odirect")), staging, torch.empty_like(staging))
    full = full_reference(s.ctx, child)
    assert out.fallback.startswith("SegmentCorruptError: ObjectCorruptError")
    assert out.tokens == full.tokens and torch.equal(out.logits, full.logits)
    assert not identical(compare_states(refs[child.name], out))       # the control: it really recomputed


def test_arrival_objects_deliver_complement_not_export(setup):
    s, _, _, tmp = setup
    comp = save_objects(s.export, tmp / "comp", transform=lambda t: t ^ 0xFF)
    r = routes.build("buffered")
    land = r.landing(comp.total_padded)
    land.fill_(0xA5)
    private = torch.full((s.export.catalog.nbytes,), 0x5A, dtype=torch.uint8)
    route_restore(s.ctx, s.workload.children[0], comp, r, land, private, None, "arrival-test")
    assert torch.equal(private, s.export.raw ^ 0xFF)
    r.close()


def test_read_once_counts(setup):
    s, _, _, tmp = setup
    tier = TieredObjects(tmp / "tier")
    for e in s.export.catalog.entries:
        tier.put(e.key, s.export.raw[e.offset:e.offset + e.nbytes].contiguous().numpy(), keep=False)
    privates = [torch.empty(s.export.catalog.nbytes, dtype=torch.uint8) for _ in range(4)]
    t, reads = readonce.run_pairs(tier, s.export.catalog, privates, pairs=2, warmup=0)
    assert [r["read-once"]["reads_per_object"] for r in reads] == [[1, 1, 1]] * 2
    assert [r["forced-eviction"]["reads_per_object"] for r in reads] == [[4, 4, 4]] * 2
    assert all(torch.equal(p, s.export.raw) for p in privates)
    assert t.to_dict()["summary"]["load"]["pairs"] == 2


def test_whole_stage_tiny(tmp_path):
    res = storage.run(_cfg(tmp_path, checksums={"warm_arms": True, "max_new_tokens": 2}))
    failed = [(c.id, c.error, {k: v for k, v in c.checks.items() if v["ok"] is False}) for c in res.cases
              if c.passed is not True]
    assert not failed
    s = res.summary()
    assert s["arms"] == ["buffered", "odirect"] and s["outputs_identical"] is True and s["pairs"] == 1
    assert s["reads_per_object_read_once"] == 1 and s["reads_per_object_forced"] == 2
    assert s["arrival_checks_passed"] == 2 and s["failure_controls_passed"] == 7
    assert s["floor_ratio"] > 0 and set(s["paired"]) == {"read", "check", "restore", "outer"}
    assert s["direct_mode"]["arm"] == "direct-unavailable"
    assert {"routes", "floor_sequential", "floor_pipelined", "floor_pipelined-device-blake3", "read_once",
            "read_once_service"} <= set(res.timings)
    assert s["reads_per_object_read_once_service"] == 1
    assert (len(s["joins_read_once_service"]) == s["pairs"]
            and all(0 <= j <= 3 * 2 for j in s["joins_read_once_service"]))
    assert set(s["floor_ratios"]) == {"sequential", "pipelined", "pipelined-device-blake3"}
    assert s["floor_ratio"] == min(s["floor_ratios"].values()) and s["floor_ratios"][s["floor_ratio_variant"]] == \
        s["floor_ratio"]
    floor = next(c for c in res.cases if c.id == "floor")
    assert floor.checks["pipelined-device-blake3_output_identical"]["ok"] is True
    tl = floor.checks["pipelined-device-blake3_timeline_ms"]["value"]
    nobj = len(s["object_bytes"]["payload"])
    assert sorted((ev, i) for ev, i, _ in tl) == sorted((ev, i) for ev in ("read-start", "read-end", "checked",
                                                                         "restored") for i in range(nobj))
    assert all(t >= 0 for _, _, t in tl)
    cs = s["checksums"]
    assert cs["outputs_identical"] and cs["algorithms"] == {"cpu-sha256": "sha256", "cpu-blake3": "blake3",
                                                            "cpu-blake3-overlap": "blake3"}
    assert set(cs["paired"]) == {"cpu-blake3"} and set(cs["overlap_paired"]["outer"]) >= {"median_ratio", "b_faster"}
    assert cs["runs_compared"] == 2 * 2 * 2 * len(cs["children"]) + 3 and cs["route"]["reads"] > 0
    assert {"checksum_cpu-blake3", "checksum_overlap"} <= set(res.timings)
    assert cs["max_new_tokens"] == 2 and s["max_new_tokens"] == 3      # own references for the checksum runs
    assert {c.id for c in res.cases} >= {"checksum-objects", "checksum-warmup", "checksums-cpu-sha256-vs-cpu-blake3",
                                         "checksum-overlap", "checksum-corrupt"}
    from kmesh.report.tables import storage_checksums_caption, storage_checksums_frame
    df = storage_checksums_frame(s)
    assert list(df["B"]) == ["cpu-blake3", "cpu-blake3-overlap"] and "of 2" in storage_checksums_caption(s)


def test_pipelined_restore_same_bytes_and_bad_object_drained(setup):
    from kmesh.harness.child import new_cache, restore_child
    from kmesh.stages.storage.pipeline import pipelined_restore
    from kmesh.storage.errors import ObjectCorruptError

    s, objs, _, tmp = setup
    r = routes.build("odirect")
    land = r.landing(objs.total_padded)
    private = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8)
    for child in s.workload.children:
        a, b = new_cache(s.ctx, child), new_cache(s.ctx, child)
        ma = pipelined_restore(s.ctx, child, objs, r, land, private, a, "pipe-test")
        mb = restore_child(b, s.ctx.catalog, s.export.raw, child, s.ctx.runner)
        assert torch.equal(ma, mb)
        assert torch.equal(a.raw.view(torch.uint8), b.raw.view(torch.uint8))   # NaN canaries compared as bytes
    bad = save_objects(s.export, tmp / "pipe-bad")
    raw = bytearray(bad.paths[1].read_bytes()); raw[-1] ^= 1; bad.paths[1].write_bytes(raw)
    with pytest.raises(ObjectCorruptError):
        child = s.workload.children[0]
        pipelined_restore(s.ctx, child, bad, r, land, private, new_cache(s.ctx, child), "pipe-bad")
    assert not s.ctx.engine.pending("pipe-bad") and s.ctx.engine.live_holds() == 0
    r.close()


@pytest.mark.parametrize("variant", ["pipelined", "pipelined-host-blake3", "pipelined-device-blake3",
                                     "pipelined-device-sha256", "pipelined-restore-once",
                                     "pipelined-device-sha256-tree-restore-once"])
def test_pipelined_variants_same_bytes_and_corrupt_object_refused(setup, variant):
    """Every check placement writes exactly what restore_child writes from the export; a flipped payload byte is
    refused before use (ObjectCorruptError), with nothing pending and no hold left, however many hashers run."""
    from kmesh.harness.child import new_cache, restore_child
    from kmesh.stages.storage.pipeline import parse_variant, pipelined_restore
    from kmesh.storage.errors import ObjectCorruptError

    s, objs, _, tmp = setup
    chk = parse_variant(variant, hashers=3)
    algo = chk.algorithm or "sha256"
    params = {"chunk_bytes": 4096} if algo == "sha256-tree" else None
    vobjs = objs if algo == "sha256" else save_objects(s.export, tmp / f"var-{variant}", algo, params=params)
    r = routes.build("odirect")
    land = r.landing(vobjs.total_padded)
    dev = torch.empty(vobjs.total_padded, dtype=torch.uint8) if chk.where == "device" else None
    private = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8)
    for child in s.workload.children:
        land.fill_(0xA5)
        private.fill_(0x5A)
        a, b = new_cache(s.ctx, child), new_cache(s.ctx, child)
        ma = pipelined_restore(s.ctx, child, vobjs, r, land, private, a, "pipe-var", chk, dev)
        mb = restore_child(b, s.ctx.catalog, s.export.raw, child, s.ctx.runner)
        assert torch.equal(ma, mb) and bool(ma.any())
        assert torch.equal(a.raw.view(torch.uint8), b.raw.view(torch.uint8))
    bad = save_objects(s.export, tmp / f"var-bad-{variant}", algo, params=params)
    raw = bytearray(bad.paths[1].read_bytes()); raw[-1] ^= 1; bad.paths[1].write_bytes(raw)
    child = s.workload.children[0]
    private.fill_(0x5A)
    with pytest.raises(ObjectCorruptError):
        pipelined_restore(s.ctx, child, bad, r, land, private, new_cache(s.ctx, child), "pipe-var-bad", chk, dev)
    assert not s.ctx.engine.pending("pipe-var-bad") and s.ctx.engine.live_holds() == 0
    e1 = s.export.catalog.entries[1]
    assert bool((private[e1.offset:e1.offset + e1.nbytes] == 0x5A).all())    # the corrupt object was never used
    r.close()


def test_pipeline_variant_names_and_misuse():
    from kmesh.stages.storage.pipeline import PipelineVariantError, parse_variant

    assert parse_variant("sequential") is None
    assert parse_variant("pipelined", hashers=4).describe() == {"where": "host", "algorithm": None, "hashers": 4,
                                                                "restore": "per object"}
    assert parse_variant("pipelined-device-blake3", hashers=4).hashers == 1
    once = parse_variant("pipelined-device-sha256-tree-restore-once")
    assert (once.where, once.algorithm, once.restore_once) == ("device", "sha256-tree", True)
    assert parse_variant("pipelined-restore-once").restore_once and not parse_variant("pipelined").restore_once
    for bad in ("pipelined-gpu-blake3", "pipelined-device-md5", "parallel", "pipelined-host-",
                "pipelined-restore-twice", "pipelined-device-blake3-restore-once-restore-once"):
        with pytest.raises(PipelineVariantError):
            parse_variant(bad)


def test_pipeline_refuses_objects_of_another_algorithm_and_a_missing_device_landing(setup):
    from kmesh.harness.child import new_cache
    from kmesh.stages.storage.pipeline import PipelineVariantError, parse_variant, pipelined_restore
    from kmesh.storage.errors import ObjectAlgorithmError

    s, objs, _, _ = setup
    r = routes.build("odirect")
    land = r.landing(objs.total_padded)
    private = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8)
    child = s.workload.children[0]
    with pytest.raises(ObjectAlgorithmError):
        pipelined_restore(s.ctx, child, objs, r, land, private, new_cache(s.ctx, child), "pipe-algo",
                          parse_variant("pipelined-host-blake3"))
    with pytest.raises(PipelineVariantError):
        pipelined_restore(s.ctx, child, objs, r, land, private, new_cache(s.ctx, child), "pipe-dev",
                          parse_variant("pipelined-device-sha256"), None)
    r.close()


def test_floor_lands_in_the_same_kind_of_memory_as_its_arm(setup, monkeypatch):
    """Issue 21 item 7: the floor of a pinned arm (staging on CUDA) reads into pinned memory too — a landing the
    arm's route allocates — and the case records both landings and checks them equal. Here the staging arm runs
    on the CPU with cudaHostRegister stubbed (its reads are real O_DIRECT reads): the old floor allocated its own
    unpinned landing, so only one buffer was ever page-locked."""
    import dataclasses

    from kmesh.result import Result
    from kmesh.stages.storage import floor
    from kmesh.storage import aligned

    s, objs, refs, _ = setup
    locked: list[int] = []
    monkeypatch.setattr(aligned, "_cuda_host_register", lambda address, nbytes: locked.append(address))
    monkeypatch.setattr(aligned, "_cuda_host_unregister", lambda address: None)
    s2 = dataclasses.replace(s, sec={**s.sec, "floor_arm": "staging", "floor_variants": ["sequential"]})
    arm = routes.StagingRoute("cpu", io="preadv")
    try:
        res = Result("storage", "cpu", {})
        floor.floor_case(res, s2, objs, {"staging": arm}, pairs=1, warmup=0, refs=refs)
        case = res.cases[-1]
        assert case.id == "floor" and case.passed is True, (case.error, case.checks)
        assert len(locked) == 2                   # the arm's landing and the floor's, both page-locked
        kinds = res.extra["floor_landing"]
        assert kinds["floor"]["pinned"] is True and kinds["floor"] == kinds["arm"]
        assert case.checks["floor_landing_same_kind_as_arm"]["ok"] is True
        assert case.checks["floor_route"]["value"]["landing"] == "pinned host"
        # the check can fail: a floor that allocates its own landing (the old floor) is refused
        monkeypatch.setattr(floor, "floor_route", lambda io, arm_route: routes.DirectIORoute(io=io))
        old = Result("storage", "cpu", {})
        floor.floor_case(old, s2, objs, {"staging": arm}, pairs=1, warmup=0, refs=refs)
        assert old.cases[-1].checks["floor_landing_same_kind_as_arm"]["ok"] is False
        assert old.extra["floor_landing"]["floor"]["pinned"] is False and old.cases[-1].passed is False
    finally:
        arm.close()


def test_route_landing_kind_reads_the_buffer_and_refuses_device_memory_for_a_host_floor():
    plain = routes.build("odirect", io="preadv")
    with pytest.raises(routes.RouteIOError, match="no landing buffer yet"):
        plain.landing_kind()
    plain.landing(8192)
    kind = plain.landing_kind()
    assert kind["memory"] == "host" and kind["pinned"] is False and kind["allocator"].startswith("DirectIORoute")
    like = routes.DirectIORoute(io="preadv", landing_like=plain)
    like.landing(8192)
    assert like.landing_kind() == kind and like.landing(8192).data_ptr() != plain.landing(8192).data_ptr()

    class DeviceLanding(routes.Route):      # cuFile's kind of landing, without a GPU
        new_landing = routes.CuFileRoute.new_landing

    with pytest.raises(RouteUnavailableError, match="device memory"):
        routes.DirectIORoute(io="preadv", landing_like=DeviceLanding(io="preadv")).landing(8192)
    for route in (plain, like):
        route.close()


def test_storage_summary_table_renders_result_keys():
    from kmesh.report.tables import storage_frame

    pinned = {"memory": "host", "pinned": True, "align": 4096, "allocator": "StagingRoute.new_landing (AlignedBuffer)",
              "hugepages_advised": True}
    df = storage_frame({"arms": ["staging", "cufile-compat"], "direct_mode": {"arm": "cufile-compat",
                        "reason": "no nvidia-fs"}, "pairs": 7, "outputs_identical": True, "floor_ratio": 1.4,
                        "floor_ratios": {"sequential": 1.6, "pipelined": 1.4}, "floor_ratio_variant": "pipelined",
                        "floor_landing": {"arm": pinned, "floor": pinned}, "reads_per_object_read_once": 1})
    d = dict(zip(df["quantity"], df["value"]))
    assert d["arms (as run)"] == "staging, cufile-compat" and d["storage reads per object, read-once"] == 1
    assert d["floor ratios by variant"] == "sequential 1.6, pipelined 1.4 (best)"
    assert d["floor ratio's variant"] == "pipelined"
    assert d["floor landing vs the arm's"] == "floor: pinned host; arm: pinned host — same kind"


def test_unavailable_arm_runs_fallback_arms_and_skips_its_arrival(setup):
    """A requested arm that cannot run here (direct on a CPU device) is not run under its name: the fallback arms
    run, the result says why, and its arrival check is a skip with exactly that reason (allowed by the profile)."""
    import dataclasses

    from kmesh.config import SkipAllowance
    from kmesh.result import Result

    s, objs, _, _ = setup
    s2 = dataclasses.replace(s, sec={**s.sec, "arms": ["buffered", "direct"], "fallback_arms": ["buffered", "odirect"],
                                     "fallback_note": "buffered vs O_DIRECT"})
    res = Result("storage", "cpu", {}, (SkipAllowance("arrival-direct", "direct cannot run on a CPU device"),))
    built, info = stage._routes_case(res, s2, objs)
    assert list(built) == ["buffered", "odirect"] and res.cases[0].passed is True
    why = info["unavailable"]["direct"]
    assert "needs a CUDA device" in why and info["fallback"]["ran"] == ["buffered", "odirect"]
    assert info["fallback"]["why"] == {"direct": why} and info["fallback"]["comparison"] == "buffered vs O_DIRECT"
    controls.unavailable_arrival_cases(res, info["unavailable"])
    assert res.cases[-1].id == "arrival-direct" and res.cases[-1].skipped == why
    sm = res.summary()
    assert sm["ok"] and sm["skips_allowed"][0]["case"] == "arrival-direct" and not sm["skips_unallowed"]
    bare = Result("storage", "cpu", {})      # a profile that does not allow it: the stage is not ok
    controls.unavailable_arrival_cases(bare, info["unavailable"])
    assert bare.skip_verdicts()[1] and not bare.summary()["ok"]
    for r in built.values():
        r.close()
    # without fallback arms the routes case fails (one arm), naming the unavailable one
    res3 = Result("storage", "cpu", {})
    built3, info3 = stage._routes_case(res3, dataclasses.replace(s2, sec={**s2.sec, "fallback_arms": None}), objs)
    assert list(built3) == ["buffered"] and res3.cases[0].passed is False and "fallback" not in info3
    for r in built3.values():
        r.close()


@pytest.mark.gpu
def test_whole_stage_tiny_cuda(tmp_path):
    """The cuda arms end to end on a tiny model: staging (pinned host, async device copy) vs cuFile (whatever
    mode this machine has: the arm name says which); every run bit-identical to the in-process reference."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    cfg = _cfg(tmp_path, profile="cuda", device="cuda", arms=["staging", "direct"], floor_arm="staging",
               pad_to=1 << 20, checksums={"pairs": 1, "children": 1})      # the cuda arms, one pair each
    res = storage.run(cfg)
    s = res.summary()
    bad = {c.id: (c.error, {k: v for k, v in c.checks.items() if v["ok"] is False}) for c in res.cases
           if c.passed is False}
    print("arms", s["arms"], "direct_mode", s["direct_mode"], "floor_ratios", s.get("floor_ratios"), "bad", bad)
    assert not bad and s["ok"] and s["outputs_identical"] and "staging" in s["arms"]
    # the staging arm's floor reads into pinned memory as the arm does (issue 21 item 7)
    assert s["floor_landing"]["floor"]["pinned"] is True and s["floor_landing"]["floor"] == s["floor_landing"]["arm"]
    if s["direct_mode"]["mode"] is None:          # cuFile cannot run here: the fallback arms ran, the skip says why
        assert s["arms"] == ["staging", "staging-buffered"] and s["arms_fallback"]["why"]["direct"]
        skip = next(c for c in res.cases if c.id == "arrival-direct")
        # each probe quotes the cufile.log lines it caused, with their own timestamps: compare what precedes them
        assert skip.skipped == s["unavailable"]["direct"]
        assert s["direct_mode"]["reason"].split("; cufile.log:")[0] in skip.skipped
        assert s["arrival_checks_passed"] == 2
    else:
        assert s["arms"][1] == s["direct_mode"]["arm"] and not s["skipped"]
    cs = s["checksums"]
    assert cs["outputs_identical"] and set(cs["paired"]) == {"gpu-sha256", "gpu-sha256-tree", "gpu-blake3"}
    assert cs["overlap"] == ["gpu-blake3", "gpu-blake3-overlap"] and cs["overlap_paired"]["outer"]["pairs"] == 1
    assert s["reads_per_object_read_once"] == 1 and s["reads_per_object_read_once_service"] == 1
