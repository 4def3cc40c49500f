"""One folder per op (kernel, launcher, registration, tuning, checks, torch path and reference
together), and ``utils.py`` for helpers they share."""

from lean_tp.ops.decode_attention import decode_attention

__all__ = ["decode_attention"]
