"""The `one-path` cases: the vLLM connector's load path and a child's load path, given the same stored objects in a
real cache service, write the same bytes and refuse the same objects.

The child's road is kmesh.harness.child.prefill_from_segments up to the repair (a registered staging buffer, the
private copy through the transfer engine, its runner cache: slot = position). The connector's road is its own code,
engine-free (kmesh.vllm.loads.load_items: records as catalog entries over a load window registered through
kmesh.kv.link, restored through a block table into a paged engine-shaped cache, LBNHC, canary-filled). Both end in
kmesh.kv.load.LoadStep; these cases hold them to it from the outside: the K/V at every placed position, read back
from each destination with kmesh.kv.restore.capture, equal bit for bit; nothing outside the placed slots of the
engine cache changed and nothing outside the placed positions of the child's cache lost its poison; and for a
corrupt, a missing and a wrong-geometry object at segment 1 both roads refuse it with the same error, having
restored segment 0 and nothing of segment 1.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from kmesh.harness.child import new_cache, placements_of, prefill_from_segments
from kmesh.harness.modelsetup import ModelSetup
from kmesh.harness.service_side import ServiceSide
from kmesh.kv.catalog import Catalog, CatalogEntry
from kmesh.kv.errors import SegmentLoadError
from kmesh.kv.keys import token_digest
from kmesh.kv.layout import KVLayout
from kmesh.kv.link import ServiceLink
from kmesh.kv.load import Placement
from kmesh.kv.record import KIND_SEGMENT, Record
from kmesh.kv.restore import capture
from kmesh.kv.sources import ServiceSegments
from kmesh.result import Result
from kmesh.transfer.errors import TransferError
from kmesh.vllm.arrangement import staging_layout
from kmesh.vllm.loads import engine_destination, load_items
from kmesh.vllm.plans import Item

FAIL_AT = 1          # the refusal cases put the bad object at this catalog entry
REFUSALS = {"corrupt": "SegmentCorruptError", "missing": "SegmentMissingError",
            "wrong-geometry": "SegmentLayoutError"}


@dataclasses.dataclass
class Road:
    """What one road left: the failure's type name (None: none), the entries restored, its K/V at `positions`."""

    failure: str | None
    restored: list[int]
    k: torch.Tensor
    v: torch.Tensor | None
    outside_intact: bool          # nothing outside the restored positions' slots changed (or lost its poison)


def _record(entry: CatalogEntry, tokens: list[int]) -> Record:
    return Record(KIND_SEGMENT, entry.tokens, entry.leader_start, entry.nbytes, bytes.fromhex(entry.sha256),
                  token_digest(tokens))


def _positions(placements: list[Placement], indices: list[int]) -> torch.Tensor:
    keep = set(indices)
    return torch.cat([torch.arange(p.start, p.start + p.tokens) for p in placements if p.index in keep]
                     or [torch.zeros(0, dtype=torch.long)])


def _child_road(setup: ModelSetup, svc: ServiceSide, catalog: Catalog, child: Any, placements: list[Placement],
                want: list[int]) -> Road:
    ctx = dataclasses.replace(setup.ctx, catalog=catalog)
    cache = new_cache(ctx, child)
    private = torch.empty(catalog.nbytes, dtype=torch.uint8, device=setup.device)
    events: list[str] = []
    failure = None
    with svc.staging("one-path", catalog.layout.to_dict()) as staging:
        try:
            prefill_from_segments(ctx, child, ServiceSegments(svc.client, staging.reg), staging.tensor, private, cache,
                                  "repair", "one-path-child", events, prefill_fn=lambda _c, _r: None)
        except (SegmentLoadError, TransferError) as e:
            failure = type(e).__name__
    restored = sorted(int(e.split(":")[1]) for e in events if e.startswith("restored:"))
    pos = _positions(placements, want)
    seg = capture(cache.raw, cache.layout, pos.to(cache.raw.device), pos.to(cache.raw.device))
    poisoned = torch.ones(cache.capacity, dtype=torch.bool)
    poisoned[_positions(placements, restored)] = False
    intact = all(bool(torch.isnan(k[poisoned.to(k.device)]).all() and torch.isnan(v[poisoned.to(v.device)]).all())
                 for k, v in zip(cache.k, cache.v))
    return Road(failure, restored, seg.k.cpu(), None if seg.v is None else seg.v.cpu(), intact)


def _connector_road(setup: ModelSetup, svc: ServiceSide, catalog: Catalog, child: Any, placements: list[Placement],
                    records: dict[bytes, Record], want: list[int]) -> Road:
    layout = catalog.layout
    need = -(-(max(p.start + p.tokens for p in placements) + 1) // layout.block_size)
    engine = KVLayout.paged("LBNHC", layout.num_layers, need + 2, layout.block_size, layout.num_kv_heads,
                            layout.head_dim, layout.dtype)
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (engine.nbytes,), dtype=torch.uint8, generator=gen)   # canaries everywhere
    before = raw.clone()
    block_ids = list(range(need + 1, 0, -1))             # a block table that is not the identity
    items = [Item(e.key, records[e.key], 0, tuple(child.ids[:e.tokens])) for e in catalog.entries]
    def place(entry: CatalogEntry, item: Item) -> list[Placement]:
        index = items.index(item)          # the item's catalog entry: where the child placed it
        return [Placement(entry.index, p.start, p.tokens) for p in placements if p.index == index]

    link = ServiceLink.over(svc.client)
    window = link.window("one-path-load", staging_layout(engine, sum(
        -(-e.tokens // layout.block_size) for e in catalog.entries)), alloc_id=raw.data_ptr())
    try:
        got = load_items(link, window, items, engine_destination(raw, engine, setup.runner.rope, block_ids), place)
    finally:
        link.close()
    failure = None if got.failure is None else type(got.failure).__name__
    dest = engine_destination(raw, engine, setup.runner.rope, block_ids)
    pos = _positions(placements, want)
    seg = capture(raw, engine, dest.slots(pos), pos)
    written = torch.zeros(engine.num_slots, dtype=torch.bool)
    written[dest.slots(_positions(placements, got.restored))] = True
    changed = _changed_slots(raw, before, engine)
    return Road(failure, sorted(got.restored), seg.k, seg.v, bool((changed & ~written).sum() == 0))


def _changed_slots(raw: torch.Tensor, before: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """bool [slots]: a slot some byte of which changed, any layer, K or V (a capture's tensors are [T, L, H, D])."""
    every = torch.arange(layout.num_slots)
    a, b = capture(raw, layout, every, every), capture(before, layout, every, every)
    changed = (a.k.view(torch.uint8) != b.k.view(torch.uint8)).reshape(len(every), -1).any(1)
    if a.v is not None:
        changed |= (a.v.view(torch.uint8) != b.v.view(torch.uint8)).reshape(len(every), -1).any(1)
    return changed


def _compare(case: Any, child: Road, conn: Road, expect: str | None, want: list[int]) -> None:
    case.check("same_failure", child.failure == conn.failure == expect,
               value={"child": child.failure, "connector": conn.failure, "expected": expect})
    case.check("same_entries_restored", child.restored == conn.restored == want,
               value={"child": child.restored, "connector": conn.restored, "expected": want})
    equal_k = child.k.dtype == conn.k.dtype and torch.equal(child.k.view(torch.uint8), conn.k.view(torch.uint8))
    equal_v = (child.v is None and conn.v is None) or (
        child.v is not None and conn.v is not None and torch.equal(child.v.view(torch.uint8), conn.v.view(torch.uint8)))
    case.check("destination_bytes_equal", equal_k and equal_v and child.k.numel() > 0,
               value={"tokens": int(child.k.shape[0]), "k": equal_k, "v": equal_v})
    case.check("child_outside_untouched", child.outside_intact)
    case.check("engine_outside_untouched", conn.outside_intact)


def one_path_cases(res: Result, setup: ModelSetup, svc: ServiceSide) -> None:
    """The cases (see the module doc); the service must be unpaced (svc.unpace()): both roads load as a deployed
    client does, without a gate."""
    catalog = setup.export.catalog
    child = setup.workload.children[0]
    placements = placements_of(child)
    leader = setup.workload.leader_ids
    records = {e.key: _record(e, list(leader[e.leader_start:e.leader_start + e.tokens])) for e in catalog.entries}
    every = sorted({p.index for p in placements})
    with res.case("one-path-bytes", {"child": child.name, "segments": len(catalog.entries),
                                     "placements": len(placements)}) as case:
        child_road = _child_road(setup, svc, catalog, child, placements, every)
        connector_road = _connector_road(setup, svc, catalog, child, placements, records, every)
        _compare(case, child_road, connector_road, None, every)
        flipped = connector_road.k.clone()
        flipped.view(torch.uint8).view(-1)[flipped.view(torch.uint8).numel() // 2] ^= 1
        case.check("a_flipped_bit_is_seen", not torch.equal(child_road.k.view(torch.uint8), flipped.view(torch.uint8)))
    target = catalog.entries[FAIL_AT]
    variants: dict[str, Callable[[bytes], None]] = {
        "corrupt": lambda key: svc.save_variant(target, key, flip_byte=target.nbytes // 3),
        "missing": lambda key: None,
        "wrong-geometry": lambda key: svc.save_variant(target, key,
                                                       layout={**catalog.layout.to_dict(), "order": "BLHNC"}),
    }
    before = sorted(p.index for p in placements if p.index < FAIL_AT)
    for name, save in variants.items():
        with res.case(f"one-path-refuses-{name}", {"child": child.name, "segment": FAIL_AT}) as case:
            key = target.key + f"-one-path-{name}".encode()
            save(key)
            bad = dataclasses.replace(catalog, entries=tuple(
                dataclasses.replace(e, key=key) if e.index == FAIL_AT else e for e in catalog.entries))
            recs = {**records, key: records[target.key]}
            _compare(case, _child_road(setup, svc, bad, child, placements, before),
                     _connector_road(setup, svc, bad, child, placements, recs, before), REFUSALS[name], before)
