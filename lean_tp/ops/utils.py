"""Helpers shared by every op folder under ``lean_tp/ops/`` (as ``fla/ops/utils`` is for
flash-linear-attention): nothing here knows about one op."""

from __future__ import annotations


def interpreted(kernel: object) -> bool:
    """True when ``kernel`` was defined under ``TRITON_INTERPRET=1`` and so runs on CPU tensors.

    The decorator reads the variable when the kernel is defined, so a later change of the
    environment does not change the answer: ask the kernel, not the environment.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
