"""What a child checks each segment with on arrival (kmesh.kv.digests.arrival_digest): the catalog names the algorithm,
the leader records the digest, stage_entry recomputes it where the staged bytes lie and refuses a changed byte.
blake3 is the `blake3` package's digest on the host (and kmesh.integrity.gpu's, equal to it, on a GPU)."""
from __future__ import annotations

import dataclasses
import hashlib

import blake3
import pytest
import torch

from kmesh.harness.leader import export_segments
from kmesh.kv.digests import arrival_digest
from kmesh.kv.errors import SegmentCorruptError, SegmentExportError
from kmesh.kv.load import stage_segments
from kmesh.kv.sources import InProcessSegments
from kmesh.model.runner import LayerRunner
from test_segments_unaligned import BS, PREFIX, unaligned_workload
from tiny_llama import tiny_llama


@pytest.fixture(scope="module")
def leader():
    runner = LayerRunner(tiny_llama())
    workload = unaligned_workload()
    cache = runner.new_cache(len(workload.leader_ids), BS)
    runner.prefill(torch.tensor(workload.leader_ids), cache)
    return runner, cache, workload


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_the_catalog_records_the_arrival_digest_of_every_object(leader, algorithm):
    export = export_segments(*leader, PREFIX, arrival=algorithm)
    for e in export.catalog.entries:
        data = export.raw[e.offset:e.offset + e.nbytes].numpy().tobytes()
        assert e.sha256 == hashlib.sha256(data).hexdigest()        # the service's commit digest either way
        ref = hashlib.sha256(data) if algorithm == "sha256" else blake3.blake3(data)
        assert e.arrival_algorithm == algorithm and e.arrival_hex == ref.hexdigest()
    assert [d["arrival"][0] for d in export.catalog.describe()["entries"]] == [algorithm] * 2


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_a_changed_byte_is_refused_on_arrival_by_the_catalogs_algorithm(leader, algorithm):
    export = export_segments(*leader, PREFIX, arrival=algorithm)
    staging = torch.empty(export.catalog.nbytes, dtype=torch.uint8)
    stage_segments(InProcessSegments(export), staging, export.catalog)       # intact: accepted
    objects = InProcessSegments(export).objects
    last = export.catalog.entries[-1]
    objects[last.key][last.nbytes // 2] ^= 0x01
    with pytest.raises(SegmentCorruptError, match=algorithm):
        stage_segments(InProcessSegments(export, objects), staging, export.catalog)


def test_a_sha256_arrival_is_the_entrys_one_sha256(leader):
    """One digest per object when the arrival check is sha256: a catalog whose sha256 is wrong fails on arrival."""
    export = export_segments(*leader, PREFIX)
    e = dataclasses.replace(export.catalog.entries[0], sha256="0" * 64)
    assert e.arrival_hex == "0" * 64


def test_unknown_arrival_algorithms_are_refused(leader):
    with pytest.raises(SegmentExportError, match="arrival digest"):
        export_segments(*leader, PREFIX, arrival="md5")
    with pytest.raises(SegmentExportError):
        arrival_digest("crc32", torch.zeros(4, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_blake3_on_the_gpu_equals_the_package(leader):
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert arrival_digest("blake3", data.cuda()) == blake3.blake3(data.numpy().tobytes()).hexdigest()


def test_every_export_of_a_setup_uses_its_arrival_digest(leader):
    """The TTFT cases export a leader per prompt length: each must record the stage's arrival digest (on the H200
    run they recorded sha256 while the stage's own export recorded blake3, and every child hashed on the host)."""
    from kmesh.harness.modelsetup import ModelSetup

    runner, cache, workload = leader
    setup = ModelSetup(None, {}, torch.device("cpu"), None, "tiny", None, runner, workload,
                       export_segments(runner, cache, workload, PREFIX, arrival="blake3"), None)
    assert setup.arrival_digest == "blake3"
    other = setup.export_leader(workload, b"kmesh-test/other")
    assert {e.arrival_algorithm for e in other.catalog.entries} == {"blake3"}
