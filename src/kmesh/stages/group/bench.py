"""The group stage's measurements: batched group math against the unbatched path, scaling pairs, bytes held.

batched-agreement  the batched path (kmesh.model.group: stacked projections / MLP, one deviation reduction,
                   one padded attention call, one rotation per layer for every member's placements) against
                   the unbatched layer-major path on the same inputs: restored bytes equal (rotation),
                   measured max |Δ| of K, V and logits, masks and generated tokens equal.
scaling-<N>        matched rounds (kmesh.bench.rotate: the three arms in every round, the order reversed from
                   round to round, warm-up rounds excluded) for each group size N, the group of N children as
                   one "child" of the harness: serial vs layer-major and serial vs batched, paired over the
                   same serial runs, each arm's spread over the rounds recorded beside the ratios.
rag-scaling-<N>    the same over the RAG-shaped workload (`group.rag`: many retrieved chunks every child holds
                   in an order of its own, a short private question; kmesh.harness.workload.build_rag).
                   Timed (both) = the repair of the whole group: each member's restore (RoPE shift into its
                   cache) + prefill, ending with every member's first token on the host; loading
                   from the service is not in it (the storage stage times reads). Peak memory of one untimed
                   run per arm: CUDA torch.cuda.max_memory_allocated above the run's baseline (device memory);
                   CPU the process's peak RSS above its baseline (VmHWM after resetting it through
                   /proc/self/clear_refs, with glibc's mmap threshold pinned so freed tensors leave RSS): host
                   memory of the whole process, not a device figure.
bytes-held         the store holds each original once (the service's own used_bytes); each child holds its
                   repaired K/V of the restored positions. Against the shared original moved to the child's
                   positions (what restore writes, reproducible from the original), a child differs only in
                   the (layer, position) rows the repair recomputed: counted byte for byte, a diff = those rows
                   + a 4-byte index each.
"""
from __future__ import annotations

import ctypes
import statistics
from typing import TYPE_CHECKING, Any, Callable

import torch

from kmesh.bench import Intervals, over_children, rotate
from kmesh.errors import StageError
from kmesh.harness.child import new_cache, outcome_of, restore_child, restored_mask
from kmesh.harness.workload import Child
from kmesh.kv.restore import capture
from kmesh.model.blend import blend, plan
from kmesh.model.graphs import GraphedRun
from kmesh.model.group import LayerwiseRestore, Member, RestorePart, blend_group
from kmesh.model.quality import compare_states
from kmesh.result import Result

if TYPE_CHECKING:
    from kmesh.harness.child import ChildOutcome
    from kmesh.stages.group.stage import GroupSetup

ARMS = ("serial", "layer_major", "batched")


class GroupBenchError(StageError):
    """A scaling size the workload cannot fill."""


def batched_attention(setup: GroupSetup) -> str:
    """group.batched_attention: how the batched step attends (kmesh.model.group: "member" or "padded")."""
    return str(setup.sec.get("batched_attention", "member"))


def restore_parts(setup: GroupSetup, children: tuple[Child, ...], caches: dict[str, Any],
                  private: torch.Tensor) -> list[RestorePart]:
    """Each member's segments captured from its private copy (here: the export's bytes), with new positions."""
    catalog, device = setup.export.catalog, setup.device
    parts = []
    for child in children:
        slices = child.segment_slices()
        src = torch.cat([catalog.entries[i].slots(device) for i, _, _ in slices])
        old = torch.cat([catalog.entries[i].leader_positions(device) for i, _, _ in slices])
        new = torch.cat([torch.arange(a, b, device=device) for _, a, b in slices])
        parts.append(RestorePart(caches[child.name], capture(private, catalog.layout, src, old), new))
    return parts


class Arms:
    """The three ways to repair one group, over caches allocated once (every run rewrites [0, T) of each)."""

    def __init__(self, setup: GroupSetup, children: tuple[Child, ...]) -> None:
        self.setup, self.children = setup, children
        self.caches = {ch.name: new_cache(setup.ctx, ch) for ch in children}
        self.ids = {ch.name: torch.tensor(ch.ids, device=setup.device) for ch in children}
        self.restored = {ch.name: restored_mask(ch) for ch in children}
        self.private = setup.export.raw
        self.attention = batched_attention(setup)

    def _members(self) -> list[Member]:
        return [Member(ch.name, self.ids[ch.name], self.caches[ch.name], self.restored[ch.name])
                for ch in self.children]

    def run(self, arm: str) -> dict[str, torch.Tensor]:
        setup, runner = self.setup, self.setup.runner
        if arm in ("serial", "layer_major"):
            for child in self.children:
                restore_child(self.caches[child.name], setup.export.catalog, self.private, child, runner,
                              setup.ctx.restore_backend)
        if arm == "serial":
            return {ch.name: blend(runner, self.ids[ch.name], self.caches[ch.name], self.restored[ch.name],
                                   setup.ctx.repair).logits for ch in self.children}
        if arm == "layer_major":
            out = blend_group(runner, self._members(), setup.ctx.repair)
        elif arm == "batched":
            restore = LayerwiseRestore(runner, restore_parts(setup, self.children, self.caches, self.private))
            out = blend_group(runner, self._members(), setup.ctx.repair, batched=True, restore=restore,
                              attention=self.attention)
        else:
            raise ValueError(f"unknown arm {arm!r}")
        return {n: x.logits for n, x in out.results.items()}

    def graphed(self, arm: str, warmup: int = 2) -> GraphedRun:
        """The arm as one CUDA graph (group.scaling.graphs): every arm restores with the same math —
        LayerwiseRestore, kmesh.kv.restore's torch rotation (the batched-agreement case checks it writes restore()'s
        bytes) — serial and layer-major for all layers before the prefill, batched layer by layer inside it; plans
        are made before the capture. The caches are the eager arms' (one memory state for every arm)."""
        setup, runner, repair = self.setup, self.setup.runner, self.setup.ctx.repair
        plans = {ch.name: plan("repair", self.restored[ch.name], repair, runner.num_layers, setup.device)
                 for ch in self.children}
        if arm == "serial":
            own = {ch.name: LayerwiseRestore(runner, restore_parts(setup, (ch,), self.caches, self.private))
                   for ch in self.children}

            def fn() -> dict[str, torch.Tensor]:
                out = {}
                for ch in self.children:
                    own[ch.name].all_layers()
                    out[ch.name] = blend(runner, self.ids[ch.name], self.caches[ch.name], self.restored[ch.name],
                                         repair, plan_=plans[ch.name]).logits
                return out
        elif arm in ("layer_major", "batched"):
            every = LayerwiseRestore(runner, restore_parts(setup, self.children, self.caches, self.private))
            batched = arm == "batched"

            def fn() -> dict[str, torch.Tensor]:
                if not batched:
                    every.all_layers()
                out = blend_group(runner, self._members(), repair, batched=batched, attention=self.attention,
                                  restore=every if batched else None, plans=plans)
                return {n: x.logits for n, x in out.results.items()}
        else:
            raise ValueError(f"unknown arm {arm!r}")
        return GraphedRun(fn, [c.raw for c in self.caches.values()], warmup)


# -- batched agreement -----------------------------------------------------------------------------------------

def batched_agreement(res: Result, setup: GroupSetup, serial: dict[str, ChildOutcome],
                      unbatched: dict[str, ChildOutcome]) -> tuple[dict[str, Any], dict[str, ChildOutcome]]:
    """`unbatched`: the group-layer-major case's outcomes (unbatched, bit-identical to `serial`, checked again).
    Returns the case's figures and the batched outcomes (empty if the case failed before them)."""
    children = setup.group
    catalog, runner, ctx = setup.export.catalog, setup.runner, setup.ctx
    out: dict[str, Any] = {}
    got: dict[str, ChildOutcome] = {}
    with res.case("batched-agreement", {"children": [ch.name for ch in children]}) as case:
        # rotation: the batched layer-wise restore writes exactly what per-member restore() writes
        per_member = {ch.name: new_cache(ctx, ch) for ch in children}
        layerwise = {ch.name: new_cache(ctx, ch) for ch in children}
        for child in children:
            restore_child(per_member[child.name], catalog, setup.export.raw, child, runner, ctx.restore_backend)
        LayerwiseRestore(runner, restore_parts(setup, children, layerwise, setup.export.raw)).all_layers()
        rot = {n: int((per_member[n].raw != layerwise[n].raw).sum()) for n in per_member}
        case.record("rotation_bytes_differing", rot)
        # Asserted on every backend: the layer-wise restore is kmesh.kv.restore's torch math, and the CUDA kernel
        # writes the torch path's bytes exactly (synthetic stage, check_kernel; 0 bytes differed on the H200)
        rot_equal = case.check("rotation_bit_identical", all(v == 0 for v in rot.values()), value=rot)
        del per_member, layerwise
        caches = {ch.name: new_cache(ctx, ch) for ch in children}
        members = [Member(ch.name, torch.tensor(ch.ids, device=setup.device), caches[ch.name], restored_mask(ch))
                   for ch in children]
        restore = LayerwiseRestore(runner, restore_parts(setup, children, caches, setup.export.raw))
        group_out = blend_group(runner, members, ctx.repair, batched=True, restore=restore,
                                attention=batched_attention(setup))
        for member, child in zip(members, children):
            result = group_out.results[member.name]
            tokens = runner.decode(member.cache, len(member.ids), result.logits, ctx.max_new_tokens)
            got[member.name] = outcome_of(ctx, child, "in-process", "repair", member.cache, member.restored, result,
                                          tokens, None, ["batched"])
        ref = unbatched
        cmps = {n: compare_states(ref[n], got[n]) for n in ref}
        serial_eq = {n: compare_states(serial[n], ref[n])["max_abs_diff"] == 0.0 for n in ref}
        case.record("comparison", cmps)
        bound = max(x["max_abs_diff"] for x in cmps.values())
        logits_bound = max(float((ref[n].logits.double() - got[n].logits.double()).abs().max()) for n in ref)
        case.check("unbatched_reference_equals_serial", all(serial_eq.values()), value=serial_eq)
        case.check("masks_equal_every_layer", all(x["mask_equal_layers"] == x["layers"] for x in cmps.values()),
                   value={n: x["mask_equal_layers"] for n, x in cmps.items()})
        case.check("tokens_equal", all(x["tokens_equal"] for x in cmps.values()))
        tol = float(setup.sec["batched_tolerance"])
        scale = max(float(ref[n].logits.double().abs().max()) for n in ref)
        case.check("within_stated_tolerance", bound <= tol * max(scale, 1.0),
                   value={"max_abs_diff": bound, "tolerance_rel": tol, "logits_max_abs": scale})
        out = {"max_abs_diff": bound, "logits_max_abs_diff": logits_bound,
               "bit_identical": all(x["max_abs_diff"] == 0.0 for x in cmps.values()),
               "rotation_bit_identical": all(v == 0 for v in rot.values()), "rotation_checked": rot_equal,
               "tolerance_rel": tol, "mask_comparisons": sum(x["layers"] for x in cmps.values()),
               "masks_equal": sum(x["mask_equal_layers"] for x in cmps.values()),
               "tokens_equal": all(x["tokens_equal"] for x in cmps.values())}
    return out, got


# -- peak memory --------------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _pin_mmap_threshold(nbytes: int = 1 << 16) -> bool:
    """glibc: serve allocations >= nbytes by mmap (and return them at free), not from a growing heap."""
    libc = _libc()
    return bool(libc and libc.mallopt(-3, nbytes))   # M_MMAP_THRESHOLD


def _trim() -> None:
    """Give freed heap pages back (so a run that reuses them shows in its RSS peak)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_memory(device: torch.device, fn: Callable[[], Any]) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return {"bytes": torch.cuda.max_memory_allocated() - base,
                "what": "torch.cuda.max_memory_allocated above the run's baseline (device memory)"}
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")    # resets VmHWM to the current RSS
    base = _status_kib("VmRSS")
    fn()
    return {"bytes": (_status_kib("VmHWM") - base) * 1024,
            "what": "host process peak RSS above baseline (VmHWM after clear_refs); not device memory"}


# -- scaling --------------------------------------------------------------------------------------------------------

def spread(values: list[float]) -> dict[str, float]:
    """The spread of an arm's kept per-round times: quartiles, extremes, and the interquartile range over the
    median (a ratio is quoted only beside its baseline's spread)."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median_ms": median * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3, "min_ms": min(values) * 1e3,
            "max_ms": max(values) * 1e3, "iqr_over_median": (q3 - q1) / median if median > 0 else float("inf")}


def scaling(res: Result, setup: GroupSetup, sizes: list[int] | None = None, case_prefix: str = "scaling",
            timing_prefix: str = "group", goal_at: int = 4) -> dict[str, Any]:
    """Per group size N: the three arms (serial, layer-major, batched) over the first N children of
    `setup.workload`, in the same rounds (kmesh.bench.rotate: every round runs all three, the order reversed from
    round to round, warm-up rounds discarded), so the two paired comparisons share one serial baseline, run
    beside both arms; every arm's spread over the kept rounds is recorded with it."""
    sec, timing_cfg = setup.sec["scaling"], setup.cfg.section("timing")
    pairs, warmup = int(sec.get("pairs", timing_cfg["pairs"])), int(sec.get("warmup", timing_cfg["warmup"]))
    dev = "cuda" if setup.device.type == "cuda" else "cpu"
    graphs = bool(sec.get("graphs", False))
    if graphs and dev != "cuda":
        raise GroupBenchError("group.scaling.graphs needs the group on a CUDA device")
    out: dict[str, Any] = {}
    for size in [int(n) for n in (sizes if sizes is not None else sec["sizes"])]:
        children = setup.workload.children[:size]
        with res.case(f"{case_prefix}-{size}", {"children": size, "pairs": pairs, "warmup": warmup, "graphs": graphs,
                                                "batched_attention": batched_attention(setup),
                                                "prompt_tokens": setup.workload.spec.prompt_tokens,
                                                "segments": len(setup.export.catalog.entries),
                                                "design": "the three arms in every round, order reversed each round"}
                      ) as case:
            if len(children) < size:
                raise GroupBenchError(f"{case_prefix}-{size}: the workload has only {len(children)} children")
            arms = Arms(setup, children)
            if setup.device.type != "cuda":
                _pin_mmap_threshold()
            # one untimed run per arm first: its logits are checked, its peak memory recorded, and it warms
            # the arm up (the rounds may add warm-up rounds of their own: `warmup`)
            logits: dict[str, dict[str, torch.Tensor]] = {}
            peaks: dict[str, Any] = {}
            for arm in ARMS:
                peaks[arm] = peak_memory(setup.device, lambda arm=arm: logits.__setitem__(
                    arm, {n: x.clone() for n, x in arms.run(arm).items()}))  # noqa: F821 - runs before `del arms`
            exact = all(torch.equal(logits["serial"][n], logits["layer_major"][n]) for n in logits["serial"])
            bdiff = max(float((logits["serial"][n].double() - logits["batched"][n].double()).abs().max())
                        for n in logits["serial"])
            case.check("layer_major_logits_equal_serial", exact)
            case.record("batched_logits_max_abs_diff", bdiff)
            tokens_equal = {n: int(logits["serial"][n].argmax()) == int(logits["batched"][n].argmax())
                            for n in logits["serial"]}
            case.record("batched_first_token_equal_serial", tokens_equal)
            # noqa below: these closures live in `runs`, deleted together with `arms`; none is called after the `del`
            runs: dict[str, Callable[[], Any]] = {arm: (lambda arm=arm: arms.run(arm)) for arm in ARMS}  # noqa: F821
            if graphs:
                runs = _graph_arms(case, arms, logits)

            @torch.no_grad()
            def run_arm(arm: str, _group: Any, intervals: Intervals) -> None:
                with intervals.part("repair"):
                    for x in runs[arm]().values():  # noqa: F821 - run_arm is used by rotate() only, before `del runs`
                        int(x.argmax())       # every member's first token on the host ends the interval

            group = [tuple(ch.name for ch in children)]
            parents: dict[str, str | None] = {}
            rounds = rotate(ARMS, pairs, warmup, over_children(run_arm, group, dev, parents))
            layer_major_timing = rounds.paired("serial", "layer_major")
            batched_timing = rounds.paired("serial", "batched")
            for timing in (layer_major_timing, batched_timing):
                timing.parents.update(parents)
            res.timings[f"{timing_prefix}_{size}_serial_vs_layer_major"] = layer_major_timing.to_dict()
            res.timings[f"{timing_prefix}_{size}_serial_vs_batched"] = batched_timing.to_dict()
            layer_major = layer_major_timing.to_dict()["summary"]["repair"]
            batched = batched_timing.to_dict()["summary"]["repair"]
            spreads = {arm: spread([r[arm]["repair"][0] for r in rounds.records]) for arm in ARMS}
            row = {"children": size, "pairs": pairs, "prompt_tokens": setup.workload.spec.prompt_tokens,
                   "serial_ms": batched["median_a"] * 1e3,
                   "layer_major_ms": layer_major["median_b"] * 1e3, "batched_ms": batched["median_b"] * 1e3,
                   "ratio_layer_major_over_serial": layer_major["median_ratio"],
                   "ratio_batched_over_serial": batched["median_ratio"],
                   "speedup_batched": statistics.median(1 / x for x in batched["ratios"]),
                   "layer_major_faster_pairs": layer_major["b_faster"], "batched_faster_pairs": batched["b_faster"],
                   "spread": spreads}
            for arm in ARMS:
                row[f"{arm}_ms_per_child"] = row[f"{arm}_ms"] / size
            row["peak_memory"] = peaks      # of each arm's eager untimed run (a graph's pool is allocated at capture)
            row["graphs"] = graphs
            case.record("row", row)
            case.check("pairs_recorded", layer_major["pairs"] == pairs and batched["pairs"] == pairs
                       and len(rounds.records) == pairs)
            out[str(size)] = row
            del arms, runs
            if dev == "cuda":
                torch.cuda.empty_cache()    # the graphs' memory pools go before the next size's
    if str(goal_at) in out:
        out[f"goal_batched_2x_at_{goal_at}"] = {"goal": 2.0, "measured_speedup": out[str(goal_at)]["speedup_batched"],
                                                "met": out[str(goal_at)]["speedup_batched"] >= 2.0,
                                                "serial_iqr_over_median":
                                                    out[str(goal_at)]["spread"]["serial"]["iqr_over_median"]}
    return out


def _graph_arms(case: Any, arms: Arms, eager: dict[str, dict[str, torch.Tensor]]
                ) -> dict[str, Callable[[], Any]]:
    """Every arm captured as one CUDA graph, each verified equal to its own eager run (poisoned caches, outputs
    and cache bytes) and its logits compared with the eager arm's of the untimed run (the eager serial and
    layer-major arms restore with the CUDA kernel, the graphs with the torch rotation: the same bytes)."""
    graphed = {arm: arms.graphed(arm) for arm in ARMS}
    verified = {arm: g.verify_against_eager() for arm, g in graphed.items()}
    case.record("graphs_verified", verified)
    case.check("graphs_equal_eager", all(v["equal"] for v in verified.values()),
               value={arm: v["equal"] for arm, v in verified.items()})
    replay = {arm: {n: x.clone() for n, x in g.replay().items()} for arm, g in graphed.items()}
    same = {arm: all(torch.equal(replay[arm][n], eager[arm][n]) for n in eager[arm]) for arm in ARMS}
    case.check("graph_logits_equal_eager_arm", all(same.values()), value=same)
    return {arm: g.replay for arm, g in graphed.items()}


# -- bytes held -----------------------------------------------------------------------------------------------------

def bytes_held(res: Result, setup: GroupSetup, store_bytes: int) -> dict[str, Any]:
    sizes = sorted({int(n) for n in setup.sec["scaling"]["sizes"]} | {len(setup.group)})
    children = setup.workload.children[: max(sizes)]
    catalog, runner, ctx = setup.export.catalog, setup.runner, setup.ctx
    out: dict[str, Any] = {}
    with res.case("bytes-held", {"sizes": sizes}) as case:
        per_child = []
        for child in children:
            cache = new_cache(ctx, child)
            restored = restore_child(cache, catalog, setup.export.raw, child, runner, ctx.restore_backend)
            pos = restored.nonzero()[:, 0].to(setup.device)
            before_k = torch.stack([k[pos] for k in cache.k]).clone()
            before_v = torch.stack([v[pos] for v in cache.v]).clone()
            blend(runner, torch.tensor(child.ids, device=setup.device), cache, restored, ctx.repair)
            after_k = torch.stack([k[pos] for k in cache.k])
            after_v = torch.stack([v[pos] for v in cache.v])
            # a row = one (layer, position): its K and V bytes
            k_bytes_changed = (before_k.contiguous().view(torch.uint8) != after_k.contiguous().view(torch.uint8))
            v_bytes_changed = (before_v.contiguous().view(torch.uint8) != after_v.contiguous().view(torch.uint8))
            changed = (k_bytes_changed.flatten(2).any(-1) | v_bytes_changed.flatten(2).any(-1))   # [layers, positions]
            row_bytes = (after_k[0, 0].numel() + after_v[0, 0].numel()) * after_k.element_size()
            full = int(pos.numel()) * runner.num_layers * row_bytes
            n_changed = int(changed.sum())
            per_child.append({"child": child.name, "restored_tokens": int(pos.numel()), "repaired_copy_bytes": full,
                              "rows": int(changed.numel()), "rows_changed": n_changed,
                              "rows_changed_per_layer": [int(x) for x in changed.sum(1).tolist()],
                              "diff_bytes": n_changed * (row_bytes + 4)})
        by_size = {}
        for size in sizes:
            first = per_child[:size]
            full = statistics.fmean(x["repaired_copy_bytes"] for x in first)
            diff = statistics.fmean(x["diff_bytes"] for x in first)
            by_size[str(size)] = {"store_bytes_total": store_bytes, "store_bytes_per_child": store_bytes / size,
                                  "repaired_copy_bytes_per_child": full, "diff_bytes_per_child": diff,
                                  "held_per_child_full_copies": store_bytes / size + full,
                                  "held_per_child_with_diffs": store_bytes / size + diff,
                                  "diff_saving_fraction": 1 - diff / full if full else 0.0,
                                  "compression_full_over_diff": full / diff if diff else float("inf")}
        case.record("per_child", per_child)
        case.record("by_group_size", by_size)
        case.check("store_holds_each_original_once", store_bytes == sum(e.nbytes for e in catalog.entries),
                   value=store_bytes)
        case.check("diffs_counted", all(0 < x["rows_changed"] <= x["rows"] for x in per_child))
        out = {"per_child": per_child, "by_group_size": by_size,
               "transient_per_child_bytes": {"staging": catalog.nbytes, "private_copy": catalog.nbytes}}
    return out
