"""The shape of the package, drawn from its own imports (tests/importgraph.py): no stage imports another stage, no
import circle, the service's loop file stays a loop, and the stages folder stays a table of contents."""
from __future__ import annotations

import ast
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
                      "stages/beta.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kmesh.a\n",
                      }.items():
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


# -- the package root holds infrastructure; the KV domain lives in kmesh.kv (issue "one path for a saved segment") --

ROOT_INFRASTRUCTURE = {"__init__", "__main__", "bench", "cli", "config", "console", "doctor", "errors", "jsonfile",
                       "executors", "hostspeed", "pins", "progress", "provenance", "result", "stage_times",
                       "zygote"}
RUNTIME_PACKAGES = ("kmesh.kv", "kmesh.service", "kmesh.transfer", "kmesh.storage", "kmesh.integrity", "kmesh.vllm",
                    "kmesh.cuda", "kmesh.model", "kmesh.reference", "kmesh.sources")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_package_root_holds_infrastructure_only():
    loose = sorted(p.stem for p in (ROOT / "src" / "kmesh").glob("*.py"))
    domain = [m for m in loose if m not in ROOT_INFRASTRUCTURE]
    assert not domain, f"domain modules at the package root (they belong in a package): {domain}"


def _defined_classes(module: str) -> list[ast.ClassDef]:
    tree = ast.parse(importgraph.module_file(module).read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def record_formats(modules: list[str]) -> list[str]:
    """Classes that pack and unpack a stored byte format of their own (a record), module:class."""
    out = []
    for m in modules:
        for cls in _defined_classes(m):
            methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
            if {"pack", "unpack"} <= methods:
                out.append(f"{m}:{cls.name}")
    return out


SERVICE_REFUSALS = {"ObjectMissingError", "LayoutMismatchError", "RangeError"}


def error_mappings(modules: list[str]) -> list[str]:
    """Places that turn the service's load refusals into errors of their own: `isinstance(e, <refusal>)` tests or
    `except <refusal>` handlers that raise something else, module:line."""
    out = []
    for m in modules:
        tree = ast.parse(importgraph.module_file(m).read_text())
        for node in ast.walk(tree):
            names: set[str] = set()
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                names = {getattr(n, "attr", getattr(n, "id", "")) for n in ast.walk(node.args[1])}
            elif isinstance(node, ast.ExceptHandler) and node.type is not None and any(
                    isinstance(s, ast.Raise) and s.exc is not None for s in ast.walk(node)):
                names = {getattr(n, "attr", getattr(n, "id", "")) for n in ast.walk(node.type)}
            if names & SERVICE_REFUSALS:
                out.append(f"{m}:{node.lineno}")
    return out


def _outside_kv() -> list[str]:
    return [m for m in importgraph.all_modules() if not _in(m, "kmesh.kv") and not _in(m, "kmesh.service")]


def test_only_the_kv_package_defines_a_segment_record():
    assert record_formats(["kmesh.kv.record"]) == ["kmesh.kv.record:Record"]
    outside = record_formats([m for m in importgraph.all_modules() if not _in(m, "kmesh.kv")])
    assert not outside, f"a record format outside kmesh.kv: {outside}"


def test_only_the_kv_link_maps_the_services_refusals():
    assert error_mappings(["kmesh.kv.link"]), "the scan no longer sees kmesh.kv.link's own mapping"
    outside = error_mappings(_outside_kv())
    assert not outside, f"service refusals mapped outside kmesh.kv.link: {outside}"


def test_the_scans_see_a_record_and_a_mapping(tmp_path, monkeypatch):
    # negative control: a module outside kv with its own record and its own mapping of a service refusal
    (tmp_path / "kmesh" / "stages").mkdir(parents=True)
    (tmp_path / "kmesh" / "__init__.py").write_text("")
    (tmp_path / "kmesh" / "rogue.py").write_text(
        "class Rec:\n    def pack(self): ...\n    @classmethod\n    def unpack(cls, raw): ...\n"
        "def load(c):\n    try:\n        c.load()\n    except se.ObjectMissingError as e:\n        raise KeyError(e)\n"
        "def mapped(e):\n    return isinstance(e, se.RangeError)\n")
    monkeypatch.setattr(importgraph, "SRC", tmp_path)
    assert record_formats(["kmesh.rogue"]) == ["kmesh.rogue:Rec"]
    assert error_mappings(["kmesh.rogue"]) == ["kmesh.rogue:8", "kmesh.rogue:11"]


def test_the_connector_loads_through_the_kv_package():
    used = importgraph.imports_of("kmesh.vllm.connector") | importgraph.imports_of("kmesh.vllm.loads")
    for needed in ("kmesh.kv.load", "kmesh.kv.link", "kmesh.kv.record", "kmesh.kv.keys", "kmesh.kv.sources",
                   "kmesh.kv.restore"):
        assert needed in used, f"the connector's worker side does not use {needed}"
    assert "kmesh.vllm.loads" in importgraph.imports_of("kmesh.vllm.connector")
    assert "kmesh.kv.load" in importgraph.imports_of("kmesh.harness.child"), "the children's load step moved away"
    for gone in ("objects", "link", "repair"):
        assert importgraph.module_file(f"kmesh.vllm.{gone}") is None, f"kmesh.vllm.{gone} is back"


def private_imports(modules: list[str]) -> list[str]:
    """`from kmesh.x import _name` (a private name crossing a module boundary), module: name."""
    out = []
    for m in modules:
        for node in ast.walk(ast.parse(importgraph.module_file(m).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kmesh"):
                out += [f"{m}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_name_crosses_a_module_boundary():
    assert private_imports(["kmesh.kv.gather"]) == []
    crossing = private_imports(importgraph.all_modules())
    assert not crossing, f"private names imported across modules: {crossing}"


def test_runtime_packages_import_neither_the_harness_nor_developer_tools():
    bad = sorted(f"{m} -> {i}" for m in importgraph.all_modules() if any(_in(m, p) for p in RUNTIME_PACKAGES)
                 for i in importgraph.imports_of(m) if _in(i, "kmesh.harness") or _in(i, "kmesh.devtools"))
    assert not bad, f"runtime code depends on the experiment harness or developer tooling: {bad}"
    tools = sorted(f"{m} -> {i}" for m in importgraph.all_modules() if not _in(m, "kmesh.devtools")
                   for i in importgraph.imports_of(m) if _in(i, "kmesh.devtools"))
    assert not tools, f"only the Makefile runs kmesh.devtools: {tools}"
