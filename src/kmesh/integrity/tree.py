"""The `sha256-tree` integrity format, and its plain-Python reference.

An object of n bytes is cut into chunks of `chunk_bytes` (recorded in the object header; a power of two,
64 B – 16 MiB): chunk i = bytes [i·chunk_bytes, (i+1)·chunk_bytes), the last chunk short — its real length
(1 … chunk_bytes bytes), never padded. An empty object (n = 0) is one empty chunk, so every object has at least
one leaf and its digest is SHA-256(0x00) (RFC 6962 would hash an empty list to SHA-256() instead).

    leaf i = SHA-256(0x00 ‖ chunk i)
    node   = SHA-256(0x01 ‖ left ‖ right)         (left, right: 32-byte digests)
    digest = T(leaf 0 … leaf m−1), RFC 6962 §2.1's split over the leaf digests:
             T(x) = x for one leaf;  T(l[0:m]) = node(T(l[0:k]), T(l[k:m])), k = the largest power of two < m.
             One leaf (n <= chunk_bytes) is its own digest: SHA-256(0x00 ‖ object).

The same tree, built level by level (what the CPU and CUDA implementations do): pair nodes from the left; an odd
last node of a level is carried up unchanged (never duplicated, unlike Bitcoin's tree, whose duplication lets two
different leaf lists share a root). The 0x00/0x01 prefixes keep a leaf from ever being read as a node.

This is a different digest from whole-object SHA-256 (the write-up's `sha256` format): an object file says which
one it carries, and readers verify with the one it names.
"""
from __future__ import annotations

import hashlib
from typing import Any

from kmesh.integrity.errors import IntegrityError

LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
MIN_CHUNK_BYTES = 64
MAX_CHUNK_BYTES = 1 << 24


def check_chunk_bytes(chunk_bytes: Any) -> int:
    """The header's chunk size as an int, or IntegrityError: a power of two in [64 B, 16 MiB]."""
    if chunk_bytes is None:
        raise IntegrityError("sha256-tree needs chunk_bytes (the object header carries it)")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise IntegrityError(f"sha256-tree chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
    if not (MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES) or chunk_bytes & (chunk_bytes - 1):
        raise IntegrityError(f"sha256-tree chunk_bytes must be a power of two in [{MIN_CHUNK_BYTES}, "
                             f"{MAX_CHUNK_BYTES}], got {chunk_bytes}")
    return chunk_bytes


def leaf_count(nbytes: int, chunk_bytes: int) -> int:
    """Leaves of an nbytes object: ceil(nbytes / chunk_bytes), and 1 for the empty object."""
    return max(1, -(-nbytes // chunk_bytes))


def leaf(chunk: Any) -> bytes:
    return hashlib.sha256(LEAF_PREFIX + bytes(chunk)).digest()


def node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def _mth(leaves: list[bytes]) -> bytes:
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)   # largest power of two < len(leaves)
    return node(_mth(leaves[:k]), _mth(leaves[k:]))


def reference(data: Any, chunk_bytes: int) -> bytes:
    """The format by its definition (RFC 6962's recursive split): slow, obviously right; tests compare with it."""
    chunk_bytes = check_chunk_bytes(chunk_bytes)
    buf = bytes(memoryview(data).cast("B"))
    leaves = [leaf(buf[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(leaf_count(len(buf), chunk_bytes))]
    return _mth(leaves)


def fold_levels(nodes: list[bytes]) -> bytes:
    """The root of a leaf level, level by level (odd last node carried up): the fast paths' tree walk."""
    if not nodes:
        raise ValueError("a tree has at least one leaf")
    while len(nodes) > 1:
        nxt = [node(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
        if len(nodes) % 2:
            nxt.append(nodes[-1])
        nodes = nxt
    return nodes[0]
