"""kmesh.reference.decoder and kmesh.reference.repair: the float64 reference the repair's invariants are held to.

The decoder must reproduce the runner's full prefill (a float32 Llama and a Qwen2 with q/k/v biases), and the replay
must pass a correct repair and name each kind of wrong one: a recomputed row with wrong K/V, a query that does not see
its own position, the least deviant positions selected, a position without data left unrecomputed, a restored row
overwritten without being recomputed.
"""
from __future__ import annotations

import math

import pytest
import torch

from kmesh.model.blend import RepairConfig, blend
from kmesh.model.runner import LayerRunner
from kmesh.reference.decoder import DecoderReferenceError, Float64Decoder
from kmesh.reference.repair import rel_err, replay
from tiny_llama import TINY, tiny_llama

T = 96


def _tiny_qwen2(seed: int = 1):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**TINY, use_sliding_window=False)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape))
    return model


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    return model, LayerRunner(model, attention="sdpa"), Float64Decoder(model, LayerRunner(model).rope)


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_decoder_reproduces_the_runners_full_prefill(which):
    model = tiny_llama() if which == "llama" else _tiny_qwen2()
    runner = LayerRunner(model, attention="sdpa")
    dec = Float64Decoder(model, runner.rope)
    ids = torch.randint(0, TINY["vocab_size"], (T,), generator=torch.Generator().manual_seed(3))
    cache = runner.new_cache(T)
    logits = runner.prefill(ids, cache)
    k, v = cache.stacked(T)
    rk, rv, rl = dec.prefill(ids)
    assert rel_err(k, rk) < 1e-5 and rel_err(v, rv) < 1e-5 and rel_err(logits, rl) < 1e-5
    # and it is a different computation: a wrong RoPE theta in the reference is far off
    wrong = Float64Decoder(model, type(runner.rope)(runner.rope.head_dim, runner.rope.rotary_dim,
                                                    runner.rope.theta * 2, runner.rope.style, None,
                                                    runner.rope.max_position))
    assert rel_err(k, wrong.prefill(ids)[0]) > 1e-2


def test_decoder_refuses_what_it_does_not_cover(llama):
    model, _, dec = llama
    with pytest.raises(DecoderReferenceError):
        dec.qkv(7, torch.zeros(2, TINY["hidden_size"], dtype=torch.float64), torch.arange(2))
    with pytest.raises(DecoderReferenceError):
        dec.qkv(0, torch.zeros(2, TINY["hidden_size"], dtype=torch.float64), torch.arange(3))


def _restored_run(runner, seed=5, ratio=0.25):
    """A prompt whose positions [16, 80) hold K/V computed in ANOTHER context (a different prefix), shifted in: what
    a repair exists for. Returns ids, restored mask, the cache before, the blend result and the cache after."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (T,), generator=g)
    other = torch.cat([torch.randint(0, TINY["vocab_size"], (16,), generator=g), ids[16:80]])
    donor = runner.new_cache(T)
    runner.prefill(other, donor)   # same positions 16..79 (no shift needed), different preceding text
    restored = torch.zeros(T, dtype=torch.bool)
    restored[16:80] = True
    cache = runner.new_cache(T, fill=float("nan"))
    for layer in range(runner.num_layers):
        cache.k[layer][16:80] = donor.k[layer][16:80]
        cache.v[layer][16:80] = donor.v[layer][16:80]
    before = cache.stacked(T)
    conf = RepairConfig((1,), ratio, "k")
    res = blend(runner, ids, cache, restored, conf, "repair")
    return ids, restored, before, res, cache.stacked(T), conf


def _replay(dec, ids, restored, before, masks, after, conf, logits):
    return replay(dec, ids, restored, masks, after[0], after[1], before[0], before[1], conf.check_layers,
                  conf.ratios(), conf.deviation, logits)


def test_replay_passes_a_correct_repair(llama):
    _, runner, dec = llama
    ids, restored, before, res, after, conf = _restored_run(runner)
    rep = _replay(dec, ids, restored, before, res.masks, after, conf, res.logits)
    assert rep.selection_ok and rep.forced_always_recomputed and rep.masks_follow_rule and rep.reused_rows_untouched
    assert max(rep.k_rel_err + rep.v_rel_err) < 1e-5 and rep.logits_rel_err < 1e-5
    s = rep.selections[0]
    assert s["kept"] == s["expected_kept"] == 32 + math.ceil(0.25 * 64)


def test_replay_names_a_wrong_recomputed_row(llama):
    _, runner, dec = llama
    ids, restored, before, res, after, conf = _restored_run(runner)
    k = after[0].clone()
    row = int(res.masks[2].nonzero()[3])
    k[2, row] += 0.5
    rep = _replay(dec, ids, restored, before, res.masks, (k, after[1]), conf, res.logits)
    assert rep.k_rel_err[2] > 1e-2 and max(rep.k_rel_err[:2]) < 1e-5


def test_replay_names_a_query_that_does_not_see_itself(llama, monkeypatch):
    model, runner, dec = llama
    plain = LayerRunner.attend

    def blind(self, q, q_pos, k, v, key_pos=None, mask="position", all_rows=False, last_query=False):
        if all_rows or last_query:
            return plain(self, q, q_pos, k, v, key_pos, mask, all_rows, last_query)
        m = k.shape[0]
        allowed = (torch.arange(m)[None, :] < q_pos[:, None]) | (torch.arange(m)[None, :] == 0)
        kk = k.repeat_interleave(self.groups, dim=1).transpose(0, 1)[None]
        vv = v.repeat_interleave(self.groups, dim=1).transpose(0, 1)[None]
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, attn_mask=allowed,
                                                               scale=self.scale)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)

    monkeypatch.setattr(LayerRunner, "attend", blind)
    ids, restored, before, res, after, conf = _restored_run(runner)
    rep = _replay(dec, ids, restored, before, res.masks, after, conf, res.logits)
    assert max(rep.k_rel_err + rep.v_rel_err) > 1e-2 and rep.logits_rel_err > 1e-3


def test_replay_names_the_least_deviant_selection(llama, monkeypatch):
    import kmesh.model.blend as blend_mod

    _, runner, dec = llama
    pick = blend_mod.pick
    monkeypatch.setattr(blend_mod, "pick", lambda p, i, dev, forced: pick(p, i, -dev, forced))
    ids, restored, before, res, after, conf = _restored_run(runner)
    rep = _replay(dec, ids, restored, before, res.masks, after, conf, res.logits)
    assert not rep.selection_ok and rep.selections[0]["missing"] and rep.selections[0]["extra"]


def test_replay_names_a_forced_position_left_out_and_a_touched_restored_row(llama):
    _, runner, dec = llama
    ids, restored, before, res, after, conf = _restored_run(runner)
    masks = res.masks.clone()
    masks[2:, 3] = False           # position 3 has no restored data: it must be recomputed at every layer
    rep = _replay(dec, ids, restored, before, masks, after, conf, res.logits)
    assert not rep.forced_always_recomputed and not rep.masks_follow_rule
    masks[3, 3] = True             # a row back after an earlier layer dropped it: no repair does that
    with pytest.raises(DecoderReferenceError):
        _replay(dec, ids, restored, before, masks, after, conf, res.logits)
    k = after[0].clone()
    row = int((~res.masks[3] & restored).nonzero()[0])
    k[3, row] += 1.0               # a restored row the repair did not recompute, changed anyway
    rep = _replay(dec, ids, restored, before, res.masks, (k, after[1]), conf, res.logits)
    assert not rep.reused_rows_untouched


def test_replay_names_a_last_position_left_out_instead_of_crashing(llama):
    _, runner, dec = llama
    ids, restored, before, res, after, conf = _restored_run(runner)
    masks = res.masks.clone()
    masks[2:, T - 1] = False
    rep = _replay(dec, ids, restored, before, masks, after, conf, res.logits)
    assert not rep.forced_always_recomputed and rep.logits_rel_err == float("inf")
