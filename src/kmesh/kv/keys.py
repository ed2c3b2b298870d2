"""Keys of saved KV in the cache service: token digests, namespaces, prefix and segment keys, record keys.

A namespace keeps one model's and one per-block KV geometry's objects apart. Two kinds of key:
  prefix   block i of a prompt, a chain hash over tokens [0, (i+1)·block_size): its KV is valid only after exactly
           those tokens, at positions i·block_size…;
  segment  a named span of a leader prompt, keyed by its tokens alone (position-free): a child that places the same
           tokens elsewhere gets them moved by kmesh.kv.restore and repaired (kmesh.kv.repair).
Each payload's record (kmesh.kv.record) is stored beside it under `record_key(key)`.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

KEY_ROOT = b"kmesh-vllm/"       # kept: objects saved by earlier connectors stay addressable under the same names


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def token_digest(tokens: Sequence[int]) -> bytes:
    """sha256 of the token ids (little-endian int64): what a record says its payload was computed from."""
    return hashlib.sha256(tokens_bytes(tokens)).digest()


def namespace(model: str, geometry: str) -> bytes:
    """Keys of one model and one per-block KV geometry never mix with another's (short, key-safe)."""
    return hashlib.sha256(f"{model}\0{geometry}".encode()).hexdigest()[:16].encode()


def prefix_keys(ns: bytes, tokens: Sequence[int], block_size: int, blocks: int) -> list[bytes]:
    """Chain keys of the first `blocks` full blocks: key i names tokens [0, (i+1)·block_size)."""
    out, h = [], hashlib.sha256(ns)
    for i in range(blocks):
        h.update(tokens_bytes(tokens[i * block_size:(i + 1) * block_size]))
        out.append(KEY_ROOT + ns + b"/p/" + h.copy().hexdigest()[:40].encode())
    return out


def segment_key(ns: bytes, tokens: Sequence[int]) -> bytes:
    return KEY_ROOT + ns + b"/s/" + hashlib.sha256(b"segment\0" + tokens_bytes(tokens)).hexdigest()[:40].encode()


def is_segment_key(key: bytes) -> bool:
    return key.startswith(KEY_ROOT) and key.split(b"/")[2:3] == [b"s"]


def record_key(key: bytes) -> bytes:
    return key + b"/rec"
