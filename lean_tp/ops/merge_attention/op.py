"""``torch.library`` registration of ``lean_tp::merge_attention``, and its public entry point.

R partials of the same query rows, each computed over a disjoint set of keys, combine exactly:
with L = logsumexp_r(lse_r), out = sum_r exp(lse_r - L) out_r. The merge is the rule the decode
op applies to its own tiles (``rule.merge_partials``, with each partial as m = lse, l = 1), folded in
partial order, so every rank that merges the same partials gets the same bits. It is a few
elementwise passes over (R, rows, D): plain torch, which Inductor fuses into one kernel.
"""

from __future__ import annotations

import torch

from lean_tp.ops.merge_attention.rule import merge_partials
from lean_tp.ops.utils import FLOAT_DTYPES, require_tensor


def check_partials(out: object, lse: object) -> None:
    """``TypeError``/``ValueError`` naming the argument for malformed partials (shapes and dtypes only)."""
    require_tensor("out", out)
    require_tensor("lse", lse)
    if out.dim() < 2 or out.shape[0] < 1:
        raise ValueError(f"out: expected (R, *rows, D) with R >= 1 partials, got shape {tuple(out.shape)}")
    if out.dtype not in FLOAT_DTYPES:
        raise TypeError(f"out: expected dtype float16, bfloat16 or float32, got {out.dtype}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse: expected dtype torch.float32, got {lse.dtype}")
    if tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(f"lse: expected shape {tuple(out.shape[:-1])} (out's without D), got {tuple(lse.shape)}")
    if lse.device != out.device:
        raise ValueError(f"lse: expected a tensor on {out.device} (out's device), got {lse.device}")


@torch.library.custom_op("lean_tp::merge_attention", mutates_args=())
def merge_attention_op(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Registered op; see ``merge_attention``."""
    check_partials(out, lse)
    # An empty partial (lse = -inf) gets weight 0; its out is zeroed so that even a NaN there cannot leak.
    acc = torch.where(torch.isneginf(lse)[..., None], 0.0, out.float())
    one = torch.ones_like(lse[0])
    m, l, o = lse[0], (~torch.isneginf(lse[0])).float(), acc[0]
    for r in range(1, out.shape[0]):
        m, l, o = merge_partials((m, l, o), (lse[r], one, acc[r]))
    empty = l == 0  # every partial empty: m = -inf
    l_safe = torch.where(empty, one, l)
    merged = torch.where(empty[..., None], 0.0, o / l_safe[..., None])
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    merged_lse = torch.where(empty, m, m_safe + torch.log(l_safe))
    return merged.to(out.dtype), merged_lse


@merge_attention_op.register_fake
def _(out, lse):
    check_partials(out, lse)
    return out.new_empty(out.shape[1:]), lse.new_empty(lse.shape[1:])


def merge_attention(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge R attention partials of the same query rows over disjoint key sets, exactly.

    Args:
        out: (R, *rows, D) fp16, bf16 or fp32: partial r is the attention output over its keys alone
            (``decode_attention``'s out). A partial with no keys has lse -inf; its out is ignored.
        lse: (R, *rows) float32: each partial's natural-log softmax denominator
            (``decode_attention(..., return_lse=True)``'s lse), -inf for an empty partial.

    Returns:
        (out, lse): (*rows, D) in out's dtype (computed in float32) and (*rows) float32, as one
        call over all the keys would give; rows where every partial is empty get out 0, lse -inf.
    """
    check_partials(out, lse)
    return torch.ops.lean_tp.merge_attention(out, lse)
