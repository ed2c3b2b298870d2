"""Batched decode and teacher forcing (kmesh.model.quality.decode_batch / teacher_forced_logits_batch over
LayerRunner.extend_batch) against the one-request-at-a-time paths they replace in the RAG quality case: the same
greedy tokens, the same end-of-turn rule, the same teacher-forced logits up to float rounding, whatever the rows'
continuation lengths, and no row's outcome touched. Tiny seeded Llama (GQA 4:2), float32, CPU; ~3 s.

Measured (torch 2.13 CPU): batched vs single teacher-forced logits max |Δ| ~1e-6 (bound 1e-5); tokens equal."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kmesh.model.errors import ModelError
from kmesh.model.quality import decode_batch, teacher_forced_logits, teacher_forced_logits_batch
from kmesh.model.runner import LayerRunner
from tiny_llama import TINY, tiny_llama

TOL = 1e-5
T = 40


@pytest.fixture(scope="module")
def runner():
    return LayerRunner(tiny_llama())


def _outcome(runner: LayerRunner, seed: int) -> SimpleNamespace:
    """A prefilled state as the quality case holds it (K/V copies, next-token logits), of a prompt of its own."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (T,), generator=g)
    cache = runner.new_cache(T)
    logits = runner.prefill(ids, cache)
    k, v = cache.stacked(T)
    return SimpleNamespace(k=k, v=v, logits=logits, ids=ids)


def _decoded(runner: LayerRunner, o: SimpleNamespace, n: int, stop: tuple[int, ...] = ()) -> list[int]:
    cache = runner.new_cache(T + n)
    for layer in range(runner.num_layers):
        cache.write_prefix(layer, o.k[layer], o.v[layer])
    return runner.decode(cache, T, o.logits, n, stop_ids=stop)


@pytest.fixture(scope="module")
def outcomes(runner):
    return [_outcome(runner, s) for s in range(5)]


def test_decode_batch_gives_each_rows_own_greedy_tokens(runner, outcomes):
    before = [(o.k.clone(), o.v.clone()) for o in outcomes]
    single = [_decoded(runner, o, 9) for o in outcomes]
    assert decode_batch(runner, outcomes, 9) == single
    assert len({tuple(t) for t in single}) > 1           # the rows differ: a mixed-up row would show
    assert all(torch.equal(o.k, k) and torch.equal(o.v, v) for o, (k, v) in zip(outcomes, before))
    assert decode_batch(runner, outcomes, 1) == [t[:1] for t in single]
    assert decode_batch(runner, outcomes, 2) == [t[:2] for t in single]     # one step


def test_decode_batch_stops_each_row_at_its_own_end_of_turn(runner, outcomes):
    free = [_decoded(runner, o, 9) for o in outcomes]
    # an end-of-turn token that row 0 reaches at step 3 and other rows elsewhere or never
    stop = (free[0][3],)
    want = [_decoded(runner, o, 9, stop) for o in outcomes]
    got = decode_batch(runner, outcomes, 9, stop)
    assert got == want
    assert got[0] == free[0][:free[0].index(stop[0]) + 1]
    assert any(len(t) == 9 for t in got)                   # a row that never stops runs on beside the stopped one
    # every row ends inside the loop (each at its second token or before): the rows so far, not nothing
    seconds = tuple({t[1] for t in free})
    assert decode_batch(runner, outcomes, 9, seconds) == [_decoded(runner, o, 9, seconds) for o in outcomes]
    # every row stopped at its first token: nothing is computed
    firsts = tuple(t[0] for t in free)
    assert decode_batch(runner, outcomes, 9, firsts) == [t[:1] for t in free]


def test_teacher_forced_batch_equals_one_at_a_time(runner, outcomes):
    conts = [_decoded(runner, o, n) for o, n in zip(outcomes, (9, 1, 4, 9, 6))]   # lengths differ: padding
    got = teacher_forced_logits_batch(runner, outcomes, conts)
    for o, cont, rows in zip(outcomes, conts, got):
        one = teacher_forced_logits(runner, o, cont)
        assert rows.shape == (len(cont), TINY["vocab_size"])
        assert torch.equal(rows[0], o.logits)
        torch.testing.assert_close(rows, one, rtol=TOL, atol=TOL)
    # one fed token (a continuation of two) and two (the shortest forward with a causal mask among the fed tokens)
    two = [t[:2] for t in conts if len(t) >= 2]
    for o, cont, rows in zip([o for o, t in zip(outcomes, conts) if len(t) >= 2], two,
                             teacher_forced_logits_batch(runner, [o for o, t in zip(outcomes, conts) if len(t) >= 2],
                                                         two)):
        assert rows.shape[0] == 2
        torch.testing.assert_close(rows, teacher_forced_logits(runner, o, cont), rtol=TOL, atol=TOL)
    three = [t[:3] for t in conts if len(t) >= 3]
    for o, cont, rows in zip([o for o, t in zip(outcomes, conts) if len(t) >= 3], three,
                             teacher_forced_logits_batch(runner, [o for o, t in zip(outcomes, conts) if len(t) >= 3],
                                                         three)):
        torch.testing.assert_close(rows, teacher_forced_logits(runner, o, cont), rtol=TOL, atol=TOL)
    # a row's logits do not depend on what the other rows are fed, nor on how far they are padded
    alone = teacher_forced_logits_batch(runner, outcomes[2:3], conts[2:3])[0]
    torch.testing.assert_close(alone, got[2], rtol=TOL, atol=TOL)
    other = [conts[0], [(t + 1) % TINY["vocab_size"] for t in conts[1]] + [7] * 8, *conts[2:]]
    torch.testing.assert_close(teacher_forced_logits_batch(runner, outcomes, other)[0], got[0], rtol=TOL, atol=TOL)
    # the continuation matters: feeding row 0 other tokens changes its later rows
    shifted = [[(t + 1) % TINY["vocab_size"] for t in conts[0]], *conts[1:]]
    assert not torch.equal(teacher_forced_logits_batch(runner, outcomes, shifted)[0][1:], got[0][1:])


def test_batched_refusals(runner, outcomes):
    with pytest.raises(ValueError, match="at least one"):
        teacher_forced_logits_batch(runner, outcomes[:2], [[1, 2], []])
    with pytest.raises(ValueError, match="2 outcomes but 1"):
        teacher_forced_logits_batch(runner, outcomes[:2], [[1, 2]])
    short = SimpleNamespace(k=outcomes[0].k[:, :T - 1], v=outcomes[0].v[:, :T - 1], logits=outcomes[0].logits)
    with pytest.raises(ValueError, match="different shapes"):
        decode_batch(runner, [outcomes[1], short], 4)
    k = torch.zeros(runner.num_layers, 2, T + 1, runner.num_kv_heads, runner.head_dim)
    ids = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ModelError, match="batched K/V"):      # K and V of different shapes, each well formed
        runner.extend_batch(k, k[:, :, :T].clone(), T - 1, ids)
    with pytest.raises(ModelError, match="batched K/V"):      # not [layers, B, slots, heads, D]
        runner.extend_batch(k.flatten(3), k.flatten(3).clone(), T - 1, ids)
    with pytest.raises(ModelError, match="cannot hold"):
        runner.extend_batch(k, k.clone(), T, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ModelError, match="batched K/V"):
        runner.extend_batch(k, k.clone(), T - 1, torch.zeros(3, 1, dtype=torch.long))


def test_batch_runs_in_the_models_dtype():
    """A bfloat16 model's states batch as bfloat16 (a float32 buffer would meet bf16 queries in attention)."""
    runner = LayerRunner(tiny_llama().to(torch.bfloat16))
    outs = [_outcome(runner, s) for s in range(2)]
    conts = [_decoded(runner, o, 4) for o in outs]
    got = teacher_forced_logits_batch(runner, outs, conts)
    for o, cont, rows in zip(outs, conts, got):
        assert rows.dtype == torch.bfloat16
        one = teacher_forced_logits(runner, o, cont)
        scale = float(one.abs().max())
        torch.testing.assert_close(rows.float(), one.float(), rtol=0, atol=0.05 * scale)
    assert [len(t) for t in decode_batch(runner, outs, 4)] == [4, 4]
