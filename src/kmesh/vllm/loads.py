"""The connector's loads, engine-free: stored payloads into the engine's blocks through kmesh.kv's one load step.

A payload's record (kmesh.kv.record) becomes a catalog entry over the connector's load window (an engine-geometry
staging buffer with the block axis outermost, kmesh.vllm.arrangement.staging_layout); the window is loaded through
the cache service (kmesh.kv.sources.ServiceSegments over the connector's link), every payload's digest checked
against its record, and the verified ones restored by kmesh.kv.load.LoadStep — the same step the harness's children
run. Only what is vLLM's stays here: positions map to slots through the request's block table, and the interior
case restores into a span buffer the repair reads (kmesh.kv.repair.repair_span). Nothing here imports vLLM, so the
equivalence stage runs these loads without an engine.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kmesh.kv.catalog import Catalog, CatalogEntry, segment_nbytes
from kmesh.kv.errors import SegmentLoadError
from kmesh.kv.keys import record_key
from kmesh.kv.layout import KVLayout
from kmesh.kv.link import ServiceLink, Window
from kmesh.kv.load import Destination, LoadStep, PartTimer, Placement, untimed
from kmesh.kv.record import RECORD_BYTES, Record, RecordError
from kmesh.kv.rope import RopeConfig
from kmesh.kv.sources import ServiceSegments
from kmesh.vllm.arrangement import staging_layout
from kmesh.vllm.plans import Item, slots_of

log = logging.getLogger("kmesh.vllm")


def read_record(link: ServiceLink, window: Window, key: bytes) -> Record | None:
    """The committed record of payload `key`, or None (missing, or not a record of this format)."""
    window.tensor[:RECORD_BYTES].zero_()            # a load that wrote nothing cannot pass as a record
    try:
        n = link.load(window.ref, record_key(key), 0)
        return Record.unpack(bytes(window.tensor[:n].numpy()))
    except SegmentLoadError as e:
        if type(e).__name__ != "SegmentMissingError":
            log.warning("kmesh: record of %r unusable: %s", key, e)
        return None
    except RecordError as e:
        log.warning("kmesh: record of %r unusable: %s", key, e)
        return None


def fits(item: Item, layout: KVLayout) -> bool:
    """Its record vouches for whole blocks of this geometry, and they fit the window."""
    rec = item.record
    return (rec is not None and rec.nbytes == segment_nbytes(layout, rec.tokens)
            and math.ceil(rec.tokens / layout.block_size) <= layout.num_blocks)


def catalog_of(items: Sequence[Item], layout: KVLayout) -> tuple[Catalog, list[int]]:
    """Entries for the items' payloads laid one after another from block 0 of `layout`, as far as they fit, and
    the positions in `items` of the entries made (an item that does not fit gets none)."""
    entries: list[CatalogEntry] = []
    kept: list[int] = []
    block = 0
    for i, it in enumerate(items):
        blocks = math.ceil(it.record.tokens / layout.block_size) if it.record is not None else 0
        if not fits(it, layout) or block + blocks > layout.num_blocks:
            continue
        entries.append(CatalogEntry.from_record(it.record, it.key, len(entries), layout, block))
        kept.append(i)
        block += blocks
    return Catalog(layout, tuple(entries)), kept


PlaceFn = Callable[[CatalogEntry, Item], list[Placement]]


@dataclass
class ItemsLoaded:
    restored: list[int]          # positions in the items of those restored
    failed: int | None           # the item whose load, digest or copy failed (None: none failed)
    failure: BaseException | None


def load_items(link: ServiceLink, window: Window, items: Sequence[Item], dest: Destination, place: PlaceFn,
               part: PartTimer = untimed) -> ItemsLoaded:
    """One load step over the items that fit the window, in order: loaded, verified against their records,
    restored into `dest` at the placements `place(entry, item)` gives."""
    catalog, kept = catalog_of(items, window.layout)
    placements = [p for e, i in zip(catalog.entries, kept) for p in place(e, items[i])]
    source = ServiceSegments(link, window.ref, timeout_s=link.timeout_s)
    outcome = LoadStep(source, window.tensor, catalog, dest, placements, part=part).run()
    failed = kept[outcome.failed.index] if outcome.failed is not None else None
    if outcome.failure is not None:
        log.warning("kmesh: payload %r not loaded: %s", items[failed].key if failed is not None else None,
                    outcome.failure)
    return ItemsLoaded([kept[e.index] for e in outcome.restored], failed, outcome.failure)


def load_prefix(link: ServiceLink, window: Window, items: Sequence[Item], num_tokens: int, dest: Destination,
                part: PartTimer = untimed) -> int | None:
    """Prefix blocks in window-sized chunks, each chunk one load step into the engine's blocks (`dest` maps
    positions through the block table), up to `num_tokens` (a partly supplied last block leaves the engine's own
    slots to it). Returns the prompt position of the first block not restored, None when every one was."""
    def place(entry: CatalogEntry, item: Item) -> list[Placement]:
        n = min(entry.tokens, num_tokens - item.start)
        return [Placement(entry.index, item.start, n)] if n > 0 else []

    per = window.layout.num_blocks
    for c0 in range(0, len(items), per):
        chunk = list(items[c0:c0 + per])
        done = set(load_items(link, window, chunk, dest, place, part).restored)
        bad = next((i for i in range(len(chunk)) if i not in done), None)
        if bad is not None:
            return chunk[bad].start
    return None


@dataclass
class Span:
    """The span [0, E) of an interior request in the engine's geometry (slot = position): restored K/V at the
    positions `restored` marks, poison elsewhere; what kmesh.kv.repair.repair_span reads."""

    raw: torch.Tensor
    layout: KVLayout
    restored: torch.Tensor
    missing: list[int] = field(default_factory=list)      # prompt positions of segments not restored
    loaded: int = 0                                         # segments restored


def new_span(engine_layout: KVLayout, span_end: int) -> Span:
    layout = staging_layout(engine_layout, max(1, math.ceil(span_end / engine_layout.block_size)))
    raw = torch.full((layout.nbytes,), 0xFF, dtype=torch.uint8)    # all-ones bytes: NaN in every float dtype
    return Span(raw, layout, torch.zeros(span_end, dtype=torch.bool))


def load_span(link: ServiceLink, window: Window, items: Sequence[Item], span_end: int, engine_layout: KVLayout,
              rope: RopeConfig, part: PartTimer = untimed) -> Span:
    """Every interior segment into the span at the child's positions (cut at the span's end), as many as the
    window holds per load step; a segment that fails or can never fit the window is missing (the repair computes
    its positions) and the others go on."""
    span = new_span(engine_layout, span_end)
    dest = Destination(span.raw, span.layout, rope)
    todo = [it for it in items if it.start < span_end]

    def place(entry: CatalogEntry, item: Item) -> list[Placement]:
        return [Placement(entry.index, item.start, min(entry.tokens, span_end - item.start))]

    while todo:
        got = load_items(link, window, todo, dest, place, part)
        later: list[Item] = []
        for i, it in enumerate(todo):
            if i in got.restored:
                span.loaded += 1
                span.restored[it.start:it.start + min(it.record.tokens, span_end - it.start)] = True
            elif i == got.failed or not fits(it, window.layout):
                span.missing.append(it.start)
            else:
                later.append(it)        # did not fit beside the others: the next step
        if len(later) == len(todo):     # no progress (cannot happen: the first that fits is always kept)
            span.missing.extend(it.start for it in later)
            break
        todo = later
    return span


def engine_destination(engine_raw: torch.Tensor, engine_layout: KVLayout, rope: RopeConfig,
                       block_ids: Sequence[int]) -> Destination:
    """The engine's KV cache as a load step's destination: positions to slots through the request's blocks."""
    bs = engine_layout.block_size
    return Destination(engine_raw, engine_layout, rope, lambda pos: slots_of(block_ids, pos, bs))
