"""kmesh.kv.layout: addressing of every arrangement (both access paths agree, addresses tile the buffer exactly),
the CPU backend's transposed K plane, layouts derived from live views, fp8 helpers and bad layouts."""
import itertools

import pytest
import torch

from kmesh.kv.layout import ORDERS, KVLayout, LayoutError, MisalignedLayoutError, dequantize, quantize, storage_bytes

SMALL = dict(num_layers=3, num_blocks=4, block_size=16)


def _layouts():
    for order, dt in itertools.product(ORDERS, ("float32", "bfloat16", "fp8_e4m3")):
        yield KVLayout.paged(order, 3, 4, 16, 2, 8, dt)
        yield KVLayout.mla(order, 3, 4, 16, 8, 4, dt)
    for order in ("LBHNC", "BLHNC", "BHLNC", "LHBNC"):
        yield KVLayout.cpu(3, 4, 16, 2, 8, "float16", order=order)


LAYOUTS = list(_layouts())


def _id(lay):
    return f"{lay.packing}-{lay.order}-{lay.dtype}"


def _all_element_offsets(lay):
    """Every K and V element offset of the layout, from the strides (path 1)."""
    out = []
    for st, width in ((lay.k_strides(), lay.head_dim), (lay.v_strides() if lay.head_dim_v else None, lay.head_dim_v)):
        if st is None:
            continue
        idx = [torch.arange(n) for n in (lay.num_layers, lay.num_blocks, lay.num_kv_heads, lay.block_size, width)]
        L, B, H, N, C = torch.meshgrid(*idx, indexing="ij")
        out.append((st.offset + L * st.layer + B * st.block + H * st.head + N * st.token + C * st.channel).flatten())
    return torch.cat(out)


@pytest.mark.parametrize("lay", LAYOUTS, ids=_id)
def test_addresses_tile_the_cells_exactly_once(lay):
    offs = _all_element_offsets(lay)
    assert offs.unique().numel() == offs.numel(), "two logical elements share an address"
    assert int(offs.min()) == lay.offset // lay.element_size
    assert int(offs.max()) + 1 == lay.nbytes // lay.element_size   # dense: nothing beyond the last cell
    total = lay.num_layers * lay.num_blocks * lay.num_kv_heads * lay.block_size * lay.cell_channels
    assert offs.numel() == total


@pytest.mark.parametrize("lay", LAYOUTS, ids=_id)
def test_strided_views_and_layer_views_agree(lay):
    # write distinct values through path 1 (k_tensor/v_tensor), read through path 2 (vLLM-style layer views)
    raw = torch.zeros(lay.nbytes, dtype=torch.uint8)
    flat = lay.elements(raw)
    g = torch.Generator().manual_seed(0)
    k = torch.randint(0, 120, lay.k_tensor(flat).shape, generator=g).to(lay.storage_dtype)
    lay.k_tensor(flat).copy_(k)
    if lay.head_dim_v:
        v = torch.randint(0, 120, lay.v_tensor(flat).shape, generator=g).to(lay.storage_dtype)
        lay.v_tensor(flat).copy_(v)
    slots = torch.randperm(lay.num_slots, generator=g)[:20]
    kr, vr = lay.read_tokens(raw, slots)
    b, n = lay.split_slots(slots)
    assert torch.equal(kr, k[:, b, n].transpose(0, 1))
    if lay.head_dim_v:
        assert torch.equal(vr, v[:, b, n].transpose(0, 1))
    mask = lay.touched_bytes(raw, slots)
    assert int(mask.sum()) == 20 * lay.num_layers * lay.num_kv_heads * lay.cell_channels * lay.element_size


def test_cpu_packing_stores_k_transposed_then_v():
    lay = KVLayout.cpu(2, 3, 16, 2, 8, "float32")
    raw = torch.zeros(lay.nbytes, dtype=torch.uint8)
    flat = lay.elements(raw)
    l, b, n, h, c = 1, 2, 5, 1, 3
    lay.k_tensor(flat)[l, b, n, h, c] = 7.0
    lay.v_tensor(flat)[l, b, n, h, c] = 9.0
    N, D, H, B = 16, 8, 2, 3
    plane = ((l * B + b) * H + h) * (2 * N * D)          # LBHNC: one [N, 2D] area per (layer, block, head)
    assert flat[plane + c * N + n] == 7.0                  # K^T: element [c, n] at c·N + n
    assert flat[plane + N * D + n * D + c] == 9.0          # V: element [n, c] after the K plane
    assert int((flat != 0).sum()) == 2


def test_paged_lbnhc_cell_is_k_then_v():
    lay = KVLayout.paged("LBNHC", 2, 3, 16, 2, 8, "bfloat16")
    flat = lay.elements(torch.zeros(lay.nbytes, dtype=torch.uint8))
    lay.k_tensor(flat)[1, 2, 5, 1, 3] = 7
    lay.v_tensor(flat)[1, 2, 5, 1, 3] = 9
    cell = (((1 * 3 + 2) * 16 + 5) * 2 + 1) * 16          # [L, B, N, H] then C = 2·8
    assert flat[cell + 3] == 7 and flat[cell + 8 + 3] == 9


@pytest.mark.parametrize("order", ORDERS)
def test_from_layer_views_recovers_the_layout(order):
    lay = KVLayout.paged(order, 4, 5, 32, 2, 16, "float16", offset=64)
    raw = torch.zeros(lay.nbytes + 128, dtype=torch.uint8)
    views = lay.layer_views(raw)
    got = KVLayout.from_layer_views(views, "paged", 16, "float16")
    assert got.order == order
    assert got.byte_strides == lay.byte_strides and got.offset == 64
    assert storage_bytes(views[2]).data_ptr() == raw.data_ptr()


def test_from_layer_views_with_padded_blocks():
    lay = KVLayout.paged("LBNHC", 2, 4, 16, 2, 8, "bfloat16", block_stride=2 * 16 * 2 * 16 * 2 + 256,
                         layer_stride=4 * (2 * 16 * 2 * 16 * 2 + 256))
    raw = torch.zeros(lay.nbytes, dtype=torch.uint8)
    got = KVLayout.from_layer_views(lay.layer_views(raw), "paged", 8, "bfloat16")
    assert got.byte_strides == lay.byte_strides


def test_from_layer_views_rejects_foreign_views():
    a = KVLayout.paged("LBHNC", 1, 2, 16, 2, 8, "float32")
    v1 = a.layer_views(torch.zeros(a.nbytes, dtype=torch.uint8))
    v2 = a.layer_views(torch.zeros(a.nbytes, dtype=torch.uint8))
    with pytest.raises(LayoutError):
        KVLayout.from_layer_views(v1 + v2, "paged", 8, "float32")
    with pytest.raises(LayoutError):
        KVLayout.from_layer_views(v1, "paged", 16, "float32")   # C = 16 does not hold K and V of 16


@pytest.mark.parametrize("kw, msg", [
    (dict(packing="paged", order="LNBHC"), "order"),
    (dict(packing="paged", dtype="int8"), "dtype"),
    (dict(packing="cpu", order="LBNHC"), "N next to C"),
    (dict(packing="mla", num_kv_heads=2), "one latent"),
    (dict(packing="paged", rope_offset=4), "MLA"),
    (dict(packing="paged", num_blocks=0), "num_blocks"),
    (dict(packing="paged", dtype="fp8_e4m3", k_scale=0.0), "k_scale"),
])
def test_bad_layouts_are_refused(kw, msg):
    base = dict(packing="paged", order="LBHNC", num_layers=2, num_blocks=2, block_size=16, num_kv_heads=1,
                head_dim=8, head_dim_v=8, dtype="float16")
    base.update(kw)
    if base["packing"] == "mla" and "num_kv_heads" not in kw:
        base.update(num_kv_heads=1, head_dim_v=0, rope_offset=4)
    if base["packing"] == "mla":
        base["head_dim_v"] = 0
    with pytest.raises(LayoutError, match=msg):
        KVLayout(**base)


def test_misaligned_offsets_and_buffers():
    with pytest.raises(MisalignedLayoutError):
        KVLayout.paged("LBHNC", 1, 2, 16, 1, 8, "float32", offset=2)
    lay = KVLayout.paged("LBHNC", 1, 2, 16, 1, 8, "float32")
    raw = torch.zeros(lay.nbytes + 4, dtype=torch.uint8)
    with pytest.raises(MisalignedLayoutError):
        lay.elements(raw[1:])
    with pytest.raises(LayoutError):
        lay.elements(raw[: lay.nbytes - 4])


def test_dict_round_trip():
    lay = KVLayout.mla("BLNHC", 2, 3, 16, 32, 16, "fp8_e5m2", k_scale=0.5)
    assert KVLayout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize("fmt, top", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_fp8_quantize_saturates_and_rounds_like_the_cast(fmt, top):
    x = torch.tensor([0.0, 1.0, -3.3, 1e9, -1e9, 0.013])
    q = quantize(x, fmt, 2.0)
    back = dequantize(q, fmt, 0.5)
    assert q.dtype == torch.uint8
    assert back[3] == top * 0.5 and back[4] == -top * 0.5              # saturated, not inf/NaN
    assert torch.equal(q[[0, 1, 2, 5]], (x[[0, 1, 2, 5]] * 2).to(fmt).view(torch.uint8))


# ---------------------------------------------------------------------------------------------------
# Against the independent reference (kmesh.reference.addressing): every byte address, both access paths

from kmesh.reference import addressing as ref  # noqa: E402

# Layouts whose construction keywords matter: offsets, padded pages (block_stride / layer_stride beyond
# dense), head_dim_v != head_dim, and kw passed through the cpu/mla factories. (head_dim_v != head_dim is
# built with the constructor here: a factory failing at import would hide which test caught it.)
OVERRIDE_LAYOUTS = [
    KVLayout.paged("LBHNC", 3, 4, 16, 2, 8, "float32", offset=64, block_stride=2 * 16 * 16 * 4 + 128),
    KVLayout.paged("BLNHC", 3, 4, 16, 2, 8, "bfloat16", layer_stride=2 * 16 * 16 * 2 + 96),
    KVLayout("paged", "LHBNC", 3, 4, 16, 2, 8, 4, "fp8_e5m2", offset=5),
    KVLayout.paged("BHLNC", 3, 4, 16, 2, 8, "float16", block_stride=4 * 3 * 16 * 16 * 2 * 2, layer_stride=1024),
    KVLayout.cpu(3, 4, 16, 2, 8, "float16", order="BLHNC", offset=32, block_stride=3 * 2 * 16 * 16 * 2 + 64),
    KVLayout.mla("LBNHC", 3, 4, 16, 8, 4, "fp8_e4m3", offset=7, layer_stride=4 * 16 * 12 + 40),
    KVLayout("paged", "LBHNC", 3, 4, 16, 2, 8, 1, "float16"),             # the narrowest V
]


def _raw(lay, seed=0, slack=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (lay.nbytes + slack,), dtype=torch.uint8, generator=g)


def _edge_slots(lay):
    # first and last slot of the cache and both sides of a block boundary, plus a few in between
    bs = lay.block_size
    return torch.tensor([0, bs - 1, bs, lay.num_slots - 1, 2 * bs + 3, 1, lay.num_slots - bs])


def _bytes(t):
    return t.contiguous().view(torch.uint8)     # random bytes hold NaN patterns: compare bytes, not values


@pytest.mark.parametrize("lay", LAYOUTS + OVERRIDE_LAYOUTS, ids=_id)
def test_both_access_paths_read_the_reference_addresses(lay):
    raw = _raw(lay)
    slots = _edge_slots(lay)
    layers = list(range(lay.num_layers))
    k_ref, v_ref = ref.read(raw, lay, slots, layers)
    # path 1: strided views, indexed by the reference's (block, offset) split
    b, n = ref.blocks_and_offsets(slots, lay.block_size)
    flat = lay.elements(raw)
    assert torch.equal(_bytes(lay.k_tensor(flat)[:, b, n].transpose(0, 1)), _bytes(k_ref))
    if lay.head_dim_v:
        assert torch.equal(_bytes(lay.v_tensor(flat)[:, b, n].transpose(0, 1)), _bytes(v_ref))
    # the layout's own split of slots is plain integer arithmetic
    lb, ln = lay.split_slots(slots)
    assert torch.equal(lb, b) and torch.equal(ln, n)
    # path 2: vLLM-style layer views, on a layer subset in a non-sorted order
    k2, v2 = lay.read_tokens(raw, slots.to(torch.uint8), layers=[2, 0])   # any integer dtype (uint8 is no mask)
    k_ref2, v_ref2 = ref.read(raw, lay, slots, [2, 0])
    assert torch.equal(_bytes(k2), _bytes(k_ref2))
    assert (v2 is None) == (v_ref2 is None)
    if v2 is not None:
        assert torch.equal(_bytes(v2), _bytes(v_ref2))
    assert torch.equal(lay.touched_bytes(raw, slots, layers=[2, 0]), ref.touched_mask(raw.numel(), lay, slots, [2, 0]))
    # padding slots (-1) mark nothing; all layers by default
    padded = torch.cat([slots[:3], torch.tensor([-1]), slots[3:], torch.tensor([-1])])
    assert torch.equal(lay.touched_bytes(raw, padded), ref.touched_mask(raw.numel(), lay, slots, layers))


@pytest.mark.parametrize("lay", LAYOUTS[::5] + OVERRIDE_LAYOUTS, ids=_id)
def test_nbytes_ends_at_the_last_referenced_byte(lay):
    every = ref.touched_mask(lay.nbytes + 64, lay, torch.arange(lay.num_slots), range(lay.num_layers))
    hit = every.nonzero().flatten()
    assert int(hit.max()) + 1 == lay.nbytes        # the smallest buffer that holds every cell
    assert int(hit.min()) == lay.offset
    assert lay.byte_strides == ref.axis_strides(lay)


def test_factories_pass_their_keywords_through():
    p = KVLayout.paged("LBHNC", 2, 3, 16, 2, 8, "float16", head_dim_v=4, offset=16)
    assert (p.head_dim, p.head_dim_v, p.cell_channels, p.offset) == (8, 4, 12, 16)
    c = KVLayout.cpu(2, 3, 16, 2, 8, "fp8_e4m3", offset=8, k_scale=0.5, v_scale=0.25, block_stride=4096)
    assert (c.offset, c.k_scale, c.v_scale, c.block_stride) == (8, 0.5, 0.25, 4096)
    m = KVLayout.mla("LBHNC", 2, 3, 16, 8, 4, "fp8_e5m2", offset=3, k_scale=0.125, layer_stride=2048)
    assert (m.offset, m.k_scale, m.layer_stride, m.rope_offset, m.head_dim) == (3, 0.125, 2048, 8, 12)


@pytest.mark.parametrize("make", [
    lambda: KVLayout.mla("LBHNC", 1, 2, 16, 1, 4, "float16"),           # kv_lora_rank 1: rope_offset 1 is valid
    lambda: KVLayout.paged("LBHNC", 1, 2, 16, 1, 8, "float16", head_dim_v=1),
    lambda: KVLayout.paged("LBHNC", 1, 2, 16, 1, 8, "fp8_e4m3", offset=0, block_stride=1024),
], ids=["mla-rank-1", "paged-dv-1", "fp8-override"])
def test_smallest_valid_values_are_accepted(make):
    lay = make()
    assert lay.byte_strides == ref.axis_strides(lay)


BASE = dict(packing="paged", order="BLHNC", num_layers=2, num_blocks=2, block_size=16, num_kv_heads=1,
            head_dim=8, head_dim_v=8, dtype="float16")
MLA = dict(BASE, packing="mla", head_dim=12, head_dim_v=0, rope_offset=8)


@pytest.mark.parametrize("kw, msg", [
    (dict(BASE, num_blocks=True), "num_blocks"),          # a bool is not a size
    (dict(BASE, num_blocks=2.0), "num_blocks"),           # nor a float (BLHNC: B outermost, strides stay ints)
    (dict(BASE, head_dim_v=None), "head_dim_v"),
    (dict(BASE, head_dim_v=0), "head_dim_v > 0"),         # paged/cpu need values
    (dict(MLA, rope_offset=0), "rope_offset"),            # no latent part
    (dict(MLA, rope_offset=12), "rope_offset"),           # no rotary part
    (dict(BASE, offset=-4), "offset"),
    (dict(BASE, block_stride=-64), "stride"),
    (dict(BASE, block_stride=64.0), "stride"),
    (dict(BASE, layer_stride=-512), "stride"),
], ids=["bool-size", "float-size", "dv-None", "dv-0", "mla-rope0", "mla-rope-all", "neg-offset",
        "neg-block-stride", "float-block-stride", "neg-layer-stride"])
def test_wrong_layout_values_are_refused(kw, msg):
    with pytest.raises(LayoutError, match=msg):
        KVLayout(**kw)


def test_check_buffer_guards_size_dtype_shape_and_alignment():
    lay = KVLayout.paged("LBHNC", 1, 2, 16, 1, 8, "float32", offset=4)
    raw = torch.zeros(lay.nbytes + 8, dtype=torch.uint8)
    lay.check_buffer(raw[: lay.nbytes])                                   # exactly nbytes is enough
    lay.check_buffer(raw[: lay.nbytes].view(torch.int8))
    assert lay.elements(raw[: lay.nbytes + 3]).numel() == lay.nbytes // 4  # trailing partial element dropped
    for bad in (raw[: lay.nbytes - 1], raw.view(torch.float32), raw.view(2, -1), raw[::2]):
        with pytest.raises(LayoutError):
            lay.check_buffer(bad)
    flat = lay.elements(raw)
    lay.check_buffer(flat, elements=True)
    with pytest.raises(LayoutError, match="dtype"):
        lay.check_buffer(raw, elements=True)                              # bytes where elements are expected
    with pytest.raises(MisalignedLayoutError):
        lay.check_buffer(raw[2: lay.nbytes + 2])
    with pytest.raises(LayoutError):
        lay.check_buffer(raw.numpy())


# ---------------------------------------------------------------------------------------------------
# write_tokens (the test helper) lands where the reference reads

@pytest.mark.parametrize("lay", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[-1], OVERRIDE_LAYOUTS[2]], ids=_id)
def test_write_tokens_lands_at_the_reference_addresses(lay):
    raw = _raw(lay, seed=2)
    before = raw.clone()
    slots = _edge_slots(lay)
    g = torch.Generator().manual_seed(3)
    shape = (slots.numel(), 2, lay.num_kv_heads)
    k = torch.randint(0, 100, (*shape, lay.head_dim), generator=g).to(lay.storage_dtype)
    v = torch.randint(0, 100, (*shape, lay.head_dim_v), generator=g).to(lay.storage_dtype) if lay.head_dim_v else None
    lay.write_tokens(raw, slots.to(torch.uint8), k, v, layers=[2, 0])   # any integer dtype (uint8 is no mask)
    k_ref, v_ref = ref.read(raw, lay, slots, [2, 0])
    assert torch.equal(_bytes(k_ref), _bytes(k))
    if v is not None:
        assert torch.equal(_bytes(v_ref), _bytes(v))
    mask = ref.touched_mask(raw.numel(), lay, slots, [2, 0])
    assert torch.equal(raw[~mask], before[~mask])
    assert torch.equal(lay.touched_bytes(raw, slots.to(torch.uint8), [2, 0]), mask)   # uint8 slots are no mask


def test_write_tokens_without_values_leaves_values_alone():
    lay = KVLayout.paged("LBNHC", 2, 3, 16, 2, 8, "float32")
    raw = _raw(lay, seed=4)
    slots = torch.tensor([0, 17, 47])
    _, v_before = ref.read(raw, lay, slots, [0, 1])
    k = torch.arange(3 * 2 * 2 * 8, dtype=torch.float32).reshape(3, 2, 2, 8)
    lay.write_tokens(raw, slots, k, None)                                  # all layers, K only
    k_ref, v_ref = ref.read(raw, lay, slots, [0, 1])
    assert torch.equal(k_ref, k) and torch.equal(_bytes(v_ref), _bytes(v_before))


# ---------------------------------------------------------------------------------------------------
# from_layer_views: what the vLLM connector derives from the registered caches

def _views_layout_agree(src, got, raw):
    """`got` addresses exactly the memory `src` does (the connector would write there)."""
    extent = {"L": src.num_layers, "B": src.num_blocks, "H": src.num_kv_heads, "N": src.block_size}
    want, have = ref.axis_strides(src), ref.axis_strides(got)
    assert got.offset == src.offset
    assert {a: have[a] for a in extent if extent[a] > 1} == {a: want[a] for a in extent if extent[a] > 1}
    slots, layers = _edge_slots(src), list(range(src.num_layers))
    assert torch.equal(ref.touched_mask(raw.numel(), got, slots, layers),
                       ref.touched_mask(raw.numel(), src, slots, layers))


@pytest.mark.parametrize("src", [
    KVLayout.paged("LBHNC", 1, 4, 16, 2, 8, "float16"),           # one layer: L has no stride to read
    KVLayout.paged("LBNHC", 1, 4, 16, 2, 8, "float16", offset=32),
    KVLayout.paged("LHBNC", 1, 4, 16, 2, 8, "float16"),
    KVLayout.paged("BLNHC", 3, 4, 16, 2, 8, "float32", layer_stride=2 * 16 * 16 * 4 + 512),   # padded layers
    KVLayout.paged("LBHNC", 3, 4, 16, 2, 8, "float32", layer_stride=4 * 2 * 16 * 16 * 4 + 256),
    KVLayout("paged", "LBNHC", 2, 4, 16, 2, 8, 4, "bfloat16"),
    KVLayout.mla("LBNHC", 2, 4, 16, 8, 4, "fp8_e4m3", offset=3),
    KVLayout.cpu(2, 4, 16, 2, 8, "float16", order="BHLNC"),
], ids=_id)
def test_from_layer_views_addresses_what_the_views_address(src):
    raw = torch.zeros(src.nbytes + 64, dtype=torch.uint8)
    views = src.layer_views(raw)
    kw = {"head_dim_v": src.head_dim_v} if src.packing == "paged" and src.head_dim_v != src.head_dim else {}
    if src.packing == "mla":
        kw = {"rope_offset": src.rope_offset}       # head_dim_v defaults to 0 for MLA
    got = KVLayout.from_layer_views(views, src.packing, src.head_dim, src.dtype, **kw)
    _views_layout_agree(src, got, raw)
    for a, b in zip(got.layer_views(raw), views):      # the same views (strides of size-1 axes aside)
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
        big = [i for i, n in enumerate(a.shape) if n > 1]
        assert [a.stride(i) for i in big] == [b.stride(i) for i in big]


def test_from_layer_views_passes_scales_through():
    src = KVLayout.paged("LBHNC", 2, 3, 16, 1, 8, "fp8_e5m2", k_scale=0.5, v_scale=0.25)
    got = KVLayout.from_layer_views(src.layer_views(torch.zeros(src.nbytes, dtype=torch.uint8)), "paged", 8,
                                    "fp8_e5m2", k_scale=0.5, v_scale=0.25)
    assert (got.k_scale, got.v_scale) == (0.5, 0.25)


def test_from_layer_views_refuses_views_that_differ():
    src = KVLayout.paged("LBHNC", 2, 4, 16, 2, 8, "float16")
    raw = torch.zeros(src.nbytes, dtype=torch.uint8)
    v0, v1 = src.layer_views(raw)
    for other in (v1[:3],                                  # shape
                  v1.as_strided(v1.shape, (v1.stride(0), v1.stride(1), 8, 1)),   # strides only (N)
                  v1.view(torch.bfloat16)):                # dtype only
        with pytest.raises(LayoutError, match="differ"):
            KVLayout.from_layer_views([v0, other], "paged", 8, "float16")


def test_from_layer_views_refuses_a_cell_width_it_cannot_hold():
    # H = N = 1: no H/N stride to cross-check, so only the cell width itself shows C = 16 != 4 + 4.
    src = KVLayout.paged("LBHNC", 2, 4, 1, 1, 8, "float16")
    views = src.layer_views(torch.zeros(src.nbytes, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="channels"):
        KVLayout.from_layer_views(views, "paged", 4, "float16")


def test_from_layer_views_checks_head_strides_but_ignores_size_one_axes():
    raw = torch.zeros(1 << 16, dtype=torch.uint8)
    h16 = raw.view(torch.float16)
    B, H, N, C = 4, 2, 16, 16
    # heads padded apart (H stride 2 × dense, blocks and layers dense over that): no dense LBHNC has it
    padded = [h16.as_strided((B, H, N, C), (2 * H * N * C, 2 * N * C, C, 1), layer * B * 2 * H * N * C)
              for layer in range(2)]
    with pytest.raises(LayoutError, match="H stride"):
        KVLayout.from_layer_views(padded, "paged", 8, "float16")
    # one head: its stride means nothing (here 1 element), the layout is the dense one
    one = KVLayout.paged("LBHNC", 2, 4, 16, 1, 8, "float16")
    odd = [x.as_strided(x.shape, (x.stride(0), 1, x.stride(2), 1)) for x in one.layer_views(raw)]
    got = KVLayout.from_layer_views(odd, "paged", 8, "float16")
    want = ref.axis_strides(one)
    assert {a: got.byte_strides[a] for a in "LBN"} == {a: want[a] for a in "LBN"}


@pytest.mark.parametrize("gap", [0, 1, -4096], ids=["aliased", "1-byte-apart", "descending"])
def test_from_layer_views_refuses_layers_that_overlap(gap):
    # vLLM layers sharing one cache tensor (or views handed over in a wrong order) cannot be addressed as
    # distinct layers: a layout for them would send layer 1's writes to memory the views never name.
    src = KVLayout.paged("LBHNC", 1, 4, 16, 2, 8, "fp8_e4m3")
    raw = torch.zeros(8192, dtype=torch.uint8)
    base = 4096 if gap < 0 else 0
    v0 = src.layer_views(raw[base:])[0]
    v1 = v0.as_strided(v0.shape, v0.stride(), v0.storage_offset() + gap)
    # aliased / descending: refused for what they are (1 byte apart: no vLLM order has L innermost)
    with pytest.raises(LayoutError, match="increasing addresses" if gap <= 0 else "axis order"):
        KVLayout.from_layer_views([v0, v1], "paged", 8, "fp8_e4m3")


# ---------------------------------------------------------------------------------------------------
# storage_bytes and the fp8 helpers

def test_storage_bytes_is_the_whole_storage_as_bytes():
    lay = KVLayout.paged("LBNHC", 3, 2, 16, 2, 8, "bfloat16", offset=16)
    raw = torch.zeros(lay.nbytes + 10, dtype=torch.uint8)
    got = storage_bytes(lay.layer_views(raw)[2])
    assert got.dtype == torch.uint8 and got.shape == (raw.numel(),) and got.stride() == (1,)
    assert got.data_ptr() == raw.data_ptr()
    got[-1] = 7                                          # the same memory, to the last byte
    assert raw[-1] == 7
    m = storage_bytes(torch.empty(5, dtype=torch.float32, device="meta"))
    assert m.device.type == "meta" and m.shape == (20,)


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_fp8_quantize_multiplies_in_float32_whatever_the_input(src):
    # 1 · (1 + 1/16 + 2^-12) is just above the e4m3 midpoint between 1.0 and 1.125, so it rounds up to 1.125
    # (0x39). Multiplying in bf16/fp16 would first round it onto the midpoint, then tie to even: 1.0 (0x38).
    x = torch.ones(3, dtype=src)
    assert quantize(x, torch.float8_e4m3fn, 1.0625 + 2**-12).tolist() == [0x39] * 3
    assert quantize(x, torch.float8_e4m3fn, torch.tensor(1.0625 + 2**-12)).tolist() == [0x39] * 3
    assert dequantize(torch.tensor([0x39], dtype=torch.uint8), torch.float8_e4m3fn, 2.0).tolist() == [2.25]
