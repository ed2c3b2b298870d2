"""The load step of a saved segment, one implementation for every caller: load -> verify -> private copy -> restore.

    step = LoadStep(source, staging, catalog, dest, placements, private=private, engine=engine, owner=owner)
    outcome = step.run()        # LoadOutcome: the entries restored, and the failure that stopped it (or None)

`source` (kmesh.kv.sources) loads each catalog entry into its span of `staging` in catalog order, the size checked
on arrival; then every loaded entry's digest is checked in one call (kmesh.kv.digests); the verified entries are
copied into `private` through the transfer engine (one batch, one drain) and restored into the destination at the
placements' positions, keys rotated from their saved positions (kmesh.kv.restore; the gather kernel on CUDA where
the layout allows). A failure at entry k (load, digest or copy) still restores exactly the entries before it, then
reports the failure: the caller recomputes what was not restored, and never reuses part of a segment. Without a
private buffer (the vLLM connector's host windows, which the service does not write once a load has ended) the
restore reads the staging buffer itself.

The harness's children (kmesh.harness.child) and the vLLM connector (kmesh.vllm.loads) both run this step; the
equivalence stage's `one-path` cases hold the two roads to the same destination bytes and the same refusals.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from kmesh.kv.catalog import Catalog, CatalogEntry, check_catalog, size_error
from kmesh.kv.digests import first_corrupt
from kmesh.kv.errors import PrivateCopyError, SegmentLayoutError, SegmentLoadError
from kmesh.kv.gather import gather_supported, plan_gather
from kmesh.kv.layout import KVLayout
from kmesh.kv.restore import capture, restore
from kmesh.kv.rope import RopeConfig
from kmesh.kv.sources import SegmentSource
from kmesh.transfer.engine import TransferEngine
from kmesh.transfer.errors import TransferError

PartTimer = Callable[[str], ContextManager[Any]]   # kmesh.bench.Intervals.part, or untimed


def untimed(_name: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


def prepare_staging(staging: torch.Tensor, catalog: Catalog) -> None:
    """Check the catalog against its layout (check_catalog) and the staging buffer against the catalog, then
    poison staging, so a copy that silently wrote nothing cannot pass the checks of stage_entry."""
    check_catalog(catalog)
    if staging.dtype != torch.uint8 or staging.numel() < catalog.nbytes:
        raise SegmentLayoutError(f"staging buffer of {staging.numel()} {staging.dtype} elements cannot hold the "
                                 f"catalog's {catalog.nbytes} bytes")
    staging.fill_(0xA5)



def load_entry(source: SegmentSource, staging: torch.Tensor, entry: CatalogEntry) -> None:
    """Load one entry into its span of staging and check its size (its digest: first_corrupt)."""
    n = source.load(entry, staging)
    if n != entry.nbytes:          # a source that does not check sizes itself
        raise size_error(entry, n)



def stage_entry(source: SegmentSource, staging: torch.Tensor, entry: CatalogEntry) -> None:
    """Load one entry into its span of staging and check its size and digest on arrival."""
    load_entry(source, staging, entry)
    corrupt = first_corrupt(staging, [entry])
    if corrupt is not None:
        raise corrupt[1]


def stage_segments(source: SegmentSource, staging: torch.Tensor, catalog: Catalog,
                   on_staged: Callable[[CatalogEntry], None] | None = None) -> None:
    """prepare_staging, then every entry staged and checked (stage_entry), in catalog order."""
    prepare_staging(staging, catalog)
    for entry in catalog.entries:
        stage_entry(source, staging, entry)
        if on_staged is not None:
            on_staged(entry)


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


def copy_private_each(engine: TransferEngine, staging: torch.Tensor, private: torch.Tensor,
                      entries: Sequence[CatalogEntry], owner: str) -> list[CatalogEntry]:
    """Every entry's span of staging copied into the same span of `private`, submitted in order as one batch
    (TransferEngine.submit_many: on CUDA one stream wait and one event for all; entries adjacent in staging and in
    private — a catalog's are — joined into one copy with one ticket, each entry checked first), then one drain for
    all of them. Returns the entries copied. A copy that fails — refused or failing after it was accepted
    (SubmitError), or ending failed — raises PrivateCopyError naming the entries before it (before its run, when
    joined), and only once nothing of the owner's is pending, so the caller may use those and reuse the rest of
    `private`. A drain that cannot finish raises as it is (the caller must not touch the memory). An engine with a
    planned fault, a pacing gate or its own submit() takes one ticket per entry (the controls fail entry k)."""
    pairs = [(staging[e.offset:e.offset + e.nbytes], private[e.offset:e.offset + e.nbytes]) for e in entries]
    try:
        tickets = engine.submit_many(pairs, owner=owner, join_adjacent=True)
    except TransferError as err:
        engine.drain(owner=owner)          # the failed copy's accepted ticket and every earlier one
        k = len(getattr(err, "accepted", ()))
        raise PrivateCopyError(f"private copy of segment {entries[k].index} failed: {type(err).__name__}: {err}",
                               list(entries[:k])) from err
    report = engine.drain(owner=owner)
    if report.failed:
        bad = {id(t) for t in report.failed}
        first = next(i for i, t in enumerate(tickets) if id(t) in bad)
        raise PrivateCopyError(f"private copy of segment {entries[first].index} ended failed: "
                               f"{report.failed[0].error}", list(entries[:first]))
    return list(entries)


@dataclass(frozen=True)
class Placement:
    """Where the destination takes catalog entry `index`: its first `tokens` tokens at positions start, start+1, …"""

    index: int
    start: int
    tokens: int


@dataclass
class Destination:
    """The KV cache a load step restores into: its bytes and layout, the model's rotary settings, and how a
    position finds its slot (None: slot = position, as in the harness's runner caches; the connector maps positions
    through the request's block table). `backend` "cuda" restores with the gather kernel where the layout allows."""

    raw: torch.Tensor
    layout: KVLayout
    rope: RopeConfig
    slots: Callable[[torch.Tensor], torch.Tensor] | None = None
    backend: str = "torch"


def restore_placed(dest: Destination, catalog: Catalog, src: torch.Tensor, placements: Sequence[Placement],
                   segments: Any = None) -> list[Placement]:
    """Restore the placements (every one, or those whose entry index is in `segments`) from `src` (a buffer in the
    catalog's layout) into the destination, keys rotated from each entry's saved positions to the placement's.
    Returns the placements restored. A token's slot and rotation depend only on its own old and new position, so
    restoring placements one call each writes the same bytes as one call for all."""
    chosen = [p for p in placements if segments is None or p.index in segments]
    if not chosen:
        return []
    dev = dest.raw.device
    entries = [catalog.entries[p.index] for p in chosen]
    if dest.backend == "cuda" and dest.slots is None and gather_supported(catalog.layout):
        # planned on the host from the catalog (no device sync), one launch reading the rows in place
        src_slots = np.concatenate([np.arange(e.first_slot, e.first_slot + p.tokens) for e, p in zip(entries, chosen)])
        old = np.concatenate([np.arange(e.leader_start, e.leader_start + p.tokens) for e, p in zip(entries, chosen)])
        new = np.concatenate([np.arange(p.start, p.start + p.tokens) for p in chosen])
        plan_gather(dest.raw, dest.layout, src, catalog.layout, src_slots, old, new, new, dest.rope).run("cuda")
        return chosen
    # the reference: one capture (a copy out of the source buffer) + one restore, checked on the device
    src_dev = src.device
    src_slots = torch.cat([torch.arange(e.first_slot, e.first_slot + p.tokens, device=src_dev)
                           for e, p in zip(entries, chosen)])
    old = torch.cat([torch.arange(e.leader_start, e.leader_start + p.tokens, device=src_dev)
                     for e, p in zip(entries, chosen)])
    new = torch.cat([torch.arange(p.start, p.start + p.tokens, device=dev) for p in chosen])
    saved = capture(src, catalog.layout, src_slots, old)
    if saved.k.device != dev:
        saved = saved.to(dev)
    slots = new if dest.slots is None else dest.slots(new.cpu()).to(dev)
    restore(dest.raw, dest.layout, saved, slots, new, dest.rope, backend=dest.backend)
    return chosen


@dataclass
class LoadOutcome:
    restored: list[CatalogEntry] = field(default_factory=list)     # entries whose placements reached the destination
    failure: SegmentLoadError | TransferError | None = None         # what stopped the step (None: every entry)
    failed: CatalogEntry | None = None                              # the entry it stopped at

    def positions(self, length: int, placements: Sequence[Placement]) -> torch.Tensor:
        """bool [length]: the positions the restored entries' placements cover."""
        mask = torch.zeros(length, dtype=torch.bool)
        done = {e.index for e in self.restored}
        for p in placements:
            if p.index in done:
                mask[p.start:p.start + p.tokens] = True
        return mask


class _TimedLoads:
    """A source whose load calls are timed as part `load`: the source's own work (for the service: request, copy,
    reply), without the size check load_entry makes on arrival."""

    def __init__(self, source: SegmentSource, part: PartTimer) -> None:
        self.source, self.part, self.name = source, part, source.name

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        with self.part("load"):
            return self.source.load(entry, staging)


@dataclass
class LoadStep:
    """One run of the load step over a catalog (see the module doc). `entries`: the catalog entries to load, in
    order (default: all); `private` + `engine` + `owner`: the private copy (None: restore from staging);
    `part(name)` times the steps as parts: stage ⊃ load (the source's calls), private-copy, restore;
    `events` collects staged:/private-copy-drained:/restored: markers per entry index."""

    source: SegmentSource
    staging: torch.Tensor
    catalog: Catalog
    dest: Destination
    placements: Sequence[Placement]
    entries: Sequence[CatalogEntry] | None = None
    private: torch.Tensor | None = None
    engine: TransferEngine | None = None
    owner: str = ""
    part: PartTimer = untimed
    events: list[str] = field(default_factory=list)

    def run(self) -> LoadOutcome:
        part, out = self.part, LoadOutcome()
        entries = list(self.catalog.entries if self.entries is None else self.entries)
        with part("stage"):
            prepare_staging(self.staging, self.catalog)
        prefetch = getattr(self.source, "prefetch", None)
        abandon = getattr(self.source, "abandon", None)
        timed = _TimedLoads(self.source, part)
        loaded: list[CatalogEntry] = []
        try:
            if prefetch is not None:
                # a source that can request every load up front (the service without a gate) does, so the copies
                # overlap; each entry is still waited for and checked in order below
                with part("stage"), part("load"):
                    prefetch(entries)
            for entry in entries:
                with part("stage"):
                    try:
                        load_entry(timed, self.staging, entry)
                    except (SegmentLoadError, TransferError) as e:
                        out.failure, out.failed = e, entry    # the entries before it are still checked below
                        break
                loaded.append(entry)
            with part("stage"):
                corrupt = first_corrupt(self.staging, loaded)    # every loaded entry's digest in one call
            if corrupt is not None:      # an earlier entry than a load failure's: its error is the one reported
                out.failure, out.failed = corrupt[1], loaded[corrupt[0]]
                loaded = loaded[:corrupt[0]]
            self.events.extend(f"staged:{e.index}" for e in loaded)
        finally:
            if (out.failure is not None or not _completed(loaded, entries)) and abandon is not None:
                abandon()     # the loads requested ahead end before the caller reuses staging
        self._copy_and_restore(loaded, out)
        return out

    def _copy_and_restore(self, verified: list[CatalogEntry], out: LoadOutcome) -> None:
        if not verified:
            return
        src, copied = self.staging, verified
        if self.private is not None:
            if self.engine is None:
                raise ValueError("a private copy needs a transfer engine")
            with self.part("private-copy"):
                try:
                    copied = copy_private_each(self.engine, self.staging, self.private, verified, self.owner)
                except PrivateCopyError as e:
                    # the copies before the one that failed are drained and whole: restored, as a stage failure's are
                    copied = e.copied
                    out.failure, out.failed = e, verified[len(e.copied)]
            self.events.extend(f"private-copy-drained:{e.index}" for e in copied)
            src = self.private
        if copied:
            with self.part("restore"):
                restore_placed(self.dest, self.catalog, src, self.placements, segments={e.index for e in copied})
            self.events.extend(f"restored:{e.index}" for e in copied)
        out.restored = list(copied)


def _completed(loaded: list[CatalogEntry], entries: list[CatalogEntry]) -> bool:
    return len(loaded) == len(entries)
