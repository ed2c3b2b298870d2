"""The diagrams under docs/: the stage DAG (drawn from the rule files' real inputs), the data path, and the
packages (drawn from the package's own imports).

    python -m kmesh.report.diagrams            # rewrites docs/dag.svg, docs/data-path.svg and docs/packages.svg

There is no graphviz on the build machines, so both are laid out here and drawn with matplotlib. The DAG is read
from workflow/rules/*.smk, never typed in: a rule's `input:` entries `result("X")` are its edges (an entry whose
line says "order only" only orders the jobs, the stage does not read that result), and `result(s) for s in
STAGES` means every stage of common.smk's STAGES (kmesh.stages.STAGES but the report). Each stage box and each edge
carries an SVG id (`stage__<name>`, `edge__<from>__<to>`), so a test can compare the committed SVG with the rule files.
"""
from __future__ import annotations

import argparse
import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.path import Path as MplPath

from kmesh.stages import STAGES

RULES_DIR = Path("workflow/rules")
SHARED_RULES = "common"   # definitions only: no rule of its own

# Text stays text in the SVG (searchable, and the test reads the stage names back); the hash salt and the empty
# date make a redraw from unchanged rules byte-identical.
_SVG_STYLE = {"svg.fonttype": "none", "svg.hashsalt": "kmesh-diagrams", "font.family": "DejaVu Sans",
              "font.size": 9}
_RULE = re.compile(r"^rule (\w+):", re.MULTILINE)
_RESULT_INPUT = re.compile(r'result\("(\w+)"\)')


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    order_only: bool   # the rule lists the result for pipeline order; its stage does not read it


def rule_stages(rules_dir: Path = RULES_DIR) -> list[str]:
    """The stage of every rule file (its rule's name), in pipeline order (pipeline_stages) first, then by name."""
    names = []
    for path in sorted(rules_dir.glob("*.smk")):
        if path.stem == SHARED_RULES:
            continue
        found = _RULE.findall(path.read_text())
        if found != [path.stem]:
            raise ValueError(f"{path}: expected exactly one rule named {path.stem!r}, found {found}")
        names.append(path.stem)
    order = pipeline_stages(rules_dir)
    return [s for s in order if s in names] + sorted(s for s in names if s not in order)


def pipeline_stages(rules_dir: Path = RULES_DIR) -> list[str]:
    """common.smk's STAGES: the stages `rule all` and the report ask for, in pipeline order.

    common.smk derives them from kmesh.stages.STAGES (every stage but the report), so they are derived here the same
    way rather than read from its text; `rules_dir` is kept for the callers that pass it.
    """
    return [s for s in STAGES if s != "report"]


def _input_lines(rule_text: str) -> Iterator[str]:
    """The lines of a rule's `input:` block (more indented than the `input:` keyword itself)."""
    lines = rule_text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "input:":
            indent = len(line) - len(line.lstrip())
            for entry in lines[i + 1:]:
                if entry.strip() and len(entry) - len(entry.lstrip()) <= indent:
                    return
                yield entry
            return


def rule_edges(rules_dir: Path = RULES_DIR) -> list[Edge]:
    """Every dependency between stages as the rule files declare it (see the module docstring)."""
    stages = pipeline_stages(rules_dir)
    edges: list[Edge] = []
    for target in rule_stages(rules_dir):
        for line in _input_lines((rules_dir / f"{target}.smk").read_text()):
            order_only = "order only" in line
            sources = _RESULT_INPUT.findall(line)
            if re.search(r"result\(\w+\) for \w+ in STAGES", line):
                sources += stages
            edges += [Edge(src, target, order_only) for src in sources]
    return edges


def layers(stages: list[str], edges: list[Edge]) -> dict[str, int]:
    """Depth of each stage = the longest chain of inputs above it (0 for a stage with no stage input)."""
    inputs = {s: [e.source for e in edges if e.target == s] for s in stages}
    depth: dict[str, int] = {}

    def visit(stage: str, path: tuple[str, ...]) -> int:
        if stage in path:
            raise ValueError(f"dependency cycle: {' -> '.join((*path, stage))}")
        if stage not in depth:
            depth[stage] = 1 + max((visit(s, (*path, stage)) for s in inputs[stage]), default=-1)
        return depth[stage]

    for stage in stages:
        visit(stage, ())
    return depth


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    svg = path.suffix == ".svg"   # other suffixes (e.g. .png) only for looking at a draft
    fig.savefig(path, bbox_inches="tight", dpi=110, metadata={"Date": None} if svg else {"Software": None})
    return path


def _box(ax: Any, x: float, y: float, w: float, h: float, text: str, gid: str | None = None, *,
         face: str = "#eef3f8", edge: str = "#2c5d8a", size: float = 9, weight: str = "normal") -> None:
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                           facecolor=face, edgecolor=edge, linewidth=1.2)
    label = ax.text(x, y, text, ha="center", va="center", fontsize=size, fontweight=weight, linespacing=1.3)
    if gid:
        patch.set_gid(f"box__{gid.split('__', 1)[1]}")
        label.set_gid(gid)
    ax.add_patch(patch)


def _arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], gid: str | None = None, *,
           color: str = "#444444", style: str = "solid", width: float = 1.1,
           via: tuple[tuple[float, float], ...] = ()) -> None:
    """An arrow from start to end, straight or along the corner points `via` (right-angled lanes)."""
    common = dict(arrowstyle="-|>", mutation_scale=11, color=color, linewidth=width, linestyle=style,
                  shrinkA=0, shrinkB=0)
    if via:
        arrow = FancyArrowPatch(path=MplPath([start, *via, end]), **common)
    else:
        arrow = FancyArrowPatch(start, end, **common)
    if gid:
        arrow.set_gid(gid)
    ax.add_patch(arrow)


def draw_dag(path: Path, rules_dir: Path = RULES_DIR) -> Path:
    """docs/dag.svg: stages top to bottom by depth. Inputs from the row above are straight arrows, longer ones run
    in lanes on the left (dashed: order only); the report's inputs, every stage, share a lane on the right."""
    stages = rule_stages(rules_dir)
    edges = rule_edges(rules_dir)
    depth = layers(stages, edges)
    rows: dict[int, list[str]] = {}
    for stage in stages:
        rows.setdefault(depth[stage], []).append(stage)
    box_w, box_h, col_gap, row_gap = 2.1, 0.5, 2.8, 1.0
    where: dict[str, tuple[float, float]] = {}
    for d, names in rows.items():
        for i, name in enumerate(names):
            where[name] = ((i - (len(names) - 1) / 2) * col_gap, -d * row_gap)
    left = {d: min(where[n][0] for n in names) - box_w / 2 for d, names in rows.items()}
    right_lane = max(x for x, _ in where.values()) + box_w / 2 + 0.45
    long_edges = sorted((e for e in edges if e.target != "report" and depth[e.target] - depth[e.source] > 1),
                        key=lambda e: (depth[e.target] - depth[e.source], e.source))
    with matplotlib.rc_context(_SVG_STYLE):
        fig = Figure(figsize=(7.5, (max(rows) + 2) * 0.85))
        ax = fig.add_subplot()
        ax.set_axis_off()
        lanes_used = 0
        # each source of a lane edge leaves its row at its own height, so lines from neighbours stay apart
        leaving = [n for n in stages if any(e.source == n and (e in long_edges or e.target == "report")
                                            for e in edges)]
        drop = {n: 0.1 + 0.1 * [m for m in leaving if depth[m] == depth[n]].index(n) for n in leaving}
        for e in edges:
            (x0, y0), (x1, y1) = where[e.source], where[e.target]
            gid = f"edge__{e.source}__{e.target}"
            style = "--" if e.order_only else "solid"
            below = y0 - box_h / 2 - drop.get(e.source, 0.1)   # the gap under the source's row
            if e.target == "report":
                _arrow(ax, (x0, y0 - box_h / 2), (x1 + box_w / 2, y1), gid, color="#a0a0a0", width=0.8,
                       via=((x0, below), (right_lane, below), (right_lane, y1)))
            elif e in long_edges:
                lane = min(left.values()) - 0.3 - 0.22 * lanes_used    # left of every box
                lanes_used += 1
                _arrow(ax, (x0, y0 - box_h / 2), (x1 - box_w / 2, y1), gid, color="#2c5d8a", style=style,
                       via=((x0, below), (lane, below), (lane, y1)))
            else:
                _arrow(ax, (x0, y0 - box_h / 2), (x1, y1 + box_h / 2), gid, color="#2c5d8a", style=style, width=1.2)
        for name, (x, y) in where.items():
            _box(ax, x, y, box_w, box_h, name, f"stage__{name}", weight="bold")
        bottom = -(max(rows) + 0.8) * row_gap
        ax.text(0, bottom, "solid: the stage reads that result    dashed: listed for order only\n"
                "grey (right): the report reads every stage's result\n"
                "drawn from workflow/rules/*.smk (input: result(\"…\")) by kmesh.report.diagrams",
                ha="center", va="center", fontsize=7.5, color="#555555")
        ax.set_xlim(min(left.values()) - 0.3 - 0.22 * lanes_used - 0.1, right_lane + 0.2)
        ax.set_ylim(bottom - 0.4, 0.5)
        return _save(fig, path)


# The data path of one shared segment, left to right (what docs/data-path.svg shows; README links it).
_PATH_BOXES = (
    ("leader", "leader (model process)\nprefill, then export:\none object per shared segment\nkmesh.harness.leader"),
    ("service", "cache service (own process)\nshared originals:\nRAM tier over disk tier\nkmesh.service"),
    ("child", "child request\nload into its staging memory,\nverify digest, private copy,\n"
              "restore + RoPE shift, repair\nkmesh.kv.load, kmesh.kv.restore"),
    ("engine", "engine: vLLM 0.32\nKMeshConnector writes\nthe K/V into vLLM's\npaged cache; vLLM decodes\n"
               "kmesh.vllm.connector"),
)
_PATH_ARROWS = (
    ("leader", "service", "save: registration\n(memfd / CUDA IPC),\ncopy, commit + digest"),
    ("service", "child", "load: copy engine,\nheld until drained\n(kmesh.transfer)"),
    ("child", "engine", "in vLLM the connector\ndoes the child's part\n(sha256 vs its record)"),
)


def draw_data_path(path: Path) -> Path:
    """docs/data-path.svg: leader → service → child → engine, with the object files and storage routes below."""
    box_w, box_h, gap = 2.75, 1.3, 3.6
    xs = {name: i * gap for i, (name, _) in enumerate(_PATH_BOXES)}
    disk_x, disk_y, disk_w, disk_h = (xs["service"] + xs["child"]) / 2, -1.8, 2.7, 0.85
    with matplotlib.rc_context(_SVG_STYLE):
        fig = Figure(figsize=(12, 4.3))
        ax = fig.add_subplot()
        ax.set_axis_off()
        for name, text in _PATH_BOXES:
            _box(ax, xs[name], 0.0, box_w, box_h, text, f"node__{name}", size=8)
        for a, b, label in _PATH_ARROWS:
            _arrow(ax, (xs[a] + box_w / 2, 0.0), (xs[b] - box_w / 2, 0.0), f"flow__{a}__{b}", width=1.6)
            ax.text((xs[a] + xs[b]) / 2, 0.75, label, ha="center", va="bottom", fontsize=7, color="#333333")
        _box(ax, disk_x, disk_y, disk_w, disk_h,
             "object files on disk\nheader + digest, 4 KiB padding\nkmesh.storage.objfile", "node__disk",
             face="#f6f1e7", edge="#8a6d2c", size=7.5)
        top = disk_y + disk_h / 2
        _arrow(ax, (xs["service"], -box_h / 2), (disk_x - 0.7, top), "flow__service__disk", color="#8a6d2c",
               style="--")
        _arrow(ax, (disk_x + 0.7, top), (xs["child"], -box_h / 2), "flow__disk__child", color="#8a6d2c")
        ax.text(xs["service"] - 0.2, -1.15, "each commit also\nwrites a file (--disk-dir)", ha="right", va="center",
                fontsize=7, color="#8a6d2c")
        ax.text(xs["child"] + 0.2, -1.15, "storage routes: O_DIRECT or buffered,\nio_uring or preadv, staging or "
                "cuFile\n(stage storage)", ha="left", va="center", fontsize=7, color="#8a6d2c")
        ax.text(xs["engine"], -1.8, "any failure on the way (missing,\ncorrupt, service lost, ...):\n"
                "drain, then full recompute", ha="center", va="center", fontsize=7, color="#a33a2a")
        ax.set_xlim(-box_w / 2 - 0.2, xs["engine"] + box_w / 2 + 0.2)
        ax.set_ylim(-2.4, 1.6)
        return _save(fig, path)


# The packages, in tiers from the bottom (what the rest builds on) to the top (what runs them); the tiers are layout,
# the arrows are read from the code (package_edges). "root" is the package root's infrastructure modules.
PACKAGE_TIERS = (
    ("root", "sources", "integrity", "reference"),
    ("cuda", "transfer", "storage"),
    ("service", "model"),
    ("kv",),
    ("vllm", "harness"),
    ("stages", "diagnostics", "report", "devtools", "reliability"),
)
SRC_DIR = Path("src")


def package_of(module: str) -> str:
    """The package a kmesh module belongs to ("root": a module at the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and (SRC_DIR / "kmesh" / parts[1]).is_dir() else "root"


def _module_imports(path: Path) -> set[str]:
    """The kmesh modules a source file imports (absolute imports; TYPE_CHECKING blocks included: they name a use)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kmesh.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kmesh"):
            out |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return out


def package_edges(src: Path | None = None) -> dict[tuple[str, str], int]:
    """(importing package, imported package) -> number of module imports across that boundary, from the sources."""
    root = (src or SRC_DIR) / "kmesh"
    edges: dict[tuple[str, str], int] = {}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root.parent).with_suffix("").parts
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        a = package_of(module)
        for imported in _module_imports(f):
            b = package_of(imported)
            if imported == "kmesh" or b == a:
                continue
            edges[(a, b)] = edges.get((a, b), 0) + 1
    return edges


def draw_packages(path: Path, src: Path | None = None) -> Path:
    """docs/packages.svg: a box per package in its tier, an arrow per package another imports (grey: from a higher
    tier down, as expected; red: up or across a tier, the imports to look at), and the segment's data path."""
    edges = package_edges(src)
    tier = {p: i for i, row in enumerate(PACKAGE_TIERS) for p in row}
    drawn = sorted({p for e in edges for p in e} | set(tier))
    missing = [p for p in drawn if p not in tier]
    if missing:
        raise ValueError(f"packages without a tier in PACKAGE_TIERS: {missing}")
    box_w, box_h, col_gap, row_gap = 1.7, 0.5, 2.3, 1.35
    where = {p: ((i - (len(row) - 1) / 2) * col_gap, r * row_gap)
             for r, row in enumerate(PACKAGE_TIERS) for i, p in enumerate(row)}
    with matplotlib.rc_context(_SVG_STYLE):
        fig = Figure(figsize=(11, 7.2))
        ax = fig.add_subplot()
        ax.set_axis_off()
        for (a, b), n in sorted(edges.items()):
            (x0, y0), (x1, y1) = where[a], where[b]
            down = tier[a] > tier[b]
            _arrow(ax, (x0, y0 - box_h / 2 if down else y0), (x1, y1 + box_h / 2 if down else y1),
                   f"dep__{a}__{b}", color="#9a9a9a" if down else "#c0392b", width=0.6 + 0.12 * min(n, 8) ** 0.5)
        for p, (x, y) in where.items():
            _box(ax, x, y, box_w, box_h, p, f"pkg__{p}", weight="bold",
                 face="#fdebd0" if p in ("kv", "vllm", "harness") else "#eef3f8")
        ax.text(0, -0.95, "a segment's round trip: harness.leader exports -> kv.link saves -> service stores -> "
                "kv.load (load, verify, private copy, restore)\nrun by harness.child and by vllm.loads (the connector) "
                "-> kv.repair -> the engine's blocks.   Arrows: imports read from the code by kmesh.report.diagrams "
                "(grey: down a tier; red: up or across)", ha="center", va="center", fontsize=7, color="#555555")
        ax.set_xlim(-3 * col_gap, 3 * col_gap)
        ax.set_ylim(-1.3, (len(PACKAGE_TIERS) - 1) * row_gap + 0.6)
        return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kmesh.report.diagrams", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"), help="directory for dag.svg and data-path.svg")
    parser.add_argument("--rules", type=Path, default=RULES_DIR, help="the rule files to read the DAG from")
    args = parser.parse_args(argv)
    for written in (draw_dag(args.out / "dag.svg", args.rules), draw_data_path(args.out / "data-path.svg"),
                    draw_packages(args.out / "packages.svg")):
        print(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
