"""Helpers shared by every op folder under ``lean_tp/ops/`` (as ``fla/ops/utils`` is for
flash-linear-attention): nothing here knows about one op."""

from __future__ import annotations

import torch

# The floating dtypes the ops compute in (q, out); caches may also be fp8.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def require_tensor(name: str, x: object) -> None:
    """``TypeError`` naming the argument unless ``x`` is a tensor (before the dispatcher rejects
    it with a RuntimeError)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def interpreted(kernel: object) -> bool:
    """True when ``kernel`` was defined under ``TRITON_INTERPRET=1`` and so runs on CPU tensors.

    The decorator reads the variable when the kernel is defined, so a later change of the
    environment does not change the answer: ask the kernel, not the environment.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"3.7.1"`` or ``"2.13.0+cpu"``."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
