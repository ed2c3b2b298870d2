"""What the diagnostics share: the GPU check, CUDA-event timing, the options, the scaled workloads, the JSON output."""
from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from kmesh import provenance
from kmesh.config import PROFILES, Config, find_root, load_config, parse_overrides
from kmesh.diagnostics import DiagnosticError
from kmesh.harness.leader import Export
from kmesh.harness.modelsetup import ModelSetup
from kmesh.harness.workload import Child, Workload, build


def require_cuda(diagnostic: str) -> None:
    """Stop with a DiagnosticError naming the diagnostic unless torch sees a CUDA device."""
    if not torch.cuda.is_available():
        raise DiagnosticError(f"diagnostic {diagnostic} needs a CUDA GPU, and torch {torch.__version__} sees none "
                              f"(torch.cuda.is_available() is False)")


def timed(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median CUDA-event time of fn() in ms, after 3 warm-up calls (each timed call synchronises)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def parser(name: str, doc: str | None, *, config: bool = False, out: bool = False) -> argparse.ArgumentParser:
    """The diagnostic's argument parser; --help prints its whole docstring (what it measures, how to read it).
    config: --profile (default cuda) and --set KEY=VALUE, as `kmesh run` takes them; out: a required --out FILE."""
    made = argparse.ArgumentParser(prog=f"kmesh diagnose {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    if config:
        made.add_argument("--profile", choices=PROFILES, default="cuda", help="config profile (default cuda)")
        made.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    if out:
        made.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return made


def load(args: argparse.Namespace) -> Config:
    return load_config(profile=args.profile, overrides=parse_overrides(args.set))


@dataclass
class ScaledLeader:
    """The equivalence workload scaled to `prompt_tokens`, its leader's export and the child measured (A)."""

    prompt_tokens: int
    workload: Workload
    export: Export
    child: Child


def scaled_leaders(setup: ModelSetup, prompt_tokens: Iterable[int], tag: str) -> Iterator[ScaledLeader]:
    """For each prompt length in turn: the workload scaled to it, its leader prefilled and exported (object keys
    kmesh-eq/<tag>-<prompt_tokens>)."""
    for length in prompt_tokens:
        workload = build(setup.tok, setup.cfg.seed, setup.workload.spec.scaled(length))
        export = setup.export_leader(workload, f"kmesh-eq/{tag}-{length}".encode())
        yield ScaledLeader(length, workload, export, workload.children[0])


def write_json(path: Path, data: dict[str, Any], cfg: Config | None = None) -> None:
    """The diagnostic's JSON output, with its provenance (`provenance`: kmesh.provenance.collect of the config it
    ran on — code revision and tree digest, config, seed, pins, hardware; without a config, the code and hardware
    parts). NaN and inf are written as such (not refused): a diagnostic records what it saw, and a NaN difference
    is a finding."""
    if cfg is not None:
        prov = provenance.collect(cfg)
    else:
        prov = {"kmesh": {"version": provenance.dist_version("kmesh"), **provenance.git_revision(find_root())},
                "cpu": provenance.cpu_model(), "hostname": platform.node(), "argv": sys.argv,
                **provenance.torch_info()}
    prov["end"] = provenance.now()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "provenance": prov}, indent=1) + "\n")
    print(f"-> {path}", flush=True)
