"""The catalog of a staging buffer: which saved object lands where, how many tokens it holds, what vouches for it.

A catalog has one KVLayout with the block axis outermost (all layers of a block together), so one segment is one
contiguous byte range: one saved object per segment, whatever the layer count. A segment starts on a block boundary
and its object is the whole blocks it spans (`segment_nbytes`): the slots past its last token in a partial last
block are padding, covered by the digest and never restored. A catalog comes from a leader's export
(kmesh.harness.leader) or from the records the vLLM connector reads (`CatalogEntry.from_record`); a child checks
it against its layout (`check_catalog`) before a byte is copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kmesh.kv.errors import SegmentCatalogError, SegmentOversizeError, SegmentSizeError, SegmentTruncatedError
from kmesh.kv.layout import KVLayout
from kmesh.kv.record import Record


@dataclass(frozen=True)
class CatalogEntry:
    index: int
    key: bytes
    offset: int            # bytes into the export buffer (and into a child's staging buffer)
    nbytes: int
    sha256: str            # the object's sha256 (what the cache service records when it commits the object)
    leader_start: int      # position of the segment's first token in the leader prompt
    tokens: int
    first_slot: int        # slot of its first token in the export layout
    # what a child checks on arrival, before a byte of the segment reaches its model state: (algorithm, hex digest
    # or "" for sha256, which is the sha256 above); blake3 runs on the GPU where the staging buffer is a device buffer
    arrival: tuple[str, str] = ("sha256", "")

    @property
    def arrival_algorithm(self) -> str:
        return self.arrival[0]

    @property
    def arrival_hex(self) -> str:
        if self.arrival[0] == "sha256":
            return self.sha256      # one sha256 per object: the service's commit digest is the arrival digest
        return self.arrival[1]

    @classmethod
    def from_record(cls, record: Record, key: bytes, index: int, layout: KVLayout, first_block: int) -> "CatalogEntry":
        """The entry of a stored payload its record vouches for, staged from block `first_block` of `layout`:
        the same checks (check_catalog, digests, sizes) as a leader's export then apply to it."""
        return cls(index, key, layout.offset + first_block * layout.byte_strides["B"], record.nbytes,
                   record.digest_hex if record.algorithm == "sha256" else "", record.start, record.tokens,
                   first_block * layout.block_size,
                   (record.algorithm, "" if record.algorithm == "sha256" else record.digest_hex))

    def slots(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.arange(self.first_slot, self.first_slot + self.tokens, device=device)

    def leader_positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.arange(self.leader_start, self.leader_start + self.tokens, device=device)


@dataclass(frozen=True)
class Catalog:
    layout: KVLayout
    entries: tuple[CatalogEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def describe(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "entries": [
            {"key": e.key.decode(errors="replace"), "offset": e.offset, "nbytes": e.nbytes, "sha256": e.sha256,
             "arrival": [e.arrival_algorithm, e.arrival_hex], "leader_start": e.leader_start, "tokens": e.tokens}
            for e in self.entries]}


def size_error(entry: CatalogEntry, nbytes: int, where: str = "") -> SegmentSizeError:
    """The typed refusal of an object of nbytes for `entry` (truncated or oversize)."""
    cls = SegmentTruncatedError if nbytes < entry.nbytes else SegmentOversizeError
    return cls(f"object {entry.key!r} has {nbytes} bytes{where}; its catalog entry ({entry.tokens} tokens) "
               f"says {entry.nbytes}")


def segment_nbytes(layout: KVLayout, tokens: int) -> int:
    """Bytes of the object of a `tokens`-token segment under an export layout: the whole blocks it spans."""
    return -(-tokens // layout.block_size) * layout.byte_strides["B"]


def check_catalog(catalog: Catalog) -> None:
    """Every entry is what its tokens need under the catalog's layout, else SegmentCatalogError: it starts
    on a block boundary (offset = its first block's bytes), holds the whole blocks its tokens span, lies
    inside the layout and overlaps no other entry. A block-outermost order makes a segment contiguous."""
    layout = catalog.layout
    if layout.order[0] != "B":
        raise SegmentCatalogError(f"catalog layout order {layout.order} does not keep a block's layers together")
    bs, block_bytes = layout.block_size, layout.byte_strides["B"]
    end = 0
    for e in sorted(catalog.entries, key=lambda e: e.offset):
        what = f"catalog entry {e.key!r} ({e.tokens} tokens from slot {e.first_slot}, block size {bs})"
        if e.tokens < 1:
            raise SegmentCatalogError(f"{what} holds no tokens")
        if e.first_slot % bs or e.offset != layout.offset + e.first_slot // bs * block_bytes:
            raise SegmentCatalogError(f"{what} does not start on a block boundary at offset {e.offset}")
        if e.nbytes != segment_nbytes(layout, e.tokens):
            raise SegmentCatalogError(f"{what} says {e.nbytes} bytes; its blocks hold "
                                      f"{segment_nbytes(layout, e.tokens)}")
        if e.offset < end or e.offset + e.nbytes > layout.nbytes:
            raise SegmentCatalogError(f"{what} overlaps another entry or lies past the layout's "
                                      f"{layout.nbytes} bytes")
        end = e.offset + e.nbytes


