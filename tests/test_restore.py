"""kmesh.kv.restore: round trips against float64 references, every bad-input error (and that it writes nothing),
and — on a GPU — the restore_rope kernel against the torch path, byte for byte."""
import numpy as np
import pytest
import torch

from kmesh.kv.layout import KVLayout, quantize
from kmesh.kv.restore import (DestinationError, DeviceMismatchError, DtypeMismatchError, DuplicateSlotError,
                              HeadCountError, HeadDimError, KVSegment, LayerRangeError, MisalignedDestinationError,
                              NonContiguousDestinationError, PositionError, RestoreError, ScaleMismatchError,
                              SegmentError, SlotError, SlotRangeError, capture, plan_restore, restore)
from kmesh.kv.rope import RopeConfig, RopeRangeError, rotate

ROPE = RopeConfig(64, 64, 10000.0, "neox", None, 4096)


def _segment(lay: KVLayout, T: int, seed: int = 0, device="cpu", old0: int = 10) -> tuple[KVSegment, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L = lay.num_layers
    x = torch.randn(T, L, lay.num_kv_heads, lay.head_dim, generator=g, dtype=torch.float64)
    old = torch.arange(old0, old0 + T)
    k64 = rotate(x.reshape(T, -1, lay.head_dim), old, ROPE).reshape(x.shape)
    v = torch.randn(T, L, lay.num_kv_heads, lay.head_dim_v, generator=g)
    if lay.fp8_dtype is not None:
        k, v = quantize(k64.float(), lay.fp8_dtype, 1 / lay.k_scale), quantize(v, lay.fp8_dtype, 1 / lay.v_scale)
    else:
        k, v = k64.to(lay.storage_dtype), v.to(lay.storage_dtype)
    seg = KVSegment(k.to(device), v.to(device), old.to(device), lay.dtype, lay.k_scale, lay.v_scale)
    return seg, x


def _poisoned(lay: KVLayout, device="cpu", seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8, generator=g).to(device)


@pytest.mark.parametrize("lay", [
    KVLayout.paged("LBNHC", 2, 6, 16, 2, 64, "bfloat16"),
    KVLayout.paged("BHLNC", 2, 6, 16, 2, 64, "float32"),
    KVLayout.cpu(2, 3, 32, 2, 64, "float16"),
], ids=lambda x: f"{x.packing}-{x.order}-{x.dtype}")
def test_restore_round_trip_against_float64(lay):
    T = 21
    seg, x = _segment(lay, T)
    raw = _poisoned(lay)
    before = raw.clone()
    slots = torch.randperm(lay.num_slots, generator=torch.Generator().manual_seed(3))[:T]
    new = torch.arange(500, 500 + T)
    restore(raw, lay, seg, slots, new, ROPE)
    k, v = lay.read_tokens(raw, slots)
    assert torch.equal(v, seg.v)
    ref = rotate(x.reshape(T, -1, 64), new, ROPE).reshape(x.shape)
    err = ((k.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
    u = {torch.bfloat16: 2**-8, torch.float32: 2**-24, torch.float16: 2**-11}[lay.storage_dtype]
    assert err <= 2 * u + 8 * 2**-24
    # the shift really happened: the old keys are far from the new reference
    assert ((seg.k.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max() > 0.1
    mask = lay.touched_bytes(raw, slots)
    assert torch.equal(raw[~mask], before[~mask])


def test_padding_slots_skipped_and_first_layer_respected():
    lay = KVLayout.paged("LBHNC", 4, 4, 16, 2, 64, "bfloat16")
    seg, _ = _segment(lay.with_(num_layers=2), 6)
    raw = _poisoned(lay)
    before = raw.clone()
    slots = torch.tensor([3, -1, 17, -1, 40, 5])
    restore(raw, lay, seg, slots, seg.positions, ROPE, first_layer=2)
    keep = slots >= 0
    k, v = lay.read_tokens(raw, slots[keep], layers=[2, 3])
    assert torch.equal(k, seg.k[keep]) and torch.equal(v, seg.v[keep])   # no move: bytes kept
    mask = lay.touched_bytes(raw, slots, layers=[2, 3])
    assert int(mask.sum()) == 4 * 2 * 2 * 128 * 2
    assert torch.equal(raw[~mask], before[~mask])


def test_capture_then_restore_across_arrangements():
    src = KVLayout.cpu(2, 2, 32, 2, 64, "bfloat16")
    dst = KVLayout.paged("BLNHC", 2, 5, 16, 2, 64, "bfloat16")
    raw = _poisoned(src)
    slots = torch.arange(5, 45)
    seg = capture(raw, src, slots, torch.arange(40))
    k0, v0 = src.read_tokens(raw, slots)
    out = _poisoned(dst, seed=7)
    dslots = torch.arange(80 - 40, 80)
    restore(out, dst, seg, dslots, torch.arange(40), ROPE)
    k1, v1 = dst.read_tokens(out, dslots)
    # random poison holds NaN patterns: compare bytes, not values
    assert torch.equal(k0.view(torch.uint8), k1.view(torch.uint8))
    assert torch.equal(v0.view(torch.uint8), v1.view(torch.uint8))


def test_fp8_keys_requantized_with_same_scale_and_values_bytes_kept():
    lay = KVLayout.paged("LBNHC", 1, 4, 16, 2, 64, "fp8_e4m3", k_scale=0.01, v_scale=0.02)
    seg, x = _segment(lay, 16)
    raw = _poisoned(lay)
    slots = torch.arange(16, 32)
    new = seg.positions + 100
    restore(raw, lay, seg, slots, new, ROPE)
    k, v = lay.read_tokens(raw, slots)
    assert torch.equal(v, seg.v)
    ref = rotate(x.reshape(16, -1, 64), new, ROPE).reshape(x.shape)
    got = k.view(torch.float8_e4m3fn).double() * 0.01
    assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 2 * 2**-4


# ---------------------------------------------------------------------------------------------------
# Bad input: a specific error, raised before anything is written

LAY = KVLayout.paged("LBNHC", 2, 4, 16, 2, 64, "bfloat16")


def _refused(exc, raw=None, lay=LAY, seg=None, slots=None, new=None, rope=ROPE, first_layer=0):
    seg = seg if seg is not None else _segment(LAY, 4)[0]
    raw = raw if raw is not None else _poisoned(lay)
    before = raw.clone()
    slots = slots if slots is not None else torch.tensor([0, 1, 2, 3])
    new = new if new is not None else torch.tensor([7, 8, 9, 10])
    with pytest.raises(exc) as info:
        restore(raw, lay, seg, slots, new, rope, first_layer=first_layer)
    assert isinstance(info.value, RestoreError) or exc is RopeRangeError
    assert torch.equal(raw, before), "a refused restore must not write"
    return info.value


def test_wrong_head_count():
    seg, _ = _segment(LAY.with_(num_kv_heads=3), 4)
    _refused(HeadCountError, seg=seg)


def test_wrong_head_dim_keys_values_and_rope():
    seg, _ = _segment(LAY.with_(head_dim=64, head_dim_v=32), 4)
    _refused(HeadDimError, seg=seg)
    k = torch.zeros(4, 2, 2, 128, dtype=torch.bfloat16)
    _refused(HeadDimError, seg=KVSegment(k, torch.zeros(4, 2, 2, 64, dtype=torch.bfloat16), torch.arange(4),
                                         "bfloat16"))
    _refused(HeadDimError, rope=RopeConfig(128, 128, 1e4, "neox", None, 4096))


def test_wrong_dtype():
    seg, _ = _segment(LAY.with_(dtype="float16"), 4)
    _refused(DtypeMismatchError, seg=seg)
    with pytest.raises(DtypeMismatchError):
        KVSegment(torch.zeros(1, 1, 1, 4), None, torch.arange(1), "bfloat16")


def test_fp8_scale_mismatch():
    lay = LAY.with_(dtype="fp8_e5m2", k_scale=0.5, v_scale=0.5)
    seg, _ = _segment(lay.with_(k_scale=0.25), 4)
    _refused(ScaleMismatchError, lay=lay, seg=seg, raw=_poisoned(lay))


def test_slot_out_of_range_both_ends():
    e = _refused(SlotRangeError, slots=torch.tensor([0, 1, 2, LAY.num_slots]))
    assert str(LAY.num_slots) in str(e)
    _refused(SlotRangeError, slots=torch.tensor([0, -2, 2, 3]))


def test_duplicate_destination_slots():
    e = _refused(DuplicateSlotError, slots=torch.tensor([5, 9, 5, -1]))
    assert "5" in str(e)


def test_padding_slots_may_repeat():
    raw = _poisoned(LAY)
    seg, _ = _segment(LAY, 4)
    restore(raw, LAY, seg, torch.tensor([-1, 3, -1, 4]), torch.tensor([7, 8, 9, 10]), ROPE)


def test_positions_beyond_rope_table():
    _refused(RopeRangeError, new=torch.tensor([7, 8, 9, ROPE.max_position]))
    _refused(RopeRangeError, new=torch.tensor([-1, 8, 9, 10]))


def test_slot_and_position_shapes():
    _refused(SlotError, slots=torch.tensor([0, 1, 2]))
    _refused(SlotError, slots=torch.tensor([0.0, 1.0, 2.0, 3.0]))
    _refused(SlotError, slots=torch.tensor([[0, 1], [2, 3]]))
    _refused(PositionError, new=torch.tensor([1, 2]))
    _refused(PositionError, new=torch.tensor([7.0, 8.0, 9.0, 10.0]))


BAD_INDEX_LISTS = [
    [0.5, 1.7, 2.2, 3.0],            # floats: torch.as_tensor(..., dtype=int64) would truncate them to 0, 1, 2, 3
    [0, 1, 2, 3.0],                  # one float among ints
    [0, 1, 2, 2**70],                # beyond int64
    [0, 1, 2, -(2**63) - 1],
    ["0", "1", "2", "3"],            # strings
    "0123",                          # a string is a sequence of strings
    [True, False, True, False],      # bools are ints to Python, never slots
    [0, 1, 2, None],
    [[0], [1], [2], [3]],            # nested
    np.array([0.0, 1.0, 2.0, 3.0]),  # a float numpy array
    np.array([0, 1, 2, 2**64 - 1], dtype=np.uint64),  # would wrap to -1 (= padding!) as int64
    np.int64(3),                     # a scalar, not a sequence
    {0, 1, 2, 3},                    # unordered
]


@pytest.mark.parametrize("bad", BAD_INDEX_LISTS, ids=lambda b: type(b).__name__ + ":" + repr(b)[:24])
def test_non_integer_slots_and_positions_are_refused_not_truncated(bad):
    e = _refused(SlotError, slots=bad)
    assert "slots" in str(e)
    e = _refused(PositionError, new=bad)
    assert "new_positions" in str(e)
    assert not isinstance(e, SlotError)


def _index_kinds(first: int) -> list:
    """The integer containers restore accepts, each holding first .. first + 3."""
    v = [first + i for i in range(4)]
    return [v, tuple(v), range(first, first + 4), [np.int64(v[0]), np.int32(v[1]), np.uint8(v[2]), v[3]],
            np.array(v, dtype=np.int32), np.array(v, dtype=np.uint64), torch.tensor(v, dtype=torch.int16),
            torch.tensor(v, dtype=torch.uint8)]


@pytest.mark.parametrize("kind", range(len(_index_kinds(0))), ids=lambda i: type(_index_kinds(0)[i]).__name__)
def test_integer_slots_and_positions_of_every_kind_agree(kind):
    seg, _ = _segment(LAY, 4)
    ref = _poisoned(LAY)
    restore(ref, LAY, seg, torch.tensor([0, 1, 2, 3]), torch.tensor([7, 8, 9, 10]), ROPE)
    out = _poisoned(LAY)
    plan = restore(out, LAY, seg, _index_kinds(0)[kind], _index_kinds(7)[kind], ROPE)
    assert plan.slots.dtype == torch.int64 and plan.slots.tolist() == [0, 1, 2, 3]
    assert torch.equal(out, ref)


def test_layers_out_of_range():
    _refused(LayerRangeError, first_layer=1)
    _refused(LayerRangeError, first_layer=-1)
    _refused(LayerRangeError, first_layer=0.0)
    _refused(LayerRangeError, first_layer=True)
    _refused(LayerRangeError, first_layer="0")


def test_first_layer_accepts_any_integral():
    lay = LAY.with_(num_layers=4)
    seg, _ = _segment(LAY, 4)
    ref = _poisoned(lay)
    restore(ref, lay, seg, [0, 1, 2, 3], [7, 8, 9, 10], ROPE, first_layer=2)
    for fl in (np.int64(2), np.int32(2), np.uint8(2)):
        out = _poisoned(lay)
        plan = restore(out, lay, seg, [0, 1, 2, 3], [7, 8, 9, 10], ROPE, first_layer=fl)
        assert type(plan.first_layer) is int and plan.first_layer == 2
        assert torch.equal(out, ref)
    _refused(LayerRangeError, lay=lay, raw=_poisoned(lay), first_layer=np.int64(3))


def test_capture_checks_layers_slots_and_positions():
    lay = LAY.with_(num_layers=3)
    raw = _poisoned(lay)
    before = raw.clone()
    slots, pos = torch.arange(4), torch.arange(4)
    full = capture(raw, lay, slots, pos)
    assert full.num_layers == 3
    b = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731  (poison holds NaNs: compare bytes)
    last = capture(raw, lay, slots, pos, layers=[2])
    assert torch.equal(b(last.k), b(full.k[:, 2:3])) and torch.equal(b(last.v), b(full.v[:, 2:3]))
    picked = capture(raw, lay, slots, pos, layers=np.array([2, 0]))
    assert torch.equal(b(picked.k), b(full.k[:, [2, 0]]))
    for bad in ([-1], [0, 3], [0.0], [True], "0", 1):
        with pytest.raises(LayerRangeError):
            capture(raw, lay, slots, pos, layers=bad)
    with pytest.raises(SlotError):
        capture(raw, lay, [0.5, 1.5, 2.5, 3.5], pos)
    with pytest.raises(PositionError):
        capture(raw, lay, slots, torch.arange(4.0))
    with pytest.raises(PositionError):
        capture(raw, lay, slots, [0, 1, 2, 2**64])
    assert capture(raw, lay, [0, 1, 2, 3], [0, 1, 2, 3]).positions.dtype == torch.int64
    assert torch.equal(raw, before), "capture must only read"


def test_non_contiguous_destination():
    raw = _poisoned(LAY)
    two = torch.zeros(2, LAY.nbytes, dtype=torch.uint8)
    _refused(NonContiguousDestinationError, raw=two)
    strided = torch.zeros(2 * LAY.nbytes, dtype=torch.uint8)[::2]
    _refused(NonContiguousDestinationError, raw=strided)
    del raw


def test_misaligned_destination():
    big = torch.zeros(LAY.nbytes + 1, dtype=torch.uint8)
    _refused(MisalignedDestinationError, raw=big[1:])


def test_destination_too_small_or_not_bytes():
    _refused(DestinationError, raw=torch.zeros(LAY.nbytes - 2, dtype=torch.uint8))
    with pytest.raises(DestinationError):
        restore(torch.zeros(LAY.nbytes // 2, dtype=torch.bfloat16), LAY, _segment(LAY, 4)[0], [0, 1, 2, 3],
                [1, 2, 3, 4], ROPE)


def test_segment_on_another_device():
    seg, _ = _segment(LAY, 4)
    meta = KVSegment(seg.k.to("meta"), seg.v.to("meta"), seg.positions.to("meta"), seg.dtype)
    _refused(DeviceMismatchError, seg=meta)


def test_malformed_segment():
    with pytest.raises(SegmentError):
        KVSegment(torch.zeros(4, 2, 64, dtype=torch.bfloat16), None, torch.arange(4), "bfloat16")
    with pytest.raises(SegmentError):
        KVSegment(torch.zeros(4, 1, 2, 64, dtype=torch.bfloat16), None, torch.arange(3), "bfloat16")
    with pytest.raises(SegmentError):
        KVSegment(torch.zeros(4, 1, 2, 64, dtype=torch.bfloat16), None, torch.arange(4.0), "bfloat16")


# ---------------------------------------------------------------------------------------------------
# GPU: the kernel equals the torch path byte for byte (vector and element paths)

GPU_LAYOUTS = [KVLayout.paged(o, 3, 9, 16, 2, 64, dt, k_scale=0.02, v_scale=0.03)
               for o in ("LBNHC", "BHLNC") for dt in ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")]
GPU_LAYOUTS += [KVLayout.cpu(3, 3, 32, 2, 64, "bfloat16"), KVLayout.cpu(3, 3, 32, 2, 64, "fp8_e4m3", k_scale=0.02),
                KVLayout.mla("BLHNC", 3, 9, 16, 128, 64, "bfloat16"),
                KVLayout.mla("LBNHC", 3, 9, 16, 128, 64, "fp8_e5m2"),
                KVLayout.cpu(3, 3, 32, 1, 256, "float32")]   # element path with more items than threads
# divisors that are not powers of two (heads, block size, units per row) for the vector path's fast division
GPU_LAYOUTS += [KVLayout.paged("LBNHC", 3, 13, 7, 3, 96, "bfloat16"),
                KVLayout.paged("BHLNC", 3, 11, 5, 5, 32, "float32"),
                KVLayout.mla("LBNHC", 3, 9, 16, 512, 64, "fp8_e4m3", k_scale=0.05)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lay", GPU_LAYOUTS, ids=lambda x: f"{x.packing}-{x.order}-{x.dtype}")
@pytest.mark.parametrize("style", ["neox", "gptj", "partial"])
def test_kernel_equals_torch_path(lay, style):
    from kmesh.cuda.restore_rope import launch_restore

    hd = lay.head_dim - lay.rope_offset
    rope = RopeConfig(hd, hd // 2 if style == "partial" else hd, 1e4, "gptj" if style == "gptj" else "neox",
                      None, 4096)
    g = torch.Generator().manual_seed(11)
    T = 50
    store = lay.storage_dtype
    if lay.fp8_dtype is not None:
        k = torch.randint(0, 0x7E, (T, 3, lay.num_kv_heads, lay.head_dim), generator=g, dtype=torch.uint8)
        v = torch.randint(0, 0x7E, (T, 3, lay.num_kv_heads, lay.head_dim_v), generator=g, dtype=torch.uint8)
    else:
        k = torch.randn(T, 3, lay.num_kv_heads, lay.head_dim, generator=g).to(store)
        v = torch.randn(T, 3, lay.num_kv_heads, lay.head_dim_v, generator=g).to(store)
    old = torch.randint(0, 4000, (T,), generator=g)
    new = torch.randint(0, 4000, (T,), generator=g)
    new[:5] = old[:5]                                     # some tokens stay put
    slots = torch.randperm(lay.num_slots, generator=g)[:T]
    slots[7] = -1
    seg = KVSegment(k, v if lay.head_dim_v else None, old, lay.dtype, lay.k_scale, lay.v_scale).to("cuda")
    ref = _poisoned(lay, "cuda")
    restore(ref, lay, seg, slots.cuda(), new.cuda(), rope)
    paths = set()
    for slow in (False, True):
        out = _poisoned(lay, "cuda")
        info = launch_restore(plan_restore(out, lay, seg, slots.cuda(), new.cuda(), rope), force_slow=slow)
        torch.cuda.synchronize()
        paths.add(info["path"])
        assert torch.equal(out, ref), f"{info}: {(out != ref).sum().item()} bytes differ"
    assert ("vector" in paths) == (lay.packing != "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_kernel_split_into_token_ranges(monkeypatch, dtype):
    """With a tiny unit limit the vector path runs as several launches over token ranges: same bytes."""
    import kmesh.cuda.restore_rope as rr

    lay = KVLayout.paged("LBNHC", 3, 9, 16, 2, 64, dtype, k_scale=0.02, v_scale=0.03)
    rope = RopeConfig(64, 64, 1e4, "neox", None, 4096)
    g = torch.Generator().manual_seed(5)
    T = 50
    if lay.fp8_dtype is not None:
        k, v = (torch.randint(0, 0x7E, (T, 3, 2, 64), generator=g, dtype=torch.uint8) for _ in range(2))
    else:
        k, v = (torch.randn(T, 3, 2, 64, generator=g).to(lay.storage_dtype) for _ in range(2))
    old, new = torch.randint(0, 4000, (T,), generator=g), torch.randint(0, 4000, (T,), generator=g)
    slots = torch.randperm(lay.num_slots, generator=g)[:T]
    slots[3] = -1
    seg = KVSegment(k, v, old, lay.dtype, lay.k_scale, lay.v_scale).to("cuda")
    ref = _poisoned(lay, "cuda")
    restore(ref, lay, seg, slots.cuda(), new.cuda(), rope)
    out = _poisoned(lay, "cuda")
    plan = plan_restore(out, lay, seg, slots.cuda(), new.cuda(), rope)
    per_token = 3 * 2 * sum(rr.units_per_row(plan))
    limit = max(7 * per_token + 5, T * 3 * 2)   # the row count T·L·H must still fit
    monkeypatch.setattr(rr, "_INT32", limit)
    info = rr.launch_restore(plan)
    torch.cuda.synchronize()
    step = limit // per_token
    assert info["path"] == "vector" and info["launches"] == -(-T // step) > 1, info
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} bytes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_refuses_cpu_cache():
    from kmesh.cuda.restore_rope import launch_restore

    seg, _ = _segment(LAY, 4)
    plan = plan_restore(_poisoned(LAY), LAY, seg, [0, 1, 2, 3], [5, 6, 7, 8], ROPE)
    with pytest.raises(DeviceMismatchError):
        launch_restore(plan)


# ---------------------------------------------------------------------------------------------------
# Where restore and capture put / take bytes, against the independent reference (kmesh.reference.addressing)

from kmesh.reference import addressing as ref  # noqa: E402

WHERE_LAYOUTS = [
    KVLayout.paged("LBNHC", 3, 4, 8, 2, 32, "bfloat16", offset=64),
    KVLayout.paged("BHLNC", 3, 4, 8, 2, 32, "fp8_e4m3", k_scale=0.05, v_scale=0.1),
    KVLayout.cpu(3, 4, 8, 2, 32, "float32", order="BLHNC"),
    KVLayout.mla("LBHNC", 3, 4, 8, 16, 32, "float16"),               # rotary part = channels [16, 48)
]


def _b(t):
    return t.contiguous().view(torch.uint8)     # poisoned caches hold NaN patterns: compare bytes


def _rope_for(lay):
    # a partial rotary over the key channels from rope_offset: channels [rope_offset, rope_offset + 16) move
    return RopeConfig(lay.head_dim - lay.rope_offset, 16, 10000.0, "gptj", None, 4096)


@pytest.mark.parametrize("lay", WHERE_LAYOUTS, ids=lambda x: f"{x.packing}-{x.order}-{x.dtype}")
def test_restore_writes_exactly_the_reference_cells(lay):
    # slot 0, the last slot and both sides of a block boundary; padding in between; layers [1, 3)
    slots = torch.tensor([0, -1, lay.num_slots - 1, 7, 8, -1, 17])
    T, kept = slots.numel(), slots >= 0
    src = lay.with_(num_layers=2)
    seg = capture(_poisoned(src, seed=5), src, torch.arange(T), torch.arange(100, 100 + T))
    new = seg.positions.clone()
    new[2::2] += 37                                         # tokens 2, 4, 6 move; 0, 1, 3, 5 keep their place
    raw = _poisoned(lay)
    before = raw.clone()
    plan = restore(raw, lay, seg, slots, new, _rope_for(lay), first_layer=1)
    assert plan.num_written_tokens == int(kept.sum())
    k, v = ref.read(raw, lay, slots[kept], [1, 2])
    if v is not None:
        assert torch.equal(_b(v), _b(seg.v[kept]))          # values byte for byte
    still = (new == seg.positions)[kept]
    assert torch.equal(_b(k[still]), _b(seg.k[kept][still]))     # unmoved keys byte for byte
    lo, hi = lay.rope_offset, lay.rope_offset + 16
    moved_k, moved_seg = _b(k[~still]), _b(seg.k[kept][~still])
    es = lay.element_size
    assert torch.equal(moved_k[..., : lo * es], moved_seg[..., : lo * es])      # channels before the rotary part
    assert torch.equal(moved_k[..., hi * es:], moved_seg[..., hi * es:])        # and past rotary_dim: untouched
    mask = ref.touched_mask(raw.numel(), lay, slots[kept], [1, 2])
    assert torch.equal(raw[~mask], before[~mask]), "bytes outside the destination cells changed"


@pytest.mark.parametrize("lay", WHERE_LAYOUTS, ids=lambda x: f"{x.packing}-{x.order}-{x.dtype}")
def test_capture_reads_the_reference_cells(lay):
    raw = _poisoned(lay, seed=9)
    before = raw.clone()
    slots = torch.tensor([lay.num_slots - 1, 0, 8, 7])
    seg = capture(raw, lay, slots, torch.arange(4), layers=[2, 0])
    k, v = ref.read(raw, lay, slots, [2, 0])
    assert torch.equal(_b(seg.k), _b(k))
    assert (seg.v is None) == (lay.head_dim_v == 0)
    if v is not None:
        assert torch.equal(_b(seg.v), _b(v))
    assert (seg.dtype, seg.k_scale, seg.v_scale) == (lay.dtype, lay.k_scale, lay.v_scale)
    assert torch.equal(raw, before)


def test_capture_refuses_slots_outside_the_cache():
    raw = _poisoned(LAY)
    for bad in ([-1, 0], [0, LAY.num_slots], [LAY.num_slots - 1, LAY.num_slots + 5], [-1]):
        with pytest.raises(SlotRangeError):          # -1 would read the last block, num_slots past the end
            capture(raw, LAY, bad, list(range(len(bad))))
    empty = capture(raw, LAY, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert empty.num_tokens == 0 and empty.k.shape == (0, 2, 2, 64)


def test_capture_keeps_integer_positions_exactly():
    # 2^53 + 1 has no float64: an index path through floats would change it
    big = [2**53 + 1, 2**62 + 3, 5, 2**63 - 1]
    raw = _poisoned(LAY)
    for kind in (big, np.array(big, dtype=np.int64), np.array(big, dtype=np.uint64), torch.tensor(big)):
        assert capture(raw, LAY, [0, 1, 2, 3], kind).positions.tolist() == big


@pytest.mark.parametrize("extreme", [
    [7, 8, 9, 2**63 - 1], [7, 8, 9, -(2**63)],
    np.array([7, 8, 9, 2**63 - 1], dtype=np.uint64), torch.tensor([7, 8, 9, 2**63 - 1], dtype=torch.uint64),
], ids=["list-max", "list-min", "np-uint64-max", "torch-uint64-max"])
def test_int64_extremes_are_positions_off_the_table_not_malformed(extreme):
    # the largest / smallest int64 is a valid integer: refused by the rope table's range, not as malformed
    e = _refused(RopeRangeError, new=extreme)
    assert not isinstance(e, PositionError)


def test_torch_index_tensors_of_the_wrong_kind_are_refused():
    for bad in (torch.tensor([True, False, True, False]), torch.tensor([0, 1, 2, 3], dtype=torch.complex64),
                torch.tensor([0, 1, 2, 2**64 - 1], dtype=torch.uint64)):   # the last would wrap to -1 (padding)
        _refused(SlotError, slots=bad)
        _refused(PositionError, new=bad)
    plan = restore(_poisoned(LAY), LAY, _segment(LAY, 4)[0], torch.tensor([0, 1, 2, 3], dtype=torch.uint64),
                   torch.tensor([7, 8, 9, 10], dtype=torch.uint64), ROPE)
    assert plan.slots.dtype == torch.int64 and plan.slots.tolist() == [0, 1, 2, 3]


def test_duplicate_slot_zero_is_refused():
    _refused(DuplicateSlotError, slots=torch.tensor([0, 5, 0, -1]))


@pytest.mark.parametrize("slots, named", [
    ([0, -5, 2, 3], "-5"), ([0, 1, 2, 999], "999"), ([-1, 1, 2, 999], "999"), ([-2, 1, 2, 3], "-2"),
    ([-7, 1, 2, 999], "-7"),
])
def test_slot_range_error_names_the_offending_slot(slots, named):
    e = _refused(SlotRangeError, slots=torch.tensor(slots))
    assert f"slot {named} " in str(e)


def test_plan_restore_defaults_to_the_first_layer():
    raw = _poisoned(LAY)
    plan = plan_restore(raw, LAY, _segment(LAY, 4)[0], [0, 1, 2, 3], [7, 8, 9, 10], ROPE)
    assert plan.first_layer == 0
    plan.run()                                        # the default backend is the torch path
    ref_raw = _poisoned(LAY)
    restore(ref_raw, LAY, _segment(LAY, 4)[0], [0, 1, 2, 3], [7, 8, 9, 10], ROPE, first_layer=0, backend="torch")
    assert torch.equal(raw, ref_raw)


def test_run_refuses_unknown_backends_and_cuda_on_a_cpu_cache():
    raw = _poisoned(LAY)
    before = raw.clone()
    plan = plan_restore(raw, LAY, _segment(LAY, 4)[0], [0, 1, 2, 3], [7, 8, 9, 10], ROPE)
    with pytest.raises(RestoreError, match="backend"):
        plan.run("triton")
    with pytest.raises(DeviceMismatchError, match="CUDA cache"):
        plan.run("cuda")
    assert torch.equal(raw, before)


def test_bytes_moved_by_hand():
    # T=4, L=2, H=2, K 64 + V 64 bfloat16: segment 4·2·2·128·2 = 4096 bytes.
    # Tables: cos and sin [4, 32] float32 = 2·128·4 = 1024, plus 8-byte slot + 1-byte moved flag per token = 36.
    plan = plan_restore(_poisoned(LAY), LAY, _segment(LAY, 4)[0], [0, -1, 2, 3], [7, 8, 9, 10], ROPE)
    assert plan.bytes_moved() == {"read": 4096 + 1060, "written": 4096, "total": 2 * 4096 + 1060}


# ---------------------------------------------------------------------------------------------------
# KVSegment: shape checks, layer slices, devices

def test_segment_refuses_mismatched_values_positions_and_scales():
    k = torch.zeros(4, 2, 2, 8, dtype=torch.float16)
    v = torch.zeros(4, 2, 2, 8, dtype=torch.float16)
    pos = torch.arange(4)
    bad = [
        dict(v=torch.zeros(3, 2, 2, 8, dtype=torch.float16)),          # another token count
        dict(v=torch.zeros(4, 2, 2, dtype=torch.float16)),             # 3-D, its [T, L, H] matching k's
        dict(v=[[0.0] * 8] * 4),                                       # not a tensor
        dict(positions=torch.arange(4)[:, None]),                      # [T, 1]
        dict(positions=[0, 1, 2, 3]),
        dict(positions=torch.tensor([True, False, True, True])),
        dict(k_scale=float("inf")), dict(v_scale=-1.0), dict(k_scale=0.0), dict(v_scale=float("nan")),
    ]
    for kw in bad:
        args = dict(k=k, v=v, positions=pos, dtype="float16") | kw
        with pytest.raises(SegmentError):
            KVSegment(**args)
    KVSegment(k, v, pos.to(torch.int32), "float16", 2, 0.5)           # integer positions of any width, int scales


def test_segment_layers_slice_every_part():
    seg, _ = _segment(LAY.with_(num_layers=4, dtype="fp8_e5m2", k_scale=0.5, v_scale=0.25), 3)
    part = seg.layers(1, 3)
    assert torch.equal(part.k, seg.k[:, 1:3]) and torch.equal(part.v, seg.v[:, 1:3])
    assert part.positions is seg.positions
    assert (part.dtype, part.k_scale, part.v_scale, part.num_layers) == ("fp8_e5m2", 0.5, 0.25, 2)
    mla = KVSegment(torch.zeros(3, 4, 1, 12, dtype=torch.bfloat16), None, torch.arange(3), "bfloat16")
    sub = mla.layers(2, 4)
    assert sub.v is None and sub.k.shape == (3, 2, 1, 12)


def test_segment_to_moves_every_tensor_and_keeps_scales():
    seg, _ = _segment(LAY.with_(dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25), 2)
    m = seg.to("meta")
    assert {m.k.device.type, m.v.device.type, m.positions.device.type} == {"meta"}
    assert (m.dtype, m.k_scale, m.v_scale) == ("fp8_e4m3", 0.5, 0.25)
    mla = KVSegment(torch.zeros(2, 1, 1, 12, dtype=torch.bfloat16), None, torch.arange(2), "bfloat16").to("meta")
    assert mla.v is None and mla.k.device.type == "meta"
