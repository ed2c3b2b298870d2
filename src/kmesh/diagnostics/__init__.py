"""Measurement diagnostics: one module per question a stage's numbers raised, run as
`python -m kmesh diagnose <name> [args]` (`python -m kmesh diagnose` lists them, `... <name> --help` shows a
diagnostic's options). Each module's docstring says what it measures and how to read its output; each has
`main(argv) -> int`. They measure on the package's own setups (kmesh.harness.modelsetup), never on a stage module, and
most need a CUDA GPU: without one they stop with a DiagnosticError saying so.

The list is read from this package's files (a module whose name starts with `_` is a helper, not a diagnostic),
and each summary from its docstring's first paragraph, without importing anything: listing stays fast and works
without a GPU.
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

from kmesh.errors import KMeshError

_HERE = Path(__file__).resolve().parent


class DiagnosticError(KMeshError):
    """A diagnostic cannot run here (no GPU, a library missing) or was given arguments it cannot use."""


class UnknownDiagnosticError(DiagnosticError):
    """No diagnostic of that name."""


def available() -> dict[str, str]:
    """name -> its docstring's first paragraph on one line, for every diagnostic module, sorted by name."""
    out: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules([str(_HERE)]), key=lambda m: m.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        doc = ast.get_docstring(ast.parse((_HERE / f"{info.name}.py").read_text())) or ""
        out[info.name] = " ".join(doc.strip().split("\n\n")[0].split()) or "(no description)"
    return out


def listing() -> str:
    """The diagnostics as an indented two-column text, one per line."""
    names = available()
    width = max(map(len, names), default=0)
    return "\n".join(f"  {name:<{width}}  {summary}" for name, summary in names.items())


def run(name: str, argv: list[str]) -> int:
    """Run diagnostic `name` with its own arguments; its exit status."""
    names = available()
    if name not in names:
        raise UnknownDiagnosticError(f"unknown diagnostic {name!r}; available: {', '.join(names)}")
    module = importlib.import_module(f"{__name__}.{name}")
    return int(module.main(argv) or 0)
