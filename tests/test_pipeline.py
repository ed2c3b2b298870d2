"""The Snakemake pipeline: plans, lints clean (but for the conda/container advice), and each stage's
rule is a thin call of `python -m kmesh run STAGE`."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kmesh.stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
ADVICE = "Specify a conda environment or container for each rule."


def _snakemake(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # A scratch results dir keeps the user's results/ out of it; --config is validated like config.yaml.
    return subprocess.run([*SNAKEMAKE, *args, "--config", f"results_dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
def test_dry_run_lists_every_stage(tmp_path, profile):
    out = subprocess.run([*SNAKEMAKE, "-n", "--config", f"results_dir={tmp_path}", f"profile={profile}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    for stage in STAGES:
        assert re.search(rf"^rule {stage}:", text, re.M), f"rule {stage} not planned"
        assert f"{tmp_path}/{profile}/{stage}/result.json" in text


def test_lint_reports_only_the_conda_container_advice(tmp_path):
    out = _snakemake("--lint", tmp_path=tmp_path)
    text = out.stdout + out.stderr
    bullets = [ln.strip()[2:] for ln in text.splitlines() if ln.strip().startswith("* ")]
    linted_rules = set(re.findall(r"^Lints for rule (\w+)", text, re.M))
    assert set(STAGES) <= linted_rules, "lint did not cover every rule"
    assert bullets and all(b.startswith(ADVICE) for b in bullets), [b for b in bullets if not b.startswith(ADVICE)]
    assert "Lints for snakefile" not in text, text[-3000:]


def test_bad_config_on_the_command_line_is_rejected(tmp_path):
    out = subprocess.run([*SNAKEMAKE, "-n", "--config", "profile=tpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "profile" in text and "tpu" in text


def test_every_stage_rule_is_one_kmesh_call():
    for stage in STAGES:
        smk = (ROOT / "workflow" / "rules" / f"{stage}.smk").read_text()
        assert f'kmesh_run("{stage}")' in smk, f"{stage}.smk must call kmesh_run({stage!r})"
        for directive in ("output:", "log:", "resources:", "gpu=", "mem_mb="):
            assert directive in smk, f"{stage}.smk lacks {directive}"
