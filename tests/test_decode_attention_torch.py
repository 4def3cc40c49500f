"""The plain-torch backend (the CPU path users get) against the float64 reference."""

import pytest
import torch
from helpers import LAYOUTS, assert_matches_ref, make_inputs

import lean_tp
from lean_tp.ops.decode_attention import torch_impl

ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2), (8, 1)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_decode_attention_torch(dtype, head_dim, hq, hkv, layout):
    inputs = make_inputs([0, 1, 127, 128, 129, 1500], hq, hkv, head_dim, dtype, layout, seed=head_dim + hq)
    out, lse = lean_tp.decode_attention(**inputs, backend="torch", return_lse=True)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert_matches_ref(out, lse, inputs, atol=ATOL[dtype])


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_attention_torch_many_chunks(monkeypatch, layout):
    """Small chunks make every sequence span several merged chunks, some of them fully masked."""
    monkeypatch.setattr(torch_impl, "CHUNK_TOKENS", 48)
    inputs = make_inputs([0, 47, 48, 49, 300], 8, 2, 64, torch.float32, layout, seed=1)
    out, lse = lean_tp.decode_attention(**inputs, backend="torch", return_lse=True)
    assert_matches_ref(out, lse, inputs, atol=2e-5)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_attention_torch_left_padding(monkeypatch, layout):
    """Padding that spans whole chunks, ends inside one, or leaves nothing valid."""
    monkeypatch.setattr(torch_impl, "CHUNK_TOKENS", 48)
    inputs = make_inputs([10, 0, 200, 1], 8, 2, 64, torch.float32, layout, seed=6, leftpad=[0, 30, 100, 47])
    out, lse = lean_tp.decode_attention(**inputs, backend="torch", return_lse=True)
    assert_matches_ref(out, lse, inputs, atol=2e-5)


def test_decode_attention_auto_on_cpu_is_torch():
    inputs = make_inputs([33, 0], 4, 2, 64, torch.float32, seed=2)
    torch.testing.assert_close(
        lean_tp.decode_attention(**inputs), lean_tp.decode_attention(**inputs, backend="torch"), atol=0, rtol=0
    )
