"""KMeshConnector's scheduler and worker sides against a real cache-service process, without a vLLM engine.

The engine tests (tests/test_vllm_connector.py, and the vllm stage's cases) need a ~60 s engine start each; these
drive the connector's own methods in the order vLLM calls them (scheduler: get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished; worker:
bind_connector_metadata, start_load_kv, save_kv_layer per layer, wait_for_save, get_block_ids_with_load_errors)
over small paged caches, so the save → record → lookup → fetch → verify → restore chain is checked in seconds,
against the source cache's own bytes, with a real service process, socket and shared memory in between.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kmesh.kv.keys import prefix_keys, record_key, segment_key, token_digest  # noqa: E402
from kmesh.kv.layout import KVLayout  # noqa: E402
from kmesh.kv.record import KIND_PREFIX, KIND_SEGMENT, RECORD_BYTES, Record  # noqa: E402
from kmesh.kv.restore import capture  # noqa: E402
from kmesh.kv.rope import RopeConfig  # noqa: E402
from kmesh.vllm import arrangement as arr  # noqa: E402
from kmesh.vllm.connector import KMeshConnector  # noqa: E402
from kmesh.vllm.plans import slots_of  # noqa: E402

BS = 4                 # tokens per block
BLOCKS = 12            # engine blocks per cache
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(scope="module")
def service():
    from kmesh.service import process

    rt = Path(tempfile.mkdtemp(prefix="kmesh-vw-"))          # short: socket path limit
    sp = process.start(rt / "svc", store_bytes=64 << 20)
    yield sp
    sp.stop()


def _config(extra: dict):
    """The parts of a VllmConfig the connector reads (float32: vLLM's CPU ISA vec, which KMesh addresses)."""
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                           model_config=SimpleNamespace(model="m", dtype=torch.float32, use_mla=False,
                                                        get_head_size=lambda: 8),
                           cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"))


def _extra(service, ns: str, **kw) -> dict:
    # every test its own namespace: objects of one test are never found by another's lookups
    return {"socket": str(service.socket_path), "staging_blocks": 4, "retry_s": 0.5, "namespace": ns, **kw}


def _scheduler(extra: dict) -> KMeshConnector:
    return KMeshConnector(_config(extra), KVConnectorRole.SCHEDULER)


def _worker(extra: dict, seed: int) -> KMeshConnector:
    """A worker over a paged cache of random contents: what register_kv_caches sets up, minus detecting a real
    engine's arrangement (tests/test_vllm_layout_contract.py checks that against vLLM's own caches)."""
    conn = KMeshConnector(_config(extra), KVConnectorRole.WORKER)
    layout = KVLayout.paged("LBNHC", len(LAYERS), BLOCKS, BS, 2, 8, "float32")
    raw = torch.randn(layout.nbytes // 4, generator=torch.Generator().manual_seed(seed)).view(torch.uint8)
    conn.engine = arr.EngineCache(raw, layout, LAYERS, "TEST")
    conn.rope = RopeConfig(8, 8, 10000.0, "neox", None, 4096)
    conn._block_bytes = arr.staging_layout(layout, 1).nbytes
    for name in ("load", "save", "records"):
        conn._window(name)
    return conn


def _request(rid: str, prompt: list[int], params: dict | None = None, save: dict | None = None):
    sp = SimpleNamespace(extra_args={"kv_transfer_params": save}) if save else None
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params, sampling_params=sp)


def _schedule(sched: KMeshConnector, req, block_ids: list[int]):
    """The scheduler's part of one step for one new request: (tokens KMesh supplies, the step's metadata)."""
    n, asynchronous = sched.get_num_new_matched_tokens(req, 0)
    assert asynchronous is False
    sched.update_state_after_alloc(req, None, n)
    new = SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids, num_computed_tokens=n,
                          sampling_params=req.sampling_params, block_ids=(block_ids,))
    meta = sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[new], num_scheduled_tokens={req.request_id: len(req.prompt_token_ids) - n}))
    return n, meta


def _execute(worker: KMeshConnector, meta) -> set[int]:
    """The worker's part of the step: load, the forward's per-layer saves, the save; the blocks that failed."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.save_kv_layer(name, None, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return worker.get_block_ids_with_load_errors()


def _kv(worker: KMeshConnector, block_ids: list[int], positions: range) -> torch.Tensor:
    pos = torch.tensor(list(positions))
    return _bytes(capture(worker.engine.raw, worker.engine.layout, slots_of(block_ids, pos, BS), pos))


def _bytes(seg) -> torch.Tensor:
    """A captured segment's K and V as one tensor (compared bit for bit: NaN-free random caches)."""
    return torch.cat([seg.k.flatten(), seg.v.flatten()])


def _finished(sched: KMeshConnector, req) -> dict:
    delay, params = sched.request_finished(req, [])
    assert delay is False
    return params["kmesh"]


def test_prefix_saved_then_loaded_into_other_blocks_bit_identical(service):
    extra = _extra(service, "w-prefix")
    sched, a, b = _scheduler(extra), _worker(extra, seed=1), _worker(extra, seed=2)
    prompt = [100 + i for i in range(2 * BS + 1)]                      # two whole blocks and one token
    req = _request("r1", prompt)
    n, meta = _schedule(sched, req, [3, 1, 0])
    assert n == 0 and not meta.loads and [len(s.items) for s in meta.saves] == [2]
    assert _execute(a, meta) == set() and a.stats["saved"] == 2
    rep = _finished(sched, req)
    assert rep["req_id"] == "r1" and rep["tokens_supplied"] == 0 and rep["saving"] == 2 and "block_ids" not in rep
    # what was stored: two prefix records vouching for their tokens and positions
    keys = prefix_keys(sched.ns, prompt, BS, 2)
    recs = [sched._read_record(k) for k in keys]
    assert [(r.kind, r.tokens, r.start) for r in recs] == [(KIND_PREFIX, BS, 0), (KIND_PREFIX, BS, BS)]
    assert recs[1].matches(KIND_PREFIX, prompt[BS:2 * BS], BS) and not recs[1].matches(KIND_PREFIX, prompt[:BS], BS)

    before = b.engine.raw.clone()
    req2 = _request("r2", prompt)
    n, meta = _schedule(sched, req2, [5, 2, 7])
    assert n == 2 * BS and [p.mode for p in meta.loads] == ["prefix"] and not meta.saves
    assert _execute(b, meta) == set() and b.stats["loaded_blocks"] == 2
    assert torch.equal(_kv(b, [5, 2, 7], range(2 * BS)), _kv(a, [3, 1, 0], range(2 * BS)))
    # nothing else of b's cache changed: every slot outside blocks 5 and 2 keeps its bytes
    slots = slots_of([5, 2], torch.arange(2 * BS), BS)
    others = torch.ones(BLOCKS * BS, dtype=torch.bool)
    others[slots] = False
    pos = torch.arange(BLOCKS * BS)[others]
    assert torch.equal(_bytes(capture(b.engine.raw, b.engine.layout, pos, pos)),
                       _bytes(capture(before, b.engine.layout, pos, pos)))
    rep = _finished(sched, req2)
    assert (rep["mode"], rep["tokens_supplied"], rep["stored_tokens"], rep["load_errors"]) == ("prefix", 8, 8, 0)


def test_a_prompt_of_whole_blocks_is_supplied_up_to_its_last_token(service):
    """The engine computes at least the last prompt token: of 2 whole stored blocks, 7 tokens are supplied and the
    last block is restored in its first 3 slots only (the engine writes the 4th)."""
    extra = _extra(service, "w-whole")
    sched, a, b = _scheduler(extra), _worker(extra, seed=3), _worker(extra, seed=4)
    prompt = [200 + i for i in range(2 * BS)]
    _execute(a, _schedule(sched, _request("s", prompt), [0, 1])[1])
    before = b.engine.raw.clone()
    n, meta = _schedule(sched, _request("l", prompt), [6, 4])
    assert n == 2 * BS - 1 and meta.loads[0].num_tokens == 2 * BS - 1
    _execute(b, meta)
    assert torch.equal(_kv(b, [6, 4], range(2 * BS - 1)), _kv(a, [0, 1], range(2 * BS - 1)))
    last = torch.tensor([2 * BS - 1])
    assert torch.equal(_kv(b, [6, 4], range(2 * BS - 1, 2 * BS)),
                       _bytes(capture(before, b.engine.layout, slots_of([6, 4], last, BS), last)))


def test_more_blocks_than_the_staging_window_in_chunks(service):
    """5 blocks through a 4-block window: the save skips what does not fit (a later request saves it: the lookup
    misses it), the load restores in two chunks."""
    extra = _extra(service, "w-chunks")
    sched, a, b = _scheduler(extra), _worker(extra, seed=5), _worker(extra, seed=6)
    prompt = [300 + i for i in range(5 * BS + 1)]
    ids_a = [9, 8, 7, 6, 5, 4]
    _execute(a, _schedule(sched, _request("s1", prompt), ids_a)[1])
    assert a.stats["saved"] == 4 and a.stats["save_skipped"] == 1
    n, meta = _schedule(sched, _request("s2", prompt), ids_a)
    assert n == 4 * BS and [it.start for s in meta.saves for it in s.items] == [4 * BS]
    _execute(a, meta)
    assert a.stats["saved"] == 5
    ids_b = [0, 2, 4, 6, 8, 10]
    n, meta = _schedule(sched, _request("l", prompt), ids_b)
    assert n == 5 * BS
    assert _execute(b, meta) == set() and b.stats["loaded_blocks"] == 5
    assert torch.equal(_kv(b, ids_b, range(5 * BS)), _kv(a, ids_a, range(5 * BS)))
    # a prompt of exactly those 5 blocks: supplied up to its last token, which the second chunk leaves to the engine
    c = _worker(extra, seed=22)
    before = c.engine.raw.clone()
    n, meta = _schedule(sched, _request("w", prompt[:5 * BS]), ids_b[:5])
    assert n == 5 * BS - 1 and _execute(c, meta) == set()
    assert torch.equal(_kv(c, ids_b, range(5 * BS - 1)), _kv(a, ids_a, range(5 * BS - 1)))
    last = torch.tensor([5 * BS - 1])
    assert torch.equal(_kv(c, ids_b, range(5 * BS - 1, 5 * BS)),
                       _bytes(capture(before, c.engine.layout, slots_of(ids_b, last, BS), last)))


def test_a_corrupt_payload_fails_its_blocks_and_the_report_says_so(service):
    """Block 1's payload does not match its record: block 0 is restored, blocks 1.. are reported failed (vLLM
    recomputes from there), keep their bytes, and the request's report counts them."""
    extra = _extra(service, "w-corrupt")
    sched, a, b = _scheduler(extra), _worker(extra, seed=7), _worker(extra, seed=8)
    prompt = [400 + i for i in range(3 * BS + 1)]
    keys = prefix_keys(sched.ns, prompt, BS, 3)
    _execute(a, _schedule(sched, _request("s", prompt[:BS + 1]), [0, 1])[1])       # block 0 only, honestly
    # blocks 1 and 2 stored as someone else would: random bytes under a record whose digest they do not match
    w = a._window("save")
    rw = a._window("records")
    for i in (1, 2):
        w.tensor[:a._block_bytes] = torch.randint(0, 256, (a._block_bytes,), dtype=torch.uint8)
        assert a.link.save(w, keys[i], 0, a._block_bytes)
        rec = Record(KIND_PREFIX, BS, i * BS, a._block_bytes, bytes(32), token_digest(prompt[i * BS:(i + 1) * BS]))
        rw.tensor[:RECORD_BYTES] = torch.frombuffer(bytearray(rec.pack()), dtype=torch.uint8)
        assert a.link.save(rw, record_key(keys[i]), 0, RECORD_BYTES)
    before = b.engine.raw.clone()
    ids = [11, 3, 5, 1]
    req = _request("l", prompt)
    n, meta = _schedule(sched, req, ids)
    assert n == 3 * BS
    failed = _execute(b, meta)
    assert failed == {3, 5} and b.stats["load_errors"] == 2 and b.stats["loaded_blocks"] == 1
    assert torch.equal(_kv(b, ids, range(BS)), _kv(a, [0, 1], range(BS)))
    assert torch.equal(_kv(b, ids, range(BS, 3 * BS)),
                       _bytes(capture(before, b.engine.layout, slots_of(ids, torch.arange(BS, 3 * BS), BS),
                                      torch.arange(BS, 3 * BS))))
    assert b.get_block_ids_with_load_errors() == set()              # reported once
    sched.update_connector_output(SimpleNamespace(invalid_block_ids=failed))
    rep = _finished(sched, req)
    assert (rep["tokens_supplied"], rep["load_errors"]) == (BS, 2)
    # the failed request's step saves nothing (its KV is not trusted)
    assert b.stats["saved"] == 0


def test_a_missing_payload_fails_from_that_block(service):
    extra = _extra(service, "w-missing")
    sched, b = _scheduler(extra), _worker(extra, seed=9)
    prompt = [500 + i for i in range(BS + 1)]
    key = prefix_keys(sched.ns, prompt, BS, 1)[0]
    rw = b._window("records")
    rec = Record(KIND_PREFIX, BS, 0, b._block_bytes, bytes(32), token_digest(prompt[:BS]))
    rw.tensor[:RECORD_BYTES] = torch.frombuffer(bytearray(rec.pack()), dtype=torch.uint8)
    assert b.link.save(rw, record_key(key), 0, RECORD_BYTES)          # a record whose payload was never stored
    n, meta = _schedule(sched, _request("l", prompt), [4, 2])
    assert n == BS
    assert _execute(b, meta) == {4} and b.stats["loaded_blocks"] == 0


def test_a_record_of_other_tokens_is_not_used(service):
    """A record under a prefix key whose token digest is another block's: the lookup stops there."""
    extra = _extra(service, "w-tokens")
    sched, b = _scheduler(extra), _worker(extra, seed=10)
    prompt = [600 + i for i in range(BS + 1)]
    key = prefix_keys(sched.ns, prompt, BS, 1)[0]
    rw = b._window("records")
    rec = Record(KIND_PREFIX, BS, 0, b._block_bytes, bytes(32), token_digest([1, 2, 3, 4]))
    rw.tensor[:RECORD_BYTES] = torch.frombuffer(bytearray(rec.pack()), dtype=torch.uint8)
    assert b.link.save(rw, record_key(key), 0, RECORD_BYTES)
    n, meta = _schedule(sched, _request("l", prompt), [0, 1])
    assert n == 0 and not meta.loads


def test_segments_saved_by_name_and_planned_for_interior_reuse(service):
    """kmesh_save_segments stores a segment record (kind segment, its own start); a request naming a span with
    those tokens elsewhere gets an interior plan over the prompt up to that span's end."""
    extra = _extra(service, "w-segments")
    sched, a = _scheduler(extra), _worker(extra, seed=11)
    seg = [700 + i for i in range(BS)]
    leader = [1, 2, 3, 4] + seg + [9]
    _, meta = _schedule(sched, _request("s", leader, save={"kmesh_save_segments": [[4, 8]]}), [0, 1, 2])
    assert [(it.start, it.tokens) for s in meta.saves for it in s.items] == [(4, tuple(seg))]
    _execute(a, meta)
    rec = sched._read_record(segment_key(sched.ns, seg))
    assert (rec.kind, rec.tokens, rec.start) == (KIND_SEGMENT, BS, 4)
    child = [5, 6, 7, 8, 10, 11, 12, 13] + seg + [14, 15]
    req = _request("c", child, params={"kmesh_segments": [[8, 12]]})
    n, meta = _schedule(sched, req, [3, 4, 5, 6])
    plan = meta.loads[0]
    assert (n, plan.mode, plan.num_tokens, plan.first) == (12, "interior", 12, 0)
    assert plan.span == tuple(child[:12]) and [it.start for it in plan.items] == [8] and plan.block_ids == [3, 4, 5, 6]
    rep = _finished(sched, req)
    assert (rep["mode"], rep["segments"], rep["stored_tokens"], rep["tokens_supplied"]) == ("interior", 1, 4, 12)
    # a span that ends the prompt is claimed up to the last token only (the engine computes that one)
    n, meta = _schedule(sched, _request("e", [5, 6, 7, 8] + seg, params={"kmesh_segments": [[4, 8]]}), [0, 1])
    assert n == 7 and meta.loads[0].num_tokens == 7
    # spans that are not sorted, disjoint and inside the prompt are ignored; unknown segments give no plan
    for bad in ([[8, 12], [4, 9]], [[8, 30]], "8-12", [[12, 8]]):
        assert _schedule(sched, _request("b", child, params={"kmesh_segments": bad}), [0, 1, 2, 3])[0] == 0
    assert _schedule(sched, _request("u", child, params={"kmesh_segments": [[0, 4]]}), [0, 1, 2, 3])[0] == 0


def test_a_negative_control_worker_loads_but_never_writes(service):
    extra = _extra(service, "w-control")
    sched, a = _scheduler(extra), _worker(extra, seed=12)
    prompt = [800 + i for i in range(BS + 1)]
    _execute(a, _schedule(sched, _request("s", prompt), [0, 1])[1])
    liar = _worker({**extra, "negative_control": "skip_write"}, seed=13)
    before = liar.engine.raw.clone()
    n, meta = _schedule(sched, _request("l", prompt), [2, 3])
    assert n == BS
    assert _execute(liar, meta) == set() and liar.stats["loaded_blocks"] == 1 and liar.stats["writes_skipped"] == 1
    assert torch.equal(liar.engine.raw, before)


def test_a_local_prefix_hit_is_subtracted_and_its_blocks_not_loaded(service):
    """vLLM's own prefix cache already holds the first block (num_computed_tokens = 4): KMesh supplies the rest,
    and the load starts after the engine's blocks."""
    extra = _extra(service, "w-local")
    sched, a, b = _scheduler(extra), _worker(extra, seed=14), _worker(extra, seed=15)
    prompt = [900 + i for i in range(3 * BS + 1)]
    _execute(a, _schedule(sched, _request("s", prompt), [0, 1, 2, 3])[1])
    req = _request("l", prompt)
    n, asynchronous = sched.get_num_new_matched_tokens(req, BS)
    assert (n, asynchronous) == (2 * BS, False)
    sched.update_state_after_alloc(req, None, n)
    new = SimpleNamespace(req_id="l", prompt_token_ids=prompt, num_computed_tokens=BS + n, sampling_params=None,
                          block_ids=([7, 8, 9, 10],))
    meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"l": 1}))
    plan = meta.loads[0]
    assert (plan.first, plan.num_tokens, [it.start for it in plan.items]) == (BS, 3 * BS, [BS, 2 * BS])
    before = b.engine.raw.clone()
    assert _execute(b, meta) == set() and b.stats["loaded_blocks"] == 2
    assert torch.equal(_kv(b, [7, 8, 9], range(BS, 3 * BS)), _kv(a, [0, 1, 2], range(BS, 3 * BS)))
    first = torch.arange(BS)
    assert torch.equal(_kv(b, [7], range(BS)), _bytes(capture(before, b.engine.layout, slots_of([7], first, BS),
                                                             first)))
    # all of it local: nothing to supply, and no plan left behind
    req2 = _request("m", prompt)
    assert sched.get_num_new_matched_tokens(req2, 3 * BS) == (0, False) and "m" not in sched._plans


def test_service_down_supplies_nothing_and_the_report_says_so(tmp_path):
    """No service at the socket: no crash, nothing supplied, the report says the service is down."""
    sched = _scheduler({"socket": str(tmp_path / "nobody.sock"), "retry_s": 60.0, "namespace": "w-down"})
    req = _request("r", [1] * (2 * BS + 1))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert _finished(sched, req)["service"] == "down"
    assert sched.link.warnings == 1 and sched.link.down_reason


def test_the_service_gone_before_the_load_fails_every_claimed_block(tmp_path):
    """The service dies between the scheduler's plan and the worker's load: every claimed block is reported
    failed (vLLM recomputes them), the engine's blocks keep their bytes, the request's step saves nothing."""
    from kmesh.service import process

    rt = Path(tempfile.mkdtemp(prefix="kmesh-vd-"))
    sp = process.start(rt / "svc", store_bytes=16 << 20)
    try:
        extra = {"socket": str(sp.socket_path), "staging_blocks": 4, "retry_s": 60.0, "namespace": "w-gone"}
        sched, a = _scheduler(extra), _worker(extra, seed=16)
        prompt = [950 + i for i in range(2 * BS + 1)]
        _execute(a, _schedule(sched, _request("s", prompt), [0, 1, 2])[1])
        longer = prompt[:2 * BS] + [960 + i for i in range(2 * BS + 1)]       # 2 stored blocks, 2 new ones
        n, meta = _schedule(sched, _request("l", longer), [5, 6, 7, 8, 9])
        assert n == 2 * BS and len(meta.saves[0].items) == 2
        sp.stop()
        before = a.engine.raw.clone()
        assert _execute(a, meta) == {5, 6}
        assert torch.equal(a.engine.raw, before) and a.stats["saved"] == 2          # the first step's two only
    finally:
        sp.stop()


def test_a_failed_load_saves_nothing_of_its_request_but_the_others_in_its_step_do(service):
    """One step, two new requests. "bad": block 0 stored, block 1's record vouches for other bytes than its payload,
    blocks 2-4 new. "good": blocks 0-2 stored, 3-4 new. The worker finds bad's corruption at block 1: block 1 is
    reported failed and none of bad's new blocks is saved from this step (its K/V is not trusted), while good's
    loads and saves go through."""
    extra = _extra(service, "w-failsave")
    sched, a, b = _scheduler(extra), _worker(extra, seed=17), _worker(extra, seed=18)
    good = [1000 + i for i in range(5 * BS + 1)]
    bad = [2000 + i for i in range(5 * BS + 1)]
    gkeys, bkeys = prefix_keys(sched.ns, good, BS, 5), prefix_keys(sched.ns, bad, BS, 5)
    _execute(a, _schedule(sched, _request("g0", good[:3 * BS + 1]), [0, 1, 2, 3])[1])     # good's blocks 0-2
    _execute(a, _schedule(sched, _request("b0", bad[:BS + 1]), [0, 1])[1])                # bad's block 0
    w, rw = a._window("save"), a._window("records")
    w.tensor[:a._block_bytes] = torch.randint(0, 256, (a._block_bytes,), dtype=torch.uint8)
    assert a.link.save(w, bkeys[1], 0, a._block_bytes)
    rec = Record(KIND_PREFIX, BS, BS, a._block_bytes, bytes(32), token_digest(bad[BS:2 * BS]))
    rw.tensor[:RECORD_BYTES] = torch.frombuffer(bytearray(rec.pack()), dtype=torch.uint8)
    assert a.link.save(rw, record_key(bkeys[1]), 0, RECORD_BYTES)
    reqs = {"bad": (_request("bad", bad), [0, 1, 2, 3, 4, 5]), "good": (_request("good", good), [6, 7, 8, 9, 10, 11])}
    news, counts = [], {}
    for rid, (req, ids) in reqs.items():
        counts[rid], _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, None, counts[rid])
        news.append(SimpleNamespace(req_id=rid, prompt_token_ids=req.prompt_token_ids,
                                    num_computed_tokens=counts[rid], sampling_params=None, block_ids=(ids,)))
    meta = sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=news, num_scheduled_tokens={n.req_id: len(n.prompt_token_ids) - counts[n.req_id]
                                                       for n in news}))
    assert counts == {"bad": 2 * BS, "good": 3 * BS}
    assert {p.req_id: [it.start for it in p.items] for p in meta.saves} == {"bad": [2 * BS, 3 * BS, 4 * BS],
                                                                            "good": [3 * BS, 4 * BS]}
    assert _execute(b, meta) == {1} and b.stats["load_errors"] == 1 and b.stats["loaded_blocks"] == 1 + 3
    assert b.stats["saved"] == 2 and b.stats["save_skipped"] == 0
    assert all(sched._read_record(k) is not None for k in gkeys[3:])
    assert all(sched._read_record(k) is None for k in bkeys[2:])
    assert torch.equal(_kv(b, [6, 7, 8], range(3 * BS)), _kv(a, [0, 1, 2], range(3 * BS)))
    # the scheduler learns of the failure from vLLM: bad's report counts its block from there on, good's is intact
    sched.update_connector_output(SimpleNamespace(invalid_block_ids={1}))
    reports = {rid: _finished(sched, req) for rid, (req, _) in reqs.items()}
    assert (reports["bad"]["tokens_supplied"], reports["bad"]["load_errors"]) == (BS, 1)
    assert (reports["good"]["tokens_supplied"], reports["good"]["load_errors"]) == (3 * BS, 0)


def test_a_payload_without_its_record_is_kept_and_the_rest_of_the_prompt_saved(service):
    """A writer died between a block's payload and its record: the lookup misses the block, the save finds the
    payload already stored (it is not written again) and goes on with the prompt's next block."""
    extra = _extra(service, "w-norecord")
    sched, a = _scheduler(extra), _worker(extra, seed=19)
    prompt = [3000 + i for i in range(2 * BS + 1)]
    keys = prefix_keys(sched.ns, prompt, BS, 2)
    w = a._window("save")
    w.tensor[:a._block_bytes] = 7
    assert a.link.save(w, keys[0], 0, a._block_bytes)
    n, meta = _schedule(sched, _request("s", prompt), [0, 1, 2])
    assert n == 0 and [it.start for it in meta.saves[0].items] == [0, BS]
    _execute(a, meta)
    assert a.stats["saved"] == 1 and sched._read_record(keys[0]) is None and sched._read_record(keys[1]) is not None


def test_a_missing_first_block_reports_no_token_supplied(service):
    extra = _extra(service, "w-missing0")
    sched, b = _scheduler(extra), _worker(extra, seed=20)
    prompt = [4000 + i for i in range(2 * BS + 1)]
    keys = prefix_keys(sched.ns, prompt, BS, 2)
    rw = b._window("records")
    for i in range(2):           # records whose payloads were never stored
        rec = Record(KIND_PREFIX, BS, i * BS, b._block_bytes, bytes(32), token_digest(prompt[i * BS:(i + 1) * BS]))
        rw.tensor[:RECORD_BYTES] = torch.frombuffer(bytearray(rec.pack()), dtype=torch.uint8)
        assert b.link.save(rw, record_key(keys[i]), 0, RECORD_BYTES)
    req = _request("l", prompt)
    n, meta = _schedule(sched, req, [4, 2, 3])
    assert n == 2 * BS and _execute(b, meta) == {4, 2}
    sched.update_connector_output(SimpleNamespace(invalid_block_ids={4, 2}))
    assert (_finished(sched, req)["tokens_supplied"], b.stats["load_errors"]) == (0, 2)


def test_request_finished_for_an_unknown_request_and_a_plan_never_scheduled(service):
    extra = _extra(service, "w-finish")
    sched, a = _scheduler(extra), _worker(extra, seed=21)
    assert sched.request_finished(_request("nobody", [1, 2, 3]), []) == (False, None)
    prompt = [5000 + i for i in range(BS + 1)]
    _execute(a, _schedule(sched, _request("s", prompt), [0, 1])[1])
    req = _request("aborted", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (BS, False) and "aborted" in sched._plans
    assert _finished(sched, req)["tokens_supplied"] == 0           # finished before it was ever scheduled
    assert "aborted" not in sched._plans and "aborted" not in sched._reports


def test_namespaces_keep_engines_apart_and_reports_start_empty(service):
    """Two engines whose namespaces differ (another model, dtype or block size) never see each other's blocks; a
    request that gets nothing reports mode none with the service up; a plan vLLM allocates nothing for is dropped."""
    one, other = _scheduler(_extra(service, "w-ns-one")), _scheduler(_extra(service, "w-ns-other"))
    a = _worker(_extra(service, "w-ns-one"), seed=23)
    prompt = [6000 + i for i in range(BS + 1)]
    _execute(a, _schedule(one, _request("s", prompt), [0, 1])[1])
    req = _request("o", prompt)
    assert other.get_num_new_matched_tokens(req, 0) == (0, False)
    rep = _finished(other, req)
    assert (rep["mode"], rep["service"], rep["tokens_supplied"], rep["load_errors"]) == ("none", "up", 0, 0)
    req = _request("dropped", prompt)
    assert one.get_num_new_matched_tokens(req, 0) == (BS, False) and "dropped" in one._plans
    one.update_state_after_alloc(req, None, 0)            # vLLM allocated the request without external tokens
    assert "dropped" not in one._plans
