"""Stage `kernels`: compile every kernels/*.cu for the configured target and, with a GPU, load it.

Outputs results/<profile>/kernels/<name>.cubin (what kmesh.cuda loads). Without nvcc the compile
cases are *skipped* with "no nvcc" — never passed, and no profile allows that skip, so the stage fails.
Load cases run only where CUDA is available (the cpu profile allows their skip: kernels.allow_skips).
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from kmesh.config import Config
from kmesh.result import Result

_KERNEL_NAME = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+(\w+)\s*\(')


def kernel_entry_points(source: str) -> list[str]:
    """Names of the extern "C" __global__ functions a .cu file defines (what a loader looks up)."""
    return _KERNEL_NAME.findall(source)


def nvcc_version(nvcc: str) -> str | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    match = re.search(r"release ([0-9.]+)", out.stdout)
    return match.group(1) if match else out.stdout.strip().splitlines()[-1:][0] if out.stdout else None


def compile_cubin(nvcc: str, gencode: str, src: Path, out: Path) -> dict[str, object]:
    """nvcc -cubin; returns the command, the ptxas resource report (its last lines), the entry functions ptxas
    compiled (all of them) and the return code."""
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", "-lineinfo", "-Xptxas", "-v", *shlex.split(gencode),
           str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return {"cmd": " ".join(cmd), "returncode": proc.returncode,
            "ptxas": [ln.strip() for ln in proc.stderr.splitlines() if "ptxas" in ln][-40:],
            "compiled_entry_functions": sorted(set(re.findall(r"Compiling entry function '(\w+)'", proc.stderr))),
            "stderr_tail": proc.stderr[-2000:] if proc.returncode else ""}


def run(cfg: Config) -> Result:
    res = Result.begin("kernels", cfg)
    sec = cfg.section("kernels")
    src_dir = cfg.path(sec["sources"])
    out_dir = cfg.stage_dir("kernels")
    nvcc = shutil.which(sec["nvcc"]) or (sec["nvcc"] if Path(sec["nvcc"]).is_file() else None)
    sources = sorted(src_dir.glob("*.cu"))
    res.extra["nvcc"] = nvcc
    res.extra["nvcc_version"] = nvcc_version(nvcc) if nvcc else None
    res.extra["gencode"] = sec["gencode"]

    with res.case("inventory", {"dir": str(src_dir)}) as case:
        case.record("sources", [s.name for s in sources])
        if not sources:
            case.skip(f"no kernels/*.cu in {src_dir}")
        case.check("every_source_has_entry_point",
                   all(kernel_entry_points(s.read_text()) for s in sources),
                   {s.name: kernel_entry_points(s.read_text()) for s in sources})

    cuda_ok = False
    try:
        import torch

        cuda_ok = torch.cuda.is_available()
    except ImportError:
        pass

    for src in sources:
        cubin = out_dir / f"{src.stem}.cubin"
        with res.case(f"compile:{src.stem}", {"source": src.name, "gencode": sec["gencode"]}) as case:
            if nvcc is None:
                case.skip(f"no nvcc ({sec['nvcc']!r} not found on PATH)")
            cubin.unlink(missing_ok=True)  # a stale cubin must never pass for a fresh one
            info = compile_cubin(nvcc, sec["gencode"], src, cubin)
            case.record("build", info)
            case.check("nvcc_ok", info["returncode"] == 0, info["stderr_tail"] or None)
            case.check("cubin_written", cubin.is_file() and cubin.stat().st_size > 0,
                       cubin.stat().st_size if cubin.is_file() else None)
            # every entry point the source declares is one ptxas compiled (none dropped by the preprocessor)
            missing = sorted(set(kernel_entry_points(src.read_text())) - set(info["compiled_entry_functions"]))
            case.check("ptxas_compiled_every_entry_point", not missing,
                       {"missing": missing, "compiled": len(info["compiled_entry_functions"])})
        with res.case(f"load:{src.stem}", {"cubin": str(cubin)}) as case:
            if cfg.profile != "cuda" or not cuda_ok:
                case.skip("no CUDA device in this profile/machine: compiled only")
            if not cubin.is_file():
                raise FileNotFoundError(f"{cubin} was not built")
            import cupy

            module = cupy.RawModule(path=str(cubin))
            names = kernel_entry_points(src.read_text())
            found = {}
            for name in names:
                try:
                    module.get_function(name)
                    found[name] = True
                except Exception as e:  # report which symbol is missing, keep checking the rest
                    found[name] = f"{type(e).__name__}: {e}"
            case.check("entry_points_load", all(v is True for v in found.values()), found)
    return res
