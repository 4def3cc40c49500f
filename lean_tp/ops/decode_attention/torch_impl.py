"""Plain-torch decode attention: the CPU path users get, and a portable path on any device.

The cache is read in chunks of ``CHUNK_TOKENS`` and the chunk partials are merged with the same
operator the kernel uses, so memory stays bounded for long caches. Every shape is static: the
whole capacity is processed with masks (no ``.item()``), which keeps it traceable and graph-safe.
"""

from __future__ import annotations

import torch

from lean_tp.ops.decode_attention.cache import CacheLayout

# Bounds the fp32 working set to B * Hq * CHUNK_TOKENS scores plus one upcast K/V chunk.
CHUNK_TOKENS = 4096


def merge_partials(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge two softmax partials (m, l, acc): m, l (...,), acc (..., D); natural log domain.

    m = -inf marks an empty partial; merging with it returns the other operand unchanged.
    """
    m_a, l_a, acc_a = a
    m_b, l_b, acc_b = b
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a = torch.exp(m_a - m_safe)
    w_b = torch.exp(m_b - m_safe)
    return m, l_a * w_a + l_b * w_b, acc_a * w_a[..., None] + acc_b * w_b[..., None]


def _kv_chunks(layout: CacheLayout, k_cache, v_cache, block_table):
    """Yield (first token, K chunk, V chunk), chunks as (B, Hkv, n, D)."""
    if not layout.paged:
        for n0 in range(0, layout.capacity, CHUNK_TOKENS):
            yield n0, k_cache[:, :, n0 : n0 + CHUNK_TOKENS], v_cache[:, :, n0 : n0 + CHUNK_TOKENS]
        return
    page_size = layout.page_size
    pages_per_chunk = max(1, CHUNK_TOKENS // page_size)
    # Entries past a sequence's length may hold anything; clamp so the gather stays in bounds.
    table = block_table.long().clamp(0, k_cache.shape[0] - 1)
    for p0 in range(0, table.shape[1], pages_per_chunk):
        pages = table[:, p0 : p0 + pages_per_chunk]
        k = k_cache[pages].flatten(1, 2).transpose(1, 2)
        v = v_cache[pages].flatten(1, 2).transpose(1, 2)
        yield p0 * page_size, k, v


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    cache_leftpad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention in plain torch; arguments and results as ``decode_attention_fwd``."""
    batch, num_q_heads, head_dim = q.shape
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    num_kv_heads = layout.num_kv_heads
    group = num_q_heads // num_kv_heads
    q_g = q.view(batch, num_kv_heads, group, head_dim).float() * softmax_scale
    lens = cache_seqlens.view(batch, 1, 1, 1)
    starts = cache_leftpad.view(batch, 1, 1, 1) if cache_leftpad is not None else None
    m = torch.full((batch, num_kv_heads, group), float("-inf"), device=q.device)
    partial = (m, torch.zeros_like(m), torch.zeros_like(q_g))
    for n0, k, v in _kv_chunks(layout, k_cache, v_cache, block_table):
        # K as the left operand keeps its (n, D) memory order: a (D, n) copy for the right operand
        # is what torch 2.11's CPU Inductor miscompiles when fused with the page gather.
        s = torch.matmul(k.float(), q_g.transpose(-1, -2)).transpose(-1, -2)
        pos = torch.arange(n0, n0 + s.shape[-1], device=q.device)
        valid = pos < lens if starts is None else (pos < lens) & (pos >= starts)
        s = s.masked_fill(~valid, float("-inf"))
        m_c = s.amax(-1)
        p = torch.exp(s - torch.where(torch.isinf(m_c), torch.zeros_like(m_c), m_c)[..., None])
        partial = merge_partials(partial, (m_c, p.sum(-1), torch.matmul(p, v.float())))
    m, l, acc = partial
    empty = l == 0
    out = acc / torch.where(empty, torch.ones_like(l), l)[..., None]
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(torch.where(empty, torch.ones_like(l), l)))
    return out.view(batch, num_q_heads, head_dim).to(q.dtype), lse.view(batch, num_q_heads)
