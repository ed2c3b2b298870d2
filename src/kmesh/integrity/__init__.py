"""Integrity algorithms for stored objects: one registry every reader and writer goes through.

Object files record the algorithm by name (DESIGN.md §2 `storage`); a reader looks the name up here and refuses
an unknown one with `UnknownAlgorithmError`. CPU implementations live here and in kmesh.integrity.cpu; GPU kernels
(kernels/sha256*.cu, kernels/blake3.cu, driven by kmesh.integrity.gpu) must produce exactly the digest the CPU
implementation of the same name produces.

    sha256       whole-object SHA-256 (the write-up's format)
    sha256-tree  chunked SHA-256 tree, RFC 6962-style prefixes; param chunk_bytes (kmesh.integrity.tree)
    blake3       the standard BLAKE3 digest of the whole object (32 bytes), as the `blake3` package computes it

    algo = get("sha256")
    d = algo.digest(memoryview(buf))           # bytes
    verify("sha256", buf, expected)            # raises DigestMismatchError
    get("sha256-tree").digest(buf, chunk_bytes=65536)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from kmesh.integrity.errors import DigestMismatchError, IntegrityError, UnknownAlgorithmError  # noqa: F401


@dataclass(frozen=True)
class Algorithm:
    """A named whole-object digest. `params` are what the object header must carry to recompute it."""

    name: str
    digest_size: int
    compute: Callable[..., bytes] = field(repr=False)
    params: tuple[str, ...] = ()

    def digest(self, data: Any, **params: Any) -> bytes:
        unknown = set(params) - set(self.params)
        if unknown:
            raise IntegrityError(f"{self.name} takes no parameter(s) {sorted(unknown)}")
        return self.compute(memoryview(data).cast("B"), **params)


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


_REGISTRY: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    if algo.name in _REGISTRY:
        raise IntegrityError(f"integrity algorithm {algo.name!r} registered twice")
    _REGISTRY[algo.name] = algo
    return algo


def get(name: str) -> Algorithm:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownAlgorithmError(
            f"unknown integrity algorithm {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def names() -> list[str]:
    return sorted(_REGISTRY)


def verify(name: str, data: Any, expected: bytes, what: str = "object", **params: Any) -> None:
    actual = get(name).digest(data, **params)
    if actual != expected:
        raise DigestMismatchError(name, expected, actual, what)


register(Algorithm("sha256", 32, _sha256))

# Late: the registry above must exist before the CPU implementations register into it.
from kmesh.integrity import cpu as _cpu  # noqa: E402


def _sha256_tree(data: memoryview, chunk_bytes: int | None = None) -> bytes:
    return _cpu.sha256_tree(data, chunk_bytes)


def _blake3(data: memoryview) -> bytes:
    return _cpu.blake3(data)


register(Algorithm("sha256-tree", 32, _sha256_tree, params=("chunk_bytes",)))
register(Algorithm("blake3", 32, _blake3))
