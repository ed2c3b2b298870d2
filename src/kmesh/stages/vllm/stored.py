"""The segments the engine stored, read back from the cache service by the stage (not through the engine).

The interior case's reference repairs a child from exactly the K/V the connector loads: the leader's segments
as the kmesh engine saved them (payload + record, kmesh.vllm.objects), fetched here over a link of the
stage's own, size and sha256 checked against the record as the connector checks them, and placed where the
child has them (kmesh.vllm.repair.placed_segment, the connector's own placement).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from kmesh.errors import KMeshError
from kmesh.layout import KVLayout
from kmesh.sources.digest import sha256_tensor
from kmesh.vllm.arrangement import record_layout, staging_layout
from kmesh.vllm.link import ServiceLink
from kmesh.vllm.objects import KIND_SEGMENT, RECORD_BYTES, Record, record_key, segment_key
from kmesh.vllm.repair import Placed, placed_segment


class StoredSegmentError(KMeshError):
    """A segment the engine should have stored is missing, or its payload does not match its record."""


def stored_segments(socket_path: str, engine_stats: dict[str, Any], prompt: Sequence[int],
                    spans: Sequence[Sequence[int]], span_end: int) -> list[Placed]:
    """The stored K/V of the segments at `spans` of `prompt`, placed for a repair of prompt[0:span_end]."""
    engine_layout = KVLayout.from_dict(engine_stats["layout"])
    block_size = int(engine_stats["block_size"])
    ns = engine_stats["namespace"].encode()
    blocks = max(math.ceil((b - a) / block_size) for a, b in spans)
    link = ServiceLink(socket_path, "kmesh-vllm-stage-refs")
    if not link.connect():
        raise StoredSegmentError(f"no service at {socket_path}: {link.down_reason}")
    placed: list[Placed] = []
    try:
        payload = link.window("payload", staging_layout(engine_layout, blocks), alloc_id=1)
        records = link.window("records", record_layout(1), alloc_id=2)
        for a, b in spans:
            key = segment_key(ns, list(prompt[a:b]))
            records.tensor[:RECORD_BYTES].zero_()
            n = link.load(records, record_key(key), 0)
            rec = Record.unpack(bytes(records.tensor[:n].numpy()))
            if not rec.matches(KIND_SEGMENT, list(prompt[a:b]), None):
                raise StoredSegmentError(f"the record of segment [{a}, {b}) vouches for other tokens")
            payload.tensor.fill_(0xA5)        # poison: a load that wrote nothing fails the digest
            got = link.load(payload, key, 0)
            region = payload.tensor[:got]
            if got != rec.nbytes or bytes.fromhex(sha256_tensor(region)) != rec.sha256:
                raise StoredSegmentError(f"segment [{a}, {b}): {got} bytes loaded, the record says {rec.nbytes} "
                                         f"(or the sha256 differs)")
            seg = placed_segment(payload, rec, a, span_end)       # a copy (capture): the window is reused
            if seg is not None:
                placed.append(seg)
    finally:
        link.close()
    return placed
