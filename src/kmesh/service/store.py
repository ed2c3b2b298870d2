"""The service's store of shared originals: immutable, refcounted objects in a host-RAM tier over a disk tier.

An original is written once, by the copy that saves it (state "pending", invisible to loads), and becomes
readable when that copy has drained ("committed"). After commit its bytes never change: a load copies them
into the client's own registered memory, so every child that mutates gets its private copy and the original
stays as committed (`verify()` re-hashes it to prove so). `pins` count the loads in flight; eviction never
frees a pinned object. RetentionPolicy decides what an eviction may drop; GroupRetention keeps the sources of a
group (retain/unretain) across its children.

Disk tier (`disk_dir`): every commit also writes the original as an object file (kmesh.storage: atomic,
digest over the padded object) whose header carries what re-adopting it needs (`kmesh_service`: the layout
descriptor as base64 msgpack, the geometry digest, the commit sha256). `evict(tier="ram")` drops only the RAM
copy. Reading it back is split so the server can do it off its loop thread (kmesh.service.diskreads):
`begin_read_back` reserves the capacity and marks the object `reading` (no eviction may drop it meanwhile),
the read runs elsewhere, `end_read_back` checks the digest of what was read against the commit and installs
the RAM copy (or returns the capacity and raises DiskReadError). `acquire()` of an evicted object still reads
synchronously, for in-process users; the server never calls it on one. `disk_reads` per object counts what
storage really served, `joins` the loads that shared a read already running.

Making room (`eviction="lru"`, the default): a save or read-back that would take the RAM tier past its high
watermark (a fraction of its capacity) first evicts the least recently used originals that nobody holds — not
pinned by a load, not retained by a group, not being read back or saved — until the RAM in use is at the low
watermark or nothing more may go: an original the disk tier holds (written through at its commit, so nothing is
written now) loses only its RAM copy and stays loadable; without a disk tier it is forgotten (a cache may forget,
never corrupt). The object-count limit makes room the same way, forgetting the least recently used original
(and its file). A save is refused only when no tier can take it, with a CapacityError that says what holds the
room. `eviction="none"`: the store refuses instead (the service's old behaviour). Counters: `lru_spilled` (RAM
copies dropped, on disk), `lru_forgotten` (originals dropped), `lru_refused` (saves or read-backs refused).

Restart: with `adopt=True` (the default) a store over a disk dir that holds object files re-adopts each valid
one as a committed object on disk, not in RAM (its header checked now, its payload digest when it is read
back); a file that is not ours, damaged or truncated is left where it is, not adopted, and listed in
`disk_rejected` (bounded); temp files of an interrupted atomic write (their writer is gone) are removed.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import torch

from kmesh.service.errors import CapacityError, DiskReadError, ObjectExistsError, ObjectMissingError

HEADER_SECTION = "kmesh_service"   # the object file header's section written by this store
HEADER_VERSION = 1
MAX_REJECTED_LISTED = 32            # disk_rejected entries kept for status (the count is complete)
_OBJ_NAME = re.compile(r"^([0-9a-f]*)\.kmo$")
_TMP_NAME = re.compile(r"^\.[0-9a-f]*\.kmo\.tmp-(\d+)-[0-9a-f]+$")   # kmesh.storage.objfile.write_object's
EVICTION_POLICIES = ("lru", "none")


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
    joins: int = 0             # loads that joined a read-back already running instead of reading again
    reading: bool = False      # a read-back is in flight (capacity reserved; not evictable meanwhile)
    adopted: bool = False      # found on disk at start (a previous run's commit)
    fetched: bool = False      # came from the remote tier (another host's commit), verified on arrival
    last_used: int = 0         # the store's use clock at its latest save, load or read-back (LRU order)

    @property
    def in_ram(self) -> bool:
        return self.tensor is not None

    def digest(self) -> str:
        return hashlib.sha256(memoryview(self.tensor.numpy()).cast("B")).hexdigest()

    def describe(self, verify: bool = False) -> dict[str, Any]:
        d = {"key": self.key, "nbytes": self.nbytes, "state": self.state, "pins": self.pins, "sha256": self.sha256,
             "in_ram": self.in_ram, "on_disk": self.on_disk, "disk_reads": self.disk_reads, "joins": self.joins,
             "reading": self.reading, "adopted": self.adopted, "fetched": self.fetched}
        if verify and self.state == "committed" and self.in_ram:
            d["sha256_now"] = self.digest()
        return d


def header_section(obj: Original, sha256: str) -> dict[str, Any]:
    """What the object file's header carries to re-adopt obj exactly (JSON-safe and reversible)."""
    return {HEADER_SECTION: {"v": HEADER_VERSION, "nbytes": obj.nbytes, "sha256": sha256,
                             "geometry": obj.geometry.hex(),
                             "layout": base64.b64encode(msgpack.packb(obj.layout, use_bin_type=True)).decode()}}


class AdoptError(ValueError):
    """An object file the store will not adopt (the message is the reason status reports)."""


def parse_section(header: Any, key: bytes) -> tuple[dict[str, Any], bytes, str, int]:
    """(layout, geometry, sha256, nbytes) from a header written by header_section; AdoptError says why not."""
    from kmesh.service import descriptor
    from kmesh.service.errors import SchemaError

    if header.key != key:
        raise AdoptError(f"the header names key {header.key[:64]!r}, the file name another")
    meta = header.layout.get(HEADER_SECTION)
    if meta is None:
        old = "service_layout" in header.layout
        raise AdoptError("written by an older service (its header cannot be re-adopted)" if old else
                         "not written by the cache service (no kmesh_service header section)")
    if not isinstance(meta, dict) or meta.get("v") != HEADER_VERSION:
        raise AdoptError(f"kmesh_service header version {meta.get('v') if isinstance(meta, dict) else meta!r}, "
                         f"this service writes {HEADER_VERSION}")
    try:
        sha, nbytes = meta["sha256"], meta["nbytes"]
        geometry = bytes.fromhex(meta["geometry"])
        layout = msgpack.unpackb(base64.b64decode(meta["layout"], validate=True), raw=False)
        if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise AdoptError(f"sha256 {str(sha)[:80]!r} is not a hex sha256")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes != header.payload_nbytes:
            raise AdoptError(f"nbytes {nbytes!r} differs from the file's payload of {header.payload_nbytes} B")
        layout = descriptor.validate(layout)
    except (KeyError, TypeError, ValueError, msgpack.UnpackException, SchemaError) as e:
        if isinstance(e, AdoptError):
            raise
        raise AdoptError(f"kmesh_service header section unreadable: {type(e).__name__}: {e}") from e
    if descriptor.geometry_digest(layout) != geometry:
        raise AdoptError("its geometry digest does not match its layout")
    return layout, geometry, sha, nbytes


class RetentionPolicy:
    """Default: any unpinned committed object may be evicted (never one whose read-back is in flight)."""

    def may_evict(self, obj: Original) -> bool:
        return obj.pins == 0 and obj.state == "committed" and not obj.reading


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
                 max_objects: int = 65536, disk_dir: Path | None = None, adopt: bool = True,
                 eviction: str = "lru", high_watermark: float = 1.0, low_watermark: float = 0.9) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {list(EVICTION_POLICIES)}, not {eviction!r}")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1, got low {low_watermark!r}, "
                             f"high {high_watermark!r}")
        self.eviction = eviction
        self.high_watermark, self.low_watermark = high_watermark, low_watermark
        self._clock = itertools.count(1)
        self.capacity_bytes = capacity_bytes
        self.max_objects = max_objects  # every list the service keeps has a limit; this is the store's
        self.pinned = pinned  # page-locked host memory (fast async H2D/D2H on a CUDA service)
        self.retention = retention or GroupRetention()
        self.objects: dict[bytes, Original] = {}
        self.used_bytes = 0
        self.counters = {"committed": 0, "aborted": 0, "evicted": 0, "evicted_ram": 0, "disk_reads": 0,
                         "disk_writes": 0, "disk_read_failures": 0, "joins": 0, "adopted": 0, "disk_rejected": 0,
                         "disk_temp_removed": 0, "lru_spilled": 0, "lru_forgotten": 0, "lru_refused": 0, "fetched": 0}
        self.disk_rejected: list[dict[str, str]] = []   # the first MAX_REJECTED_LISTED: {file, reason}
        self.disk = None
        # called after each commit of this host's own saves (the remote tier publishes them); not for fetched ones
        self.on_commit: Callable[[Original], None] | None = None
        self._seq = itertools.count(1)
        if disk_dir is not None:
            from kmesh.storage.tier import DiskTier

            self.disk = DiskTier(Path(disk_dir))
            self._remove_stale_temps()
            if adopt:
                self._adopt()

    # -- restart ---------------------------------------------------------------------------------------------
    def _reject(self, name: str, reason: str) -> None:
        self.counters["disk_rejected"] += 1
        if len(self.disk_rejected) < MAX_REJECTED_LISTED:
            self.disk_rejected.append({"file": name[:200], "reason": reason[:300]})

    def _remove_stale_temps(self) -> None:
        """Temp files of an atomic write that never reached its rename: their writer is gone, nobody will."""
        for p in self.disk.directory.iterdir():
            m = _TMP_NAME.match(p.name)
            if m is None:
                continue
            try:
                os.kill(int(m.group(1)), 0)
                continue  # its writer still runs (not ours to touch)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            p.unlink(missing_ok=True)
            self.counters["disk_temp_removed"] += 1
            self._reject(p.name, "temp file of an interrupted write: removed")

    def _adopt(self) -> None:
        """Each valid object file of a previous run becomes a committed object on disk (not in RAM)."""
        from kmesh.storage.errors import StorageError
        from kmesh.storage.objfile import ObjectFile

        found = []
        for p in self.disk.directory.iterdir():
            if _TMP_NAME.match(p.name) or not p.is_file():
                continue
            try:
                found.append((p.stat().st_mtime_ns, p.name, p))
            except OSError as e:
                self._reject(p.name, f"cannot stat: {e}")
        for _, name, p in sorted(found):   # creation order survives as well as the file times tell it
            m = _OBJ_NAME.match(name)
            if m is None or len(m.group(1)) % 2:
                self._reject(name, "not a <hex key>.kmo object file")
                continue
            key = bytes.fromhex(m.group(1))
            if len(self.objects) >= self.max_objects:
                self._reject(name, f"store full: {len(self.objects)} objects, limit {self.max_objects}")
                continue
            try:
                with ObjectFile.open(p) as f:
                    layout, geometry, sha, nbytes = parse_section(f.header, key)
            except (StorageError, AdoptError, OSError) as e:
                self._reject(name, f"{type(e).__name__}: {e}")
                continue
            obj = Original(key, nbytes, layout, geometry, None, state="committed", sha256=sha,
                           seq=next(self._seq), on_disk=True, adopted=True)
            self.objects[key] = obj
            self.counters["adopted"] += 1

    # -- writes ----------------------------------------------------------------------------------------------
    def begin_put(self, key: bytes, nbytes: int, layout: dict[str, Any], geometry: bytes) -> Original:
        if key in self.objects:
            raise ObjectExistsError(f"object {key[:64]!r} exists ({self.objects[key].state}); originals are "
                                    f"immutable, evict it first")
        if len(self.objects) >= self.max_objects:
            self._forget_for_a_slot()
        if len(self.objects) >= self.max_objects:
            self.counters["lru_refused"] += self.eviction == "lru"
            raise CapacityError(f"store full: {len(self.objects)} objects, limit {self.max_objects}"
                                + self._held_note())
        if nbytes > self.capacity_bytes:   # no eviction could make room: refuse before evicting anything
            raise CapacityError(f"an original of {nbytes} bytes is larger than the RAM tier "
                                f"({self.capacity_bytes} bytes)")
        self._make_room(nbytes)
        if self.used_bytes + nbytes > self.capacity_bytes:
            self.counters["lru_refused"] += self.eviction == "lru"
            raise CapacityError(f"store full: {self.used_bytes} + {nbytes} > {self.capacity_bytes} bytes"
                                + self._held_note())
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        obj = Original(key, nbytes, layout, geometry, t, seq=next(self._seq), last_used=next(self._clock))
        self.objects[key] = obj
        self.used_bytes += nbytes
        return obj

    def commit(self, obj: Original, sha256: str | None = None) -> None:
        """Make obj visible. sha256: its digest when the caller already checked it (a fetched object)."""
        sha = sha256 or obj.digest()
        if self.disk is not None:   # spilled before it becomes visible: a failed write aborts the save
            self.disk.write(obj.key, obj.tensor.numpy(), header_section(obj, sha))
            obj.on_disk = True
            self.counters["disk_writes"] += 1
        obj.state = "committed"
        obj.sha256 = sha
        self.counters["committed"] += 1
        if self.on_commit is not None and not obj.fetched:
            self.on_commit(obj)

    def install_fetched(self, key: bytes, layout: dict[str, Any], geometry: bytes, payload: bytes,
                        sha256: str) -> Original:
        """A verified object from the remote tier becomes a committed original here (RAM, and the disk tier when
        there is one); CapacityError / ObjectExistsError as for a save."""
        obj = self.begin_put(key, len(payload), layout, geometry)
        try:
            obj.tensor.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
            obj.fetched = True
            self.commit(obj, sha256)
        except BaseException:
            if obj.state != "committed":
                self.abort(obj)
            raise
        self.counters["fetched"] += 1
        return obj

    def abort(self, obj: Original) -> None:
        """The saving copy failed or was cancelled: the partial object never becomes visible."""
        self._drop(obj)
        self.counters["aborted"] += 1

    # -- reads -----------------------------------------------------------------------------------------------
    def lookup(self, key: bytes) -> Original:
        """The committed object (in RAM or only on disk); ObjectMissingError otherwise."""
        obj = self.objects.get(key)
        if obj is None or obj.state != "committed":
            raise ObjectMissingError(f"no committed object {key[:64]!r}"
                                     + (" (its save is still in flight)" if obj is not None else ""))
        return obj

    def acquire(self, key: bytes) -> Original:
        """Pin a committed object for a load. An evicted one is read back here, synchronously (in-process
        users; the server reads back off its loop thread first, through begin/end_read_back)."""
        obj = self.lookup(key)
        if not obj.in_ram:
            t = self.begin_read_back(obj)
            digest, error = None, None
            try:
                self.disk.read(obj.key, out=t)
                digest = hashlib.sha256(memoryview(t.numpy()).cast("B")).hexdigest()
            except Exception as e:  # typed below, by end_read_back
                error = e
            self.end_read_back(obj, t, digest, error)
        obj.pins += 1
        obj.last_used = next(self._clock)
        return obj

    def begin_read_back(self, obj: Original) -> torch.Tensor:
        """Reserve the capacity of obj's RAM copy and mark it reading; returns the tensor to read into."""
        if obj.in_ram or obj.reading or self.disk is None or not obj.on_disk:
            raise ValueError(f"object {obj.key[:64]!r} needs no read-back (in_ram {obj.in_ram}, reading "
                             f"{obj.reading}, on_disk {obj.on_disk})")
        if obj.nbytes <= self.capacity_bytes:
            self._make_room(obj.nbytes)
        if self.used_bytes + obj.nbytes > self.capacity_bytes:
            self.counters["lru_refused"] += self.eviction == "lru"
            raise CapacityError(f"store full: {self.used_bytes} + {obj.nbytes} > {self.capacity_bytes} bytes "
                                f"(reading {obj.key[:64]!r} back from disk)" + self._held_note())
        obj.last_used = next(self._clock)
        t = torch.empty(obj.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.used_bytes += obj.nbytes
        obj.reading = True
        return t

    def end_read_back(self, obj: Original, t: torch.Tensor, digest: str | None, error: BaseException | None) -> None:
        """Install the RAM copy read back into t if digest (sha256 of t) is the commit's; otherwise return the
        reserved capacity and raise DiskReadError (nothing installed)."""
        obj.reading = False
        if error is None and digest != obj.sha256:
            error = ValueError(f"read back from disk, it hashes to {str(digest)[:16]}..., its commit to "
                               f"{str(obj.sha256)[:16]}... (differs from its commit)")
        if error is not None:
            self.used_bytes -= obj.nbytes
            self.counters["disk_read_failures"] += 1
            raise DiskReadError(f"object {obj.key[:64]!r} could not be read back from disk: "
                                f"{type(error).__name__}: {error}")
        obj.tensor = t
        obj.disk_reads += 1
        self.counters["disk_reads"] += 1

    def cancel_read_back(self, obj: Original) -> None:
        """A read-back that never started: its reservation goes, nothing is counted."""
        if obj.reading:
            obj.reading = False
            self.used_bytes -= obj.nbytes

    def joined(self, obj: Original) -> None:
        obj.joins += 1
        self.counters["joins"] += 1

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

    # -- making room (module doc) -------------------------------------------------------------------------------
    def _lru(self, in_ram_only: bool) -> list[Original]:
        """What ordinary eviction may drop now, least recently used first."""
        return sorted((o for o in self.objects.values() if (o.in_ram or not in_ram_only)
                       and self.retention.may_evict(o)), key=lambda o: (o.last_used, o.seq))

    def _make_room(self, nbytes: int) -> None:
        """Before `nbytes` of RAM are reserved: past the high watermark, evict LRU down to the low one."""
        if self.eviction != "lru" or self.used_bytes + nbytes <= self.high_watermark * self.capacity_bytes:
            return
        target = self.low_watermark * self.capacity_bytes - nbytes
        for obj in self._lru(in_ram_only=True):
            if self.used_bytes <= target:
                break
            if obj.on_disk and self.disk is not None:   # written through at commit: only the RAM copy goes
                obj.tensor = None
                self.used_bytes -= obj.nbytes
                self.counters["lru_spilled"] += 1
            else:
                self._drop(obj)
                self.counters["lru_forgotten"] += 1

    def _forget_for_a_slot(self) -> None:
        """At the object-count limit: forget the least recently used original that nobody holds."""
        if self.eviction != "lru":
            return
        candidates = self._lru(in_ram_only=False)
        if candidates:
            self._drop(candidates[0])
            self.counters["lru_forgotten"] += 1

    def _held_note(self) -> str:
        """Why nothing more could go (for the CapacityError of a refused save or read-back)."""
        if self.eviction != "lru":
            return " (eviction: none)"
        held = [o for o in self.objects.values() if (o.in_ram or o.reading) and not self.retention.may_evict(o)]
        return (f"; no tier can take it: the RAM in use is held by {len(held)} original(s) that may not be evicted "
                f"(pinned by loads {sum(o.pins > 0 for o in held)}, being saved "
                f"{sum(o.state == 'pending' for o in held)}, being read back {sum(o.reading for o in held)}, the "
                f"rest retained by groups)")

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
                "reading": sum(o.reading for o in self.objects.values()),
                "in_ram": sum(o.in_ram for o in self.objects.values()),
                "disk_dir": str(self.disk.directory) if self.disk is not None else None,
                "eviction": {"policy": self.eviction, "high_watermark": self.high_watermark,
                             "low_watermark": self.low_watermark},
                "counters": dict(self.counters), "disk_rejected": list(self.disk_rejected)}
