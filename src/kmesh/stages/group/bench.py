"""The group stage's measurements: batched group math against the unbatched path, scaling pairs, bytes held.

batched-agreement  the batched path (kmesh.model.group: stacked projections / MLP, one deviation reduction,
                   one padded attention call, one rotation per layer for every member's placements) against
                   the unbatched layer-major path on the same inputs: restored bytes equal (rotation),
                   measured max |Δ| of K, V and logits, masks and generated tokens equal.
scaling-<N>        matched pairs (kmesh.bench.run_pairs; alternating order, warm-up excluded) for each group
                   size N, the group of N children as one "child" of the harness: serial vs layer-major and
                   serial vs batched. Timed = the repair of the whole group: each member's restore (RoPE shift
                   into its cache) + prefill, ending with every member's first token on the host; loading
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
from typing import Any, Callable

import torch

from kmesh.bench import Intervals, run_pairs
from kmesh.child import outcome_of, new_cache
from kmesh.model.blend import blend
from kmesh.model.group import LayerwiseRestore, Member, RestorePart, blend_group
from kmesh.model.quality import compare_states
from kmesh.restore import capture
from kmesh.result import Result
from kmesh.segments import restore_child
from kmesh.workload import Child

ARMS = ("serial", "layer_major", "batched")


def _restored_mask(child: Child) -> torch.Tensor:
    m = torch.zeros(len(child.ids), dtype=torch.bool)
    for _, a, b in child.segment_slices():
        m[a:b] = True
    return m


def restore_parts(s: Any, children: tuple[Child, ...], caches: dict[str, Any],
                  private: torch.Tensor) -> list[RestorePart]:
    """Each member's segments captured from its private copy (here: the export's bytes), with new positions."""
    cat, dev = s.export.catalog, s.device
    parts = []
    for ch in children:
        sl = ch.segment_slices()
        src = torch.cat([cat.entries[i].slots(dev) for i, _, _ in sl])
        old = torch.cat([cat.entries[i].leader_positions(dev) for i, _, _ in sl])
        new = torch.cat([torch.arange(a, b, device=dev) for _, a, b in sl])
        parts.append(RestorePart(caches[ch.name], capture(private, cat.layout, src, old), new))
    return parts


class Arms:
    """The three ways to repair one group, over caches allocated once (every run rewrites [0, T) of each)."""

    def __init__(self, s: Any, children: tuple[Child, ...]) -> None:
        self.s, self.children = s, children
        self.caches = {ch.name: new_cache(s.ctx, ch) for ch in children}
        self.ids = {ch.name: torch.tensor(ch.ids, device=s.device) for ch in children}
        self.restored = {ch.name: _restored_mask(ch) for ch in children}
        self.private = s.export.raw

    def _members(self) -> list[Member]:
        return [Member(ch.name, self.ids[ch.name], self.caches[ch.name], self.restored[ch.name])
                for ch in self.children]

    def run(self, arm: str) -> dict[str, torch.Tensor]:
        s, r = self.s, self.s.runner
        if arm in ("serial", "layer_major"):
            for ch in self.children:
                restore_child(self.caches[ch.name], s.export.catalog, self.private, ch, r, s.ctx.restore_backend)
        if arm == "serial":
            return {ch.name: blend(r, self.ids[ch.name], self.caches[ch.name], self.restored[ch.name],
                                   s.ctx.repair).logits for ch in self.children}
        if arm == "layer_major":
            out = blend_group(r, self._members(), s.ctx.repair)
        elif arm == "batched":
            lr = LayerwiseRestore(r, restore_parts(s, self.children, self.caches, self.private))
            out = blend_group(r, self._members(), s.ctx.repair, batched=True, restore=lr)
        else:
            raise ValueError(f"unknown arm {arm!r}")
        return {n: x.logits for n, x in out.results.items()}


# -- batched agreement -----------------------------------------------------------------------------------------

def batched_agreement(res: Result, s: Any, serial: dict[str, Any], unbatched: dict[str, Any]) -> dict[str, Any]:
    """`unbatched`: the group-layer-major case's outcomes (unbatched, bit-identical to `serial`, checked again)."""
    children = s.group
    out: dict[str, Any] = {}
    with res.case("batched-agreement", {"children": [c.name for c in children]}) as c:
        r = s.runner
        # rotation: the batched layer-wise restore writes exactly what per-member restore() writes
        a = {ch.name: new_cache(s.ctx, ch) for ch in children}
        b = {ch.name: new_cache(s.ctx, ch) for ch in children}
        for ch in children:
            restore_child(a[ch.name], s.export.catalog, s.export.raw, ch, r, s.ctx.restore_backend)
        LayerwiseRestore(r, restore_parts(s, children, b, s.export.raw)).all_layers()
        rot = {n: int((a[n].raw != b[n].raw).sum()) for n in a}
        c.record("rotation_bytes_differing", rot)
        rot_equal = c.check("rotation_bit_identical" if s.ctx.restore_backend == "torch" else "rotation_recorded",
                            all(v == 0 for v in rot.values()) or s.ctx.restore_backend != "torch", value=rot)
        del a, b
        caches = {ch.name: new_cache(s.ctx, ch) for ch in children}
        members = [Member(ch.name, torch.tensor(ch.ids, device=s.device), caches[ch.name], _restored_mask(ch))
                   for ch in children]
        lr = LayerwiseRestore(r, restore_parts(s, children, caches, s.export.raw))
        g = blend_group(r, members, s.ctx.repair, batched=True, restore=lr)
        got = {}
        for m, ch in zip(members, children):
            res_ = g.results[m.name]
            tokens = r.decode(m.cache, len(m.ids), res_.logits, s.ctx.max_new_tokens)
            got[m.name] = outcome_of(s.ctx, ch, "in-process", "kmesh", m.cache, m.restored, res_, tokens, None,
                                   ["batched"])
        ref = unbatched
        cmps = {n: compare_states(ref[n], got[n]) for n in ref}
        serial_eq = {n: compare_states(serial[n], ref[n])["max_abs_diff"] == 0.0 for n in ref}
        c.record("comparison", cmps)
        bound = max(x["max_abs_diff"] for x in cmps.values())
        logits_bound = max(float((ref[n].logits.double() - got[n].logits.double()).abs().max()) for n in ref)
        c.check("unbatched_reference_equals_serial", all(serial_eq.values()), value=serial_eq)
        c.check("masks_equal_every_layer", all(x["mask_equal_layers"] == x["layers"] for x in cmps.values()),
                value={n: x["mask_equal_layers"] for n, x in cmps.items()})
        c.check("tokens_equal", all(x["tokens_equal"] for x in cmps.values()))
        tol = float(s.sec["batched_tolerance"])
        scale = max(float(ref[n].logits.double().abs().max()) for n in ref)
        c.check("within_stated_tolerance", bound <= tol * max(scale, 1.0),
                value={"max_abs_diff": bound, "tolerance_rel": tol, "logits_max_abs": scale})
        out = {"max_abs_diff": bound, "logits_max_abs_diff": logits_bound,
               "bit_identical": all(x["max_abs_diff"] == 0.0 for x in cmps.values()),
               "rotation_bit_identical": all(v == 0 for v in rot.values()), "rotation_checked": rot_equal,
               "tolerance_rel": tol, "masks_equal": all(x["mask_equal_layers"] == x["layers"] for x in cmps.values()),
               "tokens_equal": all(x["tokens_equal"] for x in cmps.values())}
    return out


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

def scaling(res: Result, s: Any) -> dict[str, Any]:
    sec, tcfg = s.sec["scaling"], s.cfg.section("timing")
    pairs, warmup = int(sec.get("pairs", tcfg["pairs"])), int(sec.get("warmup", tcfg["warmup"]))
    dev = "cuda" if s.device.type == "cuda" else "cpu"
    out: dict[str, Any] = {}
    for N in [int(n) for n in sec["sizes"]]:
        children = s.workload.children[:N]
        with res.case(f"scaling-{N}", {"children": N, "pairs": pairs, "warmup": warmup,
                                       "prompt_tokens": s.workload.spec.prompt_tokens}) as c:
            arms = Arms(s, children)
            if s.device.type != "cuda":
                _pin_mmap_threshold()
            # one untimed run per arm first: its logits are checked, its peak memory recorded, and it warms
            # the arm up (the pairs may add warm-up pairs of their own: `warmup`)
            logits: dict[str, dict[str, torch.Tensor]] = {}
            peaks: dict[str, Any] = {}
            for arm in ARMS:
                peaks[arm] = peak_memory(s.device, lambda arm=arm: logits.__setitem__(
                    arm, {n: x.clone() for n, x in arms.run(arm).items()}))
            exact = all(torch.equal(logits["serial"][n], logits["layer_major"][n]) for n in logits["serial"])
            bdiff = max(float((logits["serial"][n].double() - logits["batched"][n].double()).abs().max())
                        for n in logits["serial"])
            c.check("layer_major_logits_equal_serial", exact)
            c.record("batched_logits_max_abs_diff", bdiff)

            @torch.no_grad()
            def fn(arm: str, _group: Any, iv: Intervals) -> None:
                with iv.part("repair"):
                    for x in arms.run(arm).values():
                        int(x.argmax())       # every member's first token on the host ends the interval

            group = [tuple(ch.name for ch in children)]
            t_lm = run_pairs(fn, ("serial", "layer_major"), group, pairs=pairs, warmup=warmup, device=dev,
                             progress=False)
            t_b = run_pairs(fn, ("serial", "batched"), group, pairs=pairs, warmup=warmup, device=dev, progress=False)
            res.timings[f"group_{N}_serial_vs_layer_major"] = t_lm.to_dict()
            res.timings[f"group_{N}_serial_vs_batched"] = t_b.to_dict()
            lm, b = t_lm.to_dict()["summary"]["repair"], t_b.to_dict()["summary"]["repair"]
            row = {"children": N, "pairs": pairs,
                   "serial_ms": b["median_a"] * 1e3, "serial_ms_in_layer_major_pairs": lm["median_a"] * 1e3,
                   "layer_major_ms": lm["median_b"] * 1e3, "batched_ms": b["median_b"] * 1e3,
                   "ratio_layer_major_over_serial": lm["median_ratio"], "ratio_batched_over_serial": b["median_ratio"],
                   "speedup_batched": statistics.median(1 / x for x in b["ratios"]),
                   "layer_major_faster_pairs": lm["b_faster"], "batched_faster_pairs": b["b_faster"]}
            for k in ("serial", "layer_major", "batched"):
                row[f"{k}_ms_per_child"] = row[f"{k}_ms"] / N
            row["peak_memory"] = peaks
            c.record("row", row)
            c.check("pairs_recorded", lm["pairs"] == pairs and b["pairs"] == pairs)
            out[str(N)] = row
            del arms
    if "4" in out:
        out["goal_batched_2x_at_4"] = {"goal": 2.0, "measured_speedup": out["4"]["speedup_batched"],
                                       "met": out["4"]["speedup_batched"] >= 2.0}
    return out


# -- bytes held -----------------------------------------------------------------------------------------------------

def bytes_held(res: Result, s: Any, store_bytes: int) -> dict[str, Any]:
    sizes = sorted({int(n) for n in s.sec["scaling"]["sizes"]} | {len(s.group)})
    children = s.workload.children[: max(sizes)]
    out: dict[str, Any] = {}
    with res.case("bytes-held", {"sizes": sizes}) as c:
        r = s.runner
        per_child = []
        for ch in children:
            cache = new_cache(s.ctx, ch)
            restored = restore_child(cache, s.export.catalog, s.export.raw, ch, r, s.ctx.restore_backend)
            pos = restored.nonzero()[:, 0].to(s.device)
            before_k = torch.stack([k[pos] for k in cache.k]).clone()
            before_v = torch.stack([v[pos] for v in cache.v]).clone()
            blend(r, torch.tensor(ch.ids, device=s.device), cache, restored, s.ctx.repair)
            after_k = torch.stack([k[pos] for k in cache.k])
            after_v = torch.stack([v[pos] for v in cache.v])
            # a row = one (layer, position): its K and V bytes
            bk = (before_k.contiguous().view(torch.uint8) != after_k.contiguous().view(torch.uint8))
            bv = (before_v.contiguous().view(torch.uint8) != after_v.contiguous().view(torch.uint8))
            changed = (bk.flatten(2).any(-1) | bv.flatten(2).any(-1))              # [layers, positions]
            row_bytes = (after_k[0, 0].numel() + after_v[0, 0].numel()) * after_k.element_size()
            full = int(pos.numel()) * r.num_layers * row_bytes
            n_changed = int(changed.sum())
            per_child.append({"child": ch.name, "restored_tokens": int(pos.numel()), "repaired_copy_bytes": full,
                              "rows": int(changed.numel()), "rows_changed": n_changed,
                              "rows_changed_per_layer": [int(x) for x in changed.sum(1).tolist()],
                              "diff_bytes": n_changed * (row_bytes + 4)})
        by_n = {}
        for N in sizes:
            pc = per_child[:N]
            full = statistics.fmean(x["repaired_copy_bytes"] for x in pc)
            diff = statistics.fmean(x["diff_bytes"] for x in pc)
            by_n[str(N)] = {"store_bytes_total": store_bytes, "store_bytes_per_child": store_bytes / N,
                            "repaired_copy_bytes_per_child": full, "diff_bytes_per_child": diff,
                            "held_per_child_full_copies": store_bytes / N + full,
                            "held_per_child_with_diffs": store_bytes / N + diff,
                            "diff_saving_fraction": 1 - diff / full if full else 0.0,
                            "compression_full_over_diff": full / diff if diff else float("inf")}
        c.record("per_child", per_child)
        c.record("by_group_size", by_n)
        c.check("store_holds_each_original_once", store_bytes == sum(e.nbytes for e in s.export.catalog.entries),
                value=store_bytes)
        c.check("diffs_counted", all(0 < x["rows_changed"] <= x["rows"] for x in per_child))
        out = {"per_child": per_child, "by_group_size": by_n,
               "transient_per_child_bytes": {"staging": s.export.catalog.nbytes, "private_copy": s.export.catalog.nbytes}}
    return out
