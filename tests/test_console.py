"""`python -m kmesh pipeline` (what `make pipeline` runs): the compact console over Snakemake's log.

The parser and the printed lines are checked on real Snakemake output recorded by tests/data/console/record.sh;
the end-to-end tests run the real pipeline on its two fast stages in a scratch results directory."""
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kmesh import cli, stage_times
from kmesh.console import (Console, JobFailed, JobFinished, JobStarted, SnakemakeLog, format_seconds, log_path,
                           read_invocation)
from kmesh.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "console"
PLACEHOLDER = "RESULTS"   # how record.sh spells the scratch results directory


def _recorded(name: str, results: Path) -> list[str]:
    return (DATA / name).read_text().replace(PLACEHOLDER, str(results)).splitlines(keepends=True)


def _events(lines: list[str]) -> list:
    log = SnakemakeLog()
    events = [event for line in lines for event in log.feed(line)]
    return events + log.close()


class SteppingClock:
    """Each reading is one second after the previous one, so every stage took 1.0 s."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _replay(name: str, results: Path, returncode: int, dry_run: bool = False) -> list[str]:
    """The console lines the recorded output `name` gives."""
    out = io.StringIO()
    log_file = results / "cpu" / "logs" / ("snakemake-dry-run.log" if dry_run else "snakemake.log")
    console = Console(out, ROOT, log_file, dry_run, clock=SteppingClock())
    log = SnakemakeLog()
    console.begin()
    for line in _recorded(name, results):
        for event in log.feed(line):
            console.handle(event)
    for event in log.close():
        console.handle(event)
    console.end(log, returncode)
    return out.getvalue().splitlines()


def _write_summary(results: Path, stage: str, passed: int, failed: int, skipped: int,
                   cpu_s: float | None = None) -> None:
    path = results / "cpu" / stage / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict = {"summary": {"passed": passed, "failed": failed, "skipped": skipped}}
    if cpu_s is not None:
        data["provenance"] = {"resources": {"cpu_s": cpu_s}}
    path.write_text(json.dumps(data))


def _lines_per_stage(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    stage = None
    for line in lines:
        match = re.match(r"^\[kmesh\] (\w+)\s{2,}(started|ok|FAILED|unfinished)\b", line)
        if match:
            stage = match[1]
        elif not line.startswith("[kmesh]   "):
            stage = None   # a pipeline line; an indented line belongs to the stage line above it
        if stage:
            counts[stage] = counts.get(stage, 0) + 1
    return counts


# --- the parser on recorded output ------------------------------------------------------------------------------

def test_events_of_a_real_run(tmp_path):
    events = _events(_recorded("run.log", tmp_path))
    assert events == [
        JobStarted("1", "sources", (f"{tmp_path}/cpu/sources/result.json", f"{tmp_path}/sources/pins.json"),
                   (f"{tmp_path}/cpu/logs/sources.log",)),
        JobFinished("1", "sources", 1, 2),
        JobStarted("0", "kernels", (f"{tmp_path}/cpu/kernels/result.json",), (f"{tmp_path}/cpu/logs/kernels.log",)),
        JobFinished("0", "kernels", 2, 2),
    ]


def test_a_start_is_reported_at_its_jobid_line_not_when_the_job_ends(tmp_path):
    # Snakemake prints nothing more until the job ends: waiting for the record to close would delay "started".
    lines = _recorded("run.log", tmp_path)
    first_jobid = next(i for i, line in enumerate(lines) if line.startswith("    jobid:"))
    log = SnakemakeLog()
    events = [event for line in lines[:first_jobid + 1] for event in log.feed(line)]
    assert [type(e) for e in events] == [JobStarted]


def test_events_of_a_failed_stage(tmp_path):
    events = _events(_recorded("kernels-failed.log", tmp_path))
    assert events == [
        JobStarted("0", "kernels", (f"{tmp_path}/cpu/kernels/result.json",), (f"{tmp_path}/cpu/logs/kernels.log",)),
        JobFailed("0", "kernels", (f"{tmp_path}/cpu/logs/kernels.log",)),
    ]


def test_the_plan_of_a_dry_run(tmp_path):
    log = SnakemakeLog()
    for line in _recorded("dry-run.log", tmp_path):
        log.feed(line)
    assert log.job_counts == {"sources": 1, "kernels": 1}
    assert log.reasons == {"input files updated by another job": "kernels",
                           "output files have to be generated": "kernels, sources"}


# --- the console lines for recorded output ----------------------------------------------------------------------

def test_console_of_a_real_run(tmp_path):
    _write_summary(tmp_path, "sources", 8, 0, 0, cpu_s=12.4)
    _write_summary(tmp_path, "kernels", 5, 0, 4)   # a result written before CPU seconds were kept: none shown
    assert _replay("run.log", tmp_path, 0) == [
        f"[kmesh] pipeline: Snakemake's full log -> {tmp_path}/cpu/logs/snakemake.log",
        "[kmesh] sources        started",
        "[kmesh] sources        ok      8 passed, 0 failed, 0 skipped       1.0 s     12 CPU-s  [1/2]",
        "[kmesh] kernels        started",
        "[kmesh] kernels        ok      5 passed, 0 failed, 4 skipped       1.0 s               [2/2]",
        f"[kmesh] pipeline ok: 2 stages ran in 5.0 s (full log {tmp_path}/cpu/logs/snakemake.log)",
    ]


def test_console_of_a_failed_stage_names_it_and_its_log(tmp_path):
    # Snakemake deletes a failed job's result.json: the counts come from the summary line in the stage's log.
    stage_log = tmp_path / "cpu" / "logs" / "kernels.log"
    stage_log.parent.mkdir(parents=True)
    stage_log.write_text((DATA / "kernels-failed.stage.log").read_text().replace(PLACEHOLDER, str(tmp_path)))
    lines = _replay("kernels-failed.log", tmp_path, 1)
    assert lines == [
        f"[kmesh] pipeline: Snakemake's full log -> {tmp_path}/cpu/logs/snakemake.log",
        "[kmesh] kernels        started",
        f"[kmesh] kernels        FAILED  1 passed, 4 failed, 4 skipped       1.0 s  log {stage_log}",
        "[kmesh]   first failure: compile:blake3: nvcc_ok, cubin_written",
        f"[kmesh] pipeline FAILED after 3.0 s (exit 1): kernels, log {stage_log} "
        f"(full log {tmp_path}/cpu/logs/snakemake.log)",
    ]
    assert max(_lines_per_stage(lines).values()) <= 3


def test_a_stage_that_crashed_shows_its_last_log_line(tmp_path):
    stage_log = tmp_path / "cpu" / "logs" / "kernels.log"
    stage_log.parent.mkdir(parents=True)
    stage_log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\nStageError: no kernels/\n\n")
    lines = _replay("kernels-failed.log", tmp_path, 1)
    assert "[kmesh] kernels        FAILED  no result" in lines[2] and lines[2].endswith(f"log {stage_log}")
    assert lines[3] == "[kmesh]   last log line: StageError: no kernels/"


def test_console_of_a_dry_run_is_the_plan(tmp_path):
    assert _replay("dry-run.log", tmp_path, 0, dry_run=True) == [
        f"[kmesh] dry run: Snakemake's full log -> {tmp_path}/cpu/logs/snakemake-dry-run.log",
        "[kmesh] dry run: 2 jobs would run: sources, kernels",
        "[kmesh]   input files updated by another job: kernels",
        "[kmesh]   output files have to be generated: kernels, sources",
    ]


def test_console_when_nothing_is_to_be_done(tmp_path):
    assert _replay("nothing-to-do.log", tmp_path, 0)[1:] == [
        f"[kmesh] nothing to be done: every requested file is up to date "
        f"(full log {tmp_path}/cpu/logs/snakemake.log)"]


def test_console_of_a_config_error_shows_snakemakes_message(tmp_path):
    lines = _replay("bad-config.log", tmp_path, 1)
    # The recording names the checkout it ran in.
    assert re.fullmatch(r'\[kmesh\]   WorkflowError in file ".*/workflow/rules/common\.smk", line 6:', lines[1])
    assert lines[2:] == [
        "[kmesh]   Error validating config file.",
        "[kmesh]   ValidationError: 7 is not of type 'object'",
        f"[kmesh] pipeline FAILED: Snakemake exited 1 before any stage failed "
        f"(full log {tmp_path}/cpu/logs/snakemake.log)",
    ]


@pytest.mark.parametrize("seconds, text", [(0.04, "0.0 s"), (7.06, "7.1 s"), (59.9, "59.9 s"), (130.4, "2 min 10 s"),
                                           (3725, "1 h 2 min")])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


# --- what Snakemake's parser says about the arguments ------------------------------------------------------------

@pytest.mark.parametrize("args, passthrough, dry_run", [
    (["--cores", "all"], False, False),
    (["--cores", "all", "-n"], False, True),
    (["--cores", "all", "-np"], False, True),
    (["--cores", "all", "--forcerun", "synthetic"], False, False),
    (["--cores", "all", "--dag"], True, False),          # the DOT text on stdout is the product
    (["--cores", "all", "--list-rules"], True, False),
    (["--cores", "all", "--summary"], True, False),
    (["--cores", "all", "--report", "report.html"], True, False),
    (["--cores", "all", "--report", "r.html", "--report-after-run"], False, False),
    (["-h"], True, False),
    (["--no-such-option"], True, False),                 # Snakemake says what is wrong itself
])
def test_invocation_kind(args, passthrough, dry_run):
    invocation = read_invocation(args)
    assert (invocation.passthrough, invocation.dry_run) == (passthrough, dry_run)


def test_log_lands_in_the_results_dir_and_profile_snakemake_uses(tmp_path):
    default = log_path(read_invocation(["--cores", "all"]))
    assert default == Path.cwd().resolve() / "results" / "cpu" / "logs" / "snakemake.log"
    cuda = log_path(read_invocation(["--cores", "all", "-n", "--config", f"results_dir={tmp_path}", "profile=cuda"]))
    assert cuda == tmp_path / "cuda" / "logs" / "snakemake-dry-run.log"
    extra = tmp_path / "extra.yaml"
    extra.write_text(f"results_dir: {tmp_path}/from-file\nprofile: cuda\n")
    from_file = read_invocation(["--cores", "all", "--configfile", str(extra), "--config", "profile=cpu"])
    assert log_path(from_file) == tmp_path / "from-file" / "cpu" / "logs" / "snakemake.log"   # --config wins


def test_an_unknown_profile_is_refused_before_a_folder_is_made_for_it(tmp_path):
    with pytest.raises(ConfigError, match="tpu"):
        log_path(read_invocation(["--cores", "all", "--config", f"results_dir={tmp_path}", "profile=tpu"]))
    assert not (tmp_path / "tpu").exists()


def test_an_unknown_profile_exits_2_before_snakemake_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kmesh.console.subprocess.Popen", lambda *a, **k: pytest.fail("Snakemake started"))
    assert cli.main(["pipeline", "--cores", "1", "--config", f"results_dir={tmp_path}", "profile=tpu"]) == 2
    assert "'tpu' is not one of" in capsys.readouterr().err


def test_a_product_mode_runs_snakemake_untouched(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr("kmesh.console.subprocess.run",
                        lambda cmd, **kwargs: ran.append((cmd, kwargs)) or subprocess.CompletedProcess(cmd, 0))
    assert cli.main(["pipeline", "--cores", "all", "--dag"]) == 0
    # its stdout is ours; env None: this process's (no executor plugin to put on the path)
    assert ran == [([sys.executable, "-m", "snakemake", "--cores", "all", "--dag"], {"env": None})]
    assert capsys.readouterr().out == ""


def test_cli_hands_every_argument_after_pipeline_to_snakemake(monkeypatch):
    seen = []
    monkeypatch.setattr("kmesh.console.run_pipeline", lambda args: seen.append(args) or 3)
    assert cli.main(["pipeline", "-n", "--config", "profile=cuda", "--", "target"]) == 3
    assert seen == [["-n", "--config", "profile=cuda", "--", "target"]]


@pytest.mark.parametrize(("make_args", "command"), [
    ([], "python -m kmesh pipeline --cores all"),
    (["PROFILE_OVERLAY=long"], "python -m kmesh pipeline --cores all --config overlay=long results_dir=results/long"),
    (["SNAKEMAKE_ARGS=-n"], "python -m kmesh pipeline --cores all -n")])
def test_make_pipeline_runs_the_console(make_args, command):
    """make's own dry run of the recipe: the console, and the long overlay into its own results dir."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "pipeline", *make_args], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert command in [" ".join(line.split()) for line in out.splitlines()], out


# --- end to end: the real pipeline on its fast stages -----------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return tmp_path_factory.mktemp("console-results")


def _pipeline(*args: str, path_prefix: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The stage jobs run `python -m kmesh run ...` from PATH: this interpreter and this checkout's sources.
    env["PATH"] = os.pathsep.join([*([str(path_prefix)] if path_prefix else []), str(Path(sys.executable).parent),
                                   env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kmesh", "pipeline", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow   # a real pipeline run (~12 s): make test-all; make test runs its whole pipeline through the console
def test_a_real_run_prints_a_few_lines_and_keeps_the_full_log(results):
    out = _pipeline("--cores", "1", "--config", f"results_dir={results}", "--", f"{results}/cpu/sources/result.json")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"[kmesh] pipeline: Snakemake's full log -> {results}/cpu/logs/snakemake.log"
    committed = stage_times.from_committed("cpu").get("sources")   # a fresh folder: the committed table's figure
    assert lines[1] == "[kmesh] sources        started" + (
        f"  expect ~{format_seconds(committed.wall_s)}, {committed.cases} cases (committed table at {committed.rev})"
        if committed else "")
    ok_line = r"\[kmesh\] sources        ok      \d+ passed, 0 failed, \d+ skipped +[\d.]+ s +\d+ CPU-s  \[1/1\]"
    assert re.fullmatch(ok_line, lines[2]), lines[2]
    assert lines[3].startswith("[kmesh] pipeline ok: 1 stage ran in ")
    assert len(lines) == 4 and _lines_per_stage(lines) == {"sources": 2}
    full = (results / "cpu" / "logs" / "snakemake.log").read_text()
    assert "localrule sources:" in full and "    input: " in full and "Finished jobid" in full
    assert "input:" not in out.stdout + out.stderr


def test_a_failed_stage_is_named_with_its_log_and_the_exit_status_propagates(results, tmp_path):
    # An nvcc that refuses every file: the kernels stage runs, writes its failed cases and exits 1.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvcc").write_text("#!/bin/sh\necho 'nvcc: refused for the test' >&2\nexit 1\n")
    (fake / "nvcc").chmod(0o755)
    out = _pipeline("--cores", "1", "--config", f"results_dir={results}", "--", f"{results}/cpu/kernels/result.json",
                    path_prefix=fake)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    stage_log = results / "cpu" / "logs" / "kernels.log"
    failed = [line for line in lines if line.startswith("[kmesh] kernels        FAILED")]
    assert len(failed) == 1 and re.search(r"\d+ passed, [1-9]\d* failed", failed[0]), lines
    assert failed[0].endswith(f"log {stage_log}") and stage_log.is_file()
    assert lines[-1].startswith("[kmesh] pipeline FAILED after ") and f"kernels, log {stage_log}" in lines[-1]
    assert max(_lines_per_stage(lines).values()) <= 3, lines


def test_a_dry_run_prints_the_plan(results):
    out = _pipeline("--cores", "1", "-n", "--forcerun", "sources", "--config", f"results_dir={results}", "--",
                    f"{results}/cpu/kernels/result.json")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "[kmesh] dry run: 2 jobs would run: sources, kernels", lines
    assert not any("started" in line for line in lines) and len(lines) < 10
    assert "This was a dry-run" in (results / "cpu" / "logs" / "snakemake-dry-run.log").read_text()




def test_a_running_stage_says_its_cases_done_of_the_expected_count(tmp_path):
    # and never "3/2": a stage that gained cases since its record says how many it had then
    log = tmp_path / "cpu" / "logs" / "peers.log"
    log.parent.mkdir(parents=True)
    out = io.StringIO()
    console = Console(out, ROOT, tmp_path / "snakemake.log", False, clock=SteppingClock(),
                      expected={"peers": stage_times.Expectation(wall_s=60.0, cases=2, source="last run here")})
    console.handle(JobStarted("0", "peers", (f"{tmp_path}/cpu/peers/result.json",), (str(log),)))
    progress = []
    for ended in (1, 3):
        log.write_text("".join(f"[kmesh] case {i + 1} passed: c{i} (1.0 s)\n" for i in range(ended))
                       + f"[kmesh] case {ended + 1} started: c{ended}\n")
        console.tick(every_s=0.0)
        progress.append(out.getvalue().splitlines()[-1])
    assert re.search(r"running  1/2 cases done, now c1  \d+\.\d s of ~1 min 0 s$", progress[0]), progress
    assert "running  3 cases done (of 2 when last recorded), now c3" in progress[1], progress
