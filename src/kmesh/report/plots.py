"""Plots where a reader would rather look than read: stage outcomes, per-pair differences."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable

import matplotlib

matplotlib.use("Agg")  # headless: pipelines and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def _save(fig: Any, base: Path, formats: Iterable[str]) -> list[Path]:
    base.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        p = base.with_suffix(f".{fmt}")
        # Fixed metadata so reruns on identical inputs give identical SVG/PNG bytes.
        fig.savefig(p, dpi=120, bbox_inches="tight", metadata={"Date": None} if fmt == "svg" else {"Software": None})
        out.append(p)
    plt.close(fig)
    return out


def summary_plot(summary: pd.DataFrame, base: Path, formats: Iterable[str], title: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(summary) + 2), 3.2))
    if len(summary):
        x = range(len(summary))
        bottom = [0] * len(summary)
        for col, color in (("passed", "#3a7d44"), ("failed", "#c0392b"), ("skipped", "#b0b0b0")):
            vals = summary[col].tolist()
            ax.bar(x, vals, bottom=bottom, color=color, label=col)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(list(x), summary["stage"].tolist(), rotation=20)
        ax.legend(frameon=False, fontsize=8)
    else:
        ax.text(0.5, 0.5, "no stage results yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("cases")
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)


def paired_plot(timing: dict[str, Any], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """Per-pair differences (B − A) for every part, with the median marked."""
    a, b = timing["arms"]["A"], timing["arms"]["B"]
    parts = list(timing["summary"])
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(parts) + 1.5), 3.2))
    for i, part in enumerate(parts):
        diffs = [d * 1e3 for d in timing["summary"][part]["diffs"]]
        ax.scatter([i] * len(diffs), diffs, s=14, alpha=0.7, color="#34495e")
        med = timing["summary"][part]["median_diff"] * 1e3
        ax.hlines(med, i - 0.25, i + 0.25, color="#c0392b")
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xticks(range(len(parts)), parts)
    ax.set_ylabel(f"{b} − {a} per pair [ms]")
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)


def quality_plot(quality: dict[str, dict[str, Any]], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """Per arm: KL to full recompute, first token and teacher-forced (log scale), and what the arm recomputed
    (fraction of all positions, of restored positions) beside its teacher-forced top-1 agreement."""
    arms = list(quality)
    x = list(range(len(arms)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(7, 2.0 * len(arms) + 3), 3.4))
    for offset, key, label, color in ((-0.2, "kl_first_token_mean", "first token", "#34495e"),
                                      (0.2, "kl_teacher_forced_mean", "teacher-forced", "#c0392b")):
        # a zero KL (the full arm) has no place on a log axis: drawn at 1e-12
        # (a key missing from an older result file draws no bar)
        vals = [quality[a].get(key) for a in arms]
        ax1.bar([i + offset for i in x], [float("nan") if v is None else max(v, 1e-12) for v in vals], width=0.4,
                color=color, label=label)
    ax1.set_yscale("log")
    ax1.set_xticks(x, arms, rotation=20)
    ax1.set_ylabel("KL(full ‖ arm), mean over children [nats]")
    ax1.legend(frameon=False, fontsize=8)
    for offset, key, label, color in ((-0.27, "recomputed_fraction_of_positions_mean", "recomputed / all positions",
                                       "#b0b0b0"),
                                      (0.0, "recomputed_fraction_of_restored_mean", "recomputed / restored",
                                       "#7f8c8d"),
                                      (0.27, "top1_teacher_forced", "top-1 agreement (teacher-forced)", "#3a7d44")):
        ax2.bar([i + offset for i in x], [quality[a].get(key) or 0.0 for a in arms], width=0.27, color=color,
                label=label)
    ax2.set_xticks(x, arms, rotation=20)
    ax2.set_ylim(0, 1.05)
    ax2.legend(frameon=False, fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, base, formats)


def frontier_plot(rag: dict[str, Any], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """Teacher-forced KL (log) against TTFT ratio vs full, one labelled point per arm, the Pareto front joined;
    the first-token KL as open markers beside."""
    points = [p for p in rag.get("frontier") or [] if p["arm"] != "full"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {"repair": "#c0392b", "epic": "#2471a3", "stock": "#7f8c8d", "naive": "#34495e"}
    for p in points:
        family = p["arm"].split("-")[0]
        color = colors.get(family, "#3a7d44")
        ax.scatter(p["ttft_ratio_vs_full"], p["kl_teacher_forced_mean"], s=30, color=color, zorder=3)
        ax.scatter(p["ttft_ratio_vs_full"], max(p["kl_first_token_mean"], 1e-12), s=18, facecolors="none",
                   edgecolors=color, zorder=2)
        ax.annotate(p["arm"], (p["ttft_ratio_vs_full"], p["kl_teacher_forced_mean"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    front = sorted((p for p in points if p.get("on_front")), key=lambda p: p["ttft_ratio_vs_full"])
    if front:
        ax.plot([p["ttft_ratio_vs_full"] for p in front], [p["kl_teacher_forced_mean"] for p in front],
                color="#3a7d44", lw=1, ls="--", label="Pareto front (teacher-forced KL)", zorder=1)
    ax.set_yscale("log")
    ax.set_xlabel("TTFT / full recompute (repair-only, median of pair ratios)")
    ax.set_ylabel("KL(full ‖ arm) [nats], mean over children")
    ax.scatter([], [], s=30, color="grey", label="teacher-forced")
    ax.scatter([], [], s=18, facecolors="none", edgecolors="grey", label="first token")
    ax.legend(frameon=False, fontsize=7)
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)


def arms_plot(timing: dict[str, Any], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """GB/s per arm (log scale) with every trial's value as a dot and the median as a bar."""
    arms = list(timing["rows"])
    nbytes = timing["bytes"]
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(arms) + 2), 3.4))
    med = [timing["rows"][a]["gbps"] for a in arms]
    ax.bar(range(len(arms)), med, color="#b0c4de")
    for i, a in enumerate(arms):
        pts = [nbytes / t / 1e9 for t in timing["times_s"].get(a, []) if t > 0]
        ax.scatter([i] * len(pts), pts, s=10, color="#34495e", alpha=0.7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(arms)), arms, rotation=25, ha="right")
    ax.set_ylabel("GB/s (bar: median; dots: trials)")
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)


def sweep_plot(timing: dict[str, Any], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """GB/s against chunk size (log2 axis), best chunk marked."""
    xs = [r["chunk_bytes"] for r in timing["rows"]]
    ys = [r["gbps"] for r in timing["rows"]]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys, marker="o", color="#34495e")
    best = timing["best_chunk_bytes"]
    ax.axvline(best, color="#c0392b", lw=0.8, ls="--", label=f"best: {best} B")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size [bytes]")
    ax.set_ylabel("GB/s (median over trials)")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)


def scaling_plot(scaling: dict[str, Any], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """Time per child vs group size for each arm, and the paired ratios to serial (a stage summary's `scaling`)."""
    rows = sorted((r for r in scaling.values() if isinstance(r, dict) and "children" in r), key=lambda r: r["children"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.4))
    n = [r["children"] for r in rows]
    for arm, label in (("serial", "serial"), ("layer_major", "layer-major"), ("batched", "layer-major batched")):
        ax.plot(n, [r[f"{arm}_ms_per_child"] for r in rows], marker="o", label=label)
    ax.set_xlabel("children in the group")
    ax.set_ylabel("repair time per child [ms] (median)")
    for a in (ax, bx):
        a.set_xticks(n)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    bx.plot(n, [r["ratio_layer_major_over_serial"] for r in rows], marker="o", color="C1", label="layer-major / serial")
    bx.plot(n, [r["ratio_batched_over_serial"] for r in rows], marker="o", color="C2", label="batched / serial")
    bx.axhline(1.0, color="grey", lw=0.8, ls="--")
    bx.set_xlabel("children in the group")
    bx.set_ylabel("median of per-pair time ratios")
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return _save(fig, base, formats)


def bandwidth_plot(shapes: dict[str, dict[str, Any]], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """Bandwidth per arm (copy / kernel / torch path) for every shape of a restore_bench summary."""
    arms = [(k, lbl) for k, lbl in (("copy_GBps", "copy"), ("kernel_GBps", "kernel"), ("torch_GBps", "torch path"))
            if any(s.get(k) is not None for s in shapes.values())]
    names = list(shapes)
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(names) + 1.5), 3.2))
    width = 0.8 / max(1, len(arms))
    for i, (key, label) in enumerate(arms):
        vals = [shapes[n].get(key) or 0.0 for n in names]
        ax.bar([x + i * width for x in range(len(names))], vals, width, label=label)
    ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(names))], names)
    ax.set_ylabel("GB/s")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)


def peers_plot(timings: dict[str, Any], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """TTFT per arm and workload: every timed request (dots) and the median (bar), from the stage's paired rounds
    (timings ttft_<workload>_<A>_vs_<B>; each arm's values read from its pairing with another arm)."""
    colors = {"vllm": "#7f8c8d", "vllm-prefix": "#b7950b", "lmcache": "#2874a6", "kmesh": "#c0392b"}
    # the arms drawn: those a pairing with vllm names (results from before vllm-prefix have three)
    arms = ("vllm", *(a for a in colors if a != "vllm" and any(k.endswith(f"_vllm_vs_{a}") for k in timings)))
    workloads = [w for w in ("cross_engine", "exact", "interior") if f"ttft_{w}_vllm_vs_lmcache" in timings]
    fig, ax = plt.subplots(figsize=(max(4, 2.6 * len(workloads) + 1), 3.4))
    for wi, w in enumerate(workloads):
        for ai, arm in enumerate(arms):
            key = f"ttft_{w}_vllm_vs_{'lmcache' if arm == 'vllm' else arm}"
            values = [1e3 * statistics.median(p[arm]["ttft"]) for p in timings[key]["raw"]]
            x = wi * (len(arms) + 1) + ai
            ax.bar(x, statistics.median(values), color=colors[arm], alpha=0.6, label=arm if wi == 0 else None)
            ax.scatter([x] * len(values), values, s=12, color=colors[arm])
    names = {"cross_engine": "another engine's", "exact": "exact repeat", "interior": "interior"}
    ax.set_xticks([wi * (len(arms) + 1) + 1 for wi in range(len(workloads))], [names[w] for w in workloads])
    ax.set_ylabel("time to first token [ms]")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)


def remote_plot(timings: dict[str, Any], base: Path, formats: Iterable[str], title: str) -> list[Path]:
    """First-token time per arm of the remote stage: every round's median over children (dots) and the median of
    those (bar), read from the pairings remote_vs_<arm> (the remote arm's own values from the first)."""
    arms = ("remote", "disk", "ram", "full")
    colors = {"remote": "#c0392b", "disk": "#2874a6", "ram": "#27ae60", "full": "#7f8c8d"}
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    for x, arm in enumerate(arms):
        key = "remote_vs_disk" if arm == "remote" else f"remote_vs_{arm}"
        if key not in timings:
            continue
        values = [1e3 * statistics.median(p[arm]["first-token"]) for p in timings[key]["raw"]]
        ax.bar(x, statistics.median(values), color=colors[arm], alpha=0.6)
        ax.scatter([x] * len(values), values, s=12, color=colors[arm])
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("first token [ms]")
    ax.set_title(title, fontsize=10)
    return _save(fig, base, formats)
