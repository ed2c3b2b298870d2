"""kmesh.model.runner and kmesh.model.blend: the layer-wise runner against transformers' own forward, the true
causal mask by position, and blend()'s arms over a restored state built honestly (leader prefill → capture →
restore at new positions → blend).

Tiny random float32 Llama / Qwen2 models are built in-test (weights drawn so that logits and tokens are not
degenerate: unit-variance embeddings, 1/sqrt(fan_in) projections, random norm weights and q/k/v biases); the
embedded SmolLM2-135M (converted by the model stage into results/models/smollm2-135m-instruct) is used when
that folder exists and skipped otherwise.

Measured on CPU (torch 2.13, transformers 5.19), asserted with margin:
  tiny llama / qwen2: next-token logits vs transformers max |Δ| ~6e-7 (bound 1e-5); per-layer K and V 0.0
  (bound 1e-5); layer-0 K restored from a leader at other positions vs fresh K ~1.4e-6 (bound 1e-5).
  SmolLM2: logits max |Δ| ~3.4e-5 of |logit| ≤ 25 (bound 2e-4); K and V 0.0 (bound 1e-4); 8 greedy tokens equal.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kmesh.kv.restore import capture, restore
from kmesh.model.blend import ARMS, RepairConfig, RepairConfigError, blend, plan
from kmesh.model.errors import ModelError
from kmesh.model.runner import LayerRunner
from smollm2_model import converted

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, max_position_embeddings=512)
LOGIT_TOL = 1e-5        # tiny float32 models, measured ~6e-7
KV_TOL = 1e-5           # measured 0.0
SHIFT_TOL = 1e-5        # restored (rope-shifted) layer-0 K vs a fresh rotation, measured ~1.4e-6
SMOL_LOGIT_TOL = 2e-4   # measured ~3.4e-5
SMOL_KV_TOL = 1e-4      # measured 0.0
CHECK = 1               # RepairConfig()'s single check layer
RATIO = 0.15


# --- models ------------------------------------------------------------------------------------------------

def _tiny_model(kind: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    model = model.float().eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    model = _tiny_model(request.param)
    if request.param == "qwen2":  # the q/k/v biases are really there and really nonzero
        att = model.model.layers[0].self_attn
        assert all(m.bias is not None and float(m.bias.detach().abs().max()) > 0.1
                   for m in (att.q_proj, att.k_proj, att.v_proj))
    else:
        assert model.model.layers[0].self_attn.q_proj.bias is None
    return SimpleNamespace(kind=request.param, model=model, runner=LayerRunner(model))


@pytest.fixture(scope="module")
def smol():
    from kmesh.model import smollm2

    model, tok = smollm2.load_converted(converted())
    return SimpleNamespace(model=model, tok=tok, runner=LayerRunner(model), smollm2=smollm2)


def _ids(n: int, seed: int, vocab: int = TINY["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _pkv_kv(pkv, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cached K, V of one layer as [T, kv_heads, D] (batch 0)."""
    if hasattr(pkv, "layers"):          # transformers 5 DynamicCache
        k, v = pkv.layers[layer].keys, pkv.layers[layer].values
    else:                               # legacy tuple cache
        k, v = pkv[layer][0], pkv[layer][1]
    return k[0].transpose(0, 1), v[0].transpose(0, 1)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


# --- 1. runner vs transformers ----------------------------------------------------------------------------

def test_prefill_matches_transformers_forward(tiny):
    ids = _ids(40, 1)
    cache = tiny.runner.new_cache(64)
    logits = tiny.runner.prefill(ids, cache)
    with torch.no_grad():
        out = tiny.model(ids[None], use_cache=True)
    ref = out.logits[0, -1]
    assert logits.shape == ref.shape == (TINY["vocab_size"],) and logits.dtype == torch.float32
    assert float(ref.abs().max()) > 1.0   # not a degenerate near-zero model
    assert float((logits - ref).abs().max()) <= LOGIT_TOL
    for layer in range(tiny.runner.num_layers):
        hk, hv = _pkv_kv(out.past_key_values, layer)
        assert hk.shape == (40, TINY["num_key_value_heads"], TINY["head_dim"])
        assert float((cache.k[layer][:40] - hk).abs().max()) <= KV_TOL, layer   # post-RoPE keys
        assert float((cache.v[layer][:40] - hv).abs().max()) <= KV_TOL, layer
    # slots beyond the prompt were never written (cache zeroed by new_cache)
    assert all(torch.count_nonzero(cache.k[l][40:]) == 0 for l in range(tiny.runner.num_layers))


def test_decode_matches_generate(tiny):
    ids = _ids(40, 2)
    cache = tiny.runner.new_cache(48)
    tokens = tiny.runner.decode(cache, 40, tiny.runner.prefill(ids, cache), 8)
    with torch.no_grad():
        gen = tiny.model.generate(ids[None], attention_mask=torch.ones(1, 40, dtype=torch.long), max_new_tokens=8,
                                  do_sample=False, pad_token_id=0)
    assert tokens == gen[0, 40:].tolist()
    assert len(set(tokens)) >= 4, tokens   # a real continuation, not one token repeated
    # 8 tokens after 40 write positions 40..46: 47 slots are exactly enough, 46 are not
    tight = tiny.runner.new_cache(47, block_size=1)
    assert tight.capacity == 47
    assert tiny.runner.decode(tight, 40, tiny.runner.prefill(ids, tight), 8) == tokens
    with pytest.raises(ModelError, match="cannot hold"):
        tiny.runner.decode(tiny.runner.new_cache(46, block_size=1), 40, torch.zeros(TINY["vocab_size"]), 8)


def test_smollm2_runner_matches_transformers(smol):
    ids = smol.smollm2.chat_ids(smol.tok, "What is the capital of France?")[0]
    T = ids.numel()
    cache = smol.runner.new_cache(T + 8)
    logits = smol.runner.prefill(ids, cache)
    with torch.no_grad():
        out = smol.model(ids[None], use_cache=True)
    assert float((logits - out.logits[0, -1]).abs().max()) <= SMOL_LOGIT_TOL
    for layer in range(smol.runner.num_layers):
        hk, hv = _pkv_kv(out.past_key_values, layer)
        assert float((cache.k[layer][:T] - hk).abs().max()) <= SMOL_KV_TOL, layer
        assert float((cache.v[layer][:T] - hv).abs().max()) <= SMOL_KV_TOL, layer
    tokens = smol.runner.decode(cache, T, logits, 8)
    ref, text = smol.smollm2.greedy(smol.model, smol.tok, ids[None], 8)
    assert tokens == ref, (tokens, ref)
    assert "paris" in smol.tok.decode(tokens).lower(), text


# --- 2. true causal mask by position ---------------------------------------------------------------------

def _layer1_inputs(runner: LayerRunner, ids: torch.Tensor):
    """Hidden rows entering layer 1 (after a full layer 0) and positions."""
    pos = torch.arange(ids.numel())
    h = runner.embed(ids)
    q, k, v = runner.qkv(0, h, pos)
    return runner.finish_layer(0, h, runner.attend(q, pos, k, v)), pos


@torch.no_grad()
def test_subset_of_queries_attends_by_position(tiny):
    r = tiny.runner
    h, pos = _layer1_inputs(r, _ids(40, 3))
    q, k, v = r.qkv(1, h, pos)
    every = r.attend(q, pos, k, v)
    sub = torch.tensor([2, 9, 17, 23, 30])   # not the last rows
    qs, ks, vs = r.qkv(1, h[sub], pos[sub])
    assert torch.allclose(qs, q[sub], atol=1e-6, rtol=0) and torch.allclose(ks, k[sub], atol=1e-6, rtol=0)
    assert torch.allclose(vs, v[sub], atol=1e-6, rtol=0)
    part = r.attend(qs, pos[sub], k, v)
    assert part.shape == (5, TINY["num_attention_heads"] * TINY["head_dim"])
    assert torch.allclose(part, every[sub], atol=1e-6, rtol=0)
    # an explicit reference: softmax over keys at positions <= p, kv head = query head // groups
    for row, p in enumerate(sub.tolist()):
        for head in range(r.num_heads):
            kvh = head // r.groups
            w = torch.softmax((k[: p + 1, kvh] @ qs[row, head]) * r.scale, 0)
            ref = w @ v[: p + 1, kvh]
            got = part[row, head * r.head_dim:(head + 1) * r.head_dim]
            assert torch.allclose(got, ref, atol=1e-5, rtol=0), (p, head)
    # bottom-right alignment of the same subset is a different mask: rows see keys 0..35+i, not 0..p
    br = r.attend(qs, pos[sub], k, v, mask="bottom_right")
    assert float((br - part).abs().max()) > 1e-2
    # ... and exactly that mask (the stock arm's): an explicit reference per row and head
    m, n = k.shape[0], len(sub)
    for row in range(n):
        last = m - n + row
        for head in range(r.num_heads):
            kvh = head // r.groups
            w = torch.softmax((k[: last + 1, kvh] @ qs[row, head]) * r.scale, 0)
            ref = w @ v[: last + 1, kvh]
            assert torch.allclose(br[row, head * r.head_dim:(head + 1) * r.head_dim], ref, atol=1e-5, rtol=0), row
    # ... and for all rows in order the two masks are the same mask
    assert torch.equal(r.attend(q, pos, k, v, mask="bottom_right"), every)
    # key positions, not key order: permuted keys with their positions give the same output
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(r.attend(qs, pos[sub], k[perm], v[perm], key_pos=pos[perm]), part, atol=1e-6, rtol=0)
    with pytest.raises(ModelError, match="mask must be"):
        r.attend(qs, pos[sub], k, v, mask="causal")
    # the fused shortcuts refuse what they cannot compute: several queries (or key positions) for a decode step,
    # fewer queries than keys (or key positions) for the whole-prefill kernel
    with pytest.raises(ModelError, match="last_query"):
        r.attend(qs, pos[sub], k, v, last_query=True)
    with pytest.raises(ModelError, match="last_query"):
        r.attend(q[-1:], pos[-1:], k, v, key_pos=pos, last_query=True)
    with pytest.raises(ModelError, match="all_rows"):
        r.attend(qs, pos[sub], k, v, all_rows=True)
    with pytest.raises(ModelError, match="all_rows"):
        r.attend(q, pos, k, v, key_pos=pos, all_rows=True)


# --- 3. blend over an honestly restored state -------------------------------------------------------------

def _case(runner: LayerRunner, child_prefix: int = 13, child_suffix: int = 7, seed: int = 10,
          fill: float = 0.0) -> SimpleNamespace:
    """Leader = 8 + doc(24) + 8 tokens; child = child_prefix + the same doc + child_suffix tokens. The doc's K/V
    are captured from the leader's prefill at positions 8..31 and restored into the child's cache at
    child_prefix..child_prefix+23 (keys re-rotated by restore with the runner's rope)."""
    vocab = runner.config.vocab_size
    doc = _ids(24, seed, vocab)
    leader = torch.cat([_ids(8, seed + 1, vocab), doc, _ids(8, seed + 2, vocab)])
    child = torch.cat([_ids(child_prefix, seed + 3, vocab), doc, _ids(child_suffix, seed + 4, vocab)])
    T, a, b, n = child.numel(), 8, child_prefix, 24
    lc = runner.new_cache(leader.numel())
    runner.prefill(leader, lc)
    seg = capture(lc.raw, lc.layout, list(range(a, a + n)), list(range(a, a + n)))
    assert seg.k.shape == (n, runner.num_layers, runner.num_kv_heads, runner.head_dim)
    restored_cache = runner.new_cache(T + 8, fill=fill)
    restore(restored_cache.raw, restored_cache.layout, seg, list(range(b, b + n)), list(range(b, b + n)), runner.rope)
    restored = torch.zeros(T, dtype=torch.bool)
    restored[b:b + n] = True
    full_cache = runner.new_cache(T + 8)
    full = runner.prefill(child, full_cache)
    return SimpleNamespace(child=child, T=T, restored=restored, pristine=restored_cache, full=full,
                           full_cache=full_cache, leader_cache=lc, doc_slots=torch.arange(b, b + n),
                           leader_slots=torch.arange(a, a + n))


def _copy(runner: LayerRunner, cache):
    return runner.cache_over(cache.raw.clone(), cache.layout, fill=None)


def test_restored_state_is_honest(tiny):
    _r, c = tiny.runner, _case(tiny.runner)
    d, s = c.doc_slots, c.leader_slots
    # layer 0 K depends only on token and position: the shifted leader K is the child's fresh K
    assert float((c.pristine.k[0][d] - c.full_cache.k[0][d]).abs().max()) <= SHIFT_TOL
    assert torch.equal(c.pristine.v[0][d], c.full_cache.v[0][d])
    # the keys really moved, and deeper layers carry the leader's context: there is something to repair
    assert float((c.pristine.k[0][d] - c.leader_cache.k[0][s]).abs().max()) > 0.1
    assert float((c.pristine.k[2][d] - c.full_cache.k[2][d]).abs().max()) > 0.1
    assert torch.count_nonzero(c.pristine.k[1][:c.T][~c.restored]) == 0   # nothing written outside the doc


@pytest.mark.parametrize("arm", ["full", "repair", "naive", "stock"])
def test_blend_shapes_and_arm(tiny, arm):
    r, c = tiny.runner, _case(tiny.runner)
    res = blend(r, c.child, _copy(r, c.pristine), c.restored, arm=arm)
    assert res.arm == arm and res.masks.dtype == torch.bool and res.masks.shape == (r.num_layers, c.T)
    assert res.logits.shape == (TINY["vocab_size"],) and torch.isfinite(res.logits).all()
    assert res.counts() == res.masks.sum(1).tolist() == res.recomputed
    if arm == "repair":   # blend()'s default arm (and default config)
        default = blend(r, c.child, _copy(r, c.pristine), c.restored)
        assert default.arm == "repair" and torch.equal(default.masks, res.masks)
        assert torch.equal(default.logits, res.logits)


def test_full_arm_is_prefill_bit_for_bit(tiny):
    r, c = tiny.runner, _case(tiny.runner)
    cache = _copy(r, c.pristine)
    res = blend(r, c.child, cache, c.restored, arm="full")
    assert torch.equal(res.logits, c.full) and res.masks.all()
    assert all(torch.equal(a, b) for a, b in zip(cache.stacked(c.T), c.full_cache.stacked(c.T)))


def test_repair_with_ratio_one_is_full(tiny):
    r, c = tiny.runner, _case(tiny.runner)
    res = blend(r, c.child, _copy(r, c.pristine), c.restored, RepairConfig(recompute_ratio=1.0), arm="repair")
    assert res.masks.all()
    assert torch.equal(res.logits, c.full)
    kl_default = _kl(c.full, blend(r, c.child, _copy(r, c.pristine), c.restored, arm="repair").logits)
    assert kl_default > 0   # the default ratio does not recompute everything: the logits really differ


def _repair_expected_keep(restored: torch.Tensor) -> int:
    T = restored.numel()
    forced = ~restored
    forced[T - 1] = True
    return int(forced.sum()) + math.ceil(RATIO * int((~forced).sum()))


@pytest.mark.parametrize("shape", [(13, 7), (13, 0), (0, 5)], ids=["suffix", "ends-in-doc", "starts-with-doc"])
def test_repair_masks(tiny, shape):
    r, c = tiny.runner, _case(tiny.runner, *shape)
    cache = _copy(r, c.pristine)
    res = blend(r, c.child, cache, c.restored, arm="repair")
    m, T = res.masks, c.T
    keep = _repair_expected_keep(c.restored)
    missing = int((~c.restored).sum())
    n_rest_wo_last = int(c.restored.sum()) - int(c.restored[-1])
    assert keep == missing + int(c.restored[-1]) + math.ceil(RATIO * n_rest_wo_last)
    assert m[0].all()
    for layer in range(CHECK, r.num_layers):
        assert int(m[layer].sum()) == keep, (layer, res.counts())
        assert torch.equal(m[layer], m[CHECK])
    assert m[:, ~c.restored].all() and m[:, T - 1].all()
    # the restored rows kept are the top ceil(0.15·n) by ‖fresh K − restored K‖² at the check layer, where
    # fresh K = full prefill's (every layer before the check layer was recomputed for every position)
    cand = c.restored.clone()
    cand[T - 1] = False
    dev = ((c.full_cache.k[CHECK][:T] - c.pristine.k[CHECK][:T]) ** 2).sum((1, 2))
    dev[~cand] = -1
    top = set(torch.topk(dev, math.ceil(RATIO * int(cand.sum()))).indices.tolist())
    assert set(torch.nonzero(m[CHECK] & cand)[:, 0].tolist()) == top


def test_repair_by_v_deviation_ranks_restored_rows_by_v(tiny):
    """deviation="v": the restored rows kept at the check layer are the top ceil(0.15·n) by ‖fresh V − restored V‖²
    (fresh V = the full prefill's, every earlier layer recomputed for every position)."""
    r, c = tiny.runner, _case(tiny.runner)
    res = blend(r, c.child, _copy(r, c.pristine), c.restored, RepairConfig(deviation="v"), arm="repair")
    T = c.T
    cand = c.restored.clone()
    cand[T - 1] = False
    dev = ((c.full_cache.v[CHECK][:T] - c.pristine.v[CHECK][:T]) ** 2).sum((1, 2))
    dev[~cand] = -1
    top = set(torch.topk(dev, math.ceil(RATIO * int(cand.sum()))).indices.tolist())
    assert set(torch.nonzero(res.masks[CHECK] & cand)[:, 0].tolist()) == top
    assert int(res.masks[CHECK].sum()) == _repair_expected_keep(c.restored)


def test_repair_cache_after_blend(tiny):
    r, c = tiny.runner, _case(tiny.runner)
    cache = _copy(r, c.pristine)
    res = blend(r, c.child, cache, c.restored, arm="repair")
    T = c.T
    sel = res.masks[CHECK]
    kept = c.restored & ~sel          # restored, not recomputed: must be untouched from the check layer on
    over = c.restored & sel           # restored, recomputed: overwritten
    assert int(kept.sum()) > 0 and int(over.sum()) > 0
    for layer in range(r.num_layers):
        k, v, k0, v0 = cache.k[layer][:T], cache.v[layer][:T], c.pristine.k[layer][:T], c.pristine.v[layer][:T]
        if layer < CHECK:             # everything recomputed: the full prefill's K/V
            assert torch.allclose(k, c.full_cache.k[layer][:T], atol=1e-6, rtol=0)
            assert torch.allclose(v, c.full_cache.v[layer][:T], atol=1e-6, rtol=0)
            continue
        assert torch.equal(k[kept], k0[kept]) and torch.equal(v[kept], v0[kept]), layer
        diff = (k[over] - k0[over]).abs().flatten(1).amax(1)
        assert (diff > 0).all(), layer
        assert torch.count_nonzero(k[~c.restored].flatten(1).abs().amax(1) == 0) == 0   # missing: written
    # at the check layer the recomputed rows are the full prefill's rows exactly (same inputs)
    assert torch.allclose(cache.k[CHECK][:T][sel], c.full_cache.k[CHECK][:T][sel], atol=1e-6, rtol=0)
    # nothing beyond the prompt written
    assert all(torch.count_nonzero(cache.k[l][T:]) == 0 for l in range(r.num_layers))


def test_repair_multiple_check_layers(tiny):
    r, c = tiny.runner, _case(tiny.runner)
    cfg = RepairConfig(check_layers=(1, 2), recompute_ratio=(0.5, 0.15))
    res = blend(r, c.child, _copy(r, c.pristine), c.restored, cfg, arm="repair")
    missing = int((~c.restored).sum())
    n = int(c.restored.sum())   # last is missing here
    assert res.counts() == [c.T, missing + math.ceil(0.5 * n), missing + math.ceil(0.15 * n),
                            missing + math.ceil(0.15 * n)]
    assert not (res.masks[2] & ~res.masks[1]).any() and torch.equal(res.masks[3], res.masks[2])


# --- epic: EPIC's LegoLink rule (the first k tokens of every restored chunk recomputed, the rest reused) -------

def test_epic_plan_recomputes_each_chunk_head_even_where_chunks_touch():
    restored = torch.zeros(44, dtype=torch.bool)
    restored[13:37] = True
    cfg = RepairConfig(epic_tokens=4)
    p = plan("epic", restored, cfg, 4, torch.device("cpu"), chunks=[(25, 37), (13, 25)])   # adjacent, any order
    assert p.forced.tolist() == list(range(13)) + [13, 14, 15, 16, 25, 26, 27, 28] + list(range(37, 44))
    assert p.keep == () and p.check_layers == ()
    # k longer than a chunk: the whole chunk; k = 0: naive's set; the last position always, restored or not
    assert plan("epic", restored, RepairConfig(epic_tokens=50), 4, torch.device("cpu"),
                chunks=[(13, 25), (25, 37)]).forced.tolist() == list(range(44))
    allr = torch.ones(10, dtype=torch.bool)
    assert plan("epic", allr, RepairConfig(epic_tokens=0), 4, torch.device("cpu"), chunks=[(0, 10)]).forced.tolist() \
        == [9]
    assert plan("epic", allr, RepairConfig(epic_tokens=2), 4, torch.device("cpu"),
                chunks=[(0, 5), (5, 10)]).forced.tolist() == [0, 1, 5, 6, 9]


@pytest.mark.parametrize("chunks, match", [(None, "needs the restored chunks"), ([(10, 20)], "not wholly restored"),
                                           ([(13, 25), (20, 37)], "disjoint"), ([(13, 13)], "non-empty"),
                                           ([(30, 50)], "inside")])
def test_epic_refuses_missing_or_wrong_chunks(chunks, match):
    restored = torch.zeros(44, dtype=torch.bool)
    restored[13:37] = True
    with pytest.raises(ModelError, match=match):
        plan("epic", restored, RepairConfig(), 4, torch.device("cpu"), chunks=chunks)
    for bad in (-1, 2.0, True):
        with pytest.raises(RepairConfigError, match="epic_tokens"):
            plan("epic", restored, RepairConfig(epic_tokens=bad), 4, torch.device("cpu"), chunks=[(13, 37)])


def test_epic_masks_cache_and_its_limits(tiny):
    """epic recomputes exactly its plan's positions at every layer and leaves every other restored row as restored;
    with k = 0 it is naive bit for bit; its logits move towards full's as k grows to the whole chunk."""
    r, c = tiny.runner, _case(tiny.runner)
    T, chunks = c.T, [(13, 25), (25, 37)]
    cache = _copy(r, c.pristine)
    res = blend(r, c.child, cache, c.restored, RepairConfig(epic_tokens=4), arm="epic", chunks=chunks)
    heads = torch.zeros(T, dtype=torch.bool)
    heads[[13, 14, 15, 16, 25, 26, 27, 28]] = True
    kept = c.restored & ~heads
    for layer in range(r.num_layers):
        assert torch.equal(res.masks[layer], ~c.restored | heads), layer
        assert torch.equal(cache.k[layer][:T][kept], c.pristine.k[layer][:T][kept])
        assert torch.equal(cache.v[layer][:T][kept], c.pristine.v[layer][:T][kept])
        if layer:   # recomputed heads hold fresh K, not the restored (layer 0's fresh K equals the shifted one)
            assert not torch.equal(cache.k[layer][:T][heads], c.pristine.k[layer][:T][heads]), layer
    naive = blend(r, c.child, _copy(r, c.pristine), c.restored, arm="naive")
    zero = blend(r, c.child, _copy(r, c.pristine), c.restored, RepairConfig(epic_tokens=0), arm="epic", chunks=chunks)
    assert torch.equal(zero.masks, naive.masks) and torch.equal(zero.logits, naive.logits)
    whole = blend(r, c.child, _copy(r, c.pristine), c.restored, RepairConfig(epic_tokens=12), arm="epic",
                  chunks=chunks)
    assert bool(whole.masks.all())
    assert _kl(c.full, whole.logits) < 1e-9 < _kl(c.full, naive.logits)


def test_naive_masks_and_cache(tiny):
    r, c = tiny.runner, _case(tiny.runner)
    cache = _copy(r, c.pristine)
    res = blend(r, c.child, cache, c.restored, arm="naive")
    T = c.T
    for layer in range(r.num_layers):
        assert torch.equal(res.masks[layer], ~c.restored), layer
        assert torch.equal(cache.k[layer][:T][c.restored], c.pristine.k[layer][:T][c.restored])
        assert torch.equal(cache.v[layer][:T][c.restored], c.pristine.v[layer][:T][c.restored])
    # layer 0 of a missing position depends on its token only
    miss = ~c.restored
    assert torch.allclose(cache.k[0][:T][miss], c.full_cache.k[0][:T][miss], atol=1e-6, rtol=0)
    assert 0 < _kl(c.full, res.logits)


def test_stock_masks_and_zeroes(tiny):
    r = tiny.runner
    c = _case(r, fill=7.0)    # a poisoned child cache: stock must zero what has no data, not inherit the buffer
    cache = _copy(r, c.pristine)
    T = c.T
    assert (c.pristine.k[CHECK][:T][~c.restored] == 7.0).all()
    res = blend(r, c.child, cache, c.restored, arm="stock")
    keep = int(RATIO * T)
    assert keep == 6
    for layer in range(r.num_layers):
        assert int(res.masks[layer].sum()) == (T if layer < CHECK else keep), (layer, res.counts())
    assert torch.equal(res.masks[CHECK + 1], res.masks[CHECK])
    # selection: top int(0.15·T) over ALL positions by ‖fresh K − cached K‖², missing positions cached as zeros
    cached = c.pristine.k[CHECK][:T].clone()
    cached[~c.restored] = 0
    dev = ((c.full_cache.k[CHECK][:T] - cached) ** 2).sum((1, 2))
    assert set(torch.nonzero(res.masks[CHECK])[:, 0].tolist()) == set(torch.topk(dev, keep).indices.tolist())
    miss = ~c.restored
    for layer in range(r.num_layers):
        k, v = cache.k[layer][:T], cache.v[layer][:T]
        not_re = miss & ~res.masks[layer]
        if layer < CHECK:
            assert not not_re.any()
            assert torch.allclose(k[miss], c.full_cache.k[layer][:T][miss], atol=1e-6, rtol=0)
        else:
            assert not_re.any(), layer
            assert torch.count_nonzero(k[not_re]) == 0 and torch.count_nonzero(v[not_re]) == 0, layer
            kept = c.restored & ~res.masks[layer]
            assert torch.equal(k[kept], c.pristine.k[layer][:T][kept])
    assert (cache.k[0][T:] == 7.0).all()   # beyond the prompt: untouched


def test_stock_matched_budget_is_repair_count(tiny):
    """stock-matched: stock's rule (top-k over ALL positions by K deviation, missing zeroed, bottom-right mask)
    given exactly the repair arm's recomputed count, which includes every unrestored position. The plain stock arm
    (int(0.15·T) = 6 here) cannot even cover the 20 unrestored positions; matched it gets repair's 24."""
    r, c = tiny.runner, _case(tiny.runner)
    T = c.T
    rep = blend(r, c.child, _copy(r, c.pristine), c.restored, arm="repair")
    n = int(rep.masks[-1].sum())
    assert n == _repair_expected_keep(c.restored) == 24 and int((~c.restored).sum()) == 20
    cache = _copy(r, c.pristine)
    matched = blend(r, c.child, cache, c.restored, RepairConfig(recompute_counts=(n,)), arm="stock")
    assert matched.counts() == rep.counts() == [T, n, n, n]
    stock = blend(r, c.child, _copy(r, c.pristine), c.restored, arm="stock")
    assert stock.counts()[-1] == int(RATIO * T) == 6 < n
    # the same selection rule: the top n by ‖fresh K − cached K‖² with missing positions cached as zeros
    cached = c.pristine.k[CHECK][:T].clone()
    cached[~c.restored] = 0
    dev = ((c.full_cache.k[CHECK][:T] - cached) ** 2).sum((1, 2))
    assert set(torch.nonzero(matched.masks[CHECK])[:, 0].tolist()) == set(torch.topk(dev, n).indices.tolist())
    # nothing forces the unrestored positions: an unrestored position the ranking left out holds zeros
    not_re = ~c.restored & ~matched.masks[-1]
    assert torch.count_nonzero(cache.k[-1][:T][not_re]) == 0
    # the queries it recomputes attend bottom-right aligned, not by position: not the repair arm's state
    assert not torch.equal(matched.logits, rep.logits)


def test_recompute_counts_errors(tiny):
    _r, c = tiny.runner, _case(tiny.runner)
    for cfg in (RepairConfig(recompute_counts=(0,)), RepairConfig(recompute_counts=(3, 4)),
                RepairConfig(check_layers=(1, 2), recompute_counts=(3, 4)), RepairConfig(recompute_counts=(2.0,))):
        with pytest.raises(RepairConfigError):
            cfg.validate(4)
    with pytest.raises(RepairConfigError, match="exceed"):
        plan("stock", c.restored, RepairConfig(recompute_counts=(c.T + 1,)), 4, torch.device("cpu"))
    for arm in ("repair", "naive", "full"):   # a fixed budget is the stock arm's only
        with pytest.raises(RepairConfigError, match="stock arm"):
            plan(arm, c.restored, RepairConfig(recompute_counts=(5,)), 4, torch.device("cpu"))
    assert plan("stock", c.restored, RepairConfig(recompute_counts=(c.T,)), 4, torch.device("cpu")).keep == (c.T,)
    # the smallest budgets are allowed: one position, equal counts at two check layers
    assert plan("stock", c.restored, RepairConfig(recompute_counts=(1,)), 4, torch.device("cpu")).keep == (1,)
    RepairConfig(check_layers=(1, 2), recompute_counts=(1, 1)).validate(4)


def test_chance_control_keeps_the_budget_and_is_seeded(tiny):
    """selection_seed: the repair's budget and forced rows, the restored rows picked by a seeded random score (the
    same seed the same rows; another seed other rows); the repair arm's only; never in a CUDA graph."""
    r, c = tiny.runner, _case(tiny.runner, 40, 7)
    rule = blend(r, c.child, _copy(r, c.pristine), c.restored, arm="repair")
    runs = [blend(r, c.child, _copy(r, c.pristine), c.restored, RepairConfig(selection_seed=s), arm="repair")
            for s in (0, 0, 1)]
    for res in runs:
        assert res.counts() == rule.counts()
        assert res.masks[:, ~c.restored].all() and res.masks[:, c.T - 1].all()
    assert torch.equal(runs[0].masks, runs[1].masks) and not torch.equal(runs[0].masks, runs[2].masks)
    for arm in ("naive", "stock", "full", "epic"):
        with pytest.raises(RepairConfigError, match="chance control"):
            plan(arm, c.restored, RepairConfig(selection_seed=0), r.num_layers, torch.device("cpu"), chunks=[(40, 64)])
    for bad in (-1, 1.5):
        with pytest.raises(RepairConfigError, match="selection_seed"):
            RepairConfig(selection_seed=bad).validate(r.num_layers)


def test_the_rule_leaves_the_check_layer_closest_to_full(tiny):
    """The law the equivalence stage checks (quality: repair_closest_to_full_at_its_check_layer): at the first
    check layer the repair's cache is no farther from the full prefill's than chance's at the same budget, and a
    rule that keeps the most deviant rows restored (the least deviant recomputed) is farther than chance."""
    from kmesh.model import blend as blend_mod
    from kmesh.model.quality import kv_error

    r, c = tiny.runner, _case(tiny.runner, 40, 7)

    def at_check(config: RepairConfig) -> float:
        cache = _copy(r, c.pristine)
        blend(r, c.child, cache, c.restored, config, arm="repair")
        full, got = SimpleNamespace(k=c.full_cache.stacked(c.T)[0]), SimpleNamespace(k=cache.stacked(c.T)[0])
        return kv_error(full, got, CHECK)

    rule, chance = at_check(RepairConfig()), [at_check(RepairConfig(selection_seed=s)) for s in range(3)]
    assert rule < min(chance)
    real_pick = blend_mod.pick

    def least_deviant(p, i, dev, forced_rows):
        return real_pick(p, i, -dev, forced_rows)

    blend_mod.pick = least_deviant
    try:
        wrong = at_check(RepairConfig())
    finally:
        blend_mod.pick = real_pick
    assert wrong > max(chance)


def test_decode_stops_at_end_of_turn(tiny):
    r = tiny.runner
    ids = _ids(40, 2)
    cache = r.new_cache(48)
    first = r.prefill(ids, cache)
    tokens = r.decode(cache, 40, first, 8)
    j = next(i for i in range(1, 8) if tokens[i] not in tokens[:i])   # the first token not seen before it
    stopped = r.new_cache(48)
    got = r.decode(stopped, 40, r.prefill(ids, stopped), 8, stop_ids=(tokens[j], 999))
    assert got == tokens[:j + 1]
    # nothing after the end-of-turn token was computed: its slot and every later one still zero
    assert all(torch.count_nonzero(stopped.k[layer][40 + j:]) == 0 for layer in range(r.num_layers))
    assert r.decode(r.new_cache(48), 40, first, 8, stop_ids=(tokens[0],)) == tokens[:1]


def test_teacher_forced_follows_decode(tiny):
    """Teacher forcing a state with its own greedy tokens (one batched forward) gives the logits decode saw step by
    step, up to float rounding, with the same greedy tokens and the same K/V written; row 0 is the prefill's own
    logits exactly; with other tokens the rest differ."""
    r = tiny.runner
    ids = _ids(40, 2)
    cache = r.new_cache(48)
    first = r.prefill(ids, cache)
    prompt = r.cache_over(cache.raw.clone(), cache.layout, fill=None)
    seen: list[torch.Tensor] = []
    tokens = r.decode(cache, 40, first, 8, step_logits=seen)
    forced_cache = r.cache_over(prompt.raw.clone(), prompt.layout, fill=None)
    forced = r.teacher_forced(forced_cache, 40, first, tokens)
    assert forced.shape == (8, TINY["vocab_size"])
    assert torch.equal(forced[0], first)
    stepped = torch.stack([first, *seen])
    torch.testing.assert_close(forced, stepped, rtol=1e-5, atol=1e-5)
    assert forced.argmax(-1).tolist() == tokens
    # the fed tokens' K/V (all but the last token, which is never fed) are decode's
    k_forced, v_forced = forced_cache.stacked(47)
    k_dec, v_dec = cache.stacked(47)
    torch.testing.assert_close(k_forced, k_dec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_forced, v_dec, rtol=1e-5, atol=1e-5)
    other = [(t + 1) % TINY["vocab_size"] for t in tokens]
    forced_other = r.teacher_forced(r.cache_over(prompt.raw.clone(), prompt.layout, fill=None), 40, first, other)
    assert torch.equal(forced_other[0], first) and not torch.equal(forced_other[1:], forced[1:])
    with pytest.raises(ModelError, match="at least one"):
        r.teacher_forced(prompt, 40, first, [])
    with pytest.raises(ModelError, match="cannot hold"):
        r.teacher_forced(prompt, 40, first, [0] * 10)


def test_teacher_forced_and_extend_fill_the_cache_exactly_and_refuse_one_more(tiny):
    """A 48-slot cache after 40 prompt positions: teacher forcing 9 tokens feeds 8 (slots 40..47, exactly full) and
    `extend` of 8 fits; `extend` of 9 is refused before anything is written; teacher forcing refuses a prefill
    longer than the cache even when it feeds nothing (one token)."""
    r = tiny.runner
    ids = _ids(40, 2)
    cache = r.new_cache(48)
    first = r.prefill(ids, cache)
    assert cache.capacity == 48
    prompt = r.cache_over(cache.raw.clone(), cache.layout, fill=None)
    tokens = [int(t) for t in _ids(9, 7)]
    full = r.cache_over(prompt.raw.clone(), prompt.layout, fill=None)
    forced = r.teacher_forced(full, 40, first, tokens)
    assert forced.shape == (9, TINY["vocab_size"])
    assert all(torch.count_nonzero(full.k[layer][47]) > 0 for layer in range(r.num_layers))   # the last slot written
    fits = r.cache_over(prompt.raw.clone(), prompt.layout, fill=None)
    torch.testing.assert_close(r.extend(fits, 40, torch.tensor(tokens[:8])), forced[1:], rtol=1e-5, atol=1e-5)
    over = r.cache_over(prompt.raw.clone(), prompt.layout, fill=None)
    with pytest.raises(ModelError, match="cannot hold"):
        r.extend(over, 40, torch.tensor(tokens))
    assert torch.equal(over.raw, prompt.raw)
    with pytest.raises(ModelError, match="cannot hold"):
        r.teacher_forced(prompt, 49, first, tokens[:1])
    assert torch.equal(r.teacher_forced(prompt, 48, first, tokens[:1]), first[None])
    # `extend` reads only the slots up to its last position: NaN in every later slot (a cache of 64) changes nothing
    poisoned = r.new_cache(64, fill=float("nan"))
    assert torch.equal(r.prefill(ids, poisoned), first)
    torch.testing.assert_close(r.extend(poisoned, 40, torch.tensor(tokens[:8])), forced[1:], rtol=1e-5, atol=1e-5)


# --- 4. repair is meaningful on the real model -------------------------------------------------------------

def test_smollm2_repair_beats_naive(smol):
    """Measured (CPU): T=95, doc 51 tokens at 8 in the leader and 22 in the child; KL(full‖naive) ≈ 0.0105,
    KL(full‖repair) ≈ 0.0037 (52 of 95 positions recomputed after layer 1); repair's and naive's top-1 equal
    full's. No claim against stock here: stock at its own int(0.15·95) = 14 positions cannot even cover the 44
    unrestored ones, so it loses by budget; the equivalence stage measures repair against stock-matched (the same
    rule at repair's count) and reports that met or missed."""
    r, tok = smol.runner, smol.tok

    def enc(s: str) -> torch.Tensor:
        return tok(s, add_special_tokens=False, return_tensors="pt")["input_ids"][0]

    doc = enc("The Zorblat river flows north through the city of Quenmar. Quenmar is famous for its copper bells, "
              "which are rung every evening at seven. The bell founders of Quenmar use a secret alloy containing "
              "tin and silver.")
    lp = enc("<|im_start|>system\nBackground notes follow.\n")
    cp = enc("<|im_start|>system\nYou are a helpful assistant. Read the passage below carefully and answer the "
             "user's question.\n")
    q = enc("<|im_end|>\n<|im_start|>user\nWhat are the bells of Quenmar made of?<|im_end|>\n<|im_start|>assistant\n")
    leader, child = torch.cat([lp, doc, enc("<|im_end|>\n")]), torch.cat([cp, doc, q])
    a, b, n, T = lp.numel(), cp.numel(), doc.numel(), child.numel()
    assert a != b
    lc = r.new_cache(leader.numel())
    r.prefill(leader, lc)
    seg = capture(lc.raw, lc.layout, list(range(a, a + n)), list(range(a, a + n)))
    pristine = r.new_cache(T)
    restore(pristine.raw, pristine.layout, seg, list(range(b, b + n)), list(range(b, b + n)), r.rope)
    restored = torch.zeros(T, dtype=torch.bool)
    restored[b:b + n] = True
    full = r.prefill(child, r.new_cache(T))
    assert torch.equal(blend(r, child, _copy(r, pristine), restored, arm="full").logits, full)
    kl = {arm: _kl(full, blend(r, child, _copy(r, pristine), restored, arm=arm).logits) for arm in ("naive", "repair")}
    km = blend(r, child, _copy(r, pristine), restored, arm="repair")
    assert kl["naive"] > 0 and kl["repair"] < kl["naive"], kl
    assert int(km.logits.argmax()) == int(full.argmax()), kl


def test_end_of_turn_ids(smol):
    """SmolLM2-Instruct ends a turn with <|im_end|> (its eos, and what transformers' generate stops on); the
    byte tokenizer of random weights has no end-of-turn token."""
    from kmesh.harness.modelsetup import end_of_turn_ids
    from kmesh.harness.workload import ByteTokenizer, HFTokenizer

    im_end = smol.tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(smol.model, HFTokenizer(smol.tok)) == (im_end,)
    assert end_of_turn_ids(smol.model, ByteTokenizer(smol.model.config.vocab_size)) == ()


# --- 5. configuration and argument errors ------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    RepairConfig(check_layers=()),
    RepairConfig(check_layers=(2, 1)),
    RepairConfig(check_layers=(1, 1)),
    RepairConfig(check_layers=(-1,)),
    RepairConfig(check_layers=(4,)),             # the tiny models have 4 layers: 0..3
    RepairConfig(check_layers=(1.0,)),
    RepairConfig(recompute_ratio=0.0),
    RepairConfig(recompute_ratio=-0.1),
    RepairConfig(recompute_ratio=1.5),
    RepairConfig(recompute_ratio=float("nan")),
    RepairConfig(check_layers=(1, 2), recompute_ratio=(0.1, 0.2)),   # increasing
    RepairConfig(check_layers=(1, 2), recompute_ratio=(0.3, 0.2, 0.1)),
    RepairConfig(check_layers=(1,), recompute_ratio=(0.3, 0.2)),
    RepairConfig(deviation="q"),
], ids=lambda c: f"{c.check_layers}-{c.recompute_ratio}-{c.deviation}")
def test_bad_repair_config(tiny, cfg):
    with pytest.raises(RepairConfigError):
        cfg.validate(4)
    assert issubclass(RepairConfigError, ModelError)
    c = _case(tiny.runner)
    cache = _copy(tiny.runner, c.pristine)
    for arm in ("repair", "stock"):
        with pytest.raises(RepairConfigError):
            blend(tiny.runner, c.child, cache, c.restored, cfg, arm=arm)
    assert torch.equal(cache.raw, c.pristine.raw)   # refused before anything was written


def test_good_repair_configs_and_from_dict():
    for cfg in (RepairConfig(), RepairConfig(check_layers=(0, 3), recompute_ratio=(0.5, 0.5)),
                RepairConfig(recompute_ratio=1.0, deviation="v")):
        cfg.validate(4)
    d = RepairConfig.from_dict({"check_layers": [1, 2], "recompute_ratio": [0.3, 0.1], "deviation": "v"})
    assert d == RepairConfig((1, 2), (0.3, 0.1), "v") and d.ratios() == (0.3, 0.1)
    assert RepairConfig.from_dict({}) == RepairConfig() and RepairConfig().ratios() == (0.15,)
    assert ARMS == ("full", "naive", "stock", "repair", "epic")
    assert RepairConfig.from_dict({"epic_tokens": 32}).epic_tokens == 32 and RepairConfig().epic_tokens == 16


def test_blend_argument_errors(tiny):
    r, c = tiny.runner, _case(tiny.runner)
    cache = _copy(r, c.pristine)
    with pytest.raises(ModelError, match="arm must be one of"):
        blend(r, c.child, cache, c.restored, arm="cacheblend")
    with pytest.raises(ModelError):
        blend(r, c.child[:-1], cache, c.restored)          # ids shorter than the restored mask
    with pytest.raises(ModelError):
        blend(r, c.child, r.new_cache(c.T - 1, block_size=1), c.restored)
    with pytest.raises(ModelError, match="empty"):
        plan("repair", torch.zeros(0, dtype=torch.bool), RepairConfig(), r.num_layers, r.device)
    assert torch.equal(cache.raw, c.pristine.raw)


def test_plan_keep_sizes():
    restored = torch.zeros(44, dtype=torch.bool)
    restored[13:37] = True
    p = plan("repair", restored, RepairConfig(), 4, torch.device("cpu"))
    assert p.keep == (20 + math.ceil(0.15 * 24),) and p.check_layers == (1,)
    assert p.forced.tolist() == list(range(13)) + list(range(37, 44))
    s = plan("stock", restored, RepairConfig(), 4, torch.device("cpu"))
    assert s.keep == (6,) and s.forced.tolist() == p.forced.tolist()
    n = plan("naive", restored, RepairConfig(), 4, torch.device("cpu"))
    assert n.keep == () and n.check_layers == ()
    allr = torch.ones(10, dtype=torch.bool)
    assert plan("repair", allr, RepairConfig(), 4, torch.device("cpu")).forced.tolist() == [9]
    assert plan("stock", allr, RepairConfig(), 4, torch.device("cpu")).keep == (1,)   # max(int(1.5), 1)


# --- 6. negative control: one flipped bit is seen downstream -----------------------------------------------

def _flip(t: torch.Tensor, bit: int) -> None:
    t.view(torch.int32).bitwise_xor_(1 << bit)


# A high mantissa bit, the highest, and the sign. Not the lowest: one ulp of one K element moves the last query's
# score by ~1e-7 and the attention output by ~1e-9, below its float32 resolution, so whether it reaches the logits
# depends on the CPU's summation order (it did with AVX-512 kernels, not with AVX2 ones). A flip that small is for
# the digest check on arrival to catch (tests/test_ttft_end_to_end.py flips one bit), not for the repair to show.
@pytest.mark.parametrize("bit", [16, 22, 31])
def test_one_flipped_restored_bit_changes_blend(tiny, bit):
    r, c = tiny.runner, _case(tiny.runner)
    base_cache = _copy(r, c.pristine)
    base = blend(r, c.child, base_cache, c.restored, arm="repair")
    kept = torch.nonzero(c.restored & ~base.masks[CHECK])[:, 0]
    pos = int(kept[len(kept) // 2])
    layer = 2                                       # after the check layer: read as restored
    bad = _copy(r, c.pristine)
    cell = bad.k[layer][pos, 1, 3:4]
    before = cell.clone()
    _flip(cell, bit)
    assert not torch.equal(cell, before) and int(torch.count_nonzero(bad.raw != c.pristine.raw)) == 1
    res = blend(r, c.child, bad, c.restored, arm="repair")
    assert torch.equal(res.masks, base.masks)
    changed_kv = any(not torch.equal(a[:, :c.T][res.masks], b[:, :c.T][res.masks])
                     for a, b in zip(bad.stacked(c.T), base_cache.stacked(c.T)))
    assert not torch.equal(res.logits, base.logits) or changed_kv
    if bit == 22:
        assert not torch.equal(res.logits, base.logits)
        assert not torch.equal(bad.k[layer + 1][c.T - 1], base_cache.k[layer + 1][c.T - 1])
    # the same flip at layer 0 (recomputed for every position before the check layer) is overwritten
    early = _copy(r, c.pristine)
    _flip(early.k[0][pos, 1, 3:4], bit)
    again = blend(r, c.child, early, c.restored, arm="repair")
    assert torch.equal(again.logits, base.logits) and torch.equal(early.raw, base_cache.raw)


# --- regressions: bugs found by these tests, fixed in blend.py ------------------------------------------------

def test_naive_with_last_position_restored_gives_next_token_logits(tiny):
    r = tiny.runner
    ids = _ids(32, 20)
    lc = r.new_cache(32)
    full = r.prefill(ids, lc)
    # exact reuse: the same prompt at the same positions, every position but 0 restored from its own prefill
    seg = capture(lc.raw, lc.layout, list(range(1, 32)), list(range(1, 32)))
    cache = r.new_cache(32)
    restore(cache.raw, cache.layout, seg, list(range(1, 32)), list(range(1, 32)), r.rope)
    restored = torch.ones(32, dtype=torch.bool)
    restored[0] = False
    res = blend(r, ids, cache, restored, arm="naive")
    assert torch.allclose(res.logits, full, atol=LOGIT_TOL, rtol=0)


def test_repair_forced_positions_survive_nan_deviation(tiny):
    r, c = tiny.runner, _case(tiny.runner)
    cache = _copy(r, c.pristine)
    cache.k[CHECK][c.doc_slots[:10]] = float("nan")   # more NaN rows than ceil(0.15 · 24) = 4
    res = blend(r, c.child, cache, c.restored, arm="repair")
    assert res.masks[:, ~c.restored].all() and res.masks[:, c.T - 1].all()


def test_transformers_sdpa_policy_keeps_transformers_forward(tiny):
    """The comparison wrapper runs transformers' own SDPA path (same logits) and restores the model's setting."""
    from kmesh.model.runner import transformers_sdpa_policy

    ids = _ids(30, 4)
    before = tiny.model.config._attn_implementation
    with torch.no_grad():
        ref = tiny.model(ids[None]).logits[0, -1]
        with transformers_sdpa_policy(tiny.model):
            assert tiny.model.config._attn_implementation == "kmesh_sdpa"
            got = tiny.model(ids[None]).logits[0, -1]
            gen = tiny.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=3,
                                      do_sample=False, pad_token_id=0)
    assert tiny.model.config._attn_implementation == before
    assert torch.equal(got, ref)
    assert gen.shape == (1, 33)
    # a setting other than transformers' default comes back as it was, not as the default
    other = "eager" if before != "eager" else "sdpa"
    tiny.model.set_attn_implementation(other)
    try:
        with transformers_sdpa_policy(tiny.model):
            assert tiny.model.config._attn_implementation == "kmesh_sdpa"
        assert tiny.model.config._attn_implementation == other
    finally:
        tiny.model.set_attn_implementation(before)


def test_sdpa_backend_rule():
    from torch.nn.attention import SDPBackend

    from kmesh.model.runner import sdpa_backends

    assert SDPBackend.CUDNN_ATTENTION in sdpa_backends(512, True)       # causal prefill: fastest kernel allowed
    assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends(1, True)     # decode step: not reproducible on H200
    assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends(512, False)  # explicit mask


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_attention_calls_are_reproducible():
    """Each SDPA call shape the runner makes, repeated on identical inputs, gives identical bytes (the decode
    step under cuDNN did not on the H200)."""

    from kmesh.model.runner import _sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, Hk, D = 4096, 14, 2, 64
    kv = torch.randn(T, Hk, 2 * D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = kv[..., :D].transpose(0, 1)[None], kv[..., D:].transpose(0, 1)[None]
    qd = torch.randn(1, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qp = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    calls = {"decode": lambda: _sdpa(qd, k, v, enable_gqa=True),
             "prefill": lambda: _sdpa(qp, k, v, is_causal=True, enable_gqa=True)}
    for name, fn in calls.items():
        first = fn()
        assert all(torch.equal(first, fn()) for _ in range(50)), name


def test_pick_ranks_a_nan_deviation_above_every_number_and_below_the_forced_rows():
    """Broken restored data gives a NaN deviation: that row must be recomputed (ranked above any finite
    deviation), but never instead of a forced row (repair's unrestored positions)."""
    from types import SimpleNamespace

    from kmesh.model.blend import pick

    dev = torch.tensor([0.1, float("nan"), 0.5, 0.2])
    assert pick(SimpleNamespace(keep=[1], selection_seed=None), 0, dev, None).tolist() == [1]
    assert pick(SimpleNamespace(keep=[2], selection_seed=None), 0, dev, None).tolist() == [1, 2]
    forced = torch.tensor([False, False, False, True])
    assert pick(SimpleNamespace(keep=[1], selection_seed=None), 0, dev, forced).tolist() == [3]
    assert pick(SimpleNamespace(keep=[2], selection_seed=None), 0, dev, forced).tolist() == [1, 3]
    # k capped at the rows
    assert pick(SimpleNamespace(keep=[9], selection_seed=None), 0, dev, forced).tolist() == [0, 1, 2, 3]
