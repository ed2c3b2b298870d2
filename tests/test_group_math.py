"""kmesh.model.group on a tiny CPU model: layer-major execution, batched group math, failure isolation.

Model: a tiny random float32 LlamaForCausalLM (4 layers, 2 KV heads of 16 channels, as in
tests/test_equivalence_parts.py); workload: ByteTokenizer(300), 3 segments of 80 tokens, 4 children of 352.
Reference everywhere: each child's own blend() (the serial path), on identical restored inputs.
Numerical bound of the batched path (module doc of kmesh.model.group): the rotation and the deviation are
asserted bit-identical; the whole batched prefill is asserted within BATCHED_TOL of serial with equal masks
(on this CPU it is in fact bit-identical, which is recorded by test_batched_group_within_bound's print).
"""
from __future__ import annotations

import pytest
import torch

from kmesh.harness.child import restore_child
from kmesh.harness.leader import export_segments
from kmesh.harness.workload import ByteTokenizer, WorkloadSpec, build
from kmesh.kv.restore import capture
from kmesh.model.blend import ARMS, BlendState, RepairConfig, blend, deviation, plan
from kmesh.model.errors import ModelError
from kmesh.model.group import InjectedMemberFault, LayerwiseRestore, Member, MemberFailure, RestorePart, blend_group
from kmesh.model.runner import LayerRunner
from tiny_llama import tiny_llama

SPEC = WorkloadSpec(prompt_tokens=352, segment_tokens=(80, 80, 80), children=4, block_size=16)
BS = 16
BATCHED_TOL = 1e-5     # relative to max(1, max |logit|)


def _leader(device: torch.device, key: bytes):
    """(runner, workload, the leader's export) on `device`."""
    runner = LayerRunner(tiny_llama().to(device))
    w = build(ByteTokenizer(300), 0, SPEC)
    lc = runner.new_cache(len(w.leader_ids), BS)
    runner.prefill(torch.tensor(w.leader_ids, device=device), lc)
    return runner, w, export_segments(runner, lc, w, key)


@pytest.fixture(scope="module")
def env():
    return _leader(torch.device("cpu"), b"group-test")


def _layerwise_parts(env, caches):
    """Per child: its segments captured at their leader positions with their new positions (a RestorePart), and
    a Member over its cache with its restored mask."""
    runner, w, ex = env
    dev = runner.device
    parts, members = [], []
    for ch, c in zip(w.children, caches):
        sl = ch.segment_slices()
        src = torch.cat([ex.catalog.entries[i].slots(dev) for i, _, _ in sl])
        old = torch.cat([ex.catalog.entries[i].leader_positions(dev) for i, _, _ in sl])
        new = torch.cat([torch.arange(a, b, device=dev) for _, a, b in sl])
        parts.append(RestorePart(c, capture(ex.raw, ex.catalog.layout, src, old), new))
        r = torch.zeros(len(ch.ids), dtype=torch.bool)
        r[new.cpu()] = True
        members.append(Member(ch.name, torch.tensor(ch.ids, device=dev), c, r))
    return parts, members


def _restored(env, lengths=None):
    """Per child: (child, cache with restored inputs, restored mask, T) — T may cut the prompt (ragged groups)."""
    runner, w, ex = env
    out = []
    for i, ch in enumerate(w.children):
        T = len(ch.ids) if lengths is None else lengths[i]
        cache = runner.new_cache(len(ch.ids) + BS, BS, fill=float("nan"))
        r = restore_child(cache, ex.catalog, ex.raw, ch, runner)
        out.append((ch, cache, r[:T].clone(), T))
    return out


def _chunks(ch, T):
    """The child's restored segments inside its first T positions (the epic arm's chunks)."""
    return tuple((a, min(b, T)) for _, a, b in ch.segment_slices() if a < T)


def _serial(env, arm="repair", config=RepairConfig(), lengths=None):
    runner = env[0]
    out = {}
    for ch, cache, r, T in _restored(env, lengths):
        res = blend(runner, torch.tensor(ch.ids[:T]), cache, r, config, arm, chunks=_chunks(ch, T))
        out[ch.name] = (res, cache.raw.clone())
    return out


def _members(env, arm="repair", lengths=None):
    return [Member(ch.name, torch.tensor(ch.ids[:T]), cache, r, arm, _chunks(ch, T))
            for ch, cache, r, T in _restored(env, lengths)]


@pytest.mark.parametrize("arm", ARMS)
def test_layer_major_is_bit_identical_to_serial(env, arm):
    cfg = RepairConfig(check_layers=(1, 2), recompute_ratio=(0.3, 0.15))
    ref = _serial(env, arm, cfg)
    members = [Member(m.name, m.ids, m.cache, m.restored, arm, m.chunks) for m in _members(env)]
    out = blend_group(env[0], members, cfg)
    assert not out.failed and sorted(out.results) == sorted(ref)
    L = env[0].num_layers
    assert [layer for layer, _ in out.order] == sorted(layer for layer, _ in out.order)   # layer-major
    assert out.order[:len(members)] == [(0, m.name) for m in members]
    assert len(out.order) == L * len(members)
    for m in members:
        res, raw = ref[m.name]
        assert torch.equal(res.logits, out.results[m.name].logits)
        assert torch.equal(res.masks, out.results[m.name].masks)
        assert torch.equal(raw, m.cache.raw)     # every K/V byte (and every canary) the same


def test_blend_is_a_loop_of_steps(env):
    runner = env[0]
    (ch, cache, r, T), = _restored(env)[:1]
    p = plan("repair", r, RepairConfig(), runner.num_layers, runner.device)
    s = BlendState(runner, torch.tensor(ch.ids), cache, p)
    with pytest.raises(ModelError, match="stopped at layer 0"):
        s.result()
    for layer in range(runner.num_layers):
        assert s.layer == layer
        s.step()
    ref = _serial(env)[ch.name][0]
    assert s.done and torch.equal(s.result().logits, ref.logits) and torch.equal(s.masks, ref.masks)


def test_batched_rotation_is_bit_identical_to_restore(env):
    runner, w, ex = env
    a = _restored(env)
    caches = [runner.new_cache(len(ch.ids) + BS, BS, fill=float("nan")) for ch in w.children]
    parts, _ = _layerwise_parts(env, caches)
    lr = LayerwiseRestore(runner, parts)
    assert lr.placement_tokens == sum(p.segment.num_tokens for p in parts) and bool(lr.moved.any())
    lr.all_layers()
    for (_, ref, _, _), c in zip(a, caches):
        assert torch.equal(ref.raw, c.raw)


def test_batched_deviation_is_bit_identical_per_row():
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, 2, 16, generator=g) for n in (7, 130, 1, 64)]
    cached = [x + 0.01 * torch.randn(x.shape, generator=g) for x in rows]
    together = deviation(torch.cat(rows), torch.cat(cached)).split([x.shape[0] for x in rows])
    for x, c, t in zip(rows, cached, together):
        assert torch.equal(deviation(x, c), t)


@pytest.mark.parametrize("attention", ["member", "padded"])
@pytest.mark.parametrize("lengths", [None, (352, 300, 352, 200)], ids=["same-length", "ragged"])
def test_batched_group_within_bound(env, lengths, attention):
    runner, w, ex = env
    ref = _serial(env, lengths=lengths)
    members = _members(env, lengths=lengths)
    out = blend_group(runner, members, RepairConfig(), batched=True, attention=attention)
    worst = 0.0
    for m in members:
        a, b = ref[m.name][0], out.results[m.name]
        assert torch.equal(a.masks, b.masks)
        scale = max(1.0, float(a.logits.abs().max()))
        d = float((a.logits - b.logits).abs().max())
        T = len(m.ids)
        kv = (ref[m.name][1].view(torch.float32) - m.cache.raw.view(torch.float32)).nan_to_num().abs().max()
        worst = max(worst, d / scale, float(kv))
        assert int(a.logits.argmax()) == int(b.logits.argmax())
        assert T == b.masks.shape[1]
    print(f"batched vs serial, max relative |Δ| = {worst}")
    assert worst <= BATCHED_TOL


def test_batched_with_layerwise_restore_matches_serial(env):
    runner, w, ex = env
    ref = _serial(env)
    caches = [runner.new_cache(len(ch.ids) + BS, BS, fill=float("nan")) for ch in w.children]
    parts, members = _layerwise_parts(env, caches)
    out = blend_group(runner, members, RepairConfig(), batched=True, restore=LayerwiseRestore(runner, parts))
    for m in members:
        a, b = ref[m.name][0], out.results[m.name]
        assert torch.equal(a.masks, b.masks)
        assert float((a.logits - b.logits).abs().max()) <= BATCHED_TOL * max(1.0, float(a.logits.abs().max()))


def test_a_corrupted_member_input_is_seen_by_the_comparison(env):
    """The agreement checks can fail: one flipped restored byte of one member changes that member only."""
    runner = env[0]
    ref = _serial(env)
    members = _members(env)
    victim = members[1]
    reused = victim.restored & ~ref[victim.name][0].masks[3].cpu()   # layer 3 rows reused, not recomputed
    pos = int(reused.nonzero()[-1, 0])
    victim.cache.k[3][pos].view(torch.uint8)[0, 3] ^= 0x01      # an exponent bit: this key ×4 or ÷4
    out = blend_group(runner, members, RepairConfig(), batched=True)
    assert not torch.equal(out.results[victim.name].logits, ref[victim.name][0].logits)
    for m in members:
        if m is not victim:
            assert float((out.results[m.name].logits - ref[m.name][0].logits).abs().max()) <= BATCHED_TOL * 10


@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
def test_failing_member_leaves_the_group_others_unaffected(env, batched):
    runner = env[0]
    ref = _serial(env)
    members = _members(env)
    seen = []

    def hook(name, layer):
        seen.append((layer, name))
        if name == "B" and layer == 0:
            raise InjectedMemberFault("B fails after layer 0")

    out = blend_group(runner, members, RepairConfig(), batched=batched, after_layer=hook)
    assert out.failed == {"B": (0, "InjectedMemberFault: B fails after layer 0")}
    assert "B" not in out.results
    assert [n for layer, n in seen if layer > 0 and n == "B"] == []
    for m in members:
        if m.name != "B":
            assert torch.equal(out.results[m.name].masks, ref[m.name][0].masks)
            if not batched:
                assert torch.equal(out.results[m.name].logits, ref[m.name][0].logits)


def test_other_errors_in_the_hook_are_not_swallowed(env):
    def hook(name, layer):
        raise RuntimeError("a bug, not a member failure")

    with pytest.raises(RuntimeError, match="a bug"):
        blend_group(env[0], _members(env)[:2], RepairConfig(), after_layer=hook)
    assert issubclass(InjectedMemberFault, MemberFailure)


@pytest.mark.parametrize("batched", [False, True], ids=["layer-major", "batched"])
def test_plans_made_beforehand_give_the_same_group(env, batched):
    """blend_group(plans=...) (what a CUDA graph capture needs: no planning inside) = planning inside it."""
    runner = env[0]
    own = blend_group(runner, _members(env), RepairConfig(), batched=batched)
    members = _members(env)
    plans = {m.name: plan(m.arm, m.restored, RepairConfig(), runner.num_layers, runner.device) for m in members}
    given = blend_group(runner, members, RepairConfig(), batched=batched, plans=plans)
    for n, a in own.results.items():
        assert torch.equal(a.logits, given.results[n].logits) and torch.equal(a.masks, given.results[n].masks)
    with pytest.raises(ModelError, match="plans for"):
        blend_group(runner, _members(env), RepairConfig(), plans={k: plans[k] for k in list(plans)[:2]})


def test_blend_group_argument_errors(env):
    runner = env[0]
    ms = _members(env)[:2]
    with pytest.raises(ModelError, match="empty group"):
        blend_group(runner, [], RepairConfig())
    with pytest.raises(ModelError, match="unique"):
        blend_group(runner, [ms[0], ms[0]], RepairConfig())
    with pytest.raises(ModelError, match="repair and full"):
        blend_group(runner, [Member("x", ms[0].ids, ms[0].cache, ms[0].restored, "stock")], RepairConfig(),
                    batched=True)
    with pytest.raises(ModelError, match="batched path"):
        blend_group(runner, ms, RepairConfig(), restore=object())   # type: ignore[arg-type]
    with pytest.raises(ModelError, match="at least one member"):
        LayerwiseRestore(runner, [])
    with pytest.raises(ModelError, match="attention must be"):
        blend_group(runner, ms, RepairConfig(), batched=True, attention="dense")


@pytest.mark.gpu
def test_cuda_layer_major_exact_batched_bounded_and_blend_still_graph_capturable():
    """On a GPU: layer-major = serial bit for bit, batched within BATCHED_TOL, and blend() (now a loop of
    BlendState steps) still captures as one CUDA graph equal to its eager run."""
    from kmesh.model.graphs import GraphedBlend

    env_ = _leader(torch.device("cuda"), b"group-test-cuda")
    runner = env_[0]
    ref = _serial(env_)
    members = _members(env_)
    out = blend_group(runner, members, RepairConfig())
    for m in members:
        assert torch.equal(ref[m.name][0].logits, out.results[m.name].logits)
        assert torch.equal(ref[m.name][1], m.cache.raw)
    members = _members(env_)
    out = blend_group(runner, members, RepairConfig(), batched=True)
    for m in members:
        a, b = ref[m.name][0], out.results[m.name]
        assert torch.equal(a.masks, b.masks)
        assert float((a.logits - b.logits).abs().max()) <= BATCHED_TOL * max(1.0, float(a.logits.abs().max()))
    for arm in ("repair", "epic"):
        ch, cache, r, T = _restored(env_)[0]
        g = GraphedBlend(runner, torch.tensor(ch.ids), cache, r, RepairConfig(), arm, chunks=_chunks(ch, T))
        assert all(g.verify_against_eager().values()), arm


@pytest.mark.gpu
def test_cuda_graphed_group_equals_eager_and_the_check_can_fail():
    """GraphedRun over the batched group with its layer-wise restore (the group stage's graphed arm): replay equals
    the eager run byte for byte from poisoned caches; a function whose eager run writes other bytes than its
    capture (a host-side counter baked into the graph) is reported unequal."""
    from kmesh.model.graphs import GraphedRun

    dev = torch.device("cuda")
    env_ = _leader(dev, b"group-graph-cuda")
    runner, w, _ = env_
    caches = [runner.new_cache(len(ch.ids) + BS, BS, fill=float("nan")) for ch in w.children]
    parts, members = _layerwise_parts(env_, caches)
    restore = LayerwiseRestore(runner, parts)
    plans = {m.name: plan(m.arm, m.restored, RepairConfig(), runner.num_layers, dev) for m in members}

    def fn():
        out = blend_group(runner, members, RepairConfig(), batched=True, restore=restore, plans=plans)
        return {n: x.logits for n, x in out.results.items()}

    g = GraphedRun(fn, [c.raw for c in caches])
    assert g.verify_against_eager()["equal"]
    counter = iter(range(1, 1000))
    t = torch.zeros(8, device=dev)
    bad = GraphedRun(lambda: {"t": t.fill_(float(next(counter)))}, [t])
    got = bad.verify_against_eager()
    assert not got["equal"] and got["outputs"] == {"t": False}
