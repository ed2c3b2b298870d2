"""kmesh.hostspeed: the host facts every recorded run of the two commands carries."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from kmesh import hostspeed


def test_measure_names_the_host_and_restores_torch_threads():
    before = torch.get_num_threads()
    m = hostspeed.measure()
    assert torch.get_num_threads() == before
    assert m["cores"] >= 1 and m["cpu"]
    for key in ("python_loop_s", "matmul_s"):
        assert math.isfinite(m[key]) and 0 < m[key] < 60, (key, m[key])
    assert m["avx512"] == any(f.startswith("avx512") for f in m["vector_flags"])


def test_the_line_says_what_the_facts_say():
    m = {"cpu": "X", "cores": 2, "avx512": False, "vector_flags": ["avx", "avx2"], "python_loop_s": 0.2,
         "matmul_s": 0.15}
    assert "without AVX-512" in hostspeed.line(m) and "0.200 s" in hostspeed.line(m) and "0.150 s" in hostspeed.line(m)
    assert "with AVX-512" in hostspeed.line({**m, "avx512": True})


def test_the_command_writes_the_facts(tmp_path):
    out = tmp_path / "host.json"
    run = subprocess.run([sys.executable, "-m", "kmesh", "host-speed", "--out", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    facts = json.loads(out.read_text())
    assert run.stdout.strip() == hostspeed.line(facts)
