"""What the connector stores in the cache service: object keys and the small record that vouches for each payload.

Two kinds of saved KV, both "payloads" of whole staging blocks (kmesh.vllm.arrangement.staging_layout):
  prefix   block i of a prompt, keyed by a chain hash over tokens [0, (i+1)·block_size): its KV is valid only
           after exactly those tokens, at positions i·block_size…;
  segment  a named span of a leader prompt, keyed by its tokens alone (position-free): a child that places the
           same tokens elsewhere gets them moved by kmesh.restore and repaired (kmesh.model.blend).
Each payload has a record beside it (key + "/rec"), saved AFTER the payload: the record's presence is the
commit marker the scheduler looks up (a 256-byte load, not the payload's megabytes), and it carries the
payload's sha256, size, token digest and original position, checked before a single byte reaches the engine.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from kmesh.errors import KMeshError

MAGIC = b"KMVR"
VERSION = 1
KIND_PREFIX, KIND_SEGMENT = 1, 2
_REC = struct.Struct("<4sHBxIqQ32s32s")    # magic, version, kind, tokens, start position, payload bytes, 2 digests
RECORD_BYTES = 256                         # one record cell (kmesh.vllm.arrangement.RECORD_LAYOUT)


class RecordError(KMeshError):
    """A stored record is not one this connector wrote (bad magic/version) or does not match its key."""


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def token_digest(tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(_tokens_bytes(tokens)).digest()


def namespace(model: str, geometry: str) -> bytes:
    """Keys of one model and one per-block KV geometry never mix with another's (short, key-safe)."""
    return hashlib.sha256(f"{model}\0{geometry}".encode()).hexdigest()[:16].encode()


def prefix_keys(ns: bytes, tokens: Sequence[int], block_size: int, blocks: int) -> list[bytes]:
    """Chain keys of the first `blocks` full blocks: key i names tokens [0, (i+1)·block_size)."""
    out, h = [], hashlib.sha256(ns)
    for i in range(blocks):
        h.update(_tokens_bytes(tokens[i * block_size:(i + 1) * block_size]))
        out.append(b"kmesh-vllm/" + ns + b"/p/" + h.copy().hexdigest()[:40].encode())
    return out


def segment_key(ns: bytes, tokens: Sequence[int]) -> bytes:
    return b"kmesh-vllm/" + ns + b"/s/" + hashlib.sha256(b"segment\0" + _tokens_bytes(tokens)).hexdigest()[:40].encode()


def record_key(key: bytes) -> bytes:
    return key + b"/rec"


@dataclass(frozen=True)
class Record:
    kind: int
    tokens: int            # tokens in the payload
    start: int             # position of its first token when it was saved
    nbytes: int            # payload bytes
    sha256: bytes          # of the payload bytes
    token_digest: bytes    # of its token ids

    def pack(self) -> bytes:
        body = _REC.pack(MAGIC, VERSION, self.kind, self.tokens, self.start, self.nbytes, self.sha256,
                         self.token_digest)
        return body + bytes(RECORD_BYTES - len(body))

    @classmethod
    def unpack(cls, raw: bytes) -> "Record":
        if len(raw) < _REC.size:
            raise RecordError(f"record of {len(raw)} bytes, expected {RECORD_BYTES}")
        magic, version, kind, tokens, start, nbytes, sha, tdig = _REC.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise RecordError(f"not a kmesh-vllm record (magic {magic!r}, version {version})")
        if kind not in (KIND_PREFIX, KIND_SEGMENT):
            raise RecordError(f"unknown record kind {kind}")
        return cls(kind, tokens, start, nbytes, sha, tdig)

    def matches(self, kind: int, tokens: Sequence[int], start: int | None) -> bool:
        """Does this record vouch for exactly these tokens (and, for a prefix block, this position)?"""
        return (self.kind == kind and self.tokens == len(tokens) and self.token_digest == token_digest(tokens)
                and (start is None or self.start == start))


def parse_spans(raw: Any, length: int) -> list[tuple[int, int]] | None:
    """Request-supplied segment spans [[start, end], ...]: sorted, disjoint, inside the prompt; None if malformed."""
    if not isinstance(raw, (list, tuple)):
        return None
    out: list[tuple[int, int]] = []
    for s in raw:
        if (not isinstance(s, (list, tuple)) or len(s) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in s)):
            return None
        a, b = s
        if not 0 <= a < b <= length or (out and a < out[-1][1]):
            return None
        out.append((a, b))
    return out
