"""The digests a saved segment is checked with on arrival, computed where its bytes lie.

`sha256` is the object's commit digest (what the cache service records and the connector's record carries);
`blake3` runs on the GPU for a CUDA staging buffer (kmesh.integrity.gpu computes the blake3 package's digest), so a
device-staged segment is checked without copying it back. `first_corrupt` checks a batch of staged segments with one
call per algorithm (one launch set on the GPU) and names the first that differs.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kmesh.kv.errors import SegmentCorruptError, SegmentExportError
from kmesh.sources.digest import sha256_tensor


class Vouched(Protocol):
    """What a digest check needs of a staged segment (kmesh.kv.catalog.CatalogEntry)."""

    key: bytes
    offset: int
    nbytes: int

    @property
    def arrival_algorithm(self) -> str: ...

    @property
    def arrival_hex(self) -> str: ...


ARRIVAL_DIGESTS = ("sha256", "blake3")


def arrival_digest(algorithm: str, t: torch.Tensor) -> str:
    """Hex digest of a byte tensor's contents by a named kmesh.integrity algorithm, where the bytes lie: sha256 on
    the host (a device tensor is copied back), blake3 on the GPU for a CUDA tensor (kmesh.integrity.gpu, the same
    digest as the blake3 package's) and on the host otherwise."""
    if algorithm == "sha256":
        return sha256_tensor(t)
    if algorithm == "blake3":
        t = t.detach().contiguous()
        if t.is_cuda:
            from kmesh.integrity.gpu import hash_buffer

            return hash_buffer("blake3", t).hex()
        from kmesh import integrity

        return integrity.get("blake3").digest(t.numpy()).hex()
    raise SegmentExportError(f"arrival digest must be one of {ARRIVAL_DIGESTS}, got {algorithm!r}")



def arrival_digests(algorithm: str, views: Sequence[torch.Tensor]) -> list[str]:
    """arrival_digest of every view: blake3 of CUDA views in one kmesh.integrity.gpu call (one launch set for all,
    where one call per view cost a RAG child ~0.1 ms a segment on the H200), each view alone otherwise."""
    if algorithm == "blake3" and views and all(v.is_cuda for v in views):
        from kmesh.integrity.gpu import hash_buffers

        return [d.hex() for d in hash_buffers("blake3", [v.detach().contiguous() for v in views])]
    return [arrival_digest(algorithm, v) for v in views]



def first_corrupt(staging: torch.Tensor, entries: Sequence[Vouched]) -> tuple[int, SegmentCorruptError] | None:
    """Every entry's arrival digest over its span of staging, one arrival_digests call per algorithm; the position
    in `entries` and the error of the first whose digest differs from the leader's, or None when all agree."""
    got: dict[int, str] = {}
    by_algorithm: dict[str, list[int]] = {}
    for i, entry in enumerate(entries):
        by_algorithm.setdefault(entry.arrival_algorithm, []).append(i)
    for algorithm, where in by_algorithm.items():
        views = [staging[entries[i].offset:entries[i].offset + entries[i].nbytes] for i in where]
        got.update(zip(where, arrival_digests(algorithm, views)))
    for i, entry in enumerate(entries):
        want = entry.arrival_hex
        if got[i] != want:
            return i, SegmentCorruptError(f"object {entry.key!r}: {entry.arrival_algorithm} {got[i][:16]}… differs "
                                          f"from the leader's {want[:16]}…")
    return None


