"""load_many (kmesh.service.protocol): a child's segment loads in one request whose reply waits for the copies,
against a real cache service process; what it stops at (a refusal, an original being read back) and how
kmesh.kv.sources.ServiceSegments goes on from there."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kmesh.harness.leader import export_segments
from kmesh.harness.service import Harness
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import ByteTokenizer, RagSpec, build_rag
from kmesh.kv.load import prepare_staging, stage_entry
from kmesh.kv.sources import ServiceSegments
from kmesh.model.runner import LayerRunner
from tiny_llama import tiny_llama

SPEC = RagSpec(chunks=4, chunk_tokens=96, prompt_tokens=512, children=1, block_size=16, leader_preamble_tokens=16,
               min_restorable=0.7)


@pytest.fixture(scope="module")
def export():
    runner = LayerRunner(tiny_llama())
    w = build_rag(ByteTokenizer(300), 0, SPEC)
    cache = runner.new_cache(len(w.leader_ids), 16)
    runner.prefill(torch.tensor(w.leader_ids), cache)
    return export_segments(runner, cache, w, b"load-many")


def _items(export, replace=None):
    replace = replace or {}
    return [(replace.get(e.index, e.key), e.offset) for e in export.catalog.entries]


def _service(export, **kw):
    return ServiceSide(Harness(heartbeat_timeout_s=30.0, chunk_bytes=1 << 20, **kw), export, torch.device("cpu"))


def test_every_item_in_one_request_whose_reply_waits_for_the_copies(export):
    n = len(export.catalog.entries)
    with _service(export) as svc, svc.h:
        svc.save_leader()
        svc.unpace()
        with svc.staging("all") as st:
            st.tensor.fill_(0xA5)
            r = svc.client.load_many(st.reg, _items(export), wait_s=5.0)
            assert r["stopped_at"] is None and r["error"] is None and len(r["reqs"]) == n
            assert [j["req"] for j in r["jobs"]] == r["reqs"]
            want = [("done", e.nbytes) for e in export.catalog.entries]
            assert [(j["state"], j["nbytes"]) for j in r["jobs"]] == want
            assert torch.equal(st.tensor[:export.catalog.nbytes], export.raw)
        assert svc.no_leaks(), svc.leaks()


def test_the_batch_stops_at_the_first_refusal_and_requests_nothing_after_it(export):
    with _service(export) as svc, svc.h:
        svc.save_leader()
        svc.unpace()
        with svc.staging("refused") as st:
            before = len(svc.client.list_all("requests"))
            r = svc.client.load_many(st.reg, _items(export, {1: b"no-such-object"}), wait_s=5.0)
            assert r["stopped_at"] == 1 and r["error"]["code"] == "object_missing" and len(r["reqs"]) == 1
            assert r["jobs"][0]["state"] == "done"
            assert len(svc.client.list_all("requests")) == before + 1      # items 2 and 3 never requested
            # a client's own mistake is typed as load's (a stale generation: refused at item 0, not fatal)
            stale = dataclasses.replace(st.reg, gen=st.reg.gen + 7)
            r = svc.client.load_many(stale, _items(export), wait_s=1.0)
            assert r["stopped_at"] == 0 and r["reqs"] == [] and r["error"]["code"] == "stale_generation"
            assert svc.client.ping()["pong"]
        assert svc.no_leaks(), svc.leaks()


def test_without_waiting_it_answers_at_once_and_a_timeout_answers_with_the_copies_as_they_stand(export):
    n = len(export.catalog.entries)
    with _service(export) as svc, svc.h:
        svc.save_leader()                      # the gate stays closed: an accepted copy moves nothing yet
        try:
            with svc.staging("paced") as st:
                r = svc.client.load_many(st.reg, _items(export), wait_s=0.0)
                assert {j["state"] for j in r["jobs"]} == {"running"} and len(r["reqs"]) == n
                again = svc.client.load_many(st.reg, [(export.catalog.entries[0].key, 0)], wait_s=0.3)
                assert again["stopped_at"] == 0 and again["error"]["code"] == "busy"   # its range is taken
                for req, e in zip(r["reqs"], export.catalog.entries):
                    svc.after_accept(req, e.nbytes)
                assert all(svc.client.wait(req)["state"] == "done" for req in r["reqs"])
            with svc.staging("timed-out") as st:
                t0 = time.monotonic()
                r = svc.client.load_many(st.reg, _items(export), wait_s=0.3)    # parked, answered at its timeout
                assert time.monotonic() - t0 >= 0.25 and {j["state"] for j in r["jobs"]} == {"running"}
                for req, e in zip(r["reqs"], export.catalog.entries):
                    svc.after_accept(req, e.nbytes)
                assert all(svc.client.wait(req)["state"] == "done" for req in r["reqs"])
        finally:
            svc.unpace()                       # on a failure, let every copy end so the staging can close
        assert svc.no_leaks(), svc.leaks()


def _staged_through_segments(svc, st, export) -> list[str]:
    """Every entry staged through ServiceSegments (prefetch, then each in order; checked on arrival); the ops of
    the client's calls meanwhile."""
    ops: list[str] = []
    call = svc.client.call
    svc.client.call = lambda op, *a, **k: (ops.append(op), call(op, *a, **k))[1]
    try:
        src = ServiceSegments(svc.client, st.reg)
        prepare_staging(st.tensor, export.catalog)
        src.prefetch(export.catalog.entries)
        for e in export.catalog.entries:
            stage_entry(src, st.tensor, e)
    finally:
        svc.client.call = call
    assert torch.equal(st.tensor[:export.catalog.nbytes], export.raw)
    return ops


def test_an_original_being_read_back_ends_the_batch_and_service_segments_load_the_rest_one_by_one(export, tmp_path):
    entries = export.catalog.entries
    with _service(export, disk_dir=tmp_path / "disk") as svc, svc.h:
        svc.save_leader()
        svc.unpace()
        assert svc.h.admin.evict(entries[2].key, tier="ram")["evicted"] == 1
        with svc.staging("cold") as st:
            r = svc.client.load_many(st.reg, _items(export), wait_s=5.0)
            assert r["stopped_at"] == 2 and r["error"] is None and len(r["reqs"]) == 2      # no error: it parks
            for req in r["reqs"]:
                svc.client.wait(req)
        with svc.staging("segments") as st:
            # the batch stops before entry 2 (no read-back starts for it): 2 and 3 are loaded one by one
            assert _staged_through_segments(svc, st, export) == ["load_many", "load", "load", "wait", "wait"]
        assert svc.h.admin.evict(entries[3].key, tier="ram")["evicted"] == 1
        with svc.staging("segments-cold") as st:
            # entry 2 was read back by the loads above (in RAM again): the batch of 3, then the cold one alone
            assert _staged_through_segments(svc, st, export) == ["load_many", "load", "wait"]
        assert svc.no_leaks(), svc.leaks()


def test_two_items_into_the_same_bytes_are_refused_as_one_after_the_other_would_be(export):
    """The batch's copies are accepted together, after every item's checks: an item whose destination overlaps an
    earlier item's of the same batch is refused (DestinationBusyError) as if the earlier had been accepted first,
    and the batch stops there; nothing pinned is left behind."""
    first = export.catalog.entries[0]
    with _service(export) as svc, svc.h:
        svc.save_leader()
        svc.unpace()
        with svc.staging("overlap") as st:
            r = svc.client.load_many(st.reg, [(first.key, first.offset), (first.key, first.offset),
                                              (export.catalog.entries[1].key, export.catalog.entries[1].offset)],
                                     wait_s=5.0)
            assert r["stopped_at"] == 1 and r["error"]["code"] == "busy" and len(r["reqs"]) == 1
            assert r["jobs"][0]["state"] == "done"
            assert torch.equal(st.tensor[first.offset:first.offset + first.nbytes],
                               export.raw[first.offset:first.offset + first.nbytes])
        st_now = svc.h.status()
        assert all(o["pins"] == 0 for o in st_now["store"]["objects"]), st_now["store"]["objects"]
        assert svc.no_leaks(), svc.leaks()
