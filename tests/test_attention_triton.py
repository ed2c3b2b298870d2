"""kmesh.model.attention_triton: position-causal attention over a subset of query rows.

The kernel's math runs on CPU through Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
imported, hence a subprocess) and is compared with a float64 reference; on a GPU (marker gpu) the compiled
kernel is compared with the same reference, with SDPA's masked path, and through the runner.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kmesh.model.attention_triton import TritonAttentionError, available, position_causal_attention

pytestmark = pytest.mark.skipif(not available(), reason="triton is not importable")

# Cases: (n queries, m keys, heads, kv heads, D, block_m, block_n, order). `order`: sorted, shuffled, or
# "edge" (position 0 and m-1 only). Block sizes small enough for the interpreter, and m not a multiple of them.
CASES = [(37, 100, 4, 2, 16, 16, 16, "sorted"), (50, 64, 3, 1, 32, 16, 32, "sorted"),
         (5, 70, 2, 2, 16, 16, 16, "shuffled"), (2, 33, 2, 1, 16, 16, 16, "edge"), (1, 1, 2, 2, 16, 16, 16, "edge"),
         (64, 64, 2, 2, 16, 16, 16, "sorted")]

_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from kmesh.model.attention_triton import position_causal_attention
    cases = json.loads(sys.argv[1]); out = []
    for i, (n, m, H, Hk, D, bm, bn, order) in enumerate(cases):
        g = torch.Generator().manual_seed(i)
        if order == "edge":
            pos = torch.tensor([0, m - 1][:n])
        else:
            pos = torch.sort(torch.randperm(m, generator=g)[:n]).values
            if order == "shuffled":
                pos = pos[torch.randperm(n, generator=g)]
        q = torch.randn(n, H, D, generator=g)
        kv = torch.randn(m, Hk, 2 * D, generator=g)          # the cache's packed K|V: strided views
        k, v = kv[..., :D], kv[..., D:]
        o = position_causal_attention(q, pos, k, v, D ** -0.5, block_m=bm, block_n=bn)
        kk, vv = k.double().repeat_interleave(H // Hk, 1), v.double().repeat_interleave(H // Hk, 1)
        s = torch.einsum("nhd,mhd->hnm", q.double(), kk) * D ** -0.5
        s = s.masked_fill(~(torch.arange(m)[None, :] <= pos[:, None])[None], float("-inf"))
        ref = torch.einsum("hnm,mhd->nhd", s.softmax(-1), vv)
        out.append(float((o.double() - ref).abs().max()))
    print(json.dumps(out))
""")


def test_interpreter_matches_float64_reference() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    errs = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(errs) == len(CASES)
    assert max(errs) < 1e-5, errs            # float32 math vs float64


def test_a_wrong_mask_would_be_caught() -> None:
    """The reference above distinguishes the true mask from an off-by-one one (so the test can fail)."""
    g = torch.Generator().manual_seed(3)
    n, m, D = 8, 20, 16
    pos = torch.sort(torch.randperm(m, generator=g)[:n]).values
    q, k, v = torch.randn(n, 1, D, generator=g), torch.randn(m, 1, D, generator=g), torch.randn(m, 1, D, generator=g)
    def att(shift: int) -> torch.Tensor:
        s = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) * D ** -0.5
        s = s.masked_fill(~(torch.arange(m)[None, :] <= pos[:, None] + shift)[None], float("-inf"))
        return torch.einsum("hnm,mhd->nhd", s.softmax(-1), v.double())
    assert float((att(0) - att(1)).abs().max()) > 1e-3


@pytest.mark.parametrize("bad", ["dtype", "heads", "head_dim", "pos_shape", "stride"])
def test_bad_inputs_raise(bad: str) -> None:
    q, k, v = torch.randn(4, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    pos = torch.arange(4)
    if bad == "dtype":
        q = q.double()
    elif bad == "heads":
        q = torch.randn(4, 3, 16)
    elif bad == "head_dim":
        q, k, v = torch.randn(4, 4, 24), torch.randn(8, 2, 24), torch.randn(8, 2, 24)
    elif bad == "pos_shape":
        pos = torch.arange(5)
    elif bad == "stride":
        q = torch.randn(4, 4, 32)[..., ::2]
    with pytest.raises(TritonAttentionError):
        position_causal_attention(q, pos, k, v, 0.25)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernel_matches_reference_and_sdpa(dtype: torch.dtype) -> None:
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    n, m, H, Hk, D = 700, 2000, 14, 2, 64
    pos = torch.sort(torch.randperm(m, device="cuda", generator=g)[:n]).values
    q = torch.randn(n, H, D, device="cuda", dtype=dtype, generator=g)
    kv = torch.randn(m, Hk, 2 * D, device="cuda", dtype=dtype, generator=g)
    k, v = kv[..., :D], kv[..., D:]
    o = position_causal_attention(q, pos, k, v, D ** -0.5)
    assert torch.equal(o, position_causal_attention(q, pos, k, v, D ** -0.5))   # deterministic
    kk, vv = k.double().repeat_interleave(7, 1), v.double().repeat_interleave(7, 1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), kk) * D ** -0.5
    allowed = torch.arange(m, device="cuda")[None, :] <= pos[:, None]
    ref = torch.einsum("hnm,mhd->nhd", s.masked_fill(~allowed[None], float("-inf")).softmax(-1), vv)
    sd = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.repeat_interleave(7, 1).transpose(0, 1)[None],
                                        v.repeat_interleave(7, 1).transpose(0, 1)[None], attn_mask=allowed,
                                        scale=D ** -0.5)[0].transpose(0, 1)
    err, err_sdpa = float((o.double() - ref).abs().max()), float((sd.double() - ref).abs().max())
    # No worse than SDPA's own masked path against float64 (x2 + one rounding step of the output dtype).
    assert err <= 2 * err_sdpa + torch.finfo(dtype).eps, (err, err_sdpa)


@pytest.mark.gpu
@cuda
def test_gpu_runner_uses_triton_and_matches_sdpa_runner() -> None:
    from kmesh.config import load_config
    from kmesh.model import qwen2_random
    from kmesh.model.runner import LayerRunner

    sec = dict(load_config(profile="cpu").section("model")["qwen2_random"], num_hidden_layers=2, vocab_size=1000)
    model = qwen2_random.build(sec, 0, "cuda")
    a, b = LayerRunner(model, "auto"), LayerRunner(model, "sdpa")
    assert a.attention == "triton" and b.attention == "sdpa"
    T = 300
    pos = torch.sort(torch.randperm(T, device="cuda")[:90]).values
    h = torch.randn(90, model.config.hidden_size, device="cuda", dtype=a.dtype)
    q, k, v = a.qkv(0, h, pos)
    kv = torch.randn(T, a.num_kv_heads, 2 * a.head_dim, device="cuda", dtype=a.dtype)
    x, y = a.attend(q, pos, kv[..., :a.head_dim], kv[..., a.head_dim:]), b.attend(q, pos, kv[..., :a.head_dim],
                                                                                 kv[..., a.head_dim:])
    assert x.shape == y.shape
    assert float((x.float() - y.float()).abs().max()) < 3e-2     # bf16: two accumulation orders
