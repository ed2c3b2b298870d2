"""The service's store of shared originals: immutable, refcounted objects in a host-RAM tier.

An original is written once, by the copy that saves it (state "pending", invisible to loads), and becomes
readable when that copy has drained ("committed"). After commit its bytes never change: a load copies them
into the client's own registered memory, so every child that mutates gets its private copy and the original
stays as committed (`verify()` re-hashes it to prove so). `pins` count the loads in flight; eviction never
frees a pinned object. RetentionPolicy decides what an eviction may drop — later waves plug in group
retention (keep a source across the children of a group) and a disk tier with singleflight loads here.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from kmesh.service.errors import CapacityError, ObjectExistsError, ObjectMissingError


@dataclass(eq=False)
class Original:
    key: bytes
    nbytes: int
    layout: dict[str, Any]
    geometry: bytes
    tensor: torch.Tensor
    state: str = "pending"   # pending -> committed (or aborted: removed)
    pins: int = 0
    sha256: str | None = None  # at commit
    seq: int = 0               # order of creation: the cursor of `list objects`

    def digest(self) -> str:
        return hashlib.sha256(self.tensor.numpy().tobytes()).hexdigest()

    def describe(self, verify: bool = False) -> dict[str, Any]:
        d = {"key": self.key, "nbytes": self.nbytes, "state": self.state, "pins": self.pins, "sha256": self.sha256}
        if verify and self.state == "committed":
            d["sha256_now"] = self.digest()
        return d


class RetentionPolicy:
    """Default: any unpinned committed object may be evicted."""

    def may_evict(self, obj: Original) -> bool:
        return obj.pins == 0 and obj.state == "committed"


class Store:
    def __init__(self, capacity_bytes: int, pinned: bool = False, retention: RetentionPolicy | None = None,
                 max_objects: int = 65536) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_objects = max_objects  # every list the service keeps has a limit; this is the store's
        self.pinned = pinned  # page-locked host memory (fast async H2D/D2H on a CUDA service)
        self.retention = retention or RetentionPolicy()
        self.objects: dict[bytes, Original] = {}
        self.used_bytes = 0
        self.counters = {"committed": 0, "aborted": 0, "evicted": 0}
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
        obj.state = "committed"
        obj.sha256 = obj.digest()
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
        obj.pins += 1
        return obj

    def release(self, obj: Original) -> None:
        obj.pins -= 1
        assert obj.pins >= 0, "unbalanced release"

    def evict(self, key: bytes | None = None) -> dict[str, list[bytes]]:
        """Drop what the retention policy allows (one key, or all); pinned objects are kept and reported."""
        keys = [key] if key is not None else list(self.objects)
        if key is not None and key not in self.objects:
            raise ObjectMissingError(f"no object {key[:64]!r}")
        evicted, kept = [], []
        for k in keys:
            obj = self.objects[k]
            if self.retention.may_evict(obj):
                self._drop(obj)
                self.counters["evicted"] += 1
                evicted.append(k)
            else:
                kept.append(k)
        return {"evicted": evicted, "kept": kept}

    def _drop(self, obj: Original) -> None:
        del self.objects[obj.key]
        self.used_bytes -= obj.nbytes

    def summary(self) -> dict[str, Any]:
        """Totals only (bounded); the objects themselves are listed page by page (`list objects`)."""
        return {"nobjects": len(self.objects), "max_objects": self.max_objects, "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes, "pins": sum(o.pins for o in self.objects.values()),
                "counters": dict(self.counters)}
