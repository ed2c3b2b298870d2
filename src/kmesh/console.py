"""`python -m kmesh pipeline [snakemake args]` (what `make pipeline` runs): Snakemake with a readable console.

Snakemake prints every job with all its inputs, and each stage lists dozens of code files. This runs Snakemake as
a child process, writes everything it prints to `<results_dir>/<profile>/logs/snakemake.log` (a dry run:
`snakemake-dry-run.log`), follows that text line by line and prints at most three lines per stage:

    [kmesh] sources        started  expect ~7 s, 8 cases (last run here)
    [kmesh] equivalence    running  12/24 cases done, now rag-quality   1 min 30 s of ~2 min 50 s
    [kmesh] sources        ok      8 passed, 0 failed, 0 skipped       7.1 s      6 CPU-s  [1/2]
    [kmesh] kernels        FAILED  1 passed, 4 failed, 4 skipped       3.0 s  log results/cpu/logs/kernels.log
    [kmesh]   first failure: compile:blake3: nvcc_ok, cubin_written

and one closing line. A start line says what the stage is expected to take (kmesh.stage_times: the last run's record
in the same results folder, else the committed table); while a stage runs, a line every PROGRESS_EVERY_S seconds
says how many of its cases are done (the case lines `kmesh run` prints to the stage's log, kmesh.result). The counts
of a finished stage come from its result.json summary, its CPU seconds (its own
and its reaped children's) from the result's provenance; Snakemake deletes the
outputs of a failed job, so a failed stage's counts come from the summary line `kmesh run` wrote to its log.
Snakemake's own exit status is returned.

Invocations whose output is the product (--dag, --lint, --summary, --list-changes, --help, ...) run Snakemake
untouched. Which kind an invocation is, whether it is a dry run, and which config files and --config values it
carries are read with Snakemake's own argument parser, so profiles and abbreviations count as Snakemake counts them.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from kmesh.errors import ConfigError
from kmesh.executors import make_importable, snakemake_env
from kmesh.stage_times import Expectation, expectations

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
TAG = "[kmesh]"
RULE_WIDTH = 13  # the longest stage name (restore_bench), so the status column lines up

# Snakemake's argparse attributes of the invocations that print something other than a run (their output is what
# the caller asked for, e.g. `--dag | dot`), taken from the branches of snakemake.cli.args_to_api (9.27).
PRODUCT_MODES = (
    "lint", "list_target_rules", "list_rules", "print_compilation", "export_cwl", "containerize",
    "generate_unit_tests", "dag", "rulegraph", "filegraph", "d3dag", "unlock", "cleanup_metadata",
    "conda_cleanup_envs", "conda_create_envs_only", "list_conda_envs", "cleanup_shadow", "container_cleanup_images",
    "list_changes", "list_input_changes", "list_params_changes", "list_untracked", "summary", "detailed_summary",
    "archive", "delete_all_output", "delete_temp_output",
)

# The lines of Snakemake's text log this follows (snakemake/logging.py and scheduling/job_scheduler.py, 9.27).
JOB_HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (?P<rule>[\w.-]+):$")
ERROR_HEADER = re.compile(r"^Error in rule (?P<rule>[\w.-]+):$")
ATTRIBUTE = re.compile(r"^    (?P<key>[\w-]+): (?P<value>.*)$")
FINISHED = re.compile(r"^Finished job(?:id)?:? (?P<jobid>\d+)(?:\.| \(Rule: (?P<rule>[\w.-]+)\))?")
PROGRESS = re.compile(r"^(?P<done>\d+) of (?P<total>\d+) steps \([^)]*\) done$")
STATS_ROW = re.compile(r"^(?P<rule>[\w.-]+)\s+(?P<count>\d+)$")
TIMESTAMP = re.compile(r"^\[\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\]$")
# A Python exception Snakemake reports outside any job ("MissingRuleException:", "WorkflowError in file ...").
EXCEPTION = re.compile(r"^[A-Za-z_]\w*(?:Error|Exception)\b.*:")
LOG_SUFFIX = " (check log file(s) for error details)"
# What `kmesh run` prints first and for each failed case (kmesh.cli.cmd_run).
STAGE_SUMMARY = re.compile(r"^\[kmesh\] \S+ \(\S+\): (?P<passed>\d+) passed, (?P<failed>\d+) failed, "
                           r"(?P<skipped>\d+) skipped")
STAGE_FAILURE = re.compile(r"^\[kmesh\]\s+FAILED (?P<what>.+)$")
# What a stage prints as each case starts and ends (kmesh.result.CASE_STARTED / CASE_ENDED).
CASE_STARTED = re.compile(r"^\[kmesh\] case (?P<number>\d+) started: (?P<id>.+)$")
CASE_ENDED = re.compile(r"^\[kmesh\] case (?P<number>\d+) (?:passed|failed|skipped): (?P<id>.+) \(")
PROGRESS_EVERY_S = 30.0   # a running stage's progress line at least this often


@dataclass(frozen=True)
class JobStarted:
    jobid: str
    rule: str
    outputs: tuple[str, ...]
    logs: tuple[str, ...]


@dataclass(frozen=True)
class JobFinished:
    jobid: str
    rule: str
    done: int | None = None   # Snakemake's "k of n steps done" that followed, where it did
    total: int | None = None


@dataclass(frozen=True)
class JobFailed:
    jobid: str
    rule: str
    logs: tuple[str, ...]


Event = JobStarted | JobFinished | JobFailed


@dataclass
class _Block:
    """An indented record being read: a job ("rule X:") or a job's error ("Error in rule X:")."""

    kind: str
    rule: str
    attributes: dict[str, str] = field(default_factory=dict)


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v for v in (value or "").split(", ") if v)


class SnakemakeLog:
    """Reads Snakemake's text log one line at a time; `feed` returns the job events each line completes.

    Besides the events it keeps what a closing line needs: the first job-stats table (the plan), the reasons of a
    dry run, whether there was nothing to do, and the first lines of each exception reported outside a job.
    """

    def __init__(self) -> None:
        self.job_counts: dict[str, int] = {}
        self.reasons: dict[str, str] = {}
        self.nothing_to_do = False
        self.exceptions: list[list[str]] = []
        self.tail: list[str] = []
        self._block: _Block | None = None
        self._finished: JobFinished | None = None  # held for one line: a progress line may follow
        self._section: str | None = None           # "stats" | "reasons" | "exception" | None
        self._reason: str | None = None
        self._stats_done = False
        self._rules: dict[str, str] = {}           # jobid -> rule

    def feed(self, line: str) -> list[Event]:
        line = line.rstrip("\r\n")
        if line.strip():
            self.tail = (self.tail + [line])[-5:]
        events: list[Event] = []
        if self._finished is not None:
            finished, self._finished = self._finished, None
            match = PROGRESS.match(line)
            if match:
                return [JobFinished(finished.jobid, finished.rule, int(match["done"]), int(match["total"]))]
            events.append(finished)
        if self._block is not None:
            if self._block_goes_on(line, events):
                return events
            events.extend(self._close_block())
        if self._section is not None and self._section_goes_on(line):
            return events
        self._section = None
        self._start(line)
        return events

    def close(self) -> list[Event]:
        """The events the last lines left pending (call at the end of the output)."""
        events: list[Event] = []
        if self._finished is not None:
            events.append(self._finished)
            self._finished = None
        if self._block is not None:
            events.extend(self._close_block())
        return events

    def _start(self, line: str) -> None:
        for pattern, kind in ((JOB_HEADER, "job"), (ERROR_HEADER, "error")):
            match = pattern.match(line)
            if match:
                self._block = _Block(kind, match["rule"])
                return
        match = FINISHED.match(line)
        if match:
            jobid = match["jobid"]
            self._finished = JobFinished(jobid, match["rule"] or self._rules.get(jobid, "?"))
        elif line == "Job stats:":
            # A dry run prints the table again after the jobs; the first one is kept.
            self._section = "stats"
        elif line == "Reasons:":
            self._section = "reasons"
        elif line.startswith("Nothing to be done"):
            self.nothing_to_do = True
        elif EXCEPTION.match(line):
            self._section = "exception"
            self.exceptions.append([line])

    def _block_goes_on(self, line: str, events: list[Event]) -> bool:
        """Whether `line` is part of the open job or error record (and record it if so)."""
        assert self._block is not None
        match = ATTRIBUTE.match(line)
        if match:
            self._block.attributes.setdefault(match["key"], match["value"])
            if self._block.kind == "job" and match["key"] == "jobid":
                # Input, output and log come before the jobid; the rest may follow only when the job ends, so the
                # start is reported now.
                events.append(self._job_started(self._block))
            return True
        return line.startswith("        ")  # the continuation of an attribute (an error's shell command)

    def _section_goes_on(self, line: str) -> bool:
        """Whether `line` belongs to the section being read (and record it if so)."""
        if self._section == "stats":
            match = STATS_ROW.match(line)
            if match and match["rule"] != "total" and not self._stats_done:
                self.job_counts[match["rule"]] = int(match["count"])
            if match and match["rule"] == "total":
                self._stats_done = True
            return bool(match) or line.startswith(("job ", "---"))
        if self._section == "reasons":
            if not line.startswith("    "):
                return False
            if line.startswith("        ") and self._reason is not None:
                self.reasons[self._reason] = line.strip()
            elif not line.startswith("        "):
                category = line.strip()
                self._reason = category[:-1] if category.endswith(":") and not category.startswith("(") else None
            return True
        # An exception's message: its next non-empty lines, up to where a known record starts.
        if not line.strip() or any(p.match(line) for p in (JOB_HEADER, ERROR_HEADER, FINISHED, TIMESTAMP)):
            return False
        if len(self.exceptions[-1]) < 4:
            self.exceptions[-1].append(line)
        return True

    def _job_started(self, block: _Block) -> JobStarted:
        jobid = block.attributes["jobid"]
        self._rules[jobid] = block.rule
        return JobStarted(jobid, block.rule, _split(block.attributes.get("output")), self._logs(block))

    @staticmethod
    def _logs(block: _Block) -> tuple[str, ...]:
        return _split(block.attributes.get("log", "").removesuffix(LOG_SUFFIX))

    def _close_block(self) -> list[Event]:
        block, self._block = self._block, None
        assert block is not None
        jobid = block.attributes.get("jobid")
        if block.kind == "error" and jobid is not None:
            return [JobFailed(jobid, block.rule, self._logs(block))]
        return []


def case_progress(lines: list[str]) -> tuple[int, str | None]:
    """(cases ended, the case running now or None) from a stage's log lines."""
    done, current = 0, None
    for line in lines:
        ended = CASE_ENDED.match(line)
        if ended:
            done += 1
            current = None
            continue
        started = CASE_STARTED.match(line)
        if started:
            current = started["id"]
    return done, current


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def _counts(summary: dict[str, Any]) -> str:
    return f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped"


def _cpu_seconds(result: dict[str, Any] | None) -> float | None:
    """The stage's CPU seconds from its result's provenance (None for a result written before they were kept)."""
    try:
        return float(result["provenance"]["resources"]["cpu_s"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _shorten(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


class Console:
    """Prints the compact lines for the events of one Snakemake run (the clock is a parameter for the tests)."""

    def __init__(self, out: TextIO, workdir: Path, log_path: Path, dry_run: bool,
                 clock: Callable[[], float] = time.monotonic,
                 expected: dict[str, Expectation] | None = None) -> None:
        self.out = out
        self.expected = dict(expected or {})
        self._lock = threading.RLock()   # the progress ticker reads the running jobs from its own thread
        self._last_line: dict[str, float] = {}
        self.workdir = workdir
        self.log_path = log_path
        self.dry_run = dry_run
        self.clock = clock
        self.started_at = clock()
        self.running: dict[str, tuple[JobStarted, float]] = {}
        self.finished: list[str] = []
        self.failed: list[tuple[str, Path | None]] = []

    def say(self, text: str) -> None:
        with self._lock:
            print(f"{TAG} {text}".rstrip(), file=self.out, flush=True)

    @staticmethod
    def shown(path: Path) -> str:
        """A path as the reader would type it: relative to the current directory where it lies inside it."""
        try:
            return str(path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(path)

    def begin(self) -> None:
        what = "dry run" if self.dry_run else "pipeline"
        self.say(f"{what}: Snakemake's full log -> {self.shown(self.log_path)}")

    def handle(self, event: Event) -> None:
        with self._lock:
            self._handle(event)

    def _handle(self, event: Event) -> None:
        if self.dry_run:
            return  # the jobs of a dry run are a plan; the closing lines summarise it
        if isinstance(event, JobStarted):
            now = self.clock()
            self.running[event.jobid] = (event, now)
            self._last_line[event.jobid] = now
            if event.outputs:  # a job without outputs (rule all) is only the target list
                e = self.expected.get(event.rule)
                hint = f"expect ~{format_seconds(e.wall_s)}, {e.cases} cases ({e.source})" if e else ""
                self.say(f"{event.rule:<{RULE_WIDTH}}  started  {hint}")
        elif isinstance(event, JobFinished):
            self._finished(event)
        elif isinstance(event, JobFailed):
            self._failed(event)

    def tick(self, every_s: float = PROGRESS_EVERY_S) -> None:
        """A progress line for each stage that has run `every_s` seconds since its last line: its cases done (of
        the expected count), the case it is in, its time so far (of the expected)."""
        if self.dry_run:
            return
        with self._lock:
            self._tick(every_s)

    def _tick(self, every_s: float) -> None:
        now = self.clock()
        for jobid, (job, t0) in list(self.running.items()):
            if not job.outputs or now - self._last_line.get(jobid, t0) < every_s:
                continue
            self._last_line[jobid] = now
            done, current = case_progress(_read_lines(self._path(job.logs[0]))) if job.logs else (0, None)
            e = self.expected.get(job.rule)
            count = f"{done}/{e.cases} cases done" if e and done <= e.cases else f"{done} cases done"
            if e and done > e.cases:   # the stage gained cases since the record the expectation comes from
                count += f" (of {e.cases} when last recorded)"
            now_in = f", now {current}" if current else ""
            took = format_seconds(now - t0) + (f" of ~{format_seconds(e.wall_s)}" if e else "")
            self.say(f"{job.rule:<{RULE_WIDTH}}  running  {count}{now_in}  {took}")

    def _finished(self, event: JobFinished) -> None:
        started, t0 = self.running.pop(event.jobid, (None, 0.0))
        if started is None or not started.outputs:
            return
        self.finished.append(event.rule)
        data = self._result_data(started)
        counts = _counts(data["summary"]) if data else ""
        cpu = _cpu_seconds(data)
        cpu_text = f"{cpu:>5.0f} CPU-s" if cpu is not None else ""
        steps = f"[{event.done}/{event.total}]" if event.done is not None else ""
        self.say(f"{event.rule:<{RULE_WIDTH}}  ok      {counts:<31} {format_seconds(self.clock() - t0):>9}  "
                 f"{cpu_text:>11}  {steps}")

    def _failed(self, event: JobFailed) -> None:
        started, t0 = self.running.pop(event.jobid, (None, None))
        log = self._path(event.logs[0]) if event.logs else None
        self.failed.append((event.rule, log))
        lines = _read_lines(log) if log else []
        summaries = [m for m in map(STAGE_SUMMARY.match, lines) if m]
        counts = _counts(summaries[-1].groupdict()) if summaries else "no result"
        where = f"log {self.shown(log)}" if log else "no log"
        took = format_seconds(self.clock() - t0) if t0 is not None else ""
        self.say(f"{event.rule:<{RULE_WIDTH}}  FAILED  {counts:<31} {took:>9}  {where}")
        failures = [m["what"] for m in map(STAGE_FAILURE.match, lines) if m]
        if failures:
            self.say(f"  first failure: {_shorten(failures[0])}")
        elif lines and any(line.strip() for line in lines):
            self.say(f"  last log line: {_shorten([line for line in lines if line.strip()][-1].strip())}")

    def _path(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() else self.workdir / path

    def _result_data(self, job: JobStarted) -> dict[str, Any] | None:
        for name in job.outputs:
            if name.endswith("/result.json") or name == "result.json":
                try:
                    data = json.loads(self._path(name).read_text())
                    _counts(data["summary"])
                    return data
                except (OSError, ValueError, KeyError, TypeError):
                    return None
        return None

    def end(self, log: SnakemakeLog, returncode: int) -> None:
        elapsed = format_seconds(self.clock() - self.started_at)
        full_log = f"full log {self.shown(self.log_path)}"
        if self.dry_run and returncode == 0:
            self._plan(log)
            return
        for started, _ in self.running.values():
            if started.outputs:  # Snakemake stopped while it ran (interrupted, or another job failed first)
                self.say(f"{started.rule:<{RULE_WIDTH}}  unfinished")
        if returncode == 0 and log.nothing_to_do:
            self.say(f"nothing to be done: every requested file is up to date ({full_log})")
        elif returncode == 0:
            jobs = len(self.finished)
            self.say(f"pipeline ok: {jobs} stage{'s' * (jobs != 1)} ran in {elapsed} ({full_log})")
        elif self.failed:
            names = "; ".join(f"{rule}, log {self.shown(path)}" if path else rule for rule, path in self.failed)
            self.say(f"pipeline FAILED after {elapsed} (exit {returncode}): {names} ({full_log})")
        else:
            # No job failed: Snakemake refused the workflow itself (a config error, an unknown target, a lock).
            reported = log.exceptions[0] if log.exceptions else log.tail[-3:]
            for line in reported:
                self.say(f"  {_shorten(line.strip())}")
            self.say(f"pipeline FAILED: Snakemake exited {returncode} before any stage failed ({full_log})")

    def _plan(self, log: SnakemakeLog) -> None:
        if log.nothing_to_do:
            self.say("dry run: nothing to be done, every requested file is up to date")
            return
        total = sum(log.job_counts.values())
        rules = ", ".join(rule if count == 1 else f"{rule} x{count}" for rule, count in log.job_counts.items())
        self.say(f"dry run: {total} job{'s' * (total != 1)} would run: {rules}")
        for reason, rules in log.reasons.items():
            self.say(f"  {reason}: {_shorten(rules)}")


@dataclass(frozen=True)
class Invocation:
    """What Snakemake will do with these arguments, as its own parser reads them."""

    passthrough: bool        # its output is the product (or the parser refused the arguments): run it untouched
    dry_run: bool = False
    workdir: Path = Path(".")
    configfiles: tuple[Path, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)


def read_invocation(args: list[str]) -> Invocation:
    # first: Snakemake collects the executor plugins it offers when its modules are imported (kmesh.executors)
    make_importable(args)
    try:
        from snakemake.cli import parse_args, parse_config
        from snakemake.exceptions import CliException
        from snakemake_interface_common.exceptions import WorkflowError
    except ImportError as e:
        raise ConfigError(f"snakemake is not installed in this environment ({e})") from e
    sink = io.StringIO()
    try:
        # The parser prints help, usage errors and "Using profile ..."; Snakemake itself says those again.
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            _, parsed = parse_args(args)
            config = parse_config(parsed.config)
    except (SystemExit, CliException, WorkflowError, ValueError, OSError):
        # --help, --version, a usage error, an unreadable profile: Snakemake says it (and exits as it does).
        return Invocation(passthrough=True)
    product = any(getattr(parsed, mode, None) not in (None, False) for mode in PRODUCT_MODES)
    if getattr(parsed, "report", None) is not None and not getattr(parsed, "report_after_run", False):
        product = True
    workdir = Path(parsed.directory) if parsed.directory else Path.cwd()
    return Invocation(passthrough=product, dry_run=bool(parsed.dryrun), workdir=workdir.resolve(),
                      configfiles=tuple(Path(p) for p in parsed.configfile or ()), config=config)


def pipeline_config(invocation: Invocation) -> dict[str, Any]:
    """The config Snakemake will see: config.yaml < --configfile < --config, merged as Snakemake merges them."""
    import yaml

    from kmesh.config import PROFILES, deep_merge

    data: dict[str, Any] = {}
    for path in (invocation.workdir / "config" / "config.yaml", *invocation.configfiles):
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue  # Snakemake reports a config file it cannot read; the log goes where the rest says
        if isinstance(loaded, dict):
            data = deep_merge(data, loaded)
    data = deep_merge(data, invocation.config)
    profile = data.get("profile", "cpu")
    if profile not in PROFILES:  # checked here so that no results/<typo>/ folder is made for the log
        raise ConfigError(f"config field 'profile': {profile!r} is not one of {list(PROFILES)}")
    return data


def results_root(invocation: Invocation, data: dict[str, Any]) -> Path:
    results = Path(str(data.get("results_dir", "results")))
    return results if results.is_absolute() else invocation.workdir / results


def log_path(invocation: Invocation) -> Path:
    """`<results_dir>/<profile>/logs/snakemake.log` of the config Snakemake will see."""
    data = pipeline_config(invocation)
    name = "snakemake-dry-run.log" if invocation.dry_run else "snakemake.log"
    return results_root(invocation, data) / data.get("profile", "cpu") / "logs" / name


def expected_times(invocation: Invocation) -> dict[str, Expectation]:
    """What each stage of this run is expected to take (read before Snakemake deletes the outputs it reruns)."""
    data = pipeline_config(invocation)
    overlays = [str(data["overlay"])] if data.get("overlay") else []
    return expectations(results_root(invocation, data), str(data.get("profile", "cpu")), overlays)


def run_pipeline(args: list[str], out: TextIO | None = None) -> int:
    """Run Snakemake with `args`; return its exit status."""
    out = out or sys.stdout
    invocation = read_invocation(args)
    if invocation.passthrough:
        return subprocess.run([*SNAKEMAKE, *args], env=snakemake_env(args)).returncode
    path = log_path(invocation)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Output paths in Snakemake's log are relative to its working directory.
    console = Console(out, invocation.workdir, path, invocation.dry_run, expected=expected_times(invocation))
    log = SnakemakeLog()
    console.begin()
    stop_ticks = threading.Event()

    def ticks() -> None:
        while not stop_ticks.wait(PROGRESS_EVERY_S / 6):
            console.tick()

    with path.open("w") as log_file:
        proc = subprocess.Popen([*SNAKEMAKE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, env=snakemake_env(args, invocation.workdir))
        threading.Thread(target=ticks, name="pipeline-progress", daemon=True).start()
        assert proc.stdout is not None
        interrupted = False
        while True:
            try:
                for line in proc.stdout:
                    log_file.write(line)
                    log_file.flush()  # `tail -f` on the log shows Snakemake's full output as it comes
                    for event in log.feed(line):
                        console.handle(event)
                break
            except KeyboardInterrupt:
                # Ctrl-C reached Snakemake too (same process group): follow it while it stops its jobs.
                if not interrupted:
                    console.say("interrupted: waiting for Snakemake to stop its jobs")
                interrupted = True
        for event in log.close():
            console.handle(event)
        returncode = proc.wait()
        stop_ticks.set()
    console.end(log, returncode)
    return returncode
