"""GPU microbench: the masked attention of KMesh repair's recomputed queries vs the full causal prefill's.

Why TTFT repair is not faster: n = 34 % of T queries (sorted positions) attend over all T keys with the true
causal mask by position. Variants, timed with CUDA events after warm-up, median of `reps`:
  mask_repeat  what kmesh.model.runner.attend does: K/V repeated to the query heads + bool mask [n, T]
  mask_gqa     the same mask, SDPA's enable_gqa instead of the repeat
  flex         torch FlexAttention with a block mask (kv_pos <= q_pos), compiled
  causal_full  the full arm's fused causal attention over all T queries (flash)
  triton_*     kmesh.model.attention_triton (skips key blocks a query block cannot see), several fixed block
               configs, K/V read through the cache's strided LBNHC views as the runner does
Every variant's output is compared with mask_repeat (max abs diff); the triton variants also with a float64
reference on 256 sampled rows (and mask_repeat's error against the same reference). Writes JSON to argv[1].
"""
import json
import sys

import torch

from gpu_timing import timed
import torch.nn.functional as F

dev, dt, Hq, Hkv, D = "cuda", torch.bfloat16, 14, 2, 64


out = {}
g = torch.Generator(device=dev).manual_seed(0)
for T in (4096, 16384):
    n = int(0.34 * T)
    pos = torch.sort(torch.randperm(T - 1, device=dev, generator=g)[: n - 1]).values
    pos = torch.cat([pos, torch.tensor([T - 1], device=dev)])
    q = torch.randn(1, Hq, n, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    qf = torch.randn(1, Hq, T, D, device=dev, dtype=dt, generator=g)
    mask = torch.arange(T, device=dev)[None, :] <= pos[:, None]
    rep = lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), attn_mask=mask)
    gqa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    full = lambda: F.scaled_dot_product_attention(qf, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), is_causal=True)
    ref = rep()
    row = {"n": n, "T": T, "mask_repeat_ms": timed(rep), "mask_gqa_ms": timed(gqa),
           "mask_gqa_maxdiff": float((gqa() - ref).abs().max()), "causal_full_ms": timed(full)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fa = torch.compile(flex_attention)
        bm = create_block_mask(lambda b, h, qi, ki: ki <= pos[qi], None, None, n, T, device=dev)
        fx = lambda: fa(q, k, v, block_mask=bm, enable_gqa=True)
        row["flex_ms"] = timed(fx)
        row["flex_maxdiff"] = float((fx() - ref).abs().max())
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is recorded, not fatal
        row["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    from kmesh.model.attention_triton import position_causal_attention

    kv = torch.cat([k[0].transpose(0, 1), v[0].transpose(0, 1)], dim=-1).contiguous()   # [T, Hkv, 2D] as cached
    kc, vc = kv[..., :D], kv[..., D:]
    qn = q[0].transpose(0, 1).contiguous()                                                 # [n, Hq, D]
    rows = torch.randperm(n, device=dev, generator=g)[:256]
    sel = pos[rows]
    kk = kc.double().repeat_interleave(Hq // Hkv, 1); vv = vc.double().repeat_interleave(Hq // Hkv, 1)
    sc = torch.einsum("nhd,mhd->hnm", qn[rows].double(), kk) * D ** -0.5
    sc = sc.masked_fill(~(torch.arange(T, device=dev)[None, :] <= sel[:, None])[None], float("-inf"))
    ref64 = torch.einsum("hnm,mhd->nhd", sc.softmax(-1), vv)
    row["mask_repeat_err64"] = float((ref[0].transpose(0, 1)[rows].double() - ref64).abs().max())
    for bm_, bn_, w_, st_ in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2),
                              (64, 32, 4, 4)):
        name = f"triton_m{bm_}_n{bn_}_w{w_}_s{st_}"
        try:
            tr = lambda: position_causal_attention(qn, pos, kc, vc, D ** -0.5, bm_, bn_, w_, st_)
            o = tr()
            row[name + "_ms"] = timed(tr)
            row[name + "_maxdiff"] = float((o - ref[0].transpose(0, 1)).abs().max())
            row[name + "_err64"] = float((o[rows].double() - ref64).abs().max())
            row[name + "_deterministic"] = bool(torch.equal(o, tr()))
        except Exception as e:  # noqa: BLE001
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    out[str(T)] = row
    print(row, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": out},
          open(sys.argv[1], "w"), indent=1)
