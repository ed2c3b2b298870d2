"""The shape of the package, drawn from its own imports (tests/importgraph.py): no stage imports another stage, no
import circle, the service's loop file stays a loop, and the stages folder stays a table of contents."""
from __future__ import annotations

from pathlib import Path

import importgraph

ROOT = Path(__file__).resolve().parents[1]
STAGES_DIR = ROOT / "src" / "kmesh" / "stages"


def _stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kmesh", "stages"] else None


def test_no_stage_imports_another_stage():
    crossings = sorted(f"{m} -> {i}" for m in importgraph.all_modules() if _stage_of(m)
                       for i in importgraph.imports_of(m) if _stage_of(i) and _stage_of(i) != _stage_of(m))
    assert not crossings, "what two stages share belongs below them in the package:\n" + "\n".join(crossings)


def test_no_stage_needs_the_stages_registry():
    users = sorted(m for m in importgraph.all_modules() if _stage_of(m) and "kmesh.stages" in importgraph.imports_of(m))
    assert not users, f"stages import kmesh.stages itself: {users}"


def test_no_import_circle():
    assert importgraph.cycles() == []


def test_the_graph_sees_a_circle_and_a_crossing(tmp_path, monkeypatch):
    # negative control: the same reader over a tiny fake package with one circle and one stage crossing
    pkg = tmp_path / "kmesh"
    (pkg / "stages" / "alpha").mkdir(parents=True)
    for rel, text in {"__init__.py": "", "a.py": "from kmesh import b\n", "b.py": "import kmesh.a\n",
                      "stages/__init__.py": "", "stages/alpha/__init__.py": "from .part import x\n",
                      "stages/alpha/part.py": "def f():\n    from kmesh.stages import beta\n",
                      "stages/beta.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kmesh.a\n"}.items():
        (pkg / rel).write_text(text)
    monkeypatch.setattr(importgraph, "SRC", tmp_path)
    assert importgraph.cycles() == [["kmesh.a", "kmesh.b"]]
    assert importgraph.imports_of("kmesh.stages.alpha") == {"kmesh.stages.alpha.part"}
    assert importgraph.imports_of("kmesh.stages.alpha.part") == {"kmesh.stages.beta"}
    assert importgraph.imports_of("kmesh.stages.beta") == set()


def test_service_loop_is_short():
    lines = len((ROOT / "src" / "kmesh" / "service" / "server.py").read_text().splitlines())
    assert lines <= 400, f"service/server.py has {lines} lines: operations belong in their own modules"


def test_stages_folder_is_a_table_of_contents():
    from kmesh.stages import STAGES

    # one entry per pipeline stage (a module or a folder) and the package's own __init__: nothing else lives there
    entries = sorted(p.name.removesuffix(".py") for p in STAGES_DIR.iterdir() if p.name != "__pycache__")
    assert entries == sorted([*STAGES, "__init__"]), f"src/kmesh/stages holds {entries}, the pipeline {STAGES}"
    for folder in (p for p in STAGES_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = (folder / "__init__.py").read_text()
        assert "def run(" in init or "import run" in init, f"stage folder {folder.name} exposes no run(cfg)"
