"""Read-once serving (beyond the write-up): four concurrent children share one disk read per object.

Arm A `forced-eviction`: children one at a time, every RAM copy evicted (and the page cache dropped) before each,
singleflight off — storage is read once per object per child (4 reads per object), as the route benchmark does.
Arm B `read-once`: one cold start for the group, then the four children load concurrently (threads released by
one barrier) through singleflight, the group's keys retained until every child has its private copy —
storage is read once per object. Each child copies the shared immutable bytes into its own private buffer; the
stage then restores and repairs every child from that private copy and compares it bit for bit with the
reference. Timed: `load` per child (its gets + copies into its private buffer, wall clock; per pair the median
over children) and `group` (all four children's loads: the sum of the serial children / the wall time of the
concurrent group); matched pairs, alternating order.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Callable

import torch

from kmesh.bench import PairedTiming
from kmesh.segments import Catalog
from kmesh.storage.routes import drop_page_cache
from kmesh.storage.tier import TieredObjects

ARMS = ("forced-eviction", "read-once")


def _load_child(tier: TieredObjects, catalog: Catalog, private: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for e in catalog.entries:
        private[e.offset:e.offset + e.nbytes].copy_(tier.get(e.key))
    if private.device.type == "cuda":
        torch.cuda.synchronize(private.device)
    return time.perf_counter() - t0


def forced_eviction(tier: TieredObjects, catalog: Catalog, privates: list[torch.Tensor]) -> list[float]:
    tier.singleflight_enabled = False
    out = []
    for p in privates:
        tier.evict(force=True)
        drop_page_cache([tier.path(e.key) for e in catalog.entries])
        out.append(_load_child(tier, catalog, p))
    return out


def concurrent_children(n: int, load: Callable[[int], float], name: str) -> list[float]:
    """Run load(0..n-1) in n threads released together by a barrier (simultaneous loads, so singleflight has
    something to join); the per-child seconds, or the first child's exception re-raised in this thread."""
    barrier = threading.Barrier(n)
    times: list[float | None] = [None] * n
    errors: list[BaseException] = []

    def child(i: int) -> None:
        try:
            barrier.wait()
            times[i] = load(i)
        except BaseException as e:  # re-raised below, in the stage's thread
            errors.append(e)

    threads = [threading.Thread(target=child, args=(i,), name=f"{name}-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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
    """Matched pairs of the two arms; returns the timing and, per pair and arm, the disk reads per object."""
    timing = PairedTiming(*ARMS, warmup=warmup)
    timing.parents.update(load=None, group=None)
    reads: list[dict[str, Any]] = []
    for i in range(warmup + pairs):
        order = list(ARMS) if (i - warmup) % 2 == 0 else list(reversed(ARMS))
        rec: dict[str, Any] = {"order": order}
        counts: dict[str, Any] = {}
        for arm in order:
            tier.reset_counters()
            for p in privates:
                p.fill_(0xA5)
            t0 = time.perf_counter()
            t = forced_eviction(tier, catalog, privates) if arm == ARMS[0] else \
                read_once(tier, catalog, privates, f"group-{i}")
            wall = time.perf_counter() - t0
            # serial children: the group is their sum (evictions between them excluded); concurrent: its wall time
            rec[arm] = {"load": t, "group": [sum(t) if arm == ARMS[0] else wall]}
            c: Counter = tier.counters["disk_reads"]
            counts[arm] = {"reads_per_object": [c[e.key] for e in catalog.entries], "joins": tier.counters["joins"],
                           "ram_hits": tier.counters["ram_hits"]}
        if i >= warmup:
            timing.pairs.append(rec)
            reads.append(counts)
    return timing, reads
