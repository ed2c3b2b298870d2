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
private buffer (its own repaired state is built from that later). Timed: `load` per child, `group` (serial
sum / concurrent wall time), matched pairs, alternating order.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from kmesh.bench import PairedTiming
from kmesh.segments import Export, ServiceSegments
from kmesh.service.harness import Harness
from kmesh.service_side import ServiceSide
from kmesh.stages.storage_readonce import concurrent_children
from kmesh.storage.routes import drop_page_cache

ARMS = ("forced-eviction", "read-once")


class ServiceChildren:
    """The service, the leader's saved originals, and one connection + staging registration per child."""

    def __init__(self, h: Harness, export: Export, device: torch.device, n: int) -> None:
        self.h, self.export, self.n = h, export, n
        self.stack = contextlib.ExitStack()
        self.leader = self.stack.enter_context(ServiceSide(h, export, device))
        self.leader.save_leader()
        self.sides = [self.stack.enter_context(ServiceSide(h, export, device)) for _ in range(n)]
        self.staging = [self.stack.enter_context(s.staging(f"read-once-{i}")) for i, s in enumerate(self.sides)]
        self._gate = threading.Lock()   # the harness gate's counters are not thread-safe

    def after_accept(self, side: ServiceSide) -> Any:
        def go(req: int, nbytes: int) -> None:
            with self._gate:
                side.after_accept(req, nbytes)
        return go

    def disk_reads(self) -> dict[bytes, int]:
        return {o["key"]: o.get("disk_reads", 0) for o in self.h.status()["store"]["objects"]}

    def counts(self) -> dict[bytes, tuple[int, int]]:
        """Per object, as the service counts them: (disk reads, loads that joined a read in flight)."""
        return {o["key"]: (o.get("disk_reads", 0), o.get("joins", 0)) for o in self.h.status()["store"]["objects"]}

    def cold(self) -> None:
        self.h.admin.evict(tier="ram", force=True)
        if self.h.service_disk_dir is not None:   # and the OS page cache of the object files: a cold read
            drop_page_cache(sorted(self.h.service_disk_dir.glob("*.kmo")))

    def load_child(self, i: int, private: torch.Tensor) -> float:
        side, st = self.sides[i], self.staging[i]
        src = ServiceSegments(side.client, st.reg, self.after_accept(side))
        t0 = time.perf_counter()
        for e in self.export.catalog.entries:
            src.load(e, st.tensor)
        private.copy_(st.tensor)
        if private.device.type == "cuda":
            torch.cuda.synchronize(private.device)
        return time.perf_counter() - t0

    def forced_eviction(self, privates: list[torch.Tensor]) -> list[float]:
        out = []
        for i, p in enumerate(privates):
            self.cold()
            out.append(self.load_child(i, p))
        return out

    def read_once(self, privates: list[torch.Tensor], group: str) -> list[float]:
        self.cold()
        for e in self.export.catalog.entries:
            self.h.admin.retain(group, e.key)
        try:
            return concurrent_children(len(privates), lambda i: self.load_child(i, privates[i]), "svc-read-once")
        finally:
            self.h.admin.unretain(group)

    def run_pairs(self, privates: list[torch.Tensor], pairs: int, warmup: int) -> tuple[PairedTiming, list[Any]]:
        timing = PairedTiming(*ARMS, warmup=warmup)
        timing.parents.update(load=None, group=None)
        reads: list[Any] = []
        for i in range(warmup + pairs):
            order = list(ARMS) if (i - warmup) % 2 == 0 else list(reversed(ARMS))
            rec: dict[str, Any] = {"order": order}
            counts: dict[str, Any] = {"joins": {}}
            for arm in order:
                before = self.counts()
                for p in privates:
                    p.fill_(0xA5)
                t0 = time.perf_counter()
                t = self.forced_eviction(privates) if arm == ARMS[0] else self.read_once(privates, f"group-{i}")
                wall = time.perf_counter() - t0
                rec[arm] = {"load": t, "group": [sum(t) if arm == ARMS[0] else wall]}
                after = self.counts()
                keys = [e.key for e in self.export.catalog.entries]
                counts[arm] = [after[k][0] - before.get(k, (0, 0))[0] for k in keys]
                counts["joins"][arm] = [after[k][1] - before.get(k, (0, 0))[1] for k in keys]
            if i >= warmup:
                timing.pairs.append(rec)
                reads.append(counts)
        return timing, reads

    def close(self) -> None:
        self.stack.close()
