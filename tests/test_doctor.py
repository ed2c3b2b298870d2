"""`kmesh doctor` probes for real and prints a table; --json is machine-readable."""
import json
import subprocess
import sys

from kmesh.doctor import probe_io_uring, probe_o_direct


def test_doctor_json_lists_every_capability(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kmesh", "doctor", "--json", "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=True)
    caps = json.loads(out.stdout)
    assert set(caps) == {"CUDA + GPU", "nvcc", "io_uring", "O_DIRECT (results dir)", "CUDA dma-buf export",
                         "cuFile (GDS)", "vLLM", "LMCache"}
    for name, p in caps.items():
        assert p["ok"] in (True, False, None) and p["detail"], name


def test_o_direct_probe_reads_back_what_it_wrote(tmp_path):
    p = probe_o_direct(tmp_path)
    # tmpfs refuses O_DIRECT; a disk-backed filesystem must round-trip the block exactly.
    assert p["ok"] is True or "Invalid argument" in p["detail"], p
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_io_uring_probe_answers():
    p = probe_io_uring()
    assert p["ok"] in (True, False) and "io_uring" in p["detail"]
