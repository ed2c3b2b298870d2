"""Run mutmut on a named set of modules (pyproject `[tool.kmesh.mutation-sets.NAME]`) in a copy of the tree.

mutmut reads one configuration, `[tool.mutmut]` of ./pyproject.toml, and keeps its state in ./mutants; a second
set of modules therefore runs in its own copy: results/mutation/NAME/tree holds the tracked and untracked (not
ignored) files of this checkout, its pyproject's `[tool.mutmut]` is the base one updated by the set's keys, and
results/models is linked in (the runner tests read the converted model there). The report (kmesh.devtools
.mutation_report) lands in results/mutation/NAME/, naming this checkout's revision.

    python -m kmesh.devtools.mutation_set trust --jobs 2     # make mutation MUTATION_SET=trust
    python -m kmesh.devtools.mutation_set trust-equivalence --copy-only   # the copy alone, to run mutmut elsewhere

`--copy-only` prepares results/mutation/NAME/tree and stops: a machine with more cores and no git checkout (the
device host) runs `mutmut run` in that tree with PYTHONPATH=mutants/src, then `python -m kmesh.devtools
.mutation_report --out ..` from it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


class MutationSetError(RuntimeError):
    """The named set is not configured, or the copy could not be made."""


def set_config(pyproject: Path, name: str) -> dict:
    data = tomllib.loads(pyproject.read_text("utf-8"))
    sets = data.get("tool", {}).get("kmesh", {}).get("mutation-sets", {})
    if name not in sets:
        raise MutationSetError(f"no mutation set {name!r} in {pyproject} (have: {', '.join(sorted(sets)) or 'none'})")
    config = dict(data["tool"]["mutmut"])
    config.update(sets[name])
    return config


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        if "'" not in v and "\n" not in v:
            return "'" + v + "'"          # a literal string: the patterns' backslashes stay as they are
        raise MutationSetError(f"cannot write {v!r} as a literal TOML string")
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise MutationSetError(f"cannot write {v!r} into the copy's pyproject")


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    keep_state = dest / "mutants"           # mutmut retests only what changed: keep its state between runs
    for rel in filter(None, files):
        src, dst = ROOT / rel, dest / rel
        if not src.is_file():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copy2(src, dst)
    models = ROOT / "results" / "models"
    for link in (dest / "results" / "models", keep_state / "results" / "models"):   # mutmut runs tests in mutants/
        if models.exists() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(models)
    keep_state.joinpath("src").mkdir(parents=True, exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kmesh.devtools.mutation_set", description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--diffs", action="store_true", help="add every survivor's diff to the report")
    parser.add_argument("--copy-only", action="store_true", help="prepare the copy and stop (module doc)")
    parser.add_argument("mutants", nargs="*", help="only these mutants (names or globs, as mutmut prints them): e.g. "
                        "the survivors again after tests were added (mutmut keeps earlier results otherwise)")
    args = parser.parse_intermixed_args(argv)   # names may follow the options
    config = set_config(ROOT / "pyproject.toml", args.name)
    out = ROOT / "results" / "mutation" / args.name
    tree = out / "tree"
    copy_tree(tree)
    text = (tree / "pyproject.toml").read_text("utf-8")
    head, sep, rest = text.partition("[tool.mutmut]")
    if not sep:
        raise MutationSetError("pyproject.toml has no [tool.mutmut] section")
    nxt = rest.find("\n[")
    tail = rest[nxt:] if nxt >= 0 else ""
    body = "".join(f"{k} = {toml_value(v)}\n" for k, v in config.items())
    (tree / "pyproject.toml").write_text(head + "[tool.mutmut]\n" + body + tail, "utf-8")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    revision = rev.strip() + (" (dirty)" if dirty else "")
    if args.copy_only:
        (out / "REVISION").write_text(revision + "\n", "utf-8")
        print(f"{tree} (revision {revision}): mutmut run there with PYTHONPATH=mutants/src")
        return 0
    env = dict(os.environ, PYTHONPATH=str(tree / "mutants" / "src"), KMESH_REVISION=revision)
    exe = Path(sys.executable).with_name("mutmut")
    with open(out / "mutmut.log", "w") as log:
        rc = subprocess.run([str(exe), "run", "--max-children", str(args.jobs), *args.mutants], cwd=tree, env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT).returncode
    report = [sys.executable, "-m", "kmesh.devtools.mutation_report", "--out", str(out)]
    report += ["--diffs"] if args.diffs else []
    rrc = subprocess.run(report, cwd=tree, env=env).returncode
    return rc or rrc


if __name__ == "__main__":
    raise SystemExit(main())
