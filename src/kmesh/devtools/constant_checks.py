"""Find result checks that cannot fail, by reading the stages' source (issue 21 item 6).

A check (`case.check(name, ok, ...)`, kmesh.result.Case.check) must be able to fail. At run time a check whose
`ok` is the literal True looks exactly like one that was computed, so the guard is this static scan, run over
every stage by tests/test_constant_checks.py. It reports four shapes:

  constant         a literal where `ok`, or one operand of its and/or/not/if-else, should be computed:
                   check("x", True), check("x", measured or True), check("x", a if b else True)
  setting-or       `measured or <a setting>`: an operand of an `or` that reads configuration, not the run:
                   a lookup in cfg/sec/conf/config/settings/profile (or .sec/.cfg/.profile/.config), or a
                   lookup compared with a literal (`ctx.restore_backend != "torch"`): the check passes whenever
                   that setting is so, whatever was measured; also `ok` that is itself a config lookup
  constant-name    `ok` is a variable that the function only ever binds to one literal (ok = True ... check(ok))
  self-comparison  a comparing call (its name says compare/equal/identical/same/agree/diverge/quality/overlap/
                   gap/close/diff) given the same variable twice (f(a, a)), also through a plain alias in the
                   same function (b = a ... f(a, b)), or a comparison of an expression with itself (x == x): what
                   it measures is an identity, e.g. the quality table's full arm scored against itself

    python -m kmesh.devtools.constant_checks [PATH ...]  # default: src/kmesh/stages and src/kmesh/harness/modelsetup.py
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

CONFIG_NAMES = frozenset({"cfg", "config", "sec", "conf", "settings", "setting", "profile"})
CONFIG_ATTRS = frozenset({"sec", "cfg", "config", "profile"})
# callees that compare their arguments (by name): given one thing twice, they measure an identity
COMPARING = re.compile(r"compar|equal|identical|same|agree|diverg|quality|overlap|gap|close|diff", re.IGNORECASE)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.code}"


def _ok_argument(call: ast.Call) -> ast.expr | None:
    """The `ok` of a `<x>.check(name, ok, ...)` call, or None when the call is no such check."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "check"):
        return None
    if len(call.args) >= 2:
        return call.args[1]
    return next((k.value for k in call.keywords if k.arg == "ok"), None)


def _skeleton(expr: ast.expr, in_or: bool = False) -> Iterator[tuple[ast.expr, bool]]:
    """The leaves of the boolean structure of `ok` (through and/or/not/if-else), each with whether it is an
    operand of an `or` (directly or through a `not`)."""
    if isinstance(expr, ast.BoolOp):
        for value in expr.values:
            yield from _skeleton(value, isinstance(expr.op, ast.Or))
    elif isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        yield from _skeleton(expr.operand, in_or)
    elif isinstance(expr, ast.IfExp):
        yield from _skeleton(expr.body, in_or)
        yield from _skeleton(expr.orelse, in_or)
    else:
        yield expr, in_or


def _lookup_root(expr: ast.expr) -> tuple[ast.expr, list[str]]:
    """(root, attribute names) of a chain like a.b["c"].get("d"); root is where the chain starts."""
    attrs: list[str] = []
    while True:
        if isinstance(expr, ast.Attribute):
            attrs.append(expr.attr)
            expr = expr.value
        elif isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
            expr = expr.value
        elif (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)
              and expr.func.attr in ("get", "section") and all(isinstance(a, ast.Constant) for a in expr.args)):
            expr = expr.func.value
        else:
            return expr, attrs


def _is_lookup(expr: ast.expr) -> bool:
    root, _ = _lookup_root(expr)
    return isinstance(root, ast.Name) and root is not expr or isinstance(expr, ast.Name)


def _reads_config(expr: ast.expr) -> bool:
    root, attrs = _lookup_root(expr)
    return (isinstance(root, ast.Name) and root.id in CONFIG_NAMES) or bool(CONFIG_ATTRS & set(attrs))


def _is_setting(expr: ast.expr, in_or: bool) -> bool:
    """An expression that reads configuration rather than what the run measured; in an `or`, also any lookup
    compared with a literal (there it can make the whole check pass)."""
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return _is_setting(expr.operand, in_or)
    if isinstance(expr, ast.Compare):
        if not in_or:
            return any(_reads_config(s) for s in (expr.left, *expr.comparators))
        sides = [expr.left, *expr.comparators]
        literals = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, (str, int, float))
                    and not isinstance(s.value, bool)
                    or isinstance(s, (ast.Tuple, ast.List, ast.Set))
                    and all(isinstance(e, ast.Constant) for e in s.elts)]
        others = [s for s in sides if not any(s is lit for lit in literals)]
        return bool(literals) and bool(others) and all(_is_lookup(s) or _reads_config(s) for s in others) \
            or any(_reads_config(s) for s in sides)
    return _reads_config(expr)


def _constant_names(func: ast.AST) -> set[str]:
    """Names the function binds only to one and the same literal (never computed, never rebound otherwise):
    `caught = False ... except: caught = True` is a flag the run sets, `ok = True` alone is not."""
    literal: dict[str, set[object]] = {}
    other: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            targets = [t for t in node.targets if isinstance(t, ast.Name)]
            if isinstance(node.value, ast.Constant):
                for t in targets:
                    literal.setdefault(t.id, set()).add(repr(node.value.value))
            else:
                other.update(t.id for t in targets)
            for t in node.targets:
                if not isinstance(t, ast.Name):
                    other.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
            if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Constant):
                literal.setdefault(node.target.id, set()).add(repr(node.value.value))
            else:
                other.add(node.target.id)
        elif isinstance(node, (ast.For, ast.comprehension, ast.With, ast.NamedExpr)):
            targets = ([i.optional_vars for i in node.items if i.optional_vars] if isinstance(node, ast.With)
                       else [node.target])
            other.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            other.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            other.update(node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            other.update(a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg))
    return {name for name, values in literal.items() if len(values) == 1 and name not in other}


def _aliases(func: ast.AST) -> dict[str, str]:
    """Each name's alias class (a representative), from plain `b = a` assignments anywhere in the function."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    parent[find(target.id)] = find(node.value.id)
    return {name: find(name) for name in parent}


def _functions(tree: ast.Module) -> Iterator[ast.AST]:
    """The module body and every function in it (nested ones also on their own)."""
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _own_nodes(func: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `func` outside the functions nested in it."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def scan_source(source: str, path: str = "<source>") -> list[Finding]:
    """Every constant-shaped check and self-comparison in one module's source."""
    tree = ast.parse(source, filename=path)
    found: list[Finding] = []

    def add(node: ast.AST, rule: str) -> None:
        found.append(Finding(path, node.lineno, rule, ast.unparse(node)[:160]))

    for func in _functions(tree):
        constants = _constant_names(func) if func is not tree else set()
        alias = _aliases(func)
        for node in _own_nodes(func):
            if isinstance(node, ast.Call):
                ok = _ok_argument(node)
                if ok is not None:
                    for leaf, in_or in _skeleton(ok):
                        if isinstance(leaf, ast.Constant):
                            add(node, "constant")
                        elif isinstance(leaf, ast.Name) and leaf.id in constants:
                            add(node, "constant-name")
                        elif (in_or or leaf is ok) and _is_setting(leaf, in_or):
                            add(node, "setting-or")
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                names = [a.id for a in node.args if isinstance(a, ast.Name)]
                classes = [alias.get(n, n) for n in names]
                if COMPARING.search(callee) and len(set(classes)) < len(classes):
                    add(node, "self-comparison")
            elif isinstance(node, ast.Compare):
                sides = [ast.dump(s) for s in (node.left, *node.comparators)]
                if len(set(sides)) < len(sides) and not all(
                        isinstance(s, ast.Constant) for s in (node.left, *node.comparators)):
                    add(node, "self-comparison")
    return sorted(set(found), key=lambda f: (f.path, f.line, f.rule))


def stage_sources(root: Path) -> list[Path]:
    """The stage code the scan covers: every module under src/kmesh/stages, and kmesh.harness.modelsetup's setup
    case."""
    src = root / "src" / "kmesh"
    return sorted((src / "stages").rglob("*.py")) + [src / "harness" / "modelsetup.py"]


def scan_paths(paths: Iterable[Path]) -> list[Finding]:
    found: list[Finding] = []
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            found.extend(scan_source(file.read_text(), str(file)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="files or folders (default: the stage code)")
    args = parser.parse_args(argv)
    if args.paths:
        paths = args.paths
    else:
        from kmesh.config import find_root

        paths = stage_sources(find_root())
    found = scan_paths(paths)
    for finding in found:
        print(finding)
    print(f"{len(found)} check(s) that cannot fail", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
