"""The one link between a KMesh process and its cache service: one connection, registered windows, copies, and
the one mapping of the service's refusals onto the kv package's errors.

Every caller goes through it: the vLLM connector (`ServiceLink(socket, ...)`, which connects itself and comes
back after an outage) and the harness's model processes (`ServiceLink.over(client)`, a connection they opened and
registered buffers on themselves). A window is a memfd registered under a KVLayout descriptor; the service copies
saved objects in and out of it.

Refusals the caller answers with a recompute become SegmentLoadError subclasses (`segment_error`): a missing
object, another KV geometry, an object larger than the staging region, a lost service (LinkUnavailable). Any other
refusal (a registration the caller got wrong, a malformed request) is raised as the service's own error: a bug,
not a reason to recompute. Service down is not a failure of the caller: the link turns itself off with ONE warning
per outage and every call raises LinkUnavailable until, `retry_s` later, a request finds the service back (links
that own their connection reconnect and register their windows anew, a new generation each). Pacing and faults are
the caller's: a copy's `after_accept` hook is passed in, never taken from a test harness.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kmesh.kv.errors import (LinkUnavailable, SegmentLayoutError, SegmentLoadError, SegmentMissingError,
                             SegmentOversizeError, SegmentSaveError)
from kmesh.kv.layout import KVLayout
from kmesh.service import errors as se
from kmesh.service.client import RegRef, ServiceClient
from kmesh.service.handles import HostBuffer

log = logging.getLogger("kmesh.kv")
_GENERATION = itertools.count(1)      # every window this process registers gets a fresh generation
_LOST = (se.ConnectionLostError, se.ServiceUnavailableError, se.ShuttingDownError, OSError)


def segment_error(e: BaseException, key: bytes, offset: int = 0, nbytes: int | None = None) -> BaseException:
    """A refused load as the kv error its caller turns into a recompute; any other refusal returned as it is."""
    if isinstance(e, SegmentLoadError):
        return e
    if isinstance(e, se.ObjectMissingError):
        return SegmentMissingError(str(e))
    if isinstance(e, se.LayoutMismatchError):
        return SegmentLayoutError(str(e))
    if isinstance(e, se.RangeError):   # the staging region is the entry's: the object is larger than it
        says = "" if nbytes is None else f" (its entry says {nbytes} bytes)"
        return SegmentOversizeError(f"object {key!r} does not fit at {offset} of the staging buffer{says}: {e}")
    if isinstance(e, _LOST):
        return LinkUnavailable(f"cache service lost: {e}")
    return e


def _reg(target: Any) -> RegRef:
    """A copy's registration: a RegRef, or a Window's."""
    return target.ref if isinstance(target, Window) else target


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
        self.client: Any = None
        self.owns_client = True
        self.windows: dict[str, Window] = {}
        self.down_reason: str | None = None
        self.down_at = 0.0
        self.warnings = 0                      # one per outage
        self.sessions = 0                      # successful connects
        self.closed = False
        self.released: list[int] = []          # registration ids closed by close()

    @classmethod
    def over(cls, client: Any, timeout_s: float = 60.0) -> "ServiceLink":
        """A link over a connection the caller opened (and closes): it never reconnects, and on loss stays down."""
        link = cls("", getattr(client, "name", "client"), timeout_s, retry_s=math.inf)
        link.client, link.owns_client, link.sessions = client, False, 1
        return link

    @classmethod
    def off(cls, name: str = "kmesh-vllm") -> "ServiceLink":
        """A link that never connects (no socket configured, or the caller refused the engine)."""
        link = cls("", name)
        link.closed = True
        return link

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.client is not None and self.down_reason is None

    def _down(self, why: str) -> LinkUnavailable:
        if self.down_reason is None:   # one warning per outage, however many requests follow
            self.down_reason = why
            self.warnings += 1
            log.warning("kmesh: cache service unavailable (%s); computing every token instead", why)
        self.down_at = time.monotonic()
        self._drop()
        return LinkUnavailable(why)

    def _drop(self) -> None:
        """Forget a lost connection and its windows (the service closes and drains them on its side)."""
        if self.client is not None and self.owns_client:
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
        if not self.owns_client or (self.down_reason is not None
                                    and time.monotonic() - self.down_at < self.retry_s):
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

    def _call(self, fn: str, *args: Any, **kw: Any) -> Any:
        if not self.up:
            raise LinkUnavailable(self.down_reason or "not connected")
        try:
            return getattr(self.client, fn)(*args, **kw)
        except _LOST as e:
            raise self._down(f"{type(e).__name__}: {e}") from e

    # -- windows --------------------------------------------------------------------------------------------
    def window(self, name: str, layout: KVLayout, alloc_id: int) -> Window:
        """This session's registered window `name` (registered now if it is not yet)."""
        w = self.windows.get(name)
        if w is not None and w.layout == layout:
            return w
        if not self.connect():
            raise LinkUnavailable(self.down_reason or "not connected")
        buf = HostBuffer(layout.nbytes, name=f"kmesh-{name}")
        try:
            ref = self._call("register_host", buf, alloc_id=alloc_id, generation=next(_GENERATION),
                             layout=layout.to_dict())
        except BaseException:
            buf.close()
            raise
        w = Window(name, layout, buf, ref, buf.as_tensor())
        self.windows[name] = w
        return w

    # -- copies ---------------------------------------------------------------------------------------------
    def request_load(self, ref: "RegRef | Window", key: bytes, offset: int, nbytes: int | None = None) -> int:
        """Ask for object `key` to be copied into the registration at offset; the request id. Refusals: see
        segment_error (nbytes: what the caller expects, named in an oversize refusal)."""
        try:
            return self._call("load", _reg(ref), key, offset)
        except se.ServiceError as e:
            mapped = segment_error(e, key, offset, nbytes)
            if mapped is e:
                raise
            raise mapped from e

    def load_many(self, ref: "RegRef | Window", items: Sequence[tuple[bytes, int]], wait_s: float) -> dict[str, Any]:
        """One load_many request (the service's reply; se.UnknownOpError from a service without it)."""
        return self._call("load_many", _reg(ref), list(items), wait_s=wait_s)

    def wait(self, req: int, timeout: float | None = None) -> dict[str, Any]:
        return self._call("wait", req, timeout=self.timeout_s if timeout is None else timeout)

    def poll(self, req: int) -> dict[str, Any]:
        return self._call("poll", req)

    def cancel(self, req: int) -> None:
        self._call("cancel", req)

    def load(self, ref: "RegRef | Window", key: bytes, offset: int) -> int:
        """Copy object `key` into the registration at offset and wait for it; its size. A copy that did not
        end done raises SegmentLoadError."""
        r = self.wait(self.request_load(ref, key, offset))
        if r["state"] != "done":
            raise SegmentLoadError(f"load of {key!r} ended {r['state']}: {r.get('error')}")
        return int(r["nbytes"])

    def save(self, ref: "RegRef | Window", key: bytes, offset: int, nbytes: int,
             after_accept: Callable[[int, int], None] | None = None) -> bool:
        """Save registration bytes as the immutable original `key`; False if it already exists (someone saved
        it). `after_accept(req, nbytes)` runs once the service accepted the copy (a paced service's grant)."""
        try:
            req = self._call("save", _reg(ref), key, offset, nbytes)
        except se.ObjectExistsError:
            return False
        if after_accept is not None:
            after_accept(req, nbytes)
        r = self.wait(req)
        if r["state"] != "done":
            raise SegmentSaveError(f"saving {key!r} ended {r['state']}: {r.get('error')}")
        return True

    # -- end ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every window's registration (the service drains and releases them), then the connection if the
        link owns it. Final."""
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
    """The process's link to the service at socket_path (a closed one is replaced): the scheduler and worker
    sides of an engine whose worker runs in the engine-core process share one connection, windows and warning."""
    k = (str(socket_path), os.getpid())
    link = _LINKS.get(k)
    if link is None or link.closed:
        link = _LINKS[k] = ServiceLink(socket_path, "kmesh-vllm", timeout_s, retry_s)
    return link
