"""The merge rule: two softmax partials of the same query rows over disjoint keys make one.

The decode kernel applies it in the log2 domain to its programs' partials (``decode_attention/
merge.py``); the torch backend to its chunks; ``merge_attention`` to the partials of separate
calls (context-parallel ranks), each as m = lse, l = 1.
"""

from __future__ import annotations

import torch


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
