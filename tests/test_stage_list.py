"""One list of the pipeline's stages: kmesh.stages.STAGES.

The Snakefile includes one rule file per stage in a loop over that list and common.smk derives the stages `rule all`
and the report read from it. Everything else that names the stages must agree with it: the rule files under
workflow/rules/ (one per stage, each defining the one rule named after it), the rules Snakemake defines and the jobs
it plans, and the stage pages under docs/stages/. These tests compare them all and, on a copy of the workflow with
a planted stray rule file and page, show that a disagreement is caught.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from kmesh.stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
REFERENCE = "kmesh.stages.STAGES"


def _snakemake(root: Path, results: Path, *args: str) -> str:
    """Snakemake's output for `args` on the workflow in `root` (results into a scratch folder), failing on an error."""
    out = subprocess.run([*SNAKEMAKE, *args, "--config", f"results_dir={results}"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def stage_lists(root: Path, results: Path) -> dict[str, list[str]]:
    """Every list of the stages that the workflow and docs in `root` state, by where it comes from."""
    rule_files = sorted(p for p in (root / "workflow" / "rules").glob("*.smk") if p.stem != "common")
    pages = root / "docs" / "stages"
    defined = _snakemake(root, results, "--list-rules").splitlines()
    # the job counts of a dry run that plans every job: `<rule>  <count>` rows up to the `total` row
    stats = _snakemake(root, results, "-n", "--forceall", "--quiet", "rules")
    planned = re.findall(r"^(\w+)\s+\d+$", stats.split("Job stats:", 1)[1].split("\ntotal", 1)[0], re.M)
    return {
        REFERENCE: list(STAGES),
        "workflow/rules/*.smk": [p.stem for p in rule_files],
        "the rules those files define": [r for p in rule_files
                                         for r in re.findall(r"^rule (\w+):", p.read_text(), re.M)],
        "snakemake --list-rules": [r for r in (line.strip() for line in defined) if re.fullmatch(r"\w+", r)
                                   and r != "all"],
        "snakemake -n --forceall (jobs)": [r for r in planned if r != "all"],
        "docs/stages/*.md": [p.stem for p in sorted(pages.glob("*.md")) if p.name != "README.md"],
        "docs/stages/README.md (table)": re.findall(r"^\| `(\w+)` \|", (pages / "README.md").read_text(), re.M),
    }


def disagreements(lists: dict[str, list[str]]) -> list[str]:
    """Each list that differs from kmesh.stages.STAGES as a multiset, with what it lacks, adds or repeats.

    Compared without order: Snakemake lists rules by name and the docs index keeps its own reading order; the
    pipeline order is kmesh.stages.STAGES's alone. A stage named twice (two rule files defining one rule, two rows
    in the index) is a disagreement too.
    """
    want = Counter(lists[REFERENCE])
    found = []
    for name, stages in lists.items():
        have = Counter(stages)
        if have == want:
            continue
        missing = sorted((want - have).elements())
        extra = sorted((have - want).elements())
        found.append(f"{name}: lacks {missing}, adds {extra}")
    return found


def test_every_list_of_the_stages_is_kmesh_stages(tmp_path):
    lists = stage_lists(ROOT, tmp_path)
    assert len(lists[REFERENCE]) == len(set(STAGES)) >= 16
    assert disagreements(lists) == [], "\n".join(disagreements(lists))


def test_comparison_reports_a_planted_difference():
    lists = {REFERENCE: ["a", "b", "c"], "same, other order": ["c", "a", "b"], "one short": ["a", "b"],
             "one more": ["a", "b", "c", "d"], "one twice": ["a", "b", "b", "c"]}
    assert disagreements(lists) == ["one short: lacks ['c'], adds []", "one more: lacks [], adds ['d']",
                                    "one twice: lacks [], adds ['b']"]


def test_a_stray_rule_file_and_page_fail_the_comparison(tmp_path):
    """Negative control on a copy: a rule file for a stage kmesh.stages does not name is not included by the
    Snakefile's loop (so Snakemake never runs it), and a page for it documents nothing; both must be reported."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy2(ROOT / "Snakefile", root / "Snakefile")
    shutil.copytree(ROOT / "workflow", root / "workflow")
    shutil.copytree(ROOT / "docs" / "stages", root / "docs" / "stages")
    for shared in ("src", "config", "kernels", "requirements"):   # read by the rules' inputs, left as they are
        (root / shared).symlink_to(ROOT / shared)
    (root / "workflow" / "rules" / "stray.smk").write_text(
        (ROOT / "workflow" / "rules" / "kernels.smk").read_text().replace("kernels", "stray"))
    (root / "docs" / "stages" / "stray.md").write_text("# Stage `stray`\n")
    lists = stage_lists(root, tmp_path / "results")
    assert "stray" not in lists["snakemake --list-rules"]
    assert disagreements(lists) == ["workflow/rules/*.smk: lacks [], adds ['stray']",
                                    "the rules those files define: lacks [], adds ['stray']",
                                    "docs/stages/*.md: lacks [], adds ['stray']"]


def test_no_hand_written_stage_list_in_the_workflow():
    """The Snakefile includes common.smk by name and every stage's rule file in its loop, and neither file spells
    out the stages (the Snakefile's old header listed 14 of them, common.smk had a 15-stage copy)."""
    snakefile = (ROOT / "Snakefile").read_text()
    common = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    assert re.findall(r'^include: "([^"]+)"', snakefile, re.M) == ["workflow/rules/common.smk"]
    assert re.search(r'^for (\w+) in kmesh\.stages\.STAGES:\n\n?    include: f"workflow/rules/\{\1\}\.smk"$',
                     snakefile, re.M)
    run_of_three = re.compile(rf"(?:\b(?:{'|'.join(STAGES)})\b\W+){{3}}")
    assert not run_of_three.search(snakefile), run_of_three.search(snakefile)
    assert re.search(r"^STAGES = .*kmesh\.stages\.STAGES", common, re.M)
    assert not re.search(r'^STAGES\s*=\s*[\[(]\s*"', common, re.M)
