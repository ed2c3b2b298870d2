"""Deliberately bad objects for the connector's fallback checks, stored by a separate service client.

A record that vouches for a payload whose bytes differ in one bit ("corrupt"), or a record whose payload was
never stored ("missing"): the scheduler claims the block (its record matches the tokens), the worker must
catch the problem before the engine reads the block and report it (get_block_ids_with_load_errors).
"wrong" is the negative control: an intact payload of random finite K/V that its record vouches for — it is
loaded, and the engine's output changes (so an output equal to plain vLLM's means the right KV was used).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from kmesh.kv.keys import prefix_keys, record_key, token_digest
from kmesh.kv.layout import KVLayout
from kmesh.kv.link import ServiceLink
from kmesh.kv.record import KIND_PREFIX, RECORD_BYTES, Record
from kmesh.sources.digest import sha256_tensor
from kmesh.vllm.arrangement import record_layout, staging_layout


def store_bad_prefix(socket_path: str, engine_stats: dict[str, Any], prompt: Sequence[int],
                     blocks: dict[int, str], seed: int = 0) -> list[bytes]:
    """Store prefix block i of `prompt` as blocks[i] in {"corrupt", "missing", "wrong"}; returns the payload keys."""
    block_size = int(engine_stats["block_size"])
    layout = staging_layout(KVLayout.from_dict(engine_stats["layout"]), 1)
    keys = prefix_keys(engine_stats["namespace"].encode(), list(prompt), block_size, max(blocks) + 1)
    link = ServiceLink(socket_path, "kmesh-faults")
    if not link.connect():
        raise RuntimeError(f"no service at {socket_path}: {link.down_reason}")
    try:
        payload = link.window("payload", layout, alloc_id=1)
        records = link.window("records", record_layout(1), alloc_id=2)
        for i, kind in sorted(blocks.items()):
            gen = torch.Generator().manual_seed(seed + i)
            values = torch.randn(layout.nbytes // layout.element_size, generator=gen).to(layout.storage_dtype)
            payload.tensor.copy_(values.view(torch.uint8))   # finite K/V
            sha = bytes.fromhex(sha256_tensor(payload.tensor))
            if kind == "corrupt":
                payload.tensor[layout.nbytes // 3] ^= 0x01          # one bit: the record's digest no longer matches
            elif kind not in ("missing", "wrong"):
                raise ValueError(f"block kind must be 'corrupt', 'missing' or 'wrong', got {kind!r}")
            if kind != "missing":
                link.save(payload, keys[i], 0, layout.nbytes)
            start = i * block_size
            record = Record(KIND_PREFIX, block_size, start, layout.nbytes, sha,
                            token_digest(prompt[start:start + block_size]))
            records.tensor[:RECORD_BYTES].copy_(torch.frombuffer(bytearray(record.pack()), dtype=torch.uint8))
            link.save(records, record_key(keys[i]), 0, RECORD_BYTES)
    finally:
        link.close()
    return [keys[i] for i in sorted(blocks)]
