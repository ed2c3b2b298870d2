"""Stage `restore_bench` (issue 14): what a restore costs against moving the same bytes once.

Design (kmesh.bench, DESIGN §5): per shape (kmesh.stages.restore_bench.cases.SHAPES), matched pairs, arm order
alternating, warm-up pairs excluded; each timed interval holds `reps` back-to-back executions, time per execution
= interval / reps; ratios are medians of the per-pair ratios.
  cuda: copy vs kernel  — torch's device-to-device copy of exactly the segment's bytes (the bandwidth ceiling:
                          it reads and writes every byte once, as a restore must) against the restore_rope kernel;
        torch vs kernel — kmesh.kv.restore's torch path against the kernel, same validated plan.
        Intervals are CUDA events, preceded (outside the interval) by a GPU sleep so that host-side launch work
        is queued ahead and the events time the GPU only.
  cpu:  copy vs torch   — a plain CPU copy of the same bytes against kmesh.kv.restore's torch path.
Bandwidth = bytes counted / time: for a restore, segment read + cells written + shift tables + slots
(RestorePlan.bytes_moved); for the copy, read + write of the segment's bytes.
Correctness, after timing, each path into a freshly poisoned cache: restored values equal the segment's byte for
byte, no byte outside the destination cells changes; on cuda the kernel's whole buffer equals the torch path's
(bytes_differ). Goals (kernel ≥ 0.85 of the copy's bandwidth, ≥ 20× the torch path) are recorded as met or
missed, never turned into pass/fail: a case fails only on a correctness check.
Variants (cuda): compile-time tunables of kernels/restore_rope.cu, each an nvcc flag set; the summary uses the
first (the default build).
"""
from __future__ import annotations

import os
import statistics
from typing import Any

import torch

from kmesh.bench import PairedTiming, run_pairs
from kmesh.config import Config
from kmesh.result import Case, Result
from kmesh.stages.restore_bench.cases import Bench, build, check_restored, shape, timed

GOAL_BANDWIDTH = 0.85   # kernel / copy bandwidth (issue 3)
GOAL_SPEEDUP = 20.0     # torch time / kernel time
CHILD_CASE = "child-restore"   # kmesh.stages.restore_bench.child: one child's restore, host work included (cuda)


def _medians(timing: PairedTiming, arm: str, reps: int) -> list[float]:
    return [x / reps for x in timing.per_pair(arm, "exec")]


def _compare(ops: dict, arms: tuple[str, str], reps: int, pairs: int, warmup: int, device: str,
             res: Result, key: str) -> tuple[list[float], list[float]]:
    timing = run_pairs(timed(ops, {arms[0]: reps, arms[1]: reps}, device), arms, ["segment"], pairs=pairs,
                       warmup=warmup, device=device, progress=False)
    res.timings[key] = timing.to_dict()
    return _medians(timing, arms[0], reps), _medians(timing, arms[1], reps)


def _cpu_shape(name: str, bench: Bench, sec: dict, pairs: int, warmup: int, res: Result,
               case: Case) -> dict[str, Any]:
    counted = bench.plan.bytes_moved()
    ops = {"copy": lambda: bench.copy_dst.copy_(bench.copy_src), "torch": lambda: bench.plan.run("torch")}
    copy_t, torch_t = _compare(ops, ("copy", "torch"), sec["reps"], pairs, warmup, "cpu", res,
                               f"{name}:copy_vs_torch")
    case.check("copy_equals_source", bool(torch.equal(bench.copy_dst, bench.copy_src)))
    chk = check_restored(bench, lambda p: p.run("torch"))
    case.check("torch_values_byte_identical", chk["values_differ"] == 0, chk["values_differ"])
    case.check("torch_outside_cells_untouched", chk["outside_differ"] == 0, chk["outside_differ"])
    ratio = statistics.median(t_ / c_ for c_, t_ in zip(copy_t, torch_t))
    return {"copy_s": statistics.median(copy_t), "torch_s": statistics.median(torch_t),
            "copy_GBps": 2 * bench.seg_bytes / statistics.median(copy_t) / 1e9,
            "torch_GBps": counted["total"] / statistics.median(torch_t) / 1e9,
            "time_ratio_torch_over_copy": ratio,
            "torch_vs_copy": counted["total"] / (2 * bench.seg_bytes) / ratio,
            "kernel_vs_copy": None, "speedup_vs_torch": None,
            "bytes_differ": chk["values_differ"] + chk["outside_differ"],
            "pairs": pairs, "bytes": counted, "segment_bytes": bench.seg_bytes}


def _use_variant(flags: str) -> None:
    from kmesh.cuda import configure

    os.environ["KMESH_KERNEL_FLAGS"] = flags
    configure(None)


def _cuda_variant(name: str, flags: str, bench: Bench, sec: dict, pairs: int, warmup: int, res: Result,
                  case: Case) -> dict[str, Any]:
    from kmesh.cuda.restore_rope import launch_restore

    _use_variant(flags)
    launch = launch_restore(bench.plan)   # compiles/loads this variant outside the timing
    counted = bench.plan.bytes_moved()
    tag = flags or "default"
    ops = {"copy": lambda: bench.copy_dst.copy_(bench.copy_src), "kernel": lambda: launch_restore(bench.plan),
           "torch": lambda: bench.plan.run("torch")}
    copy_t, kern_t = _compare(ops, ("copy", "kernel"), sec["reps"], pairs, warmup, "cuda", res,
                              f"{name}:copy_vs_kernel[{tag}]")
    torch_t, kern2_t = _compare(ops, ("torch", "kernel"), sec["torch_reps"], pairs, warmup, "cuda", res,
                                f"{name}:torch_vs_kernel[{tag}]")
    case.check(f"copy_equals_source[{tag}]", bool(torch.equal(bench.copy_dst, bench.copy_src)))
    ref = check_restored(bench, lambda p: p.run("torch"))
    ker = check_restored(bench, launch_restore)
    differ = int((ref["_buf"] != ker["_buf"]).sum())
    case.check(f"kernel_equals_torch_bytes[{tag}]", differ == 0, differ)
    case.check(f"torch_values_byte_identical[{tag}]", ref["values_differ"] == 0, ref["values_differ"])
    case.check(f"kernel_outside_cells_untouched[{tag}]", ker["outside_differ"] == 0, ker["outside_differ"])
    ratio = statistics.median(c_ / k_ for c_, k_ in zip(copy_t, kern_t))
    return {"launch": launch, "copy_s": statistics.median(copy_t), "kernel_s": statistics.median(kern_t),
            "copy_GBps": 2 * bench.seg_bytes / statistics.median(copy_t) / 1e9,
            "kernel_GBps": counted["total"] / statistics.median(kern_t) / 1e9,
            "torch_GBps": counted["total"] / statistics.median(torch_t) / 1e9,
            "time_ratio_copy_over_kernel": ratio,
            "kernel_vs_copy": ratio * counted["total"] / (2 * bench.seg_bytes),
            "kernel_won_vs_copy": sum(k_ < c_ for c_, k_ in zip(copy_t, kern_t)),
            "torch_s": statistics.median(torch_t), "kernel_s_in_torch_pairs": statistics.median(kern2_t),
            "speedup_vs_torch": statistics.median(t_ / k_ for t_, k_ in zip(torch_t, kern2_t)),
            "kernel_won_vs_torch": sum(k_ < t_ for t_, k_ in zip(torch_t, kern2_t)),
            "bytes_differ": differ, "pairs": pairs, "bytes": counted, "segment_bytes": bench.seg_bytes}


def run(cfg: Config) -> Result:
    res = Result.begin("restore_bench", cfg)
    sec = cfg.section("restore_bench")
    device = sec["device"]
    pairs = sec.get("pairs") or cfg.data["timing"]["pairs"]
    warmup = cfg.data["timing"]["warmup"]
    res.extra["design"] = __doc__.split("Design", 1)[1].strip()
    res.extra["device"] = device
    shapes: dict[str, Any] = {}
    if device == "cuda":
        # (cpu has no such case: the host it runs on is no claim; its shape cases check every byte)
        with res.case("device", {"device": device}) as case:
            available = torch.cuda.is_available()
            case.check("cuda_available", available, value=torch.cuda.get_device_name() if available
                       else "restore_bench.device is cuda but torch sees no GPU")
            if available:
                sent = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(cfg.seed))
                case.check("device_round_trip_bytes_equal", torch.equal(sent.to(device).cpu(), sent))
        if not torch.cuda.is_available():
            return res
        res.extra["gpu"] = torch.cuda.get_device_name()
    variants = sec.get("variants") or [""]
    for si, name in enumerate(sec["shapes"]):
        spec = shape(name)
        with res.case(name, spec.params()) as case:
            bench = build(spec, cfg.seed + si, device)
            if device == "cpu":
                summ = _cpu_shape(name, bench, sec, pairs, warmup, res, case)
            else:
                per_variant = {flags or "default": _cuda_variant(name, flags, bench, sec, pairs, warmup, res,
                                                                 case)
                               for flags in variants}
                _use_variant(variants[0])
                summ = dict(per_variant[variants[0] or "default"])
                ok = {k: v for k, v in per_variant.items() if v["bytes_differ"] == 0}
                summ["fastest_variant"] = min(ok, key=lambda k: ok[k]["kernel_s"]) if ok else None
                case.record("variants", per_variant)
                summ["goal_bandwidth_met"] = summ["kernel_vs_copy"] >= GOAL_BANDWIDTH
                summ["goal_speedup_met"] = summ["speedup_vs_torch"] >= GOAL_SPEEDUP
            case.record("summary", summ)
            shapes[name] = {k: summ[k] for k in ("kernel_vs_copy", "speedup_vs_torch", "bytes_differ",
                                                 "copy_GBps", "segment_bytes")}
            shapes[name].update({k: summ[k] for k in ("kernel_GBps", "torch_GBps", "torch_vs_copy",
                                                      "goal_bandwidth_met", "goal_speedup_met") if k in summ})
            bench = None   # free this shape's buffers before the next one
            if device == "cuda":
                torch.cuda.empty_cache()
    res.extra["shapes"] = shapes
    if device == "cuda":
        from kmesh.stages.restore_bench.child import run_child_case

        with res.case(CHILD_CASE, dict(sec.get("child") or {})) as case:
            res.extra["child"] = run_child_case(sec, pairs, warmup, cfg.seed, res, case)
    else:
        res.skip_case(CHILD_CASE, dict(sec.get("child") or {}), "restore_bench.device is cpu: the one-launch child "
                      "restore is the CUDA kernel's (its host plan and refusals are tested on the CPU by "
                      "tests/test_restore_gather.py)")
    res.extra["goals"] = {"kernel_vs_copy": GOAL_BANDWIDTH, "speedup_vs_torch": GOAL_SPEEDUP}
    if device == "cuda":
        from kmesh.cuda import kernel_info

        res.extra["kernel"] = kernel_info("restore_rope")
    return res
