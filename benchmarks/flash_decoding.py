"""FlashDecoding baseline: the LeanAttention paper's comparator, written in Triton for the benchmark.

A fixed-split decode kernel: one program per (split, sequence, KV head) over an equal share of the
cache *capacity*, then a separate combine kernel per (sequence, query head). The split count is
FlashAttention-2's ``num_splits_heuristic`` (``lean_tp.tools.simulate.fa2_splits``, the same function the
simulator uses). Query heads of a GQA group share their KV head's program, as FA2's decode path
packs them. It lives in ``benchmarks/``, not in the library: it exists to be measured against.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lean_tp.tools.simulate import Problem, fa2_splits

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner step; FA2's split boundaries (multiples of 64-256 keys) align to it
SIMULATED_SMS = 132  # SM count assumed off-GPU (the interpreter), so that CPU tests split like an H100


@triton.jit
def flash_decoding_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seqlens_ptr,
    ws_acc_ptr,
    ws_ml_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    num_kv_heads,
    num_splits,
    split_tokens,
    scale_log2,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Partial (acc, max, sum) of one split for the GROUP query heads of one KV head.

    ws_acc: (B, Hq, num_splits, D) fp32; ws_ml: (B, Hq, num_splits, 2) fp32, log2 domain.
    """
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    # 64-bit: batch x stride overflows int32 on long caches (256k tokens x 32 heads x D=128 is 2^30).
    i_b, i_h = (i_bh // num_kv_heads).to(tl.int64), (i_bh % num_kv_heads).to(tl.int64)
    seq_len = tl.load(seqlens_ptr + i_b)
    start = i_s * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)
    o_g, o_d = tl.arange(0, BLOCK_G), tl.arange(0, HEAD_DIM)
    m_g = o_g < GROUP
    p_q = q_ptr + i_b * stride_qb + (i_h * GROUP + o_g)[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None], other=0.0)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh
    for n0 in range(start, end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < end
        b_k = tl.load(k_base + o_n[:, None] * stride_kn + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(v_base + o_n[:, None] * stride_vn + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k)).to(tl.float32) * scale_log2
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.math.exp2(b_m - b_m_new)
        b_p = tl.math.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v).to(tl.float32)
        b_m = b_m_new
    o_row = (i_b * num_kv_heads * GROUP + i_h * GROUP + o_g) * num_splits + i_s
    tl.store(ws_acc_ptr + o_row[:, None] * HEAD_DIM + o_d[None, :], b_acc, mask=m_g[:, None])
    tl.store(ws_ml_ptr + o_row * 2, b_m, mask=m_g)
    tl.store(ws_ml_ptr + o_row * 2 + 1, b_l, mask=m_g)


@triton.jit
def flash_decoding_combine_kernel(
    ws_acc_ptr,
    ws_ml_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the splits of one (sequence, query head): out (B, Hq, D), lse (B, Hq) natural log."""
    i_row = tl.program_id(0)
    o_s, o_d = tl.arange(0, BLOCK_S), tl.arange(0, HEAD_DIM)
    m_s = o_s < num_splits
    b_m = tl.load(ws_ml_ptr + (i_row * num_splits + o_s) * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(ws_ml_ptr + (i_row * num_splits + o_s) * 2 + 1, mask=m_s, other=0.0)
    b_acc = tl.load(
        ws_acc_ptr + (i_row * num_splits + o_s)[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None], other=0.0
    )
    m_max = tl.max(b_m, axis=0)
    # Empty splits carry max = -inf and weigh 0; an all-empty (length 0) row gives out 0, lse -inf.
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)
    b_w = tl.math.exp2(b_m - m_ref)
    l_sum = tl.sum(b_w * b_l, axis=0)
    l_safe = tl.where(l_sum > 0, l_sum, 1.0)
    b_out = tl.sum(b_w[:, None] * b_acc, axis=0) / l_safe
    tl.store(out_ptr + i_row * HEAD_DIM + o_d, b_out.to(out_ptr.dtype.element_ty))
    lse = tl.where(l_sum > 0, (m_ref + tl.math.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + i_row, lse)


def num_splits_for(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """FA2's split count for this shape on q's device (the cache capacity sizes the splits)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else SIMULATED_SMS
    problem = Problem((capacity,) * batch, num_q_heads, num_kv_heads, head_dim)
    return fa2_splits(problem, sms)[0]


def flash_decoding(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: tuple | None = None,
):
    """Fixed-split decode attention. q (B, Hq, D) and k_cache, v_cache (B, Hkv, S_max, D), each with
    ``stride(-1) == 1``; cache_seqlens (B,) int32. Returns out (B, Hq, D) [and lse (B, Hq) fp32].
    ``out``, ``lse`` and ``workspace`` (ws_acc, ws_ml) may be given (tests fill them with NaN)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    splits = num_splits or num_splits_for(q, k_cache)
    split_tokens = math.ceil(math.ceil(max(capacity, 1) / BLOCK_N) / splits) * BLOCK_N
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    ws_acc, ws_ml = workspace or (
        torch.empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device),
        torch.empty(batch, num_q_heads, splits, 2, dtype=torch.float32, device=q.device),
    )
    flash_decoding_split_kernel[(splits, batch * num_kv_heads)](
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        ws_acc,
        ws_ml,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        splits,
        split_tokens,
        scale * LOG2E,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=BLOCK_N,
    )
    out = out if out is not None else torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = lse if lse is not None else torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    flash_decoding_combine_kernel[(batch * num_q_heads,)](
        ws_acc, ws_ml, out, lse, splits, HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits))
    )
    return (out, lse) if return_lse else out
