"""MLA decode (V head dim below K's): V is the first Dv columns of each latent K row.

The float64 reference and the torch backend take it; the Triton kernel does not yet, and the op
refuses ``v_cache.shape != k_cache.shape`` before any backend runs (``checks.check_inputs``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import ATOL, make_inputs

from lean_tp.ops.decode_attention.naive import decode_attention_ref
from lean_tp.ops.decode_attention.torch_impl import decode_attention_torch

# A scaled-down latent row (DeepSeek-V3: Dqk 576 = 512 latent + 64 rope, Dv 512), so that the
# rope columns are read by QK^T only.
DQK, DV = 72, 64
LENS = [0, 1, 15, 16, 17, 70]


def _mla_inputs(layout: str, num_q_heads: int, dtype: torch.dtype, seed: int) -> dict:
    inputs = make_inputs(LENS, num_q_heads, 1, DQK, dtype, layout, seed=seed)
    inputs["v_cache"] = inputs["k_cache"][..., :DV]  # the same storage: one latent cache
    return inputs


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_attention_ref_mla_is_full_v_sliced(layout):
    """Attention is linear in V's columns: the prefix-view answer is the full-row answer's first Dv."""
    inputs = _mla_inputs(layout, 16, torch.float32, seed=1)
    out, lse = decode_attention_ref(**inputs, softmax_scale=DQK**-0.5)
    full_out, full_lse = decode_attention_ref(**dict(inputs, v_cache=inputs["k_cache"]), softmax_scale=DQK**-0.5)
    assert out.shape == (len(LENS), 16, DV)
    torch.testing.assert_close(out, full_out[..., :DV], rtol=0, atol=0)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads", [16, 64])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_attention_torch_mla(layout, num_q_heads, dtype):
    inputs = _mla_inputs(layout, num_q_heads, dtype, seed=2)
    ref_out, ref_lse = decode_attention_ref(**inputs, softmax_scale=DQK**-0.5)
    out, lse = decode_attention_torch(**inputs, softmax_scale=DQK**-0.5)
    assert out.shape == (len(LENS), num_q_heads, DV) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=ATOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=ATOL[torch.float32] * 10)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()  # length 0: no key, empty row
