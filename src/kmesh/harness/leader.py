"""The leader's side of the write-up's workload: its saved segments exported into one buffer with a catalog.

    # BLNHC buffer: each segment from a block start
    export = export_segments(runner, leader_cache, workload, key_prefix)

Each segment's K/V (all layers) is copied out of the leader's cache into an export buffer in a block-outermost order
(kmesh.kv.catalog), so one segment is one contiguous object; every entry records the object's sha256 (what the cache
service commits) and its arrival digest (kmesh.kv.digests), what children check on arrival.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kmesh.harness.workload import Workload
from kmesh.kv.catalog import Catalog, CatalogEntry, check_catalog, segment_nbytes
from kmesh.kv.digests import ARRIVAL_DIGESTS, arrival_digest
from kmesh.kv.errors import SegmentExportError
from kmesh.kv.layout import KVLayout
from kmesh.kv.restore import capture, restore
from kmesh.model.runner import KVCache, LayerRunner
from kmesh.sources.digest import sha256_tensor

EXPORT_ORDER = "BLNHC"


@dataclass
class Export:
    raw: torch.Tensor      # uint8, catalog.layout
    catalog: Catalog


def export_layout(runner: LayerRunner, workload: Workload) -> KVLayout:
    bs = workload.spec.block_size
    blocks = sum(-(-s.tokens // bs) for s in workload.segments)     # each segment from a block start
    return KVLayout.paged(EXPORT_ORDER, runner.num_layers, blocks, bs, runner.num_kv_heads, runner.head_dim,
                          runner.dtype_name)


def export_segments(runner: LayerRunner, leader_cache: KVCache, workload: Workload, key_prefix: bytes,
                    arrival: str = "sha256") -> Export:
    """Copy each segment's K/V (all layers) out of the leader's cache into an export buffer, each segment from
    a block start over the whole blocks it spans (a partial last block's other slots stay zero). Every entry
    records the object's sha256 and its `arrival` digest (ARRIVAL_DIGESTS), what children check on arrival."""
    empty = [i for i, seg in enumerate(workload.segments) if seg.tokens < 1]
    if empty:
        raise SegmentExportError(f"segments {empty} hold no tokens; a segment needs at least one")
    if arrival not in ARRIVAL_DIGESTS:
        raise SegmentExportError(f"arrival digest must be one of {ARRIVAL_DIGESTS}, got {arrival!r}")
    layout = export_layout(runner, workload)
    raw = torch.zeros(layout.nbytes, dtype=torch.uint8, device=runner.device)
    block_bytes, bs = layout.byte_strides["B"], layout.block_size
    entries, block = [], 0
    for i, seg in enumerate(workload.segments):
        slot = block * bs
        pos = torch.arange(seg.leader_start, seg.leader_start + seg.tokens, device=runner.device)
        saved = capture(leader_cache.raw, leader_cache.layout, pos, pos)    # leader slot = position
        dst = torch.arange(slot, slot + seg.tokens, device=runner.device)
        restore(raw, layout, saved, dst, pos, runner.rope)                  # same positions: a byte copy
        offset, nbytes = block * block_bytes, segment_nbytes(layout, seg.tokens)
        obj = raw[offset:offset + nbytes]
        sha = sha256_tensor(obj)
        entries.append(CatalogEntry(i, key_prefix + f"/segment-{i}".encode(), offset, nbytes, sha,
                                    seg.leader_start, seg.tokens, slot,
                                    (arrival, "" if arrival == "sha256" else arrival_digest(arrival, obj))))
        block += nbytes // block_bytes
    catalog = Catalog(layout, tuple(entries))
    check_catalog(catalog)
    return Export(raw, catalog)


