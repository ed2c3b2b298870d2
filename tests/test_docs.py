"""The documentation stays true to the repository: a page per stage, a README that reads in five minutes, links
that resolve, a DAG drawing that matches the rule files, and a flake.lock that really pins nixpkgs."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kmesh.report import diagrams

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "workflow" / "rules"
STAGE_DOCS = ROOT / "docs" / "stages"
README = ROOT / "README.md"
LINKED_DOCS = [README, *sorted(STAGE_DOCS.glob("*.md")), ROOT / "docs" / "service.md", ROOT / "docs" / "testing.md"]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_SVG_NS = "{http://www.w3.org/2000/svg}"


def rule_file_stages() -> set[str]:
    """Stages as the rule files name them (read here, not through kmesh.report.diagrams)."""
    return {p.stem for p in RULES.glob("*.smk") if p.stem != "common"}


def broken_links(md: Path) -> list[str]:
    """Relative link targets in a Markdown file that name no existing file or folder (anchors ignored)."""
    bad = []
    for target in _LINK.findall(md.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue   # a URL (https:, mailto:) or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (md.parent / path).exists():
            bad.append(target)
    return bad


def test_rule_stages_are_the_pipeline():
    assert len(rule_file_stages()) >= 13
    assert {"sources", "storage", "report"} <= rule_file_stages()


@pytest.mark.parametrize("stage", sorted(rule_file_stages()))
def test_every_rule_stage_has_a_page_in_the_index(stage):
    page = STAGE_DOCS / f"{stage}.md"
    assert page.is_file(), f"{page} is missing"
    assert page.read_text().startswith(f"# Stage `{stage}`")
    assert f"]({stage}.md)" in (STAGE_DOCS / "README.md").read_text(), f"docs/stages/README.md does not link {stage}"


def test_readme_reads_in_five_minutes():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README has {len(lines)} lines"
    assert len(text) <= 15_000, f"README has {len(text)} characters"
    longest = max(lines, key=len)
    assert len(longest) <= 400, f"a README line has {len(longest)} characters: {longest[:80]}..."


@pytest.mark.parametrize("md", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    assert md.is_file()
    assert broken_links(md) == []


def test_broken_link_is_reported(tmp_path):
    (tmp_path / "there.md").write_text("x")
    md = tmp_path / "page.md"
    md.write_text("[ok](there.md#part) [web](https://example.org/x) [anchor](#top) [gone](missing/file.md)")
    assert broken_links(md) == ["missing/file.md"]


def _svg_ids(path: Path) -> dict[str, ET.Element]:
    return {el.get("id"): el for el in ET.parse(path).getroot().iter() if el.get("id")}


def test_committed_dag_names_the_rule_files_stages():
    ids = _svg_ids(ROOT / "docs" / "dag.svg")
    drawn = {i.removeprefix("stage__"): el for i, el in ids.items() if i.startswith("stage__")}
    assert set(drawn) == rule_file_stages()
    for stage, el in drawn.items():
        texts = ["".join(t.itertext()).strip() for t in el.iter(f"{_SVG_NS}text")]
        assert texts == [stage], f"box of {stage} reads {texts}"


def test_committed_dag_draws_the_rule_files_edges():
    ids = _svg_ids(ROOT / "docs" / "dag.svg")
    drawn = {tuple(i.split("__")[1:]) for i in ids if i.startswith("edge__")}
    declared = {(e.source, e.target) for e in diagrams.rule_edges(RULES)}
    assert drawn == declared, "docs/dag.svg is stale: run `python -m kmesh.report.diagrams`"


def test_rule_edges_are_read_from_the_inputs():
    edges = {(e.source, e.target): e for e in diagrams.rule_edges(RULES)}
    assert ("sources", "kernels") in edges and not edges["sources", "kernels"].order_only
    assert edges["peers", "vllm"].order_only and not edges["model", "vllm"].order_only   # "# order only"
    assert {s for s, t in edges if t == "report"} == rule_file_stages() - {"report"}
    inputs = {t for _, t in edges}
    assert inputs == rule_file_stages() - {"sources"}       # every stage but the root reads a result


@pytest.mark.parametrize("stage", sorted(rule_file_stages() - {"report"}))
def test_stage_page_names_the_rules_inputs(stage):
    """A stage page's "Rule:" sentence names the stages its rule lists as inputs, no more, no fewer (an input
    dropped or added in the rule file makes the page stale)."""
    text = " ".join((ROOT / "docs" / "stages" / f"{stage}.md").read_text().split())
    m = re.search(rf"`workflow/rules/{stage}\.smk` — ([^;]*);", text)
    assert m, f"docs/stages/{stage}.md has no 'Rule: `workflow/rules/{stage}.smk` — inputs ...;' sentence"
    named = set(re.findall(r"`(\w+)`", m.group(1))) & rule_file_stages()
    declared = {e.source for e in diagrams.rule_edges(RULES) if e.target == stage}
    assert named == declared, f"docs/stages/{stage}.md names {sorted(named)}, the rule reads {sorted(declared)}"


def test_rule_stages_refuse_a_rule_file_with_another_rule(tmp_path):
    (tmp_path / "common.smk").write_text('STAGES = ["a"]\n')
    (tmp_path / "a.smk").write_text("rule b:\n    input:\n        x=1,\n")
    with pytest.raises(ValueError, match="expected exactly one rule named 'a'"):
        diagrams.rule_stages(tmp_path)


def test_committed_data_path_shows_the_chain():
    ids = _svg_ids(ROOT / "docs" / "data-path.svg")
    for node in ("leader", "service", "child", "engine", "disk"):
        assert f"node__{node}" in ids
    for a, b in (("leader", "service"), ("service", "child"), ("child", "engine")):
        assert f"flow__{a}__{b}" in ids


# -- flake.lock -------------------------------------------------------------------------------------------------

def _lock() -> dict:
    return json.loads((ROOT / "flake.lock").read_text())


def test_flake_lock_pins_nixpkgs_to_one_revision():
    lock = _lock()
    assert lock["version"] == 7 and lock["root"] == "root"
    name = lock["nodes"]["root"]["inputs"]["nixpkgs"]
    locked = lock["nodes"][name]["locked"]
    assert (locked["type"], locked["owner"], locked["repo"]) == ("github", "NixOS", "nixpkgs")
    assert re.fullmatch(r"[0-9a-f]{40}", locked["rev"]), locked["rev"]
    assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", locked["narHash"]), locked["narHash"]
    assert type(locked["lastModified"]) is int and locked["lastModified"] > 1_600_000_000


def test_flake_input_matches_the_lock():
    original = _lock()["nodes"]["nixpkgs"]["original"]
    flake = (ROOT / "flake.nix").read_text()
    match = re.search(r'inputs\.nixpkgs\.url\s*=\s*"github:([^/"]+)/([^/"]+)/([^/"]+)"', flake)
    assert match, "flake.nix names no github nixpkgs input"
    assert original["type"] == "github"
    assert match.groups() == (original["owner"], original["repo"], original["ref"])


# -- docs/packages.svg and docs/architecture.md: the packages drawn from the code's imports ----------------------

def test_committed_package_picture_draws_the_codes_imports():
    ids = _svg_ids(ROOT / "docs" / "packages.svg")
    drawn = {tuple(i.split("__")[1:]) for i in ids if i.startswith("dep__")}
    assert drawn == set(diagrams.package_edges(ROOT / "src")), \
        "docs/packages.svg is stale: run `python -m kmesh.report.diagrams`"
    packages = {p.name for p in (ROOT / "src" / "kmesh").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert {i.removeprefix("pkg__") for i in ids if i.startswith("pkg__")} == packages | {"root"}


def test_package_edges_see_a_new_import(tmp_path):
    # negative control: a copy of two packages where one starts importing the other
    for pkg, text in {"alpha": "from kmesh.beta import x\n", "beta": "x = 1\n"}.items():
        (tmp_path / "kmesh" / pkg).mkdir(parents=True)
        (tmp_path / "kmesh" / pkg / "__init__.py").write_text(text)
    (tmp_path / "kmesh" / "__init__.py").write_text("")
    old = diagrams.SRC_DIR
    try:
        diagrams.SRC_DIR = tmp_path
        assert set(diagrams.package_edges(tmp_path)) == {("alpha", "beta")}
    finally:
        diagrams.SRC_DIR = old


def test_architecture_page_shows_the_package_picture_and_names_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "packages.svg" in text
    for p in (ROOT / "src" / "kmesh").iterdir():
        if p.is_dir() and p.name != "__pycache__":
            assert f"`{p.name}`" in text, f"docs/architecture.md does not name the package {p.name}"


def test_readme_quotes_the_last_recorded_run_of_each_command():
    """README's times of the two commands come from docs/measurements/two-commands.json, the last run of each."""
    from kmesh.console import format_seconds

    record = json.loads((ROOT / "docs" / "measurements" / "two-commands.json").read_text())
    rows = {line.split("|")[1].strip(): line for line in README.read_text().splitlines() if line.startswith("| `make ")}
    for command in ("make pipeline", "make test"):
        last = [run for run in record["runs"] if run["command"] == command][-1]
        row = next((line for name, line in rows.items() if name.startswith(f"`{command}`")), "")
        quoted = f"{format_seconds(last['wall_s'])} at {last['rev']}"
        assert quoted in row, f"README's row of {command} does not say {quoted!r} (two-commands.json): {row!r}"
        met = last["wall_s"] <= record["budget_s"][command]
        assert ("over the 10 min budget" in row) != met, f"README's row of {command} says met/missed wrongly: {row!r}"


def test_docs_testing_lists_every_recorded_run_of_the_two_commands():
    from kmesh.console import format_seconds

    record = json.loads((ROOT / "docs" / "measurements" / "two-commands.json").read_text())
    text = (ROOT / "docs" / "testing.md").read_text()
    for run in record["runs"]:
        met = "met" if run["wall_s"] <= record["budget_s"][run["command"]] else "missed"
        row = f"| `{run['command']}` | {run['rev']} | {run['date']} | {format_seconds(run['wall_s'])} | {met} |"
        assert row in text, f"docs/testing.md lacks the run {row}"


def test_readme_peers_table_is_generated_from_the_committed_result():
    """README's peers figures are kmesh.report.tables.peers_markdown of the result file its marker names, never
    typed by hand (a rerun committed under docs/measurements moves the marker and the table together)."""
    from kmesh.report.tables import peers_markdown

    text = README.read_text()
    m = re.search(r"<!-- peers-table (\S+) -->\n(.*?)\n<!-- /peers-table -->", text, re.S)
    assert m, "README has no <!-- peers-table FILE --> ... <!-- /peers-table --> block"
    result = json.loads((ROOT / "docs" / m.group(1)).read_text())
    assert result["stage"] == "peers" and result["summary"]["ok"] is True
    assert m.group(2) == peers_markdown(result), "README's peers table differs from its committed result"
    assert result["provenance"]["kmesh"]["rev"][:7] in m.group(1) and not result["provenance"]["kmesh"]["dirty"]
