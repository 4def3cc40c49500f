"""Exact or refused, never wrong: every (q dtype, cache dtype, backend, device) combination either
matches the float64 reference within the documented tolerance (``helpers.ATOL``) or raises a
``TypeError``/``ValueError`` that names the argument.

bf16 arithmetic is wrong in the Triton interpreter (numpy has no bf16); the kernel computes its dots
in fp32 there, so ``backend="triton"`` with bf16 on CPU is exact too, not silently off.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ATOL
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

import lean_tp
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.utils import interpreted

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_KINDS = ("same", torch.float8_e4m3fn, torch.float8_e5m2)
BACKENDS = ("auto", "torch", "triton")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Ragged around the interpreter tile (256 keys at D=64), with an empty sequence.
LENS = [0, 1, 255, 257, 600]


def _refusal(q_dtype: torch.dtype, cache, backend: str, device: str) -> tuple[type, str] | None:
    """The documented error of a combination, or None when it must compute."""
    if cache != "same" and q_dtype == torch.float32:
        return TypeError, "q: expected float16 or bfloat16 with an fp8 k_cache"
    if backend == "triton" and device == "cpu" and not interpreted(decode_attention_fwd_kernel):
        return ValueError, "backend: 'triton' on cpu tensors runs through the Triton interpreter"
    return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache", CACHE_KINDS, ids=lambda c: c if isinstance(c, str) else str(c).removeprefix("torch."))
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_backend_device_is_exact_or_refused(q_dtype, cache, backend, device):
    inputs = make_feature_inputs(
        LENS, 8, 2, 64, q_dtype, "paged16", cache_dtype=None if cache == "same" else cache, seed=len(str(cache))
    )
    if cache != "same" and q_dtype == torch.float32:  # make_feature_inputs builds fp8 caches for 16-bit q only
        inputs["k_cache"] = inputs["k_cache"].to(cache)
        inputs["v_cache"] = inputs["v_cache"].to(cache)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    refusal = _refusal(q_dtype, cache, backend, device)
    if refusal is not None:
        with pytest.raises(refusal[0], match=refusal[1]):
            lean_tp.decode_attention(**inputs, return_lse=True, backend=backend)
        return
    out, lse = lean_tp.decode_attention(**inputs, return_lse=True, backend=backend)
    assert_matches_feature_ref(out, lse, inputs, ATOL[q_dtype])


@pytest.mark.skipif(not interpreted(decode_attention_fwd_kernel), reason="the interpreter's bf16")
def test_bf16_on_the_interpreter_matches_the_torch_backend_on_contiguous_caches():
    """The failure this file guards against: errors of ~1e8 from bf16 dots in the interpreter."""
    inputs = make_feature_inputs([37, 100, 300], 8, 2, 128, torch.bfloat16, "contiguous", tq=2)
    got = lean_tp.decode_attention(**inputs, backend="triton")
    want = lean_tp.decode_attention(**inputs, backend="torch")
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[torch.bfloat16], rtol=0)
