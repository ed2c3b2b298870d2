"""The staging route pipelined: object i+1 is read while object i is checked, copied and restored.

A reader thread runs the read calls of each object in turn (preadv / io_uring waits release the GIL); what
happens to a read object depends on where it is checked (`PipelineCheck`):

    host    a pool of hasher threads verifies the landing slot (hashlib / blake3 release the GIL), so the check
            of object i runs beside the read of object i+1; the stage's thread takes each verified object in
            order, submits its device copy (kmesh.transfer ticket, holds on both buffers), waits for it and
            restores that segment's placements in the child
    device  the stage's thread copies the unverified host slot into a device landing slot (ticket T1, after the
            read returned: I/O completion is explicit), hashes the device slot there (GPU kernels on a hash
            stream that waits for T1's event; on the CPU profile the "device" is a second host buffer hashed by
            the CPU implementation), compares the digest, and only then copies the payload into the child's
            private buffer (T2, ordered after the hash) and restores it: what is checked is what is used

Restore is kmesh.restore, one capture + one restore per segment: the bytes restore_child writes, because each
token's slot and rotation depend only on its own old and new position. `-restore-once` variants instead restore
the whole child with restore_child after the last copy: one validation and one launch (a restore is mostly
fixed cost), and no restore competes with the reads for the GIL. A failed read or check stops the reader;
copies already submitted are drained before the error reaches the caller, so nothing is pending on the child's
memory, and every hasher thread has finished with the landing before it is returned.
"""
from __future__ import annotations

import queue
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kmesh import integrity
from kmesh.child import ChildContext
from kmesh.model.runner import KVCache
from kmesh.restore import capture, restore
from kmesh.segments import restore_child
from kmesh.stages.storage_objects import ObjectSet
from kmesh.storage import errors as se
from kmesh.storage.objfile import Header
from kmesh.storage.routes import Route
from kmesh.workload import Child


class PipelineVariantError(ValueError):
    """A floor variant name that does not parse, or names an integrity algorithm kmesh.integrity lacks."""


@dataclass(frozen=True)
class PipelineCheck:
    where: str = "host"          # "host": the landing slot, on hasher threads | "device": the device slot
    algorithm: str | None = None  # the object set's algorithm; None: whatever the set was written with
    hashers: int = 1             # host: hasher threads (objects checked at once)
    restore_once: bool = False   # restore every segment in one call after the last copy, not one per object

    def describe(self) -> dict[str, Any]:
        return {"where": self.where, "algorithm": self.algorithm, "hashers": self.hashers,
                "restore": "once, after the last copy" if self.restore_once else "per object"}


_VARIANT = re.compile(r"pipelined(?:-(host|device)-([a-z0-9-]+?))?(-restore-once)?")


def parse_variant(name: str, hashers: int = 1) -> PipelineCheck | None:
    """`sequential` -> None; `pipelined` (host check, the objects' own algorithm); `pipelined-host-<algorithm>`;
    `pipelined-device-<algorithm>`; each of them with `-restore-once` (one restore after the last copy)."""
    if name == "sequential":
        return None
    m = _VARIANT.fullmatch(name)
    if m is None:
        raise PipelineVariantError(f"floor variant {name!r}: expected sequential, pipelined, "
                                   f"pipelined-host-<algorithm> or pipelined-device-<algorithm>, "
                                   f"optionally ending in -restore-once")
    where, algo = m.group(1) or "host", m.group(2)
    if algo is not None and algo not in integrity.names():
        raise PipelineVariantError(f"floor variant {name!r}: unknown integrity algorithm {algo!r} "
                                   f"(known: {', '.join(integrity.names())})")
    return PipelineCheck(where, algo, max(1, int(hashers)) if where == "host" else 1, m.group(3) is not None)


def _restore_segment(ctx: ChildContext, cache: KVCache, private: torch.Tensor, child: Child, seg: int,
                     restored: torch.Tensor) -> None:
    dev = cache.raw.device
    e = ctx.catalog.entries[seg]
    spans = [(a, b) for s, a, b in child.segment_slices() if s == seg]
    if not spans:
        return
    src = torch.cat([e.slots(dev) for _ in spans])
    old = torch.cat([e.leader_positions(dev) for _ in spans])
    new = torch.cat([torch.arange(a, b, device=dev) for a, b in spans])
    saved = capture(private, ctx.catalog.layout, src, old)
    restore(cache.raw, cache.layout, saved, new, new, ctx.runner.rope, backend=ctx.restore_backend)
    for a, b in spans:
        restored[a:b] = True


def _read(route: Route, objs: ObjectSet, i: int, landing: torch.Tensor) -> tuple[torch.Tensor, Header]:
    """Object i's read call into its landing slot (header checked on open; file unchanged; the catalog's
    object). Not yet verified."""
    e = objs.catalog.entries[i]
    with route.open(objs.paths[i]) as f:
        h = f.header
        if h.key != e.key or h.payload_nbytes != e.nbytes:
            raise se.ObjectMismatchError(f"{objs.paths[i]} holds {h.key!r} ({h.payload_nbytes} B), the catalog "
                                         f"wants {e.key!r} ({e.nbytes} B)")
        dst = landing[objs.slots[i]:objs.slots[i] + h.padded_nbytes]
        route.read(f, dst)
        f.check_unchanged()
    return dst, h


def _mismatch(objs: ObjectSet, i: int, h: Header, got: bytes) -> se.ObjectCorruptError:
    return se.ObjectCorruptError(f"{objs.paths[i]}: {h.algorithm} digest mismatch on the device copy "
                                 f"(recorded {h.digest.hex()[:16]}…, computed {got.hex()[:16]}…)")


class _DeviceChecker:
    """Hash a device landing slot after its copy; on CUDA with kmesh.integrity.gpu on a stream of its own."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def digest(self, t1: Any, slot: torch.Tensor, h: Header) -> tuple[bytes, Any]:
        """(digest, what T2 must wait for)."""
        if self.stream is None:
            t1.issued()                       # CPU engine: the copy into the "device" slot is done
            return integrity.get(h.algorithm).digest(slot.numpy(), **h.params), None
        from kmesh.integrity import gpu

        self.stream.wait_event(t1.issued())   # device visibility: the hash waits for the copy
        d = gpu.hash_async(h.algorithm, [slot], stream=self.stream, **h.params).result()[0]
        done = torch.cuda.Event()
        done.record(self.stream)
        return d, done

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def pipelined_restore(ctx: ChildContext, child: Child, objs: ObjectSet, route: Route, landing: torch.Tensor,
                      private: torch.Tensor, cache: KVCache, owner: str, check: PipelineCheck | None = None,
                      device_landing: torch.Tensor | None = None,
                      trace: list[tuple[str, int, float]] | None = None) -> torch.Tensor:
    """Read on a reader thread, check + copy + restore per object; returns the bool [T] restored mask.
    check.where == "device" needs `device_landing` (objs.total_padded bytes on the child's device).
    `trace` (untimed runs): (event, object, perf_counter seconds) for read-start/read-end/checked/restored
    (restored: after a device synchronize, so the time is when the restore really finished; object -1: the
    one restore of a -restore-once variant)."""
    check = check or PipelineCheck()
    if check.algorithm is not None and any(h.algorithm != check.algorithm for h in objs.headers):
        raise se.ObjectAlgorithmError(f"objects are checked with {sorted({h.algorithm for h in objs.headers})}, "
                                      f"the pipeline expects {check.algorithm}")
    if check.where == "device" and (device_landing is None or device_landing.numel() < objs.total_padded):
        raise PipelineVariantError("a device check needs a device landing of the object set's padded size")
    entries = objs.catalog.entries
    q: queue.Queue[tuple[Any, Any, Any, Future[None] | None, BaseException | None]] = queue.Queue()
    stop = threading.Event()
    pool = ThreadPoolExecutor(check.hashers, thread_name_prefix="kmesh-floor-hash") if check.where == "host" else None
    checker = _DeviceChecker(private.device) if check.where == "device" else None

    def mark(event: str, i: int) -> None:
        if trace is not None:
            if event == "restored" and private.device.type == "cuda":
                torch.cuda.synchronize(private.device)
            trace.append((event, i, time.perf_counter()))

    def reader() -> None:
        for e in entries:
            if stop.is_set():
                return
            try:
                mark("read-start", e.index)
                slot, h = _read(route, objs, e.index, landing)
                mark("read-end", e.index)
                fut = (pool.submit(h.verify, route.host_bytes(slot), str(objs.paths[e.index]))
                       if pool is not None else None)
                q.put((e, slot, h, fut, None))
            except BaseException as err:  # handed to the stage's thread
                q.put((e, None, None, None, err))
                return

    th = threading.Thread(target=reader, name=f"storage-reader-{child.name}", daemon=True)
    th.start()
    restored = torch.zeros(len(child.ids), dtype=torch.bool)
    try:
        for _ in entries:
            e, slot, h, fut, err = q.get()
            if err is not None:
                raise err
            dst = private[e.offset:e.offset + e.nbytes]
            if checker is None:
                fut.result()                                  # ObjectCorruptError before any use
                mark("checked", e.index)
                ctx.engine.drain([ctx.engine.submit(slot[:e.nbytes], dst, owner=owner)])
            else:
                dslot = device_landing[objs.slots[e.index]:objs.slots[e.index] + h.padded_nbytes]
                t1 = ctx.engine.submit(slot, dslot, owner=owner)
                d, hashed = checker.digest(t1, dslot, h)
                if d != h.digest:
                    raise _mismatch(objs, e.index, h, d)
                mark("checked", e.index)
                ctx.engine.drain([t1, ctx.engine.submit(dslot[:e.nbytes], dst, owner=owner, after=hashed)])
            if not check.restore_once:
                _restore_segment(ctx, cache, private, child, e.index, restored)
                mark("restored", e.index)
        if check.restore_once:    # every copy drained above: one validation, one launch for the whole child
            restored = restore_child(cache, ctx.catalog, private, child, ctx.runner, ctx.restore_backend)
            mark("restored", -1)
    finally:
        stop.set()
        th.join()
        if pool is not None:
            pool.shutdown(wait=True)                          # no hasher reads the landing after we return
        if ctx.engine.pending(owner):
            ctx.engine.drain(owner=owner)
        if checker is not None:
            checker.close()
    return restored
