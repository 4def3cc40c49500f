"""Exact merge of attention partials computed over disjoint key sets, from their (out, lse).

    rule.py    the merge rule of two partials, shared with decode_attention's torch backend
    op.py      torch.library registration, public API (the merge itself is plain torch)
    naive.py   the float64 reference

Context-parallel decode (``lean_tp.distributed.cp``) merges the partials of the ranks that hold
the shares of one sequence with it.
"""

from lean_tp.ops.merge_attention.naive import merge_attention_ref
from lean_tp.ops.merge_attention.op import merge_attention
from lean_tp.ops.merge_attention.rule import merge_partials

__all__ = ["merge_attention", "merge_attention_ref", "merge_partials"]
