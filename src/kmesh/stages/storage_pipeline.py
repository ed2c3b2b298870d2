"""The staging route pipelined: object i+1 is read and checked while object i is copied and restored.

A reader thread runs read + integrity check of each object in turn (preadv and hashlib release the GIL); the
stage's thread takes each verified object as it arrives, submits its device copy (kmesh.transfer ticket, holds),
waits for that ticket, and restores that segment's placements in the child (kmesh.restore, one capture + one
restore per segment). The result is the same bytes restore_child writes: each token's slot and rotation depend
only on its own old and new position. A failed read or check stops the reader; the copies already submitted are
drained before the error reaches the caller, so nothing is pending on the child's memory.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from kmesh.child import ChildContext
from kmesh.model.runner import KVCache
from kmesh.restore import capture, restore
from kmesh.stages.storage_objects import ObjectSet, read_verified
from kmesh.storage.routes import Route
from kmesh.workload import Child


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


def pipelined_restore(ctx: ChildContext, child: Child, objs: ObjectSet, route: Route, landing: torch.Tensor,
                      private: torch.Tensor, cache: KVCache, owner: str) -> torch.Tensor:
    """Read/check on a reader thread, copy + restore per object here; returns the bool [T] restored mask."""
    entries = objs.catalog.entries
    q: queue.Queue[tuple[Any, Any, BaseException | None]] = queue.Queue()

    def reader() -> None:
        for e in entries:
            try:
                q.put((e, read_verified(route, objs, e.index, landing), None))
            except BaseException as err:  # handed to the stage's thread
                q.put((e, None, err))
                return

    th = threading.Thread(target=reader, name=f"storage-reader-{child.name}", daemon=True)
    th.start()
    restored = torch.zeros(len(child.ids), dtype=torch.bool)
    try:
        for _ in entries:
            e, payload, err = q.get()
            if err is not None:
                raise err
            ticket = ctx.engine.submit(payload, private[e.offset:e.offset + e.nbytes], owner=owner)
            ctx.engine.drain([ticket])
            _restore_segment(ctx, cache, private, child, e.index, restored)
    finally:
        th.join()
        if ctx.engine.pending(owner):
            ctx.engine.drain(owner=owner)
    return restored
