"""GPU microbench: the masked attention of KMesh repair's recomputed queries vs the full causal prefill's.

Why TTFT repair is not faster: n = 34 % of T queries (sorted positions) attend over all T keys with the true
causal mask by position. Variants, timed with CUDA events after warm-up, median of `reps`:
  mask_repeat  what kmesh.model.runner.attend does: K/V repeated to the query heads + bool mask [n, T]
  mask_gqa     the same mask, SDPA's enable_gqa instead of the repeat
  flex         torch FlexAttention with a block mask (kv_pos <= q_pos), compiled
  causal_full  the full arm's fused causal attention over all T queries (flash)
Every variant's output is compared with mask_repeat (max abs diff). Writes JSON to argv[1].
"""
import json
import sys

import torch
import torch.nn.functional as F

dev, dt, Hq, Hkv, D = "cuda", torch.bfloat16, 14, 2, 64


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


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
    out[str(T)] = row
    print(row, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": out},
          open(sys.argv[1], "w"), indent=1)
