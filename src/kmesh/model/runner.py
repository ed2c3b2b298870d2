"""A layer-wise runner over Hugging Face Llama / Qwen2 weights: the model KMesh repairs restored state with.

transformers runs a whole forward at once; CacheBlend-style repair needs to stop between layers, compute
Q/K/V for a chosen subset of positions, keep restored K/V for the others and attend over all of them. The
runner calls the checkpoint's own modules (projections, norms, MLP, rotary table) one layer at a time and
does the rest itself:

    runner = LayerRunner(model)
    cache = runner.new_cache(capacity)                 # a paged LBNHC KV cache (kmesh.kv.layout), slot = position
    h = runner.embed(ids)                              # [n, hidden]
    q, k, v = runner.qkv(layer, h, positions)          # post-RoPE, [n, heads, D]
    cache.write(layer, positions, k, v)
    kc, vc = cache.layer_kv(layer, num_keys)
    a = runner.attend(q, positions, kc, vc)            # TRUE causal mask: key position <= query position
    h = runner.finish_layer(layer, h, a)
    logits = runner.logits(h[-1:])

Attention masks are built from positions, never from row order: a query at position p sees keys at
positions <= p whatever subset of queries is computed. `mask="bottom_right"` reproduces what a dense
flash-attn call with causal=True does for q_len < k_len (query i of n sees keys <= k_len - n + i) — the
stock-CacheBlend control needs it, KMesh never uses it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Literal, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kmesh.kv.layout import KVLayout
from kmesh.kv.rope import RopeConfig
from kmesh.model.errors import ModelError
from kmesh.model.layer_step import LAYER_STEPS, CompiledSteps, rope

MaskKind = Literal["position", "bottom_right"]
AttentionKind = Literal["auto", "sdpa", "triton"]
LayerStep = Literal["eager", "compiled"]
_TORCH_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class KVCache:
    """One request's private K/V: a paged LBNHC cache (K|V packed per token) with slot = position.

    `raw` is the byte buffer kmesh.kv.restore writes into; `k[l]` / `v[l]` are [slots, heads, D] views of it,
    so what restore wrote is exactly what attention reads.
    """

    layout: KVLayout
    raw: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.layout.num_slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def write_distinct(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """write() for slots the caller knows are distinct (a blend's active positions, by construction): each
        slot is written once, so the plain scatter is exact whatever its order, and it runs without the
        deterministic mode's index sort (kmesh.harness.modelsetup.deterministic_kernels turns that mode on; on the H200
        the sort, its fills and bound checks were ~0.6 ms of a 4k repair's 8 ms, two calls a layer)."""
        with _plain_scatter():
            self.k[layer][slots] = k
            self.v[layer][slots] = v

    def write_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [n, heads, D] into slots 0..n-1 (what write() with slots arange(n) does, as a plain copy)."""
        n = k.shape[0]
        self.k[layer][:n] = k
        self.v[layer][:n] = v

    def layer_kv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, n) of one layer, [n, heads, D] views."""
        return self.k[layer][:n], self.v[layer][:n]

    def stacked(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of slots [0, n), [layers, n, heads, D] (for comparisons)."""
        return (torch.stack([k[:n] for k in self.k]).clone(), torch.stack([v[:n] for v in self.v]).clone())


def _without_index_sort() -> Iterator[None]:
    """Deterministic-algorithms mode off for the enclosed index writes (host state only: capturable), then back."""
    on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if not on:
        yield
        return
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


# not @contextmanager: mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
_plain_scatter = contextmanager(_without_index_sort)


# cuDNN's SDPA kernel is what torch 2.11 picks on the H200 for a decode step (one query, GQA), and it is not
# reproducible there: the same inputs gave two different outputs in about 1 of 5 calls
# (docs/measurements/equivalence-h200/decode_isolation.json), which flipped greedy tokens. Flash,
# memory-efficient and math attention forward are deterministic. cuDNN stays allowed for a causal prefill (many
# queries, no mask), where it is the fastest kernel (1.2 vs 1.7 ms per layer at 16k for flash) and repeated calls
# were bit-identical; every other call runs without it. transformers' own forward is compared under the same rule
# (transformers_sdpa_policy).
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_WITH_CUDNN = [SDPBackend.CUDNN_ATTENTION, *_NO_CUDNN]


def sdpa_backends(q_len: int, causal_without_mask: bool) -> list[SDPBackend]:
    """The SDPA kernels the runner allows for one call (see the comment above)."""
    return _WITH_CUDNN if causal_without_mask and q_len > 1 else _NO_CUDNN


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(sdpa_backends(q.shape[-2], bool(kw.get("is_causal")) and kw.get("attn_mask") is None)):
        return F.scaled_dot_product_attention(q, k, v, **kw)


_POLICY_NAME = "kmesh_sdpa"


def _policy_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cuda":
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    # transformers' own sdpa path passes is_causal exactly when q_len > 1 and there is no mask
    with sdpa_kernel(sdpa_backends(query.shape[2], attention_mask is None)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def _transformers_sdpa_policy(model: Any) -> Iterator[None]:
    """Run transformers' own SDPA attention under the runner's kernel rule (sdpa_backends) for a comparison."""
    from transformers import AttentionInterface

    AttentionInterface.register(_POLICY_NAME, _policy_attention)   # idempotent: a name → function entry
    before = model.config._attn_implementation
    model.set_attn_implementation(_POLICY_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# not @contextmanager: mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
transformers_sdpa_policy = contextmanager(_transformers_sdpa_policy)


class LayerRunner:
    """Llama / Qwen2 (incl. SmolLM2) weights run layer by layer (see module doc)."""

    def __init__(self, model: Any, attention: AttentionKind = "auto", layer_step: LayerStep = "eager") -> None:
        cfg = model.config
        if cfg.model_type not in ("llama", "qwen2"):
            raise ModelError(f"the layer-wise runner knows llama and qwen2 models, not {cfg.model_type!r}")
        if getattr(cfg, "use_sliding_window", False):
            raise ModelError("sliding-window attention is not supported by the layer-wise runner")
        self.model = model
        self.inner = model.model
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim ** -0.5
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        if self.dtype not in _TORCH_DTYPE:
            raise ModelError(f"runner dtype must be float32/bfloat16/float16, got {self.dtype}")
        self.rope = RopeConfig.from_hf_config(cfg)
        self.attention = self._attention_backend(attention)
        if layer_step not in LAYER_STEPS:
            raise ModelError(f"layer_step must be one of {LAYER_STEPS}, got {layer_step!r}")
        self.layer_step = layer_step
        # the compiled functions (kmesh.model.layer_step) replace the modules' calls; None: the modules run
        self.steps: CompiledSteps | None = CompiledSteps(model) if layer_step == "compiled" else None

    def _attention_backend(self, attention: str) -> str:
        """Which kernel runs the position-masked attention of a subset of queries (the repair's recompute).

        sdpa: SDPA with an explicit boolean mask (every query × key pair computed, then masked).
        triton: kmesh.model.attention_triton, which skips the key blocks a query block cannot see.
        auto: triton on CUDA when it is importable and the head size fits, else sdpa.
        """
        from kmesh.model import attention_triton

        fits = self.head_dim >= 16 and not self.head_dim & (self.head_dim - 1)
        if attention == "auto":
            return "triton" if self.device.type == "cuda" and attention_triton.available() and fits else "sdpa"
        if attention == "triton":
            if not attention_triton.available():
                raise ModelError("attention='triton' but triton is not importable")
            if not fits:
                raise ModelError(f"attention='triton' needs a power-of-two head_dim >= 16, not {self.head_dim}")
            return attention
        if attention == "sdpa":
            return attention
        raise ModelError(f"attention must be 'auto', 'sdpa' or 'triton', got {attention!r}")

    # -- state -------------------------------------------------------------------------------------------
    @property
    def dtype_name(self) -> str:
        """The model dtype as a kmesh.kv.layout dtype name (what its caches hold)."""
        return _TORCH_DTYPE[self.dtype]

    def cache_layout(self, capacity: int, block_size: int = 16) -> KVLayout:
        blocks = -(-capacity // block_size)
        return KVLayout.paged("LBNHC", self.num_layers, blocks, block_size, self.num_kv_heads, self.head_dim,
                              self.dtype_name)

    def new_cache(self, capacity: int, block_size: int = 16, fill: float = 0.0) -> KVCache:
        """A zeroed (or `fill`ed: poison) cache for `capacity` positions."""
        layout = self.cache_layout(capacity, block_size)
        raw = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        return self.cache_over(raw, layout, fill)

    def cache_over(self, raw: torch.Tensor, layout: KVLayout, fill: float | None = 0.0) -> KVCache:
        """The cache views over an existing byte buffer (fill=None keeps its contents)."""
        L, S, H, D = layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim
        elems = layout.elements(raw)
        if fill is not None:
            elems.fill_(fill)
        kv = elems[: L * S * H * 2 * D].view(L, S, H, 2 * D)
        return KVCache(layout, raw, [kv[i, :, :, :D] for i in range(L)], [kv[i, :, :, D:] for i in range(L)])

    # -- one layer -----------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids.to(self.device))

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] of the checkpoint's own rotary table (what transformers' forward applies)."""
        dummy = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(dummy, positions.to(self.device)[None])
        return cos[0], sin[0]

    def qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor,
            rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-RoPE q [n, heads, D], k and v [n, kv_heads, D] of hidden rows h [n, hidden] at `positions`."""
        cos, sin = rot if rot is not None else self.rotary(positions)
        if self.steps is not None:
            return self.steps.norm_qkv(h, self.steps.weights[layer], cos, sin, self.num_heads, self.num_kv_heads)
        blk = self.inner.layers[layer]
        x = blk.input_layernorm(h)
        att = blk.self_attn
        n = h.shape[0]
        q = att.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = att.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = att.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def check_qkv(self, layer: int, h: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor],
                  with_v: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A check layer's first half: (normed rows, post-RoPE K, V or None) of every row; Q (and V) of the rows
        the check keeps come from `kept_qv` (what qkv() gives those rows, without projecting the dropped ones)."""
        cos, sin = rot
        if self.steps is not None:
            w = self.steps.weights[layer]
            if with_v:
                return self.steps.norm_kv(h, w, cos, sin, self.num_kv_heads)
            x, k = self.steps.norm_k(h, w, cos, sin, self.num_kv_heads)
            return x, k, None
        blk = self.inner.layers[layer]
        x = blk.input_layernorm(h)
        att, n = blk.self_attn, h.shape[0]
        k = rope(att.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = att.v_proj(x).view(n, self.num_kv_heads, self.head_dim) if with_v else None
        return x, k, v

    def kept_qv(self, layer: int, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor],
                v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE Q, and V unless given, of normed rows x (check_qkv's, narrowed to the kept rows)."""
        cos, sin = rot
        if self.steps is not None:
            w = self.steps.weights[layer]
            if v is None:
                return self.steps.qv_rows(x, w, cos, sin, self.num_heads, self.num_kv_heads)
            return self.steps.q_rows(x, w, cos, sin, self.num_heads), v
        att, n = self.inner.layers[layer].self_attn, x.shape[0]
        q = rope(att.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
        return q, (att.v_proj(x).view(n, self.num_kv_heads, self.head_dim) if v is None else v)

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_pos: torch.Tensor | None = None, mask: MaskKind = "position",
               all_rows: bool = False, last_query: bool = False) -> torch.Tensor:
        """Attention of queries q [n, heads, D] over keys k/v [m, kv_heads, D]: output [n, heads·D].

        position: query at position p sees keys at positions <= p (key_pos defaults to 0..m-1).
        bottom_right: query i (rows in order) sees keys 0..m-n+i, whatever its position.
        all_rows: the caller knows the queries are exactly positions 0..m-1 in order (and keys 0..m-1), where
        every mask above is the plain causal one: the fused causal kernel runs instead of an explicit mask.
        last_query: one query at position m-1 (a decode step): it sees every key, so no mask at all.
        """
        n, m = q.shape[0], k.shape[0]
        if last_query:
            if n != 1 or key_pos is not None:
                raise ModelError(f"last_query needs one query at the last of {m} positions, got {n} queries")
            out = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], scale=self.scale,
                                                 enable_gqa=self.groups > 1)
            return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
        if all_rows:
            if n != m or key_pos is not None:
                raise ModelError(f"all_rows needs queries and keys at positions 0..{m - 1}, got {n} queries")
            out = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], is_causal=True, scale=self.scale,
                                                 enable_gqa=self.groups > 1)
            return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
        if mask == "bottom_right":
            # query i sees keys 0..m-n+i: the position rule with the queries at positions m-n..m-1, so the stock
            # arm runs the same kernels as the others (an explicit mask on the CPU, Triton on CUDA)
            q_pos, key_pos, mask = torch.arange(m - n, m, device=q.device), None, "position"
        if mask == "position" and key_pos is None and self.attention == "triton":
            from kmesh.model.attention_triton import position_causal_attention

            return position_causal_attention(q, q_pos.to(q.device), k, v, self.scale).reshape(
                n, self.num_heads * self.head_dim)
        if mask == "position":
            kp = torch.arange(m, device=q.device) if key_pos is None else key_pos
            allowed = kp[None, :] <= q_pos.to(q.device)[:, None]
        else:
            raise ModelError(f"mask must be 'position' or 'bottom_right', got {mask!r}")
        kk = k.repeat_interleave(self.groups, dim=1).transpose(0, 1)[None]
        vv = v.repeat_interleave(self.groups, dim=1).transpose(0, 1)[None]
        out = _sdpa(q.transpose(0, 1)[None], kk, vv, attn_mask=allowed, scale=self.scale)
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post-attention norm + MLP + residual."""
        if self.steps is not None:
            return self.steps.finish(h, attn, self.steps.weights[layer])
        blk = self.inner.layers[layer]
        h = h + blk.self_attn.o_proj(attn)
        return h + blk.mlp(blk.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.inner.norm(h))

    # -- whole requests -------------------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Plain full prefill of ids [T] at positions 0..T-1 into `cache`: next-token logits [vocab]."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            T = ids.shape[0]
            pos = torch.arange(T, device=self.device)
            rot = self.rotary(pos)
            h = self.embed(ids)
            for layer in range(self.num_layers):
                q, k, v = self.qkv(layer, h, pos, rot)
                cache.write_prefix(layer, k, v)
                kc, vc = cache.layer_kv(layer, T)
                h = self.finish_layer(layer, h, self.attend(q, pos, kc, vc, all_rows=True))
            return self.logits(h[-1:])[0]

    def decode_step(self, cache: KVCache, position: int, token: int) -> torch.Tensor:
        """Feed `token` at `position` (its K/V written into the cache, every earlier slot read): next-token
        logits [vocab]."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            p = torch.tensor([position], device=self.device)
            h = self.embed(torch.tensor([token], device=self.device))
            rot = self.rotary(p)
            for layer in range(self.num_layers):
                q, k, v = self.qkv(layer, h, p, rot)
                cache.write(layer, p, k, v)
                kc, vc = cache.layer_kv(layer, position + 1)
                # one query at the last position sees every key under either mask: no mask tensor needed
                h = self.finish_layer(layer, h, self.attend(q, p, kc, vc, last_query=True))
            return self.logits(h)[0]

    def decode(self, cache: KVCache, length: int, first_logits: torch.Tensor, max_new_tokens: int,
               step_logits: list[torch.Tensor] | None = None, stop_ids: Collection[int] = ()) -> list[int]:
        """Greedy continuation after a prefill of `length` positions whose next-token logits are given. With
        `step_logits`, each decode step's next-token logits [vocab] are appended to it (the logits behind every
        token after the first). A token in `stop_ids` (the model's end-of-turn) ends the continuation: it is the
        last token returned, and nothing after it is computed or written."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            if length + max_new_tokens > cache.capacity + 1:
                raise ModelError(f"cache of {cache.capacity} slots cannot hold {length} + {max_new_tokens} tokens")
            stop = frozenset(int(t) for t in stop_ids)
            tokens = [int(first_logits.argmax())]
            for i in range(max_new_tokens - 1):
                if tokens[-1] in stop:
                    break
                logits = self.decode_step(cache, length + i, tokens[-1])
                if step_logits is not None:
                    step_logits.append(logits)
                tokens.append(int(logits.argmax()))
            return tokens

    def teacher_forced(self, cache: KVCache, length: int, first_logits: torch.Tensor,
                       tokens: Sequence[int]) -> torch.Tensor:
        """Next-token logits [len(tokens), vocab] along a GIVEN continuation after a prefill of `length`
        positions: row 0 is `first_logits`, row i the logits after tokens[:i] were fed (whatever this state would
        have generated itself). The last token is never fed: nothing is predicted after it."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            if not tokens:
                raise ModelError("teacher forcing needs at least one token")
            if length + len(tokens) > cache.capacity + 1:
                raise ModelError(f"cache of {cache.capacity} slots cannot hold {length} + {len(tokens)} tokens")
            fed = tokens[:-1]
            if not fed:
                return first_logits[None]
            # one forward over every fed token at once (causal among them, each seeing the whole prefix): the same
            # logits a decode step per token gives, up to float rounding of the larger matrix products, in one pass
            return torch.cat([first_logits[None], self.extend(cache, length, torch.tensor(
                [int(t) for t in fed], device=self.device))])

    def extend_batch(self, k: torch.Tensor, v: torch.Tensor, length: int, ids: torch.Tensor) -> torch.Tensor:
        """`extend` for B requests at once, each over K/V of its own: k, v [layers, B, slots, kv_heads, D] hold
        every request's first `length` positions; ids [B, n] are fed at positions length..length+n-1 (their K/V
        written into k, v; query i of a row sees that row's slots up to its own position): logits [B, n, vocab].

        One pass reads the weights once for all B rows: what batching buys where a step is bound by reading the
        weights (decode, short continuations). A row's logits equal its own `extend`'s up to float rounding (the
        matrix products see B·n rows instead of n), not bit for bit."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            B, n = ids.shape
            if k.shape != v.shape or k.dim() != 5 or k.shape[:2] != (self.num_layers, B):
                raise ModelError(f"batched K/V must be [{self.num_layers}, {B}, slots, kv_heads, D], got "
                                 f"{tuple(k.shape)} and {tuple(v.shape)}")
            if length + n > k.shape[2]:
                raise ModelError(f"batched K/V of {k.shape[2]} slots cannot hold {length} + {n} tokens")
            pos = torch.arange(length, length + n, device=self.device)
            cos, sin = self.rotary(pos)
            rot = (cos.repeat(B, 1), sin.repeat(B, 1))
            flat_pos = pos.repeat(B)
            m = length + n
            # one query per row at the last position sees every key: no mask, as decode_step
            mask = None if n == 1 else (torch.arange(m, device=self.device)[None, :] <= pos[:, None])
            h = self.embed(ids.reshape(-1))
            for layer in range(self.num_layers):
                q, kk, vv = self.qkv(layer, h, flat_pos, rot)
                k[layer, :, length:m] = kk.view(B, n, self.num_kv_heads, self.head_dim)
                v[layer, :, length:m] = vv.view(B, n, self.num_kv_heads, self.head_dim)
                out = _sdpa(q.view(B, n, self.num_heads, self.head_dim).transpose(1, 2),
                            k[layer, :, :m].transpose(1, 2), v[layer, :, :m].transpose(1, 2),
                            attn_mask=mask, scale=self.scale, enable_gqa=self.groups > 1)
                h = self.finish_layer(layer, h, out.transpose(1, 2).reshape(B * n, self.num_heads * self.head_dim))
            return self.logits(h).view(B, n, -1)

    def extend(self, cache: KVCache, length: int, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [n] at positions length..length+n-1 after a prefill of `length` positions (their K/V written
        into the cache; query i sees every slot up to its own position): next-token logits [n, vocab]."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            n = ids.shape[0]
            if length + n > cache.capacity:
                raise ModelError(f"cache of {cache.capacity} slots cannot hold {length} + {n} tokens")
            pos = torch.arange(length, length + n, device=self.device)
            rot = self.rotary(pos)
            h = self.embed(ids)
            for layer in range(self.num_layers):
                q, k, v = self.qkv(layer, h, pos, rot)
                cache.write(layer, pos, k, v)
                kc, vc = cache.layer_kv(layer, length + n)
                h = self.finish_layer(layer, h, self.attend(q, pos, kc, vc))
            return self.logits(h)
