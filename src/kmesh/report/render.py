"""Render every stage result of a profile into results/<profile>/tables and results/<profile>/plots."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kmesh.config import Config
from kmesh.errors import ResultError
from kmesh.report import plots, tables
from kmesh.result import load_result
from kmesh.stages import STAGES

# A timing's `kind` → (table frame, caption, plot, plot title): one table and one plot per timing.
_TIMING_KINDS = {
    "paired": (tables.paired_frame, tables.paired_caption, plots.paired_plot, "per-pair differences"),
    "arms": (tables.arms_frame, tables.arms_caption, plots.arms_plot, "throughput per arm"),
    "sweep": (tables.sweep_frame, tables.sweep_caption, plots.sweep_plot, "GB/s vs chunk size"),
}

def _file_stem(name: str) -> str:
    """A timing's name as a portable file name (names like `qwen05b:copy_vs_kernel[cuda]` carry : and [])."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")

def collect_results(cfg: Config) -> tuple[list[dict[str, Any]], list[str]]:
    """Result files present for this profile, in pipeline order, plus problems with unreadable ones."""
    base = cfg.results_dir / cfg.profile
    found, problems = [], []
    for stage in STAGES:
        if stage == "report":
            continue
        p = base / stage / "result.json"
        if not p.exists():
            continue
        try:
            found.append(load_result(p))
        except ResultError as e:
            problems.append(str(e))
    return found, problems


def render_all(cfg: Config) -> list[Path]:
    rep = cfg.section("report")
    fmts, pfmts = rep.get("formats", ["md", "csv", "tex"]), rep.get("plots", ["png", "svg"])
    tdir = cfg.results_dir / cfg.profile / "tables"
    pdir = cfg.results_dir / cfg.profile / "plots"
    results, problems = collect_results(cfg)
    written: list[Path] = []

    summary = tables.summary_frame(results)
    caption = f"KMesh stage results, profile {cfg.profile}."
    if problems:
        caption += " Unreadable result files: " + "; ".join(problems)
    written += tables.write_table(summary, tdir / "summary", fmts, caption)
    written += plots.summary_plot(summary, pdir / "summary", pfmts, f"KMesh {cfg.profile}: cases per stage")

    for r in results:
        stage = r["stage"]
        written += tables.write_table(tables.cases_frame(r), tdir / f"{stage}_cases", fmts,
                                      f"Stage {stage}: every case and its outcome.")
        if stage == "storage":
            written += tables.write_table(tables.storage_frame(r["summary"]), tdir / "storage_summary", fmts,
                                          "Stage storage: routes as run, cuFile mode, bit-identity, floor ratio, "
                                          "reads per object (read-once vs forced eviction).")
            if r["summary"].get("checksums", {}).get("paired"):
                written += tables.write_table(tables.storage_checksums_frame(r["summary"]),
                                              tdir / "storage_checksums", fmts,
                                              tables.storage_checksums_caption(r["summary"]))
        if stage == "vllm" and "ttft" in r["summary"]:
            written += tables.write_table(tables.vllm_frame(r["summary"]), tdir / "vllm_summary", fmts,
                                          "Stage vllm: the pinned vLLM engine with KMeshConnector (TTFT: matched "
                                          "pairs, alternating order, medians of per-pair values).")
        if stage == "peers" and r["summary"].get("ttft_exact"):
            written += tables.write_table(tables.peers_frame(r["summary"]), tdir / "peers", fmts,
                                          "Stage peers: vLLM alone (a recompute; vllm-prefix: its own prefix cache "
                                          "on, as its users run it) vs vLLM + LMCache (its MP server) vs vLLM + "
                                          "KMesh, same engine and prompts; reuse as each system counts it; TTFT "
                                          "medians of balanced-order rounds, ratios = medians of per-pair ratios.")
            written += tables.write_table(tables.peers_faults_frame(r["summary"]), tdir / "peers_faults", fmts,
                                          "Stage peers: the same fault scenarios against LMCache's server and "
                                          "KMesh's service (what each server holds, by its own status API).")
            if "ttft_exact_vllm_vs_lmcache" in r.get("timings", {}):
                written += plots.peers_plot(r["timings"], pdir / "peers_ttft", pfmts,
                                            f"peers ({cfg.profile}): TTFT per arm and workload")
        if stage == "remote" and r["summary"].get("remote_arms"):
            written += tables.write_table(tables.remote_frame(r["summary"]), tdir / "remote", fmts,
                                          "Stage remote: a child's first token on host B with its segments from the "
                                          "store, B's disk, B's RAM, or none (full recompute); rotated rounds, "
                                          "ratios = medians of per-pair ratios.")
            written += tables.write_table(tables.remote_faults_frame(r["summary"]), tdir / "remote_faults", fmts,
                                          "Stage remote: the store's failures, each ending in a recompute.")
            if "remote_vs_full" in r.get("timings", {}):
                written += plots.remote_plot(r["timings"], pdir / "remote_first_token", pfmts,
                                             f"remote ({cfg.profile}): first token per arm on host B")
        if stage == "reliability":
            written += tables.write_table(tables.reliability_frame(r["summary"]), tdir / "reliability", fmts,
                                          "Stage reliability: real processes against the cache service (the "
                                          "short form of the cpu profile unless its config says otherwise).")
        quality = r["summary"].get("quality")
        if isinstance(quality, dict) and quality:
            written += tables.write_table(tables.quality_frame(quality), tdir / f"{stage}_quality", fmts,
                                          tables.quality_caption(stage))
            written += plots.quality_plot(quality, pdir / f"{stage}_quality", pfmts, f"{stage}: repair quality")
        rag = r["summary"].get("rag") if stage == "equivalence" else None
        if isinstance(rag, dict) and rag.get("quality"):
            written += tables.write_table(tables.quality_frame(rag["quality"]), tdir / f"{stage}_rag_quality", fmts,
                                          "RAG-shaped workload. " + tables.quality_caption(stage))
        if isinstance(rag, dict) and rag.get("frontier"):
            written += tables.write_table(tables.frontier_frame(rag), tdir / f"{stage}_rag_frontier", fmts,
                                          tables.frontier_caption(rag))
            written += plots.frontier_plot(rag, pdir / f"{stage}_rag_frontier", pfmts,
                                           f"{stage} ({cfg.profile}): RAG workload, quality vs TTFT per arm")
        ttft = r["summary"].get("ttft") if stage == "equivalence" else None
        if isinstance(ttft, dict) and ttft:
            written += tables.write_table(tables.ttft_frame(ttft), tdir / f"{stage}_ttft", fmts,
                                          tables.ttft_caption(stage))
        for key, what in (("scaling", ""), ("rag_scaling", " (RAG workload)")):
            scaling = r["summary"].get(key)
            if isinstance(scaling, dict) and any(isinstance(v, dict) and "children" in v for v in scaling.values()):
                written += tables.write_table(tables.scaling_frame(scaling), tdir / f"{stage}_{key}", fmts,
                                              tables.scaling_caption(stage, scaling)
                                              + (" Workload: RAG-shaped (group.rag)." if what else ""))
                written += plots.scaling_plot(scaling, pdir / f"{stage}_{key}", pfmts,
                                              f"{stage}{what}: time per child vs N")
        held = r["summary"].get("bytes_held")
        if isinstance(held, dict) and held.get("by_group_size"):
            written += tables.write_table(tables.bytes_held_frame(held), tdir / f"{stage}_bytes_held", fmts,
                                          f"Stage {stage}: bytes held per child vs group size (measured; diffs = "
                                          "rows the repair changed against the shifted shared original + 4-byte index)")
        bandwidth = r["summary"].get("shapes") if stage == "restore_bench" else None
        if isinstance(bandwidth, dict) and bandwidth:
            written += tables.write_table(tables.bandwidth_frame(bandwidth), tdir / f"{stage}_bandwidth", fmts,
                                          tables.bandwidth_caption(r["summary"].get("goals", {})))
            written += plots.bandwidth_plot(bandwidth, pdir / f"{stage}_bandwidth", pfmts,
                                            f"{stage} ({cfg.profile}): bandwidth per arm")
        for name, timing in r.get("timings", {}).items():
            kind = _TIMING_KINDS.get(timing.get("kind")) if isinstance(timing, dict) else None
            if kind is None:
                continue
            frame, caption, plot, what = kind
            base = _file_stem(f"{stage}_{name}")
            written += tables.write_table(frame(timing), tdir / base, fmts,
                                          f"Stage {stage}, {name}: " + caption(timing))
            written += plot(timing, pdir / base, pfmts, f"{stage} / {name}: {what}")
    return written
