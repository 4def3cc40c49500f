"""Float64 reference of decode attention: the slow, obvious definition every backend is tested against."""

from __future__ import annotations

import math

import torch

from lean_tp.ops.decode_attention.cache import CacheLayout


def gather_kv(
    layout: CacheLayout, cache: torch.Tensor, b: int, start: int, end: int, block_table: torch.Tensor | None
) -> torch.Tensor:
    """Keys (or values) at positions [start, end) of sequence b as (Hkv, end - start, D), for a
    contiguous or a paged cache."""
    if not layout.paged:
        return cache[b, :, start:end]
    page_size = layout.page_size
    pages = block_table[b, : math.ceil(end / page_size)].long()
    return cache[pages].flatten(0, 1)[start:end].transpose(0, 1)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    cache_leftpad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hq, D) and lse (B, Hq), both float64; shapes as in ``lean_tp.decode_attention``."""
    batch, num_q_heads, head_dim = q.shape
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, num_q_heads), float("-inf"), dtype=torch.float64)
    starts = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    for b, (start, end) in enumerate(zip(starts, cache_seqlens.tolist())):
        if end == start:
            continue
        k = gather_kv(layout, k_cache, b, start, end, block_table).double().cpu()
        v = gather_kv(layout, v_cache, b, start, end, block_table).double().cpu()
        group = num_q_heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        s = torch.einsum("hd,hnd->hn", q[b].double().cpu(), k) * scale
        lse[b] = torch.logsumexp(s, -1)
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v)
    return out, lse
