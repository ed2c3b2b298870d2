"""kmesh.reference.addressing against byte offsets worked out by hand, so the reference the synthetic stage
trusts is itself checked without kmesh.kv.layout; then (only as a cross-check) against kmesh.kv.layout's views."""
import itertools

import pytest
import torch

from kmesh.kv.layout import KVLayout
from kmesh.reference import addressing as ref

# paged, float32 (4 bytes), L=2 B=3 H=2 N=4, K and V 2 channels each: a cell is 4 channels = 16 bytes.
# Dense byte strides per order (innermost first, each = previous stride × previous extent):
#   LBHNC: N 16, H 64,  B 128, L 384        LBNHC: H 16, N 32, B 128, L 384
#   LHBNC: N 16, B 64,  H 192, L 384        BLHNC: N 16, H 64, L 128, B 256
#   BLNHC: H 16, N 32,  L 128, B 256        BHLNC: N 16, L 64, H 128, B 256
# (part, layer, slot, head, channel) -> byte offset. Slot 6 = block 1, offset 2; slot 11 = block 2, offset 3.
PAGED_F32 = {
    "LBHNC": {("k", 1, 6, 1, 1): 384 + 128 + 64 + 2 * 16 + 1 * 4,      # 612
              ("v", 1, 6, 1, 0): 384 + 128 + 64 + 2 * 16 + 2 * 4,      # 616: V starts after D=2 K channels
              ("k", 0, 11, 0, 0): 2 * 128 + 3 * 16,                    # 304
              ("v", 1, 11, 1, 1): 768 - 4},                            # the last element of the buffer
    "LBNHC": {("k", 1, 6, 1, 1): 384 + 128 + 2 * 32 + 16 + 4,          # 596
              ("v", 1, 6, 1, 0): 384 + 128 + 2 * 32 + 16 + 8,          # 600
              ("k", 0, 11, 0, 0): 2 * 128 + 3 * 32},                   # 352
    "LHBNC": {("k", 1, 6, 1, 1): 384 + 192 + 64 + 2 * 16 + 4,          # 676
              ("k", 0, 11, 0, 0): 2 * 64 + 3 * 16,                     # 176
              ("v", 0, 0, 1, 1): 192 + 8 + 4},                         # 204
    "BLHNC": {("k", 1, 6, 1, 1): 256 + 128 + 64 + 2 * 16 + 4,          # 484
              ("k", 0, 11, 0, 0): 2 * 256 + 3 * 16,                    # 560
              ("v", 1, 0, 0, 0): 128 + 8},                             # 136
    "BLNHC": {("k", 1, 6, 1, 1): 256 + 128 + 2 * 32 + 16 + 4,          # 468
              ("k", 0, 11, 0, 0): 2 * 256 + 3 * 32,                    # 608
              ("v", 0, 1, 1, 1): 32 + 16 + 8 + 4},                     # 60
    "BHLNC": {("k", 1, 6, 1, 1): 256 + 128 + 64 + 2 * 16 + 4,          # 480
              ("k", 0, 11, 0, 0): 2 * 256 + 3 * 16,                    # 560
              ("v", 1, 3, 0, 1): 64 + 3 * 16 + 8 + 4},                 # 124
}


@pytest.mark.parametrize("order", list(PAGED_F32))
def test_paged_offsets_by_hand(order):
    lay = KVLayout.paged(order, 2, 3, 4, 2, 2, "float32")
    for (part, layer, slot, head, ch), want in PAGED_F32[order].items():
        assert ref.byte_offset(lay, part, layer, slot, head, ch) == want, (order, part, layer, slot, head, ch)
        got = ref.element_offsets(lay, part, torch.tensor([slot]), [layer])[0, 0, head, ch]
        assert int(got) == want


def test_paged_fp8_one_byte_elements_by_hand():
    # fp8 (1 byte), LBNHC, same sizes: cell 4 bytes; H 4, N 8, B 32, L 96. V channel 1 = cell byte 2 + 1.
    lay = KVLayout.paged("LBNHC", 2, 3, 4, 2, 2, "fp8_e4m3")
    assert ref.byte_offset(lay, "v", 1, 6, 1, 1) == 96 + 32 + 2 * 8 + 4 + 3    # 151
    assert ref.byte_offset(lay, "k", 0, 5, 0, 0) == 32 + 8                     # 40


def test_stride_overrides_and_offset_by_hand():
    # LBHNC float32 with pages padded to 160 bytes and the cache 32 bytes into the buffer: L = 160 × 3 blocks.
    lay = KVLayout.paged("LBHNC", 2, 3, 4, 2, 2, "float32", block_stride=160, offset=32)
    assert ref.axis_strides(lay) == {"N": 16, "H": 64, "B": 160, "L": 480}
    assert ref.byte_offset(lay, "k", 1, 6, 1, 1) == 32 + 480 + 160 + 64 + 32 + 4    # 772
    # BLHNC with a 1000-byte layer stride: blocks are dense over it (2 layers × 1000).
    lay = KVLayout.paged("BLHNC", 2, 3, 4, 2, 2, "float32", layer_stride=1000)
    assert ref.axis_strides(lay) == {"N": 16, "H": 64, "L": 1000, "B": 2000}
    assert ref.byte_offset(lay, "k", 1, 6, 1, 1) == 1000 + 2000 + 64 + 32 + 4       # 3100


def test_cpu_planes_by_hand():
    # float16 (2 bytes), L=2 B=3 H=2 N=4 D=2: per (layer, block, head) an area of N × 2D = 16 elements (32 B).
    # LBHNC: H 32, B 64, L 192. K^T: [c, n] at c·N + n; V: [n, c] at N·D + n·D + c = 8 + 2n + c.
    lay = KVLayout.cpu(2, 3, 4, 2, 2, "float16")
    area = 192 + 64 + 32                                      # layer 1, block 1, head 1
    assert ref.byte_offset(lay, "k", 1, 6, 1, 1) == area + (1 * 4 + 2) * 2          # 300
    assert ref.byte_offset(lay, "v", 1, 6, 1, 0) == area + (8 + 2 * 2 + 0) * 2      # 312
    assert ref.byte_offset(lay, "k", 0, 3, 0, 0) == 3 * 2                           # 6
    assert ref.byte_offset(lay, "k", 0, 3, 0, 1) == (4 + 3) * 2                     # 14
    assert ref.byte_offset(lay, "v", 0, 3, 0, 1) == (8 + 6 + 1) * 2                 # 30
    # BHLNC: L 32, H 64, B 128
    lay = KVLayout.cpu(2, 3, 4, 2, 2, "float16", order="BHLNC")
    assert ref.byte_offset(lay, "k", 1, 6, 1, 1) == 32 + 64 + 128 + 12              # 236


def test_mla_latent_by_hand():
    # bfloat16 (2 bytes), one head, latent 4 + rope 2 = 6 channels = 12 bytes per cell, N=4, B=3, L=2.
    lay = KVLayout.mla("BLNHC", 2, 3, 4, 4, 2, "bfloat16")      # H 12, N 12, L 48, B 96
    assert ref.byte_offset(lay, "k", 1, 6, 0, 5) == 96 + 48 + 2 * 12 + 5 * 2        # 178
    lay = KVLayout.mla("LBNHC", 2, 3, 4, 4, 2, "bfloat16")      # H 12, N 12, B 48, L 144
    assert ref.byte_offset(lay, "k", 1, 6, 0, 5) == 144 + 48 + 24 + 10              # 226
    with pytest.raises(ref.AddressError):
        ref.byte_offset(lay, "v", 0, 0, 0, 0)


def test_slots_split_by_plain_arithmetic():
    assert [ref.block_and_offset(s, 16) for s in (0, 15, 16, 37)] == [(0, 0), (0, 15), (1, 0), (2, 5)]
    b, n = ref.blocks_and_offsets(torch.tensor([0, 15, 16, 37, 127]), 16)
    assert b.tolist() == [0, 0, 1, 2, 7] and n.tolist() == [0, 15, 0, 5, 15]
    with pytest.raises(ref.AddressError):
        ref.block_and_offset(-1, 16)
    with pytest.raises(ref.AddressError):
        ref.blocks_and_offsets(torch.tensor([3, -1]), 16)


def _small_layouts():
    for order, dt in itertools.product(("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"), ("float32", "fp8_e5m2")):
        yield KVLayout.paged(order, 3, 4, 8, 2, 4, dt, offset=16)
        yield KVLayout.mla(order, 3, 4, 8, 4, 4, dt)
    yield KVLayout.cpu(3, 4, 8, 2, 4, "bfloat16", order="LHBNC")


@pytest.mark.parametrize("lay", list(_small_layouts()), ids=lambda l: f"{l.packing}-{l.order}-{l.dtype}")
def test_every_byte_of_every_cell_is_addressed_exactly_once(lay):
    slots = torch.arange(lay.num_blocks * lay.block_size)
    layers = range(lay.num_layers)
    parts = ["k"] + ([] if lay.packing == "mla" else ["v"])
    es = ref.element_bytes(lay.dtype)
    offs = torch.cat([(ref.element_offsets(lay, p, slots, layers)[..., None] + torch.arange(es)).flatten()
                      for p in parts])
    assert offs.unique().numel() == offs.numel()
    total = ref.destination_bytes(lay, slots.numel(), lay.num_layers)
    assert offs.numel() == total and int(offs.min()) == lay.offset and int(offs.max()) == lay.offset + total - 1
    assert int(ref.touched_mask(lay.offset + total, lay, slots, layers).sum()) == total


@pytest.mark.parametrize("lay", list(_small_layouts()), ids=lambda l: f"{l.packing}-{l.order}-{l.dtype}")
def test_read_and_mask_agree_with_vllm_style_layer_views(lay):
    # Cross-check only: kmesh.kv.layout's per-layer views (vLLM's split) and the reference name the same bytes.
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (lay.nbytes + 8,), dtype=torch.uint8, generator=g)
    slots = torch.randperm(lay.num_slots, generator=g)[:11]
    k, v = ref.read(raw, lay, slots, [2, 0])
    k2, v2 = lay.read_tokens(raw, slots, [2, 0])
    assert torch.equal(k.view(torch.uint8), k2.view(torch.uint8))
    assert (v is None) == (v2 is None) and (v is None or torch.equal(v.view(torch.uint8), v2.view(torch.uint8)))
    assert torch.equal(ref.touched_mask(raw.numel(), lay, slots, [2, 0]), lay.touched_bytes(raw, slots, [2, 0]))


def test_out_of_buffer_addresses_are_refused():
    lay = KVLayout.paged("LBHNC", 2, 3, 4, 2, 2, "float32")
    with pytest.raises(ref.AddressError):
        ref.read(torch.zeros(100, dtype=torch.uint8), lay, torch.tensor([11]), [1])
