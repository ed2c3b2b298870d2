"""Read-once serving (beyond the write-up): four concurrent children share one disk read per object.

Arm A `forced-eviction`: children one at a time, every RAM copy evicted (and the page cache dropped) before each,
singleflight off — storage is read once per object per child (4 reads per object), as the route benchmark does.
Arm B `read-once`: one cold start for the group, then the four children load concurrently (threads released by
one barrier) through singleflight, the group's keys retained until every child has its private copy —
storage is read once per object. Each child copies the shared immutable bytes into its own private buffer; the
stage then checks that every private copy holds the leader's bytes (the service case repairs from them). Timed:
`load` per child (its gets + copies into its private buffer, wall clock; per pair the median over children) and
`group` (all four children's loads: the sum of the serial children / the wall time of the concurrent group);
matched pairs, alternating order (kmesh.bench.alternate). The same two arms through the cache service:
kmesh.stages.storage.service.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from kmesh.bench import PairedTiming, alternate
from kmesh.kv.catalog import Catalog
from kmesh.result import Result
from kmesh.stages.storage.setup import Setup, paired_summary
from kmesh.storage import routes
from kmesh.storage.routes import drop_page_cache
from kmesh.storage.tier import TieredObjects

ARMS = ("forced-eviction", "read-once")

GroupLoad = Callable[[list[torch.Tensor]], list[float]]            # privates -> seconds per child
GroupLoadOnce = Callable[[list[torch.Tensor], str], list[float]]   # privates, retention group -> seconds per child


def time_group_arm(arm: str, round_index: int, privates: list[torch.Tensor], forced: GroupLoad,
                   once: GroupLoadOnce) -> dict[str, list[float]]:
    """One arm's run of the whole group (privates poisoned first, untimed): `load` per child and `group` — the
    serial children's sum (evictions between them excluded), or the concurrent group's wall time."""
    for private in privates:
        private.fill_(0xA5)
    start = time.perf_counter()
    loads = forced(privates) if arm == ARMS[0] else once(privates, f"group-{round_index}")
    wall = time.perf_counter() - start
    return {"load": loads, "group": [sum(loads) if arm == ARMS[0] else wall]}


def group_pairs(run_arm: Callable[[str, int], dict[str, list[float]]], pairs: int, warmup: int) -> PairedTiming:
    """Matched pairs of the two group arms; `load` and `group` are side by side, not nested."""
    timing = alternate(ARMS, pairs, warmup, run_arm)
    timing.parents.update(load=None, group=None)
    return timing


def _load_child(tier: TieredObjects, catalog: Catalog, private: torch.Tensor) -> float:
    start = time.perf_counter()
    for entry in catalog.entries:
        private[entry.offset:entry.offset + entry.nbytes].copy_(tier.get(entry.key))
    if private.device.type == "cuda":
        torch.cuda.synchronize(private.device)
    return time.perf_counter() - start


def forced_eviction(tier: TieredObjects, catalog: Catalog, privates: list[torch.Tensor]) -> list[float]:
    tier.singleflight_enabled = False
    out = []
    for private in privates:
        tier.evict(force=True)
        drop_page_cache([tier.path(e.key) for e in catalog.entries])
        out.append(_load_child(tier, catalog, private))
    return out


def concurrent_children(count: int, load: Callable[[int], float], name: str) -> list[float]:
    """Run load(0..count-1) in `count` threads released together by a barrier (simultaneous loads, so singleflight
    has something to join); the per-child seconds, or the first child's exception re-raised in this thread."""
    barrier = threading.Barrier(count)
    times: list[float | None] = [None] * count
    errors: list[BaseException] = []

    def child(index: int) -> None:
        try:
            barrier.wait()
            times[index] = load(index)
        except BaseException as e:  # re-raised below, in the stage's thread
            errors.append(e)

    threads = [threading.Thread(target=child, args=(i,), name=f"{name}-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [float(t) for t in times if t is not None]


def read_once(tier: TieredObjects, catalog: Catalog, privates: list[torch.Tensor], group: str) -> list[float]:
    tier.singleflight_enabled = True
    tier.evict(force=True)
    drop_page_cache([tier.path(e.key) for e in catalog.entries])
    tier.retain(group, [e.key for e in catalog.entries])
    try:
        return concurrent_children(len(privates), lambda i: _load_child(tier, catalog, privates[i]), "read-once")
    finally:
        tier.release(group)   # every child holds its private copy now (or failed)


def run_pairs(tier: TieredObjects, catalog: Catalog, privates: list[torch.Tensor], pairs: int,
              warmup: int) -> tuple[PairedTiming, list[dict[str, Any]]]:
    """Matched pairs of the two arms; returns the timing and, per kept pair and arm, the disk reads per object."""
    counts: dict[int, dict[str, Any]] = {}

    def run_arm(arm: str, round_index: int) -> dict[str, list[float]]:
        tier.reset_counters()
        parts = time_group_arm(arm, round_index, privates, lambda ps: forced_eviction(tier, catalog, ps),
                               lambda ps, group: read_once(tier, catalog, ps, group))
        disk_reads = tier.counters["disk_reads"]
        counts.setdefault(round_index, {})[arm] = {
            "reads_per_object": [disk_reads[e.key] for e in catalog.entries], "joins": tier.counters["joins"],
            "ram_hits": tier.counters["ram_hits"]}
        return parts

    timing = group_pairs(run_arm, pairs, warmup)
    return timing, [counts[i] for i in range(warmup, warmup + pairs)]


def read_once_case(res: Result, setup: Setup, pairs: int, warmup: int) -> None:
    n_children = len(setup.workload.children)
    with res.case("read-once", {"children": n_children, "concurrent": True, "arms": list(ARMS)}) as case:
        tier = TieredObjects(setup.root / "tier", route=routes.DirectIORoute(io=setup.io))
        raw = setup.export.raw.cpu()
        for entry in setup.export.catalog.entries:
            tier.put(entry.key, raw[entry.offset:entry.offset + entry.nbytes].contiguous().numpy(), keep=False,
                     algorithm=setup.sec["algorithm"], pad_to=setup.sec.get("pad_to"))
        privates = [torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
                    for _ in setup.workload.children]
        timing, reads = run_pairs(tier, setup.export.catalog, privates, pairs, warmup)
        res.timings["read_once"] = timing.to_dict()
        case.record("reads", reads)
        once = [r["read-once"]["reads_per_object"] for r in reads]
        forced = [r["forced-eviction"]["reads_per_object"] for r in reads]
        case.check("read_once_one_read_per_object", all(x == 1 for r in once for x in r), value=once)
        case.check("forced_eviction_reads_per_child", all(x == n_children for r in forced for x in r), value=forced)
        res.extra["reads_per_object_read_once"] = max(x for r in once for x in r)
        res.extra["reads_per_object_forced"] = max(x for r in forced for x in r)
        res.extra["paired_read_once"] = paired_summary(timing)
        # every child's private copy from one more read-once group
        tier.reset_counters()
        read_once(tier, setup.export.catalog, privates, "verify")
        # the private copies hold exactly the leader's bytes (the service case also repairs from them)
        want = setup.export.raw.to(setup.device)
        same = sum(bool(torch.equal(p, want)) for p in privates)
        case.check("private_copies_equal_leader_bytes", same == n_children, value=same)
        case.check("private_copies_distinct_memory", len({p.data_ptr() for p in privates}) == n_children)
        case.record("tier", tier.describe())
        tier.route.close()
