"""The group path end to end: every member's segments loaded from the service's shared originals and admitted as a
group (kmesh.stages.group.load), private copies, restore, one layer-major blend_group over all members with each
finished layer written back to the member's private destination blocks by an async copy, then decode.

A member that fails (an injected fault after a chosen layer) drains what is still pending on its memory and
recomputes fully without reuse, in its working cache as the failure left it (restored segments and the layers it
repaired, which the recompute overwrites: kmesh.harness.child); the other members go on unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kmesh.harness.child import ChildOutcome, new_cache, outcome_of, prefill_and_decode, restore_child, written_slots
from kmesh.harness.modelsetup import ModelSetup
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import Child
from kmesh.model.group import InjectedMemberFault, Member, blend_group
from kmesh.model.runner import KVCache
from kmesh.stages.group.load import GroupLoad
from kmesh.transfer.engine import TransferEngine
from kmesh.transfer.faults import ChunkGate, FaultPlan


class Writeback:
    """after_layer hook: a member's finished layer (one contiguous range of its LBNHC working cache) goes to
    its private destination blocks by an async engine copy, overlapping the next layer's compute. An
    injected fault fires right after the chosen member's chosen layer was submitted."""

    def __init__(self, engines: dict[str, TransferEngine], caches: dict[str, KVCache],
                 dests: dict[str, torch.Tensor], fail: dict[str, int] | None = None) -> None:
        self.engines, self.caches, self.dests, self.fail = engines, caches, dests, fail or {}
        layout = next(iter(caches.values())).layout
        self.layer_bytes = layout.byte_strides["L"]

    def __call__(self, name: str, layer: int) -> None:
        start, end = layer * self.layer_bytes, (layer + 1) * self.layer_bytes
        self.engines[name].submit(self.caches[name].raw[start:end], self.dests[name][start:end], owner=f"group-{name}")
        if self.fail.get(name) == layer:
            raise InjectedMemberFault(f"member {name} failed after layer {layer} (injected)")


@dataclass
class GroupRun:
    outcomes: dict[str, ChildOutcome]
    admission: dict[str, Any]
    failure: dict[str, Any]
    loads: int
    order_layer_major: bool
    writeback_equal: dict[str, bool]


def _layer_major(order: list[tuple[int, str]]) -> bool:
    """No member entered layer l+1 before every live member finished layer l."""
    layers = [layer for layer, _ in order]
    return layers == sorted(layers)


def run_group(setup: ModelSetup, svc: ServiceSide, children: tuple[Child, ...], fail: dict[str, int] | None = None,
              gated: str | None = None) -> GroupRun:
    """The group path end to end (module doc); `fail` = {member: the layer after which it fails}, `gated` = the
    member whose write-back copies wait at a gate (so its layer-0 copy is provably pending when it fails)."""
    runner, catalog, device, ctx = setup.runner, setup.export.catalog, setup.device, setup.ctx
    names = [child.name for child in children]
    by_name = {child.name: child for child in children}
    privates = {n: torch.empty(catalog.nbytes, dtype=torch.uint8, device=device) for n in names}
    with GroupLoad(svc, catalog, names) as load:
        load.load_all()
        admission = load.admit()
        load.copy_private(ctx.engine, privates)
    caches = {n: new_cache(ctx, by_name[n]) for n in names}
    restored = {n: restore_child(caches[n], catalog, privates[n], by_name[n], runner, ctx.restore_backend)
                for n in names}
    dests = {n: torch.full_like(caches[n].raw, 0xA5) for n in names}
    gate = ChunkGate() if gated else None
    engines = {n: ctx.engine for n in names}
    if gated:   # the failing member's copies wait at a gate: its layer-0 write-back is provably pending
        engines[gated] = TransferEngine(str(device), FaultPlan(chunk_bytes=1 << 16), gate=gate)
    hook = Writeback(engines, caches, dests, fail)
    members = [Member(n, torch.tensor(by_name[n].ids, device=device), caches[n], restored[n]) for n in names]
    out = blend_group(runner, members, ctx.repair, after_layer=hook)
    failure: dict[str, Any] = {}
    outcomes: dict[str, ChildOutcome] = {}
    writeback_equal: dict[str, bool] = {}
    try:
        for name in names:
            child, owner = by_name[name], f"group-{name}"
            if name in out.failed:
                failed_layer, reason = out.failed[name]
                events = [f"failed-after-layer:{failed_layer}"]
                pending = engines[name].pending(owner)
                events.append(f"pending-at-failure:{len(pending)}")
                if gate is not None and name == gated:
                    gate.open()          # the held copy may finish now; the member waits for it
                engines[name].drain(pending, timeout=60.0)
                events.append(f"pending-before-recompute:{len(engines[name].pending(owner))}")
                # as kmesh.harness.child.run_child: the member recomputes in its working cache as the failure left it
                # (restored segments, the layers it repaired), which the full prefill must overwrite; its
                # write-back destination is not the recompute's and is invalidated
                cache = caches[name]
                written = written_slots(cache)
                dests[name].fill_(0xA5)
                none = torch.zeros(len(child.ids), dtype=torch.bool)
                result, tokens = prefill_and_decode(ctx, child, cache, none, "full")
                events.append("recompute")
                outcomes[name] = outcome_of(ctx, child, "service", "full", cache, none, result, tokens, reason, events,
                                            written)
                failure[name] = {"layer": failed_layer, "reason": reason, "events": events,
                                 "pending_at_failure": len(pending),
                                 "slots_written_before_recompute": int(written.sum())}
                continue
            engines[name].drain(owner=owner, timeout=60.0)
            writeback_equal[name] = bool(torch.equal(dests[name], caches[name].raw))   # every layer's write-back landed
            result = out.results[name]
            tokens = runner.decode(caches[name], len(child.ids), result.logits, ctx.max_new_tokens)
            outcomes[name] = outcome_of(ctx, child, "service", "repair", caches[name], restored[name], result, tokens,
                                        None, ["group-admitted", "private-copy-drained", "restored", "layer-major"])
    finally:
        if gate is not None:
            gate.open()
            engines[gated].close()
    return GroupRun(outcomes, admission, failure, admission["loads"], _layer_major(out.order), writeback_equal)
