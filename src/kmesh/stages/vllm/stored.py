"""The segments the engine stored, read back from the cache service by the stage (not through the engine).

The interior case's reference repairs a child from exactly the K/V the connector loads: the leader's segments
as the kmesh engine saved them (payload + record, kmesh.kv.record), read here over a link of the stage's own with
the connector's own load functions (kmesh.vllm.loads: records read, payloads loaded, verified against their records
and restored at the child's positions by kmesh.kv's load step) into a span the repair reads.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from kmesh.errors import KMeshError
from kmesh.kv.keys import segment_key
from kmesh.kv.layout import KVLayout
from kmesh.kv.link import ServiceLink
from kmesh.kv.record import KIND_SEGMENT
from kmesh.kv.rope import RopeConfig
from kmesh.vllm.arrangement import record_layout, staging_layout
from kmesh.vllm.loads import Span, load_span, read_record
from kmesh.vllm.plans import Item


class StoredSegmentError(KMeshError):
    """A segment the engine should have stored is missing, or its payload does not match its record."""


def stored_segments(socket_path: str, engine_stats: dict[str, Any], prompt: Sequence[int],
                    spans: Sequence[Sequence[int]], span_end: int, rope: RopeConfig) -> Span:
    """The stored K/V of the segments at `spans` of `prompt`, restored for a repair of prompt[0:span_end]."""
    engine_layout = KVLayout.from_dict(engine_stats["layout"])
    block_size = int(engine_stats["block_size"])
    ns = engine_stats["namespace"].encode()
    blocks = sum(math.ceil((b - a) / block_size) for a, b in spans)
    link = ServiceLink(socket_path, "kmesh-vllm-stage-refs")
    if not link.connect():
        raise StoredSegmentError(f"no service at {socket_path}: {link.down_reason}")
    try:
        payload = link.window("payload", staging_layout(engine_layout, blocks), alloc_id=1)
        records = link.window("records", record_layout(1), alloc_id=2)
        items = []
        for a, b in spans:
            toks = tuple(prompt[a:b])
            key = segment_key(ns, toks)
            rec = read_record(link, records, key)
            if rec is None or not rec.matches(KIND_SEGMENT, toks, None):
                raise StoredSegmentError(f"segment [{a}, {b}): no record vouches for its tokens")
            items.append(Item(key, rec, a, toks))
        span = load_span(link, payload, items, span_end, engine_layout, rope)
        if span.missing:
            raise StoredSegmentError(f"segments at {span.missing} were not loaded intact (size or digest differs "
                                     f"from their records, or missing)")
    finally:
        link.close()
    return span
