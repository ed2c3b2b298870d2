"""The service's remote tier (kmesh.storage.remote): publishes committed originals to the shared store and fetches
the ones this host does not hold, on one thread of its own — the loop never waits on the network.

    tier.publish(key, tensor, section)     # after a commit: the object image (header + digest as on disk) goes up
    f = tier.fetch(key, waiter)            # a load of a key this store lacks: one fetch, the reply parked
    tier.join(f, waiter)                   # another load of that key meanwhile: no second fetch (read-once)
    for t in tier.finished(): ...          # on the wake pipe: published / fetched (verified) / failed

A fetched image is checked on the worker thread before the loop sees it: objfile.decode_image (header checksum,
key, digest by the algorithm the header names), the service's header section (layout, geometry, size), and the
sha256 of the payload against the one its commit recorded. Nothing unverified reaches the store.

The store client itself runs in an agent process (kmesh.storage.remote_agent: it holds the GIL through some calls,
and its failures must not be the service's). It connects on its first call and again after a failure; after a
"store unavailable" answer the tier asks again at most once per `retry_s`, failing what comes meanwhile at once.
A store that is down when the service starts, or goes down later, costs the loads that need it a clear error,
never the service.
"""
from __future__ import annotations

import hashlib
import logging
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
from kmesh.storage.remote import RemoteMissingError, RemoteSpec, RemoteUnavailableError
from kmesh.storage.remote_agent import Agent

log = logging.getLogger("kmesh.service")


class RemoteCancelledError(StorageError):
    """The service stopped before this task ran."""


class RemoteRejectedError(StorageError):
    """What the store returned is not the object its key names (failed a check; nothing of it was used)."""


@dataclass(eq=False)
class Fetch:
    key: bytes
    waiters: list[Any] = field(default_factory=list)   # parked loads (the server's records; opaque here)
    joins: int = 0
    started_at: float = field(default_factory=time.monotonic)
    # set by the worker once verified
    payload: bytes | None = None
    layout: dict[str, Any] | None = None
    geometry: bytes | None = None
    sha256: str | None = None
    error: BaseException | None = None
    seconds: float | None = None


@dataclass(eq=False)
class Publish:
    key: bytes
    tensor: torch.Tensor | None      # the committed RAM copy (immutable; this reference keeps it alive)
    section: dict[str, Any]          # the service's header section (store.header_section)
    error: BaseException | None = None
    seconds: float | None = None


Task = Fetch | Publish


def verify_image(key: bytes, image: bytes) -> tuple[bytes, dict[str, Any], bytes, str]:
    """(payload, layout, geometry, sha256) of an object image, every check passed; RemoteRejectedError names the
    first that failed."""
    from kmesh.service.store import AdoptError, parse_section
    from kmesh.storage.objfile import decode_image

    what = f"remote object {key[:64]!r}"
    try:
        header, payload = decode_image(image, key, what=what)
        layout, geometry, sha, _ = parse_section(header, key)   # sizes, geometry vs layout checked
    except (StorageError, AdoptError) as e:
        raise RemoteRejectedError(f"{type(e).__name__}: {e}") from e
    got = hashlib.sha256(payload).hexdigest()
    if got != sha:
        raise RemoteRejectedError(f"{what}: the payload hashes to {got[:16]}..., its commit to {sha[:16]}...")
    return bytes(payload), layout, geometry, sha


class RemoteTier:
    def __init__(self, spec: RemoteSpec, max_fetches: int = 64, retry_s: float = 1.0,
                 agent_log: Path | None = None) -> None:
        self.spec, self.max_fetches, self.retry_s = spec, max_fetches, retry_s
        self.flights: dict[bytes, Fetch] = {}         # loop thread only
        self.counters = {"published": 0, "publish_failures": 0, "fetches": 0, "fetch_joins": 0, "fetched": 0,
                         "fetch_missing": 0, "fetch_rejected": 0, "fetch_failures": 0, "unavailable": 0,
                         "bytes_published": 0, "bytes_fetched": 0}
        self.last_error: str | None = None
        self.connected = False                         # the last call reached the store
        self.pending_publishes = 0                     # loop thread only
        self._unavailable_at = -1e9
        # started here, before the service's loop takes its descriptor baseline: its two pipes are the tier's
        self.agent = Agent.start(spec, agent_log)
        self._todo: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._done: DoneQueue[Task] = DoneQueue()
        self.wake_r = self._done.wake_r
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kmesh-remote", daemon=True)
        self._thread.start()

    # -- loop side --------------------------------------------------------------------------------------
    def publish(self, key: bytes, tensor: torch.Tensor, section: dict[str, Any]) -> None:
        self.pending_publishes += 1
        self._todo.put(Publish(key, tensor, section))

    def get(self, key: bytes) -> Fetch | None:
        return self.flights.get(key)

    def fetch(self, key: bytes, waiter: Any) -> Fetch:
        if len(self.flights) >= self.max_fetches:
            raise CapacityError(f"{len(self.flights)} remote fetches in flight, limit {self.max_fetches}")
        if key in self.flights:
            raise ValueError(f"a fetch of {key[:64]!r} is already in flight")  # the caller joins instead
        f = Fetch(key, [waiter])
        self.flights[key] = f
        self.counters["fetches"] += 1
        self._todo.put(f)
        return f

    def join(self, f: Fetch, waiter: Any) -> None:
        f.waiters.append(waiter)
        f.joins += 1
        self.counters["fetch_joins"] += 1

    def finished(self) -> list[Task]:
        """Tasks that ended since the last call (fetches leave `flights`: the caller settles them)."""
        out = self._done.take_all()
        for t in out:
            if isinstance(t, Publish):
                self.pending_publishes -= 1
                if t.error is None:
                    self.counters["published"] += 1
                else:
                    self.counters["publish_failures"] += 1
                    self.last_error = f"publish {t.key[:64]!r}: {type(t.error).__name__}: {t.error}"
                    log.warning("remote tier: %s", self.last_error)
                continue
            self.flights.pop(t.key, None)
            if t.error is None:
                self.counters["fetched"] += 1
                self.counters["bytes_fetched"] += len(t.payload or b"")
            elif isinstance(t.error, RemoteMissingError):
                self.counters["fetch_missing"] += 1
            else:
                self.counters["fetch_rejected" if isinstance(t.error, RemoteRejectedError) else
                              "fetch_failures"] += 1
                self.last_error = f"fetch {t.key[:64]!r}: {type(t.error).__name__}: {t.error}"
                log.warning("remote tier: %s", self.last_error)
        return out

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec.describe(), "connected": self.connected, "in_flight": len(self.flights),
                "agent_pid": self.agent.pid, "agent_starts": self.agent.starts,
                "pending_publishes": self.pending_publishes, "counters": dict(self.counters),
                "last_error": self.last_error}

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._todo.put(None)
        self._thread.join(timeout)
        self.agent.close()
        self._done.close()

    # -- worker thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            t = self._todo.get()
            if t is None:
                break
            t0 = time.monotonic()
            try:
                if self._stop.is_set():
                    raise RemoteCancelledError("the service is stopping")
                if time.monotonic() - self._unavailable_at < self.retry_s:
                    raise RemoteUnavailableError("the store did not answer "
                                                 f"{time.monotonic() - self._unavailable_at:.1f} s ago (asked again "
                                                 f"after {self.retry_s} s): {self.last_error}")
                if isinstance(t, Publish):
                    self._publish(t)
                else:
                    t.payload, t.layout, t.geometry, t.sha256 = verify_image(t.key, self.agent.fetch(t.key))
                self.connected = True
            except (RemoteMissingError, RemoteRejectedError) as e:
                t.error, self.connected = e, True   # the store answered
            except RemoteUnavailableError as e:
                t.error, self.connected, self._unavailable_at = e, False, time.monotonic()
                self.counters["unavailable"] += 1   # a plain int bump: the loop only reads it
            except Exception as e:   # RemoteStoreError (the agent reconnects) or any other: this task's alone
                t.error, self.connected = e, False
            t.seconds = time.monotonic() - t0
            if isinstance(t, Publish):
                t.tensor = None   # the RAM copy is the store's again alone
            if not self._done.put(t):
                return

    def _publish(self, t: Publish) -> None:
        from kmesh.storage.objfile import encode_image

        assert t.tensor is not None
        image = encode_image(t.tensor.numpy(), t.key, t.section)
        self.agent.publish(t.key, image)
        self.counters["bytes_published"] += len(image)
