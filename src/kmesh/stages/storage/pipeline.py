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

Restore is kmesh.kv.restore, one capture + one restore per segment: the bytes restore_child writes, because each
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
from kmesh.harness.child import ChildContext, restore_child
from kmesh.harness.workload import Child
from kmesh.kv.restore import capture, restore
from kmesh.model.runner import KVCache
from kmesh.stages.storage.objects import ObjectSet, check_catalog_object
from kmesh.storage import errors as se
from kmesh.storage.objfile import Header
from kmesh.storage.routes import Route


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
    match = _VARIANT.fullmatch(name)
    if match is None:
        raise PipelineVariantError(f"floor variant {name!r}: expected sequential, pipelined, "
                                   f"pipelined-host-<algorithm> or pipelined-device-<algorithm>, "
                                   f"optionally ending in -restore-once")
    where, algo = match.group(1) or "host", match.group(2)
    if algo is not None and algo not in integrity.names():
        raise PipelineVariantError(f"floor variant {name!r}: unknown integrity algorithm {algo!r} "
                                   f"(known: {', '.join(integrity.names())})")
    return PipelineCheck(where, algo, max(1, int(hashers)) if where == "host" else 1, match.group(3) is not None)


def _restore_segment(ctx: ChildContext, cache: KVCache, private: torch.Tensor, child: Child, seg: int,
                     restored: torch.Tensor) -> None:
    dev = cache.raw.device
    entry = ctx.catalog.entries[seg]
    spans = [(start, end) for s, start, end in child.segment_slices() if s == seg]
    if not spans:
        return
    src = torch.cat([entry.slots(dev) for _ in spans])
    old = torch.cat([entry.leader_positions(dev) for _ in spans])
    new = torch.cat([torch.arange(start, end, device=dev) for start, end in spans])
    saved = capture(private, ctx.catalog.layout, src, old)
    restore(cache.raw, cache.layout, saved, new, new, ctx.runner.rope, backend=ctx.restore_backend)
    for start, end in spans:
        restored[start:end] = True


def _read(route: Route, objs: ObjectSet, index: int, landing: torch.Tensor) -> tuple[torch.Tensor, Header]:
    """Object `index`'s read call into its landing slot (header checked on open; file unchanged; the catalog's
    object). Not yet verified."""
    with route.open(objs.paths[index]) as file:
        header = file.header
        check_catalog_object(objs, index, header)
        dst = landing[objs.slots[index]:objs.slots[index] + header.padded_nbytes]
        route.read(file, dst)
        file.check_unchanged()
    return dst, header


def _mismatch(objs: ObjectSet, index: int, header: Header, got: bytes) -> se.ObjectCorruptError:
    return se.ObjectCorruptError(f"{objs.paths[index]}: {header.algorithm} digest mismatch on the device copy "
                                 f"(recorded {header.digest.hex()[:16]}…, computed {got.hex()[:16]}…)")


class _DeviceChecker:
    """Hash a device landing slot after its copy; on CUDA with kmesh.integrity.gpu on a stream of its own, one
    SetRequest per slot (the same slots are checked child after child: a launch is a graph launch, ~5 µs of host
    work instead of ~35 for a request planned per call; the last object's check is on the critical path)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._requests: dict[tuple, Any] = {}

    def digest(self, t1: Any, slot: torch.Tensor, header: Header) -> tuple[bytes, Any]:
        """(digest, what T2 must wait for)."""
        if self.stream is None:
            t1.issued()                       # CPU engine: the copy into the "device" slot is done
            return integrity.get(header.algorithm).digest(slot.numpy(), **header.params), None
        from kmesh.integrity import gpu

        key = (slot.data_ptr(), slot.numel(), header.algorithm, tuple(sorted(header.params.items())))
        req = self._requests.get(key)
        if req is None:
            req = self._requests[key] = gpu.prepare(header.algorithm, [slot], stream=self.stream, **header.params)
        self.stream.wait_event(t1.issued())   # device visibility: the hash waits for the copy
        req.launch()
        digest = req.result()[0]
        done = torch.cuda.Event()
        done.record(self.stream)
        return digest, done

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


_checkers: dict[torch.device, _DeviceChecker] = {}


def _checker_for(device: torch.device) -> _DeviceChecker:
    """The device's checker, kept for the process: its prepared requests serve every later child."""
    if device not in _checkers:
        _checkers[device] = _DeviceChecker(device)
    return _checkers[device]


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
    handoff: queue.Queue[tuple[Any, Any, Any, Future[None] | None, BaseException | None]] = queue.Queue()
    stop = threading.Event()
    pool = ThreadPoolExecutor(check.hashers, thread_name_prefix="kmesh-floor-hash") if check.where == "host" else None
    checker = _checker_for(private.device) if check.where == "device" else None

    def mark(event: str, index: int) -> None:
        if trace is not None:
            if event == "restored" and private.device.type == "cuda":
                torch.cuda.synchronize(private.device)
            trace.append((event, index, time.perf_counter()))

    def reader() -> None:
        for entry in entries:
            if stop.is_set():
                return
            try:
                mark("read-start", entry.index)
                slot, header = _read(route, objs, entry.index, landing)
                mark("read-end", entry.index)
                verified = (pool.submit(header.verify, route.host_bytes(slot), str(objs.paths[entry.index]))
                       if pool is not None else None)
                handoff.put((entry, slot, header, verified, None))
            except BaseException as err:  # handed to the stage's thread
                handoff.put((entry, None, None, None, err))
                return

    reader_thread = threading.Thread(target=reader, name=f"storage-reader-{child.name}", daemon=True)
    reader_thread.start()
    restored = torch.zeros(len(child.ids), dtype=torch.bool)
    try:
        for _ in entries:
            entry, slot, header, verified, err = handoff.get()
            if err is not None:
                raise err
            dst = private[entry.offset:entry.offset + entry.nbytes]
            if checker is None:
                verified.result()                                  # ObjectCorruptError before any use
                mark("checked", entry.index)
                ctx.engine.drain([ctx.engine.submit(slot[:entry.nbytes], dst, owner=owner)])
            else:
                dslot = device_landing[objs.slots[entry.index]:objs.slots[entry.index] + header.padded_nbytes]
                t1 = ctx.engine.submit(slot, dslot, owner=owner)
                digest, hashed = checker.digest(t1, dslot, header)
                if digest != header.digest:
                    raise _mismatch(objs, entry.index, header, digest)
                mark("checked", entry.index)
                ctx.engine.drain([t1, ctx.engine.submit(dslot[:entry.nbytes], dst, owner=owner, after=hashed)])
            if not check.restore_once:
                _restore_segment(ctx, cache, private, child, entry.index, restored)
                mark("restored", entry.index)
        if check.restore_once:    # every copy drained above: one validation, one launch for the whole child
            restored = restore_child(cache, ctx.catalog, private, child, ctx.runner, ctx.restore_backend)
            mark("restored", -1)
    finally:
        stop.set()
        reader_thread.join()
        if pool is not None:
            pool.shutdown(wait=True)                          # no hasher reads the landing after we return
        if ctx.engine.pending(owner):
            ctx.engine.drain(owner=owner)
        if checker is not None:
            checker.close()
    return restored
