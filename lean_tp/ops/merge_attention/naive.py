"""Float64 reference of the partial merge, straight from the definition of lse."""

from __future__ import annotations

import torch


def merge_attention_ref(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out (R, *rows, D), lse (R, *rows) -> float64 out (*rows, D), lse (*rows).

    Partial r holds softmax(s_r) @ V_r over its keys and lse_r = logsumexp(s_r); over all keys the
    softmax weight of partial r is exp(lse_r - logsumexp_r(lse_r)).
    """
    lse64, out64 = lse.double(), out.double()
    total = torch.logsumexp(lse64, dim=0)
    weight = torch.exp(lse64 - total)  # NaN where every partial is empty (total = -inf)
    merged = (weight[..., None] * torch.where(torch.isinf(lse64)[..., None], 0.0, out64)).sum(0)
    empty = torch.isneginf(total)
    return torch.where(empty[..., None], 0.0, merged), total
