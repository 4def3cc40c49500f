"""Context parallelism for decode: each KV head's sequence sharded over CP ranks, merged by lse.

Tensor parallelism stops dividing KV memory once the ranks outnumber the KV heads. Context
parallelism (vLLM's DCP, NVIDIA's Helix) splits the keys of each head instead: rank ``r`` of
``C`` stores the positions ``p`` with ``(p // block) % C == r``, in order, in its own cache (runs
of ``block`` tokens dealt round-robin, so every rank holds an equal share at every length, within
one block, and appending a token touches one rank). A decode step runs ``decode_attention`` on
each rank's share with ``return_lse``; the ranks exchange (out, lse) in one all-gather (a few KB
per token, never K/V) and each merges the C partials with ``merge_attention`` in rank order, so
every rank holds the same bits. Partials over disjoint keys merge exactly (docs/design.md,
"Context parallelism").

Because a rank's positions are increasing in its local slots, every query's keys on a rank are
one contiguous range of local slots ``[count(lo), count(hi))`` (``ContextShard.count``), which is
what ``cache_leftpad``/``cache_seqlens`` express. With several new tokens (Tq > 1) each query has
its own range; the ranges share a common part, run as one call with the Tq queries folded into
the GQA group, and differ only in at most Tq - 1 slots at each end, which run on a 16-slot copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from lean_tp.ops.decode_attention import decode_attention
from lean_tp.ops.decode_attention.checks import (
    MAX_QUERY_TOKENS,
    check_flag,
    check_inputs,
    check_scalar_types,
    check_types,
    scale_tensor,
)
from lean_tp.ops.merge_attention import merge_attention

# Tokens per run dealt to one rank. Any block keeps the merge exact and every rank's keys
# contiguous in its cache; 16 keeps the shares within 16 tokens of equal (noise at the lengths
# where CP pays) and is the page size vLLM and FlashInfer allocate by default, so a paged per-rank
# cache holds whole pages.
CP_BLOCK = 16
# torch 2.13 renamed the functional all-gather; torch 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
# The ends of the per-query ranges of a Tq > 1 step span at most Tq - 1 slots each; they are
# copied into one page of this many slots (a page size the op takes).
EDGE_SLOTS = MAX_QUERY_TOKENS


def _clamp(x, lo, hi):
    return x.clamp(lo, hi) if isinstance(x, torch.Tensor) else min(max(x, lo), hi)


@dataclass(frozen=True)
class ContextShard:
    """Rank ``rank`` of ``size`` context-parallel ranks: which global positions its cache holds."""

    size: int
    rank: int
    block: int = CP_BLOCK

    def __post_init__(self) -> None:
        if self.size < 1 or self.block < 1:
            raise ValueError(
                f"ContextShard: expected size >= 1 and block >= 1, got size={self.size}, block={self.block}"
            )
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ContextShard: expected rank in [0, {self.size}), got {self.rank}")

    @property
    def span(self) -> int:
        return self.block * self.size

    def count(self, n):
        """How many of the global positions [0, n) this rank holds (an int or an int tensor; n < 0 counts as 0)."""
        n = n.clamp_min(0) if isinstance(n, torch.Tensor) else max(n, 0)
        return (n // self.span) * self.block + _clamp(n % self.span - self.rank * self.block, 0, self.block)

    def capacity(self, n: int) -> int:
        """Local slots for a global capacity of ``n`` tokens: the same on every rank (rank 0's need)."""
        return -(-n // self.span) * self.block

    def owns(self, pos: torch.Tensor) -> torch.Tensor:
        return (pos // self.block) % self.size == self.rank

    def slot(self, pos: torch.Tensor) -> torch.Tensor:
        """The local slot of global position ``pos`` on the rank that owns it."""
        return (pos // self.span) * self.block + pos % self.block

    def positions(self, n: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(count(n),) int64: the global position of each of this rank's slots among [0, n)."""
        slots = torch.arange(self.count(n), device=device)
        return (slots // self.block) * self.span + self.rank * self.block + slots % self.block


def _fold(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, Tq, Hq, D) -> (B, Hq * Tq, D) with each KV head's Tq x group rows adjacent, so that one
    query token's call serves all Tq tokens over keys they all see."""
    b, tq, hq, d = q.shape
    return q.view(b, tq, n_kv, hq // n_kv, d).permute(0, 2, 1, 3, 4).reshape(b, hq * tq, d)


def _unfold(x: torch.Tensor, tq: int, n_kv: int) -> torch.Tensor:
    """Inverse of ``_fold`` for out (B, Hq * Tq, D) or, with a trailing 1, lse (B, Hq * Tq, 1)."""
    b, rows, d = x.shape
    return x.view(b, n_kv, tq, rows // (tq * n_kv), d).permute(0, 2, 1, 3, 4).reshape(b, tq, rows // tq, d)


def _edge(q, k_cache, v_cache, start, row_lo, row_hi, attn_kwargs):
    """Partial of each query over the slots [row_lo, row_hi) (B, Tq), all within the EDGE_SLOTS
    slots from ``start`` (B,): those slots are copied as one page per sequence, and the Tq
    queries run as B * Tq one-token sequences with their own bounds on it."""
    b, tq = row_lo.shape
    rows = torch.arange(b, device=q.device)
    idx = (start[:, None] + torch.arange(EDGE_SLOTS, device=q.device)).clamp(max=k_cache.shape[2] - 1)
    pages_k, pages_v = k_cache[rows[:, None], :, idx], v_cache[rows[:, None], :, idx]  # (B, EDGE_SLOTS, Hkv, D)
    table = rows.repeat_interleave(tq).to(torch.int32)[:, None]
    lo = (row_lo - start[:, None]).clamp(0, EDGE_SLOTS)
    hi = torch.maximum((row_hi - start[:, None]).clamp(0, EDGE_SLOTS), lo)
    out, lse = decode_attention(
        q.flatten(0, 1),
        pages_k,
        pages_v,
        hi.flatten().to(torch.int32),
        block_table=table,
        cache_leftpad=lo.flatten().to(torch.int32),
        return_lse=True,
        **attn_kwargs,
    )
    return out.view(q.shape), lse.view(q.shape[:-1])


def local_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    shard: ContextShard,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    **attn_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (out, lse) over its share of each query's keys; arguments as in
    ``context_parallel_attention``. Sinks are counted on rank 0 only, so the merge counts them once."""
    sinks = sinks if shard.rank == 0 else None
    n = cache_seqlens.long()
    tq = q.shape[1] if q.dim() == 4 else 1
    q_pos = n[:, None] - tq + torch.arange(tq, device=q.device)  # (B, Tq) global positions of the queries
    lo = (q_pos - window + 1).clamp_min(0) if window is not None else torch.zeros_like(q_pos)
    first, last = shard.count(lo), shard.count(q_pos + 1)  # each query's local slots [first, last)
    # Slots every query sees: from the last query's first to the first query's last.
    c_hi = last[:, 0]
    c_lo = torch.minimum(first[:, -1], c_hi)
    seqlens = c_hi.to(torch.int32)
    leftpad = c_lo.to(torch.int32) if window is not None else None  # without a window every range starts at 0
    if tq == 1:
        return decode_attention(
            q, k_cache, v_cache, seqlens, cache_leftpad=leftpad, sinks=sinks, return_lse=True, **attn_kwargs
        )
    n_kv = k_cache.shape[1]
    folded_sinks = None if sinks is None else sinks.view(n_kv, 1, -1).expand(-1, tq, -1).reshape(-1)
    out, lse = decode_attention(
        _fold(q, n_kv),
        k_cache,
        v_cache,
        seqlens,
        cache_leftpad=leftpad,
        sinks=folded_sinks,
        return_lse=True,
        **attn_kwargs,
    )
    parts = [(_unfold(out, tq, n_kv), _unfold(lse[..., None], tq, n_kv)[..., 0])]
    parts.append(_edge(q, k_cache, v_cache, c_hi, first, last, attn_kwargs))  # the newest keys
    if window is not None:  # the oldest keys, which the later queries no longer see
        parts.append(_edge(q, k_cache, v_cache, first[:, 0], first, torch.minimum(last, c_lo[:, None]), attn_kwargs))
    return merge_attention(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def exchange_and_merge(
    out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every CP rank's (out, lse) in one collective (packed as float32, so the exchange
    adds no rounding) and merge them in rank order: the same result, bit for bit, on every rank."""
    if group is None or dist.get_world_size(group) == 1:
        return out, lse
    packed = torch.cat([out.float(), lse[..., None]], dim=-1)
    gathered = _all_gather(packed.unsqueeze(0), gather_dim=0, group=group)
    merged, merged_lse = merge_attention(gathered[..., :-1].contiguous(), gathered[..., -1].contiguous())
    return merged.to(out.dtype), merged_lse


def check_shard(shard: object, group: dist.ProcessGroup | None) -> None:
    """``shard`` must be this rank's place in ``group``: the same size, and the rank's index in it
    (None: one rank). A mismatch would merge a wrong set of partials into a silently wrong result.
    Reads only the group's metadata, no collective."""
    if not isinstance(shard, ContextShard):
        raise TypeError(f"shard: expected a ContextShard, got {type(shard).__name__}")
    size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    if (shard.size, shard.rank) != (size, rank):
        raise ValueError(
            f"shard: expected ContextShard(size={size}, rank={rank}) (this rank in group), "
            f"got size={shard.size}, rank={shard.rank}"
        )


def context_parallel_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    shard: ContextShard,
    group: dist.ProcessGroup | None,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention`` over a sequence sharded across the CP ranks of ``group``; every rank
    calls it with its own share and gets the whole result.

    Args:
        q: (B, Hq, D) or (B, Tq, Hq, D), the same on every rank of ``group``.
        k_cache, v_cache: (B, Hkv, S_local, D), this rank's share: slot ``shard.slot(p)`` holds
            position ``p`` for every ``p`` that ``shard.owns``; fp8 with ``k_scale``/``v_scale``
            as in ``decode_attention``.
        cache_seqlens: (B,) int32, the global lengths (the same on every rank), counting the new tokens.
        shard: this rank's ``ContextShard``; ``group`` the CP ranks, in shard order (None: one rank).
        The other arguments are ``decode_attention``'s, with the same meaning over global positions.

    Returns:
        out (q's shape and dtype), and lse (float32, q's shape without D) when ``return_lse``.
    """
    check_types(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, sinks=sinks)
    check_flag("return_lse", return_lse)
    check_scalar_types(softcap, window, softmax_scale)
    k_scale, v_scale = scale_tensor("k_scale", k_scale, q.device), scale_tensor("v_scale", v_scale, q.device)
    # Every rank checks the whole call, so a bad argument fails on all of them, not only where it is used.
    # cache_seqlens are global: the local calls check their own lengths against the local cache.
    check_inputs(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        None,
        backend,
        None,
        k_scale,
        v_scale,
        softcap,
        window,
        sinks,
        softmax_scale,
        values=False,
    )
    check_shard(shard, group)
    attn_kwargs = dict(softmax_scale=softmax_scale, backend=backend, k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    out, lse = local_partial(q, k_cache, v_cache, cache_seqlens, shard, window=window, sinks=sinks, **attn_kwargs)
    out, lse = exchange_and_merge(out, lse, group)
    return (out, lse) if return_lse else out


def context_parallel_decode(shard: ContextShard, group: dist.ProcessGroup | None) -> Callable:
    """The model's decode attention under context parallelism (``lean_tp.model.AttendFn``), which
    ``apply_tp`` installs on each attention layer: ``(q, cache, lengths, backend, scale) -> out`` over
    this rank's share of the layer's cache (its k, v and fp8 scales), merged over ``group``."""

    def attend(q: torch.Tensor, cache, lengths: torch.Tensor, backend: str, scale: float | None) -> torch.Tensor:
        return context_parallel_attention(
            q,
            cache.k,
            cache.v,
            lengths,
            shard,
            group,
            softmax_scale=scale,
            backend=backend,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
        )

    return attend
