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
            "note": (c.get("skipped") or (c.get("error") or "").splitlines()[0] if c.get("error") or c.get("skipped") else ""),
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


QUALITY_COLUMNS = {"top1_agreement": "top-1 agreement", "kl_mean": "KL(full ‖ arm) mean",
                   "first_divergence_median": "first divergence (median token)", "exact_match": "answer exact-match",
                   "recomputed_fraction_mean": "recomputed fraction"}


def quality_frame(quality: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per repair arm (a stage summary's `quality`): agreement with the full-recompute reference."""
    rows = [{"arm": arm, "children": q.get("children"), **{label: q.get(key) for key, label in QUALITY_COLUMNS.items()}}
            for arm, q in quality.items()]
    return pd.DataFrame(rows)


def quality_caption(stage: str) -> str:
    return (f"Stage {stage}: every arm against full-prompt recompute on the same prompts, same runner and ratio. "
            "KL in nats over the next-token distribution; first divergence = index of the first generated token "
            "that differs (= tokens generated when none does); exact-match = the answer appears in the generation.")


def vllm_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """The vllm stage's headline rows (summary keys of results/<profile>/vllm/result.json)."""
    t = summary.get("ttft") or {}
    inter = summary.get("interior_tokens_equal_full") or {}
    agree = summary.get("interior_vs_runner") or {}
    rows = [
        ("exact reuse: greedy tokens equal plain vLLM", summary.get("exact_reuse_tokens_equal")),
        ("exact reuse: tokens supplied by KMesh", summary.get("tokens_supplied")),
        ("interior: tokens equal the engine's full recompute", inter.get("equal")),
        ("interior: first divergence per child", inter.get("first_divergence")),
        ("interior: engine+KMesh vs KMesh runner, max first-token logprob gap (nats)",
         agree.get("kmesh_logprob_gap_max")),
        ("engine full vs KMesh runner full, max first-token logprob gap (nats)", agree.get("full_logprob_gap_max")),
        ("corrupt/missing object: tokens equal plain vLLM", summary.get("corrupt_fallback_tokens_equal")),
        ("service down: engine computes everything", summary.get("fallback_service_down")),
        ("service back: tokens supplied again", summary.get("service_back_supplied")),
        ("engine exit: registrations released", summary.get("engine_exit_released")),
        (f"TTFT vLLM, median ms ({t.get('prompt_tokens')} tokens)", t.get("median_vllm_ms")),
        (f"TTFT vLLM+KMesh, median ms ({t.get('tokens_supplied')} supplied)", t.get("median_kmesh_ms")),
        ("TTFT median paired ratio KMesh / vLLM", t.get("median_ratio_kmesh_over_vllm")),
        ("TTFT pairs KMesh faster", f"{t.get('kmesh_faster_pairs')} of {t.get('pairs')}" if t else None),
    ]
    return pd.DataFrame([{"measure": k, "value": v if isinstance(v, (bool, int, float, str, type(None))) else str(v)}
                         for k, v in rows])
