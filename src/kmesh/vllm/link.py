"""The connector's link to the KMesh cache service: one connection, its registered windows, synchronous copies.

A window is a memfd registered with the service under a KVLayout descriptor (kmesh.service.client); the
service copies saved objects in and out of it, the connector moves bytes between a window and the engine's
blocks with kmesh.restore. The CPU engine allocates its KV cache as ordinary process memory, which the
service cannot map, so the engine-side registrations are windows in the engine's own per-block geometry
(kmesh.vllm.arrangement.staging_layout) whose allocation id is the engine cache's address.

Service down is not an engine failure: the link turns itself off with ONE warning and every later call
answers "unavailable", so the engine computes everything itself.
"""
from __future__ import annotations

import logging
import os
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
    def __init__(self, socket_path: str | Path, name: str, timeout_s: float = 30.0) -> None:
        self.socket_path, self.name, self.timeout_s = str(socket_path), name, timeout_s
        self.client: ServiceClient | None = None
        self.windows: list[Window] = []
        self.down_reason: str | None = None
        self.released: list[int] = []          # registration ids closed by close()

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.client is not None and self.down_reason is None

    def _down(self, why: str) -> LinkUnavailable:
        if self.down_reason is None:   # one warning per link, however many requests follow
            self.down_reason = why
            log.warning("kmesh: cache service unavailable (%s); vLLM computes every token itself", why)
        return LinkUnavailable(why)

    def connect(self) -> bool:
        if self.client is not None or self.down_reason is not None:
            return self.up
        try:
            self.client = ServiceClient.connect(self.socket_path, name=f"{self.name}:{os.getpid()}",
                                                timeout=self.timeout_s)
        except (se.ServiceError, OSError) as e:
            self._down(f"{type(e).__name__}: {e}")
        return self.up

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if not self.up:
            raise LinkUnavailable(self.down_reason or "not connected")
        try:
            return fn(*args, **kw)
        except (se.ConnectionLostError, se.ServiceUnavailableError, se.ShuttingDownError, OSError) as e:
            raise self._down(f"{type(e).__name__}: {e}") from e

    # -- windows --------------------------------------------------------------------------------------------
    def register(self, name: str, layout: KVLayout, alloc_id: int, generation: int) -> Window:
        buf = HostBuffer(layout.nbytes, name=f"kmesh-vllm-{name}")
        try:
            ref = self._call(self.client.register_host, buf, alloc_id=alloc_id, generation=generation,
                             layout=layout.to_dict())
        except BaseException:
            buf.close()
            raise
        w = Window(name, layout, buf, ref, buf.as_tensor())
        self.windows.append(w)
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
        """Close every registration (the service drains and releases them), then the connection."""
        for w in self.windows:
            if self.up:
                try:
                    self.client.close(w.ref)
                    self.released.append(w.ref.reg)
                except (se.ServiceError, OSError) as e:
                    log.warning("kmesh: closing registration %s failed: %s", w.ref.reg, e)
        if self.client is not None:
            try:
                self.client.close_connection()
            except OSError:
                pass
        for w in self.windows:
            w.buf.close()
        self.windows.clear()
        self.client = None
