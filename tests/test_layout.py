"""kmesh.layout: addressing of every arrangement (both access paths agree, addresses tile the buffer exactly),
the CPU backend's transposed K plane, layouts derived from live views, fp8 helpers and bad layouts."""
import itertools

import pytest
import torch

from kmesh.layout import ORDERS, KVLayout, LayoutError, MisalignedLayoutError, dequantize, quantize, storage_bytes

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
