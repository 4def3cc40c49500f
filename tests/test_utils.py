"""Helpers shared by the ops (lean_tp/ops/utils.py)."""

from __future__ import annotations

import pytest

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
