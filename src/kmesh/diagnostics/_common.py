"""What the diagnostics share: the GPU check, CUDA-event timing, the config options and the JSON output."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch

from kmesh.config import PROFILES, Config, load_config, parse_overrides
from kmesh.diagnostics import DiagnosticError


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


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The diagnostic's argument parser; --help prints its whole docstring (what it measures, how to read it)."""
    return argparse.ArgumentParser(prog=f"kmesh diagnose {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_config_options(parser: argparse.ArgumentParser, profile: str = "cuda") -> None:
    """--profile and --set KEY=VALUE, as `kmesh run` takes them."""
    parser.add_argument("--profile", choices=PROFILES, default=profile, help=f"config profile (default {profile})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")


def load(args: argparse.Namespace) -> Config:
    return load_config(profile=args.profile, overrides=parse_overrides(args.set))


def write_json(path: Path, data: Any) -> None:
    """The diagnostic's JSON output. NaN and inf are written as such (not refused): a diagnostic records what it
    saw, and a NaN difference is a finding."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"-> {path}", flush=True)
