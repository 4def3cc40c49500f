"""``torch.library`` registration of ``lean_tp::mla_decode_gluon``, the Gluon MLA kernel as the op
``lean_tp.decode_attention`` calls for the planned calls it routes there (``gluon_takes``).

A ``custom_op``, opaque to ``torch.compile`` (its fake gives the shapes), because the Gluon launch
builds TMA descriptors on the host, which ``wrap_triton`` does not trace; the launch allocates by
shape only and syncs nothing, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch

from lean_tp.ops.mla_gluon import launcher
from lean_tp.ops.mla_gluon.launcher import DV


@torch.library.custom_op("lean_tp::mla_decode_gluon", mutates_args=())
def mla_decode_gluon_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``launcher.mla_decode_gluon`` over lean's paged latent cache.

    Args:
        q: (B, H, 576) or (B, Tq, H, 576) bf16.
        k_cache: (pages, 64, 1, 576) bf16 or float8_e4m3fn, contiguous: lean's paged cache of one
            latent head.
        cache_seqlens: (B,) int32. block_table: (B, max pages) int32, rows contiguous.
        softmax_scale: the multiplier of q.k.
        k_scale, v_scale: (1,) float32, an e4m3 cache's only.
    """
    pool = k_cache.view(k_cache.shape[0], k_cache.shape[1], k_cache.shape[-1])
    scales = {} if k_scale is None and v_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
    out, lse = launcher.mla_decode_gluon(q, pool, cache_seqlens, block_table, softmax_scale=softmax_scale, **scales)
    return out, lse


@mla_decode_gluon_op.register_fake
def _(q, k_cache, cache_seqlens, block_table, softmax_scale, k_scale=None, v_scale=None):
    return q.new_empty(*q.shape[:-1], DV), q.new_empty(q.shape[:-1], dtype=torch.float32)
