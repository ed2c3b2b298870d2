"""Masked attention of repair's recomputed queries vs the full causal prefill, variant by variant (GPU).

Why TTFT repair is not faster: n = 34 % of T queries (sorted positions) attend over all T keys with the true
causal mask by position. Random bf16 tensors of the cuda profile's shape (14 query heads, 2 KV heads, head dim
64) at T = 4096 and 16384; each variant timed with CUDA events after 3 warm-ups, median of 20:
  mask_repeat  what kmesh.model.runner.attend does: K/V repeated to the query heads + bool mask [n, T]
  mask_gqa     the same mask, SDPA's enable_gqa instead of the repeat
  flex         torch FlexAttention with a block mask (kv_pos <= q_pos), compiled
  causal_full  the full arm's fused causal attention over all T queries (flash)
  triton_*     kmesh.model.attention_triton (skips key blocks a query block cannot see), several fixed block
               configs (m<BLOCK_M>_n<BLOCK_N>_w<warps>_s<stages>), K/V read through strided [T, Hkv, 2D] views
               as the runner reads the cache

Output (JSON, --out; each row printed as well): per T, n and `<variant>_ms`. Every variant's output is compared
with mask_repeat (`_maxdiff`, max abs); the triton variants also with a float64 reference on 256 sampled rows
(`_err64`, beside mask_repeat_err64: a triton err64 at or below mask_repeat's is as accurate) and with a second
run of themselves (`_deterministic`). A variant that cannot run here records `_error` instead. A variant is worth
taking when its _ms beats mask_repeat_ms at no worse err64; causal_full_ms is the floor repair is up against.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kmesh.diagnostics._common import parser, require_cuda, timed, write_json

DTYPE, QUERY_HEADS, KV_HEADS, HEAD_DIM = torch.bfloat16, 14, 2, 64
GROUPS = QUERY_HEADS // KV_HEADS
PROMPT_TOKENS = (4096, 16384)
RECOMPUTED = 0.34          # share of the positions whose queries repair recomputes
SAMPLED_ROWS = 256         # rows checked against the float64 reference
# (BLOCK_M, BLOCK_N, warps, stages) of the triton kernel
TRITON_CONFIGS = ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 32, 4, 4))


def _flex(row: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
          ref: torch.Tensor) -> None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= pos[q_idx], None, None,
                                       q.shape[2], k.shape[2], device="cuda")

        def run() -> torch.Tensor:
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

        row["flex_ms"] = timed(run)
        row["flex_maxdiff"] = float((run() - ref).abs().max())
    except Exception as e:  # noqa: BLE001 - torch.compile fails in many ways (inductor, triton); recorded, not fatal
        row["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def variants_at(prompt_len: int, gen: torch.Generator) -> dict[str, Any]:
    """Every variant at one prompt length (see the module doc for the keys)."""
    from kmesh.model.attention_triton import position_causal_attention

    dev = "cuda"
    num_queries = int(RECOMPUTED * prompt_len)
    pos = torch.sort(torch.randperm(prompt_len - 1, device=dev, generator=gen)[: num_queries - 1]).values
    pos = torch.cat([pos, torch.tensor([prompt_len - 1], device=dev)])   # the last position is always recomputed
    q = torch.randn(1, QUERY_HEADS, num_queries, HEAD_DIM, device=dev, dtype=DTYPE, generator=gen)
    k = torch.randn(1, KV_HEADS, prompt_len, HEAD_DIM, device=dev, dtype=DTYPE, generator=gen)
    v = torch.randn(1, KV_HEADS, prompt_len, HEAD_DIM, device=dev, dtype=DTYPE, generator=gen)
    q_full = torch.randn(1, QUERY_HEADS, prompt_len, HEAD_DIM, device=dev, dtype=DTYPE, generator=gen)
    mask = torch.arange(prompt_len, device=dev)[None, :] <= pos[:, None]

    # The repeat stays inside the timed calls: kmesh.model.runner.attend repeats K/V on every call.
    def mask_repeat() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k.repeat_interleave(GROUPS, 1), v.repeat_interleave(GROUPS, 1),
                                              attn_mask=mask)

    def mask_gqa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def causal_full() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_full, k.repeat_interleave(GROUPS, 1), v.repeat_interleave(GROUPS, 1),
                                              is_causal=True)

    ref = mask_repeat()
    row: dict[str, Any] = {"n": num_queries, "T": prompt_len, "mask_repeat_ms": timed(mask_repeat),
                           "mask_gqa_ms": timed(mask_gqa), "mask_gqa_maxdiff": float((mask_gqa() - ref).abs().max()),
                           "causal_full_ms": timed(causal_full)}
    _flex(row, q, k, v, pos, ref)
    kv = torch.cat([k[0].transpose(0, 1), v[0].transpose(0, 1)], dim=-1).contiguous()   # [T, Hkv, 2D] as cached
    k_cached, v_cached = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]
    q_rows = q[0].transpose(0, 1).contiguous()                                          # [n, Hq, D]
    ref_rows = ref[0].transpose(0, 1)
    sampled = torch.randperm(num_queries, device=dev, generator=gen)[:SAMPLED_ROWS]
    sampled_pos = pos[sampled]
    k64 = k_cached.double().repeat_interleave(GROUPS, 1)
    v64 = v_cached.double().repeat_interleave(GROUPS, 1)
    scores = torch.einsum("nhd,mhd->hnm", q_rows[sampled].double(), k64) * HEAD_DIM ** -0.5
    visible = torch.arange(prompt_len, device=dev)[None, :] <= sampled_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    ref64 = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v64)
    row["mask_repeat_err64"] = float((ref_rows[sampled].double() - ref64).abs().max())
    for block_m, block_n, warps, stages in TRITON_CONFIGS:
        name = f"triton_m{block_m}_n{block_n}_w{warps}_s{stages}"
        config = (block_m, block_n, warps, stages)

        def triton(config: tuple[int, int, int, int] = config) -> torch.Tensor:
            return position_causal_attention(q_rows, pos, k_cached, v_cached, HEAD_DIM ** -0.5, *config)

        try:
            out = triton()
            row[name + "_ms"] = timed(triton)
            row[name + "_maxdiff"] = float((out - ref_rows).abs().max())
            row[name + "_err64"] = float((out[sampled].double() - ref64).abs().max())
            row[name + "_deterministic"] = bool(torch.equal(out, triton()))
        except Exception as e:  # noqa: BLE001 - a config triton cannot compile or launch here is recorded
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main(argv: list[str] | None = None) -> int:
    args = parser("attention_variants", __doc__, out=True).parse_args(argv)
    require_cuda("attention_variants")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for prompt_len in PROMPT_TOKENS:
        results[str(prompt_len)] = variants_at(prompt_len, gen)
        print(results[str(prompt_len)], flush=True)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results})
    return 0
