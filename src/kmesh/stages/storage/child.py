"""One child through a storage route, timed in nested parts: read ⊂ check ⊂ restore ⊂ outer.

    outer    new model state, restore, repair (prefill + decode), outcome checks, cleanup
    restore  per object: check, then the device copy submitted (kmesh.transfer ticket, holds on both buffers);
             all copies drained; kmesh.kv.restore into the child's cache (keys rotated to the child's positions)
    check    open (header checked), read, integrity digest over the whole padded object, file-unchanged check
    read     the route's read calls alone (summed over the four objects)

The device copy of object i is in flight (engine thread on CPU, side stream on CUDA) while object i+1 is read
and checked; it starts only after its read returned (I/O completion is explicit, never a stream event). After
the drain the landing and private buffers must carry no hold (`engine.release` raises otherwise) and nothing may
be pending for the child: checked physical cleanup. Landing and private buffers are poisoned (untimed) before
every child, so a route that silently delivered nothing would fail the digest or the comparison.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from kmesh.bench import Intervals
from kmesh.harness.child import (ChildContext, ChildOutcome, ChildStateError, new_cache, outcome_of, prefill_and_decode,
                                 restore_child)
from kmesh.harness.workload import Child
from kmesh.model.runner import KVCache
from kmesh.stages.storage.objects import ObjectSet, read_verified
from kmesh.storage.routes import Route


def _part(iv: Intervals | None, name: str) -> ContextManager[Any]:
    return iv.part(name) if iv is not None else contextlib.nullcontext()


def route_restore(ctx: ChildContext, child: Child, objs: ObjectSet, route: Route, landing: torch.Tensor,
                  private: torch.Tensor, cache: KVCache | None, owner: str,
                  iv: Intervals | None = None) -> torch.Tensor | None:
    """Read, check and copy every object into `private`; restore into `cache` (None: stop after the copies)."""
    with _part(iv, "restore"):
        for entry in objs.catalog.entries:
            with _part(iv, "check"):
                payload = read_verified(route, objs, entry.index, landing,
                                        read_part=(lambda: iv.part("read")) if iv is not None else None)
            ctx.engine.submit(payload, private[entry.offset:entry.offset + entry.nbytes], owner=owner)
        ctx.engine.drain(owner=owner)
        if cache is None:
            return None
        return restore_child(cache, ctx.catalog, private, child, ctx.runner, ctx.restore_backend)


def release_checked(ctx: ChildContext, owner: str, *buffers: torch.Tensor) -> None:
    if ctx.engine.pending(owner):
        raise ChildStateError(f"{owner}: copies still pending after the drain")
    for buffer in buffers:
        ctx.engine.release(buffer)      # BufferHeldError if any ticket still holds it


def timed_child(ctx: ChildContext, child: Child, objs: ObjectSet, route: Route, landing: torch.Tensor,
                private: torch.Tensor, iv: Intervals) -> ChildOutcome:
    owner = f"storage-{route.arm}-{child.name}"
    landing.fill_(0xA5)    # untimed: a read that delivered nothing cannot pass on the previous child's bytes
    private.fill_(0x5A)
    with iv.part("outer"):
        cache = new_cache(ctx, child)
        restored = route_restore(ctx, child, objs, route, landing, private, cache, owner, iv)
        blended, tokens = prefill_and_decode(ctx, child, cache, restored, "repair")
        out = outcome_of(ctx, child, f"storage:{route.arm}", "repair", cache, restored, blended, tokens, None,
                         ["restored", "repaired"])
        release_checked(ctx, owner, landing, private)
    return out
