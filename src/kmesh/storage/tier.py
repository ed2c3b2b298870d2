"""A host-RAM tier over a disk tier of object files: explicit eviction, singleflight loads, group retention.

    tier = TieredObjects(directory, route=DirectIORoute())
    tier.put(key, payload, layout)            # object file written (atomic); RAM copy kept unless keep=False
    data = tier.get(key)                      # RAM hit, or ONE verified disk read however many threads ask at once
    tier.retain("group-1", keys)              # kept across the children of a group: evict() leaves them
    tier.evict()                              # drop unretained RAM copies; evict(force=True) drops every one
    tier.counters["disk_reads"][key]          # how often storage was really read

The RAM copy is immutable (callers copy out of it into their private memory). Every disk read is verified
(header, digest, file unchanged) before the copy becomes visible; a failed read leaves nothing in RAM and every
joined caller gets the same error.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, TypeVar

import torch

from kmesh.storage.errors import ObjectMismatchError, ObjectNotFoundError, StorageError
from kmesh.storage.objfile import Header, write_object
from kmesh.storage.routes import DirectIORoute, Route

T = TypeVar("T")


@dataclass
class _Call(Generic[T]):
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    joined: int = 0


class Singleflight:
    """Concurrent calls for one key share one execution: the first runs fn, the others wait for its outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Hashable, _Call[Any]] = {}
        self.leaders = 0
        self.joins = 0

    def do(self, key: Hashable, fn: Callable[[], T]) -> tuple[T, bool]:
        """(value, joined): joined is True when this caller waited for another's execution."""
        with self._lock:
            call = self._calls.get(key)
            if call is not None:
                call.joined += 1
                self.joins += 1
                leader = False
            else:
                call = self._calls[key] = _Call()
                self.leaders += 1
                leader = True
        if not leader:
            call.done.wait()
            if call.error is not None:
                raise call.error
            return call.value, True
        try:
            call.value = fn()
        except BaseException as e:
            call.error = e
            raise
        finally:
            with self._lock:
                del self._calls[key]
            call.done.set()
        return call.value, False


class DiskTier:
    """Object files in one directory, one per key: written atomically, read through a route and verified."""

    def __init__(self, directory: Path, route: Route | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.route = route or DirectIORoute()
        self._io_lock = threading.Lock()          # one route (one landing buffer) reads at a time
        self.reads: Counter = Counter()

    def path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.kmo"

    def write(self, key: bytes, payload: Any, layout: dict[str, Any] | None = None, **kw: Any) -> Header:
        return write_object(self.path(key), payload, key, layout, **kw)

    def read(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
        """The verified payload of key's object (into `out` if given: a host uint8 tensor of the payload size)."""
        path = self.path(key)
        if not path.exists():
            raise ObjectNotFoundError(f"no object {key[:64]!r} in {self.directory}")
        with self._io_lock:
            with self.route.open(path) as f:
                h = f.header
                if h.key != key:
                    raise ObjectMismatchError(f"{path} holds {h.key[:64]!r}, not {key[:64]!r}")
                if out is not None and out.numel() != h.payload_nbytes:
                    raise ObjectMismatchError(f"{path}: {h.payload_nbytes} B payload, {out.numel()} B expected")
                land = self.route.landing(h.padded_nbytes)
                self.route.read(f, land)
                h.verify(self.route.host_bytes(land), str(path))
                f.check_unchanged()
                t = out.copy_(land[:h.payload_nbytes]) if out is not None else land[:h.payload_nbytes].clone()
            self.reads[key] += 1
        return t

    def remove(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def close(self) -> None:
        self.route.close()


class TieredObjects:
    def __init__(self, directory: Path, route: Route | None = None, singleflight: bool = True) -> None:
        self.disk = DiskTier(directory, route)
        self.directory, self.route = self.disk.directory, self.disk.route
        self.singleflight_enabled = singleflight
        self._flight = Singleflight()
        self._lock = threading.Lock()
        self._ram: dict[bytes, torch.Tensor] = {}
        self._retained: dict[str, set[bytes]] = {}
        self.counters: dict[str, Any] = {"disk_reads": Counter(), "ram_hits": 0, "joins": 0, "evicted": 0}

    def path(self, key: bytes) -> Path:
        return self.disk.path(key)

    # -- writes --------------------------------------------------------------------------------------
    def put(self, key: bytes, payload: Any, layout: dict[str, Any] | None = None, keep: bool = True,
            **kw: Any) -> Header:
        h = self.disk.write(key, payload, layout, **kw)
        with self._lock:
            if keep:
                self._ram[key] = torch.frombuffer(bytearray(memoryview(payload).cast("B")), dtype=torch.uint8)
            else:
                self._ram.pop(key, None)
        return h

    # -- reads ---------------------------------------------------------------------------------------
    def in_ram(self, key: bytes) -> bool:
        with self._lock:
            return key in self._ram

    def get(self, key: bytes) -> torch.Tensor:
        """The object's payload bytes (immutable: copy out of it)."""
        with self._lock:
            t = self._ram.get(key)
            if t is not None:
                self.counters["ram_hits"] += 1
                return t
        if not self.singleflight_enabled:
            return self._load(key)
        t, joined = self._flight.do(key, lambda: self._load(key))
        if joined:
            with self._lock:
                self.counters["joins"] += 1
        return t

    def _load(self, key: bytes) -> torch.Tensor:
        with self._lock:                            # a caller that lost the race to a finished load: a hit
            t = self._ram.get(key)
            if t is not None:
                self.counters["ram_hits"] += 1
                return t
        t = self.disk.read(key)
        with self._lock:
            self.counters["disk_reads"][key] += 1
            self._ram[key] = t
        return t

    # -- eviction and retention -------------------------------------------------------------------------
    def retain(self, group: str, keys: list[bytes]) -> None:
        with self._lock:
            self._retained.setdefault(group, set()).update(keys)

    def release(self, group: str) -> None:
        with self._lock:
            if self._retained.pop(group, None) is None:
                raise StorageError(f"no retention group {group!r}")

    def retained(self) -> set[bytes]:
        with self._lock:
            return set().union(*self._retained.values()) if self._retained else set()

    def evict(self, key: bytes | None = None, force: bool = False) -> list[bytes]:
        """Drop RAM copies (the object files stay): unretained ones, or every one with force=True."""
        with self._lock:
            keep = set() if force else (set().union(*self._retained.values()) if self._retained else set())
            keys = [key] if key is not None else list(self._ram)
            gone = [k for k in keys if k in self._ram and k not in keep]
            for k in gone:
                del self._ram[k]
            self.counters["evicted"] += len(gone)
            return gone

    def reset_counters(self) -> None:
        with self._lock:
            self.counters = {"disk_reads": Counter(), "ram_hits": 0, "joins": 0, "evicted": 0}

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"directory": str(self.directory), "route": self.route.describe(),
                    "singleflight": self.singleflight_enabled, "in_ram": len(self._ram),
                    "retained": sorted(k.decode(errors="replace") for k in
                                       (set().union(*self._retained.values()) if self._retained else set())),
                    "counters": {**self.counters, "disk_reads": {k.decode(errors="replace"): v for k, v in
                                                                 self.counters["disk_reads"].items()}}}
