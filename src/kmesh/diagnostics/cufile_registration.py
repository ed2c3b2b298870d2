"""Can cuFile register an O_DIRECT file here, by directory and file system (GPU machine with cuFile)?

Opens the cuFile driver, prints the mode kmesh.storage.cufile.detect classifies it as (mode, arm, whether reads go
direct, why), then for the working directory, /tmp, /dev/shm and $HOME registers (and deregisters) a small
O_DIRECT probe file with kmesh.storage.cufile.probe_registration.

Output, one line per directory: `<dir> <file system> registered`, or `<dir> <file system> FAILED <why>` with
cuFile's error and the ERROR lines cufile.log gained. The storage stage's direct arm can only run where a line reads
`registered`; where none does it falls back (storage.fallback_arms, docs/measurements/storage-h200/).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kmesh.diagnostics import DiagnosticError
from kmesh.diagnostics._common import parser, require_cuda
from kmesh.storage import cufile
from kmesh.storage.errors import RouteUnavailableError


def directories() -> list[Path]:
    return [Path.cwd(), Path("/tmp"), Path("/dev/shm"), Path.home()]


def file_system(directory: Path) -> str:
    """The file-system type stat(1) names for `directory` (e.g. ext4, overlayfs, tmpfs)."""
    out = subprocess.run(["stat", "-f", "-c", "%T", str(directory)], capture_output=True, text=True, check=False)
    return out.stdout.strip() or f"(stat failed: {out.stderr.strip()})"


def main(argv: list[str] | None = None) -> int:
    parser("cufile_registration", __doc__).parse_args(argv)
    require_cuda("cufile_registration")
    try:
        lib = cufile.load_lib()
    except RouteUnavailableError as e:
        raise DiagnosticError(f"diagnostic cufile_registration needs cuFile: {e}") from e
    mode = cufile.detect(lib)          # opens the driver; never raises (a driver that will not open is a Mode)
    if mode.mode is None:
        raise DiagnosticError(f"diagnostic cufile_registration: cuFile is unusable here: {mode.reason}")
    print("mode", mode.mode, "arm", mode.arm, "direct", mode.direct, "-", mode.reason, flush=True)
    for directory in directories():
        if not os.access(directory, os.W_OK):
            print(directory, "not writable: skipped", flush=True)
            continue
        why = cufile.probe_registration(lib, directory)
        print(directory, file_system(directory), "registered" if why is None else f"FAILED {why}", flush=True)
    return 0
