"""Case `child-restore` (cuda): what restoring one child costs from the call to restored bytes, host work included.

A child of the equivalence workload's shape: `segments` shared segments saved by a leader in an export buffer
(BLNHC, each from a block start, as kmesh.harness.leader exports them) and restored into a paged cache (LBNHC, child
slot = position) in the reverse order, `private_tokens` of private text before each: every token moves.
Arms, in the same rounds (kmesh.bench.rotate), each execution followed by a device synchronisation, wall clock:
  copy     one device-to-device copy of the restored bytes (the floor: read + write of every byte once);
  gather   restore_child's cuda path: kmesh.kv.gather's host plan + one launch reading the rows in place, the
           plan's checked tables kept from an earlier restore of the same arrangement (its plan cache);
  gather-cold  the same with the plan cache emptied first: every check, the tables built and uploaded;
  capture  the path it replaced: index tensors on the device, capture (a gather copy), plan_restore (checked on
           the device: host syncs), one launch.
Device time alone (CUDA events after a queued GPU sleep, host work hidden): copy vs the gather launch.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

from kmesh.bench import over_children, rotate
from kmesh.kv.gather import clear_plan_cache, plan_gather
from kmesh.kv.layout import KVLayout
from kmesh.kv.restore import capture, plan_restore
from kmesh.kv.rope import RopeConfig
from kmesh.result import Case, Result
from kmesh.stages.restore_bench.cases import SLEEP_CYCLES

GOAL_CHILD_S = 0.3e-3      # issue 23: a 5 MiB child restored in <= 0.3 ms
GOAL_VS_COPY = 0.85        # ... at >= 0.85 of the copy of its bytes


@dataclass(frozen=True)
class ChildShape:
    layers: int = 24
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    segments: int = 4
    segment_tokens: int = 104
    private_tokens: int = 24
    block_size: int = 16


@dataclass
class ChildBench:
    shape: ChildShape
    src_layout: KVLayout
    dst_layout: KVLayout
    src_raw: torch.Tensor
    raw: torch.Tensor
    rope: RopeConfig
    src_slots: np.ndarray
    old: np.ndarray
    new: np.ndarray
    copy_src: torch.Tensor
    copy_dst: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.src_slots.size)

    @property
    def nbytes(self) -> int:
        s = self.shape
        return self.tokens * s.layers * s.kv_heads * 2 * s.head_dim * self.src_layout.element_size


def build_child(shape: ChildShape, seed: int) -> ChildBench:
    s, bs = shape, shape.block_size
    per_seg_blocks = -(-s.segment_tokens // bs)
    src = KVLayout.paged("BLNHC", s.layers, s.segments * per_seg_blocks, bs, s.kv_heads, s.head_dim, s.dtype)
    prompt = s.segments * (s.segment_tokens + s.private_tokens)
    dst = KVLayout.paged("LBNHC", s.layers, -(-prompt // bs), bs, s.kv_heads, s.head_dim, s.dtype)
    src_slots, old, new = [], [], []
    at = 0
    for i in reversed(range(s.segments)):          # the child holds the segments in reverse order
        at += s.private_tokens
        src_slots.append(np.arange(i * per_seg_blocks * bs, i * per_seg_blocks * bs + s.segment_tokens))
        old.append(np.arange(i * s.segment_tokens, (i + 1) * s.segment_tokens))   # leader: back to back
        new.append(np.arange(at, at + s.segment_tokens))
        at += s.segment_tokens
    gen = torch.Generator(device="cuda").manual_seed(seed)
    src_raw = torch.randn(src.nbytes // 2, generator=gen, device="cuda").to(torch.bfloat16).view(torch.uint8) \
        if s.dtype == "bfloat16" else torch.randint(0, 0x7E, (src.nbytes,), generator=gen, device="cuda",
                                                    dtype=torch.uint8)
    raw = torch.randint(0, 256, (dst.nbytes,), generator=gen, device="cuda", dtype=torch.uint8)
    rope = RopeConfig(s.head_dim, s.head_dim, 1e6, "neox", None, 32768)
    bench = ChildBench(s, src, dst, src_raw, raw, rope, np.concatenate(src_slots), np.concatenate(old),
                       np.concatenate(new), torch.empty(0, device="cuda"), torch.empty(0, device="cuda"))
    bench.copy_src = torch.randint(0, 256, (bench.nbytes,), generator=gen, device="cuda", dtype=torch.uint8)
    bench.copy_dst = torch.empty_like(bench.copy_src)
    return bench


def gather_restore(b: ChildBench, raw: torch.Tensor) -> None:
    plan_gather(raw, b.dst_layout, b.src_raw, b.src_layout, b.src_slots, b.old, b.new, b.new, b.rope).run("cuda")


def capture_restore(b: ChildBench, raw: torch.Tensor, backend: str = "cuda") -> None:
    # as restore_child built its inputs before: index tensors made on the device, then capture + plan + run
    src = torch.from_numpy(b.src_slots).to("cuda")
    old = torch.from_numpy(b.old).to("cuda")
    new = torch.from_numpy(b.new).to("cuda")
    seg = capture(b.src_raw, b.src_layout, src, old)
    plan_restore(raw, b.dst_layout, seg, new, new, b.rope).run(backend)


def _wall(op: Callable[[], None], reps: int) -> Callable[[str, object, Any], None]:
    def run(_arm: str, _child: object, iv: Any) -> None:
        with iv.part("exec"):
            for _ in range(reps):
                op()
                torch.cuda.synchronize()
    return run


def run_child_case(sec: dict, pairs: int, warmup: int, seed: int, res: Result, case: Case) -> dict[str, Any]:
    from kmesh.cuda.restore_rope import launch_restore

    shape = ChildShape(**{k: v for k, v in (sec.get("child") or {}).items() if k != "reps"})
    reps = int((sec.get("child") or {}).get("reps", 20))
    b = build_child(shape, seed)
    case.record("shape", {**asdict(shape), "tokens": b.tokens, "restored_bytes": b.nbytes})
    # correctness first, each path into the same poisoned cache: gather == capture (kernel) == torch reference
    poison = b.raw.clone()
    outs = {}
    for name, fn in (("gather", gather_restore), ("capture", capture_restore),
                     ("torch", lambda bb, r: capture_restore(bb, r, "torch"))):
        out = poison.clone()
        fn(b, out)
        outs[name] = out
    torch.cuda.synchronize()
    for name in ("capture", "torch"):
        differ = int((outs["gather"] != outs[name]).sum())
        case.check(f"gather_equals_{name}_bytes", differ == 0, differ)
    changed = int((outs["gather"] != poison).sum())
    case.check("gather_wrote_the_child", changed > b.nbytes // 2, changed)
    # zero host syncs: a GPU sleep queued ahead is still running when the restore call has returned
    torch.cuda._sleep(SLEEP_CYCLES * 50)
    done = torch.cuda.Event()
    done.record()
    clear_plan_cache()
    t0 = time.perf_counter()
    gather_restore(b, b.raw)
    host_s = time.perf_counter() - t0
    waited = done.query()
    case.check("gather_waited_for_nothing", not waited, {"host_s": host_s, "device_done_when_returned": waited})
    torch.cuda.synchronize()

    def cold() -> None:
        clear_plan_cache()
        gather_restore(b, b.raw)

    ops = {"copy": lambda: b.copy_dst.copy_(b.copy_src), "gather": lambda: gather_restore(b, b.raw),
           "gather-cold": cold, "capture": lambda: capture_restore(b, b.raw)}

    def arm_run(arm: str, child: object, iv: Any) -> None:
        _wall(ops[arm], reps)(arm, child, iv)

    rounds = rotate(tuple(ops), pairs, warmup, over_children(arm_run, ["child"], "cpu"))
    per = {arm: [r[arm]["exec"][0] / reps for r in rounds.records] for arm in ops}
    for a, bb in (("copy", "gather"), ("capture", "gather"), ("capture", "gather-cold"), ("gather-cold", "gather")):
        res.timings[f"child-restore:{a}_vs_{bb}"] = rounds.paired(a, bb).to_dict()
    # device time alone: the gather's one launch vs the copy, the plan made outside the interval
    plan = plan_gather(b.raw, b.dst_layout, b.src_raw, b.src_layout, b.src_slots, b.old, b.new, b.new, b.rope)

    def device_run(arm: str, _child: object, iv: Any) -> None:
        torch.cuda._sleep(SLEEP_CYCLES)
        with iv.part("exec"):
            for _ in range(reps):
                b.copy_dst.copy_(b.copy_src) if arm == "copy" else launch_restore(plan)

    dev_rounds = rotate(("copy", "kernel"), pairs, warmup, over_children(device_run, ["child"], "cuda"))
    dev = {arm: [r[arm]["exec"][0] / reps for r in dev_rounds.records] for arm in ("copy", "kernel")}
    res.timings["child-restore:device_copy_vs_kernel"] = dev_rounds.paired("copy", "kernel").to_dict()
    med = {arm: statistics.median(v) for arm, v in per.items()}
    summ = {
        "restored_bytes": b.nbytes, "tokens": b.tokens, "reps": reps, "pairs": pairs,
        "wall_s": med,
        "gather_speedup_vs_capture": statistics.median(c / g for c, g in zip(per["capture"], per["gather"])),
        "gather_won_vs_capture": sum(g < c for c, g in zip(per["capture"], per["gather"])),
        "cold_speedup_vs_capture": statistics.median(c / g for c, g in zip(per["capture"], per["gather-cold"])),
        "cold_won_vs_capture": sum(g < c for c, g in zip(per["capture"], per["gather-cold"])),
        "wall_copy_over_gather": statistics.median(c / g for c, g in zip(per["copy"], per["gather"])),
        "device_s": {arm: statistics.median(v) for arm, v in dev.items()},
        "device_kernel_vs_copy": statistics.median(c / k for c, k in zip(dev["copy"], dev["kernel"])),
        "host_s_one_call": host_s,
    }
    summ["goal_child_s_met"] = med["gather"] <= GOAL_CHILD_S
    summ["goal_child_s_met_cold"] = med["gather-cold"] <= GOAL_CHILD_S
    summ["goal_vs_copy_met"] = summ["device_kernel_vs_copy"] >= GOAL_VS_COPY
    case.record("summary", summ)
    return summ
