"""Where a staged segment's bytes come from: the process's own saved objects (the in-process reference) or the
cache service through the one link (kmesh.kv.link). A source loads one catalog entry into its span of a staging
buffer and refuses an object of the wrong size before its bytes are used; the load step (kmesh.kv.load) checks
digests and the rest.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Protocol

import torch

from kmesh.kv.catalog import CatalogEntry, size_error
from kmesh.kv.errors import (LinkUnavailable, SegmentCancelledError, SegmentLayoutError, SegmentLoadError,
                             SegmentMissingError, SegmentSourceLostError)
from kmesh.kv.link import ServiceLink, segment_error
from kmesh.service import errors as se


class SegmentSource(Protocol):
    """Where a child's segment bytes come from: load one catalog entry into staging[offset:offset+nbytes]."""

    name: str

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        """Copy the entry's object into staging at entry.offset; returns the bytes copied. An object whose
        size is not entry.nbytes raises SegmentSizeError, copied nowhere if the source can know its size first."""


class InProcessSegments:
    """The leader's saved objects held inside the model process (the in-process reference path)."""

    name = "in-process"

    def __init__(self, export: Any, objects: dict[bytes, torch.Tensor] | None = None) -> None:
        self.objects = objects if objects is not None else {
            e.key: export.raw[e.offset:e.offset + e.nbytes].clone() for e in export.catalog.entries}

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        obj = self.objects.get(entry.key)
        if obj is None:
            raise SegmentMissingError(f"no saved object {entry.key!r}")
        n = obj.numel()
        if n != entry.nbytes:                       # before the copy: not a byte of a wrong-size object lands
            raise size_error(entry, n)
        if entry.offset + n > staging.numel():
            raise SegmentLayoutError(f"object {entry.key!r} of {n} bytes at {entry.offset} overruns the "
                                     f"{staging.numel()}-byte staging buffer")
        staging[entry.offset:entry.offset + n].copy_(obj)
        return n


class ServiceSegments:
    """Objects loaded through the cache service into a registered staging buffer (memfd or CUDA IPC).

    `after_accept(req, nbytes)` runs once the service accepted a copy (a paced service needs its tokens then).
    The size check comes first: the service reports the object's size when it accepts the load, before a paced
    copy moves a byte, and one that is not entry.nbytes raises SegmentSizeError. The service cannot stop a
    copy part-way (kmesh.service.jobs), so the refused copy is cancelled and still let run out and drained into
    staging, whose bytes the caller then never uses (it recomputes); a client cannot ask the service for an
    object's size before it loads it. An object too large for the registration is refused by the service
    (RangeError) before any copy: SegmentOversizeError. Without `after_accept` (no gate: a deployed service) a
    load is two calls, load and wait (as the vLLM connector's), and the size is checked on the wait's reply;
    prefetch() then requests every segment's load before the first wait (kmesh.kv.load.load_segments), in
    one load_many request where the service takes it (its reply waits for the copies too).
    """

    name = "service"

    def __init__(self, svc: Any, reg: Any, after_accept: Callable[[int, int], None] | None = None,
                 timeout_s: float = 60.0) -> None:
        # svc: a kmesh.kv.link.ServiceLink, or a connection (ServiceClient) the caller opened: then a link over it
        self.link = svc if isinstance(svc, ServiceLink) else ServiceLink.over(svc, timeout_s)
        self.reg, self.after_accept, self.timeout_s = reg, after_accept, timeout_s
        self.requests: list[int] = []
        # prefetch's requests by (key, offset), not yet used: a request id to wait on, load_many's description of
        # an ended copy, or the refusal of the first it could not make (raised at that entry's turn)
        self._ahead: dict[tuple[bytes, int], int | dict[str, Any] | BaseException] = {}

    def _request(self, entry: CatalogEntry) -> int:
        """The load call, its refusals as segment errors (kmesh.kv.link.segment_error); the request id."""
        req = self.link.request_load(self.reg, entry.key, entry.offset, entry.nbytes)
        self.requests.append(req)
        return req

    def prefetch(self, entries: Collection[CatalogEntry]) -> None:
        """Without a gate: request every entry's load now, in order, so the service's copies overlap; load(entry)
        then uses its own. Where the service takes load_many, the loads go MAX_BATCH at a time in one request
        each, whose reply also waits for the copies (one round trip for a child's segments instead of two per
        segment); an item the batch stops at for a read-back or fetch, and the rest, are requested one by one.
        The first load the service refuses is kept and raised at that entry's turn (so a caller going entry by
        entry fails at the same entry as without prefetch), and none after it is requested. A caller that stops
        before the end must abandon() the rest. With a gate (after_accept) nothing is requested ahead: a paced
        copy moves only the chunks granted to it, one request at a time."""
        if self.after_accept is not None:
            return
        from kmesh.service.protocol import MAX_BATCH

        todo = list(entries)
        load_many = getattr(self.link.client, "load_many", None) is not None
        while load_many and todo:
            batch = todo[:MAX_BATCH]
            try:
                r = self.link.load_many(self.reg, [(e.key, e.offset) for e in batch], wait_s=self.timeout_s)
            except se.UnknownOpError:     # a service from before load_many: one load per segment
                load_many = False
                break
            except (se.ServiceError, LinkUnavailable) as e:
                self._ahead[(batch[0].key, batch[0].offset)] = segment_error(e, batch[0].key, batch[0].offset,
                                                                             batch[0].nbytes)
                return
            jobs = {j["req"]: j for j in r["jobs"]}
            for entry, req in zip(batch, r["reqs"]):
                self.requests.append(req)
                job = jobs.get(req)
                self._ahead[(entry.key, entry.offset)] = job if job is not None and job["state"] != "running" \
                    else req
            stopped = r["stopped_at"]
            if stopped is None:
                todo = todo[len(batch):]
                continue
            if r["error"] is not None:
                err = se.error_from_reply(r["error"]["code"], r["error"]["message"])
                e = batch[stopped]
                self._ahead[(e.key, e.offset)] = segment_error(err, e.key, e.offset, e.nbytes)
                return
            todo, load_many = todo[stopped:], False     # parked: this one and the rest one by one
        for entry in todo:
            try:
                self._ahead[(entry.key, entry.offset)] = self._request(entry)
            except (SegmentLoadError, se.ServiceError) as e:
                self._ahead[(entry.key, entry.offset)] = e
                return

    def abandon(self) -> None:
        """Cancel every prefetched load not waited on and wait for its copy to end: those copies write into the
        staging buffer, which the caller reuses once it returns. A service that is gone copies nothing more."""
        ahead = [r if isinstance(r, int) else r["req"] for r in self._ahead.values()
                 if isinstance(r, int) or (isinstance(r, dict) and r["state"] == "running")]
        self._ahead.clear()
        for req in ahead:
            try:
                self.link.cancel(req)
                self.link.wait(req, timeout=self.timeout_s)
            except LinkUnavailable:
                return

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        ahead = self._ahead.pop((entry.key, entry.offset), None)
        if isinstance(ahead, BaseException):
            raise ahead
        if isinstance(ahead, dict):     # load_many's reply described the copy as ended: nothing to wait for
            r, accepted = ahead, int(ahead["nbytes"])
            return self._checked(entry, r, accepted)
        req = ahead if ahead is not None else self._request(entry)
        try:
            if self.after_accept is None:
                # unpaced (a deployed service): the wait's reply carries the accepted size too. Polling for it
                # first would cost one more round trip per segment and change nothing: a copy of the wrong size
                # runs out either way (see the class doc) and is refused below, its bytes never used.
                r = self.link.wait(req, timeout=self.timeout_s)
                accepted = int(r["nbytes"])
            else:
                accepted = int(self.link.poll(req)["nbytes"])
                if accepted != entry.nbytes:
                    self.link.cancel(req)    # nobody wants it; it runs on (see the class doc) and is drained below
                # the size the service accepted (the object's), not the catalog's: a paced service needs its
                # exact chunk count, or a short object would leave spare tokens in the gate
                self.after_accept(req, accepted)
                r = self.link.wait(req, timeout=self.timeout_s)
        except LinkUnavailable as e:
            raise SegmentSourceLostError(f"cache service lost during load of {entry.key!r}: {e}") from e
        return self._checked(entry, r, accepted)

    @staticmethod
    def _checked(entry: CatalogEntry, r: dict[str, Any], accepted: int) -> int:
        """The ended copy's bytes, or the segment error of a wrong size, a cancelled or a failed copy."""
        if accepted != entry.nbytes:
            raise size_error(entry, accepted, f" (copy {r['state']}, not used)")
        if r["state"] == "cancelled":
            raise SegmentCancelledError(f"load of {entry.key!r} was cancelled")
        if r["state"] != "done":
            raise SegmentLoadError(f"load of {entry.key!r} ended {r['state']}: {r.get('error')}")
        return int(r["nbytes"])


