"""LeanAttention decode, one folder for the whole op.

    kernel.py     the Triton kernel            schedule.py   its device-side stream-K schedule
    attend.py     the kernel's K/V loop        merge.py      its merge tree; invariant.py: batch-invariant fold
    launcher.py   grid sizing, workspace       op.py         torch.library registration, public API
    tuning.py     the launch-constant table    cache.py      the KV-cache description
    checks.py     input validation, and which calls the kernel takes
    torch_impl.py the plain-torch backend      naive.py      the float64 reference
"""

from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.checks import kernel_support
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, grid_size, lean_schedule
from lean_tp.ops.decode_attention.naive import decode_attention_ref
from lean_tp.ops.decode_attention.op import decode_attention
from lean_tp.ops.decode_attention.torch_impl import decode_attention_torch, merge_partials

__all__ = [
    "CacheLayout",
    "decode_attention",
    "decode_attention_fwd",
    "decode_attention_ref",
    "decode_attention_torch",
    "grid_size",
    "kernel_support",
    "lean_schedule",
    "merge_partials",
]
