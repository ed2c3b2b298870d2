"""Checksum arms of the storage stage (kmesh.stages.storage.checksums) on the tiny seeded Qwen2: every arm
delivers exactly the leader's bytes and the reference outputs; a corrupted object, or one checked with another
algorithm, is refused with nothing pending; with overlap the device slot stays held until the hash and the
payload copy are both done, and the payload copy waits for the hash. GPU arms: the same on CUDA (marked gpu).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kmesh.bench import Intervals
from kmesh.model.quality import compare_states, identical
from kmesh.stages.storage import checksums as sc
from kmesh.stages.storage.setup import storage_setup
from kmesh.storage import routes
from kmesh.storage.errors import ObjectAlgorithmError, ObjectCorruptError
from test_storage_stage import _cfg, setup  # noqa: F401  (the module-scoped tiny model + references)

CPU_ARMS = ["cpu-sha256", "cpu-blake3", "cpu-blake3-overlap"]


@pytest.fixture(scope="module")
def sets(setup, tmp_path_factory):  # noqa: F811
    s = setup[0]
    root = tmp_path_factory.mktemp("checksum-sets")
    return sc.save_sets(s.export, root, ["sha256", "sha256-tree", "blake3"], None, 1024)


def _bufs(s, sets):
    route = routes.build("odirect")
    return sc.Buffers(route, max(o.total_padded for o in sets.values()), s.export.catalog.nbytes, s.device)


def test_arm_table_and_errors():
    assert {a.algorithm for a in sc.ARMS.values()} == {"sha256", "sha256-tree", "blake3"}
    with pytest.raises(sc.ChecksumArmError, match="hashes on the GPU"):
        sc.arm_named("gpu-blake3", torch.device("cpu"))
    if torch.cuda.is_available():
        with pytest.raises(sc.ChecksumArmError, match="cpu profile's overlap arm"):
            sc.arm_named("cpu-blake3-overlap", torch.device("cuda"))
    with pytest.raises(sc.ChecksumArmError, match="unknown checksum arm"):
        sc.arm_named("md5", torch.device("cpu"))


def test_sets_record_their_algorithm(sets):
    assert {o.headers[0].algorithm for o in sets.values()} == set(sets)
    assert all(h.params == {"chunk_bytes": 1024} for h in sets["sha256-tree"].headers)
    assert sets["blake3"].headers[0].digest != sets["sha256"].headers[0].digest


@pytest.mark.parametrize("name", CPU_ARMS)
def test_cpu_arm_exact_bytes_and_reference_outputs(setup, sets, name):  # noqa: F811
    s, _, refs, _ = setup
    a = sc.arm_named(name, s.device)
    b = _bufs(s, sets)
    try:
        for child in s.workload.children:
            iv = Intervals("cpu")
            out = sc.timed_checksum_child(s.ctx, child, sets[a.algorithm], b, a, iv)
            assert torch.equal(b.private, s.export.raw)
            assert identical(compare_states(refs[child.name], out))
            assert iv.parents == {"outer": None, "restore": "outer", "read": "restore", "verify": "restore"}
            assert set(iv.seconds()) == {"outer", "restore", "read", "verify"}
        assert s.ctx.engine.live_holds() == 0
    finally:
        b.close()
        b.route.close()


@pytest.mark.parametrize("name", CPU_ARMS)
def test_cpu_arm_refuses_corrupt_and_wrong_algorithm(setup, sets, name, tmp_path):  # noqa: F811
    s = setup[0]
    a = sc.arm_named(name, s.device)
    b = _bufs(s, sets)
    try:
        bad = sc.corrupt_copy(sets[a.algorithm], s.export, tmp_path / "bad", None)
        why = sc.refused(s.ctx, s.workload.children[0], bad, b, a)
        assert why and why.startswith("ObjectCorruptError") and "segment-1" in why
        other = sets["sha256-tree"]
        with pytest.raises(ObjectAlgorithmError, match="expects"):
            sc.checksum_restore(s.ctx, s.workload.children[0], other, b, a, None, "wrong-algo")
        assert not s.ctx.engine.pending() and s.ctx.engine.live_holds() == 0
    finally:
        b.close()
        b.route.close()


def test_overlap_holds_device_slot_until_hash_and_copy_done(setup, sets, monkeypatch):  # noqa: F811
    """The hash of object 0 is held back: its device slot stays held, its payload copy does not run, and the
    next objects are still read meanwhile (the overlap); releasing the hash lets everything finish."""
    s = setup[0]
    a = sc.arm_named("cpu-blake3-overlap", s.device)
    objs = sets["blake3"]
    b = _bufs(s, sets)
    gate, started = threading.Event(), threading.Event()
    real = sc._hash_after

    def gated(t1, slot, arm, params, done):
        if slot.data_ptr() == b.dev.data_ptr():      # object 0
            started.set()
            gate.wait(10)
        return real(t1, slot, arm, params, done)

    monkeypatch.setattr(sc, "_hash_after", gated)
    b.poison()
    reads0 = b.route.reads
    err: list[BaseException] = []

    def go():
        try:
            sc.checksum_restore(s.ctx, s.workload.children[0], objs, b, a, None, "overlap-test")
        except BaseException as e:  # handed to the test thread
            err.append(e)

    th = threading.Thread(target=go)
    th.start()
    try:
        assert started.wait(10)
        e0 = objs.catalog.entries[0]
        for _ in range(200):      # every object read while hash 0 is held back
            if b.route.reads - reads0 == len(objs.paths):
                break
            time.sleep(0.01)
        assert b.route.reads - reads0 == len(objs.paths)
        slot0 = b.dev[objs.slots[0]:objs.slots[0] + objs.headers[0].padded_nbytes]
        assert s.ctx.engine.holds(slot0) >= 1                              # held (its copies not drained)
        assert bool((b.private[e0.offset:e0.offset + e0.nbytes] == 0x5A).all())   # that copy waits for the hash
        with pytest.raises(Exception, match="held"):
            s.ctx.engine.release(slot0)
    finally:
        gate.set()
        th.join(30)
    assert not err, err
    assert torch.equal(b.private, s.export.raw) and s.ctx.engine.live_holds() == 0
    b.close()
    b.route.close()


def _cuda_setup(tmp_path):
    cfg = _cfg(tmp_path, profile="cuda", device="cuda", pad_to=1 << 20)
    return storage_setup(cfg)


@pytest.mark.gpu
def test_gpu_arms_exact_bytes_and_refuse_corrupt(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from kmesh.harness.child import run_child
    from kmesh.kv.sources import InProcessSegments

    s = _cuda_setup(tmp_path)
    sets = sc.save_sets(s.export, tmp_path / "sets", ["sha256", "sha256-tree", "blake3"], 1 << 20, 65536)
    route = routes.build("staging", s.device)
    b = sc.Buffers(route, max(o.total_padded for o in sets.values()), s.export.catalog.nbytes, s.device)
    child = s.workload.children[0]
    st = torch.empty(s.export.catalog.nbytes, dtype=torch.uint8, device=s.device)
    ref = run_child(s.ctx, child, InProcessSegments(s.export), st, torch.empty_like(st))
    raw = s.export.raw.to(s.device)
    for name in ["cpu-sha256", "gpu-sha256", "gpu-sha256-tree", "gpu-blake3", "gpu-blake3-overlap",
                 "gpu-sha256-tree-overlap"]:
        a = sc.arm_named(name, s.device)
        out = sc.timed_checksum_child(s.ctx, child, sets[a.algorithm], b, a, Intervals("cuda"))
        assert torch.equal(b.private, raw), name
        assert identical(compare_states(ref, out)), name
        bad = sc.corrupt_copy(sets[a.algorithm], s.export, tmp_path / f"bad-{name}", 1 << 20)
        why = sc.refused(s.ctx, child, bad, b, a)
        assert why and why.startswith("ObjectCorruptError"), (name, why)
        with pytest.raises(ObjectCorruptError):
            sc.checksum_restore(s.ctx, child, bad, b, a, None, f"bad2-{name}")
        assert not s.ctx.engine.pending() and s.ctx.engine.live_holds() == 0
    b.close()
    route.close()
