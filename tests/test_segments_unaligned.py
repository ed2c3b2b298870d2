"""Segments that are not a whole number of blocks (issue 21 item 10), built as a user would: a hand-made Workload
of two segments of 20 and 12 tokens at block size 16, exported, staged (in-process and through a real cache
service), restored — and every object checked at load against the size its catalog entry and layout say it holds.

Model: the tiny seeded Llama of tests/tiny_llama.py (4 layers, 2 KV heads of 16 channels, float32).
Export geometry (BLNHC): a block of all 4 layers = 4·16·2·(16+16)·4 B = 16 KiB. The 20-token segment spans
2 blocks (its last 12 slots padding), the 12-token one 1 block: 3 blocks, 48 KiB.

Before the fix: the 20-token segment's object held only its first block, the 12-token one's held 0 bytes, and
the restore read the staging buffer's poison bytes (0xA5A5A5A5 = -2.9e-16 as float32, no NaN) for 16 tokens.
Whole file ~12 s on CPU (each real service ~1-2 s).
"""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from kmesh.harness.child import ChildContext, full_reference, restore_child, run_child
from kmesh.harness.leader import export_segments
from kmesh.harness.workload import Child, Placement, Segment, Workload, WorkloadSpec
from kmesh.kv.catalog import segment_nbytes
from kmesh.kv.errors import SegmentCatalogError, SegmentOversizeError, SegmentSizeError, SegmentTruncatedError
from kmesh.kv.load import copy_private, stage_segments
from kmesh.kv.restore import capture, restore
from kmesh.kv.sources import InProcessSegments, ServiceSegments
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import compare_states, identical
from kmesh.model.runner import LayerRunner
from kmesh.transfer.engine import TransferEngine
from tiny_llama import tiny_llama

BS = 16
SEG = (20, 12)
L, H, D = 4, 2, 16
BLOCK_BYTES = L * BS * H * 2 * D * 4          # 16384
MAX_NEW = 4
PREFIX = b"kmesh-unaligned-test/leader"


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(300) for _ in range(n))


def unaligned_workload() -> Workload:
    """Leader = segment 0 (20 tokens) then segment 1 (12): neither ends on a block boundary but the last.
    Child "moved": both segments at other positions, in the other order, between private tokens.
    Child "same": the leader's prompt then private tokens — its segments sit where the leader's were, so the
    leader's own full prefill is the full-recompute reference of those tokens, bit for bit."""
    rng = random.Random(21)
    s0, s1 = _ids(rng, SEG[0]), _ids(rng, SEG[1])
    segments = (Segment("s0", s0, "", 0), Segment("s1", s1, "", SEG[0]))
    moved = _ids(rng, 5) + s1 + _ids(rng, 3) + s0 + _ids(rng, 4)
    same = s0 + s1 + _ids(rng, 7)
    children = (Child("moved", moved, (Placement(1, 5, SEG[1]), Placement(0, 20, SEG[0])), "", "", 0),
                Child("same", same, (Placement(0, 0, SEG[0]), Placement(1, SEG[0], SEG[1])), "", "", 0))
    spec = WorkloadSpec(prompt_tokens=len(moved), segment_tokens=SEG, children=2, block_size=BS,
                        leader_preamble_tokens=0)
    return Workload(spec, 21, s0 + s1, segments, children)


@pytest.fixture(scope="module")
def env():
    runner = LayerRunner(tiny_llama())
    workload = unaligned_workload()
    leader_cache = runner.new_cache(len(workload.leader_ids), BS)
    runner.prefill(torch.tensor(workload.leader_ids), leader_cache)
    export = export_segments(runner, leader_cache, workload, PREFIX)
    ctx = ChildContext(runner, export.catalog, TransferEngine("cpu"), RepairConfig(), MAX_NEW)
    yield SimpleNamespace(runner=runner, workload=workload, leader_cache=leader_cache, export=export, ctx=ctx)
    ctx.engine.close()


def _fresh_cache(env, child: Child):
    return env.runner.new_cache(len(child.ids) + BS, BS, fill=float("nan"))


def direct_restore(env, child: Child):
    """The reference: each segment's K/V taken straight from the leader's cache (no export, object, staging or
    private copy) and restored at the child's positions."""
    cache = _fresh_cache(env, child)
    for seg, a, b in child.segment_slices():
        s = env.workload.segments[seg]
        old = torch.arange(s.leader_start, s.leader_start + s.tokens)
        saved = capture(env.leader_cache.raw, env.leader_cache.layout, old, old)
        new = torch.arange(a, b)
        restore(cache.raw, cache.layout, saved, new, new, env.runner.rope)
    return cache


def staged_restore(env, child: Child, source, staging: torch.Tensor):
    """Through the product path: stage (size + digest checks), private copy, restore_child."""
    cat = env.export.catalog
    stage_segments(source, staging, cat)
    private = torch.empty(cat.nbytes, dtype=torch.uint8)
    copy_private(env.ctx.engine, staging, private, f"test-{child.name}")
    cache = _fresh_cache(env, child)
    restored = restore_child(cache, cat, private, child, env.runner)
    return cache, restored


def _objects(export):
    return {e.key: export.raw[e.offset:e.offset + e.nbytes].clone() for e in export.catalog.entries}


# --- export -------------------------------------------------------------------------------------------------

def test_export_gives_each_segment_the_whole_blocks_it_spans(env):
    cat = env.export.catalog
    assert cat.layout.num_blocks == 3 and cat.nbytes == 3 * BLOCK_BYTES
    assert [(e.tokens, e.first_slot, e.offset, e.nbytes) for e in cat.entries] == [
        (20, 0, 0, 2 * BLOCK_BYTES), (12, 32, 2 * BLOCK_BYTES, BLOCK_BYTES)]
    assert [segment_nbytes(cat.layout, t) for t in SEG] == [2 * BLOCK_BYTES, BLOCK_BYTES]
    # the padding slots of a partial block are zeros (deterministic digests), never a neighbour's tokens
    pad = capture(env.export.raw, cat.layout, torch.arange(20, 32), torch.arange(20, 32))
    assert not pad.k.any() and not pad.v.any()
    for e, s in zip(cat.entries, env.workload.segments):
        got = capture(env.export.raw, cat.layout, e.slots(), e.leader_positions())
        ref = capture(env.leader_cache.raw, env.leader_cache.layout, s_pos := torch.arange(
            s.leader_start, s.leader_start + s.tokens), s_pos)
        assert torch.equal(got.k.view(torch.uint8), ref.k.view(torch.uint8))
        assert torch.equal(got.v.view(torch.uint8), ref.v.view(torch.uint8))


# --- in-process -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["moved", "same"])
def test_in_process_restore_is_bit_identical_to_the_leader(env, name):
    child = next(c for c in env.workload.children if c.name == name)
    staging = torch.empty(env.export.catalog.nbytes, dtype=torch.uint8)
    cache, restored = staged_restore(env, child, InProcessSegments(env.export), staging)
    assert int(restored.sum()) == sum(SEG)
    assert torch.equal(cache.raw, direct_restore(env, child).raw)      # every byte, padding slots NaN in both
    k, v = cache.stacked(len(child.ids))
    pos = torch.tensor(child.restored_positions())
    assert not torch.isnan(k[:, pos]).any() and not torch.isnan(v[:, pos]).any()
    if name == "same":   # RoPE shift 0: exactly the leader's full prefill of these tokens
        lk, lv = env.leader_cache.stacked(sum(SEG))
        assert torch.equal(k[:, :sum(SEG)], lk) and torch.equal(v[:, :sum(SEG)], lv)


def test_in_process_run_child_uses_every_unaligned_token(env):
    staging = torch.empty(env.export.catalog.nbytes, dtype=torch.uint8)
    for child in env.workload.children:
        out = run_child(env.ctx, child, InProcessSegments(env.export), staging, torch.empty_like(staging))
        assert out.fallback is None, out.fallback
        assert out.events == [f"{what}:{i}" for what in ("staged", "private-copy-drained", "restored")
                              for i in range(2)]
        assert int(out.restored.sum()) == 32 and len(out.tokens) == MAX_NEW
    # the "same" child: where the repair kept a restored position (not recomputed), its K/V are the leader's
    # full prefill of that token, bit for bit — in every layer past the first (layer 0 recomputes everything)
    child = env.workload.children[1]
    out = run_child(env.ctx, child, InProcessSegments(env.export), staging, torch.empty_like(staging))
    lk, lv = env.leader_cache.stacked(sum(SEG))
    kept = ~out.masks[:, :sum(SEG)]
    assert not kept[0].any() and int(kept[1:].sum()) > 3 * 16           # most restored positions kept
    assert bool(kept[1:, 16:].any())                                    # including the unaligned tails
    for layer in range(1, L):
        pos = kept[layer].nonzero().flatten()
        assert torch.equal(out.k[layer, pos], lk[layer, pos]) and torch.equal(out.v[layer, pos], lv[layer, pos])


# --- size checks at load ---------------------------------------------------------------------------------------

class _Recording:
    name = "recording"

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def load(self, entry, staging):
        self.calls.append(entry.index)
        return self.inner.load(entry, staging)


def test_catalog_entry_of_the_wrong_size_is_refused_before_any_load(env):
    cat = env.export.catalog
    staging = torch.empty(cat.nbytes, dtype=torch.uint8)
    # what the old export wrote for the 12-token segment: 0 bytes; and a 20-token entry of one block
    for index, nbytes in ((1, 0), (0, BLOCK_BYTES), (1, 2 * BLOCK_BYTES)):
        entries = tuple(dataclasses.replace(e, nbytes=nbytes) if e.index == index else e for e in cat.entries)
        bad = dataclasses.replace(cat, entries=entries)
        src = _Recording(InProcessSegments(env.export))
        with pytest.raises(SegmentCatalogError, match=f"segment-{index}"):
            stage_segments(src, staging, bad)
        assert src.calls == []
    moved = tuple(dataclasses.replace(e, first_slot=e.first_slot + 1) if e.index == 1 else e for e in cat.entries)
    with pytest.raises(SegmentCatalogError, match="block boundary"):
        stage_segments(InProcessSegments(env.export), staging, dataclasses.replace(cat, entries=moved))


@pytest.mark.parametrize("delta,error", [(-BLOCK_BYTES, SegmentTruncatedError), (-4, SegmentTruncatedError),
                                         (BLOCK_BYTES, SegmentOversizeError), (4, SegmentOversizeError)])
def test_in_process_object_of_the_wrong_size_refused_before_a_byte_lands(env, delta, error):
    cat = env.export.catalog
    e0 = cat.entries[0]
    objs = _objects(env.export)
    obj = objs[e0.key]
    objs[e0.key] = obj[:delta].clone() if delta < 0 else torch.cat([obj, torch.zeros(delta, dtype=torch.uint8)])
    staging = torch.empty(cat.nbytes, dtype=torch.uint8)
    with pytest.raises(error, match=f"segment-0.*{e0.nbytes + delta} bytes"):
        stage_segments(InProcessSegments(env.export, objs), staging, cat)
    assert issubclass(error, SegmentSizeError)
    assert bool((staging == 0xA5).all())        # only the poison: the refused object was never copied


# --- through a real cache service ------------------------------------------------------------------------------

def _service():
    from kmesh.harness.service import Harness

    return Harness(device="cpu", heartbeat_timeout_s=30, chunk_bytes=65536)


def test_service_unaligned_segments_and_wrong_size_objects(env):
    from kmesh.harness.service_side import ServiceSide

    ex, cat = env.export, env.export.catalog
    e0, e1 = cat.entries
    inproc = InProcessSegments(ex)
    with _service() as h, ServiceSide(h, ex, torch.device("cpu")) as svc:
        saved = svc.save_leader()
        assert saved == {e.key: e.sha256 for e in cat.entries}
        for child in env.workload.children:
            with svc.staging(f"child-{child.name}") as st:
                cache, restored = staged_restore(env, child, ServiceSegments(svc.client, st.reg, svc.after_accept),
                                                 st.tensor)
                assert torch.equal(st.tensor, ex.raw)
            assert int(restored.sum()) == 32
            assert torch.equal(cache.raw, direct_restore(env, child).raw)
            with svc.staging(f"run-{child.name}") as st:
                out = run_child(env.ctx, child, ServiceSegments(svc.client, st.reg, svc.after_accept), st.tensor,
                                torch.empty(cat.nbytes, dtype=torch.uint8))
            staging = torch.empty(cat.nbytes, dtype=torch.uint8)
            ref = run_child(env.ctx, child, inproc, staging, torch.empty_like(staging))
            assert out.fallback is None and identical(compare_states(out, ref))
            assert svc.no_leaks(), svc.leaks()

        # objects of the wrong size: refused by type, the accepted copy drained, nothing leaked
        # (entry loaded, object size, expected refusal, entry whose bytes the object starts with)
        cases = [(e0, e0.nbytes - BLOCK_BYTES, SegmentTruncatedError, e0, "has 16384 bytes"),
                 (e0, e0.nbytes + BLOCK_BYTES, SegmentOversizeError, e0, "has 49152 bytes"),  # fits: copy refused
                 (e1, e1.nbytes + BLOCK_BYTES, SegmentOversizeError, e0, "does not fit")]     # service refuses
        for i, (entry, nbytes, error, saved_from, says) in enumerate(cases):
            key = entry.key + b"-size-%d" % i
            svc.save_variant(saved_from, key, nbytes=nbytes)
            seen = []

            def after(req, n):
                seen.append(n)
                svc.after_accept(req, n)

            bad = dataclasses.replace(entry, key=key)
            with svc.staging(f"size-{i}") as st:
                src = ServiceSegments(svc.client, st.reg, after)
                with pytest.raises(error, match=f"segment-{entry.index}.*{says}.*says {entry.nbytes}"):
                    src.load(bad, st.tensor)
                if src.requests:       # accepted, then refused: the copy ran out (a service copy cannot stop)
                    assert seen == [nbytes]
                    assert svc.client.poll(src.requests[0])["state"] == "cancelled"
                else:
                    assert seen == []
                entries = tuple(bad if e.index == entry.index else e for e in cat.entries)
                ctx = dataclasses.replace(env.ctx, catalog=dataclasses.replace(cat, entries=entries))
                child = env.workload.children[0]
                out = run_child(ctx, child, ServiceSegments(svc.client, st.reg, svc.after_accept), st.tensor,
                                torch.empty(cat.nbytes, dtype=torch.uint8))
            assert out.fallback.startswith(error.__name__), out.fallback
            assert out.arm == "full" and "pending-before-recompute:0" in out.events
            assert identical(compare_states(out, full_reference(env.ctx, child)))
            assert svc.no_leaks(), svc.leaks()
        now = svc.store_digests(verify=True)
        assert all(now[e.key] == (e.sha256, e.sha256) for e in cat.entries)


# --- the workload builder's (block-multiple) segments: unchanged ------------------------------------------------

def test_builder_workload_exports_as_before_and_runs(env):
    from kmesh.harness.workload import ByteTokenizer, build

    w = build(ByteTokenizer(vocab_size=300), 0, WorkloadSpec(prompt_tokens=400, segment_tokens=(80, 96, 112),
                                                            children=1, block_size=BS))
    lc = env.runner.new_cache(len(w.leader_ids), BS)
    env.runner.prefill(torch.tensor(w.leader_ids), lc)
    ex = export_segments(env.runner, lc, w, b"kmesh-builder-test")
    cat = ex.catalog
    # block-multiple segments back to back, as the export laid them out before partial blocks were supported
    assert [e.first_slot for e in cat.entries] == [0, 80, 176]
    assert [(e.offset, e.nbytes) for e in cat.entries] == [(0, 5 * BLOCK_BYTES), (5 * BLOCK_BYTES, 6 * BLOCK_BYTES),
                                                           (11 * BLOCK_BYTES, 7 * BLOCK_BYTES)]
    assert cat.nbytes == ex.raw.numel() == 18 * BLOCK_BYTES
    ctx = dataclasses.replace(env.ctx, catalog=cat)
    staging = torch.empty(cat.nbytes, dtype=torch.uint8)
    out = run_child(ctx, w.children[0], InProcessSegments(ex), staging, torch.empty_like(staging))
    assert out.fallback is None and int(out.restored.sum()) == 288
