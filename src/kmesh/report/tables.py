"""Tables from result files: stage summary, per-case table, paired-timing tables (DESIGN §5).

Every paired table carries its design in a caption line: pairs, order, per-pair statistic, nesting.
Times are shown in milliseconds; differences are B − A, ratios B / A.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pandas as pd


def stage_status(s: dict[str, Any]) -> str:
    """A stage's verdict as its result file's summary gives it (kmesh.result): a stage whose cases did not fail
    but proved nothing, or skipped what its profile does not allow, has FAILED too."""
    if not s["cases"]:
        return "no cases"
    if s["failed"]:
        return "FAILED"
    if s.get("skips_unallowed"):
        return f"FAILED ({len(s['skips_unallowed'])} skip(s) not allowed)"
    if not s["passed"]:
        return "FAILED (no case passed)"
    return "passed" if not s["skipped"] else f"passed ({s['skipped']} allowed skip(s))"


def summary_frame(results: Iterable[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in results:
        s, prov = r["summary"], r["provenance"]
        status = stage_status(s)
        kmesh = prov.get("kmesh", {})
        rows.append({
            "stage": r["stage"], "status": status, "cases": s["cases"], "passed": s["passed"],
            "failed": s["failed"], "skipped": s["skipped"],
            "revision": (kmesh.get("rev") or "unknown")[:12] + ("+dirty" if kmesh.get("dirty") else ""),
            "hardware": prov.get("gpu") or prov.get("cpu"), "torch": prov.get("torch"),
            "finished": prov.get("end"),
        })
    return pd.DataFrame(rows)


def cases_frame(result: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for c in result["cases"]:
        failed_checks = [k for k, v in c["checks"].items() if v.get("ok") is False]
        rows.append({
            "case": c["id"],
            "result": {True: "pass", False: "FAIL", None: "skip"}[c["passed"]],
            "checks": sum(v.get("ok") is not None for v in c["checks"].values()),
            "failed checks": ", ".join(failed_checks),
            "note": (c.get("skipped") or (c.get("error") or "").splitlines()[0]
                     if c.get("error") or c.get("skipped") else ""),
            "seconds": round(c["seconds"], 3) if c.get("seconds") is not None else None,
        })
    return pd.DataFrame(rows)


def paired_frame(timing: dict[str, Any]) -> pd.DataFrame:
    """One row per timed part: medians of A and B, median paired difference and ratio, pairs B faster."""
    a, b = timing["arms"]["A"], timing["arms"]["B"]
    nesting = timing["design"].get("nesting", {})
    rows = []
    for part, s in timing["summary"].items():
        parent = nesting.get(part)
        rows.append({
            "part": part + (f" (⊂ {parent})" if parent else ""),
            f"{a} median [ms]": s["median_a"] * 1e3,
            f"{b} median [ms]": s["median_b"] * 1e3,
            f"median Δ ({b} − {a}) [ms]": s["median_diff"] * 1e3,
            f"median ratio {b}/{a}": s["median_ratio"],
            f"{b} faster": f"{s['b_faster']}/{s['pairs']}",
        })
    return pd.DataFrame(rows)


def paired_caption(timing: dict[str, Any]) -> str:
    d = timing["design"]
    return (f"{d['pairs']} matched pairs after {d['warmup']} warm-up pair(s), order {d['order']}; "
            f"per pair the {d['per_pair']}; Δ and ratio are medians over pairs; nested parts are never added.")


def write_table(df: pd.DataFrame, base: Path, formats: Iterable[str], caption: str = "") -> list[Path]:
    """Write df as base.md / base.csv / base.tex; returns the paths written."""
    base.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        p = base.with_suffix(f".{fmt}")
        if fmt == "md":
            text = df.to_markdown(index=False, floatfmt=".4g") if len(df) else "_(no rows)_"
            p.write_text((f"{caption}\n\n" if caption else "") + text + "\n")
        elif fmt == "csv":
            df.to_csv(p, index=False)
        elif fmt == "tex":
            p.write_text(df.to_latex(index=False, float_format="%.4g", caption=caption or None,
                                     escape=True) if len(df) else "% no rows\n")
        else:
            raise ValueError(f"unknown table format {fmt!r}")
        out.append(p)
    return out


QUALITY_COLUMNS = {
    "kl_first_token_mean": "KL(full ‖ arm) first token, mean",
    "kl_teacher_forced_mean": "KL(full ‖ arm) teacher-forced, mean",
    "top1_first_token": "top-1 agreement, first token",
    "top1_teacher_forced": "top-1 agreement, teacher-forced",
    "first_divergence_median": "first divergence (median token)",
    "exact_match": "answer exact-match",
    "recomputed_fraction_of_positions_mean": "recomputed / all positions",
    "recomputed_fraction_of_restored_mean": "recomputed / restored positions",
    "recomputed_fraction_of_layer_positions_mean": "recomputed / layer × positions",
}


def quality_frame(quality: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per arm (a stage summary's `quality`): agreement with the full-recompute reference, and how much
    each arm recomputed (recomputed positions per child listed, so equal budgets can be seen)."""
    rows = [{"arm": arm, "children": q.get("children"), **{label: q.get(key) for key, label in QUALITY_COLUMNS.items()},
             "recomputed positions per child": " ".join(str(n) for n in q.get("recomputed_positions") or [])}
            for arm, q in quality.items()]
    return pd.DataFrame(rows)


def quality_caption(stage: str) -> str:
    return (f"Stage {stage}: every arm against full-prompt recompute on the same prompts and runner. KL in nats: "
            "first token = the next-token distribution after the prompt; teacher-forced = mean over the steps of the "
            "full arm's own continuation fed to every arm's state (top-1 likewise). Generation stops at the model's "
            "end-of-turn token: first divergence = index of the first generated token that differs (= tokens "
            "generated when none does); exact-match = the answer appears in the generation. stock = CacheBlend as "
            "LMCache configures it (15 % of all positions); stock-matched = the same selection rule given exactly "
            "repair's recomputed count per child. Recomputed = positions recomputed after the check layer, over all "
            "positions and over the restored ones; layer × positions counts the layers before the check as well.")


FRONTIER_COLUMNS = {
    "ttft_ratio_vs_full": "TTFT / full (repair-only, median of pair ratios)",
    "kl_teacher_forced_mean": "KL teacher-forced, mean",
    "kl_first_token_mean": "KL first token, mean",
    "top1_teacher_forced": "top-1 teacher-forced",
    "exact_match": "answer exact-match",
    "recomputed_fraction_of_positions_mean": "recomputed / all positions",
    "recomputed_fraction_of_layer_positions_mean": "recomputed / layer × positions",
}


def frontier_frame(rag: dict[str, Any]) -> pd.DataFrame:
    """One row per arm of an equivalence summary's `rag`: its frontier point (TTFT ratio, teacher-forced KL), its
    other quality measures, whether it is on the Pareto front, and the arms that beat it (lower KL at no more TTFT)."""
    goals = rag.get("goals") or {}
    beaten = goals.get("arms_with_lower_kl_at_no_more_ttft") or {}
    dominates = goals.get("repair_dominates") or {}
    rows = []
    for point in rag.get("frontier") or []:
        arm = point["arm"]
        pairs = point.get("pairs_faster_than_full")
        rows.append({"arm": arm, **{label: point.get(key) for key, label in FRONTIER_COLUMNS.items()},
                     "faster than full (pairs)": "" if pairs is None else str(pairs),
                     "on the front": "yes" if point.get("on_front") else "",
                     "lower KL at no more TTFT": " ".join(beaten.get(arm, [])),
                     "dominates": " ".join(d["arm"] for d in dominates.get(arm, []))})
    return pd.DataFrame(rows)


def frontier_caption(rag: dict[str, Any]) -> str:
    w = rag.get("workload") or {}
    goals = rag.get("goals") or {}
    e2e, ideal = goals.get("goal_ttft_3x_end_to_end") or {}, goals.get("goal_within_ideal") or {}
    text = (f"Stage equivalence, RAG-shaped workload ({w.get('children')} children of {w.get('prompt_tokens')} "
            f"tokens, {w.get('chunks')} chunks each reused in an order of its own, at least "
            f"{(w.get('restorable_fraction') or 0):.0%} restorable): one point per repair strategy, quality against "
            "full recompute on every child, TTFT repair-only in matched rounds with full (the same restore for every "
            "reuse arm). stock = CacheBlend as LMCache configures it; stock-matched = its rule at repair-"
            f"{rag.get('matched_arm', '').removeprefix('repair-')}'s recomputed count; epic-k = EPIC's first k "
            "tokens of every chunk. On the front = no arm is both no slower and no worse.")
    if e2e:
        text += (f" Goal ≥ {e2e['goal']:g}× end to end for {e2e['arm']}: {e2e['measured_speedup']:.2f}× "
                 f"({'met' if e2e['met'] else 'missed'}; repair-only {e2e['repair_only_speedup']:.2f}×).")
    if ideal:
        text += (f" Within {ideal['goal']:g}× of the ideal ({ideal['ideal_ms']:.4g} ms): {ideal['ratio']:.2f}× "
                 f"({'met' if ideal['met'] else 'missed'}).")
    return text


TTFT_PARTS = ("stage", "load", "private-copy", "restore", "repair")


def _ttft_parts(parts: dict[str, float] | None, loading: float | None = None) -> str:
    """The end-to-end arm's parts, medians in ms (load ⊂ stage; the others directly inside ttft), and the median
    share of its ttft spent loading (stage + private-copy: what the repair-only arm does not do)."""
    if not parts:
        return ""
    text = ", ".join(f"{name}{' (⊂ stage)' if name == 'load' else ''} {parts[name]:.4g}"
                     for name in TTFT_PARTS if name in parts)
    return text + (f"; loading {loading:.1%} of ttft" if loading is not None else "")


def ttft_frame(ttft: dict[str, Any]) -> pd.DataFrame:
    """One row per prompt length and comparison of an equivalence summary's `ttft`: the repair-only and the
    end-to-end arm each against full recompute (and full against transformers where run): medians, median paired
    ratio and speedup, pairs won; the end-to-end arm's parts; the TTFT goal, read against the end-to-end arm."""
    rows = []
    for tokens, row in ttft.items():
        goal = row.get("goal_ttft_3x") or {}
        comparisons = [("repair only", row.get("repair_vs_full") or row.get("kmesh_vs_full"), None),
                       ("end to end", row.get("end_to_end_vs_full"), row.get("end_to_end_parts_ms_median")),
                       ("full vs transformers", row.get("full_vs_transformers"), None)]
        for label, pair, parts in comparisons:
            if not pair:
                continue
            rows.append({
                "prompt tokens": int(tokens), "arm B": label, "A": pair["arm_a"],
                "A median [ms]": pair["median_a_ms"], "B median [ms]": pair["median_b_ms"],
                "median ratio B/A": pair["median_ratio_b_over_a"],
                "median speedup A/B": pair["median_speedup_a_over_b"],
                "B faster": f"{pair['b_faster_pairs']}/{pair['pairs']}",
                "B parts, median [ms]": _ttft_parts(parts, row.get("end_to_end_loading_fraction_median")
                                                    if parts else None),
                "goal": (f"{goal['goal']:g}× {'met' if goal['met'] else 'missed'}"
                         if label == "end to end" and goal else ""),
            })
    return pd.DataFrame(rows)


def ttft_caption(stage: str) -> str:
    return (f"Stage {stage}: time to first token (until the first token id is on the host), matched pairs with "
            "the full-recompute arm, order alternating, per pair the median over the children; ratio and speedup "
            "are medians of per-pair values. repair only = restore from the leader's export in memory + repair "
            "(no segment loading); end to end = the child's request to its first token through a real cache "
            "service (load, digest check on arrival, private copy, restore, repair), its state equal to repair "
            "only's bit for bit. The two are paired with full separately (each its own full runs); loading = the "
            "median share of an end-to-end run's ttft spent on stage + private copy, measured in the same run. "
            "The goal (speedup over full) is read against end to end.")


def arms_frame(timing: dict[str, Any]) -> pd.DataFrame:
    """One row per arm of a rotating-order trial benchmark (kind "arms"): median, GB/s, paired ratio to the baseline."""
    base = timing["baseline"]
    rows = []
    for arm, r in timing["rows"].items():
        rows.append({"arm": arm, "median [ms]": r["median_ms"], "GB/s": r["gbps"],
                     f"median ratio arm/{base}": r.get("ratio_vs_baseline", 1.0 if arm == base else None),
                     f"speedup vs {base}": r.get("speedup_vs_baseline", 1.0 if arm == base else None),
                     f"faster than {base}": (f"{r['faster_than_baseline']}/{r['trials']}"
                                             if "faster_than_baseline" in r else ""),
                     "trials": r["trials"]})
    return pd.DataFrame(rows)


def arms_caption(timing: dict[str, Any]) -> str:
    mib = timing["bytes"] / 2**20
    return (f"{timing['objects']} object(s), {mib:.4g} MiB in all; {timing['trials']} trials after "
            f"{timing['warmup']} warm-up trial(s), every arm once per trial, order rotating by one arm per trial; "
            f"median over trials, GB/s = bytes / median; ratio = median over trials of arm / {timing['baseline']} "
            "in the same trial (the trials are the matched pairs).")


def sweep_frame(timing: dict[str, Any]) -> pd.DataFrame:
    rows = [{"chunk_bytes": r["chunk_bytes"], "median [ms]": r["median_ms"], "GB/s": r["gbps"],
             "best": "yes" if r["chunk_bytes"] == timing["best_chunk_bytes"] else ""} for r in timing["rows"]]
    return pd.DataFrame(rows)


def sweep_caption(timing: dict[str, Any]) -> str:
    return (f"sha256-tree ({timing['arm']} implementation) on {timing['bytes'] / 2**20:.4g} MiB per chunk size, "
            f"{len(timing['orders'])} trials rotating the order of the sizes; median per size; "
            f"best_chunk_bytes = {timing['best_chunk_bytes']} (highest GB/s).")


def scaling_frame(scaling: dict[str, Any]) -> pd.DataFrame:
    """One row per group size (a stage summary's `scaling`): medians of the arms, paired ratios, peak memory."""
    rows = []
    for _n, r in scaling.items():
        if not isinstance(r, dict) or "children" not in r:
            continue
        pm = r.get("peak_memory", {})
        rows.append({"children": r["children"], "pairs": r["pairs"],
                     "serial [ms]": r["serial_ms"], "layer-major [ms]": r["layer_major_ms"],
                     "batched [ms]": r["batched_ms"],
                     "serial / child [ms]": r["serial_ms_per_child"], "batched / child [ms]": r["batched_ms_per_child"],
                     "ratio layer-major/serial": r["ratio_layer_major_over_serial"],
                     "ratio batched/serial": r["ratio_batched_over_serial"],
                     "speedup batched": r["speedup_batched"],
                     "batched faster": f"{r['batched_faster_pairs']}/{r['pairs']}",
                     **({f"{arm} IQR/median": v["iqr_over_median"] for arm, v in r["spread"].items()}
                        if "spread" in r else {}),
                     **{f"peak {arm} [MiB]": v["bytes"] / 2**20 for arm, v in pm.items()}})
    return pd.DataFrame(rows)


def scaling_caption(stage: str, scaling: dict[str, Any]) -> str:
    first = next((r for r in scaling.values() if isinstance(r, dict) and "peak_memory" in r), {})
    what = next(iter(first.get("peak_memory", {}).values()), {}).get("what", "")
    return (f"Stage {stage}: repair of a group of N children (restore + prefill to every member's first token), "
            "matched rounds per size, the three arms in every round, order reversed each round; serial vs "
            "layer-major and serial vs batched are paired over the same serial runs; ms = median over rounds, ratios "
            "and speedup = medians of per-pair ratios; IQR/median = each arm's spread over the rounds. "
            f"Peak memory: one untimed run per arm, {what}.")


def bytes_held_frame(held: dict[str, Any]) -> pd.DataFrame:
    """Bytes a group holds per child vs group size: originals once in the store, repaired copies, diffs."""
    rows = [{"children": int(n), "store per child [MiB]": r["store_bytes_per_child"] / 2**20,
             "repaired copy per child [MiB]": r["repaired_copy_bytes_per_child"] / 2**20,
             "held per child, full copies [MiB]": r["held_per_child_full_copies"] / 2**20,
             "diff per child [MiB]": r["diff_bytes_per_child"] / 2**20,
             "held per child, diffs [MiB]": r["held_per_child_with_diffs"] / 2**20,
             "diff saving": r["diff_saving_fraction"], "full/diff": r["compression_full_over_diff"]}
            for n, r in held.get("by_group_size", {}).items()]
    return pd.DataFrame(rows)


def _io_engines(engines: dict[str, Any]) -> str:
    """`arm: engine` per arm; io_uring with its queue depth, chunk and whether fixed buffers ran (else why)."""
    out = []
    for arm, e in engines.items():
        if e.get("engine") == "io_uring":
            fixed = "fixed buffers" if e.get("fixed_buffers") else f"no fixed buffers ({e.get('fixed_reason')})"
            chunk = e.get("chunk_bytes")
            chunk = f"{chunk} B" if isinstance(chunk, int) else chunk
            out.append(f"{arm}: io_uring qd {e.get('queue_depth')}, chunk {chunk}, {fixed}")
        else:
            why = e.get("fallback_reason")
            out.append(f"{arm}: {e.get('engine')}" + (f" ({why})" if why else ""))
    return "; ".join(out)


def _io_pair(pair: dict[str, Any] | None) -> str | None:
    if not pair:
        return None
    if "unavailable" in pair:
        return f"not run: {pair['unavailable']}"
    return (f"{pair['median_ratio_uring_over_preadv']:.3g} ({pair['pairs']} pairs; "
            f"median {pair['median_uring_s']:.4g} s vs {pair['median_preadv_s']:.4g} s)")


def _floor_ratios(summary: dict[str, Any]) -> str:
    """Every floor variant's ratio, the best one (`floor_ratio`) marked."""
    best = summary.get("floor_ratio_variant")
    return ", ".join(f"{k} {v:.3g}" + (" (best)" if k == best else "")
                     for k, v in (summary.get("floor_ratios") or {}).items())


def _landing_kind(kind: dict[str, Any]) -> str:
    if kind.get("memory") == "device":
        return f"device ({kind.get('registered')}-registered)"
    return "pinned host" if kind.get("pinned") else "aligned host (not pinned)"


def _floor_landing(landings: dict[str, Any] | None) -> str | None:
    """Where the floor's reads and the arm's land, and whether the two are the same kind of memory."""
    if not landings:
        return None
    arm, floor = landings.get("arm") or {}, landings.get("floor") or {}
    return (f"floor: {_landing_kind(floor)}; arm: {_landing_kind(arm)} — "
            + ("same kind" if arm == floor else "DIFFERENT kinds"))


def storage_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """The storage stage's headline values (result keys of issue §24 storage routes), one row each."""
    dm = summary.get("direct_mode") or {}
    ob = summary.get("object_bytes") or {}
    rows = [
        ("arms (as run)", ", ".join(summary.get("arms", []))),
        ("direct route (cuFile mode)", f"{dm.get('arm')} — {dm.get('reason')}"),
        *([("arms run instead of the requested ones", f"{', '.join(summary['arms_fallback'].get('ran', []))} — "
                                                    f"{summary['arms_fallback'].get('comparison')}")]
          if summary.get("arms_fallback") else []),
        ("matched pairs", summary.get("pairs")),
        ("runs compared with the reference", summary.get("runs_compared")),
        ("outputs identical (every run)", summary.get("outputs_identical")),
        ("arrival checks passed", summary.get("arrival_checks_passed")),
        ("bad-file controls passed", summary.get("failure_controls_passed")),
        ("object payload bytes", ", ".join(str(x) for x in ob.get("payload", []))),
        ("padded bytes per child", ob.get("per_child_padded")),
        ("floor ratio, best variant (restore / raw O_DIRECT read; goal ≤ 1.25)", summary.get("floor_ratio")),
        ("floor ratio's variant", summary.get("floor_ratio_variant")),
        ("floor ratios by variant", _floor_ratios(summary)),
        ("floor landing vs the arm's", _floor_landing(summary.get("floor_landing"))),
        ("I/O engine per arm (as run)", _io_engines(summary.get("io_engine") or {})),
        ("floor read, io_uring / preadv (median paired ratio)", _io_pair(summary.get("io_pair"))),
        ("storage reads per object, read-once", summary.get("reads_per_object_read_once")),
        ("storage reads per object, forced eviction", summary.get("reads_per_object_forced")),
        ("storage reads per object, read-once through the service", summary.get("reads_per_object_read_once_service")),
        ("service loads that joined a read in flight, per pair", ", ".join(
            str(x) for x in summary.get("joins_read_once_service") or [])),
    ]
    return pd.DataFrame([{"quantity": k, "value": v} for k, v in rows])


def storage_checksums_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per checksum comparison of the storage stage: A vs B, algorithm of B, complete restoration (outer)
    and verify medians, median ratio and pairs B was faster."""
    cs = summary.get("checksums") or {}
    algos = cs.get("algorithms", {})
    rows = []
    comparisons = [(cs.get("baseline"), b, v) for b, v in (cs.get("paired") or {}).items()]
    if cs.get("overlap_paired") and len(cs.get("overlap", [])) == 2:
        comparisons.append((cs["overlap"][0], cs["overlap"][1], cs["overlap_paired"]))
    for a, b, parts in comparisons:
        o, v = parts.get("outer", {}), parts.get("verify", {})
        rows.append({"A": a, "B": b, "B algorithm": algos.get(b),
                     "outer A [ms]": o.get("median_a_s", float("nan")) * 1e3,
                     "outer B [ms]": o.get("median_b_s", float("nan")) * 1e3,
                     "outer ratio B/A": o.get("median_ratio"),
                     "B faster (outer)": f"{o.get('b_faster')}/{o.get('pairs')}",
                     "verify A [ms]": v.get("median_a_s", float("nan")) * 1e3,
                     "verify B [ms]": v.get("median_b_s", float("nan")) * 1e3})
    return pd.DataFrame(rows)


def storage_checksums_caption(summary: dict[str, Any]) -> str:
    cs = summary.get("checksums") or {}
    return (f"Stage storage, checksum arms: {cs.get('pairs')} matched pairs after {cs.get('warmup')} warm-up, "
            f"children {', '.join(cs.get('children', []))} of {cs.get('children_of_workload')}; outer = complete "
            "restoration (restore + repair + cleanup), verify = hashing not hidden by the reads (⊂ restore); "
            "medians of per-pair values, ratio = median of paired ratios. Every run's outputs equal the reference: "
            f"{cs.get('outputs_identical')}.")


BANDWIDTH_ARMS = (("copy_GBps", "copy"), ("kernel_GBps", "kernel"), ("torch_GBps", "torch path"))


def bandwidth_frame(shapes: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per shape of a restore_bench summary: bandwidth per arm, ratios, bytes that differ."""
    rows = []
    for name, s in shapes.items():
        row: dict[str, Any] = {"shape": name, "segment MiB": round(s["segment_bytes"] / 2**20, 1)}
        row.update({f"{label} GB/s": s.get(key) for key, label in BANDWIDTH_ARMS})
        row.update({"kernel/copy bandwidth": s.get("kernel_vs_copy"), "speedup vs torch": s.get("speedup_vs_torch"),
                    "torch/copy bandwidth": s.get("torch_vs_copy"), "bytes ≠": s.get("bytes_differ")})
        rows.append(row)
    return pd.DataFrame(rows).dropna(axis=1, how="all")


def bandwidth_caption(goals: dict[str, Any]) -> str:
    return ("Stage restore_bench: bandwidth = bytes counted / median time per execution (restore: segment read + "
            "cells written + shift tables + slots; copy: read + write of the segment's bytes); ratios are medians of "
            f"matched-pair ratios. Goals: kernel/copy ≥ {goals.get('kernel_vs_copy')}, speedup vs torch ≥ "
            f"{goals.get('speedup_vs_torch')}× (recorded, not asserted). bytes ≠: restored buffer vs reference.")


def vllm_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """The vllm stage's headline rows (summary keys of results/<profile>/vllm/result.json)."""
    t = summary.get("ttft") or {}
    inter = summary.get("interior_tokens_equal_full") or {}
    agree = summary.get("interior_vs_runner") or {}
    exact = summary.get("exact_vs_plain") or {}
    controls = summary.get("negative_controls") or {}

    def detected(kind: str) -> Any:
        c = controls.get(kind)
        if c is None:
            return None
        return f"{'detected' if c.get('detected') else 'NOT detected'} ({controls.get('fault')})"

    rows = [
        ("exact reuse: greedy tokens equal plain vLLM", summary.get("exact_reuse_tokens_equal")),
        ("exact reuse: tokens supplied by KMesh", summary.get("tokens_supplied")),
        (f"exact reuse vs plain vLLM, max logprob difference per token (nats, bound {exact.get('bound')})",
         exact.get("logprob_diff_max")),
        ("interior: greedy tokens equal KMesh's runner repair (children)",
         f"{agree.get('tokens_equal')} of {agree.get('children')}" if agree else None),
        (f"interior vs KMesh's runner repair, max logprob difference per token (nats, bound {agree.get('bound')})",
         agree.get("logprob_diff_max")),
        ("interior: tokens equal the engine's full recompute (recorded)", inter.get("equal")),
        ("interior: first divergence from the engine's full recompute per child", inter.get("first_divergence")),
        ("engine full vs KMesh runner full, max logprob difference per token (nats)",
         agree.get("full_logprob_diff_max")),
        ("negative control, exact reuse: wrong KV in the engine's blocks", detected("exact")),
        ("negative control, interior: wrong KV in the engine's blocks", detected("interior")),
        ("corrupt/missing object: tokens equal plain vLLM", summary.get("corrupt_fallback_tokens_equal")),
        ("service down: engine computes everything", summary.get("fallback_service_down")),
        ("service back: tokens supplied again", summary.get("service_back_supplied")),
        ("engine exit: registrations released", summary.get("engine_exit_released")),
        (f"TTFT vLLM, median ms ({t.get('prompt_tokens')} tokens)", t.get("median_vllm_ms")),
        (f"TTFT vLLM+KMesh, median ms ({t.get('tokens_supplied')} supplied)", t.get("median_kmesh_ms")),
        ("TTFT median paired ratio KMesh / vLLM", t.get("median_ratio_kmesh_over_vllm")),
        ("TTFT pairs KMesh faster", f"{t.get('kmesh_faster_pairs')} of {t.get('pairs')}" if t else None),
        ("TTFT vLLM with its own prefix cache (a same-engine repeat), median ms", t.get("median_vllm_prefix_ms")),
        ("TTFT median paired ratio KMesh / vLLM with its prefix cache", t.get("median_ratio_kmesh_over_vllm_prefix")),
        ("TTFT pairs KMesh faster than vLLM with its prefix cache",
         f"{t.get('kmesh_faster_pairs_vs_vllm_prefix')} of {t.get('pairs')}"
         if t and "kmesh_faster_pairs_vs_vllm_prefix" in t else None),
    ]
    return pd.DataFrame([{"measure": k, "value": v if isinstance(v, (bool, int, float, str, type(None))) else str(v)}
                         for k, v in rows])


RELIABILITY_TESTS = {"soak": "soak under memory pressure", "fuzz": "stateful protocol fuzz",
                     "crash": "service crash consistency", "churn": "engine churn"}


def reliability_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """The reliability stage's table: per test, the load held, faults injected, bad inputs tried, divergences from
    what must be true, the service's own internal-error count, whether it survived, data lost (summary keys soak /
    fuzz / crash / churn)."""
    rows = []
    for key, name in RELIABILITY_TESTS.items():
        t = summary.get(key)
        if not isinstance(t, dict):
            continue
        rows.append({"test": name, "load held": t.get("load"), "faults injected": t.get("faults"),
                     "bad inputs tried": t.get("bad_inputs"), "divergences": t.get("divergences"),
                     "internal errors": t.get("internal_errors"), "service survived": t.get("service_survived"),
                     "data lost": t.get("data_lost")})
    return pd.DataFrame(rows)


PEER_ARMS = ("vllm", "vllm-prefix", "lmcache", "kmesh")


def peers_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """The peers stage's table: per workload × arm, tokens equal to vllm's, tokens reused (each system's own count),
    TTFT median, its paired ratios vs vllm (a recompute) and vs vllm-prefix (plain vLLM with its prefix cache, as its
    users run it) and the pairs it won against vllm (summary keys exact, interior, ttft_cross_engine, ttft_exact,
    ttft_interior; a result from before vllm-prefix or the cross-engine case existed has no such rows). The
    cross-engine rows come first: a prompt stored by another engine process is the reuse only an external cache
    gives (vllm-prefix's own cache never saw it)."""
    rows = []
    exact = (summary.get("exact") or {}).get("arms", {})
    interior = summary.get("interior") or {}
    for workload, ttft_key in (("stored by another engine process", "ttft_cross_engine"),
                               ("exact prefix (repeat)", "ttft_exact"), ("interior segments", "ttft_interior")):
        ttft = summary.get(ttft_key) or {}
        if not ttft and ttft_key == "ttft_cross_engine":     # a result from before that case
            continue
        reused_timed = ttft.get("reused_per_request", {})
        for arm in PEER_ARMS:
            if arm not in ttft and arm not in exact:
                continue
            t = ttft.get(arm, {})
            if ttft_key == "ttft_cross_engine":
                equal = (f"first token {ttft.get('first_token_equal_vllm', {}).get(arm)}/{ttft.get('rounds')}"
                         if arm != "vllm" else "reference")
                timed = [v for v in reused_timed.get(arm, []) if v is not None]
                reused = (f"{min(timed)}–{max(timed)}" if timed and min(timed) != max(timed)
                          else (timed[0] if timed else 0)) if arm != "vllm" else 0
            elif workload.startswith("exact"):
                e = exact.get(arm, {})
                equal = ("yes" if all(e.get("tokens_equal", {}).values()) else "no") if arm != "vllm" else "reference"
                reused = e.get("reused", {}).get("repeat") if arm != "vllm" else 0
            else:
                q = interior.get(arm, {})
                equal = (f"{q.get('tokens_equal_vllm')}/{q.get('count')}" if arm != "vllm" else "reference")
                reused = (f"{q.get('reused_tokens')} ({100 * q.get('reused_fraction', 0):.0f} %)" if arm != "vllm"
                          else 0)
            rows.append({"workload": workload, "arm": arm, "tokens equal vllm": equal,
                         "tokens reused (own count)": reused,
                         "reused in timed requests": ", ".join(str(v) for v in reused_timed.get(arm, [])) or "—",
                         "TTFT median [ms]": _fmt(t.get("median_ms")),
                         "ratio vs vllm": _fmt(t.get("median_ratio_vs_vllm"), 3) if arm != "vllm" else "1",
                         "ratio vs vllm-prefix": (_fmt(t.get("median_ratio_vs_vllm_prefix"), 3)
                                                  if "median_ratio_vs_vllm_prefix" in t else "—"),
                         "pairs won vs vllm": (f"{t.get('pairs_faster_than_vllm')}/{t.get('pairs')}"
                                               if arm != "vllm" else "—")})
    return pd.DataFrame(rows)


def peers_markdown(result: dict[str, Any]) -> str:
    """README's peers table: peers_frame of a committed peers result (its TTFT, reuse and agreement columns)."""
    df = peers_frame(result["summary"])
    keep = {"workload": "workload", "arm": "arm", "tokens equal vllm": "tokens equal vLLM",
            "tokens reused (own count)": "reused", "TTFT median [ms]": "TTFT [ms]", "ratio vs vllm": "vs vllm",
            "ratio vs vllm-prefix": "vs vllm-prefix", "pairs won vs vllm": "pairs won vs vllm"}
    rows = ["| " + " | ".join(keep.values()) + " |", "|" + "---|" * len(keep)]
    last = None
    for r in df.to_dict("records"):
        cells = [("" if r["workload"] == last else r["workload"]), *(str(r[c]) for c in list(keep)[1:])]
        last = r["workload"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def peers_faults_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per fault scenario × system (summary key faults): kept serving, tokens right, what the kill
    interrupted (where the scenario records it), what the server holds afterwards (its own status), how it
    recovered."""
    rows = []
    for scenario, systems in (summary.get("faults") or {}).items():
        for system, r in systems.items():
            rows.append({"scenario": scenario, "system": system, "engine kept serving": r.get("kept_serving"),
                         "tokens right": r.get("tokens_right"), "at the kill": r.get("store_at_kill", ""),
                         "server holds afterwards": _holds(r.get("server_holds")), "recovery": r.get("recovery")})
    return pd.DataFrame(rows)


REMOTE_ARMS = {"remote": "remote tier (B fetches from the store)", "disk": "B's disk tier (page cache dropped)",
               "ram": "B's RAM", "full": "full recompute (no restore)"}


def remote_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """The remote stage's arms: first-token time per arm, paired ratio other/remote and the pairs the remote arm
    won (summary key remote_arms), and the fetches per object across the group (fetch-once)."""
    rows = []
    for arm, name in REMOTE_ARMS.items():
        a = (summary.get("remote_arms") or {}).get(arm)
        if not isinstance(a, dict):
            continue
        rows.append({"arm": name, "first token median [ms]": _fmt(a.get("median_ms")),
                     "ratio arm / remote (paired)": _fmt(a.get("ratio_vs_remote"), 3),
                     "pairs remote faster": "—" if a.get("remote_faster") is None
                     else f"{a['remote_faster']}/{a.get('pairs')}"})
    return pd.DataFrame(rows)


def remote_faults_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per store failure (summary key remote_faults): the error the child's load got, how long until it
    recomputed, host B's remote counters, whether both hosts hold what they held before, whether it recovered."""
    rows = []
    for scenario, f in (summary.get("remote_faults") or {}).items():
        rows.append({"failure": scenario, "load failed with": f.get("error"),
                     "child done after [s]": _fmt(f.get("fallback_s"), 2),
                     "recompute = full": f.get("recomputed_equal_full"),
                     "B's remote counters": ", ".join(f"{k} {v}" for k, v in (f.get("b_counters") or {}).items()),
                     "hosts hold as before": f.get("held_as_at_start"),
                     "next child restores": "—" if f.get("recovered") is None else f.get("recovered")})
    return pd.DataFrame(rows)


def _holds(h: Any) -> str:
    if not isinstance(h, dict):
        return str(h)
    if "instances" in h:      # LMCache's /status
        return (f"{len(h['instances'])} engine registration(s), {h.get('active_sessions')} session(s), "
                f"{h.get('l1_objects')} L1 chunk(s), {h.get('l1_locked')} locked")
    by_engine = h.get("clients_with_registrations_by_engine", {})
    return (f"{h.get('clients_live')} live client(s), {h.get('registrations')} registration(s) "
            f"({', '.join(f'{k}: {len(v)} client(s)' for k, v in by_engine.items())}), {h.get('objects')} object(s)")


def _fmt(v: Any, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"
