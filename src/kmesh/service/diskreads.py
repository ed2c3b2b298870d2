"""Read-backs of evicted originals from their object files, off the service's loop thread, one per object.

A load whose original has no RAM copy must not read the disk on the selector thread: while it reads, the
service would answer nobody (heartbeats, other clients' copies, status). The loop instead starts a *flight*:

    f = reads.start(key, tensor, waiter)   # queued to a small reader pool; the load's reply is parked
    reads.join(f, waiter)                   # a load of the same key meanwhile: no second read (singleflight)
    for f in reads.finished(): ...          # on the wake pipe: f.error, or f.digest of the bytes read

Each reader thread owns its own DiskTier (route + landing buffer), so reads of different objects overlap their
I/O. A reader reads through the verified DiskTier path (header, file digest, file unchanged) into the flight's
tensor and hashes what landed (sha256, the store's commit digest) on its own thread; hashing and preadv release
the GIL. The loop compares that digest with the commit's and installs the RAM copy; it alone touches the store,
the flights table and the waiters. The optional gate (a kmesh.transfer ChunkGate read end: one token per read)
lets tests hold a read open, the way the copy gate holds copies.
"""
from __future__ import annotations

import hashlib
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kmesh.service.errors import CapacityError
from kmesh.service.wake import DoneQueue
from kmesh.storage.errors import StorageError
from kmesh.transfer import ChunkGate


class ReadCancelledError(StorageError):
    """The service stopped before this read ran: nothing was read."""


@dataclass(eq=False)
class Flight:
    key: bytes
    nbytes: int
    tensor: torch.Tensor               # the future RAM copy (its capacity is reserved in the store)
    waiters: list[Any] = field(default_factory=list)  # parked loads (the server's records; opaque here)
    joins: int = 0                     # loads that found this flight running and joined it
    started_at: float = field(default_factory=time.monotonic)
    digest: str | None = None          # sha256 of the bytes read (reader thread)
    error: BaseException | None = None
    read_s: float | None = None        # the read + hash on the reader thread

    def describe(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        return {"key": self.key, "nbytes": self.nbytes, "waiters": len(self.waiters), "joins": self.joins,
                "age_s": round(now - self.started_at, 6)}


class DiskReads:
    """The reader pool, its flights (one per key) and the wake pipe that brings finished ones to the loop."""

    def __init__(self, directory: Path, threads: int = 2, max_flights: int = 64, gate_fd: int | None = None,
                 on_caller: bool = False) -> None:
        from kmesh.storage.tier import DiskTier

        if threads < 1 or max_flights < 1:
            raise ValueError(f"threads ({threads}) and max_flights ({max_flights}) must be at least 1")
        self.directory = Path(directory)
        self.max_flights = max_flights
        # on_caller: the read runs inside start(), on the loop thread: the serialised design this module
        # replaces, kept only as the negative control of the server's read_on_loop fault
        self.on_caller = on_caller
        self.flights: dict[bytes, Flight] = {}      # loop thread only
        self.counters = {"flights": 0, "joins": 0, "failed": 0}
        self._todo: queue.SimpleQueue[Flight | None] = queue.SimpleQueue()
        self._done: DoneQueue[Flight] = DoneQueue()
        self.wake_r = self._done.wake_r
        self._gate = ChunkGate.from_read_fd(gate_fd) if gate_fd is not None else None
        self._gate_lock = threading.Lock()          # one reader at a time waits on the gate pipe
        self._stop = threading.Event()
        self._tiers = [DiskTier(self.directory) for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(t,), name=f"kmesh-disk-read-{i}", daemon=True)
                         for i, t in enumerate(self._tiers)]
        for t in self._threads:
            t.start()

    # -- loop side --------------------------------------------------------------------------------------
    def get(self, key: bytes) -> Flight | None:
        return self.flights.get(key)

    def check_room(self) -> None:
        if len(self.flights) >= self.max_flights:
            raise CapacityError(f"{len(self.flights)} disk reads in flight, limit {self.max_flights}")

    def start(self, key: bytes, tensor: torch.Tensor, waiter: Any) -> Flight:
        """Queue one read of key's object file into tensor (the caller reserved its capacity)."""
        self.check_room()
        if key in self.flights:
            raise ValueError(f"a read of {key[:64]!r} is already in flight")  # the caller joins instead
        f = Flight(key, tensor.numel(), tensor, [waiter])
        self.flights[key] = f
        self.counters["flights"] += 1
        if self.on_caller:
            self._read(f, self._tiers[0])
        else:
            self._todo.put(f)
        return f

    def join(self, f: Flight, waiter: Any) -> None:
        f.waiters.append(waiter)
        f.joins += 1
        self.counters["joins"] += 1

    def finished(self) -> list[Flight]:
        """Flights whose read ended since the last call (removed from `flights`: the caller settles them)."""
        out = self._done.take_all()
        for f in out:
            self.flights.pop(f.key, None)
            if f.error is not None:
                self.counters["failed"] += 1
        return out

    def in_flight(self) -> int:
        return len(self.flights)

    def describe(self, limit: int = 16) -> dict[str, Any]:
        now = time.monotonic()
        return {"in_flight": len(self.flights), "max_flights": self.max_flights, "threads": len(self._threads),
                "gated": self._gate is not None, **self.counters,
                "flights": [f.describe(now) for f in list(self.flights.values())[:limit]]}  # bounded

    def stop_waiting(self) -> None:
        """Shutdown began: reads still held by the gate end at once (as cancelled) instead of waiting."""
        self._stop.set()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for _ in self._threads:
            self._todo.put(None)
        for t in self._threads:
            t.join(timeout=timeout)
        for tier in self._tiers:
            tier.close()
        self._done.close()

    # -- reader threads ---------------------------------------------------------------------------------
    def _held(self) -> bool:
        """Wait for the gate's token; True if the service stopped first."""
        if self._gate is None:
            return self._stop.is_set()
        with self._gate_lock:
            while not self._gate.wait(0.05):
                if self._stop.is_set():
                    return True
        return False

    def _run(self, tier: Any) -> None:
        while True:
            f = self._todo.get()
            if f is None:
                return
            if not self._read(f, tier):
                return

    def _read(self, f: Flight, tier: Any) -> bool:
        """One read into f, its outcome handed to the loop; False once the wake pipe is closed (teardown)."""
        try:
            if self._held():
                raise ReadCancelledError(f"the service stopped before {f.key[:64]!r} was read")
            t0 = time.perf_counter()
            tier.read(f.key, out=f.tensor)
            f.digest = hashlib.sha256(memoryview(f.tensor.numpy()).cast("B")).hexdigest()
            f.read_s = time.perf_counter() - t0
        except BaseException as e:  # every failure goes back to the loop, typed: the thread lives on
            f.error = e
        return self._done.put(f)   # False once closed at teardown: nobody is waiting any more
