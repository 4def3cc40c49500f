"""Plain-torch decode attention: the CPU path users get, and a portable path on any device.

The cache is read in chunks of ``CHUNK_TOKENS`` and the chunk partials are merged by the merge rule
(``merge_attention.rule``), so memory stays bounded for long caches. Keys outside a sequence's valid
range (``cache.valid_keys``) are masked in K's scores and zeroed in V, so whatever those slots
hold (NaN in an uninitialised cache or page) never reaches the output. On accelerators and under
``torch.compile`` every shape is static: the whole capacity is processed with masks (no
``.item()``), which keeps it traceable and graph-safe. Eager on CPU, where reading a value costs
no device sync, the chunks stop at the longest sequence, so a call costs what the lengths need,
not what the cache could hold.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from lean_tp.ops.decode_attention.cache import CacheLayout, valid_keys
from lean_tp.ops.decode_attention.plan import DecodePlan
from lean_tp.ops.merge_attention import merge_partials

# Bounds the fp32 working set to B * Hq * CHUNK_TOKENS scores plus one upcast K/V chunk.
CHUNK_TOKENS = 4096


def _kv_chunks(layout: CacheLayout, k_cache, v_cache, block_table, n_keys: int):
    """Yield (first token, K chunk, V chunk, bad), chunks as (B, Hkv, n, D), covering positions
    [0, n_keys) (paged: up to the end of n_keys's last page). The chunks stop there, not at the
    cache's end, so their shapes come from n_keys alone. ``bad`` (B, n) marks the keys whose page
    id lies outside the pool (None for a contiguous cache): page 0 is gathered in their place, so
    no id is ever used as an index, and the caller decides what a bad key in a sequence's range means."""
    if not layout.paged:
        for n0 in range(0, n_keys, CHUNK_TOKENS):
            n1 = min(n0 + CHUNK_TOKENS, n_keys)
            yield n0, k_cache[:, :, n0:n1], v_cache[:, :, n0:n1], None
        return
    page_size = layout.page_size
    pages_per_chunk = max(1, CHUNK_TOKENS // page_size)
    # Compared as int64: no wrap-around for negative ids, none past the pool.
    table = block_table.long()
    ok = (table >= 0) & (table < k_cache.shape[0])
    table = torch.where(ok, table, torch.zeros_like(table))
    n_pages = -(-n_keys // page_size)
    for p0 in range(0, n_pages, pages_per_chunk):
        cols = slice(p0, min(p0 + pages_per_chunk, n_pages))
        pages = table[:, cols]
        k = k_cache[pages].flatten(1, 2).transpose(1, 2)
        v = v_cache[pages].flatten(1, 2).transpose(1, 2)
        yield p0 * page_size, k, v, ~ok[:, cols].repeat_interleave(page_size, 1)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    cache_leftpad: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
    *,
    plan: DecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention in plain torch; arguments as ``lean_tp.decode_attention`` (q (B, Hq, D) or
    (B, Tq, Hq, D)), except that fp8 scales are (Hkv,) or (1,) float32 tensors and that V's head
    dim Dv may be below K's (out is (B, [Tq,] Hq, Dv): MLA's V is a prefix of each K row); ``plan``: the
    call's ``plan_decode``, whose cache layout is read (by default the layout is read here).
    Returns (out, lse).

    The Tq tokens and the group's query heads of one KV head are one block of rows (token-major),
    as in the kernel, so each K/V chunk is read once for all of them. ``batch_invariant`` computes
    one sequence at a time: torch's CPU reductions split their work by the size of the whole
    tensor, and the chunks stop at the batch's longest sequence, so a batch's shape would reach
    each sequence's rounding. It also computes a block of Tq tokens one token at a time, each as
    the one-token decode at its position (keys up to and including it), since the shape of the
    block's products reaches their rounding too: a verified token gets its decode bits.
    """
    if batch_invariant and q.dim() == 4 and q.shape[1] > 1:
        tq = q.shape[1]
        rest = (block_table, softmax_scale, cache_leftpad, k_scale, v_scale, softcap, window, sinks, True)
        tokens = [
            decode_attention_torch(
                q[:, t], k_cache, v_cache, (cache_seqlens - (tq - 1 - t)).clamp(min=0), *rest, plan=plan
            )
            for t in range(tq)
        ]
        return torch.stack([out for out, _ in tokens], 1), torch.stack([lse for _, lse in tokens], 1)
    if batch_invariant and q.shape[0] > 1:
        paged = block_table is not None
        parts = [
            decode_attention_torch(
                q[b : b + 1],
                k_cache if paged else k_cache[b : b + 1],
                v_cache if paged else v_cache[b : b + 1],
                cache_seqlens[b : b + 1],
                block_table[b : b + 1] if paged else None,
                softmax_scale,
                cache_leftpad[b : b + 1] if cache_leftpad is not None else None,
                k_scale,
                v_scale,
                softcap,
                window,
                sinks,
                plan=plan,
            )
            for b in range(q.shape[0])
        ]
        return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])
    q4 = q if q.dim() == 4 else q[:, None]
    batch, num_tokens, num_q_heads, head_dim = q4.shape
    layout = plan.layout if plan is not None else CacheLayout.of(k_cache, v_cache, block_table)
    num_kv_heads = layout.num_kv_heads
    group = num_q_heads // num_kv_heads
    rows = num_tokens * group
    q_g = (
        q4.view(batch, num_tokens, num_kv_heads, group, head_dim)
        .transpose(1, 2)
        .reshape(batch, num_kv_heads, rows, head_dim)
        .float()
        * softmax_scale
    )
    start, end = valid_keys(cache_seqlens, cache_leftpad, layout.capacity)
    lo, hi = _row_bounds(start, end, num_tokens, group, window)
    # Keys any row of a sequence sees, (B, 1, 1, 1) each: V outside them is zeroed, since 0 * NaN is NaN.
    seen_lo, seen_hi = lo.amin(2, keepdim=True), hi.amax(2, keepdim=True)
    m = torch.full((batch, num_kv_heads, rows), float("-inf"), device=q.device)
    # The accumulator has V's head dim, which may be below K's (MLA: V is a prefix of each K row).
    no_value = q_g.new_zeros(batch, num_kv_heads, rows, v_cache.shape[-1])
    partial = (m, torch.zeros_like(m), no_value)
    # Sequences with a key in their range on a page id outside the pool: their rows come out NaN,
    # as the kernel's do (``attend.attend_segment``).
    poisoned = torch.zeros(batch, dtype=torch.bool, device=q.device)
    for n0, k, v, bad in _kv_chunks(layout, k_cache, v_cache, block_table, _keys_to_read(end, layout.capacity)):
        pos = torch.arange(n0, n0 + k.shape[2], device=q.device)
        seen = (pos >= seen_lo) & (pos < seen_hi)  # (B, 1, 1, n)
        if bad is not None:
            poisoned = poisoned | (bad & seen.view(batch, -1)).any(-1)
        k, v = _dequantize(k, k_scale), _dequantize(v, v_scale)
        v = torch.where(seen.transpose(-1, -2), v, torch.zeros_like(v))
        # K as the left operand keeps its (n, D) memory order: a (D, n) copy for the right operand
        # is what torch 2.11's CPU Inductor miscompiles when fused with the page gather.
        s = torch.matmul(k, q_g.transpose(-1, -2)).transpose(-1, -2)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~((pos >= lo) & (pos < hi)), float("-inf"))
        m_c = s.amax(-1)
        p = torch.exp(s - torch.where(torch.isinf(m_c), torch.zeros_like(m_c), m_c)[..., None])
        partial = merge_partials(partial, (m_c, p.sum(-1), torch.matmul(p, v)))
    if sinks is not None:  # one more logit per query head, with no value
        sink = sinks.float().view(1, num_kv_heads, 1, group).expand(batch, num_kv_heads, num_tokens, group)
        sink = sink.reshape(batch, num_kv_heads, rows)
        partial = merge_partials(partial, (sink, torch.ones_like(sink), no_value))
    m, l, acc = partial
    l = torch.where(poisoned.view(-1, 1, 1), torch.full_like(l, float("nan")), l)
    acc = torch.where(poisoned.view(-1, 1, 1, 1), torch.full_like(acc, float("nan")), acc)
    empty = l == 0
    out = acc / torch.where(empty, torch.ones_like(l), l)[..., None]
    lse = torch.where(
        empty, torch.full_like(m, float("-inf")), m + torch.log(torch.where(empty, torch.ones_like(l), l))
    )
    out = out.view(batch, num_kv_heads, num_tokens, group, -1).transpose(1, 2).reshape(*q4.shape[:3], -1).to(q.dtype)
    lse = lse.view(batch, num_kv_heads, num_tokens, group).transpose(1, 2).reshape(q4.shape[:3])
    return (out, lse) if q.dim() == 4 else (out[:, 0], lse[:, 0])


def _keys_to_read(end: torch.Tensor, capacity: int) -> int:
    """Cache positions the chunks cover: the longest sequence's end eagerly on CPU (reading it costs
    no device sync), else the capacity (static shapes for graphs and torch.compile)."""
    if end.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(end):
        return int(end.max()) if end.numel() else 0
    return capacity


def _row_bounds(start: torch.Tensor | None, end: torch.Tensor, num_tokens: int, group: int, window: int | None):
    """Key positions [lo, hi) each row sees, as (B, 1, Tq * group, 1), from the sequences' valid keys
    [start, end) (B,; start None: 0): row t * group + g is query token t, at cache position
    end - Tq + t, which sees itself and the keys before it."""
    t = torch.arange(num_tokens, device=end.device).repeat_interleave(group)
    hi = end.view(-1, 1) - num_tokens + 1 + t
    lo = start.view(-1, 1).expand_as(hi) if start is not None else torch.zeros_like(hi)
    if window is not None:
        lo = torch.maximum(lo, hi - window)
    return lo[:, None, :, None], hi[:, None, :, None]


def _dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """(B, Hkv, n, D) float32: the chunk, times its per-KV-head (or per-tensor) scale for fp8 caches."""
    return x.float() * scale.view(1, -1, 1, 1) if scale is not None else x.float()
