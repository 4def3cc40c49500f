"""LeanAttention decode, one folder for the whole op.

- kernel.py: the Triton kernel; rows.py: a head unit's rows (q loads, row bounds, output stores)
- attend.py: the K/V loop; schedule.py: the device-side stream-K schedule
- merge.py: the kernel's merge tree; invariant.py: the batch-invariant mode (chunks.py: its K/V
  loop over chunks; folds.py: its folds across programs)
- plan.py: one call's plan (layout, features, kernel variant, grid)
- launcher.py: ``plan_decode`` and the launch; launch_args.py: the kernel's arguments, workspace
- grid.py: occupancy and grid size; tuning.py: the launch-constant table
- op.py: ``torch.library`` registration, the public API; checks.py: input validation
- cache.py: the KV-cache description; torch_impl.py: the plain-torch backend; naive.py: float64
"""

from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.checks import kernel_support
from lean_tp.ops.decode_attention.grid import grid_size
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, lean_schedule, plan_decode
from lean_tp.ops.decode_attention.naive import decode_attention_ref
from lean_tp.ops.decode_attention.op import decode_attention
from lean_tp.ops.decode_attention.plan import DecodePlan, Features, KernelVariant
from lean_tp.ops.decode_attention.torch_impl import decode_attention_torch

__all__ = [
    "CacheLayout",
    "DecodePlan",
    "Features",
    "KernelVariant",
    "decode_attention",
    "decode_attention_fwd",
    "decode_attention_ref",
    "decode_attention_torch",
    "grid_size",
    "kernel_support",
    "lean_schedule",
    "plan_decode",
]
