"""kmesh.reliability.crash: the service SIGKILLed while a client saves and loads, restarted over the same disk dir:
every save acknowledged `done` survives, every adopted object loads back as the bytes its key names, no temp file
is left (issue 26 item 3; the reliability stage runs the long form)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kmesh.reliability.crash import CrashSpec, _verify_all, run_crash
from kmesh.service import descriptor, process


@pytest.mark.covered_by_stage("reliability", "crash")
@pytest.mark.timeout(180)
def test_kills_during_saves_and_disk_reads_lose_nothing_acknowledged(tmp_path: Path):
    f = run_crash(CrashSpec(kills=3, max_delay_s=0.3, seed=5), tmp_path)
    assert f["kills"] == 3 and f["problems"] == []
    assert f["saves_acknowledged"] > 0 and f["durable_objects"] >= f["saves_acknowledged"]
    assert f["loads_after_restart_verified"] >= f["durable_objects"] and f["load_mismatches"] == 0
    assert f["files_rejected"] == 0


@pytest.mark.timeout(120)
def test_the_restart_check_sees_a_changed_byte_on_disk(tmp_path: Path):
    """The negative control: a payload byte flipped in one object file between runs must fail its load."""
    run_crash(CrashSpec(kills=1, max_delay_s=0.2, seed=6), tmp_path)
    files = sorted((tmp_path / "disk").glob("*.kmo"))
    assert files
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x01                               # in the payload (the header comes first)
    victim.write_bytes(bytes(data))
    n = descriptor.nbytes(descriptor.example(num_blocks=65536 // descriptor.nbytes(descriptor.example(1))))
    sp = process.start(tmp_path / "rt2", store_bytes=4 * n, disk_dir=tmp_path / "disk", adopt=True)
    try:
        with sp.admin_client(name="control") as adm:
            keys = [o["key"] for o in adm.status("all")["store"]["objects"]]
        bad = _verify_all(sp, keys, n)
    finally:
        sp.stop()
    want = bytes.fromhex(victim.name.split(".")[0]).hex()[:16]
    assert [b.split(":")[0] for b in bad] == [want]
