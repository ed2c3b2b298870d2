"""Position-causal attention for any subset of query rows, skipping masked work (CUDA, Triton).

Repair recomputes a scattered third of a prompt's positions; each recomputed query at position p attends to the
keys at positions 0..p. SDPA with an explicit boolean mask computes every (query, key) pair and then discards
the masked ones, so on the H200 the masked call over 5570 of 16384 queries was slower (1.65 ms per layer) than
flash attention over all 16384 (1.22 ms). This kernel visits, for each block of query rows, only the key
blocks up to the largest position in that block; key blocks that every row of the block sees need no mask.

Keys are the cache's slots 0..m-1 with slot = position (kmesh.model.runner.KVCache), read through their
strides (the LBNHC views are not contiguous). GQA: query head h reads kv head h // groups. Softmax runs online
in float32 (exp2 domain), one fixed block order per row and no atomics: the result is deterministic, and the
same on every replay of a CUDA graph. The block sizes are fixed (no autotuning: a timing-dependent choice would
make numerics depend on the run). The defaults (64 query rows × 128 keys, 4 warps, 3 stages) were the fastest of
six configs on the H200 at 4k and 16k tokens (docs/measurements/equivalence-h200/attention_variants.json).

The math is checked against a float64 reference on CPU through Triton's interpreter (TRITON_INTERPRET=1,
tests/test_attention_triton.py) and on the GPU (tests marked gpu).
"""
from __future__ import annotations

import torch

from kmesh.model.errors import ModelError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's CUDA wheels
    triton = None


class TritonAttentionError(ModelError):
    """The inputs do not fit the position-causal kernel (shape, dtype, strides, device)."""


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _position_causal_fwd(Q, K, V, O, QPOS, n_rows, n_keys, qk_scale_log2,
                             sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h,
                             GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        # Heaviest row blocks (largest positions, when rows are sorted) start first: less tail imbalance.
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUPS
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        qpos = tl.load(QPOS + rows, mask=row_ok, other=0)
        d = tl.arange(0, D)
        q = tl.load(Q + rows[:, None] * sq_n + h * sq_h + d[None, :], mask=row_ok[:, None], other=0.0)
        first = tl.min(tl.where(row_ok, qpos, n_keys), 0)
        last = tl.minimum(tl.max(tl.where(row_ok, qpos, 0), 0), n_keys - 1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Key blocks [0, n_full) are visible to every row of this block: no mask.
        n_full = (tl.minimum(first, n_keys - 1) + 1) // BLOCK_N * BLOCK_N
        for start in range(0, n_full, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            k = tl.load(K + cols[None, :] * sk_n + kvh * sk_h + d[:, None])
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale_log2
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + cols[:, None] * sv_n + kvh * sv_h + d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # The rest, up to the block's largest position: key position <= query position, per row.
        for start in range(n_full, last + 1, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < n_keys
            k = tl.load(K + cols[None, :] * sk_n + kvh * sk_h + d[:, None], mask=col_ok[None, :], other=0.0)
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale_log2
            s = tl.where((cols[None, :] <= qpos[:, None]) & col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))   # key 0 is visible to every row: m_new is finite
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + cols[:, None] * sv_n + kvh * sv_h + d[None, :], mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + rows[:, None] * so_n + h * so_h + d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])


_LOG2E = 1.4426950408889634


def position_causal_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float, block_m: int = 64, block_n: int = 128,
                              num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """q [n, heads, D] at positions q_pos [n] (any order; sorted is fastest) over keys/values [m, kv_heads, D]
    at positions 0..m-1: out [n, heads, D], where query i sees keys at positions <= q_pos[i]."""
    if triton is None:
        raise TritonAttentionError("triton is not installed")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise TritonAttentionError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                                   "[n, heads, D] / [m, kv_heads, D]")
    n, heads, D = q.shape
    m, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise TritonAttentionError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if D < 16 or D & (D - 1):
        raise TritonAttentionError(f"head_dim {D} must be a power of two >= 16")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TritonAttentionError(f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: need one of fp32/bf16/fp16")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise TritonAttentionError("the channel axis of q, k and v must be contiguous")
    if q_pos.shape != (n,) or q_pos.dtype not in (torch.int64, torch.int32):
        raise TritonAttentionError(f"q_pos must be an int tensor of shape ({n},), got {tuple(q_pos.shape)} "
                                   f"{q_pos.dtype}")
    if len({t.device for t in (q, k, v, q_pos)}) != 1:
        raise TritonAttentionError("q, k, v and q_pos must be on one device")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    grid = (triton.cdiv(n, block_m), heads)
    _position_causal_fwd[grid](q, k, v, out, q_pos, n, m, scale * _LOG2E,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               out.stride(0), out.stride(1),
                               GROUPS=heads // kv_heads, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
                               PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                               num_warps=num_warps, num_stages=num_stages)
    return out
