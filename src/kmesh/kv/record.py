"""The record that vouches for a saved payload: one format, versioned, for every caller and tier.

A record is 256 bytes, saved under kmesh.kv.keys.record_key(key) AFTER its payload: its presence is the commit marker
a lookup reads (256 bytes, not the payload's megabytes). It says what the payload is (prefix block or segment), how
many tokens it holds and at which position they were computed, its size, the digest algorithm and digest that must
match on arrival (kmesh.kv.digests), and the digest of its token ids. Version 2 added the digest algorithm; a record of
another magic or version is refused (RecordError), and the caller treats its payload as absent.

    magic "KMVR" | version u16 | kind u8 | algorithm u8 | tokens u32 | start i64 | nbytes u64 | digest 32 B |
    token digest 32 B | zero padding to 256 B                                                    (little endian)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

from kmesh.errors import KMeshError
from kmesh.kv.keys import token_digest

MAGIC = b"KMVR"
VERSION = 2
KIND_PREFIX, KIND_SEGMENT = 1, 2
ALGORITHMS = {1: "sha256", 2: "blake3"}           # code -> kmesh.kv.digests algorithm (both 32-byte digests)
_CODES = {name: code for code, name in ALGORITHMS.items()}
_REC = struct.Struct("<4sHBBIqQ32s32s")
RECORD_BYTES = 256


class RecordError(KMeshError):
    """A stored record is not one KMesh wrote (bad magic, version, kind or algorithm) or does not fit its bytes."""


@dataclass(frozen=True)
class Record:
    kind: int
    tokens: int            # tokens in the payload
    start: int             # position of its first token when it was saved
    nbytes: int            # payload bytes
    digest: bytes          # of the payload bytes, by `algorithm`
    token_digest: bytes    # of its token ids
    algorithm: str = "sha256"

    def __post_init__(self) -> None:
        if self.kind not in (KIND_PREFIX, KIND_SEGMENT):
            raise RecordError(f"unknown record kind {self.kind}")
        if self.algorithm not in _CODES:
            raise RecordError(f"digest algorithm {self.algorithm!r} is not one of {sorted(_CODES)}")
        if len(self.digest) != 32 or len(self.token_digest) != 32:
            raise RecordError("a record's digests are 32 bytes each")
        if self.tokens < 1 or self.nbytes < 1 or self.start < 0:
            raise RecordError(f"record of {self.tokens} tokens, {self.nbytes} bytes from position {self.start}")

    @property
    def digest_hex(self) -> str:
        return self.digest.hex()

    def pack(self) -> bytes:
        body = _REC.pack(MAGIC, VERSION, self.kind, _CODES[self.algorithm], self.tokens, self.start, self.nbytes,
                         self.digest, self.token_digest)
        return body + bytes(RECORD_BYTES - len(body))

    @classmethod
    def unpack(cls, raw: bytes) -> "Record":
        if len(raw) < _REC.size:
            raise RecordError(f"record of {len(raw)} bytes, expected {RECORD_BYTES}")
        magic, version, kind, code, tokens, start, nbytes, digest, tdig = _REC.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise RecordError(f"not a KMesh record of version {VERSION} (magic {magic!r}, version {version})")
        if code not in ALGORITHMS:
            raise RecordError(f"unknown digest algorithm code {code}")
        return cls(kind, tokens, start, nbytes, digest, tdig, ALGORITHMS[code])

    def matches(self, kind: int, tokens: Sequence[int], start: int | None) -> bool:
        """Does this record vouch for exactly these tokens (and, for a prefix block, this position)?"""
        return (self.kind == kind and self.tokens == len(tokens) and self.token_digest == token_digest(tokens)
                and (start is None or self.start == start))
