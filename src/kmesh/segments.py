"""Shared segments: what a leader saves, how a child gets a private copy back, and the checks in between.

    export = export_segments(runner, leader_cache, workload)     # BLNHC buffer: each segment from a block start
    src = InProcessSegments(export)                              # or ServiceSegments(svc, staging, ...)
    staged = stage_segments(src, staging, export.catalog)        # loads + size/digest checks, per segment
    private = copy_private(engine, staging, owner)               # TransferEngine copy, drained before use
    restore_child(child_cache, export.catalog, private, child, rope)   # kmesh.restore with the RoPE shift

The export buffer uses a cross-layer order (BLNHC: all layers of a block together), so one segment is one
contiguous byte range: one saved object per segment, whatever the layer count. A segment of any length
starts on a block boundary and its object is the whole blocks it spans (`segment_nbytes`): the slots past
its last token in a partial last block are zero padding, covered by the digest and never restored (a
restore reads exactly the segment's slots). The leader records each object's size, its sha256 (what the
cache service commits) and its arrival digest (sha256 or blake3: `arrival_digest`, computed where the bytes lie —
the GPU for device staging) in a Catalog; a child checks every entry against the layout (`check_catalog`: the
size its tokens need, from a block start) and every object's size before its bytes are copied, and trusts a
staged segment only after its size and arrival digest match, before a single byte of it reaches its model state. Every failure is a
SegmentLoadError subclass the caller turns into a full recompute — never a partial reuse: kmesh.child
restores the segments verified before a failure (copy_private_each: one submit per segment, one drain; then one
restore), so a failure at a later segment leaves the earlier ones in the model state, and the recompute overwrites
them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Protocol, Sequence

import numpy as np
import torch

from kmesh.errors import KMeshError
from kmesh.layout import KVLayout
from kmesh.model.runner import KVCache, LayerRunner
from kmesh.restore import capture, restore
from kmesh.restore_gather import gather_supported, plan_gather
from kmesh.sources.digest import sha256_tensor
from kmesh.transfer.engine import TransferEngine
from kmesh.transfer.errors import TransferError
from kmesh.workload import Child, Workload

EXPORT_ORDER = "BLNHC"


class SegmentLoadError(KMeshError):
    """A shared segment could not be brought back intact; the child must recompute instead."""


class SegmentMissingError(SegmentLoadError):
    """The object is not in the store (never saved, or evicted)."""


class SegmentCorruptError(SegmentLoadError):
    """The loaded bytes do not have the digest the leader recorded."""


class SegmentExportError(KMeshError):
    """A workload's segments cannot be exported (a segment of no tokens)."""


class SegmentCatalogError(SegmentLoadError):
    """A catalog entry disagrees with its layout: not the whole blocks its tokens span, from a block start."""


class SegmentSizeError(SegmentLoadError):
    """The object's size is not the catalog entry's (what its tokens need under the layout)."""


class SegmentTruncatedError(SegmentSizeError):
    """The object holds fewer bytes than the catalog entry says it must."""


class SegmentOversizeError(SegmentSizeError):
    """The object holds more bytes than the catalog entry says it must."""


class SegmentLayoutError(SegmentLoadError):
    """The object was saved under another KV geometry than the child's staging buffer."""


class SegmentSourceLostError(SegmentLoadError):
    """The source (the cache service) went away during the load."""


class SegmentCancelledError(SegmentLoadError):
    """The load was cancelled before it completed."""


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


@dataclass(frozen=True)
class CatalogEntry:
    index: int
    key: bytes
    offset: int            # bytes into the export buffer (and into a child's staging buffer)
    nbytes: int
    sha256: str            # the object's sha256 (what the cache service records when it commits the object)
    leader_start: int      # position of the segment's first token in the leader prompt
    tokens: int
    first_slot: int        # slot of its first token in the export layout
    # what a child checks on arrival, before a byte of the segment reaches its model state: (algorithm, hex digest
    # or "" for sha256, which is the sha256 above); blake3 runs on the GPU where the staging buffer is a device buffer
    arrival: tuple[str, str] = ("sha256", "")

    @property
    def arrival_algorithm(self) -> str:
        return self.arrival[0]

    @property
    def arrival_hex(self) -> str:
        if self.arrival[0] == "sha256":
            return self.sha256      # one sha256 per object: the service's commit digest is the arrival digest
        return self.arrival[1]

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
             "arrival": [e.arrival_algorithm, e.arrival_hex], "leader_start": e.leader_start, "tokens": e.tokens}
            for e in self.entries]}


def size_error(entry: CatalogEntry, nbytes: int, where: str = "") -> SegmentSizeError:
    """The typed refusal of an object of nbytes for `entry` (truncated or oversize)."""
    cls = SegmentTruncatedError if nbytes < entry.nbytes else SegmentOversizeError
    return cls(f"object {entry.key!r} has {nbytes} bytes{where}; its catalog entry ({entry.tokens} tokens) "
               f"says {entry.nbytes}")


def segment_nbytes(layout: KVLayout, tokens: int) -> int:
    """Bytes of the object of a `tokens`-token segment under an export layout: the whole blocks it spans."""
    return -(-tokens // layout.block_size) * layout.byte_strides["B"]


def check_catalog(catalog: Catalog) -> None:
    """Every entry is what its tokens need under the catalog's layout, else SegmentCatalogError: it starts
    on a block boundary (offset = its first block's bytes), holds the whole blocks its tokens span, lies
    inside the layout and overlaps no other entry. A block-outermost order makes a segment contiguous."""
    layout = catalog.layout
    if layout.order[0] != "B":
        raise SegmentCatalogError(f"catalog layout order {layout.order} does not keep a block's layers together")
    bs, block_bytes = layout.block_size, layout.byte_strides["B"]
    end = 0
    for e in sorted(catalog.entries, key=lambda e: e.offset):
        what = f"catalog entry {e.key!r} ({e.tokens} tokens from slot {e.first_slot}, block size {bs})"
        if e.tokens < 1:
            raise SegmentCatalogError(f"{what} holds no tokens")
        if e.first_slot % bs or e.offset != layout.offset + e.first_slot // bs * block_bytes:
            raise SegmentCatalogError(f"{what} does not start on a block boundary at offset {e.offset}")
        if e.nbytes != segment_nbytes(layout, e.tokens):
            raise SegmentCatalogError(f"{what} says {e.nbytes} bytes; its blocks hold "
                                      f"{segment_nbytes(layout, e.tokens)}")
        if e.offset < end or e.offset + e.nbytes > layout.nbytes:
            raise SegmentCatalogError(f"{what} overlaps another entry or lies past the layout's "
                                      f"{layout.nbytes} bytes")
        end = e.offset + e.nbytes


@dataclass
class Export:
    raw: torch.Tensor      # uint8, catalog.layout
    catalog: Catalog


def export_layout(runner: LayerRunner, workload: Workload) -> KVLayout:
    bs = workload.spec.block_size
    blocks = sum(-(-s.tokens // bs) for s in workload.segments)     # each segment from a block start
    return KVLayout.paged(EXPORT_ORDER, runner.num_layers, blocks, bs, runner.num_kv_heads, runner.head_dim,
                          runner.dtype_name)


def export_segments(runner: LayerRunner, leader_cache: KVCache, workload: Workload, key_prefix: bytes,
                    arrival: str = "sha256") -> Export:
    """Copy each segment's K/V (all layers) out of the leader's cache into an export buffer, each segment from
    a block start over the whole blocks it spans (a partial last block's other slots stay zero). Every entry
    records the object's sha256 and its `arrival` digest (ARRIVAL_DIGESTS), what children check on arrival."""
    empty = [i for i, seg in enumerate(workload.segments) if seg.tokens < 1]
    if empty:
        raise SegmentExportError(f"segments {empty} hold no tokens; a segment needs at least one")
    if arrival not in ARRIVAL_DIGESTS:
        raise SegmentExportError(f"arrival digest must be one of {ARRIVAL_DIGESTS}, got {arrival!r}")
    layout = export_layout(runner, workload)
    raw = torch.zeros(layout.nbytes, dtype=torch.uint8, device=runner.device)
    block_bytes, bs = layout.byte_strides["B"], layout.block_size
    entries, block = [], 0
    for i, seg in enumerate(workload.segments):
        slot = block * bs
        pos = torch.arange(seg.leader_start, seg.leader_start + seg.tokens, device=runner.device)
        saved = capture(leader_cache.raw, leader_cache.layout, pos, pos)    # leader slot = position
        dst = torch.arange(slot, slot + seg.tokens, device=runner.device)
        restore(raw, layout, saved, dst, pos, runner.rope)                  # same positions: a byte copy
        offset, nbytes = block * block_bytes, segment_nbytes(layout, seg.tokens)
        obj = raw[offset:offset + nbytes]
        sha = sha256_tensor(obj)
        entries.append(CatalogEntry(i, key_prefix + f"/segment-{i}".encode(), offset, nbytes, sha,
                                    seg.leader_start, seg.tokens, slot,
                                    (arrival, "" if arrival == "sha256" else arrival_digest(arrival, obj))))
        block += nbytes // block_bytes
    catalog = Catalog(layout, tuple(entries))
    check_catalog(catalog)
    return Export(raw, catalog)


class SegmentSource(Protocol):
    """Where a child's segment bytes come from: load one catalog entry into staging[offset:offset+nbytes]."""

    name: str

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        """Copy the entry's object into staging at entry.offset; returns the bytes copied. An object whose
        size is not entry.nbytes raises SegmentSizeError, copied nowhere if the source can know its size first."""


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
        if n != entry.nbytes:                       # before the copy: not a byte of a wrong-size object lands
            raise size_error(entry, n)
        if entry.offset + n > staging.numel():
            raise SegmentLayoutError(f"object {entry.key!r} of {n} bytes at {entry.offset} overruns the "
                                     f"{staging.numel()}-byte staging buffer")
        staging[entry.offset:entry.offset + n].copy_(obj)
        return n


class ServiceSegments:
    """Objects loaded through the cache service into a registered staging buffer (memfd or CUDA IPC).

    `after_accept(req, nbytes)` runs once the service accepted a copy (a paced service needs its tokens then).
    The size check comes first: the service reports the object's size when it accepts the load, before a paced
    copy moves a byte, and one that is not entry.nbytes raises SegmentSizeError. The service cannot stop a
    copy part-way (kmesh.service.jobs), so the refused copy is cancelled and still let run out and drained into
    staging, whose bytes the caller then never uses (it recomputes); a client cannot ask the service for an
    object's size before it loads it. An object too large for the registration is refused by the service
    (RangeError) before any copy: SegmentOversizeError. Without `after_accept` (no gate: a deployed service) a
    load is two calls, load and wait (as the vLLM connector's), and the size is checked on the wait's reply;
    prefetch() then requests every segment's load before the first wait (kmesh.child.prefill_from_segments), in
    one load_many request where the service takes it (its reply waits for the copies too).
    """

    name = "service"

    def __init__(self, svc: Any, reg: Any, after_accept: Callable[[int, int], None] | None = None,
                 timeout_s: float = 60.0) -> None:
        self.svc, self.reg, self.after_accept, self.timeout_s = svc, reg, after_accept, timeout_s
        self.requests: list[int] = []
        # prefetch's requests by (key, offset), not yet used: a request id to wait on, load_many's description of
        # an ended copy, or the refusal of the first it could not make (raised at that entry's turn)
        self._ahead: dict[tuple[bytes, int], int | dict[str, Any] | BaseException] = {}

    def _request(self, entry: CatalogEntry) -> int:
        """The load call, its refusals as segment errors; the request id."""
        from kmesh.service import errors as se

        try:
            req = self.svc.load(self.reg, entry.key, entry.offset)
        except (se.ServiceError, OSError) as e:
            mapped = self._segment_error(e, entry)
            if mapped is e:
                raise
            raise mapped from e
        self.requests.append(req)
        return req

    @staticmethod
    def _segment_error(e: BaseException, entry: CatalogEntry) -> BaseException:
        """A refused load (or a lost service) as the segment error the caller turns into a recompute; any other
        refusal (a registration the client got wrong, ...) is returned as it is: a bug, not a reason to recompute."""
        from kmesh.service import errors as se

        if isinstance(e, se.ObjectMissingError):
            return SegmentMissingError(str(e))
        if isinstance(e, se.LayoutMismatchError):
            return SegmentLayoutError(str(e))
        if isinstance(e, se.RangeError):   # the staging region is the catalog's: the object is larger than its entry
            return SegmentOversizeError(f"object {entry.key!r} does not fit at {entry.offset} of the staging "
                                        f"buffer (its catalog entry says {entry.nbytes} bytes): {e}")
        if isinstance(e, (se.ConnectionLostError, OSError)):
            return SegmentSourceLostError(f"cache service lost: {e}")
        return e

    def prefetch(self, entries: Collection[CatalogEntry]) -> None:
        """Without a gate: request every entry's load now, in order, so the service's copies overlap; load(entry)
        then uses its own. Where the service takes load_many, the loads go MAX_BATCH at a time in one request
        each, whose reply also waits for the copies (one round trip for a child's segments instead of two per
        segment); an item the batch stops at for a read-back or fetch, and the rest, are requested one by one.
        The first load the service refuses is kept and raised at that entry's turn (so a caller going entry by
        entry fails at the same entry as without prefetch), and none after it is requested. A caller that stops
        before the end must abandon() the rest. With a gate (after_accept) nothing is requested ahead: a paced
        copy moves only the chunks granted to it, one request at a time."""
        if self.after_accept is not None:
            return
        from kmesh.service import errors as se
        from kmesh.service.protocol import MAX_BATCH

        todo = list(entries)
        load_many = getattr(self.svc, "load_many", None)
        while load_many is not None and todo:
            batch = todo[:MAX_BATCH]
            try:
                r = load_many(self.reg, [(e.key, e.offset) for e in batch], wait_s=self.timeout_s)
            except se.UnknownOpError:     # a service from before load_many: one load per segment
                load_many = None
                break
            except (se.ServiceError, OSError) as e:
                self._ahead[(batch[0].key, batch[0].offset)] = self._segment_error(e, batch[0])
                return
            jobs = {j["req"]: j for j in r["jobs"]}
            for entry, req in zip(batch, r["reqs"]):
                self.requests.append(req)
                job = jobs.get(req)
                self._ahead[(entry.key, entry.offset)] = job if job is not None and job["state"] != "running" \
                    else req
            stopped = r["stopped_at"]
            if stopped is None:
                todo = todo[len(batch):]
                continue
            if r["error"] is not None:
                err = se.error_from_reply(r["error"]["code"], r["error"]["message"])
                self._ahead[(batch[stopped].key, batch[stopped].offset)] = self._segment_error(err, batch[stopped])
                return
            todo, load_many = todo[stopped:], None     # parked: this one and the rest one by one
        for entry in todo:
            try:
                self._ahead[(entry.key, entry.offset)] = self._request(entry)
            except (SegmentLoadError, se.ServiceError) as e:
                self._ahead[(entry.key, entry.offset)] = e
                return

    def abandon(self) -> None:
        """Cancel every prefetched load not waited on and wait for its copy to end: those copies write into the
        staging buffer, which the caller reuses once it returns. A service that is gone copies nothing more."""
        from kmesh.service import errors as se

        ahead = [r if isinstance(r, int) else r["req"] for r in self._ahead.values()
                 if isinstance(r, int) or (isinstance(r, dict) and r["state"] == "running")]
        self._ahead.clear()
        for req in ahead:
            try:
                self.svc.cancel(req)
                self.svc.wait(req, timeout=self.timeout_s)
            except (se.ConnectionLostError, OSError):
                return

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        from kmesh.service import errors as se

        ahead = self._ahead.pop((entry.key, entry.offset), None)
        if isinstance(ahead, BaseException):
            raise ahead
        if isinstance(ahead, dict):     # load_many's reply described the copy as ended: nothing to wait for
            r, accepted = ahead, int(ahead["nbytes"])
            return self._checked(entry, r, accepted)
        req = ahead if ahead is not None else self._request(entry)
        try:
            if self.after_accept is None:
                # unpaced (a deployed service): the wait's reply carries the accepted size too. Polling for it
                # first would cost one more round trip per segment and change nothing: a copy of the wrong size
                # runs out either way (see the class doc) and is refused below, its bytes never used.
                r = self.svc.wait(req, timeout=self.timeout_s)
                accepted = int(r["nbytes"])
            else:
                accepted = int(self.svc.poll(req)["nbytes"])
                if accepted != entry.nbytes:
                    self.svc.cancel(req)    # nobody wants it; it runs on (see the class doc) and is drained below
                # the size the service accepted (the object's), not the catalog's: a paced service needs its
                # exact chunk count, or a short object would leave spare tokens in the gate
                self.after_accept(req, accepted)
                r = self.svc.wait(req, timeout=self.timeout_s)
        except (se.ConnectionLostError, OSError) as e:
            raise SegmentSourceLostError(f"cache service lost during load of {entry.key!r}: {e}") from e
        return self._checked(entry, r, accepted)

    @staticmethod
    def _checked(entry: CatalogEntry, r: dict[str, Any], accepted: int) -> int:
        """The ended copy's bytes, or the segment error of a wrong size, a cancelled or a failed copy."""
        if accepted != entry.nbytes:
            raise size_error(entry, accepted, f" (copy {r['state']}, not used)")
        if r["state"] == "cancelled":
            raise SegmentCancelledError(f"load of {entry.key!r} was cancelled")
        if r["state"] != "done":
            raise SegmentLoadError(f"load of {entry.key!r} ended {r['state']}: {r.get('error')}")
        return int(r["nbytes"])


def prepare_staging(staging: torch.Tensor, catalog: Catalog) -> None:
    """Check the catalog against its layout (check_catalog) and the staging buffer against the catalog, then
    poison staging, so a copy that silently wrote nothing cannot pass the checks of stage_entry."""
    check_catalog(catalog)
    if staging.dtype != torch.uint8 or staging.numel() < catalog.nbytes:
        raise SegmentLayoutError(f"staging buffer of {staging.numel()} {staging.dtype} elements cannot hold the "
                                 f"catalog's {catalog.nbytes} bytes")
    staging.fill_(0xA5)


def arrival_digests(algorithm: str, views: Sequence[torch.Tensor]) -> list[str]:
    """arrival_digest of every view: blake3 of CUDA views in one kmesh.integrity.gpu call (one launch set for all,
    where one call per view cost a RAG child ~0.1 ms a segment on the H200), each view alone otherwise."""
    if algorithm == "blake3" and views and all(v.is_cuda for v in views):
        from kmesh.integrity.gpu import hash_buffers

        return [d.hex() for d in hash_buffers("blake3", [v.detach().contiguous() for v in views])]
    return [arrival_digest(algorithm, v) for v in views]


def load_entry(source: SegmentSource, staging: torch.Tensor, entry: CatalogEntry) -> None:
    """Load one entry into its span of staging and check its size (its digest: first_corrupt)."""
    n = source.load(entry, staging)
    if n != entry.nbytes:          # a source that does not check sizes itself
        raise size_error(entry, n)


def first_corrupt(staging: torch.Tensor, entries: Sequence[CatalogEntry]) -> tuple[int, SegmentCorruptError] | None:
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


class PrivateCopyError(TransferError):
    """A private copy failed at one segment; `copied` are the segments before it, drained and whole."""

    def __init__(self, message: str, copied: list[CatalogEntry]) -> None:
        super().__init__(message)
        self.copied = copied


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


def restore_child(cache: KVCache, catalog: Catalog, private: torch.Tensor, child: Child, runner: LayerRunner,
                  backend: str = "torch", segments: Collection[int] | None = None) -> torch.Tensor:
    """Restore the child's segments (every one, or only those whose index is in `segments`) from the private
    copy into its cache at the child's positions (keys rotated by the position change). Returns the bool [T]
    mask of the positions restored by this call. A token's slot and rotation depend only on its own old and
    new position, so restoring the segments one call each writes the same bytes as one call for all."""
    T = len(child.ids)
    restored = torch.zeros(T, dtype=torch.bool)
    dev = cache.raw.device
    slices = [s for s in child.segment_slices() if segments is None or s[0] in segments]
    if not slices:
        return restored
    if backend == "cuda" and gather_supported(catalog.layout):
        # Planned on the host from the catalog (no device sync), one launch reading the rows in place.
        entries = [catalog.entries[seg] for seg, _, _ in slices]
        src = np.concatenate([np.arange(e.first_slot, e.first_slot + e.tokens) for e in entries])
        old = np.concatenate([np.arange(e.leader_start, e.leader_start + e.tokens) for e in entries])
        new = np.concatenate([np.arange(a, b) for _, a, b in slices])
        plan_gather(cache.raw, cache.layout, private, catalog.layout, src, old, new, new, runner.rope).run("cuda")
    else:
        # The reference: one capture (a copy out of the private buffer) + one restore, checked on the device.
        src = torch.cat([catalog.entries[seg].slots(dev) for seg, _, _ in slices])
        old = torch.cat([catalog.entries[seg].leader_positions(dev) for seg, _, _ in slices])
        new = torch.cat([torch.arange(a, b, device=dev) for _, a, b in slices])
        saved = capture(private, catalog.layout, src, old)
        restore(cache.raw, cache.layout, saved, new, new, runner.rope, backend=backend)  # child slot = position
    for _, a, b in slices:
        restored[a:b] = True
    return restored
