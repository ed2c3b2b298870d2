"""`kmesh doctor` probes for real and prints a table; --json is machine-readable."""
import json
import subprocess
import sys

from kmesh.doctor import probe_io_uring, probe_o_direct


def _disagreements(caps: dict, facts: dict) -> list[str]:
    """Where the doctor's answers contradict what this machine has (today: only the shape is checked)."""
    return [name for name, p in caps.items() if not (p["ok"] in (True, False, None) and p["detail"])]


def _machine_facts(tmp_path) -> dict:
    return {}


def test_doctor_json_lists_every_capability(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kmesh", "doctor", "--json", "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=True)
    caps = json.loads(out.stdout)
    assert set(caps) == {"CUDA + GPU", "nvcc", "io_uring", "O_DIRECT (results dir)", "CUDA dma-buf export",
                         "cuFile (GDS)", "vLLM", "LMCache"}
    assert _disagreements(caps, _machine_facts(tmp_path)) == []


def test_a_doctor_answer_that_contradicts_the_machine_is_caught(tmp_path):
    """The check above must be able to fail: flip each yes/no answer and it must name that probe."""
    from kmesh.doctor import probe

    caps = probe(tmp_path)
    facts = _machine_facts(tmp_path)
    for name, p in caps.items():
        if p["ok"] is None:
            continue
        lying = {**caps, name: {**p, "ok": not p["ok"]}}
        assert name in _disagreements(lying, facts), f"a wrong answer for {name!r} went unnoticed"


def test_o_direct_probe_reads_back_what_it_wrote(tmp_path):
    p = probe_o_direct(tmp_path)
    # tmpfs refuses O_DIRECT; a disk-backed filesystem must round-trip the block exactly.
    assert p["ok"] is True or "Invalid argument" in p["detail"], p
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_io_uring_probe_answers():
    p = probe_io_uring()
    assert p["ok"] in (True, False) and "io_uring" in p["detail"]
