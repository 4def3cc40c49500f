"""What importing lean_tp does to Triton's interpreter (lean_tp/ops/interpreter.py)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from lean_tp.ops import interpreter as lean_interpreter
from lean_tp.ops.interpreter import check_interpreter_numpy
from lean_tp.ops.utils import interpreted


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


@pytest.mark.skipif(not interpreted(_doubled_eight_times_kernel), reason="the Triton interpreter's patching")
def test_the_interpreter_maps_the_language_once_a_launch(monkeypatch):
    """Importing lean_tp under TRITON_INTERPRET=1 wraps the interpreter's language patcher: a launch
    patches once, its 8 helper calls do not again, the next launch patches anew, and the language
    is restored between launches; the result is the kernel's."""
    from triton.runtime import interpreter

    assert interpreter._patch_lang is lean_interpreter._patch_lang_once
    calls = []
    patch = lean_interpreter._patch_lang
    monkeypatch.setattr(lean_interpreter, "_patch_lang", lambda fn: (calls.append(fn.__name__), patch(fn))[1])
    x = torch.randn(16)
    for launch in (1, 2):
        out = torch.full_like(x, float("nan"))
        _doubled_eight_times_kernel[(1,)](x, out, N=16)
        assert calls == ["_doubled_eight_times_kernel"] * launch and torch.equal(out, x * 256)
        assert tl.core.is_builtin(tl.arange)  # restored: outside a launch the language is Triton's own


@triton.jit
def _int32_ops_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    y = tl.load(y_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), x * y + x - y)


@pytest.mark.skipif(not interpreted(_int32_ops_kernel), reason="the Triton interpreter's internals")
def test_the_interpreter_skips_only_work_whose_result_is_discarded():
    """numpy dtypes come from a cache that answers as the interpreter's own function does, for
    every Triton dtype, blocks of it and pointers to it; integer overflow checks are off on the
    interpreter's builder, whose ``debug`` is off (so ``device_assert`` dropped them); int32
    arithmetic still wraps as on a GPU."""
    from triton.runtime import interpreter

    get = interpreter._get_np_dtype
    assert get.memoized
    dtypes = [v for v in vars(tl).values() if type(v) is tl.dtype and v.name != "void"]
    assert len(dtypes) >= 18
    for dtype in dtypes:
        for tt in (
            dtype,
            tl.block_type(dtype, [4, 2]),
            tl.pointer_type(dtype),
            tl.block_type(tl.pointer_type(dtype), [4]),
        ):
            first = get(tt)  # fills the cache, where a key can be made
            assert first == get.__wrapped__(tt) and get(tt) == first, tt
    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
    x = torch.tensor([2**30, -(2**31), 7, -1, 46341, 0, 2**31 - 1, 3], dtype=torch.int32)
    y = torch.tensor([4, -1, -3, 2**31 - 1, 46341, -(2**31), 2, 5], dtype=torch.int32)
    out = torch.full_like(x, -12345)
    _int32_ops_kernel[(1,)](x, y, out, N=8)
    want = (x.numpy().astype(np.int64) * y.numpy() + x.numpy() - y.numpy() + 2**31) % 2**32 - 2**31
    assert out.tolist() == want.tolist()


def test_overflow_checks_stay_when_the_builder_debugs():
    """With ``debug`` set, ``device_assert`` asserts the checks: they stay on."""
    from triton.runtime.interpreter import InterpreterOptions

    for debug in (True, False):
        fake = types.SimpleNamespace(interpreter_builder=types.SimpleNamespace(options=InterpreterOptions(debug=debug)))
        lean_interpreter._skip_discarded_overflow_checks(fake)
        assert fake.interpreter_builder.options.sanitize_overflow is debug
        assert dataclasses.replace(fake.interpreter_builder.options, sanitize_overflow=True) == InterpreterOptions(
            debug=debug
        )
