"""Summarise the last `mutmut run` (make mutation): mutants per module and function, and every survivor's diff.

Writes results/mutation/report.md and report.json (with the code revision it ran at). mutmut's own statuses:
killed (a test failed), survived (every selected test passed), no tests (no selected test reached the
function), timeout, suspicious, skipped, segfault, not checked.

    python -m kmesh.devtools.mutation_report [--diffs]   # --diffs: add every survivor's diff

The diffs are read from mutmut's generated modules (mutants/src: every mutant is a function beside the original,
`<name>__mutmut_<n>` and `<name>__mutmut_orig`), in this process: `mutmut show` per survivor costs a process each
(~1.5 s; hundreds of survivors in a stage module).
"""
from __future__ import annotations

import argparse
import ast
import collections
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

LINE = re.compile(r"^\s*(?P<name>\S+__mutmut_\d+): (?P<status>.+)$")


def mutmut(*args: str) -> str:
    exe = Path(sys.executable).with_name("mutmut")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mutmut"]     # installed with --target: no script
    return subprocess.run([*cmd, *args], check=True, capture_output=True, text=True).stdout


def split(name: str) -> tuple[str, str]:
    """('kmesh.kv.layout', 'KVLayout.split_slots') from mutmut's mangled
    'kmesh.kv.layout.xǁKVLayoutǁsplit_slots__mutmut_3'."""
    base = name.rsplit("__mutmut_", 1)[0]
    module, _, func = base.rpartition(".x")
    if "ǁ" in func:
        _, cls, meth = func.split("ǁ")
        func = f"{cls}.{meth}"
    else:
        func = func.lstrip("_")
    return module, func


def _functions(path: Path) -> dict[str, str]:
    """Every generated function of one mutated module, by name: its source text."""
    text = path.read_text("utf-8")
    lines = text.splitlines()       # by line numbers: ast.get_source_segment re-splits the file every call
    return {node.name: "\n".join(lines[node.lineno - 1:node.end_lineno]) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "__mutmut_" in node.name}


def mutant_diff(name: str, root: Path = Path("mutants/src"), cache: dict[Path, dict[str, str]] | None = None) -> str:
    """The lines a mutant changes (unified diff, no context) against the original function, from the generated
    module under `root`; "" when the module or the function is not there."""
    module = name.rsplit("__mutmut_", 1)[0].rpartition(".x")[0]
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    cache = {} if cache is None else cache
    if path not in cache:
        cache[path] = _functions(path) if path.exists() else {}
    func = name[len(module) + 1:]
    base = func.rsplit("__mutmut_", 1)[0]
    orig, mutant = cache[path].get(base + "__mutmut_orig"), cache[path].get(func)
    if orig is None or mutant is None:
        return ""
    mutant = mutant.replace(func, base + "__mutmut_orig", 1)
    lines = difflib.unified_diff(orig.splitlines(), mutant.splitlines(), lineterm="", n=0)
    return "\n".join(line for line in lines if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kmesh.devtools.mutation_report",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--diffs", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results/mutation"))
    args = parser.parse_args(argv)
    rows = [m.groupdict() for m in map(LINE.match, mutmut("results", "--all", "true").splitlines()) if m]
    if not rows:
        print("no mutmut results: run `make mutation` first", file=sys.stderr)
        return 1
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    survivors: dict[str, list[str]] = collections.defaultdict(list)
    for row in rows:
        module, func = split(row["name"])
        by_module[module][row["status"]] += 1
        if row["status"] == "survived":
            survivors[f"{module}:{func}"].append(row["name"])
    if os.environ.get("KMESH_REVISION"):     # a mutation set's copy has no .git: kmesh.devtools.mutation_set names it
        rev, _, flag = os.environ["KMESH_REVISION"].partition(" ")
        dirty = bool(flag)
    else:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True).stdout.strip())
    total = collections.Counter(r["status"] for r in rows)
    args.out.mkdir(parents=True, exist_ok=True)
    cache: dict[Path, dict[str, str]] = {}
    diffs = {n: mutant_diff(n, cache=cache) or mutmut("show", n) for names in survivors.values() for n in names} \
        if args.diffs else {}
    (args.out / "report.json").write_text(json.dumps(
        {"revision": rev, "dirty": dirty, "total": total, "by_module": by_module,
         "survivors": survivors, "diffs": diffs}, indent=1, ensure_ascii=False))
    statuses = sorted(total)
    md = [f"# Mutation testing (mutmut) at {rev}{' (dirty)' if dirty else ''}", "",
          "| module | " + " | ".join(statuses) + " |", "|---" * (len(statuses) + 1) + "|"]
    for module, counts in sorted(by_module.items()):
        md.append(f"| {module} | " + " | ".join(str(counts[status]) for status in statuses) + " |")
    md.append("| **all** | " + " | ".join(str(total[status]) for status in statuses) + " |")
    md += ["", "## Survivors by function", ""]
    md += [f"- `{f}`: {len(ns)}" for f, ns in sorted(survivors.items(), key=lambda kv: -len(kv[1]))]
    for name, diff in diffs.items():
        md += ["", f"### {name}", "```diff", diff.strip(), "```"]
    (args.out / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[:len(by_module) + 8]))
    print(f"-> {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
