"""One folder per op (kernel, launcher, registration, tuning, checks, torch path and reference
together), and ``utils.py`` for helpers they share."""

import triton

if triton.knobs.runtime.interpret:  # TRITON_INTERPRET=1: check the stack before any kernel is defined
    import numpy

    from lean_tp.ops.utils import check_interpreter_numpy, interpret_device_calls_once

    check_interpreter_numpy(triton.__version__, numpy.__version__)
    interpret_device_calls_once()

from lean_tp.ops.decode_attention import decode_attention  # noqa: E402
from lean_tp.ops.merge_attention import merge_attention  # noqa: E402

__all__ = ["decode_attention", "merge_attention"]
