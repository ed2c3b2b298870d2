"""A decoder layer's math over the checkpoint's own weight tensors, so torch.compile can fuse it (issue 22 item 4).

transformers' modules run a layer's element-wise work as many small kernels: RMSNorm six (cast, square, mean,
add + rsqrt, multiply, cast back, weight), RoPE six per tensor (two slices, a negation, a concatenation, two
products and a sum), SiLU and the gate product, two residual adds. On the H200 at 4k tokens these launches and
memory passes were about half of a repair's 8.1 ms of kernel time (docs/measurements/equivalence-h200/
blend_profile.json), and they cost the full arm as much per row. The same math written here as functions of
plain tensors lets Inductor fuse each chain into one or two kernels; the matrix products stay cuBLAS calls.

`CompiledSteps` holds the compiled functions and each layer's weights (references, never copies). The runner
(kmesh.model.runner, `layer_step="compiled"`) calls them instead of the modules, for every arm alike: full and
repair share the runner, so a comparison between them stays fair.

Numerics: the functions compute what the modules compute, in the same dtypes (the norm's statistics in float32,
RoPE in the model dtype), but a fused reduction may sum in another order, so they equal the modules up to float
rounding, not bit for bit. That is checked, not assumed: against the modules in float64 on the CPU (tests), and
against transformers' own forward on the GPU (the equivalence stage's runner case, within runner_logits_bound).
A CUDA graph of a compiled blend is still compared bit for bit with the same compiled blend run eagerly.

The check layer needs only K (or V) of every row (kmesh.model.blend): `norm_k` / `norm_kv` give the normed
rows and the compared projection, `q_rows` / `qv_rows` the rest for the rows the selection kept.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from kmesh.model.errors import ModelError

LAYER_STEPS = ("eager", "compiled")


class LayerStepError(ModelError):
    """The compiled layer step cannot run this model (an activation or norm it does not implement)."""


class LayerWeights(NamedTuple):
    ln1: torch.Tensor
    eps1: float
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    eps2: float
    wg: torch.Tensor
    bg: torch.Tensor | None
    wu: torch.Tensor
    bu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama / Qwen2 RMSNorm: statistics in float32, the weight applied after the cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D] rotated by cos, sin [n, D] (the rotate-half convention of Llama / Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _heads(y: torch.Tensor, heads: int) -> torch.Tensor:
    return y.view(y.shape[0], heads, -1)


def norm_qkv(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, Q/K/V projections, RoPE on Q and K: post-RoPE q [n, heads, D], k, v [n, kv_heads, D]."""
    x = rms_norm(h, w.ln1, w.eps1)
    q = _heads(F.linear(x, w.wq, w.bq), heads)
    k = _heads(F.linear(x, w.wk, w.bk), kv_heads)
    v = _heads(F.linear(x, w.wv, w.bv), kv_heads)
    return rope(q, cos, sin), rope(k, cos, sin), v


def norm_k(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
           kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A check layer's first half: the normed rows and post-RoPE K of every row."""
    x = rms_norm(h, w.ln1, w.eps1)
    return x, rope(_heads(F.linear(x, w.wk, w.bk), kv_heads), cos, sin)


def norm_kv(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
            kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_k with V too (a check layer that compares V)."""
    x, k = norm_k(h, w, cos, sin, kv_heads)
    return x, k, _heads(F.linear(x, w.wv, w.bv), kv_heads)


def q_rows(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Post-RoPE Q of normed rows x (the rows a check layer kept)."""
    return rope(_heads(F.linear(x, w.wq, w.bq), heads), cos, sin)


def qv_rows(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, heads: int,
            kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE Q and V of normed rows x."""
    return q_rows(x, w, cos, sin, heads), _heads(F.linear(x, w.wv, w.bv), kv_heads)


def finish(h: torch.Tensor, attn: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """o_proj + residual, then post-attention norm + SiLU-gated MLP + residual."""
    h = h + F.linear(attn, w.wo, w.bo)
    x = rms_norm(h, w.ln2, w.eps2)
    return h + F.linear(F.silu(F.linear(x, w.wg, w.bg)) * F.linear(x, w.wu, w.bu), w.wd, w.bd)


def _bias(linear: Any) -> torch.Tensor | None:
    return linear.bias


def _eps(norm: Any) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise LayerStepError(f"{type(norm).__name__} has no epsilon the compiled step knows")


def layer_weights(model: Any) -> list[LayerWeights]:
    """Each layer's weights of a Llama / Qwen2 checkpoint (references to its parameters)."""
    act = getattr(model.config, "hidden_act", None)
    if act != "silu":
        raise LayerStepError(f"the compiled layer step implements a SiLU-gated MLP, not hidden_act={act!r}")
    out = []
    for blk in model.model.layers:
        att, mlp = blk.self_attn, blk.mlp
        for norm in (blk.input_layernorm, blk.post_attention_layernorm):
            if "RMSNorm" not in type(norm).__name__:
                raise LayerStepError(f"the compiled layer step implements RMSNorm, not {type(norm).__name__}")
        out.append(LayerWeights(
            blk.input_layernorm.weight, _eps(blk.input_layernorm),
            att.q_proj.weight, _bias(att.q_proj), att.k_proj.weight, _bias(att.k_proj),
            att.v_proj.weight, _bias(att.v_proj), att.o_proj.weight, _bias(att.o_proj),
            blk.post_attention_layernorm.weight, _eps(blk.post_attention_layernorm),
            mlp.gate_proj.weight, _bias(mlp.gate_proj), mlp.up_proj.weight, _bias(mlp.up_proj),
            mlp.down_proj.weight, _bias(mlp.down_proj)))
    return out


def _compile(fn: Callable) -> Callable:
    """torch.compile for the runner's comparisons: Inductor's kernel choices fixed by its heuristics, not by timing
    (`deterministic`). Dynamo compiles a function again for inputs its guards tell apart (a view or not, one row
    or many), and with timed choices each compilation may take another reduction blocking: the same prefill
    then gave other bits once another variant existed (seen on the H200: a child's recompute after a failure
    differed from its reference computed earlier in the same process). A recompile past dynamo's limit raises
    instead of running the function uncompiled behind the caller's back."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True          # read at compilation and at each kernel's first launch
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True
    return torch.compile(fn, dynamic=True, fullgraph=True)


class CompiledSteps:
    """The layer functions above, each compiled once for every layer and row count (weights are arguments, so
    one graph serves all layers; dynamic row counts, so the repair's narrowing does not recompile per size).

    `compile_fn` defaults to torch.compile; tests pass the identity to check the functions' math without paying
    for a compilation on the CPU."""

    def __init__(self, model: Any, compile_fn: Callable[[Callable], Callable] | None = None) -> None:
        self.weights = layer_weights(model)
        wrap = compile_fn or _compile
        self.norm_qkv = wrap(norm_qkv)
        self.norm_k = wrap(norm_k)
        self.norm_kv = wrap(norm_kv)
        self.q_rows = wrap(q_rows)
        self.qv_rows = wrap(qv_rows)
        self.finish = wrap(finish)
