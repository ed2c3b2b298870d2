"""kmesh.kv.gather: a restore planned on the host equals capture + kmesh.kv.restore byte for byte, refuses
exactly what they refuse (same exception types, nothing written), and — on a GPU — runs as one launch that reads
the rows in place, without a single host synchronisation."""
import numpy as np
import pytest
import torch

import kmesh.kv.gather as rg
from kmesh.kv.gather import clear_plan_cache, gather_supported, plan_gather
from kmesh.kv.layout import KVLayout
from kmesh.kv.restore import (DestinationError, DeviceMismatchError, DtypeMismatchError, DuplicateSlotError,
                              HeadCountError, HeadDimError, LayerRangeError, NonContiguousDestinationError,
                              PositionError, RestoreError, ScaleMismatchError, SegmentError, SlotError, SlotRangeError,
                              capture, plan_restore)
from kmesh.kv.rope import RopeConfig, RopeRangeError

ROPE = RopeConfig(64, 64, 10000.0, "neox", None, 4096)
SRC = KVLayout.paged("BLNHC", 2, 6, 16, 2, 64, "bfloat16")     # an export buffer's order
DST = KVLayout.paged("LBNHC", 2, 8, 16, 2, 64, "bfloat16")     # vLLM's paged order


def _bytes(lay: KVLayout, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if lay.fp8_dtype is not None:   # finite fp8 bytes only (0x7F/0xFF would be NaN)
        return torch.randint(0, 0x7E, (lay.nbytes,), dtype=torch.uint8, generator=g).to(device)
    x = torch.randn(lay.nbytes // lay.element_size, generator=g).to(lay.storage_dtype)
    return x.view(torch.uint8).to(device)


def _indices(src: KVLayout, dst: KVLayout, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src_slots = torch.randperm(src.num_slots, generator=g)[:T].numpy()
    old = torch.randint(0, 4000, (T,), generator=g).numpy()
    new = torch.randint(0, 4000, (T,), generator=g).numpy()
    new[:3] = old[:3]                                  # some tokens stay put
    slots = torch.randperm(dst.num_slots, generator=g)[:T].numpy()
    slots[5] = -1                                      # padding: skipped
    return src_slots, old, slots, new


def _reference(raw, dst, src_raw, src, src_slots, old, slots, new, rope, first_layer=0, backend="torch"):
    """capture + plan_restore + run: the path restore_child took before (and takes for the torch backend)."""
    dev = raw.device
    seg = capture(src_raw, src, torch.as_tensor(src_slots).to(dev), torch.as_tensor(old).to(dev))
    plan_restore(raw, dst, seg, torch.as_tensor(slots).to(dev), torch.as_tensor(new).to(dev), rope,
                 first_layer).run(backend)


PAIRS = [(SRC, DST),
         (KVLayout.paged("BLNHC", 3, 5, 16, 2, 64, "float32"), KVLayout.paged("BHLNC", 3, 6, 16, 2, 64, "float32")),
         (KVLayout.paged("LBNHC", 2, 5, 8, 2, 64, "fp8_e4m3", k_scale=0.02, v_scale=0.03),
          KVLayout.paged("BLNHC", 2, 6, 8, 2, 64, "fp8_e4m3", k_scale=0.02, v_scale=0.03)),
         (KVLayout.mla("BLHNC", 2, 5, 16, 16, 64, "float16"), KVLayout.mla("LBNHC", 2, 6, 16, 16, 64, "float16"))]


def _rope_for(lay: KVLayout) -> RopeConfig:
    hd = lay.head_dim - lay.rope_offset
    return RopeConfig(hd, hd, 1e4, "neox", None, 4096)


@pytest.mark.parametrize("src, dst", PAIRS, ids=lambda x: f"{x.packing}-{x.order}-{x.dtype}")
def test_gather_equals_capture_then_restore(src, dst):
    rope = _rope_for(dst)
    src_raw = _bytes(src, 1)
    src_slots, old, slots, new = _indices(src, dst, 30, 2)
    ref, out = _bytes(dst, 3), _bytes(dst, 3)
    _reference(ref, dst, src_raw, src, src_slots, old, slots, new, rope)
    plan = plan_gather(out, dst, src_raw, src, src_slots, old, slots, new, rope)
    plan.run("torch")
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} bytes differ"
    assert not torch.equal(out, _bytes(dst, 3))       # it wrote something
    assert plan.num_written_tokens == 29 and plan.segment_nbytes == 30 * src.num_layers * src.num_kv_heads * \
        (src.head_dim + src.head_dim_v) * src.element_size


def test_gather_tables_are_the_device_plans_tables():
    src_slots, old, slots, new = _indices(SRC, DST, 30, 4)
    src_raw, raw = _bytes(SRC, 1), _bytes(DST, 2)
    plan = plan_gather(raw, DST, src_raw, SRC, src_slots, old, slots, new, ROPE)
    seg = capture(src_raw, SRC, torch.as_tensor(src_slots), torch.as_tensor(old))
    dev_plan = plan_restore(raw.clone(), DST, seg, torch.as_tensor(slots), torch.as_tensor(new), ROPE)
    assert torch.equal(plan.slots, dev_plan.slots) and torch.equal(plan.moved, dev_plan.moved)
    assert torch.equal(plan.cos, dev_plan.cos) and torch.equal(plan.sin, dev_plan.sin)
    for t in (plan.slots, plan.src_tok, plan.moved, plan.cos, plan.sin):
        assert t.data_ptr() % 16 == 0
    # source row offsets: block · block stride + offset-in-block · token stride, in elements
    ks = SRC.k_strides()
    assert plan.src_tok.tolist() == [s // 16 * ks.block + s % 16 * ks.token for s in src_slots.tolist()]


def test_gather_of_no_tokens_writes_nothing():
    raw = _bytes(DST, 2)
    before = raw.clone()
    plan_gather(raw, DST, _bytes(SRC, 1), SRC, [], [], [], [], ROPE).run("torch")
    assert torch.equal(raw, before)


def test_plans_of_one_arrangement_share_checked_tables_and_others_do_not():
    clear_plan_cache()
    src_slots, old, slots, new = _indices(SRC, DST, 30, 4)
    src_raw = _bytes(SRC, 1)
    a = plan_gather(_bytes(DST, 2), DST, src_raw, SRC, src_slots, old, slots, new, ROPE)
    b = plan_gather(_bytes(DST, 5), DST, src_raw, SRC, src_slots.copy(), old.copy(), slots.copy(), new.copy(), ROPE)
    assert b.slots.data_ptr() == a.slots.data_ptr() and len(rg._plan_cache) == 1    # same bytes: one entry
    new2 = new.copy()
    new2[0] += 1
    c = plan_gather(_bytes(DST, 2), DST, src_raw, SRC, src_slots, old, slots, new2, ROPE)
    assert c.slots.data_ptr() != a.slots.data_ptr() and len(rg._plan_cache) == 2
    # the caller's arrays may change after planning: the plan (and the cache) hold their own copies
    kept = slots.copy()
    slots[:] = 0
    assert np.array_equal(a.host_slots, kept) and np.array_equal(b.host_slots, kept)
    slots[:] = kept
    # a cached plan restores what a fresh one does (and what capture + restore do)
    ref, out = _bytes(DST, 3), _bytes(DST, 3)
    _reference(ref, DST, src_raw, SRC, src_slots, old, slots, new2, ROPE)
    plan_gather(out, DST, src_raw, SRC, src_slots, old, slots, new2, ROPE).run("torch")
    assert torch.equal(out, ref)


def test_a_refused_plan_is_refused_every_time_and_never_cached():
    clear_plan_cache()
    a = _args(**BAD["dst-slot-duplicate"])
    for _ in range(2):
        with pytest.raises(DuplicateSlotError):
            _new_path(a)
    assert len(rg._plan_cache) == 0
    # and the buffers are checked on every call, cached geometry or not
    good = _args()
    _new_path(good)
    with pytest.raises(DestinationError):
        _new_path({**good, "raw": torch.zeros(DST.nbytes - 2, dtype=torch.uint8)})


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(rg, "PLAN_CACHE_ENTRIES", 8)
    clear_plan_cache()
    src_raw, raw = _bytes(SRC, 1), _bytes(DST, 2)
    for i in range(8 + 5):
        plan_gather(raw, DST, src_raw, SRC, np.array([i]), np.array([0]), np.array([i]), np.array([1]), ROPE)
    assert len(rg._plan_cache) == 8
    assert rg.plan_cache_bytes() == sum(t.buf.nbytes for t in rg._plan_cache.values())
    clear_plan_cache()
    assert len(rg._plan_cache) == 0 and rg.plan_cache_bytes() == 0


def test_plan_cache_is_bounded_by_the_bytes_of_its_tables(monkeypatch):
    clear_plan_cache()
    src_raw, raw = _bytes(SRC, 1), _bytes(DST, 2)
    plan_gather(raw, DST, src_raw, SRC, np.array([0]), np.array([0]), np.array([0]), np.array([1]), ROPE)
    one = rg.plan_cache_bytes()
    assert one > 0
    monkeypatch.setattr(rg, "PLAN_CACHE_BYTES", 3 * one)
    for i in range(1, 6):
        plan_gather(raw, DST, src_raw, SRC, np.array([i]), np.array([0]), np.array([i]), np.array([1]), ROPE)
    assert len(rg._plan_cache) == 3 and rg.plan_cache_bytes() == 3 * one
    # the newest three are kept (least recently used first out)
    assert [k[-2] for k in rg._plan_cache] == [np.array([i]).tobytes() for i in (3, 4, 5)]
    clear_plan_cache()


def test_the_default_cache_keeps_every_segment_plan_of_two_16k_rag_children():
    """The cache holds what the child path plans in a timed round of the largest RAG workload: two children of 60
    per-segment plans each, beside the arms' whole-child plans (it held 64 plans and thrashed: every restore call
    planned anew). Planned for real: the first plan of each is still the cached one after all of them."""
    clear_plan_cache()
    src_raw, raw = _bytes(SRC, 1), _bytes(DST, 2)
    n = 2 * 60 + 64
    plans = [plan_gather(raw, DST, src_raw, SRC, np.array([i % SRC.num_slots]), np.array([0]),
                         np.array([i % DST.num_slots]), np.array([1 + i]), ROPE) for i in range(n)]
    assert len(rg._plan_cache) == n
    again = plan_gather(raw, DST, src_raw, SRC, np.array([0]), np.array([0]), np.array([0]), np.array([1]), ROPE)
    assert again.slots.data_ptr() == plans[0].slots.data_ptr()      # a hit, not planned anew
    clear_plan_cache()


# ------------------------------------------------------------------------------------------- refusal parity
def _args(**change):
    src_slots, old, slots, new = _indices(SRC, DST, 12, 7)
    a = dict(raw=_bytes(DST, 2), dst=DST, src_raw=_bytes(SRC, 1), src=SRC, src_slots=src_slots, old=old,
             slots=slots, new=new, rope=ROPE, first_layer=0)
    a.update(change)
    return a


BAD = {
    "src-slot-past-end": dict(src_slots=np.array([0, 1, SRC.num_slots] + list(range(2, 11)))),
    "src-slot-negative": dict(src_slots=np.array([-1] + list(range(1, 12)))),
    "src-slot-float": dict(src_slots=[0.5] * 12),
    "old-count": dict(old=np.arange(11)),
    "old-float": dict(old=np.arange(12.0)),
    "dst-slot-past-end": dict(slots=np.array([DST.num_slots] + list(range(1, 12)))),
    "dst-slot-below-padding": dict(slots=np.array([-2] + list(range(1, 12)))),
    "dst-slot-duplicate": dict(slots=np.array([3, 3] + list(range(4, 14)))),
    "dst-slot-count": dict(slots=np.arange(11)),
    "dst-slot-2d": dict(slots=np.arange(12).reshape(3, 4)),
    "new-count": dict(new=np.arange(13)),
    "new-past-table": dict(new=np.arange(4090, 4102)),
    "new-negative": dict(new=np.arange(-1, 11)),
    "old-past-table": dict(old=np.arange(4090, 4102)),
    "dtype": dict(dst=DST.with_(dtype="float16")),
    "heads": dict(dst=KVLayout.paged("LBNHC", 2, 8, 16, 1, 128, "bfloat16")),
    "head-dim": dict(dst=KVLayout.paged("LBNHC", 2, 8, 16, 2, 32, "bfloat16")),
    "rope-dim": dict(rope=RopeConfig(32, 32, 1e4, "neox", None, 4096)),
    "first-layer-past": dict(first_layer=1),
    "first-layer-bool": dict(first_layer=True),
    "first-layer-float": dict(first_layer=0.0),
    "dest-not-bytes": dict(raw=torch.zeros(DST.nbytes // 2, dtype=torch.bfloat16)),
    "dest-strided": dict(raw=torch.zeros(2 * DST.nbytes, dtype=torch.uint8)[::2]),
    "dest-too-small": dict(raw=torch.zeros(DST.nbytes - 2, dtype=torch.uint8)),
    "src-too-small": dict(src_raw=torch.zeros(SRC.nbytes - 2, dtype=torch.uint8)),
}
FP8_SRC = KVLayout.paged("BLNHC", 2, 6, 16, 2, 64, "fp8_e4m3", k_scale=0.02, v_scale=0.03)
BAD["fp8-scale"] = dict(src=FP8_SRC, src_raw=_bytes(FP8_SRC, 1),
                        raw=_bytes(FP8_SRC.with_(order="LBNHC", k_scale=0.04), 2),
                        dst=FP8_SRC.with_(order="LBNHC", k_scale=0.04))
EXPECTED = {  # what each refusal is (both paths must raise exactly this type)
    "src-slot-past-end": SlotRangeError, "src-slot-negative": SlotRangeError, "src-slot-float": SlotError,
    "old-count": SegmentError, "old-float": PositionError, "dst-slot-past-end": SlotRangeError,
    "dst-slot-below-padding": SlotRangeError, "dst-slot-duplicate": DuplicateSlotError, "dst-slot-count": SlotError,
    "dst-slot-2d": SlotError, "new-count": PositionError, "new-past-table": RopeRangeError,
    "new-negative": RopeRangeError, "old-past-table": RopeRangeError, "dtype": DtypeMismatchError,
    "heads": HeadCountError, "head-dim": HeadDimError, "rope-dim": HeadDimError, "first-layer-past": LayerRangeError,
    "first-layer-bool": LayerRangeError, "first-layer-float": LayerRangeError, "dest-not-bytes": DestinationError,
    "dest-strided": NonContiguousDestinationError, "dest-too-small": DestinationError,
    "src-too-small": DestinationError, "fp8-scale": ScaleMismatchError,
}


def _old_path(a):
    seg = capture(a["src_raw"], a["src"], a["src_slots"], a["old"])
    plan_restore(a["raw"], a["dst"], seg, a["slots"], a["new"], a["rope"], a["first_layer"])


def _new_path(a):
    plan_gather(a["raw"], a["dst"], a["src_raw"], a["src"], a["src_slots"], a["old"], a["slots"], a["new"],
                a["rope"], a["first_layer"])


@pytest.mark.parametrize("case", sorted(BAD))
def test_gather_refuses_what_capture_and_plan_restore_refuse(case):
    a = _args(**BAD[case])
    raised = []
    for path in (_old_path, _new_path):
        before = a["raw"].clone()
        with pytest.raises(RestoreError) as e:   # RopeRangeError is caught below: it is no RestoreError
            try:
                path(a)
            except RopeRangeError as rr:
                raise RestoreError("rope") from rr
        err = e.value.__cause__ if isinstance(e.value.__cause__, RopeRangeError) else e.value
        raised.append(type(err))
        assert torch.equal(a["raw"], before), f"{path.__name__} wrote before refusing"
    assert raised == [EXPECTED[case]] * 2, f"{case}: old path {raised[0].__name__}, gather {raised[1].__name__}"


def test_gather_refuses_a_source_on_another_device():
    if torch.cuda.is_available():
        with pytest.raises(DeviceMismatchError):
            _new_path(_args(src_raw=_bytes(SRC, 1, "cuda")))
    else:   # a meta tensor stands for "another device" on a CPU-only machine
        with pytest.raises(DeviceMismatchError):
            _new_path(_args(src_raw=torch.empty(SRC.nbytes, dtype=torch.uint8, device="meta")))


def test_cuda_backend_refuses_a_cpu_cache():
    plan = plan_gather(**{k: v for k, v in zip(
        ("raw", "layout", "src_raw", "src_layout", "src_slots", "old_positions", "slots", "new_positions", "rope"),
        _args().values())})
    with pytest.raises(DeviceMismatchError):
        plan.run("cuda")
    with pytest.raises(RestoreError):
        plan.run("triton")


def test_gather_support_follows_the_source_arrangement():
    assert gather_supported(SRC) and gather_supported(KVLayout.mla("BLHNC", 2, 5, 16, 16, 64, "float16"))
    assert not gather_supported(KVLayout.cpu(2, 3, 32, 2, 64, "float16"))   # K plane transposed


# ------------------------------------------------------------------------------------------------------- GPU
GPU_PAIRS = PAIRS + [
    (KVLayout.paged("BLNHC", 3, 7, 16, 2, 64, dt, k_scale=0.02, v_scale=0.03),
     KVLayout.paged(o, 3, 9, 16, 2, 64, dt, k_scale=0.02, v_scale=0.03))
    for o in ("LBNHC", "BHLNC") for dt in ("float16", "bfloat16", "fp8_e5m2")]
GPU_PAIRS += [(KVLayout.paged("BLNHC", 3, 7, 7, 3, 96, "bfloat16"),
               KVLayout.paged("LBNHC", 3, 13, 7, 3, 96, "bfloat16")),
              (KVLayout.paged("BLNHC", 2, 6, 16, 2, 64, "bfloat16"), KVLayout.cpu(2, 3, 32, 2, 64, "bfloat16"))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("src, dst", GPU_PAIRS, ids=lambda x: f"{x.packing}-{x.order}-{x.dtype}")
def test_gather_kernel_equals_both_references(src, dst):
    from kmesh.cuda.restore_rope import launch_restore

    rope = _rope_for(dst)
    src_raw = _bytes(src, 1, "cuda")
    src_slots, old, slots, new = _indices(src, dst, 40, 9)
    ref = _bytes(dst, 3, "cuda")
    _reference(ref, dst, src_raw, src, src_slots, old, slots, new, rope)        # torch path, device-planned
    kern = _bytes(dst, 3, "cuda")
    _reference(kern, dst, src_raw, src, src_slots, old, slots, new, rope, backend="cuda")   # kernel on a segment
    assert torch.equal(kern, ref)
    paths = set()
    for slow in (False, True):
        out = _bytes(dst, 3, "cuda")
        info = launch_restore(plan_gather(out, dst, src_raw, src, src_slots, old, slots, new, rope), force_slow=slow)
        torch.cuda.synchronize()
        paths.add(info["path"])
        assert info["source"] == "gather" and info["launches"] == 1
        assert info["entry"].endswith("_gather") == (info["path"] == "vector"), info
        assert torch.equal(out, ref), f"{info}: {(out != ref).sum().item()} bytes differ"
    assert ("vector" in paths) == (dst.packing != "cpu")


def _busy_device() -> torch.cuda.Event:
    """Queue ~0.5 s of device work and an event after it: if the event is still pending once the code under
    test returned, that code never waited for the device (torch's sync debug mode sees torch's syncs only;
    this sees any: cupy's, the driver's, a pageable copy)."""
    torch.cuda._sleep(int(1e9))
    done = torch.cuda.Event()
    done.record()
    return done


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gather_restore_makes_no_host_synchronisation():
    from kmesh.cuda.restore_rope import launch_restore

    src_slots, old, slots, new = _indices(SRC, DST, 40, 9)
    src_raw, out = _bytes(SRC, 1, "cuda"), _bytes(DST, 3, "cuda")
    launch_restore(plan_gather(out, DST, src_raw, SRC, src_slots, old, slots, new, ROPE))   # load the module
    torch.cuda.synchronize()
    done = _busy_device()
    torch.cuda.set_sync_debug_mode("error")
    try:
        clear_plan_cache()      # the whole plan: checks, tables, their upload, the launch
        plan_gather(out, DST, src_raw, SRC, src_slots, old, slots, new, ROPE).run("cuda")
        plan_gather(out, DST, src_raw, SRC, src_slots, old, slots, new, ROPE).run("cuda")   # and a cached one
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not done.query(), "the restore waited for the device"
    torch.cuda.synchronize()
    # the control: the device-planned path does synchronise (else this test could not fail)
    seg = capture(src_raw, SRC, torch.as_tensor(src_slots).cuda(), torch.as_tensor(old).cuda())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            plan_restore(out, DST, seg, torch.as_tensor(slots).cuda(), torch.as_tensor(new).cuda(), ROPE)
    finally:
        torch.cuda.set_sync_debug_mode(0)
