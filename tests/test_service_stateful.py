"""kmesh.reliability.fuzz (issue 26 item 2): valid request sequences from 3 clients of one real service, every reply
checked against the ownership model; the CI size (40 sequences of up to 50 steps) must reach every outcome kind the
rules name. KMESH_FUZZ_EXAMPLES / KMESH_FUZZ_STEPS give the long form (the reliability stage's)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kmesh.reliability import fuzz
from kmesh.service import process

EXAMPLES = int(os.environ.get("KMESH_FUZZ_EXAMPLES", "40"))
STEPS = int(os.environ.get("KMESH_FUZZ_STEPS", "50"))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    sp = process.start(Path(tmp_path_factory.mktemp("fuzz")) / "rt", store_bytes=512 * fuzz.N, heartbeat_timeout_s=60.0)
    yield sp
    sp.stop()


@pytest.mark.covered_by_stage("reliability", "fuzz")
@pytest.mark.timeout(max(900, EXAMPLES * STEPS // 10))   # the long form scales it
def test_valid_request_sequences_follow_the_ownership_model(service):
    counts = fuzz.run_fuzz(service, EXAMPLES, STEPS, seed=20261202)
    print(f"fuzz: {counts['batches']} x {EXAMPLES} sequences, {sum(counts.values()) - counts['batches']} checked "
          f"steps: {dict(sorted(counts.items()))}")
    assert not fuzz.MUST_REACH - set(counts), f"never reached: {sorted(fuzz.MUST_REACH - set(counts))}"
    assert service.alive()


def test_a_wrong_model_is_caught(service, monkeypatch):
    """The negative control: a model that forgets supersession (an older generation still takes work) diverges."""
    def forgetful(self, slot, r):
        c = self.clients[slot]
        if r.slot != slot or r.epoch != c.epoch:
            return fuzz.NotOwnerError
        return None if r.state in ("active", "superseded") else fuzz.RegistrationClosedError
    monkeypatch.setattr(fuzz.OwnershipMachine, "_refusal", forgetful)
    with pytest.raises(fuzz.FuzzDivergence, match="RegistrationClosedError"):
        fuzz.run_fuzz(service, EXAMPLES, STEPS, shrink=False, seed=20261202)


def test_batches_run_until_the_step_floor(service):
    """The long form's floor: batches go on until min_steps requests were made, each batch reported as it ends."""
    seen: list[dict] = []
    counts = fuzz.run_fuzz(service, 4, 10, seed=7, max_batches=1, min_steps=120, on_batch=seen.append)
    assert fuzz.steps_of(counts) >= 120
    assert [b["batch"] for b in seen] == list(range(1, counts["batches"] + 1)) and len(seen) >= 3
    assert seen[-1]["total_steps"] == fuzz.steps_of(counts) == sum(b["steps"] for b in seen)
    assert all(b["steps"] > 0 and b["seconds"] > 0 for b in seen)
    # the floor met and max_batches reached: no batch more (the caller checks the outcomes it lacks)
    assert fuzz.steps_of(counts) - seen[-1]["steps"] < 120
