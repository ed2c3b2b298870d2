"""The connector's link to the KMesh cache service: one connection, its registered windows, synchronous copies.

A window is a memfd registered with the service under a KVLayout descriptor (kmesh.service.client); the
service copies saved objects in and out of it, the connector moves bytes between a window and the engine's
blocks with kmesh.restore. The CPU engine allocates its KV cache as ordinary process memory, which the
service cannot map, so the engine-side registrations are windows in the engine's own per-block geometry
(kmesh.vllm.arrangement.staging_layout) whose allocation id is the engine cache's address.

Service down is not an engine failure: the link turns itself off with ONE warning per outage and every call
answers "unavailable" (the engine computes everything itself) until, `retry_s` later, a request finds the
service back: then the link reconnects and its windows are registered anew (a new generation each).
One link per service socket per process (`shared_link`): the scheduler and worker sides of an engine whose
worker runs in the engine-core process share one connection, one set of windows and one warning.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kmesh.errors import KMeshError
from kmesh.layout import KVLayout
from kmesh.service import errors as se
from kmesh.service.client import RegRef, ServiceClient
from kmesh.service.handles import HostBuffer

log = logging.getLogger("kmesh.vllm")
_GENERATION = itertools.count(1)      # every registration of this process gets a fresh generation


class LinkUnavailable(KMeshError):
    """The service cannot be reached (or went away): the caller computes instead."""


class ObjectMissing(KMeshError):
    """No such object in the service's store."""


class LoadFailed(KMeshError):
    """A load did not complete (failed, cancelled, wrong size or geometry)."""


@dataclass
class Window:
    name: str
    layout: KVLayout
    buf: HostBuffer
    ref: RegRef
    tensor: torch.Tensor = field(repr=False)


class ServiceLink:
    def __init__(self, socket_path: str | Path, name: str, timeout_s: float = 30.0, retry_s: float = 5.0) -> None:
        self.socket_path, self.name, self.timeout_s, self.retry_s = str(socket_path), name, timeout_s, retry_s
        self.client: ServiceClient | None = None
        self.windows: dict[str, Window] = {}
        self.down_reason: str | None = None
        self.down_at = 0.0
        self.warnings = 0                      # one per outage
        self.sessions = 0                      # successful connects
        self.closed = False
        self.released: list[int] = []          # registration ids closed by close()

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.client is not None and self.down_reason is None

    def _down(self, why: str) -> LinkUnavailable:
        if self.down_reason is None:   # one warning per outage, however many requests follow
            self.down_reason = why
            self.warnings += 1
            log.warning("kmesh: cache service unavailable (%s); vLLM computes every token itself", why)
        self.down_at = time.monotonic()
        self._drop()
        return LinkUnavailable(why)

    def _drop(self) -> None:
        """Forget a lost connection and its windows (the service closes and drains them on its side)."""
        if self.client is not None:
            try:
                self.client.close_connection()
            except OSError:
                pass
        self.client = None
        for w in self.windows.values():
            w.buf.close()
        self.windows.clear()

    def connect(self) -> bool:
        """Connected (or reconnected after retry_s)? Never raises."""
        if self.closed:
            return False
        if self.client is not None:
            return True
        if self.down_reason is not None and time.monotonic() - self.down_at < self.retry_s:
            return False
        try:
            self.client = ServiceClient.connect(self.socket_path, name=f"{self.name}:{os.getpid()}",
                                                timeout=self.timeout_s)
        except (se.ServiceError, OSError) as e:
            self._down(f"{type(e).__name__}: {e}")
            return False
        if self.down_reason is not None:
            log.warning("kmesh: cache service back at %s", self.socket_path)
        self.down_reason = None
        self.sessions += 1
        return True

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if not self.up:
            raise LinkUnavailable(self.down_reason or "not connected")
        try:
            return fn(*args, **kw)
        except (se.ConnectionLostError, se.ServiceUnavailableError, se.ShuttingDownError, OSError) as e:
            raise self._down(f"{type(e).__name__}: {e}") from e

    # -- windows --------------------------------------------------------------------------------------------
    def window(self, name: str, layout: KVLayout, alloc_id: int) -> Window:
        """This session's registered window `name` (registered now if it is not yet)."""
        w = self.windows.get(name)
        if w is not None and w.layout == layout:
            return w
        if not self.connect():
            raise LinkUnavailable(self.down_reason or "not connected")
        buf = HostBuffer(layout.nbytes, name=f"kmesh-vllm-{name}")
        try:
            ref = self._call(self.client.register_host, buf, alloc_id=alloc_id, generation=next(_GENERATION),
                             layout=layout.to_dict())
        except BaseException:
            buf.close()
            raise
        w = Window(name, layout, buf, ref, buf.as_tensor())
        self.windows[name] = w
        return w

    # -- copies ---------------------------------------------------------------------------------------------
    def save(self, w: Window, key: bytes, offset: int, nbytes: int) -> bool:
        """Save window bytes as the immutable original `key`; False if it already exists (someone saved it)."""
        try:
            req = self._call(self.client.save, w.ref, key, offset, nbytes)
        except se.ObjectExistsError:
            return False
        r = self._call(self.client.wait, req, timeout=self.timeout_s)
        if r["state"] != "done":
            raise LoadFailed(f"saving {key!r} ended {r['state']}: {r.get('error')}")
        return True

    def load(self, w: Window, key: bytes, offset: int) -> int:
        """Copy object `key` into the window at offset; returns its size (ObjectMissing, LoadFailed)."""
        try:
            req = self._call(self.client.load, w.ref, key, offset)
        except se.ObjectMissingError as e:
            raise ObjectMissing(str(e)) from e
        except (se.LayoutMismatchError, se.RangeError) as e:
            raise LoadFailed(f"{key!r}: {e}") from e
        r = self._call(self.client.wait, req, timeout=self.timeout_s)
        if r["state"] != "done":
            raise LoadFailed(f"load of {key!r} ended {r['state']}: {r.get('error')}")
        return int(r["nbytes"])

    # -- end ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every registration (the service drains and releases them), then the connection. Final."""
        if self.closed:
            return
        self.closed = True
        for w in self.windows.values():
            if self.up:
                try:
                    self.client.close(w.ref)
                    self.released.append(w.ref.reg)
                except (se.ServiceError, OSError) as e:
                    log.warning("kmesh: closing registration %s failed: %s", w.ref.reg, e)
        self._drop()


_LINKS: dict[tuple[str, int], ServiceLink] = {}


def shared_link(socket_path: str, timeout_s: float = 30.0, retry_s: float = 5.0) -> ServiceLink:
    """The process's link to the service at socket_path (a closed one is replaced)."""
    k = (str(socket_path), os.getpid())
    link = _LINKS.get(k)
    if link is None or link.closed:
        link = _LINKS[k] = ServiceLink(socket_path, "kmesh-vllm", timeout_s, retry_s)
    return link
