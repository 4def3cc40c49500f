"""Helpers shared by the ops (lean_tp/ops/utils.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lean_tp.ops import utils
from lean_tp.ops.utils import check_interpreter_numpy


@pytest.mark.parametrize(
    "triton_version, numpy_version", [("3.7.1", "2.4.6"), ("3.8.0", "2.5.0"), ("3.6.0", "2.3.5"), ("3.6.0", "1.26.4")]
)
def test_interpreter_stacks_that_work_pass(triton_version, numpy_version):
    check_interpreter_numpy(triton_version, numpy_version)


@pytest.mark.parametrize(
    "triton_version, numpy_version", [("3.6.0", "2.4.0"), ("3.6.0", "2.4.6"), ("3.5.1", "3.0.0rc1")]
)
def test_triton36_interpreter_with_numpy24_fails_fast_naming_the_fix(triton_version, numpy_version):
    with pytest.raises(ImportError, match=rf"expected numpy < 2.4, got numpy {numpy_version}.*'numpy<2.4'"):
        check_interpreter_numpy(triton_version, numpy_version)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _doubled_eight_times_kernel(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    for _ in range(8):
        x = _twice(x)
    tl.store(out_ptr + tl.arange(0, N), x)


@pytest.mark.skipif(not utils.interpreted(_doubled_eight_times_kernel), reason="the Triton interpreter's patching")
def test_the_interpreter_maps_the_language_once_a_launch(monkeypatch):
    """Importing lean_tp under TRITON_INTERPRET=1 wraps the interpreter's language patcher: a launch
    patches once, its 8 helper calls do not again, the next launch patches anew, and the language
    is restored between launches; the result is the kernel's."""
    from triton.runtime import interpreter

    assert interpreter._patch_lang is utils._patch_lang_once
    calls = []
    patch = utils._patch_lang
    monkeypatch.setattr(utils, "_patch_lang", lambda fn: (calls.append(fn.__name__), patch(fn))[1])
    x = torch.randn(16)
    for launch in (1, 2):
        out = torch.full_like(x, float("nan"))
        _doubled_eight_times_kernel[(1,)](x, out, N=16)
        assert calls == ["_doubled_eight_times_kernel"] * launch and torch.equal(out, x * 256)
        assert tl.core.is_builtin(tl.arange)  # restored: outside a launch the language is Triton's own
