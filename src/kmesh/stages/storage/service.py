"""Read-once serving through the cache service: its disk tier, group retention and singleflight read-backs.

The leader's segments are saved through the service (each commit spills an object file). Four children, each a
client connection of its own with its own registered staging buffer, load the four objects:
  forced-eviction  one child at a time, `evict tier=ram force` before each: every child's loads read the disk
  read-once        one cold start (`evict tier=ram force`), the keys retained for the group, then the four
                   children load at once (threads released by one barrier); the service reads each object once
                   on its reader pool, off its loop thread: a load arriving while that read runs joins it (its
                   reply parked until the read ends), one arriving after finds the retained RAM copy
`disk_reads` and `joins` per object come from the service's own store listing (per pair and arm: `reads`, and
`joins` beside them — how many of the read-once loads shared a read in flight depends on how close together
the children's requests arrived; it is measured, not assumed). Each child copies its staging buffer into a
private buffer; the case then restores and repairs every child from its private copy and compares it bit for bit
with the in-process reference. Timed: `load` per child, `group` (serial sum / concurrent wall time), matched
pairs, alternating order (kmesh.stages.storage.readonce.group_pairs).
"""
from __future__ import annotations

import contextlib
import shutil
import threading
import time
from typing import Any, Callable

import torch

from kmesh.bench import PairedTiming
from kmesh.harness.child import ChildOutcome, new_cache, outcome_of, prefill_and_decode, restore_child
from kmesh.harness.leader import Export
from kmesh.harness.service import Harness
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import Child
from kmesh.kv.sources import ServiceSegments
from kmesh.model.quality import compare_states, identical
from kmesh.result import Result
from kmesh.stages.storage.readonce import ARMS, concurrent_children, group_pairs, time_group_arm
from kmesh.stages.storage.setup import Setup, paired_summary
from kmesh.storage.routes import drop_page_cache


class ServiceChildren:
    """The service, the leader's saved originals, and one connection + staging registration per child."""

    def __init__(self, harness: Harness, export: Export, device: torch.device, children: int) -> None:
        self.harness, self.export, self.children = harness, export, children
        self.stack = contextlib.ExitStack()
        self.leader = self.stack.enter_context(ServiceSide(harness, export, device))
        self.leader.save_leader()
        self.sides = [self.stack.enter_context(ServiceSide(harness, export, device)) for _ in range(children)]
        self.staging = [self.stack.enter_context(side.staging(f"read-once-{i}")) for i, side in enumerate(self.sides)]
        self._gate = threading.Lock()   # the harness gate's counters are not thread-safe

    def after_accept(self, side: ServiceSide) -> Callable[[int, int], None]:
        def go(req: int, nbytes: int) -> None:
            with self._gate:
                side.after_accept(req, nbytes)
        return go

    def disk_reads(self) -> dict[bytes, int]:
        return {o["key"]: o.get("disk_reads", 0) for o in self.harness.status()["store"]["objects"]}

    def counts(self) -> dict[bytes, tuple[int, int]]:
        """Per object, as the service counts them: (disk reads, loads that joined a read in flight)."""
        return {o["key"]: (o.get("disk_reads", 0), o.get("joins", 0))
                for o in self.harness.status()["store"]["objects"]}

    def cold(self) -> None:
        self.harness.admin.evict(tier="ram", force=True)
        if self.harness.service_disk_dir is not None:   # and the OS page cache of the object files: a cold read
            drop_page_cache(sorted(self.harness.service_disk_dir.glob("*.kmo")))

    def load_child(self, index: int, private: torch.Tensor) -> float:
        side, staging = self.sides[index], self.staging[index]
        src = ServiceSegments(side.client, staging.reg, self.after_accept(side))
        start = time.perf_counter()
        for entry in self.export.catalog.entries:
            src.load(entry, staging.tensor)
        private.copy_(staging.tensor)
        if private.device.type == "cuda":
            torch.cuda.synchronize(private.device)
        return time.perf_counter() - start

    def forced_eviction(self, privates: list[torch.Tensor]) -> list[float]:
        out = []
        for index, private in enumerate(privates):
            self.cold()
            out.append(self.load_child(index, private))
        return out

    def read_once(self, privates: list[torch.Tensor], group: str) -> list[float]:
        self.cold()
        for entry in self.export.catalog.entries:
            self.harness.admin.retain(group, entry.key)
        try:
            return concurrent_children(len(privates), lambda i: self.load_child(i, privates[i]), "svc-read-once")
        finally:
            self.harness.admin.unretain(group)

    def run_pairs(self, privates: list[torch.Tensor], pairs: int, warmup: int) -> tuple[PairedTiming, list[Any]]:
        """Matched pairs of the two arms; per kept pair, each arm's disk reads per object and (under `joins`)
        the loads per object that joined a read in flight, as the service counted them."""
        keys = [e.key for e in self.export.catalog.entries]
        counts: dict[int, dict[str, Any]] = {}

        def run_arm(arm: str, round_index: int) -> dict[str, list[float]]:
            before = self.counts()
            parts = time_group_arm(arm, round_index, privates, self.forced_eviction, self.read_once)
            after = self.counts()
            record = counts.setdefault(round_index, {"joins": {}})
            record[arm] = [after[k][0] - before.get(k, (0, 0))[0] for k in keys]
            record["joins"][arm] = [after[k][1] - before.get(k, (0, 0))[1] for k in keys]
            return parts

        timing = group_pairs(run_arm, pairs, warmup)
        return timing, [counts[i] for i in range(warmup, warmup + pairs)]

    def close(self) -> None:
        self.stack.close()


def _repair_from(setup: Setup, child: Child, private: torch.Tensor, source: str) -> ChildOutcome:
    """Restore + repair one child from its private copy of the segments."""
    cache = new_cache(setup.ctx, child)
    restored = restore_child(cache, setup.ctx.catalog, private, child, setup.ctx.runner, setup.ctx.restore_backend)
    blended, tokens = prefill_and_decode(setup.ctx, child, cache, restored, "repair")
    return outcome_of(setup.ctx, child, source, "repair", cache, restored, blended, tokens, None, [])


def read_once_service_case(res: Result, setup: Setup, refs: dict[str, ChildOutcome], pairs: int,
                           warmup: int) -> None:
    n_children = len(setup.workload.children)
    eq = setup.cfg.section("equivalence")
    with res.case("read-once-service", {"children": n_children, "concurrent": True, "arms": list(ARMS),
                                        "service": "real process, disk tier + group retention"}) as case:
        disk = setup.root / "service-disk"
        shutil.rmtree(disk, ignore_errors=True)
        with Harness(device=str(setup.device), heartbeat_timeout_s=float(eq["heartbeat_timeout_s"]),
                     chunk_bytes=int(eq["chunk_bytes"]), store_bytes=1 << 31, disk_dir=disk) as harness:
            group = ServiceChildren(harness, setup.export, setup.device, n_children)
            try:
                case.check("leader_spilled_to_disk",
                           len(list(disk.glob("*.kmo"))) == len(setup.export.catalog.entries))
                privates = [torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
                            for _ in range(n_children)]
                timing, reads = group.run_pairs(privates, pairs, warmup)
                res.timings["read_once_service"] = timing.to_dict()
                case.record("reads", reads)
                once = [r["read-once"] for r in reads]
                forced = [r["forced-eviction"] for r in reads]
                case.check("read_once_one_read_per_object", all(x == 1 for r in once for x in r), value=once)
                case.check("forced_eviction_reads_per_child", all(x == n_children for r in forced for x in r),
                           value=forced)
                res.extra["reads_per_object_read_once_service"] = max(x for r in once for x in r)
                # loads that found their object's read-back in flight in the service and joined it (the rest
                # found the RAM copy the first read installed): per pair, summed over the objects
                res.extra["joins_read_once_service"] = [sum(r["joins"]["read-once"]) for r in reads]
                res.extra["paired_read_once_service"] = paired_summary(timing)
                group.read_once(privates, "verify")
                same = sum(identical(compare_states(refs[child.name],
                                                    _repair_from(setup, child, private, "service:read-once")))
                           for child, private in zip(setup.workload.children, privates))
                case.check("private_copies_repair_to_reference", same == n_children, value=same)
            finally:
                group.close()
            case.check("service_no_leaks", harness.no_leaks(), value=harness.leaks())
