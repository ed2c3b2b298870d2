"""The package's import graph, read from the sources (nothing is imported): which kmesh modules each module imports,
at module level or inside functions, absolute or relative. Imports under `if TYPE_CHECKING:` never run and are left
out; `from pkg import sub` counts the submodule `pkg.sub` (not `pkg`), as every package's own submodules do."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_file(module: str) -> Path | None:
    base = SRC / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def all_modules() -> list[str]:
    out = []
    for f in sorted((SRC / "kmesh").rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _package_of(module: str) -> str:
    f = module_file(module)
    return module if f is not None and f.name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str) -> set[str]:
    """The kmesh modules `module` names in its import statements (a `from pkg import name` counts as pkg.name when
    that is a module, else as pkg)."""
    f = module_file(module)
    if f is None:
        return set()
    found: set[str] = set()
    tree = ast.parse(f.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                 for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(module)
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            subs = [f"{base}.{a.name}" for a in node.names]
            names = [n for n in subs if module_file(n) is not None]
            if len(names) < len(subs):   # some names are attributes of base itself
                names.append(base)
        else:
            continue
        for name in names:
            if name.startswith("kmesh") and module_file(name) is not None:
                found.add(name)
    found.discard(module)
    return found


def closure(module: str) -> set[str]:
    """`module` and every kmesh module it imports, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen or module_file(m) is None:
            continue
        seen.add(m)
        todo.extend(imports_of(m))
    return seen


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {m: sorted(imports_of(m)) for m in all_modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    return found
