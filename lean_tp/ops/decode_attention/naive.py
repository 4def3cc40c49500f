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
    first = start // page_size  # columns before it hold no key of the range and are not read
    pages = block_table[b, first : math.ceil(end / page_size)].long()
    return cache[pages].flatten(0, 1)[start - first * page_size : end - first * page_size].transpose(0, 1)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    cache_leftpad: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (q's shape with v_cache's head dim Dv) and lse (q's shape without D), both float64;
    arguments as in ``lean_tp.decode_attention``, except that V's head dim may differ from K's (MLA
    reads V as the first Dv columns of each K row). Written one query at a time, straight from the
    definitions."""
    q4 = q if q.dim() == 4 else q[:, None]
    batch, num_tokens, num_q_heads, head_dim = q4.shape
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    group = num_q_heads // layout.num_kv_heads
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    out = torch.zeros(batch, num_tokens, num_q_heads, v_cache.shape[-1], dtype=torch.float64)
    lse = torch.full((batch, num_tokens, num_q_heads), float("-inf"), dtype=torch.float64)
    starts = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    for b, (start, end) in enumerate(zip(starts, cache_seqlens.tolist())):
        start = min(max(start, 0), end)
        k = _dequantize(gather_kv(layout, k_cache, b, start, end, block_table), k_scale).repeat_interleave(group, 0)
        v = _dequantize(gather_kv(layout, v_cache, b, start, end, block_table), v_scale).repeat_interleave(group, 0)
        for t in range(num_tokens):
            pos = end - num_tokens + t  # this query's cache position; it sees keys [lo, pos]
            lo = max(start, pos - window + 1) if window is not None else start
            seen = slice(lo - start, max(lo, pos + 1) - start)  # k and v begin at position start
            s = torch.einsum("hd,hnd->hn", q4[b, t].double().cpu(), k[:, seen]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:  # one more logit per head, with no value
                s = torch.cat([s, sinks.double().cpu()[:, None]], 1)
            if s.shape[1] == 0:
                continue
            lse[b, t] = torch.logsumexp(s, -1)
            out[b, t] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1)[:, : seen.stop - seen.start], v[:, seen])
    return (out, lse) if q.dim() == 4 else (out[:, 0], lse[:, 0])


def _dequantize(x: torch.Tensor, scale: float | torch.Tensor | None) -> torch.Tensor:
    """(Hkv, n, D) float64 on CPU: an fp8 cache's values times its per-tensor or per-head scale
    (a float, or a (Hkv,) or (1,) tensor)."""
    x = x.double().cpu()
    if isinstance(scale, torch.Tensor):
        return x * scale.double().cpu()[:, None, None]
    return x * scale if scale is not None else x
