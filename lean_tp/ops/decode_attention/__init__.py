"""LeanAttention decode: kernel (kernel.py, schedule.py), launcher, torch backend, float64 reference."""

from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, grid_size
from lean_tp.ops.decode_attention.naive import decode_attention_ref
from lean_tp.ops.decode_attention.torch_impl import decode_attention_torch, merge_partials

__all__ = ["decode_attention_fwd", "decode_attention_ref", "decode_attention_torch", "grid_size", "merge_partials"]
