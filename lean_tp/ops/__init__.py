"""Kernels, launchers, registration, references and the tuning table."""

from lean_tp.ops.library import decode_attention

__all__ = ["decode_attention"]
