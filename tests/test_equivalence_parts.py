"""The equivalence stage's parts on a tiny CPU model: segment export, staging checks, the drained private copy,
a child's run with its full-recompute fallback, the cache service path, quality helpers and the failure
controls (kmesh.kv, kmesh.harness.child, kmesh.model.quality, kmesh.stages.equivalence).

Model: a tiny random float32 LlamaForCausalLM (4 layers, 2 KV heads of 16 channels), built as in
tests/test_model_runner.py. Workload: ByteTokenizer(300), seed 0, 3 segments of 80 tokens (one fact sentence
needs ~70 bytes, so 16/32-token segments cannot be built), 2 children of 352 tokens, blocks of 16.
Export geometry: a block of all 4 layers = 4·16·2·(16+16)·4 B = 16 KiB; a segment = 5 blocks = 80 KiB,
which the service (chunk_bytes 64 KiB) copies in 2 chunks, so "mid-copy" is a real state.

Regressions (end of file): the fallback recomputes over the partial state a failure left (run_child once
re-poisoned it); the controls compare with the reference made before the failure and the killed service's control
checks our own staging mapping; ServiceSegments once reported the catalog's size, not the accepted copy's, to
after_accept, so a truncated object left a surplus gate token; the seven failure controls run at 64 KiB chunks,
where that surplus would let the cancelled / killed controls' copies run past the granted chunk.
Whole file ~10 s on CPU (fixture build ~2 s, each real service ~1-2 s).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kmesh.harness.child import ChildContext, ChildStateError, check_canaries, full_reference, new_cache, run_child
from kmesh.harness.leader import EXPORT_ORDER, export_segments
from kmesh.harness.modelsetup import leader_prefill
from kmesh.harness.workload import ByteTokenizer, WorkloadSpec, build
from kmesh.kv.errors import (SegmentCorruptError, SegmentLayoutError, SegmentMissingError, SegmentOversizeError,
                             SegmentTruncatedError)
from kmesh.kv.load import copy_private, stage_entry, stage_segments
from kmesh.kv.restore import capture
from kmesh.kv.sources import InProcessSegments, ServiceSegments
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import (arm_quality, compare_states, first_divergence, flip_bit, identical, kl_divergence,
                                 max_abs_diff, summarize, teacher_forced_logits, until_end_of_turn)
from kmesh.model.runner import LayerRunner
from kmesh.result import Result
from kmesh.sources.digest import sha256_tensor
from kmesh.stages.equivalence import controls
from kmesh.stages.equivalence import stage as eq_stage
from kmesh.stages.equivalence.refs import FULL, REPAIR, RefKey
from kmesh.transfer.engine import TransferEngine
from kmesh.transfer.errors import SubmitError
from kmesh.transfer.faults import ChunkGate, FaultPlan
from tiny_llama import tiny_llama

SPEC = WorkloadSpec(prompt_tokens=352, segment_tokens=(80, 80, 80), children=2, block_size=16)
SEED = 0
MAX_NEW = 8
BS = 16
L, H, D = 4, 2, 16
BLOCK_BYTES = L * BS * H * 2 * D * 4          # 16384
SEG_BYTES = 80 // BS * BLOCK_BYTES            # 81920
PREFIX = b"kmesh-eq-test/leader"
CHUNK = 65536                                 # service copy pacing: 2 chunks per segment
# The failure controls run at 64 KiB chunks: the truncated-object control's object (one block short) takes 1 chunk
# where a segment takes 2; the gate must be told the accepted copy's size, or its surplus token lets the cancelled
# control's "provably mid-copy" load run to its end (the regression test at the end of this file).
CONTROL_CHUNK = 65536


# --- fixtures ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env():
    model = tiny_llama()
    runner = LayerRunner(model)
    workload = build(ByteTokenizer(vocab_size=300), SEED, SPEC)
    ids = torch.tensor(workload.leader_ids)
    leader_cache = runner.new_cache(len(ids), BS)
    runner.prefill(ids, leader_cache)
    export = export_segments(runner, leader_cache, workload, PREFIX)
    ctx = ChildContext(runner, export.catalog, TransferEngine("cpu"), RepairConfig(), MAX_NEW)
    refs = {}
    for child in workload.children:
        refs[RefKey(FULL, child.name)] = full_reference(ctx, child)
    staging = torch.empty(export.catalog.nbytes, dtype=torch.uint8)
    private = torch.empty_like(staging)
    inproc = InProcessSegments(export)
    for child in workload.children:
        refs[RefKey(REPAIR, child.name)] = run_child(ctx, child, inproc, staging, private)
    # what kmesh.harness.modelsetup.ModelSetup offers the controls (no config, model files or transformers check)
    s = SimpleNamespace(model=model, runner=runner, workload=workload, export=export, ctx=ctx,
                        device=torch.device("cpu"), tok=ByteTokenizer(300), decode=ByteTokenizer(300).decode)
    yield SimpleNamespace(model=model, runner=runner, workload=workload, leader_cache=leader_cache, export=export,
                          ctx=ctx, refs=refs, setup=s)
    ctx.engine.close()


def _streamed(n):
    """run_child's events for n segments verified and then used: each staged (in order), then all of them copied
    private and restored."""
    return [f"{what}:{i}" for what in ("staged", "private-copy-drained", "restored") for i in range(n)]


def _objects(export):
    return {e.key: export.raw[e.offset:e.offset + e.nbytes].clone() for e in export.catalog.entries}


def test_workload_shape(env):
    w = env.workload
    assert [s.tokens for s in w.segments] == [80, 80, 80]
    assert [s.leader_start for s in w.segments] == [16, 96, 176]
    assert len(w.leader_ids) == 256
    assert [len(c.ids) for c in w.children] == [352, 352]
    assert [c.name for c in w.children] == ["A", "B"]
    # every child holds every segment, at positions other than the leader's
    for c in w.children:
        assert sorted(p.segment for p in c.placements) == [0, 1, 2]
        assert all(p.start != w.segments[p.segment].leader_start for p in c.placements)
        assert len(c.restored_positions()) == 240 and len(c.private_positions()) == 112


# --- 1. export ------------------------------------------------------------------------------------------------

def test_export_catalog_digests_offsets_and_bytes(env):
    ex, w = env.export, env.workload
    cat = ex.catalog
    assert cat.layout.order == EXPORT_ORDER == "BLNHC"
    assert cat.layout.byte_strides["B"] == BLOCK_BYTES
    assert ex.raw.dtype == torch.uint8 and ex.raw.numel() == cat.nbytes == 3 * SEG_BYTES
    assert [e.key for e in cat.entries] == [PREFIX + b"/segment-%d" % i for i in range(3)]
    assert [e.offset for e in cat.entries] == [0, SEG_BYTES, 2 * SEG_BYTES]
    assert [e.nbytes for e in cat.entries] == [SEG_BYTES] * 3
    assert [e.first_slot for e in cat.entries] == [0, 80, 160]
    assert [e.leader_start for e in cat.entries] == [16, 96, 176]
    end = 0
    for e in cat.entries:
        assert e.offset % BLOCK_BYTES == 0 and e.nbytes % BLOCK_BYTES == 0
        assert e.offset >= end                  # non-overlapping, in order
        end = e.offset + e.nbytes
        blob = ex.raw[e.offset:e.offset + e.nbytes].numpy().tobytes()
        assert hashlib.sha256(blob).hexdigest() == e.sha256 == sha256_tensor(ex.raw[e.offset:end])
    assert end == cat.nbytes
    assert len({e.sha256 for e in cat.entries}) == 3

    lc = env.leader_cache
    for e in cat.entries:
        a = capture(ex.raw, cat.layout, e.slots(), e.leader_positions())
        b = capture(lc.raw, lc.layout, e.leader_positions(), e.leader_positions())
        assert a.k.shape == b.k.shape == (80, L, H, D)
        assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
        assert torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))
        # independent of capture(): the BLNHC bytes read as [B, L, N, H, K|V] floats are the leader's K/V
        blocks = ex.raw[e.offset:e.offset + e.nbytes].view(torch.float32).view(-1, L, BS, H, 2 * D)
        per_tok = blocks.permute(1, 0, 2, 3, 4).reshape(L, -1, H, 2 * D)      # [L, tokens, H, 2D]
        pos = e.leader_positions()
        for layer in range(L):
            assert torch.equal(per_tok[layer, :, :, :D], lc.k[layer][pos])
            assert torch.equal(per_tok[layer, :, :, D:], lc.v[layer][pos])
    # the stage's own leader_prefill makes the same export
    again = leader_prefill(env.runner, w, PREFIX)
    assert torch.equal(again.raw, ex.raw) and again.catalog == cat


# --- 2. staging -------------------------------------------------------------------------------------------------

def test_stage_segments_success(env):
    cat = env.export.catalog
    staging = torch.zeros(cat.nbytes, dtype=torch.uint8)
    seen = []
    stage_segments(InProcessSegments(env.export), staging, cat, on_staged=lambda e: seen.append(e.index))
    assert seen == [0, 1, 2]
    assert torch.equal(staging, env.export.raw)


def test_stage_segments_missing_corrupt_truncated(env):
    ex, cat = env.export, env.export.catalog
    staging = torch.empty(cat.nbytes, dtype=torch.uint8)
    k0, k1, k2 = (e.key for e in cat.entries)

    objs = _objects(ex)
    del objs[k1]
    seen = []
    with pytest.raises(SegmentMissingError, match="segment-1"):
        stage_segments(InProcessSegments(ex, objs), staging, cat, on_staged=lambda e: seen.append(e.index))
    assert seen == [0]

    with pytest.raises(SegmentMissingError):
        stage_segments(InProcessSegments(ex, {}), staging, cat)

    objs = _objects(ex)
    objs[k0][SEG_BYTES // 2] ^= 0x01           # one bit
    with pytest.raises(SegmentCorruptError, match="segment-0"):
        stage_segments(InProcessSegments(ex, objs), staging, cat)

    objs = _objects(ex)
    objs[k2] = objs[k2][:-BLOCK_BYTES].clone()  # one block short
    with pytest.raises(SegmentTruncatedError, match=f"has {SEG_BYTES - BLOCK_BYTES} bytes"):
        stage_segments(InProcessSegments(ex, objs), staging, cat)

    objs = _objects(ex)
    objs[k1] = objs[k1][:-1].clone()            # one byte short
    with pytest.raises(SegmentTruncatedError):
        stage_segments(InProcessSegments(ex, objs), staging, cat)

    objs = _objects(ex)
    objs[k2] = torch.cat([objs[k2], torch.zeros(1, dtype=torch.uint8)])   # longer (would overrun the buffer)
    with pytest.raises(SegmentOversizeError, match=f"has {SEG_BYTES + 1} bytes"):
        stage_segments(InProcessSegments(ex, objs), staging, cat)


class _Silent:
    """A source whose copies 'succeed' with the right size but write nothing."""

    name = "silent"

    def load(self, entry, staging):
        return entry.nbytes


def test_stage_segments_poisons_staging_first(env):
    cat = env.export.catalog
    staging = env.export.raw.clone()            # already holds exactly the right bytes
    with pytest.raises(SegmentCorruptError, match="segment-0"):
        stage_segments(_Silent(), staging, cat)
    assert bool((staging == 0xA5).all())


# --- 3. the private copy ----------------------------------------------------------------------------------------

def test_copy_private_submit_error_raised_only_after_drain():
    n = 64 * 4096
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.zeros_like(src)
    gate = ChunkGate()
    engine = TransferEngine("cpu", FaultPlan(fail_after_submit=1, chunk_bytes=4096), gate=gate)
    granted = threading.Event()

    def release_later():
        time.sleep(0.2)
        granted.set()
        gate.allow(n // 4096)

    t = threading.Thread(target=release_later)
    t.start()
    try:
        with pytest.raises(SubmitError) as ei:
            copy_private(engine, src, dst, "child-X")
        # seen only now: the gated copy could not finish before the grant, and it is drained
        assert granted.is_set()
        assert engine.pending() == [] and engine.pending("child-X") == []
        assert engine.live_holds() == 0
        assert torch.equal(dst, src)
        assert [tk.state for tk in ei.value.pending] == ["done"]
        assert ei.value.pending[0].chunks_done == 64
    finally:
        t.join()
        gate.close()
        engine.close()


def test_copy_private_plain(env):
    src = env.export.raw
    dst = torch.zeros_like(src)
    engine = TransferEngine("cpu")
    try:
        copy_private(engine, src, dst, "child-Y")
        assert torch.equal(dst, src) and engine.pending() == [] and engine.live_holds() == 0
    finally:
        engine.close()


# --- 4. run_child in-process -----------------------------------------------------------------------------------

def test_run_child_in_process_uses_segments(env):
    for child in env.workload.children:
        out = env.refs[RefKey(REPAIR, child.name)]
        T = len(child.ids)
        assert out.fallback is None and out.arm == "repair" and out.source == "in-process"
        assert out.events == _streamed(3)
        assert out.written_before_recompute is None
        mask = torch.zeros(T, dtype=torch.bool)
        mask[child.restored_positions()] = True
        assert torch.equal(out.restored, mask) and int(out.restored.sum()) == 240
        assert len(out.tokens) == MAX_NEW
        assert out.k.shape == out.v.shape == (L, T, H, D)
        assert not torch.isnan(out.k).any() and not torch.isnan(out.v).any()
        # layer 0: everything recomputed; from check layer 1: 112 private (incl. the last) + ceil(0.15·240)
        assert out.masks.sum(1).tolist() == [352, 148, 148, 148]
        assert bool(out.masks[:, child.private_positions()].all())
        # restored (RoPE-shifted) K/V stay at the 204 positions not recomputed: not the full-recompute state
        ref = env.refs[RefKey(FULL, child.name)]
        cmp = compare_states(out, ref)
        assert not identical(cmp) and cmp["k_equal_layers"] < L and cmp["mask_equal_layers"] == 1
    # deterministic: the same child again is bit-identical
    child = env.workload.children[0]
    staging = torch.empty(env.export.catalog.nbytes, dtype=torch.uint8)
    again = run_child(env.ctx, child, InProcessSegments(env.export), staging, torch.empty_like(staging))
    assert identical(compare_states(again, env.refs[RefKey(REPAIR, "A")]))


def test_every_digest_is_checked_in_one_call_and_the_first_bad_segment_decides(env, monkeypatch):
    """The child path loads every segment, then checks all their digests in one arrival_digests call (on the GPU:
    one launch set, not one per segment); a corrupt segment 1 and a missing segment 2 fail at 1 (the corrupt one:
    the first in catalog order), a missing 1 and a corrupt 2 at 1 (the missing one); segment 0 restored either way."""
    from kmesh.kv import digests as segments_mod

    ex, child = env.export, env.workload.children[0]
    n = len(ex.catalog.entries)
    calls = []
    real = segments_mod.arrival_digests
    monkeypatch.setattr(segments_mod, "arrival_digests",
                        lambda alg, views: calls.append(len(views)) or real(alg, views))
    staging = torch.empty(ex.catalog.nbytes, dtype=torch.uint8)
    out = run_child(env.ctx, child, InProcessSegments(ex), staging, torch.empty_like(staging))
    assert out.fallback is None and calls == [n]
    e1, e2 = ex.catalog.entries[1], ex.catalog.entries[2]
    for corrupt, missing, error in ((e1, e2, "SegmentCorruptError"), (e2, e1, "SegmentMissingError")):
        objs = _objects(ex)
        objs[corrupt.key][123] ^= 0x40
        del objs[missing.key]
        calls.clear()
        out = run_child(env.ctx, child, InProcessSegments(ex, objs), staging, torch.empty_like(staging))
        assert out.fallback.startswith(error), out.fallback
        assert out.events[:4] == ["staged:0", "private-copy-drained:0", "restored:0", f"failed:{error}"], out.events
        want = controls.expected_partial(child, out.written_before_recompute.numel(), 1)
        assert torch.equal(out.written_before_recompute, want)
        assert out.tokens == env.refs[RefKey(FULL, child.name)].tokens
        # loaded before the missing one: both (corrupt 1, missing 2) or only segment 0 (missing 1), in one call
        assert calls == ([2] if missing is e2 else [1]), calls


def test_run_child_corrupt_source_falls_back_to_full_recompute(env):
    ex = env.export
    for idx, child in enumerate(env.workload.children):
        objs = _objects(ex)
        bad = ex.catalog.entries[1 + idx]
        objs[bad.key][123] ^= 0x40
        staging = torch.empty(ex.catalog.nbytes, dtype=torch.uint8)
        out = run_child(env.ctx, child, InProcessSegments(ex, objs), staging, torch.empty_like(staging))
        ref = env.refs[RefKey(FULL, child.name)]
        assert out.fallback.startswith("SegmentCorruptError"), out.fallback
        assert out.events[-1] == "recompute" and "pending-before-recompute:0" in out.events
        # the segments before the corrupt one were copied and restored, the corrupt one refused on arrival
        assert out.events[:3 * (1 + idx)] == _streamed(1 + idx)
        assert out.events[3 * (1 + idx)] == "failed:SegmentCorruptError"
        assert out.arm == "full" and not bool(out.restored.any())
        # the recompute ran over those restored segments and still equals the reference
        want = controls.expected_partial(child, out.written_before_recompute.numel(), 1 + idx)
        assert bool(want.any()) and torch.equal(out.written_before_recompute, want)
        assert out.tokens == ref.tokens and len(out.tokens) == MAX_NEW
        assert torch.equal(out.logits, ref.logits)
        assert identical(compare_states(out, ref))


def test_run_child_submit_error_falls_back_after_drain(env):
    child = env.workload.children[1]
    engine = TransferEngine("cpu", FaultPlan(fail_after_submit=1, chunk_bytes=4096))
    try:
        ctx = dataclasses.replace(env.ctx, engine=engine)
        staging = torch.empty(env.export.catalog.nbytes, dtype=torch.uint8)
        out = run_child(ctx, child, InProcessSegments(env.export), staging, torch.empty_like(staging))
        assert out.fallback.startswith("PrivateCopyError: private copy of segment 0 failed: SubmitError")
        # the first segment's private copy fails after it was accepted: nothing restored yet
        n = len(env.export.catalog.entries)
        assert out.events == [f"staged:{i}" for i in range(n)] + ["failed:PrivateCopyError",
                                                                   "pending-before-recompute:0", "recompute"]
        assert not bool(out.written_before_recompute.any())
        assert engine.pending() == [] and engine.live_holds() == 0
        assert identical(compare_states(out, env.refs[RefKey(FULL, child.name)]))
    finally:
        engine.close()


def testcheck_canaries_catches_leftover_poison_and_overwritten_canary(env):
    child = env.workload.children[0]
    used = len(child.ids) + MAX_NEW - 1
    cache = new_cache(env.ctx, child)
    assert cache.capacity >= used + BS
    for k, v in zip(cache.k, cache.v):
        k[:used] = 0.5
        v[:used] = 0.5
    check_canaries(cache, used)                  # passes
    cache.v[2][used - 1, 1, 3] = float("nan")
    with pytest.raises(ChildStateError, match="layer 2: poison left"):
        check_canaries(cache, used)
    cache.v[2][used - 1, 1, 3] = 0.5
    cache.k[3][used, 0, 0] = 1.0
    with pytest.raises(ChildStateError, match="layer 3: a canary"):
        check_canaries(cache, used)


# --- 5. the cache service ---------------------------------------------------------------------------------------

def _service(chunk_bytes: int = CHUNK):
    from kmesh.harness.service import Harness

    return Harness(device="cpu", heartbeat_timeout_s=30, chunk_bytes=chunk_bytes)


def test_service_children_bit_identical_to_in_process(env):
    from kmesh.harness.service_side import ServiceSide

    ex, cat = env.export, env.export.catalog
    private = torch.empty(cat.nbytes, dtype=torch.uint8)
    with _service() as h, ServiceSide(h, ex, torch.device("cpu")) as svc:
        saved = svc.save_leader()
        assert saved == {e.key: e.sha256 for e in cat.entries}
        assert svc.no_leaks(), svc.leaks()
        for child in env.workload.children:
            with svc.staging(f"child-{child.name}") as st:
                assert st.tensor.numel() == cat.nbytes
                src = ServiceSegments(svc.client, st.reg, svc.after_accept)
                b = run_child(env.ctx, child, src, st.tensor, private)
                assert len(src.requests) == 3
                assert torch.equal(st.tensor, ex.raw)        # staged bytes are the export
            assert b.fallback is None and b.source == "service"
            cmp = compare_states(env.refs[RefKey(REPAIR, child.name)], b)
            assert identical(cmp), cmp
            assert cmp["k_equal_layers"] == cmp["v_equal_layers"] == cmp["mask_equal_layers"] == L
            assert svc.no_leaks(), svc.leaks()
        now = svc.store_digests(verify=True)
        assert {e.key: now[e.key] for e in cat.entries} == {e.key: (e.sha256, e.sha256) for e in cat.entries}

        # failure: an evicted object -> SegmentMissingError fallback, nothing leaked
        e1 = cat.entries[1]
        key = e1.key + b"-evicted"
        svc.save_variant(e1, key)
        assert key in svc.store_digests()
        h.admin.evict(key)
        assert key not in svc.store_digests()
        entries = tuple(dataclasses.replace(e, key=key) if e.index == 1 else e for e in cat.entries)
        ctx = dataclasses.replace(env.ctx, catalog=dataclasses.replace(cat, entries=entries))
        child = env.workload.children[0]
        with svc.staging("evicted") as st:
            out = run_child(ctx, child, ServiceSegments(svc.client, st.reg, svc.after_accept), st.tensor, private)
        assert out.fallback.startswith("SegmentMissingError"), out.fallback
        assert out.events[0] == "staged:0" and out.events[-1] == "recompute"
        assert identical(compare_states(out, env.refs[RefKey(FULL, "A")]))
        assert svc.no_leaks(), svc.leaks()

        # failure: a staging buffer registered under another geometry -> SegmentLayoutError
        bad = {**cat.layout.to_dict(), "order": "BLHNC"}
        with svc.staging("wrong-layout", bad) as st:
            src = ServiceSegments(svc.client, st.reg, svc.after_accept)
            with pytest.raises(SegmentLayoutError):
                src.load(cat.entries[0], st.tensor)
            out = run_child(env.ctx, child, src, st.tensor, private)
        assert out.fallback.startswith("SegmentLayoutError") and "pending-before-recompute:0" in out.events
        assert out.tokens == env.refs[RefKey(FULL, "A")].tokens
        assert svc.no_leaks(), svc.leaks()
        # the originals are still intact after the failures
        now = svc.store_digests(verify=True)
        assert all(now[e.key] == (e.sha256, e.sha256) for e in cat.entries)


# --- 6. quality helpers and negative controls -------------------------------------------------------------------

def test_quality_helpers(env):
    x = env.refs[RefKey(FULL, "A")].logits
    y = env.refs[RefKey(REPAIR, "A")].logits
    assert kl_divergence(x, x) == 0.0
    assert kl_divergence(x, y) > 0.0
    assert kl_divergence(x, x + 3.0) == pytest.approx(0.0, abs=1e-12)   # shift-invariant
    z = x.clone()
    z[0] += 5.0
    assert kl_divergence(x, z) > 1e-6
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([4, 2, 3], [1, 2, 3]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [1]) == 0
    assert max_abs_diff(x, x) == 0.0 and max_abs_diff(x, x[:-1]) == math.inf
    nan = x.clone()
    nan[7] = float("nan")
    assert max_abs_diff(x, nan) == math.inf


def _exact(text, answer):
    return answer in text


def test_teacher_forced_kl_sees_a_drift_after_the_first_token(env):
    """A state whose first-token logits equal full's exactly but whose prompt K/V are off at later layers: the
    first-token KL is 0, top-1 agrees and (with the same greedy tokens) nothing diverges — only teacher forcing
    along full's continuation sees it."""
    ref = env.refs[RefKey(FULL, "A")]
    k = ref.k.clone()
    k[2:, : k.shape[1] // 2] += 0.5 * torch.randn(k[2:, : k.shape[1] // 2].shape,
                                                  generator=torch.Generator().manual_seed(0))
    drifted = dataclasses.replace(ref, k=k)        # same logits and tokens as full: token 1 is right
    ref_steps = teacher_forced_logits(env.runner, ref, ref.tokens, BS)
    steps = teacher_forced_logits(env.runner, drifted, ref.tokens, BS)
    q = arm_quality(ref, drifted, "", env.setup.decode, _exact, ref_steps, steps)
    assert q["kl"] == 0.0 and q["top1_agree"] and q["first_divergence"] == len(ref.tokens)
    assert q["kl_per_step"][0] == 0.0 and q["teacher_forced_steps"] == len(ref.tokens) == MAX_NEW
    assert q["kl_teacher_forced"] > 1e-4 and min(q["kl_per_step"][1:]) > 0.0, q["kl_per_step"]
    same = arm_quality(ref, ref, "", env.setup.decode, _exact, ref_steps, ref_steps)
    assert same["kl_teacher_forced"] == 0.0 and same["top1_teacher_forced"] == 1.0
    # teacher forcing the full state with its own tokens gives back its greedy tokens; the outcome is untouched
    assert ref_steps.argmax(-1).tolist() == ref.tokens and torch.equal(ref_steps[0], ref.logits)


def test_generation_measures_stop_at_end_of_turn(env):
    """Exact-match and first divergence read the continuation only up to the end-of-turn token; decoding through
    a child context with stop ids ends there (canaries still checked)."""
    assert until_end_of_turn([5, 6, 7, 8], (7,)) == [5, 6, 7] and until_end_of_turn([5, 6], (7,)) == [5, 6]
    assert first_divergence([1, 7, 3, 4], [1, 7, 9, 9], stop_ids=(7,)) == 2
    assert first_divergence([1, 2, 3], [1, 2, 9], stop_ids=(2,)) == 2    # equal through the end of the turn
    ref = env.refs[RefKey(FULL, "A")]
    j = next(i for i in range(1, MAX_NEW - 1) if ref.tokens[i] not in ref.tokens[:i])   # a first occurrence
    eot = ref.tokens[j]
    answer = env.setup.decode(ref.tokens[j + 1:])
    rows = torch.stack([ref.logits] * len(ref.tokens))
    q = arm_quality(ref, ref, answer, env.setup.decode, _exact, rows, rows, stop_ids=(eot,))
    assert q["text"] == env.setup.decode(ref.tokens[:j + 1]) and answer not in q["text"]
    assert not q["exact_match"]   # an answer generated after the end of the turn is not the model's answer
    assert arm_quality(ref, ref, answer, env.setup.decode, _exact, rows, rows)["exact_match"]   # without stop ids
    child = env.workload.children[0]
    ctx = dataclasses.replace(env.ctx, stop_ids=(eot,))
    full = full_reference(ctx, child)
    assert full.tokens == ref.tokens[:j + 1] and len(full.tokens) < MAX_NEW
    staging = torch.empty(env.export.catalog.nbytes, dtype=torch.uint8)
    rep = run_child(ctx, child, InProcessSegments(env.export), staging, torch.empty_like(staging))
    assert rep.fallback is None and rep.tokens == until_end_of_turn(env.refs[RefKey(REPAIR, "A")].tokens, (eot,))


def test_quality_case_stock_matched_gets_the_repair_count(env):
    """The quality case's five arms: stock-matched recomputes exactly the repair arm's count for every child
    (unrestored positions included), plain stock its own int(0.15·T); every arm is measured teacher-forced."""
    # stock's ratio differs from repair's, so an arm run with the other's config shows in its count
    setup = SimpleNamespace(**vars(env.setup), sec={"repair": {"check_layers": [1], "recompute_ratio": 0.15},
                                                   "stock": {"check_layers": [1], "recompute_ratio": 0.2},
                                                   "chance_seeds": 2})
    res = Result("equivalence", "cpu", {}, [])
    quality, claim = eq_stage._quality_case(res, setup, env.refs)
    case = res.cases[-1]
    assert case.id == "quality" and case.passed, {n: c for n, c in case.checks.items() if c["ok"] is False}
    assert list(quality) == ["full", "naive", "stock", "stock-matched", "repair"]
    per = case.checks["per_child"]["value"]
    T = len(env.workload.children[0].ids)
    for rep, matched, stock, naive in zip(per["repair"], per["stock-matched"], per["stock"], per["naive"]):
        assert rep["recomputed_positions"] == matched["recomputed_positions"] == 112 + math.ceil(0.15 * 240)
        assert stock["recomputed_positions"] == int(0.2 * T) == 70
        assert naive["recomputed_positions"] == 112                        # the unrestored positions only
        assert rep["recomputed_fraction_of_positions"] == 148 / 352
        assert rep["recomputed_fraction_of_restored"] == math.ceil(0.15 * 240) / 240
        assert matched["teacher_forced_steps"] == MAX_NEW
    assert quality["stock-matched"]["recomputed_positions"] == quality["repair"]["recomputed_positions"]
    assert quality["full"]["recomputed_fraction_of_positions_mean"] == 1.0
    assert quality["full"]["recomputed_fraction_of_restored_mean"] is None   # the full arm restores nothing
    # the full state equals the reference bit for bit: its teacher-forced KL is the batched forward's rounding floor
    assert 0 <= quality["full"]["kl_teacher_forced_mean"] < 1e-9 and quality["full"]["kl_first_token_mean"] == 0.0
    assert set(claim) >= {"kl_first_token_mean", "kl_teacher_forced_mean"}
    assert claim["kl_teacher_forced_mean"]["met"] == (quality["repair"]["kl_teacher_forced_mean"]
                                                     < quality["stock-matched"]["kl_teacher_forced_mean"])
    assert summarize(per["repair"]) == quality["repair"]
    same = case.checks["stock_matched_recomputed_the_same_positions_as_repair"]["value"]
    assert set(same) == {"A", "B"} and claim["children_same_positions_recomputed"] == sum(same.values())


def test_quality_claim_counts_are_the_per_child_comparisons(env, monkeypatch):
    """The repair-vs-stock-matched record: its child counts are the per-child rows' own comparisons, and
    children_same_positions_recomputed counts the children whose stock-matched mask equals repair's (here made
    equal on purpose: stock-matched handed repair's outcome)."""
    setup = _quality_setup(env)
    res = Result("equivalence", "test", provenance={})
    quality, claim = eq_stage._quality_case(res, setup, env.refs)
    per = res.cases[-1].checks["per_child"]["value"]
    lower = sum(r["kl_teacher_forced"] < m["kl_teacher_forced"] for r, m in zip(per["repair"], per["stock-matched"]))
    assert claim["children"] == len(env.workload.children) == 2
    assert claim["children_repair_lower_kl_teacher_forced"] == lower
    for key in ("kl_first_token_mean", "kl_teacher_forced_mean"):
        assert claim[key] == {"repair": quality["repair"][key], "stock-matched": quality["stock-matched"][key],
                              "met": quality["repair"][key] < quality["stock-matched"][key]}
    assert res.cases[-1].checks["claim_repair_better_than_stock_matched"]["value"] == claim

    real = eq_stage.run_child

    def matched_is_repair(ctx, child, source, staging, private, arm="repair"):
        if ctx.repair.recompute_counts is not None:            # stock-matched's fixed budget
            return env.refs[RefKey(REPAIR, child.name)]
        return real(ctx, child, source, staging, private, arm=arm)

    monkeypatch.setattr(eq_stage, "run_child", matched_is_repair)
    res = Result("equivalence", "test", provenance={})
    _, claim = eq_stage._quality_case(res, setup, env.refs)
    same = res.cases[-1].checks["stock_matched_recomputed_the_same_positions_as_repair"]["value"]
    assert same == {"A": True, "B": True} and claim["children_same_positions_recomputed"] == 2
    assert claim["children_repair_lower_kl_teacher_forced"] == 0      # equal KL is not lower


def test_quality_arm_that_fell_back_fails_arms_used_segments(env, monkeypatch):
    """An arm whose segments could not be used recomputes in full (its fallback): its numbers would be full's,
    not the arm's, so the case fails and names the child and arm."""
    real = eq_stage.run_child
    objects = _objects(env.export)
    first = env.export.catalog.entries[0].key
    objects[first][7] ^= 0x01

    def naive_from_a_corrupt_object(ctx, child, source, staging, private, arm="repair"):
        if arm == "naive" and child.name == "B":
            source = InProcessSegments(env.export, objects)
        return real(ctx, child, source, staging, private, arm=arm)

    monkeypatch.setattr(eq_stage, "run_child", naive_from_a_corrupt_object)
    res = Result("equivalence", "test", provenance={})
    eq_stage._quality_case(res, _quality_setup(env), env.refs)
    (case,) = res.cases
    check = case.checks["arms_used_segments"]
    assert check["ok"] is False and case.passed is False
    assert check["value"]["A"] == {} and list(check["value"]["B"]) == ["naive"]
    assert "SegmentCorruptError" in str(check["value"]["B"]["naive"])


def _flip_bit(t, index):
    out = t.clone()
    out.view(-1).view(torch.uint8)[index] ^= 0x01
    return out


def test_flip_bit_changes_exactly_one_bit():
    x = torch.arange(8, dtype=torch.bfloat16)
    y = flip_bit(x, 5)
    diff = x.view(torch.uint8) ^ y.view(torch.uint8)
    assert diff.nonzero().flatten().tolist() == [5] and int(diff[5]) == 1
    assert torch.equal(x, torch.arange(8, dtype=torch.bfloat16))          # the original is left alone
    mask = torch.zeros(6, dtype=torch.bool)
    assert flip_bit(mask, 2).nonzero().flatten().tolist() == [2]          # a bool tensor: that element


def test_compare_states_catches_single_bit_flips(env):
    base = env.refs[RefKey(REPAIR, "A")]
    assert identical(compare_states(base, dataclasses.replace(base)))
    for field_name, layer in (("k", 2), ("v", 0)):
        t = getattr(base, field_name).clone()
        t[layer] = _flip_bit(t[layer], 4 * 1000 + 0)      # lowest mantissa bit of one element
        cmp = compare_states(base, dataclasses.replace(base, **{field_name: t}))
        assert not identical(cmp)
        assert cmp[f"{field_name}_equal_layers"] == L - 1 and cmp["first_unequal_layer"] == layer
        assert 0.0 < cmp["max_abs_diff"] < 1e-5
    cmp = compare_states(base, dataclasses.replace(base, logits=_flip_bit(base.logits, 0)))
    assert not cmp["logits_equal"] and not identical(cmp)
    m = base.masks.clone()
    m[3, 5] = ~m[3, 5]
    cmp = compare_states(base, dataclasses.replace(base, masks=m))
    assert cmp["mask_equal_layers"] == L - 1 and cmp["first_unequal_layer"] == 3 and not identical(cmp)
    r = base.restored.clone()
    r[0] = ~r[0]
    assert not identical(compare_states(base, dataclasses.replace(base, restored=r)))
    toks = list(base.tokens)
    toks[-1] += 1
    assert not identical(compare_states(base, dataclasses.replace(base, tokens=toks)))
    # a NaN in both: byte-equal, yet max_abs_diff is inf -> not identical
    k = base.k.clone()
    k[1, 0, 0, 0] = float("nan")
    cmp = compare_states(dataclasses.replace(base, k=k), dataclasses.replace(base, k=k.clone()))
    assert cmp["k_equal_layers"] == L and not identical(cmp)


def test_negative_controls_case_passes(env):
    res = Result("equivalence", "test", provenance={})
    controls.negative_controls(res, env.setup, env.refs)
    (case,) = res.cases
    assert case.id == "negative-controls" and case.error is None and case.passed, case.checks
    assert set(case.checks) == {"identical_to_a_rerun", "k_bit_flip_caught", "v_bit_flip_caught",
                                "logits_bit_flip_caught", "mask_flip_caught", "token_change_caught",
                                "staged_byte_flip_caught"}


def _negative_controls_with(env, monkeypatch, distort):
    """negative_controls with its comparator's answers passed through `distort(a, b, cmp)`: a detector that
    misses or misplaces a perturbation."""
    real = controls.compare_states
    monkeypatch.setattr(controls, "compare_states", lambda a, b: distort(a, b, real(a, b)))
    res = Result("equivalence", "test", provenance={})
    controls.negative_controls(res, env.setup, env.refs)
    (case,) = res.cases
    assert case.error is None, case.error
    return case


def test_a_k_flip_seen_in_the_wrong_layers_fails_its_negative_control(env, monkeypatch):
    # the comparator sees K change, but in every layer, not the one flipped: caught, but not where it was made
    case = _negative_controls_with(env, monkeypatch, lambda a, b, cmp: cmp if torch.equal(a.k, b.k)
                                   else {**cmp, "k_equal_layers": 0, "first_unequal_layer": 0})
    assert case.checks["k_bit_flip_caught"]["ok"] is False and case.passed is False
    assert case.checks["v_bit_flip_caught"]["ok"] and case.checks["logits_bit_flip_caught"]["ok"]


def test_a_k_flip_seen_in_one_layer_too_many_fails_its_negative_control(env, monkeypatch):
    # the comparator places the flip at the right first layer but also sees a later layer change: the count is
    # wrong alone (mutation survivor: `and` -> `or` before the first-layer comparison)
    case = _negative_controls_with(env, monkeypatch, lambda a, b, cmp: cmp if torch.equal(a.k, b.k)
                                   else {**cmp, "k_equal_layers": cmp["k_equal_layers"] - 1})
    assert case.checks["k_bit_flip_caught"]["ok"] is False and case.passed is False
    assert case.checks["v_bit_flip_caught"]["ok"] and case.checks["logits_bit_flip_caught"]["ok"]


def test_a_logits_flip_the_logits_comparison_misses_fails_its_negative_control(env, monkeypatch):
    # logits_equal misses the flip; the state still differs in max_abs_diff, which alone must not pass the control
    case = _negative_controls_with(env, monkeypatch, lambda a, b, cmp: cmp if torch.equal(a.logits, b.logits)
                                   else {**cmp, "logits_equal": True})
    assert case.checks["logits_bit_flip_caught"]["ok"] is False and case.passed is False
    assert case.checks["k_bit_flip_caught"]["ok"]


def test_a_stager_that_does_not_check_digests_fails_the_staged_byte_control(env, monkeypatch):
    monkeypatch.setattr(controls, "stage_segments", lambda source, staging, catalog: None)
    res = Result("equivalence", "test", provenance={})
    controls.negative_controls(res, env.setup, env.refs)
    (case,) = res.cases
    check = case.checks["staged_byte_flip_caught"]
    assert check["ok"] is False and check["value"] == "no error" and case.passed is False


def test_failure_controls_refuse_a_catalog_of_one_segment():
    """They fail at segment 1 with segment 0 restored: a one-segment catalog cannot host them (a clear error, not
    an IndexError); two segments can."""
    one = SimpleNamespace(export=SimpleNamespace(catalog=SimpleNamespace(entries=(object(),))))
    with pytest.raises(controls.ControlSetupError, match="this catalog has 1 segment"):
        controls.failure_controls(Result("equivalence", "test", provenance={}), one, None, {})
    two = SimpleNamespace(export=SimpleNamespace(catalog=SimpleNamespace(entries=(object(), object()))))
    with pytest.raises(AttributeError):     # past the refusal: it reaches for the rest of the setup
        controls.failure_controls(Result("equivalence", "test", provenance={}), two, None, {})


# --- 7. the seven failure controls against a real service --------------------------------------------------------

def test_failure_controls_all_seven_pass(env):
    from kmesh.harness.service_side import ServiceSide

    res = Result("equivalence", "test", provenance={})
    with _service(CONTROL_CHUNK) as h, ServiceSide(h, env.export, torch.device("cpu")) as svc:
        svc.save_leader()
        passed = controls.failure_controls(res, env.setup, svc, env.refs)
        assert not h.service.alive()            # the last control killed it
    failed = {c.id: (c.error, {k: v for k, v in c.checks.items() if not v["ok"]}) for c in res.cases if not c.passed}
    assert failed == {}
    assert passed == 7
    assert [c.id for c in res.cases] == [
        "control-missing-object", "control-corrupt-object", "control-truncated-object",
        "control-wrong-layout-descriptor", "control-failure-after-device-work-submitted",
        "control-cancelled-child", "control-service-killed-mid-load"]
    expect = ["SegmentMissingError", "SegmentCorruptError", "SegmentTruncatedError", "SegmentLayoutError",
              "PrivateCopyError", "SegmentCancelledError", "SegmentSourceLostError"]
    assert [c.params["expect"] for c in res.cases] == expect
    # the private copy's failure is the injected SubmitError of segment 1's copy, wrapped
    assert res.cases[4].checks["failed_by_the_expected_cause"]["ok"]
    assert "private copy of segment 1 failed: SubmitError" in res.cases[4].checks["failed_as_expected"]["value"]
    for c in res.cases:
        assert c.checks["failed_as_expected"]["ok"] and c.checks["recomputed_after_drain"]["ok"]
        assert ("no_service_leaks" in c.checks) == (c.id != "control-service-killed-mid-load")
        # every control failed at segment 1 with segment 0 (80 tokens at one placement) restored in the model
        # state: the recompute ran over it and equals the reference made before the service started
        assert c.params["segment"] == controls.FAIL_AT == 1
        assert c.checks["partial_data_in_destination"]["value"]["slots_written"] == 80
        for name in ("kv", "logits", "tokens"):
            assert c.checks[f"{name}_equal_pre_failure_reference"]["ok"]
    killed = res.cases[-1].checks
    assert killed["staging_unmapped_in_child"]["ok"] and killed["staging_fd_closed_in_child"]["ok"]
    # what landed of segment 1 in staging (bytes no longer the 0xA5 fill; a data byte may be 0xA5 too): nothing
    # when refused before its copy, one chunk when the service died after it, about all of it otherwise (the
    # service lets a cancelled copy run out)
    landed = {c.id[len("control-"):]: c.checks["failing_segment_bytes_landed_in_staging"]["value"] for c in res.cases}
    assert landed["missing-object"] == landed["wrong-layout-descriptor"] == 0
    assert 0 < landed["service-killed-mid-load"] <= CONTROL_CHUNK < SEG_BYTES * 0.9 < landed["cancelled-child"]
    assert env.ctx.engine.pending() == [] and env.ctx.engine.live_holds() == 0


def test_fallback_recomputes_over_the_partial_state(env, monkeypatch):
    """Regression: run_child re-poisoned the model state before its fallback recompute, so a failure control
    compared a recompute in fresh memory with a recompute — it never showed a recompute overwriting partial
    data. Now the recompute starts in the state the failure left: segment 0 restored."""
    import kmesh.harness.child as child_mod

    seen = []
    real = child_mod.prefill_and_decode

    def spy(ctx, child, cache, restored, arm):
        if arm == "full":     # the slots holding something other than the NaN poison, seen independently here
            seen.append(torch.stack([~torch.isnan(k).all(2).all(1) | ~torch.isnan(v).all(2).all(1)
                                     for k, v in zip(cache.k, cache.v)]).any(0))
        return real(ctx, child, cache, restored, arm)

    monkeypatch.setattr(child_mod, "prefill_and_decode", spy)
    ex = env.export
    objs = _objects(ex)
    del objs[ex.catalog.entries[1].key]
    child = env.workload.children[0]
    staging = torch.empty(ex.catalog.nbytes, dtype=torch.uint8)
    out = run_child(env.ctx, child, InProcessSegments(ex, objs), staging, torch.empty_like(staging))
    assert out.fallback.startswith("SegmentMissingError")
    (at_recompute,) = seen
    want = torch.zeros(at_recompute.numel(), dtype=torch.bool)
    (start,) = [a for seg, a, _ in child.segment_slices() if seg == 0]
    want[start:start + 80] = True              # segment 0, restored before segment 1 went missing
    assert torch.equal(at_recompute, want), int(at_recompute.sum())
    assert identical(compare_states(out, env.refs[RefKey(FULL, child.name)]))
    assert torch.equal(out.written_before_recompute, want)


def _control_case(case_id="control-x"):
    res = Result("equivalence", "test", provenance={})
    return res, res.case(case_id, {})


def test_settled_fails_a_destination_without_partial_data(env):
    """A fallback whose destination was re-poisoned (or that failed before any byte landed) records no partial
    data: partial_data_in_destination fails, as does a state the failure left anywhere but segment 0's slots."""
    child = env.workload.children[0]
    ref = env.refs[RefKey(FULL, child.name)]
    cap = new_cache(env.ctx, child).capacity
    want = controls.expected_partial(child, cap, controls.FAIL_AT)
    base = dataclasses.replace(ref, fallback="SegmentMissingError: x", events=["pending-before-recompute:0",
                                                                               "recompute"])
    for written, ok in ((want, True), (torch.zeros(cap, dtype=torch.bool), False), (None, False),
                        (want | (torch.arange(cap) == cap - 1), False)):
        res, cm = _control_case()
        with cm as case:
            ran = controls.Ran(env.ctx, dataclasses.replace(base, written_before_recompute=written), None, 0)
            passed = controls._settled(case, ran, ref, SegmentMissingError, None, child)
        assert case.checks["partial_data_in_destination"]["ok"] is ok and passed is ok


def test_settled_fails_each_two_part_check_on_either_part_alone(env):
    """recomputed_after_drain needs the drain before the recompute AND the recompute last; the pre-failure
    reference needs K AND V equal; no_engine_holds needs no hold AND nothing pending. One part wrong fails each
    (mutation survivors: `and` -> `or` in each)."""
    child = env.workload.children[0]
    ref = env.refs[RefKey(FULL, child.name)]
    cap = new_cache(env.ctx, child).capacity
    want = controls.expected_partial(child, cap, controls.FAIL_AT)
    good = dataclasses.replace(ref, fallback="SegmentMissingError: x", written_before_recompute=want,
                               events=["pending-before-recompute:0", "recompute"])

    def engine(holds, pending):
        return SimpleNamespace(engine=SimpleNamespace(live_holds=lambda: holds, pending=lambda: pending))

    def settle(out, ctx=None):
        res, cm = _control_case()
        with cm as case:
            passed = controls._settled(case, controls.Ran(ctx or engine(0, []), out, None, 0), ref,
                                       SegmentMissingError, None, child)
        return case, passed

    case, passed = settle(good)                              # the baseline passes every check
    assert passed and not [k for k, c in case.checks.items() if c["ok"] is False], case.checks   # (records: ok None)
    for events in (["recompute"],                                               # no drain before the recompute
                   ["pending-before-recompute:0", "recompute", "restored:1"]):  # the recompute is not last
        case, passed = settle(dataclasses.replace(good, events=events))
        assert case.checks["recomputed_after_drain"]["ok"] is False and passed is False
    for field in ("k", "v"):                                 # one of K, V off by one bit, the other equal
        case, passed = settle(dataclasses.replace(good, **{field: flip_bit(getattr(good, field), 0)}))
        assert case.checks["kv_equal_pre_failure_reference"]["ok"] is False and passed is False
    for holds, pending in ((0, ["ticket"]), (1, [])):         # nothing held but a copy pending, and the reverse
        case, passed = settle(good, engine(holds, pending))
        assert case.checks["no_engine_holds"]["ok"] is False and passed is False


def test_references_in_self_sees_a_mapped_staging_buffer():
    from kmesh.service.handles import HostBuffer, references_in_self

    a, b = HostBuffer(1 << 16, name="kmesh-eq-same"), HostBuffer(1 << 16, name="kmesh-eq-same")
    try:
        left = references_in_self(a.tag)
        assert len(left["maps"]) == 1 and "/memfd:kmesh-eq-same" in left["maps"][0]
        assert left["fds"] == [str(a.fd)]
        a.close()
        assert references_in_self(a.tag) == {"maps": [], "fds": []}
        assert len(references_in_self(b.tag)["maps"]) == 1      # same name, another inode: still there
    finally:
        a.close()
        b.close()


def test_failure_controls_catch_a_late_reference_and_a_leaked_staging_mapping(env, monkeypatch):
    """Regressions: (1) the controls compared generated tokens with a full recompute made after the control,
    so a fallback that differed from the reference computed before the failure passed; here B's pre-failure
    reference gets another last token and every control of child B must fail on exactly that. (2) the killed
    service's control asserted no leak check of its own: here our mapping of its staging memfd is left in
    place (HostBuffer.close skipped once the service is dead) and the control must fail on it."""
    from kmesh.harness.service_side import ServiceSide
    from kmesh.service.handles import HostBuffer

    refs = dict(env.refs)
    ref_b = refs[RefKey(FULL, "B")]
    refs[RefKey(FULL, "B")] = dataclasses.replace(ref_b, tokens=ref_b.tokens[:-1] + [ref_b.tokens[-1] + 1])
    kept = []
    real_close = HostBuffer.close
    res = Result("equivalence", "test", provenance={})
    with _service(CONTROL_CHUNK) as h, ServiceSide(h, env.export, torch.device("cpu")) as svc:

        def leaky_close(buf):
            if h.service.alive():
                return real_close(buf)
            kept.append(buf)        # the killed control's staging: mapping and fd stay

        monkeypatch.setattr(HostBuffer, "close", leaky_close)
        svc.save_leader()
        try:
            passed = controls.failure_controls(res, env.setup, svc, refs)
        finally:
            monkeypatch.setattr(HostBuffer, "close", real_close)
            for buf in kept:
                buf.close()
    failed = {c.id: sorted(k for k, v in c.checks.items() if v["ok"] is False) for c in res.cases}
    assert failed == {
        "control-missing-object": [], "control-corrupt-object": ["tokens_equal_pre_failure_reference"],
        "control-truncated-object": [], "control-wrong-layout-descriptor": ["tokens_equal_pre_failure_reference"],
        "control-failure-after-device-work-submitted": [],
        "control-cancelled-child": ["tokens_equal_pre_failure_reference"],
        "control-service-killed-mid-load": ["staging_fd_closed_in_child", "staging_unmapped_in_child"]}
    assert passed == 3 and len(kept) == 1
    # where the fallback's tokens differ from the pre-failure reference, a recompute made after the control is
    # recorded beside it (a diagnosis, not a check): it agrees, and does not save B; elsewhere none is made
    for c in res.cases:
        differ = c.checks.get("tokens_equal_pre_failure_reference", {}).get("ok") is False
        assert ("tokens_equal_recompute_after_control" in c.checks) == differ, c.id
        assert not differ or c.checks["tokens_equal_recompute_after_control"]["value"], c.id


def test_service_segments_after_accept_reports_the_accepted_copy_size(env):
    from kmesh.harness.service_side import ServiceSide

    cat = env.export.catalog
    e0, e1 = cat.entries[0], cat.entries[1]
    seen = []
    with _service(CHUNK) as h, ServiceSide(h, env.export, torch.device("cpu")) as svc:
        svc.save_leader()
        key = e0.key + b"-short"
        svc.save_variant(e0, key, nbytes=e0.nbytes - BLOCK_BYTES)     # 64 KiB: one chunk

        def after(req, nbytes):
            seen.append(nbytes)
            svc.after_accept(req, nbytes)

        with svc.staging("short") as st:
            src = ServiceSegments(svc.client, st.reg, after)
            with pytest.raises(SegmentTruncatedError, match=f"has {SEG_BYTES - BLOCK_BYTES} bytes"):
                src.load(dataclasses.replace(e0, key=key), st.tensor)   # refused, its copy let run and drained
            n = svc.client.poll(src.requests[0])["nbytes"]
            # a 2-chunk copy granted one chunk must stop after it
            req = svc.client.load(st.reg, e1.key, e1.offset)
            h.accepted(e1.nbytes)
            h.grant(1)
            time.sleep(0.5)
            mid = svc.client.poll(req)
            h.finish()
            assert svc.client.wait(req, timeout=30)["state"] == "done"
        assert svc.no_leaks(), svc.leaks()
    assert n == SEG_BYTES - BLOCK_BYTES
    assert (mid["state"], mid["chunks_done"], mid["chunks_total"]) == ("running", 1, 2), mid
    assert seen == [SEG_BYTES - BLOCK_BYTES]


@contextlib.contextmanager
def _counting_calls(client):
    """The ops of every call the client makes meanwhile, in order (the list is the caller's to clear)."""
    ops: list[str] = []
    call = client.call

    def counting(op, *args, **kw):
        ops.append(op)
        return call(op, *args, **kw)

    client.call = counting
    try:
        yield ops
    finally:
        client.call = call


def test_service_segments_unpaced_two_calls_per_segment_and_the_size_checked_on_the_wait(env):
    """Without after_accept (no gate: a deployed service, the TTFT's end-to-end arm) a load is `load` then `wait`
    (no poll), the staged bytes are the export's, and a short object is still refused: on the wait's reply."""
    from kmesh.harness.service_side import ServiceSide

    cat = env.export.catalog
    e0 = cat.entries[0]
    with _service(CHUNK) as h, ServiceSide(h, env.export, torch.device("cpu")) as svc:
        svc.save_leader()
        key = e0.key + b"-short"
        svc.save_variant(e0, key, nbytes=e0.nbytes - BLOCK_BYTES)
        svc.unpace()
        with _counting_calls(svc.client) as ops:
            with svc.staging("unpaced") as st:
                ops.clear()                                    # the staging's registration is not a load
                src = ServiceSegments(svc.client, st.reg)
                for e in cat.entries:
                    stage_entry(src, st.tensor, e)
                assert torch.equal(st.tensor[:cat.nbytes], env.export.raw)
                loads_ops = list(ops)
                with pytest.raises(SegmentTruncatedError, match=f"has {SEG_BYTES - BLOCK_BYTES} bytes.*done, not used"):
                    src.load(dataclasses.replace(e0, key=key), st.tensor)
        assert svc.no_leaks(), svc.leaks()
    assert loads_ops == ["load", "wait"] * len(cat.entries)


@pytest.mark.parametrize("batched", [True, False], ids=["load_many", "load-each"])
def test_service_segments_prefetch_overlaps_the_loads_and_fails_where_the_serial_path_fails(env, batched):
    """Unpaced, kmesh.harness.child's path requests every segment's load first and waits in order: the same state as the
    paced path; a refused load (missing object) or a bad one (corrupt) at segment 1 fails the child at segment 1
    with segment 0 restored, as without prefetch, and the loads requested ahead are drained (nothing leaked).
    With load_many (batched) that is one request for every segment, its reply after every copy ended; without
    (a service from before it, or an original being read back), one load each, then one wait each."""
    from kmesh.harness.service_side import ServiceSide

    ex, cat = env.export, env.export.catalog
    child = env.workload.children[0]
    private = torch.empty(cat.nbytes, dtype=torch.uint8)
    e1 = cat.entries[1]
    with _service(CHUNK) as h, ServiceSide(h, ex, torch.device("cpu")) as svc:
        svc.save_leader()
        svc.save_variant(e1, e1.key + b"-corrupt", flip_byte=7)
        svc.unpace()
        if not batched:
            svc.client.load_many = None     # what ServiceSegments sees of a client without it
        with _counting_calls(svc.client) as ops:
            with svc.staging("prefetch") as st:
                ops.clear()
                out = run_child(env.ctx, child, ServiceSegments(svc.client, st.reg), st.tensor, private)
                good_ops = list(ops)
                assert torch.equal(st.tensor[:cat.nbytes], ex.raw)
            assert out.fallback is None
            assert identical(compare_states(out, env.refs[RefKey(REPAIR, child.name)]))
            for suffix, error in ((b"-missing", "SegmentMissingError"), (b"-corrupt", "SegmentCorruptError")):
                entries = tuple(dataclasses.replace(e, key=e.key + suffix) if e.index == 1 else e
                                for e in cat.entries)
                ctx = dataclasses.replace(env.ctx, catalog=dataclasses.replace(cat, entries=entries))
                with svc.staging(f"prefetch{suffix.decode()}") as st:
                    ops.clear()
                    out = run_child(ctx, child, ServiceSegments(svc.client, st.reg), st.tensor, private)
                    bad_ops = list(ops)
                assert out.fallback.startswith(error), out.fallback
                assert out.events[:4] == ["staged:0", "private-copy-drained:0", "restored:0", f"failed:{error}"]
                assert out.tokens == env.refs[RefKey(FULL, child.name)].tokens
                assert svc.no_leaks(), svc.leaks()
                if batched:                 # one request; missing: the batch stopped at 1; corrupt: every copy
                    assert bad_ops == ["load_many"], bad_ops     # had ended, nothing left to cancel
                elif suffix == b"-missing":   # refused at segment 1: nothing requested after it
                    assert bad_ops == ["load", "load", "wait"], bad_ops
                else:                       # segment 1 arrived corrupt: the digests are checked once every
                    n = len(cat.entries)    # segment has arrived (one call), so every load was waited for
                    assert bad_ops == ["load"] * n + ["wait"] * n, bad_ops
        assert svc.no_leaks(), svc.leaks()
    n = len(cat.entries)
    assert good_ops == (["load_many"] if batched else ["load"] * n + ["wait"] * n), good_ops


# --- issue 21 item 6: the quality case's full arm is recomputed, not the reference scored against itself -------

def _quality_setup(env):
    sec = {"repair": dataclasses.asdict(env.ctx.repair), "stock": dataclasses.asdict(env.ctx.repair), "chance_seeds": 2}
    return SimpleNamespace(**{**vars(env.setup), "sec": sec})


@pytest.mark.parametrize("arm", ["naive", "stock"])
def test_quality_arm_run_by_another_rule_fails_the_rule_check(env, monkeypatch, arm):
    """An arm whose child path runs another arm's rule (here: repair's) recomputes the wrong positions: the quality
    case's every_arm_recomputed_what_its_rule_says check names it, and the case fails."""
    from kmesh.stages.equivalence import stage as eq_stage

    real = eq_stage.run_child

    def mixed_up(ctx, child, source, staging, private, arm="repair"):
        swap = arm == wrong and ctx.repair.recompute_counts is None     # not stock-matched's fixed budget
        return real(ctx, child, source, staging, private, arm="repair" if swap else arm)

    wrong = arm
    monkeypatch.setattr(eq_stage, "run_child", mixed_up)
    res = Result("equivalence", "test", provenance={})
    eq_stage._quality_case(res, _quality_setup(env), env.refs)
    (case,) = res.cases
    assert case.error is None, case.error
    check = case.checks["every_arm_recomputed_what_its_rule_says"]
    assert check["ok"] is False and case.passed is False
    assert {a for per_child in check["value"].values() for a in per_child} == {arm}


def test_quality_full_arm_is_a_recompute_that_must_equal_the_reference(env, monkeypatch):
    from kmesh.stages.equivalence import stage as eq_stage

    res = Result("equivalence", "test", provenance={})
    eq_stage._quality_case(res, _quality_setup(env), env.refs)
    (case,) = res.cases
    assert case.error is None and "full_agrees_with_itself" not in case.checks
    assert case.checks["full_recompute_bit_identical"]["ok"] is True

    real = eq_stage.full_reference

    def drifting(ctx, child):       # a full recompute that is not reproducible: one logit one ulp off
        out = real(ctx, child)
        return dataclasses.replace(out, logits=torch.nextafter(out.logits, torch.full_like(out.logits, math.inf)))

    monkeypatch.setattr(eq_stage, "full_reference", drifting)
    res = Result("equivalence", "test", provenance={})
    eq_stage._quality_case(res, _quality_setup(env), env.refs)
    (case,) = res.cases
    assert case.checks["full_recompute_bit_identical"]["ok"] is False and case.passed is False


def test_teacher_forcing_check_allows_near_ties_of_the_dtype_only():
    """The batched forward and the step decode round differently on a GPU: a greedy token that trails the
    teacher-forced argmax by a few rounding units of the dtype is a near-tie, one that trails by more is a
    disagreement (the check of case quality fails)."""
    from kmesh.model.quality import ROUNDING_UNIT, TIE_UNITS, reproduces_greedy

    steps = torch.tensor([[4.0, 1.0, 0.0], [0.0, 2.0, 2.0 - 1e-3], [0.0, 3.0, 1.0]])
    assert reproduces_greedy(steps, [0, 1, 1], torch.float32)["ok"]
    near = reproduces_greedy(steps, [0, 2, 1], torch.bfloat16)        # 1e-3 behind, tolerance 16·2^-8·2 = 0.125
    assert near["ok"] and [r["step"] for r in near["disagree"]] == [1]
    assert near["disagree"][0]["tolerance"] == pytest.approx(TIE_UNITS * ROUNDING_UNIT[torch.bfloat16] * 2.0)
    assert not reproduces_greedy(steps, [0, 2, 1], torch.float32)["ok"]   # the same gap is no tie in float32
    far = reproduces_greedy(steps, [0, 1, 2], torch.bfloat16)          # 2.0 behind: a real disagreement
    assert not far["ok"] and far["disagree"][0]["gap"] == pytest.approx(2.0)


# --- the child path copies and restores the verified segments at once; a failure at k still leaves 0..k-1 -------

def test_a_private_copy_failing_at_segment_k_leaves_exactly_the_segments_before_it_restored(env):
    """One submit per segment, one drain, one restore: the copy of segment 1 accepted and then failing must leave
    segment 0 copied and restored (the partial data the recompute overwrites), nothing pending, and the
    full-recompute reference's outcome."""
    child = env.workload.children[0]
    engine = controls.FailingSubmitAt("cpu", FaultPlan(chunk_bytes=4096), at=1)
    try:
        ctx = dataclasses.replace(env.ctx, engine=engine)
        staging = torch.empty(env.export.catalog.nbytes, dtype=torch.uint8)
        out = run_child(ctx, child, InProcessSegments(env.export), staging, torch.empty_like(staging))
        n = len(env.export.catalog.entries)
        assert out.fallback.startswith("PrivateCopyError: private copy of segment 1 failed: SubmitError")
        assert out.events == [f"staged:{i}" for i in range(n)] + [
            "private-copy-drained:0", "restored:0", "failed:PrivateCopyError", "pending-before-recompute:0",
            "recompute"]
        want = controls.expected_partial(child, out.written_before_recompute.numel(), 1)
        assert bool(want.any()) and torch.equal(out.written_before_recompute, want)
        assert engine.pending() == [] and engine.live_holds() == 0
        assert identical(compare_states(out, env.refs[RefKey(FULL, child.name)]))
    finally:
        engine.close()


def test_a_private_copy_that_ends_failed_is_not_used(env):
    """A copy accepted whole but failing part-way (its ticket ends failed) names the segments before it: none of
    its bytes reach the model state, and the child recomputes."""
    from kmesh.kv.errors import PrivateCopyError
    from kmesh.kv.load import copy_private_each

    cat = env.export.catalog
    staging = env.export.raw.clone()
    private = torch.full_like(staging, 0x5A)
    engine = TransferEngine("cpu", FaultPlan(fail_copy_at_chunk=1, chunk_bytes=4096))
    try:
        with pytest.raises(PrivateCopyError, match="segment 0 ended failed") as e:
            copy_private_each(engine, staging, private, cat.entries, "child-x")
        assert e.value.copied == [] and engine.pending() == [] and engine.live_holds() == 0
    finally:
        engine.close()
    engine = TransferEngine("cpu")
    try:
        assert copy_private_each(engine, staging, private, cat.entries, "child-y") == list(cat.entries)
        assert torch.equal(private, staging) and engine.pending() == []
    finally:
        engine.close()


def test_a_joined_private_copy_that_ends_failed_names_the_entries_before_its_run(env, monkeypatch):
    """Adjacent entries are copied as one run with one ticket (join_adjacent); entries 2, 0, 1 make two runs. The
    second run's copy fails: the error names entry 2 as copied, and none of the run's bytes count as copied."""
    from kmesh.kv.errors import PrivateCopyError
    from kmesh.kv.load import copy_private_each

    cat = env.export.catalog
    assert len(cat.entries) >= 3
    picked = [cat.entries[2], cat.entries[0], cat.entries[1]]
    staging = env.export.raw.clone()
    private = torch.full_like(staging, 0x5A)
    accepted = []
    original_accept, original_copy = TransferEngine._accept_views, TransferEngine._copy_chunks

    def counting_accept(self, s, d, *rest):
        accepted.append(s.numel())
        return original_accept(self, s, d, *rest)

    def failing_second_run(self, job):
        if job.ticket.nbytes == picked[1].nbytes + picked[2].nbytes:
            raise RuntimeError("the second run's copy fails")
        return original_copy(self, job)

    monkeypatch.setattr(TransferEngine, "_accept_views", counting_accept)
    monkeypatch.setattr(TransferEngine, "_copy_chunks", failing_second_run)
    engine = TransferEngine("cpu")
    try:
        with pytest.raises(PrivateCopyError, match=f"segment {picked[1].index} ended failed") as e:
            copy_private_each(engine, staging, private, picked, "child-z")
        assert accepted == [picked[0].nbytes, picked[1].nbytes + picked[2].nbytes]
        assert e.value.copied == picked[:1] and engine.pending() == [] and engine.live_holds() == 0
        a = picked[0]
        assert torch.equal(private[a.offset:a.offset + a.nbytes], staging[a.offset:a.offset + a.nbytes])
    finally:
        engine.close()
