"""The equivalence stage's controls.

Negative controls: the comparisons can fail — one flipped bit in K, V, logits, a recompute mask, one changed
token, or one flipped byte of a staged segment is caught.

Failure controls (seven): each child run is made to fail at its second segment (FAIL_AT) and must end safely.
kmesh.harness.child copies and restores the segments verified before a failure before the failure propagates (a private
copy failing at segment k: the k copies before it), so when the failure comes the child's model state (poisoned
beforehand) already holds the first segment, restored: the fallback recomputes in that partially
written state, not in fresh memory. Each control checks that the failure is the expected
SegmentLoadError/TransferError; that the model state held exactly the slots of the segments before FAIL_AT when the
recompute began (the partial data was there); that nothing was pending on the child's memory then; that K/V of every
layer, the next-token logits and the generated tokens equal the full-recompute reference computed before the
service started, bit for bit; and that the service holds no registration, mapping, pin, reservation or copy of the
child afterwards — for the killed service, which holds nothing any more, that this process no longer maps (or holds
an fd of) the child's staging memory and that nothing is pending or held in its transfer engine.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kmesh.harness.child import ChildContext, ChildOutcome, full_reference, run_child
from kmesh.harness.modelsetup import ModelSetup
from kmesh.harness.service import HarnessError
from kmesh.harness.service_side import ServiceSide, Staging
from kmesh.harness.workload import Child
from kmesh.kv.errors import (PrivateCopyError, SegmentCancelledError, SegmentCorruptError, SegmentLayoutError,
                             SegmentMissingError, SegmentSourceLostError, SegmentTruncatedError)
from kmesh.kv.load import stage_segments
from kmesh.kv.sources import InProcessSegments, ServiceSegments
from kmesh.model.quality import compare_states, flip_bit, identical
from kmesh.result import Case, Result
from kmesh.service.handles import references_in_self
from kmesh.stages.equivalence.refs import FULL, REPAIR, RefKey, Refs
from kmesh.transfer.engine import TransferEngine
from kmesh.transfer.errors import SubmitError
from kmesh.transfer.faults import FaultPlan


def _wait_gpu_context_gone(pid: int, timeout_s: float = 20.0) -> dict[str, Any]:
    """Until nvidia-smi no longer lists pid as a compute process (its context, and any DMA it had in flight
    into memory of ours it mapped, is gone). Returns what was observed; a host that hides other processes
    from nvidia-smi reports listed_at_start False."""

    def listed() -> bool | None:
        try:
            smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return str(pid) in smi.stdout.split()

    t0 = time.monotonic()
    first = listed()
    now = first
    while now and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
        now = listed()
    return {"listed_at_start": first, "listed_at_end": now, "waited_s": time.monotonic() - t0}


def negative_controls(res: Result, setup: ModelSetup, refs: Refs) -> None:
    name = setup.workload.children[0].name
    layer = min(3, setup.runner.num_layers - 1)
    with res.case("negative-controls", {"child": name, "layer": layer}) as case:
        if RefKey(REPAIR, name) not in refs:
            case.skip(f"child {name} has no repaired outcome to perturb (see child-{name})")
        base = refs[RefKey(REPAIR, name)]
        layers = base.k.shape[0]
        # the comparator's equal side on a second, independent run of the same child (not base with itself)
        staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        again = run_child(setup.ctx, setup.workload.children[0], InProcessSegments(setup.export), staging,
                          torch.empty_like(staging))
        case.check("identical_to_a_rerun", identical(compare_states(base, again)))
        flipped_k = base.k.clone()
        flipped_k[layer] = flip_bit(flipped_k[layer], 7)
        cmp = compare_states(base, dataclasses.replace(base, k=flipped_k))
        case.check("k_bit_flip_caught", not identical(cmp) and cmp["k_equal_layers"] == layers - 1
                   and cmp["first_unequal_layer"] == layer, value=cmp["k_equal_layers"])
        flipped_v = base.v.clone()
        flipped_v[layer] = flip_bit(flipped_v[layer], 11)
        case.check("v_bit_flip_caught",
                   compare_states(base, dataclasses.replace(base, v=flipped_v))["v_equal_layers"] == layers - 1)
        cmp = compare_states(base, dataclasses.replace(base, logits=flip_bit(base.logits, 5)))
        case.check("logits_bit_flip_caught", not cmp["logits_equal"] and not identical(cmp))
        masks = base.masks.clone()
        masks[layer] = flip_bit(masks[layer], 0)
        case.check("mask_flip_caught",
                   compare_states(base, dataclasses.replace(base, masks=masks))["mask_equal_layers"] == layers - 1)
        tokens = list(base.tokens)
        tokens[-1] += 1
        case.check("token_change_caught",
                   not compare_states(base, dataclasses.replace(base, tokens=tokens))["tokens_equal"])
        export = setup.export
        objects = {e.key: export.raw[e.offset:e.offset + e.nbytes].clone() for e in export.catalog.entries}
        first = export.catalog.entries[0].key
        objects[first][objects[first].numel() // 2] ^= 0x10
        staging = torch.empty(export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        caught: SegmentCorruptError | None = None
        try:
            stage_segments(InProcessSegments(export, objects), staging, export.catalog)
        except SegmentCorruptError as e:
            caught = e
        case.check("staged_byte_flip_caught", caught is not None,
                   value=str(caught)[:120] if caught is not None else "no error")


FAIL_AT = 1          # the catalog entry each control fails at: entry 0 is restored in the model state by then
STAGING_FILL = 0xA5  # kmesh.kv.load.stage_segments fills staging with it before the loads


class ControlSetupError(ValueError):
    """The workload cannot host the failure controls (a catalog of fewer than FAIL_AT + 1 segments)."""


@dataclass
class Ran:
    """One control's run: the context it ran in, its outcome, and what it left in its staging buffer."""

    ctx: ChildContext
    out: ChildOutcome
    staging: Staging
    failing_segment_bytes_landed: int   # bytes of entry FAIL_AT's staging range no longer the fill when it ended


def expected_partial(child: Child, capacity: int, before: int) -> torch.Tensor:
    """bool [capacity]: the slots (= positions) of the child's placements of the segments before `before`,
    what its model state must hold when a failure at segment `before` starts the recompute."""
    want = torch.zeros(capacity, dtype=torch.bool)
    for seg, start, end in child.segment_slices():
        if seg < before:
            want[start:end] = True
    return want


def _settled(case: Case, ran: Ran, ref: ChildOutcome, expect: type, svc: ServiceSide | None,
             child: Child) -> bool:
    """The checks every failure control ends with; True when all pass.

    `ref` is the child's full-recompute reference computed before the service started, before any control:
    the recompute in the partially written model state must equal it bit for bit — K/V of every layer,
    next-token logits and greedy tokens. (Where the tokens differ, the control makes a full recompute after it
    and records whether the fallback's tokens equal that one: it tells an environment that changed the decode apart
    from a fallback that went wrong.)"""
    out, ctx = ran.out, ran.ctx
    written = out.written_before_recompute
    want = None if written is None else expected_partial(child, written.numel(), FAIL_AT)
    ok = [case.check("failed_as_expected", (out.fallback or "").startswith(expect.__name__), value=out.fallback),
          case.check("recomputed_after_drain", "pending-before-recompute:0" in out.events
                     and out.events[-1] == "recompute", value=out.events),
          case.check("partial_data_in_destination", want is not None and bool(want.any())
                     and torch.equal(written, want),
                     value={"slots_written": None if written is None else int(written.sum()),
                            "slots_expected": None if want is None else int(want.sum()),
                            "segments_restored_before_failure": list(range(FAIL_AT))}),
          case.check("kv_equal_pre_failure_reference", torch.equal(out.k, ref.k) and torch.equal(out.v, ref.v)),
          case.check("logits_equal_pre_failure_reference", torch.equal(out.logits, ref.logits)),
          case.check("tokens_equal_pre_failure_reference", out.tokens == ref.tokens,
                     value={"fallback": out.tokens, "reference": ref.tokens}),
          case.check("no_engine_holds", ctx.engine.live_holds() == 0 and not ctx.engine.pending(),
                     value=ctx.engine.live_holds())]
    if svc is not None:
        ok.append(case.check("no_service_leaks", svc.no_leaks(), value=svc.leaks()))
    case.record("failing_segment_bytes_landed_in_staging", ran.failing_segment_bytes_landed)
    case.record("outcome", out.describe())
    return all(ok)


def _own_staging_released(case: Case, staging: Staging) -> bool:
    """The killed service cannot report leaks: this process's own hold on the staging memory must be gone."""
    if staging.host is None:   # CUDA: the staging is this process's own device allocation, no mapping of a file
        case.record("staging_mapping", "cuda: the staging is our own device allocation; the service's IPC "
                                       "mapping of it went with the service's process")
        return True
    left = references_in_self(staging.host.tag)
    return all([case.check("staging_unmapped_in_child", not left["maps"], value=left["maps"]),
                case.check("staging_fd_closed_in_child", not left["fds"], value=left["fds"])])


class FailingSubmitAt(TransferEngine):
    """A transfer engine whose submit number `at` (from 0) is accepted and started, then fails
    (FaultPlan.fail_after_submit): the private copy of segment `at` of a child whose copies it alone makes."""

    def __init__(self, device: str, faults: FaultPlan, at: int) -> None:
        super().__init__(device, faults)
        self._before = at

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        if self._before == 0:
            self.faults.fail_after_submit = 1
        self._before -= 1
        return super().submit(*args, **kwargs)


Make = Callable[[Child], Ran]   # one control: how it ran


def failure_controls(res: Result, setup: ModelSetup, svc: ServiceSide, refs: Refs) -> int:
    """Run the seven controls (the killed service last); returns how many passed."""
    catalog = setup.export.catalog
    if len(catalog.entries) <= FAIL_AT:
        raise ControlSetupError(f"the failure controls fail at segment {FAIL_AT} with segment {FAIL_AT - 1} "
                                f"restored; this catalog has {len(catalog.entries)} segment(s)")
    children = setup.workload.children
    harness = svc.h
    private = torch.empty(catalog.nbytes, dtype=torch.uint8, device=setup.device)
    block_bytes = catalog.layout.byte_strides["B"]
    target = catalog.entries[FAIL_AT]
    gpu_teardown: dict[int, Any] = {}
    passed = 0

    def with_key(key: bytes) -> ChildContext:
        entries = tuple(dataclasses.replace(e, key=key) if e.index == FAIL_AT else e for e in catalog.entries)
        return dataclasses.replace(setup.ctx, catalog=dataclasses.replace(catalog, entries=entries))

    def at_target(action: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """after_accept: the earlier segments' loads run to their end, `action` takes the target's load."""
        loads = itertools.count()

        def after(req: int, nbytes: int) -> None:
            (action if next(loads) == FAIL_AT else svc.after_accept)(req, nbytes)
        return after

    def service_child(ctx: ChildContext, child: Child, after: Callable[[int, int], None] | None = None) -> Ran:
        with svc.staging(f"control-{child.name}") as staging:
            out = run_child(ctx, child, ServiceSegments(svc.client, staging.reg, after or svc.after_accept),
                            staging.tensor, private)
            landed = staging.tensor[target.offset:target.offset + target.nbytes] != STAGING_FILL
            return Ran(ctx, out, staging, int(landed.sum()))

    def control(name: str, child_index: int, expect: type, make: Make, service_alive: bool = True,
                params: dict[str, Any] | None = None) -> None:
        nonlocal passed
        child = children[child_index % len(children)]
        with res.case(f"control-{name}", {"child": child.name, "expect": expect.__name__, "segment": FAIL_AT,
                                          **(params or {})}) as case:
            ran = make(child)
            ok = []
            if not service_alive:
                case.record("gpu_context_teardown", gpu_teardown)
                ok.append(_own_staging_released(case, ran.staging))
            ref = refs[RefKey(FULL, child.name)]
            ok.append(_settled(case, ran, ref, expect, svc if service_alive else None, child))
            if ran.out.tokens != ref.tokens:   # a diagnosis, made only where it is needed (see _settled)
                now = full_reference(setup.ctx, child)
                case.record("tokens_equal_recompute_after_control", ran.out.tokens == now.tokens)
            cause = (params or {}).get("cause")
            if cause is not None:   # the error the expected one wraps
                ok.append(case.check("failed_by_the_expected_cause", f"{cause}:" in (ran.out.fallback or ""),
                                     value=ran.out.fallback))
            if all(ok):
                passed += 1

    def missing(child: Child) -> Ran:
        key = target.key + b"-evicted"
        svc.save_variant(target, key)
        harness.admin.evict(key)
        return service_child(with_key(key), child)

    def corrupt(child: Child) -> Ran:
        key = target.key + b"-corrupt"
        svc.save_variant(target, key, flip_byte=target.nbytes // 3)
        return service_child(with_key(key), child)

    def truncated(child: Child) -> Ran:
        key = target.key + b"-truncated"
        svc.save_variant(target, key, nbytes=target.nbytes - block_bytes)
        return service_child(with_key(key), child)

    def wrong_layout(child: Child) -> Ran:
        # the object was saved from a registration that declared another per-block geometry (same bytes)
        key = target.key + b"-wrong-layout"
        svc.save_variant(target, key, layout={**catalog.layout.to_dict(), "order": "BLHNC"})
        return service_child(with_key(key), child)

    def after_submit(child: Child) -> Ran:
        # the child's private copies go through this engine only, one submit per segment in order: the target's
        # is accepted, started, then fails
        engine = FailingSubmitAt(str(setup.device), FaultPlan(chunk_bytes=1 << 20), at=FAIL_AT)
        ctx = dataclasses.replace(setup.ctx, engine=engine)
        try:
            return service_child(ctx, child)
        finally:
            engine.close()

    def one_chunk_in(req: int, nbytes: int) -> None:
        """Accept the target's copy and let exactly one of its chunks through: provably mid-copy only when the
        copy is more than one chunk, so a target of one chunk is a clear error, not a wait for a copy that ended."""
        harness.accepted(nbytes)
        if harness.chunks(nbytes) < 2:
            harness.finish()
            raise HarnessError(f"the target's copy ({nbytes} B) is one chunk of equivalence.chunk_bytes="
                               f"{harness.chunk_bytes}: it cannot be stopped mid-copy; make chunk_bytes smaller")
        harness.grant(1)

    def cancel_mid_copy(req: int, nbytes: int) -> None:
        one_chunk_in(req, nbytes)
        harness.wait_chunks(req, 1, timeout=60.0)   # provably mid-copy
        svc.client.cancel(req)
        harness.finish()

    def kill_mid_copy(req: int, nbytes: int) -> None:
        one_chunk_in(req, nbytes)
        harness.wait_chunks(req, 1, timeout=60.0)
        pid = harness.service.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while harness.service.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if setup.device.type == "cuda":
            gpu_teardown[pid] = _wait_gpu_context_gone(pid)

    control("missing-object", 0, SegmentMissingError, missing)
    control("corrupt-object", 1, SegmentCorruptError, corrupt)
    control("truncated-object", 2, SegmentTruncatedError, truncated, params={"short_by": block_bytes})
    control("wrong-layout-descriptor", 3, SegmentLayoutError, wrong_layout, params={"order": "BLHNC"})
    control("failure-after-device-work-submitted", 0, PrivateCopyError, after_submit,
            params={"cause": SubmitError.__name__})
    control("cancelled-child", 1, SegmentCancelledError, lambda child: service_child(setup.ctx, child,
                                                                                    at_target(cancel_mid_copy)))
    control("service-killed-mid-load", 2, SegmentSourceLostError,
            lambda child: service_child(setup.ctx, child, at_target(kill_mid_copy)), service_alive=False)
    return passed
