"""The service's store of shared originals: immutable, refcounted objects in a host-RAM tier.

An original is written once, by the copy that saves it (state "pending", invisible to loads), and becomes
readable when that copy has drained ("committed"). After commit its bytes never change: a load copies them
into the client's own registered memory, so every child that mutates gets its private copy and the original
stays as committed (`verify()` re-hashes it to prove so). `pins` count the loads in flight; eviction never
frees a pinned object. RetentionPolicy decides what an eviction may drop; GroupRetention keeps the sources of a
group (retain/unretain) across its children.

Disk tier (`disk_dir`): every commit also writes the original as an object file (kmesh.storage: atomic,
digest over the padded object). `evict(tier="ram")` drops only the RAM copy; the next `acquire` reads the file
back (O_DIRECT, verified) into RAM. The service handles one request at a time on one thread, so concurrent loads
of one object are joined by construction: the first acquire reads it, the others find the RAM copy (and
retention keeps it there across the group) — `disk_reads` per object counts what storage really served.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kmesh.service.errors import CapacityError, ObjectExistsError, ObjectMissingError


@dataclass(eq=False)
class Original:
    key: bytes
    nbytes: int
    layout: dict[str, Any]
    geometry: bytes
    tensor: torch.Tensor | None   # None: only the disk tier holds it (RAM copy evicted)
    state: str = "pending"   # pending -> committed (or aborted: removed)
    pins: int = 0
    sha256: str | None = None  # at commit
    seq: int = 0               # order of creation: the cursor of `list objects`
    on_disk: bool = False      # an object file holds it (disk tier)
    disk_reads: int = 0        # times the RAM copy was read back from that file

    @property
    def in_ram(self) -> bool:
        return self.tensor is not None

    def digest(self) -> str:
        return hashlib.sha256(self.tensor.numpy().tobytes()).hexdigest()

    def describe(self, verify: bool = False) -> dict[str, Any]:
        d = {"key": self.key, "nbytes": self.nbytes, "state": self.state, "pins": self.pins, "sha256": self.sha256,
             "in_ram": self.in_ram, "on_disk": self.on_disk, "disk_reads": self.disk_reads}
        if verify and self.state == "committed" and self.in_ram:
            d["sha256_now"] = self.digest()
        return d


def _plain(v: Any) -> Any:
    """JSON-safe copy of a layout descriptor (bytes as hex) for the object file's header."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v.hex() if isinstance(v, (bytes, bytearray)) else v


class RetentionPolicy:
    """Default: any unpinned committed object may be evicted."""

    def may_evict(self, obj: Original) -> bool:
        return obj.pins == 0 and obj.state == "committed"


class GroupRetention(RetentionPolicy):
    """Objects retained by a group (the children that share them) are kept by ordinary eviction; a forced
    eviction (a benchmark's cold read) still drops their RAM copy."""

    def __init__(self, max_groups: int = 1024) -> None:
        self.groups: dict[str, set[bytes]] = {}
        self.max_groups = max_groups

    def retain(self, group: str, key: bytes) -> None:
        if group not in self.groups and len(self.groups) >= self.max_groups:
            raise CapacityError(f"{len(self.groups)} retention groups, limit {self.max_groups}")
        self.groups.setdefault(group, set()).add(key)

    def unretain(self, group: str) -> int:
        return len(self.groups.pop(group, ()))

    def retained(self, key: bytes) -> bool:
        return any(key in g for g in self.groups.values())

    def may_evict(self, obj: Original) -> bool:
        return super().may_evict(obj) and not self.retained(obj.key)


class Store:
    def __init__(self, capacity_bytes: int, pinned: bool = False, retention: RetentionPolicy | None = None,
                 max_objects: int = 65536, disk_dir: Path | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_objects = max_objects  # every list the service keeps has a limit; this is the store's
        self.pinned = pinned  # page-locked host memory (fast async H2D/D2H on a CUDA service)
        self.retention = retention or GroupRetention()
        self.objects: dict[bytes, Original] = {}
        self.used_bytes = 0
        self.counters = {"committed": 0, "aborted": 0, "evicted": 0, "evicted_ram": 0, "disk_reads": 0,
                         "disk_writes": 0}
        self.disk = None
        if disk_dir is not None:
            from kmesh.storage.tier import DiskTier

            self.disk = DiskTier(Path(disk_dir))
        self._seq = itertools.count(1)

    def begin_put(self, key: bytes, nbytes: int, layout: dict[str, Any], geometry: bytes) -> Original:
        if key in self.objects:
            raise ObjectExistsError(f"object {key[:64]!r} exists ({self.objects[key].state}); originals are "
                                    f"immutable, evict it first")
        if len(self.objects) >= self.max_objects:
            raise CapacityError(f"store full: {len(self.objects)} objects, limit {self.max_objects}")
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise CapacityError(f"store full: {self.used_bytes} + {nbytes} > {self.capacity_bytes} bytes")
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        obj = Original(key, nbytes, layout, geometry, t, seq=next(self._seq))
        self.objects[key] = obj
        self.used_bytes += nbytes
        return obj

    def commit(self, obj: Original) -> None:
        sha = obj.digest()
        if self.disk is not None:   # spilled before it becomes visible: a failed write aborts the save
            self.disk.write(obj.key, obj.tensor.numpy(), {"service_layout": _plain(obj.layout)})
            obj.on_disk = True
            self.counters["disk_writes"] += 1
        obj.state = "committed"
        obj.sha256 = sha
        self.counters["committed"] += 1

    def abort(self, obj: Original) -> None:
        """The saving copy failed or was cancelled: the partial object never becomes visible."""
        self._drop(obj)
        self.counters["aborted"] += 1

    def acquire(self, key: bytes) -> Original:
        obj = self.objects.get(key)
        if obj is None or obj.state != "committed":
            raise ObjectMissingError(f"no committed object {key[:64]!r}"
                                     + (" (its save is still in flight)" if obj is not None else ""))
        if not obj.in_ram:
            self._read_back(obj)
        obj.pins += 1
        return obj

    def _read_back(self, obj: Original) -> None:
        """The RAM copy from the object file, verified against the file's digest and the commit's sha256."""
        from kmesh.storage.errors import StorageError

        if self.used_bytes + obj.nbytes > self.capacity_bytes:
            raise CapacityError(f"store full: {self.used_bytes} + {obj.nbytes} > {self.capacity_bytes} bytes "
                                f"(reading {obj.key[:64]!r} back from disk)")
        t = torch.empty(obj.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        try:
            self.disk.read(obj.key, out=t)
        except StorageError as e:
            raise ObjectMissingError(f"object {obj.key[:64]!r} could not be read back from disk: "
                                     f"{type(e).__name__}: {e}") from e
        obj.tensor = t
        if obj.digest() != obj.sha256:
            obj.tensor = None
            raise ObjectMissingError(f"object {obj.key[:64]!r} read back from disk differs from its commit")
        self.used_bytes += obj.nbytes
        obj.disk_reads += 1
        self.counters["disk_reads"] += 1

    def release(self, obj: Original) -> None:
        obj.pins -= 1
        assert obj.pins >= 0, "unbalanced release"

    def evict(self, key: bytes | None = None, tier: str = "all", force: bool = False) -> dict[str, list[bytes]]:
        """Drop what the retention policy allows (one key, or all); pinned objects are kept and reported.
        tier="ram": only RAM copies of objects the disk tier holds (they stay loadable); force=True ignores
        group retention (never pins)."""
        if tier not in ("all", "ram"):
            raise ValueError(f"tier must be 'all' or 'ram', not {tier!r}")
        keys = [key] if key is not None else list(self.objects)
        if key is not None and key not in self.objects:
            raise ObjectMissingError(f"no object {key[:64]!r}")
        evicted, kept = [], []
        for k in keys:
            obj = self.objects[k]
            allowed = RetentionPolicy.may_evict(self.retention, obj) if force else self.retention.may_evict(obj)
            if tier == "ram" and not (obj.on_disk and obj.in_ram):
                allowed = False
            if not allowed:
                kept.append(k)
            elif tier == "ram":
                obj.tensor = None
                self.used_bytes -= obj.nbytes
                self.counters["evicted_ram"] += 1
                evicted.append(k)
            else:
                self._drop(obj)
                self.counters["evicted"] += 1
                evicted.append(k)
        return {"evicted": evicted, "kept": kept}

    def _drop(self, obj: Original) -> None:
        del self.objects[obj.key]
        if obj.in_ram:
            self.used_bytes -= obj.nbytes
        if obj.on_disk and self.disk is not None:
            self.disk.remove(obj.key)

    def summary(self) -> dict[str, Any]:
        """Totals only (bounded); the objects themselves are listed page by page (`list objects`)."""
        return {"nobjects": len(self.objects), "max_objects": self.max_objects, "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes, "pins": sum(o.pins for o in self.objects.values()),
                "counters": dict(self.counters)}
