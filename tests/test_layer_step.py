"""kmesh.model.layer_step: a layer's math over plain weight tensors (what `layer_step="compiled"` compiles) against
the checkpoint's own modules, and the check layer that projects Q only for the rows it keeps.

The functions are checked uncompiled in float32 against the modules (the same operations in the same order: equal
to float rounding, measured bit for bit here), traced whole by torch.compile's aot_eager
backend with dynamic row counts (no graph break: fullgraph), and compiled by Inductor on the GPU (skipped here).
"""
from __future__ import annotations

import copy

import pytest
import torch

from kmesh.model.blend import RepairConfig, blend
from kmesh.model.errors import ModelError
from kmesh.model.layer_step import CompiledSteps, LayerStepError, layer_weights
from kmesh.model.runner import LayerRunner
from test_model_runner import _case, _copy, _repair_expected_keep, _tiny_model

F32_TOL = 1e-6      # the same operations in float32 (the runner's lowest-rounding dtype): measured 0
AOT_TOL = 1e-5      # traced by dynamo / AOTAutograd, float32: measured 0


def _identity(fn):
    return fn


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(eager runner, runner whose layers run layer_step's functions uncompiled), float32."""
    model = _tiny_model(request.param)
    eager = LayerRunner(model)
    steps = LayerRunner(model)
    steps.steps = CompiledSteps(model, compile_fn=_identity)
    return eager, steps


def test_prefill_through_the_functions_equals_the_modules(pair):
    eager, steps = pair
    c = _case(eager)
    cache = steps.new_cache(c.T + 8)
    logits = steps.prefill(c.child, cache)
    assert float((logits - c.full).abs().max()) <= F32_TOL * float(c.full.abs().max())
    for a, b in zip(cache.stacked(c.T), c.full_cache.stacked(c.T)):
        assert float((a - b).abs().max()) <= F32_TOL


@pytest.mark.parametrize("arm, deviation", [("repair", "k"), ("repair", "v"), ("stock", "k"), ("naive", "k")])
def test_blend_through_the_functions_equals_the_modules(pair, arm, deviation):
    eager, steps = pair
    c = _case(eager)
    cfg = RepairConfig(deviation=deviation)
    e = blend(eager, c.child, _copy(eager, c.pristine), c.restored, cfg, arm=arm)
    s_cache = _copy(steps, c.pristine)
    s = blend(steps, c.child, s_cache, c.restored, cfg, arm=arm)
    assert torch.equal(e.masks, s.masks)
    assert float((e.logits - s.logits).abs().max()) <= F32_TOL * float(e.logits.abs().max())


def test_check_layer_rows_equal_a_full_projection_of_those_rows(pair):
    """check_qkv + kept_qv give the kept rows exactly what qkv() of every row gives them (both paths)."""
    for r in pair:
        c = _case(r)
        pos = torch.arange(c.T)
        rot = r.rotary(pos)
        h = torch.randn(c.T, r.config.hidden_size, generator=torch.Generator().manual_seed(3))
        q, k, v = r.qkv(1, h, pos, rot)
        rows = torch.tensor([0, 5, 6, c.T - 1])
        for with_v in (False, True):
            x, kc, vc = r.check_qkv(1, h, rot, with_v=with_v)
            assert torch.allclose(kc, k, rtol=0, atol=F32_TOL) and (vc is None) == (not with_v)
            kept_rot = (rot[0][rows], rot[1][rows])
            qk, vk = r.kept_qv(1, x[rows], kept_rot, None if vc is None else vc[rows])
            assert torch.allclose(qk, q[rows], rtol=0, atol=F32_TOL)
            assert torch.allclose(vk, v[rows], rtol=0, atol=F32_TOL)


def test_repair_projects_q_only_for_the_rows_the_check_keeps():
    """At the check layer K is projected for every row and Q only for the rows that stay recomputed (before,
    every row's Q was projected and the dropped rows' thrown away)."""
    model = _tiny_model("qwen2")
    r = LayerRunner(model)
    c = _case(r)
    seen: dict[str, list[int]] = {"q": [], "k": []}
    att = model.model.layers[1].self_attn
    hooks = [att.q_proj.register_forward_hook(lambda m, i, o: seen["q"].append(i[0].shape[0])),
             att.k_proj.register_forward_hook(lambda m, i, o: seen["k"].append(i[0].shape[0]))]
    try:
        blend(r, c.child, _copy(r, c.pristine), c.restored, arm="repair")
    finally:
        for hk in hooks:
            hk.remove()
    assert seen == {"q": [_repair_expected_keep(c.restored)], "k": [c.T]}
    assert _repair_expected_keep(c.restored) < c.T


def test_a_v_deviation_check_projects_v_once_for_every_row_and_q_for_the_kept():
    """deviation="v": the check projects K and V of every row, and only Q of the rows it keeps; the kept rows' V
    is the compared one narrowed, not projected again (the values would be the same: only a count shows it)."""
    model = _tiny_model("qwen2")
    r = LayerRunner(model)
    c = _case(r)
    seen: dict[str, list[int]] = {"q": [], "k": [], "v": []}
    att = model.model.layers[1].self_attn
    hooks = [getattr(att, f"{n}_proj").register_forward_hook(lambda m, i, o, n=n: seen[n].append(i[0].shape[0]))
             for n in seen]
    try:
        got = blend(r, c.child, _copy(r, c.pristine), c.restored, RepairConfig(deviation="v"), arm="repair")
    finally:
        for hk in hooks:
            hk.remove()
    keep = int(got.masks[1].sum())
    assert seen == {"q": [keep], "k": [c.T], "v": [c.T]}
    assert keep < c.T


def test_the_rotary_rows_are_computed_once_a_request_and_qkv_computes_them_when_not_given():
    """blend() and prefill() look the checkpoint's rotary table up once and carry the rows (narrowed with the
    state) to every layer's qkv(); qkv() without them computes the same rows itself (the values would be the same
    either way: only a count shows a layer computing them again)."""
    model = _tiny_model("qwen2")
    r = LayerRunner(model)
    c = _case(r)
    calls = []
    hook = model.model.rotary_emb.register_forward_hook(lambda m, i, o: calls.append(i[1].shape[-1]))
    try:
        for arm in ("repair", "full", "stock", "naive"):
            calls.clear()
            blend(r, c.child, _copy(r, c.pristine), c.restored, arm=arm)
            assert len(calls) == 1, arm
        calls.clear()
        r.prefill(c.child, r.new_cache(c.T))
        assert calls == [c.T]
    finally:
        hook.remove()
    pos = torch.tensor([0, 3, 4, c.T - 1])
    h = torch.randn(4, r.config.hidden_size, generator=torch.Generator().manual_seed(7))
    for a, b in zip(r.qkv(1, h, pos), r.qkv(1, h, pos, r.rotary(pos))):
        assert torch.equal(a, b)


def test_compiled_functions_trace_whole_with_dynamic_row_counts():
    """torch.compile (aot_eager: dynamo's trace without Inductor's code generation) of every function, fullgraph
    and dynamic: no graph break, and the traced runner's prefill and repair equal the modules'."""
    model = _tiny_model("qwen2")
    eager = LayerRunner(model)
    traced = LayerRunner(model)
    torch._dynamo.reset()
    traced.steps = CompiledSteps(model, compile_fn=lambda fn: torch.compile(fn, backend="aot_eager", dynamic=True,
                                                                             fullgraph=True))
    for child_prefix in (13, 6):    # two prompt lengths: other row counts, the same traces
        c = _case(eager, child_prefix=child_prefix)
        cache = traced.new_cache(c.T + 8)
        assert float((traced.prefill(c.child, cache) - c.full).abs().max()) <= AOT_TOL * float(c.full.abs().max())
        e = blend(eager, c.child, _copy(eager, c.pristine), c.restored, arm="repair")
        t = blend(traced, c.child, _copy(traced, c.pristine), c.restored, arm="repair")
        assert torch.equal(e.masks, t.masks)
        assert float((e.logits - t.logits).abs().max()) <= AOT_TOL * float(e.logits.abs().max())


def test_layer_step_refuses_what_it_does_not_implement():
    model = _tiny_model("llama")
    with pytest.raises(ModelError, match="layer_step must be one of"):
        LayerRunner(model, layer_step="fused")
    other = copy.deepcopy(model)
    other.config.hidden_act = "gelu"
    with pytest.raises(LayerStepError, match="SiLU"):
        layer_weights(other)
    w = layer_weights(model)
    assert len(w) == model.config.num_hidden_layers
    assert w[0].wq is model.model.layers[0].self_attn.q_proj.weight   # references, never copies


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_inductor_step_matches_eager_and_its_graph_replays_bit_for_bit():
    """Inductor's fused layer step in bf16 on the GPU: logits within 2e-2 of max |logit| of the eager modules'
    (bf16 rounding of a reduction in another order), the same next token, and a CUDA graph of the compiled repair
    equal bit for bit to the same compiled repair run eagerly."""
    from kmesh.model.graphs import GraphedBlend

    model = _tiny_model("qwen2").to("cuda", torch.bfloat16)
    eager = LayerRunner(model)
    compiled = LayerRunner(model, layer_step="compiled")
    c = _case(eager)
    e = blend(eager, c.child, _copy(eager, c.pristine), c.restored, arm="repair")
    t = blend(compiled, c.child, _copy(compiled, c.pristine), c.restored, arm="repair")
    scale = float(e.logits.float().abs().max())
    assert float((e.logits.float() - t.logits.float()).abs().max()) <= 2e-2 * max(scale, 1.0)
    assert int(e.logits.argmax()) == int(t.logits.argmax())
    g = GraphedBlend(compiled, c.child, _copy(compiled, c.pristine), c.restored, RepairConfig(), "repair")
    assert g.verify_against_eager() == {"logits": True, "masks": True, "cache_bytes": True}
    # the same prefill gives the same bits after other variants were compiled (a decode step's one row, the repair's
    # narrowed rows): with timed kernel choices a later variant could take another reduction blocking
    first = compiled.prefill(c.child, compiled.new_cache(c.T + 8))
    cache = compiled.new_cache(c.T + 8)
    compiled.decode(cache, c.T, compiled.prefill(c.child, cache), 4)
    blend(compiled, c.child, _copy(compiled, c.pristine), c.restored, RepairConfig(deviation="v"), arm="repair")
    assert torch.equal(first, compiled.prefill(c.child, compiled.new_cache(c.T + 8)))


@pytest.mark.parametrize("mode", [(False, False), (True, False), (True, True)], ids=["off", "on", "warn-only"])
def test_write_distinct_writes_what_write_does_and_gives_the_deterministic_mode_back(mode):
    """The scatter without the deterministic mode's sort lands the same bytes as write(), and the mode (on or off,
    warn-only or not) is what it was afterwards — also when the write raises."""
    r = LayerRunner(_tiny_model("qwen2"))
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    slots = torch.tensor([9, 2, 5])
    k = torch.randn(3, r.num_kv_heads, r.head_dim)
    v = torch.randn(3, r.num_kv_heads, r.head_dim)
    a, b = r.new_cache(16, fill=float("nan")), r.new_cache(16, fill=float("nan"))
    try:
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
        a.write(1, slots, k, v)
        b.write_distinct(1, slots, k, v)
        assert (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) == mode
        with pytest.raises((IndexError, RuntimeError)):
            b.write_distinct(1, torch.tensor([99]), k[:1], v[:1])
        assert (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) == mode
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert torch.equal(a.raw, b.raw)
    assert torch.equal(b.k[1][slots], k) and torch.equal(b.v[1][slots], v)


def test_tokens_agree_allows_a_divergence_only_at_a_near_tie():
    from kmesh.model.quality import tokens_agree

    wide = torch.tensor([0.0, 5.0, 1.0])      # token 1 by a margin of 4
    tie = torch.tensor([2.0, 2.05, 0.0])      # token 1 by 0.05
    assert tokens_agree([1, 1, 1], [1, 1, 1], [wide] * 3, 0.1) == {
        "first_divergence": None, "bound": 0.1, "agree": True, "margin": None}
    assert tokens_agree([1, 1, 1, 7], [1, 1, 1], [wide] * 3, 0.1)["agree"]      # longer: compared up to the reference
    near = tokens_agree([1, 0, 5], [1, 1, 1], [wide, tie, wide], 0.1)
    assert near["agree"] and near["first_divergence"] == 1 and abs(near["margin"] - 0.05) < 1e-6
    far = tokens_agree([1, 0, 1], [1, 1, 1], [wide, wide, wide], 0.1)
    assert not far["agree"] and far["first_divergence"] == 1 and far["margin"] == 4.0
    assert not tokens_agree([1, 0], [1, 1], [wide, tie], 0.01)["agree"]    # 0.05 > 2 × 0.01
    assert not tokens_agree([1], [1, 1], [wide, tie], 0.1)["agree"]         # stopped short of the reference


def test_eps_is_read_under_either_attribute_name_and_a_norm_without_one_is_refused():
    """transformers' RMSNorms keep `variance_epsilon`; torch.nn.RMSNorm (also accepted by name) keeps `eps`."""
    from types import SimpleNamespace

    from kmesh.model.layer_step import _eps

    assert _eps(SimpleNamespace(variance_epsilon=1e-5)) == 1e-5
    assert _eps(torch.nn.RMSNorm(8, eps=1e-3)) == 1e-3
    with pytest.raises(LayerStepError, match="no epsilon"):
        _eps(SimpleNamespace(epsilon=1e-6))


def test_a_config_without_hidden_act_is_refused_as_a_layer_step_error():
    from types import SimpleNamespace

    with pytest.raises(LayerStepError, match="SiLU"):     # not an AttributeError
        layer_weights(SimpleNamespace(config=SimpleNamespace(model_type="llama")))


def test_fresh_compiled_steps_give_the_check_layer_what_the_modules_give():
    """Each function CompiledSteps wraps is the one its name says: a runner built here (not the module-scoped
    fixture's) runs the check layer's K-only, K+V, Q-only and Q+V steps and equals the modules."""
    model = _tiny_model("qwen2")
    eager, steps = LayerRunner(model), LayerRunner(model)
    steps.steps = CompiledSteps(model, compile_fn=_identity)
    pos = torch.arange(11)
    rot = eager.rotary(pos)
    h = torch.randn(11, eager.config.hidden_size, generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([1, 4, 10])
    kept_rot = (rot[0][rows], rot[1][rows])
    for with_v in (False, True):
        want, got = eager.check_qkv(1, h, rot, with_v), steps.check_qkv(1, h, rot, with_v)
        for a, b in zip(want, got):
            assert (a is None and b is None) or torch.allclose(a, b, rtol=0, atol=F32_TOL)
        v = None if got[2] is None else got[2][rows]
        for a, b in zip(eager.kept_qv(1, want[0][rows], kept_rot, v), steps.kept_qv(1, got[0][rows], kept_rot, v)):
            assert torch.allclose(a, b, rtol=0, atol=F32_TOL)


def test_tokens_agree_at_the_bound_exactly_and_with_short_or_two_entry_logits():
    from kmesh.model.quality import tokens_agree

    pair = torch.tensor([0.0, 0.5])           # a vocabulary of two: token 1 by 0.5 (exact in binary)
    assert tokens_agree([0], [1], [pair], 0.25) == {"first_divergence": 0, "bound": 0.25, "agree": True,
                                                    "margin": 0.5}     # 0.5 == 2 × 0.25: still a tie
    assert not tokens_agree([0], [1], [pair], 0.2)["agree"]            # 0.5 > 2 × 0.2 (< 3 × 0.2)
    wide = torch.tensor([0.0, 5.0, 1.0])
    # the divergence lies past the logits given, or the second path stopped short: no margin, no agreement
    assert tokens_agree([1, 0], [1, 1], [wide], 0.1) == {"first_divergence": 1, "bound": 0.1, "agree": False,
                                                         "margin": None}
    assert tokens_agree([1], [1, 1], [wide, wide], 0.1) == {"first_divergence": 1, "bound": 0.1, "agree": False,
                                                            "margin": None}


def test_every_bias_of_a_llama_with_attention_and_mlp_biases_is_applied():
    """Llama's attention_bias / mlp_bias put biases on o_proj and the MLP's three projections too (the tiny Qwen2
    has only q/k/v biases): the functions' prefill equals the modules' with every bias nonzero."""
    transformers = pytest.importorskip("transformers")
    from test_model_runner import TINY

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True))
    model = model.float().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    blk = model.model.layers[0]
    assert all(m.bias is not None for m in (blk.self_attn.o_proj, blk.mlp.gate_proj, blk.mlp.up_proj,
                                            blk.mlp.down_proj))
    eager, steps = LayerRunner(model), LayerRunner(model)
    steps.steps = CompiledSteps(model, compile_fn=_identity)
    ids = torch.randint(0, TINY["vocab_size"], (12,), generator=g)
    want = eager.prefill(ids, eager.new_cache(16))
    got = steps.prefill(ids, steps.new_cache(16))
    assert float((got - want).abs().max()) <= F32_TOL * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_equals_the_modules_norm_in_a_half_precision_model(dtype):
    """Statistics in float32, the result cast back to the model dtype before the weight: bit for bit the
    checkpoint's RMSNorm (the float32 tests cannot see a missing cast back)."""
    from kmesh.model.layer_step import rms_norm

    model = _tiny_model("llama").to(dtype)
    w = layer_weights(model)[1]
    h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = rms_norm(h, w.ln1, w.eps1)
    assert got.dtype == dtype and torch.equal(got, model.model.layers[1].input_layernorm(h))


def test_layer_step_compiled_makes_the_runner_run_the_functions(monkeypatch):
    """`layer_step="compiled"` builds the CompiledSteps (here with a counting stand-in for torch.compile: no
    Inductor on the CPU) and the runner's layers run through them; the default runs the modules."""
    import kmesh.model.layer_step as layer_step

    calls: dict[str, int] = {}

    def counting(fn):
        def run(*args, **kwargs):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(layer_step, "_compile", counting)
    model = _tiny_model("qwen2")
    eager = LayerRunner(model)
    assert eager.layer_step == "eager" and eager.steps is None
    compiled = LayerRunner(model, layer_step="compiled")
    assert compiled.layer_step == "compiled" and isinstance(compiled.steps, CompiledSteps)
    ids = torch.arange(3, 15)
    want = eager.prefill(ids, eager.new_cache(16))
    got = compiled.prefill(ids, compiled.new_cache(16))
    assert calls == {"norm_qkv": model.config.num_hidden_layers, "finish": model.config.num_hidden_layers}
    assert float((got - want).abs().max()) <= F32_TOL * float(want.abs().max())


def test_blend_runs_the_fused_causal_kernel_while_the_rows_are_every_position(monkeypatch):
    """The full arm's layers, and a repair's layers before its first check, attend through the fused causal kernel
    (all_rows), not an explicit mask (the values agree to rounding: only the kernel's arguments show it)."""
    import kmesh.model.runner as runner_mod

    causal: list[bool] = []
    real = runner_mod._sdpa

    def spy(q, k, v, **kw):
        causal.append(bool(kw.get("is_causal", False)) and "attn_mask" not in kw)
        return real(q, k, v, **kw)

    r = LayerRunner(_tiny_model("qwen2"))
    c = _case(r)
    monkeypatch.setattr(runner_mod, "_sdpa", spy)
    blend(r, c.child, _copy(r, c.pristine), c.restored, arm="full")
    assert causal == [True] * r.num_layers
    causal.clear()
    blend(r, c.child, _copy(r, c.pristine), c.restored, arm="repair")     # check layer 1
    assert causal == [True] + [False] * (r.num_layers - 1)
