"""kmesh.reliability.soak: client processes saving and loading content-addressed objects against one real service
whose RAM holds a quarter of the working set (a disk tier under it): every load verifies, nothing is refused, the
service ends with no registration, pin or extra fd left (issue 26 item 1; the stage runs the long form)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kmesh.reliability.soak import SoakSpec, content, key_of, run_soak


def test_content_is_deterministic_and_keyed_by_its_digest():
    a, b = content(1, 5, 4096), content(1, 6, 4096)
    assert a == content(1, 5, 4096) and a != b and len(a) == 4096 and key_of(a) != key_of(b)


@pytest.mark.covered_by_stage("reliability", "soak")
@pytest.mark.timeout(120)
def test_a_short_soak_under_memory_pressure_loses_nothing(tmp_path: Path):
    spec = SoakSpec(clients=2, seconds=3.0, object_bytes=65536, working_set=32, ram_objects=8, seed=3)
    f = run_soak(spec, tmp_path)
    assert f["client_failures"] == [] and f["service_alive"]
    assert f["ops"] > 50 and f["verified_loads"] > 25 and f["mismatches"] == 0
    assert f["loads"].get("done", 0) == f["verified_loads"]
    assert f["refusals"] == {} and f["saves"].get("done", 0) >= 1
    counters = f["store_counters"]
    assert counters["lru_spilled"] > 0 and counters["disk_reads"] > 0 and counters["lru_refused"] == 0
    assert f["store_used_bytes"] <= f["store_capacity_bytes"] == 8 * f["object_bytes"]
    assert f["objects"] == f["saves"]["done"] and f["objects_wrong"] == [] and f["objects_rehashed"] >= 1
    assert f["registrations_left"] == 0 and f["clients_left"] == [] and f["pins_left"] == 0
    assert f["service_after"]["fds"] == f["service_before"]["fds"], (f["service_before"], f["service_after"])
    assert f["service_after"]["fd_targets"] == f["service_before"]["fd_targets"]
    assert f["service_after"]["memfd_mappings"] == f["service_before"]["memfd_mappings"] == 0
