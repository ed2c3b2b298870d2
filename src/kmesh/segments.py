"""Shared segments: what a leader saves, how a child gets a private copy back, and the checks in between.

    export = export_segments(runner, leader_cache, workload)     # BLNHC buffer: each segment whole blocks
    src = InProcessSegments(export)                              # or ServiceSegments(svc, staging, ...)
    staged = stage_segments(src, staging, export.catalog)        # loads + size/digest checks, per segment
    private = copy_private(engine, staging, owner)               # TransferEngine copy, drained before use
    restore_child(child_cache, export.catalog, private, child, rope)   # kmesh.restore with the RoPE shift

The export buffer uses a cross-layer order (BLNHC: all layers of a block together), so one segment is one
contiguous byte range: one saved object per segment, whatever the layer count. The leader records each
object's size and sha256 in a Catalog; a child trusts staged bytes only after both match, before a
single byte reaches its model state. Every failure is a SegmentLoadError subclass the caller turns into a
full recompute — never a partial restore.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from kmesh.errors import KMeshError
from kmesh.layout import KVLayout
from kmesh.model.runner import KVCache, LayerRunner
from kmesh.restore import capture, restore
from kmesh.sources.digest import sha256_tensor
from kmesh.transfer.engine import TransferEngine
from kmesh.workload import Child, Workload

EXPORT_ORDER = "BLNHC"


class SegmentLoadError(KMeshError):
    """A shared segment could not be brought back intact; the child must recompute instead."""


class SegmentMissingError(SegmentLoadError):
    """The object is not in the store (never saved, or evicted)."""


class SegmentCorruptError(SegmentLoadError):
    """The loaded bytes do not have the digest the leader recorded."""


class SegmentTruncatedError(SegmentLoadError):
    """The object is not as large as the leader's segment."""


class SegmentLayoutError(SegmentLoadError):
    """The object was saved under another KV geometry than the child's staging buffer."""


class SegmentSourceLostError(SegmentLoadError):
    """The source (the cache service) went away during the load."""


class SegmentCancelledError(SegmentLoadError):
    """The load was cancelled before it completed."""


@dataclass(frozen=True)
class CatalogEntry:
    index: int
    key: bytes
    offset: int            # bytes into the export buffer (and into a child's staging buffer)
    nbytes: int
    sha256: str
    leader_start: int      # position of the segment's first token in the leader prompt
    tokens: int
    first_slot: int        # slot of its first token in the export layout

    def slots(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.arange(self.first_slot, self.first_slot + self.tokens, device=device)

    def leader_positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.arange(self.leader_start, self.leader_start + self.tokens, device=device)


@dataclass(frozen=True)
class Catalog:
    layout: KVLayout
    entries: tuple[CatalogEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def describe(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "entries": [
            {"key": e.key.decode(errors="replace"), "offset": e.offset, "nbytes": e.nbytes, "sha256": e.sha256,
             "leader_start": e.leader_start, "tokens": e.tokens} for e in self.entries]}


@dataclass
class Export:
    raw: torch.Tensor      # uint8, catalog.layout
    catalog: Catalog


def export_layout(runner: LayerRunner, workload: Workload) -> KVLayout:
    bs = workload.spec.block_size
    blocks = sum(s.tokens for s in workload.segments) // bs
    return KVLayout.paged(EXPORT_ORDER, runner.num_layers, blocks, bs, runner.num_kv_heads, runner.head_dim,
                          runner.dtype_name)


def export_segments(runner: LayerRunner, leader_cache: KVCache, workload: Workload, key_prefix: bytes) -> Export:
    """Copy each segment's K/V (all layers) out of the leader's cache into whole blocks of an export buffer."""
    layout = export_layout(runner, workload)
    raw = torch.zeros(layout.nbytes, dtype=torch.uint8, device=runner.device)
    block_bytes = layout.byte_strides["B"]
    entries, slot = [], 0
    for i, seg in enumerate(workload.segments):
        pos = torch.arange(seg.leader_start, seg.leader_start + seg.tokens, device=runner.device)
        saved = capture(leader_cache.raw, leader_cache.layout, pos, pos)    # leader slot = position
        dst = torch.arange(slot, slot + seg.tokens, device=runner.device)
        restore(raw, layout, saved, dst, pos, runner.rope)                  # same positions: a byte copy
        offset, nbytes = (slot // layout.block_size) * block_bytes, (seg.tokens // layout.block_size) * block_bytes
        entries.append(CatalogEntry(i, key_prefix + f"/segment-{i}".encode(), offset, nbytes,
                                    sha256_tensor(raw[offset:offset + nbytes]), seg.leader_start, seg.tokens, slot))
        slot += seg.tokens
    return Export(raw, Catalog(layout, tuple(entries)))


class SegmentSource(Protocol):
    """Where a child's segment bytes come from: load one catalog entry into staging[offset:offset+nbytes]."""

    name: str

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        """Copy the entry's object into staging at entry.offset; returns the bytes copied."""


class InProcessSegments:
    """The leader's saved objects held inside the model process (the in-process reference path)."""

    name = "in-process"

    def __init__(self, export: Export, objects: dict[bytes, torch.Tensor] | None = None) -> None:
        self.objects = objects if objects is not None else {
            e.key: export.raw[e.offset:e.offset + e.nbytes].clone() for e in export.catalog.entries}

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        obj = self.objects.get(entry.key)
        if obj is None:
            raise SegmentMissingError(f"no saved object {entry.key!r}")
        n = obj.numel()
        if entry.offset + n > staging.numel():
            raise SegmentTruncatedError(f"object {entry.key!r} of {n} bytes overruns the staging buffer")
        staging[entry.offset:entry.offset + n].copy_(obj)
        return n


class ServiceSegments:
    """Objects loaded through the cache service into a registered staging buffer (memfd or CUDA IPC).

    `after_accept(req, nbytes)` runs once the service accepted a copy (a paced service needs its tokens then).
    """

    name = "service"

    def __init__(self, svc: Any, reg: Any, after_accept: Callable[[int, int], None] | None = None,
                 timeout_s: float = 60.0) -> None:
        self.svc, self.reg, self.after_accept, self.timeout_s = svc, reg, after_accept, timeout_s
        self.requests: list[int] = []

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        from kmesh.service import errors as se

        try:
            req = self.svc.load(self.reg, entry.key, entry.offset)
        except se.ObjectMissingError as e:
            raise SegmentMissingError(str(e)) from e
        except se.LayoutMismatchError as e:
            raise SegmentLayoutError(str(e)) from e
        except (se.ConnectionLostError, OSError) as e:
            raise SegmentSourceLostError(f"cache service lost: {e}") from e
        self.requests.append(req)
        try:
            if self.after_accept is not None:
                # the size the service accepted (the object's), not the catalog's: a paced service needs its
                # exact chunk count, or a short object would leave spare tokens in the gate
                self.after_accept(req, int(self.svc.poll(req)["nbytes"]))
            r = self.svc.wait(req, timeout=self.timeout_s)
        except (se.ConnectionLostError, OSError) as e:
            raise SegmentSourceLostError(f"cache service lost during load of {entry.key!r}: {e}") from e
        if r["state"] == "cancelled":
            raise SegmentCancelledError(f"load of {entry.key!r} was cancelled")
        if r["state"] != "done":
            raise SegmentLoadError(f"load of {entry.key!r} ended {r['state']}: {r.get('error')}")
        return int(r["nbytes"])


def stage_segments(source: SegmentSource, staging: torch.Tensor, catalog: Catalog,
                   on_staged: Callable[[CatalogEntry], None] | None = None) -> None:
    """Load every catalog entry into staging and check its size and digest (poisoned first, so a copy that
    silently wrote nothing cannot pass)."""
    staging.fill_(0xA5)
    for e in catalog.entries:
        n = source.load(e, staging)
        if n != e.nbytes:
            raise SegmentTruncatedError(f"object {e.key!r} has {n} bytes, the leader saved {e.nbytes}")
        got = sha256_tensor(staging[e.offset:e.offset + e.nbytes])
        if got != e.sha256:
            raise SegmentCorruptError(f"object {e.key!r}: sha256 {got[:16]}… differs from the leader's "
                                      f"{e.sha256[:16]}…")
        if on_staged is not None:
            on_staged(e)


def copy_private(engine: TransferEngine, staging: torch.Tensor, private: torch.Tensor, owner: str) -> None:
    """The child's private copy of the staged segments, through the transfer engine; returns once drained.

    A SubmitError after the copy was accepted is re-raised only after its pending ticket drained, so the
    caller may reuse `private` (or recompute into its model state) the moment it sees the error.
    """
    from kmesh.transfer.errors import SubmitError

    try:
        engine.submit(staging, private, owner=owner)
    except SubmitError as e:
        engine.drain(e.pending)
        raise
    engine.drain(owner=owner)


def restore_child(cache: KVCache, catalog: Catalog, private: torch.Tensor, child: Child, runner: LayerRunner,
                  backend: str = "torch") -> torch.Tensor:
    """Restore every segment of the child from the private copy into its cache at the child's positions
    (keys rotated by the position change). Returns the bool [T] mask of restored positions."""
    T = len(child.ids)
    restored = torch.zeros(T, dtype=torch.bool)
    dev = cache.raw.device
    slices = child.segment_slices()
    if not slices:
        return restored
    # All segments in one capture + one restore: one validation and one kernel launch per child.
    src = torch.cat([catalog.entries[seg].slots(dev) for seg, _, _ in slices])
    old = torch.cat([catalog.entries[seg].leader_positions(dev) for seg, _, _ in slices])
    new = torch.cat([torch.arange(a, b, device=dev) for _, a, b in slices])
    saved = capture(private, catalog.layout, src, old)
    restore(cache.raw, cache.layout, saved, new, new, runner.rope, backend=backend)  # child slot = position
    for _, a, b in slices:
        restored[a:b] = True
    return restored
