"""torch.library registration: opcheck, and torch.compile(fullgraph=True) against eager."""

import pytest
import torch
from helpers import make_inputs

import lean_tp


def _op_args(inputs, backend="auto"):
    scale = inputs["q"].shape[-1] ** -0.5
    return (
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["cache_seqlens"],
        inputs["block_table"],
        inputs["cache_leftpad"],
        scale,
        backend,
    )


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck(dtype, layout):
    inputs = make_inputs([0, 5, 70], 8, 2, 64, dtype, layout, seed=4)
    torch.library.opcheck(torch.ops.lean_tp.decode_attention.default, _op_args(inputs))


def test_opcheck_left_padding():
    inputs = make_inputs([0, 5, 70], 8, 2, 64, torch.float32, seed=5, leftpad=[3, 0, 17])
    torch.library.opcheck(torch.ops.lean_tp.decode_attention.default, _op_args(inputs))


def test_op_schema_and_fake_shapes():
    inputs = make_inputs([3, 9], 8, 2, 64, torch.float16, seed=4)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if v is not None else None) for k, v in inputs.items()}
        out, lse = torch.ops.lean_tp.decode_attention(*_op_args(fake))
    assert out.shape == (2, 8, 64) and out.dtype == torch.float16
    assert lse.shape == (2, 8) and lse.dtype == torch.float32


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_compile_fullgraph_matches_eager(layout):
    inputs = make_inputs([0, 17, 200], 8, 2, 64, torch.float32, layout, seed=6, leftpad=[0, 4, 1])

    def step(q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad):
        out, lse = lean_tp.decode_attention(
            q * 1.5,
            k_cache,
            v_cache,
            cache_seqlens,
            block_table=block_table,
            cache_leftpad=cache_leftpad,
            return_lse=True,
        )
        return out + 1.0, lse

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    eager = step(**inputs)
    got = compiled(**inputs)
    torch.testing.assert_close(got[0], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], eager[1], atol=1e-5, rtol=1e-5)
    # New lengths, same shapes: no recompilation is needed and the result follows the new lengths.
    inputs["cache_seqlens"] = torch.tensor([0, 7, 199], dtype=torch.int32)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled(**inputs)
    torch.testing.assert_close(got[0], step(**inputs)[0], atol=1e-5, rtol=1e-5)
