"""One folder per op (kernel, launcher, registration, tuning, checks, torch path and reference
together), ``utils.py`` for helpers they share, and ``interpreter.py`` for what
``TRITON_INTERPRET=1`` gets."""

import triton

if triton.knobs.runtime.interpret:  # TRITON_INTERPRET=1: check the stack before any kernel is defined
    import numpy

    from lean_tp.ops.interpreter import check_interpreter_numpy, speed_up_interpreter

    check_interpreter_numpy(triton.__version__, numpy.__version__)
    speed_up_interpreter()

from lean_tp.ops.decode_attention import decode_attention  # noqa: E402
from lean_tp.ops.merge_attention import merge_attention  # noqa: E402

__all__ = ["decode_attention", "merge_attention"]
