"""The Kubernetes executor plugin, installed apart from the venv's import path, and the runs that need it.

Snakemake imports every executor plugin it can find when it starts, and the Kubernetes plugin imports the
`kubernetes` client with it, a large share of a short Snakemake run's CPU, paid by every Snakemake process
(docs/cluster.md has the figures). scripts/setup-env.sh therefore installs the plugin, pinned like everything else, into
KUBERNETES_PLUGIN_DIR; `kmesh pipeline` puts that folder on the path of a run that asks for the kubernetes executor,
by `--executor`/`-e` or through a profile whose config.yaml names it. Plain Snakemake: `PYTHONPATH=<that folder>`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

KUBERNETES_PLUGIN_DIR = Path(sys.prefix) / "opt" / "snakemake-kubernetes"
KUBERNETES = "kubernetes"
_PROFILE_FLAGS = ("--profile", "--workflow-profile")
_EXECUTOR_FLAGS = ("--executor", "-e")


def _values(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """The values given to `flags` in `args` (`--flag value` and `--flag=value`)."""
    found = []
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg in flags and i + 1 < len(args):
            found.append(args[i + 1])
        for flag in flags:
            if flag.startswith("--") and arg.startswith(flag + "="):
                found.append(arg.split("=", 1)[1])
    return found


def _profile_executor(profile: str, workdir: Path) -> str | None:
    """The `executor:` of a profile given as a folder (relative to `workdir` or absolute); None where unreadable."""
    folder = Path(profile) if Path(profile).is_absolute() else workdir / profile
    try:
        data = yaml.safe_load((folder / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return str(data.get("executor")) if isinstance(data, dict) and data.get("executor") else None


def asks_for_kubernetes(args: list[str], workdir: Path | None = None) -> bool:
    """Whether Snakemake with `args` would run on the kubernetes executor: `--executor kubernetes` (or `-e`), or a
    profile (`--profile`, `--workflow-profile`, $SNAKEMAKE_PROFILE) whose config.yaml says `executor: kubernetes`."""
    workdir = workdir or Path.cwd()
    if KUBERNETES in _values(args, _EXECUTOR_FLAGS):
        return True
    profiles = _values(args, _PROFILE_FLAGS)
    if os.environ.get("SNAKEMAKE_PROFILE"):
        profiles.append(os.environ["SNAKEMAKE_PROFILE"])
    return any(_profile_executor(p, workdir) == KUBERNETES for p in profiles)


def snakemake_env(args: list[str], workdir: Path | None = None) -> dict[str, str] | None:
    """The environment for a Snakemake process with `args`: this one's, with KUBERNETES_PLUGIN_DIR first on
    PYTHONPATH where the run asks for the kubernetes executor and the folder exists; None (inherit) otherwise."""
    if not (asks_for_kubernetes(args, workdir) and KUBERNETES_PLUGIN_DIR.is_dir()):
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(KUBERNETES_PLUGIN_DIR), env.get("PYTHONPATH")) if p)
    return env


def make_importable(args: list[str], workdir: Path | None = None) -> None:
    """Put KUBERNETES_PLUGIN_DIR on this process's sys.path where `args` ask for it (before Snakemake's argument
    parser collects the executor plugins it offers)."""
    if asks_for_kubernetes(args, workdir) and KUBERNETES_PLUGIN_DIR.is_dir() \
            and str(KUBERNETES_PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(KUBERNETES_PLUGIN_DIR))
