"""requirements/<profile>.lock from its .in (kmesh.devtools.lock): pip's dry-run report made into hash pins, and
`--keep`, which resolves with the lock's own pins as constraints so that adding a package moves nothing else."""
from __future__ import annotations

import json
from pathlib import Path

from kmesh.devtools import lock

A, B = "a" * 64, "b" * 64


def _fake_pip(seen: dict):
    def run(cmd: list[str], check: bool) -> None:
        seen["constraints"] = Path(cmd[cmd.index("-c") + 1]).read_text() if "-c" in cmd else None
        report = Path(cmd[cmd.index("--report") + 1])
        report.write_text(json.dumps({"install": [
            {"metadata": {"name": name, "version": version},
             "download_info": {"archive_info": {"hashes": {"sha256": sha}}}}
            for name, version, sha in (("Beta_Pkg", "2.0", B), ("alpha", "1.0", A), ("pip", "26.0", A))]}))
    return run


def test_keep_resolves_within_the_locks_own_pins_and_adds_what_the_in_file_added(tmp_path, monkeypatch):
    req = tmp_path / "requirements"
    req.mkdir()
    (req / "cpu.in").write_text("alpha\nbeta-pkg\n")
    (req / "cpu.lock").write_text(f"# generated\nalpha==1.0 --hash=sha256:{A}\n")
    seen: dict = {}
    monkeypatch.setattr(lock.subprocess, "run", _fake_pip(seen))
    lock.write_lock("cpu", tmp_path, keep=True)
    assert seen["constraints"] == "alpha==1.0\n"
    pins = [line for line in (req / "cpu.lock").read_text().splitlines() if not line.startswith("#")]
    assert pins == [f"alpha==1.0 --hash=sha256:{A}", f"beta-pkg==2.0 --hash=sha256:{B}"]   # sorted, no pip
    lock.write_lock("cpu", tmp_path)                 # without --keep nothing constrains the resolution
    assert seen["constraints"] is None


def test_main_reads_keep_anywhere_among_its_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(lock, "write_lock", lambda profile, root, keep=False: calls.append((profile, keep)))
    monkeypatch.setattr(lock, "find_root", lambda: Path("."))
    lock.main(["--keep", "cpu"])
    lock.main(["mutation"])
    assert calls == [("cpu", True), ("mutation", False)]
