"""The Triton kernel (through the interpreter on CPU) against the float64 reference.

Outputs, LSE and the merge workspace are NaN-filled before every launch, so an unwritten output
element, or a merge that reads a slot nobody wrote, fails the comparison.
"""

import zlib

import pytest
import torch
from helpers import LAYOUTS, assert_matches_ref, make_inputs, run_kernel

import lean_tp
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launch_args import counters_size
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, plan_decode
from lean_tp.ops.decode_attention.tuning import DecodeConfig, get_config
from lean_tp.ops.utils import interpreted

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not interpreted(decode_attention_fwd_kernel),
    reason="interpreter tests; CUDA runs tests/gpu",
)

ATOL = {torch.float32: 2e-5, torch.float16: 2e-3}
HEADS = [(4, 4), (8, 2), (16, 2), (8, 1)]  # group sizes 1, 4, 8, and MQA


def tile_of(head_dim: int, dtype: torch.dtype) -> int:
    return get_config(torch.device("cpu"), head_dim, dtype).tile_n


def length_sets(tile: int) -> dict[str, list[int]]:
    return {
        "edges": [1, tile - 1, tile, tile + 1],
        "empty": [0, tile + 1],
        "ragged": [2000, 3, 0, 2 * tile + 1],
        "single": [tile],
    }


LENGTH_SETS = ("edges", "empty", "ragged", "single")
DTYPE_DIMS = [(torch.float32, 64), (torch.float16, 128), (torch.float32, 128), (torch.float16, 64)]
# Every (heads, layout, lengths) triple, each with one (dtype, head_dim) pair chosen by a Latin
# square: any three of the five factors appear together in every combination of their values
# (a strength-3 covering array), in 64 runs instead of the 256 of the full product.
MATRIX = [
    (*DTYPE_DIMS[(i + j + k) % 4], *heads, layout, lens)
    for i, heads in enumerate(HEADS)
    for j, layout in enumerate(LAYOUTS)
    for k, lens in enumerate(LENGTH_SETS)
]


@pytest.mark.parametrize(
    "dtype,head_dim,hq,hkv,layout,lens_name",
    MATRIX,
    ids=[f"{str(m[0])[6:]}-{m[1]}-{m[2]}-{m[3]}-{m[4]}-{m[5]}" for m in MATRIX],
)
def test_decode_attention_triton(dtype, head_dim, hq, hkv, layout, lens_name):
    lens = length_sets(tile_of(head_dim, dtype))[lens_name]
    inputs = make_inputs(
        lens, hq, hkv, head_dim, dtype, layout, seed=zlib.crc32(f"{head_dim}{hq}{layout}{lens_name}".encode())
    )
    out, lse = run_kernel(inputs)
    assert_matches_ref(out, lse, inputs, atol=ATOL[dtype])


@pytest.mark.parametrize("num_programs", [1, 2, 3, 5, 7, 64])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_attention_triton_grids(num_programs, layout):
    """Tiny grids make programs straddle heads and sequences; a huge one makes the grid shrink."""
    config = DecodeConfig(
        tile_n=32,
        block_n=16,
        max_block_g=16,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="test: small tiles give many tiles on short sequences",
    )
    inputs = make_inputs([97, 0, 32, 1, 65, 200], 8, 2, 64, torch.float32, layout, seed=num_programs)
    out, lse = run_kernel(inputs, num_programs=num_programs, config=config)
    assert_matches_ref(out, lse, inputs, atol=2e-5)


def test_decode_attention_triton_split_everywhere():
    """Every output split over several programs, with uneven (+-1 tile) program loads."""
    config = DecodeConfig(
        tile_n=16,
        block_n=16,
        max_block_g=16,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="test: one 16-token tile per block",
    )
    inputs = make_inputs([257, 190], 4, 2, 64, torch.float16, "transposed", seed=3)
    total_tiles = 2 * (17 + 12)
    out, lse = run_kernel(inputs, num_programs=total_tiles // 2 - 3, config=config)
    assert_matches_ref(out, lse, inputs, atol=ATOL[torch.float16])


@pytest.mark.parametrize("layout", ["paged1", "paged2", "paged8"])
def test_decode_attention_triton_short_pages(layout):
    """Pages shorter than a K/V block (SGLang's one-token pool among them): a page id per key,
    pages scattered at random, ragged lengths around the tile."""
    tile = tile_of(64, torch.float16)
    inputs = make_inputs([tile + 1, 0, 1, tile - 1, 3 * tile + 5], 8, 2, 64, torch.float16, layout, seed=len(layout))
    out, lse = run_kernel(inputs, num_programs=5)
    assert_matches_ref(out, lse, inputs, atol=ATOL[torch.float16])
    torch_out, torch_lse = lean_tp.decode_attention(**inputs, return_lse=True, backend="torch")
    assert_matches_ref(torch_out, torch_lse, inputs, atol=ATOL[torch.float16])


@pytest.mark.parametrize("num_programs", [None, 3])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "paged16"])
def test_decode_attention_triton_left_padding(layout, num_programs):
    """Left-padded batches: keys start at cache_leftpad[b] (not tile- or page-aligned); the random
    keys in the padding must not be attended to."""
    config = DecodeConfig(
        tile_n=32,
        block_n=16,
        max_block_g=16,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="test: small tiles, so padding offsets cut tiles",
    )
    inputs = make_inputs([40, 0, 1, 97], 8, 2, 64, torch.float32, layout, seed=13, leftpad=[0, 5, 33, 17])
    out, lse = run_kernel(inputs, num_programs=num_programs, config=config)
    assert_matches_ref(out, lse, inputs, atol=2e-5)


def test_decode_attention_triton_large_group_chunks():
    """A group larger than the row block is computed as several head units (NUM_GC > 1)."""
    config = DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=16,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="test: 16-row blocks force 2 chunks of a group of 24",
    )
    inputs = make_inputs([150, 40, 0], 48, 2, 64, torch.float32, "paged16", seed=11)
    out, lse = run_kernel(inputs, num_programs=3, config=config)
    assert_matches_ref(out, lse, inputs, atol=2e-5)


def test_decode_attention_triton_rejects_strided_out():
    """The kernel derives out's and lse's strides from the shape, so strided buffers are refused."""
    inputs = make_inputs([5], 4, 1, 64, torch.float32, seed=1)
    strided = torch.empty(1, 64, 4).transpose(1, 2)
    with pytest.raises(ValueError, match=r"out, lse: expected contiguous tensors, got strides \(256, 1, 4\)"):
        decode_attention_fwd(**inputs, softmax_scale=0.1, out=strided)


def test_launcher_rejects_a_grid_that_does_not_fit_its_sms_or_counters():
    inputs = make_inputs([5], 4, 1, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="num_sms: expected a divisor of num_programs=6, got 4"):
        decode_attention_fwd(**inputs, softmax_scale=0.1, num_programs=6, num_sms=4)
    with pytest.raises(ValueError, match=f"counters: expected at least {counters_size(6)} elements, got 8"):
        decode_attention_fwd(**inputs, softmax_scale=0.1, num_programs=6, counters=torch.zeros(8, dtype=torch.int32))
    plan = plan_decode(**inputs, num_programs=4)
    with pytest.raises(ValueError, match="config, num_programs, num_sms: expected None with a plan"):
        decode_attention_fwd(**inputs, softmax_scale=0.1, plan=plan, num_programs=8)


def test_decode_attention_triton_counters_reset_and_deterministic():
    """The kernel leaves its counters at zero, so a reused buffer gives identical results."""
    config = DecodeConfig(
        tile_n=32,
        block_n=16,
        max_block_g=16,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="test: many split outputs",
    )
    inputs = make_inputs([300, 77, 129], 8, 2, 64, torch.float32, "contiguous", seed=5)
    counters = torch.zeros(counters_size(5), dtype=torch.int32)
    first = run_kernel(inputs, num_programs=5, config=config, counters=counters)
    assert (counters == 0).all()
    second = run_kernel(inputs, num_programs=5, config=config, counters=counters)
    assert (counters == 0).all()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert_matches_ref(*first, inputs, atol=2e-5)


def test_decode_attention_public_api_triton_backend():
    """The registered op's Triton path, with default scale and explicit scale."""
    inputs = make_inputs([130, 0, 5], 8, 2, 128, torch.float16, "paged16", seed=7)
    out, lse = lean_tp.decode_attention(**inputs, backend="triton", return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert_matches_ref(out, lse, inputs, atol=ATOL[torch.float16])
    padded = make_inputs([60, 0, 5], 8, 2, 128, torch.float16, "paged16", seed=8, leftpad=[70, 3, 0])
    out, lse = lean_tp.decode_attention(**padded, backend="triton", return_lse=True)
    assert_matches_ref(out, lse, padded, atol=ATOL[torch.float16])
    scaled = lean_tp.decode_attention(**inputs, softmax_scale=0.3, backend="triton")
    expected = lean_tp.decode_attention(**inputs, softmax_scale=0.3, backend="torch")
    torch.testing.assert_close(scaled, expected, atol=2e-3, rtol=0)
