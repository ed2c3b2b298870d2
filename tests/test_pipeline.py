"""The Snakemake pipeline: plans, lints clean (but for the conda/container advice), and each stage's
rule is a thin call of `python -m kmesh run STAGE`."""
import re
import subprocess
import sys
from pathlib import Path


from kmesh.stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
ADVICE = "Specify a conda environment or container for each rule."


def _snakemake(*args: str, tmp_path: Path, config: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    # A scratch results dir keeps the user's results/ out of it; --config is validated like config.yaml.
    return subprocess.run([*SNAKEMAKE, *args, "--config", f"results_dir={tmp_path}", *config], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _plans_every_stage(out: subprocess.CompletedProcess, results: Path, profile: str) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    for stage in STAGES:
        assert re.search(rf"^rule {stage}:", text, re.M), f"rule {stage} not planned"
        assert f"{results}/{profile}/{stage}/result.json" in text


def test_dry_run_lists_every_stage_cuda(tmp_path):
    # the cpu profile's plan: test_engine_stages_declare_two_threads_the_rest_one_and_make_test_caps_them (one
    # Snakemake process fewer: ~5 CPU-s of make test)
    out = subprocess.run([*SNAKEMAKE, "-n", "--config", f"results_dir={tmp_path}", "profile=cuda"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    _plans_every_stage(out, tmp_path, "cuda")


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


def _planned_threads(text: str) -> dict[str, int]:
    """rule -> its threads in a dry run's job listing (Snakemake prints `threads:` only when it is not 1)."""
    out = {}
    for block in re.split(r"^(?=rule \w+:)", text, flags=re.M):
        m = re.match(r"rule (\w+):", block)
        if m:
            t = re.search(r"^    threads: (\d+)", block, re.M)
            out[m.group(1)] = int(t.group(1)) if t else 1
    return out


# Snakemake exports a job's threads as OMP_NUM_THREADS: a stage rule that declares none runs torch on one thread
# the stages that bind vLLM engines to both cores (workflow/rules/common.smk); the rest: one
TWO_THREAD_STAGES = {"peers", "vllm"}


def _planned_jobs(text: str) -> dict[str, dict[str, object]]:
    """rule -> {"priority": int, "inputs": the stages whose results it reads} from a dry run's job listing."""
    out = {}
    for block in re.split(r"^(?=rule \w+:)", text, flags=re.M):
        m = re.match(r"rule (\w+):", block)
        if m:
            p = re.search(r"^    priority: (\d+)", block, re.M)
            inputs = re.search(r"^    input: (.*)$", block, re.M)
            out[m.group(1)] = {"priority": int(p.group(1)) if p else 0,
                               "inputs": set(re.findall(r"/(\w+)/result\.json", inputs.group(1))) if inputs else set()}
    return out


def test_engine_stages_declare_two_threads_the_rest_one_and_make_test_caps_them(tmp_path):
    full_run = _snakemake("-n", "--forceall", "--cores", "2", tmp_path=tmp_path)
    _plans_every_stage(full_run, tmp_path, "cpu")
    full = _planned_threads(full_run.stdout)
    assert set(full) >= set(STAGES), sorted(set(STAGES) - set(full))
    assert {s: full[s] for s in STAGES} == {s: 2 if s in TWO_THREAD_STAGES else 1 for s in STAGES}
    # as scripts/test.sh runs it: threads capped, the test overlay
    capped_run = _snakemake("-n", "--forceall", "--cores", "2", "--max-threads", "1", tmp_path=tmp_path,
                            config=("overlay=test",))
    capped = _planned_threads(capped_run.stdout)
    assert set(capped.values()) == {1}
    assert '--max-threads "$OMP_NUM_THREADS"' in (ROOT / "scripts" / "test.sh").read_text()
    # Critical path first (workflow/rules/common.smk): a stage outranks every stage that waits for it, and the
    # engine chain (model -> reliability -> peers -> vllm) starts before equivalence, the longest single stage.
    jobs = _planned_jobs(capped_run.stdout)
    for stage in STAGES:
        for upstream in jobs[stage]["inputs"] & set(STAGES):
            assert jobs[upstream]["priority"] > jobs[stage]["priority"], (upstream, stage, jobs)
    assert jobs["reliability"]["priority"] > jobs["equivalence"]["priority"], jobs


def test_every_stage_rule_is_one_kmesh_call():
    for stage in STAGES:
        smk = (ROOT / "workflow" / "rules" / f"{stage}.smk").read_text()
        assert f'kmesh_run("{stage}")' in smk, f"{stage}.smk must call kmesh_run({stage!r})"
        for directive in ("output:", "log:", "resources:", "gpu=", "mem_mb="):
            assert directive in smk, f"{stage}.smk lacks {directive}"


# Shared machinery that decides outcomes (a representative of each kind): a content change must rerun EVERY stage.
SHARED_SAMPLES = ["src/kmesh/result.py", "src/kmesh/stages/__init__.py", "config/config.schema.yaml",
                  "config/profiles/cpu.yaml"]


def _scratch_pipeline(tmp_path: Path) -> Path:
    """A copy of the pipeline's files with every cpu-profile output present and newer than its inputs."""
    import os
    import shutil

    root = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for d in ("workflow", "config", "src", "kernels", "requirements"):
        shutil.copytree(ROOT / d, root / d, ignore=skip)
    shutil.copy2(ROOT / "Snakefile", root / "Snakefile")
    outputs = [f"results/cpu/{s}/result.json" for s in STAGES] + [
        "results/sources/pins.json", "results/models/smollm2-135m-instruct/manifest.json",
        "results/cpu/tables/summary.md", "results/cpu/plots/summary.png"]
    newest = max(p.stat().st_mtime for p in root.rglob("*") if p.is_file())
    for i, rel in enumerate(outputs):   # in pipeline order: each output newer than what it depends on
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{}")
        os.utime(p, (newest + 10 + i, newest + 10 + i))
    return root


def _planned(root: Path) -> tuple[set[str], str]:
    out = subprocess.run([*SNAKEMAKE, "-n", "--cores", "1", "--rerun-triggers", "mtime"], cwd=root,
                         capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                          "KMESH_ROOT": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    return set(re.findall(r"^rule (\w+):", text, re.M)) - {"all"}, text


def test_editing_shared_machinery_reruns_every_stage(tmp_path):
    import os

    root = _scratch_pipeline(tmp_path)
    planned, text = _planned(root)
    assert planned == set(), f"the scratch copy should be up to date:\n{text[-2000:]}"
    later = max(p.stat().st_mtime for p in (root / "results").rglob("*") if p.is_file()) + 100
    # One dry run over all the edits: Snakemake reruns a job when any one input is newer than its output, so each
    # file being an input of every stage (checked per file below) is what makes editing it alone rerun every stage.
    for rel in SHARED_SAMPLES:
        f = root / rel
        f.write_text(f.read_text() + "\n# edited\n")
        os.utime(f, (later, later))          # a content change, newer than every output
    planned, text = _planned(root)
    assert planned == set(STAGES), sorted(planned)
    # Every stage lists each file as its own input, not only through the stages it depends on (Snakemake's
    # "reason" names just the first trigger, so read the planned jobs' inputs).
    inputs = dict(re.findall(r"^rule (\w+):\n\s*input: ([^\n]*)", text, re.M))
    for rel in SHARED_SAMPLES:
        for stage in STAGES:
            assert rel in inputs[stage].split(", "), (rel, stage, inputs[stage])


def _kmesh_imports(module: str) -> set[str]:
    """The package files `module` imports, transitively (read from the sources, nothing is imported)."""
    import importgraph

    return {str(importgraph.module_file(m).relative_to(ROOT)) for m in importgraph.closure(module)}


def test_every_stage_lists_the_package_modules_it_imports(tmp_path):
    out = subprocess.run([*SNAKEMAKE, "-n", "--forceall", "--cores", "1", "--config", f"results_dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    inputs = dict(re.findall(r"^rule (\w+):\n\s*input: ([^\n]*)", out.stdout + out.stderr, re.M))
    for stage in STAGES:
        missing = _kmesh_imports(f"kmesh.stages.{stage}") - set(inputs[stage].split(", "))
        assert not missing, f"rule {stage} does not list {sorted(missing)}: editing them would not rerun it"
