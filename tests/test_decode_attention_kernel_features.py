"""Serving features on the Triton kernel (interpreter on CPU): multi-token queries, sliding windows,
softcap, sinks, fp8 KV caches and head dims that are not a power of two, alone and together,
against the float64 reference.

Outputs, lse and the workspace are NaN-filled before each launch, so an unwritten element fails.
Grids are forced to 1 program (no splits), 4 and 64 (many splits: outputs straddle programs, so
windows, sinks and query rows cross merges). The interpreter's bf16 arithmetic is wrong,
so it runs fp16 and fp32 here; bf16, and every fp8 configuration, are compiled for sm_80 and
sm_90 by tests/test_kernel_report.py and run on a GPU by tests/gpu.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from helpers import ATOL, LAYOUTS, launcher_form
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

import lean_tp
from lean_tp.ops.decode_attention import decode_attention_ref
from lean_tp.ops.decode_attention.attend import e4m3_words_to_f16
from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.checks import MAX_QUERY_TOKENS, kernel_support
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launch_args import launch_args, plan_workspace
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, plan_decode
from lean_tp.ops.decode_attention.tuning import get_config
from lean_tp.ops.utils import interpreted

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not interpreted(decode_attention_fwd_kernel),
    reason="interpreter tests; CUDA runs tests/gpu",
)

FEATURE_ARGS = ("cache_leftpad", "k_scale", "v_scale", "softcap", "window", "sinks")


def _kernel_call(inputs: dict, num_programs: int) -> dict:
    """Launcher arguments with NaN-filled out, lse and workspace."""
    q = inputs["q"]
    call = {**launcher_form(inputs), "softmax_scale": q.shape[-1] ** -0.5}
    plan = plan_decode(**call, num_programs=num_programs)
    workspace = tuple(t.fill_(float("nan")) for t in plan_workspace(plan, "cpu"))
    call.update(
        plan=plan, workspace=workspace, out=torch.full_like(q, float("nan")), lse=torch.full(q.shape[:-1], float("nan"))
    )
    return call


def check_kernel(inputs: dict, num_programs: int, atol: float) -> None:
    call = _kernel_call(inputs, num_programs)
    out, lse = decode_attention_fwd(**call)
    assert_matches_feature_ref(out, lse, inputs, atol)


def tile_lens(head_dim: int = 64) -> list[int]:
    """0, 1, tile - 1, tile, tile + 1 and a few tiles: every way a sequence meets the LeanTiles."""
    tile = get_config(torch.device("cpu"), head_dim, torch.float32).tile_n
    return [0, 1, tile - 1, tile, tile + 1, 3 * tile + 5]


TOKEN_ROWS = {"tq2_g4": (2, 8, 2), "tq4_g1": (4, 4, 4), "tq8_mqa": (8, 8, 1)}
# Every (rows, grid) pair, the layout alternating so that each layout meets every rows case and
# every grid: a strength-2 covering array, 9 runs instead of 18.
TOKEN_MATRIX = [
    (name, layout, programs)
    for i, name in enumerate(TOKEN_ROWS)
    for j, programs in enumerate([1, 4, 64])
    for layout in [("contiguous", "paged16")[(i + j) % 2]]
]


@pytest.mark.parametrize("rows,layout,num_programs", TOKEN_MATRIX, ids=["-".join(map(str, m)) for m in TOKEN_MATRIX])
def test_multi_token_queries(rows, layout, num_programs):
    """Tq x group rows per KV head (8 x 8 = 64: a full row block); lengths below Tq leave rows empty."""
    tq, hq, hkv = TOKEN_ROWS[rows]
    inputs = make_feature_inputs(tile_lens(), hq, hkv, 64, torch.float32, layout, tq=tq, seed=tq)
    check_kernel(inputs, num_programs, ATOL[torch.float32])


def test_rows_split_over_row_blocks():
    """Tq = 16 with a group of 8: 128 rows per KV head, two row blocks (head units) of 64."""
    inputs = make_feature_inputs([70, 0, 300], 16, 2, 64, torch.float16, "paged16", tq=MAX_QUERY_TOKENS, seed=2)
    check_kernel(inputs, 4, ATOL[torch.float16])


@pytest.mark.parametrize("num_programs", [1, 4, 64])
@pytest.mark.parametrize("window,tq", [(1, 1), (16, 1), (300, 1), (1, 3), (17, 4), (300, 2)])
def test_sliding_window(window, tq, num_programs):
    """Windows of 1 key, under a tile and over a tile, with left padding; the span the schedule
    tiles starts mid-tile, and with Tq > 1 each row has its own window."""
    lens = tile_lens()
    inputs = make_feature_inputs(
        lens,
        8,
        2,
        64,
        torch.float32,
        "paged16",
        tq=tq,
        window=window,
        leftpad=[3 * (i % 3) for i in range(len(lens))],
        seed=window + tq,
    )
    check_kernel(inputs, num_programs, ATOL[torch.float32])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_softcap(layout):
    inputs = make_feature_inputs(tile_lens(), 8, 2, 64, torch.float32, layout, softcap=2.0, seed=4)
    inputs["q"] *= 8  # large logits, so the cap bites
    check_kernel(inputs, 4, ATOL[torch.float32])


@pytest.mark.parametrize("num_programs", [1, 64])
def test_sinks_with_empty_sequences_and_splits(num_programs):
    """The sink joins each output's denominator once, after the merge; an empty sequence gives 0
    and lse = the sink."""
    inputs = make_feature_inputs(tile_lens(), 8, 2, 64, torch.float32, "contiguous", sinks=True, seed=6)
    check_kernel(inputs, num_programs, ATOL[torch.float32])


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("per_head_scale", [False, True], ids=["tensor_scale", "head_scale"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache(cache_dtype, per_head_scale, layout):
    inputs = make_feature_inputs(
        tile_lens(128), 8, 2, 128, torch.float16, layout, cache_dtype=cache_dtype, per_head_scale=per_head_scale, seed=7
    )
    check_kernel(inputs, 4, ATOL[torch.float16])


@pytest.mark.parametrize("head_dim", [40, 256])
def test_fp8_cache_head_dims(head_dim):
    """The fp8 tuning entries at the other padded sizes (64 with 256-key blocks, 256 with 64-key
    blocks), per-head scales, a tile's worth of ragged lengths."""
    inputs = make_feature_inputs(
        tile_lens(head_dim),
        8,
        2,
        head_dim,
        torch.bfloat16,
        "paged16",
        cache_dtype=torch.float8_e4m3fn,
        per_head_scale=True,
        seed=head_dim,
    )
    check_kernel(inputs, 4, ATOL[torch.bfloat16])


@triton.jit
def _e4m3_words_kernel(w_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    o_r = tl.arange(0, R)
    x = e4m3_words_to_f16(tl.load(w_ptr + o_r[:, None] * C + tl.arange(0, C)[None, :]))
    tl.store(out_ptr + o_r[:, None] * 4 * C + tl.arange(0, 4 * C)[None, :], x)


def test_e4m3_words_convert_every_byte_in_every_position():
    """The word conversion gives every float8_e4m3fn byte's value x 2^-8, bitwise, subnormals and
    signed zeros included, at each of a word's four byte positions; the NaN codes (unused by a
    KV cache) become +-1.875 (480 x 2^-8), finite."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    tile = torch.stack([codes.roll(k) for k in range(4)], dim=-1).reshape(64, 16)  # each code at each position
    out = torch.full((64, 16), float("nan"), dtype=torch.float16)
    _e4m3_words_kernel[(1,)](tile.view(torch.int32), out, R=64, C=4)
    expected = (tile.view(torch.float8_e4m3fn).float() * 2.0**-8).half()
    nan = expected.isnan()
    assert nan.sum() == 8  # 0x7f and 0xff at each position
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert torch.equal(out[nan].abs(), torch.full((8,), 1.875, dtype=torch.float16))


def _shifted(cache: torch.Tensor, offset: int) -> torch.Tensor:
    """``cache``'s values in a fresh buffer, starting ``offset`` elements in."""
    buf = torch.empty(cache.numel() + offset, dtype=cache.dtype)
    buf[offset:] = cache.flatten()
    return buf[offset:].view(cache.shape)


@pytest.mark.parametrize("offset", [0, 2], ids=["words", "bytes"])
def test_fp8_e4m3_as_bytes_matches_the_native_conversion(offset):
    """sm_80's path (e4m3 read as int32 words, or as uint8 bytes where the caches do not start on
    a 4-byte boundary, converted by bit moves) gives bitwise the result of the native conversion,
    checked by running both variants in the interpreter."""
    inputs = make_feature_inputs(
        [0, 9, 300],
        8,
        2,
        64,
        torch.float16,
        "paged16",
        tq=2,
        cache_dtype=torch.float8_e4m3fn,
        per_head_scale=True,
        seed=8,
    )
    inputs["v_cache"] = _shifted(inputs["v_cache"], offset)
    # Keys over fp8's whole range, subnormals included (clamped: torch 2.11 casts overflow to NaN).
    spread = inputs["k_cache"].float() * torch.logspace(-3, 1.5, inputs["k_cache"].shape[1])[None, :, None, None]
    inputs["k_cache"] = _shifted(spread.clamp(-448, 448).to(torch.float8_e4m3fn), offset)
    results = []
    for arch in ("sm80", "interp"):
        call = _kernel_call(inputs, 4)
        plan = call["plan"]
        plan = dataclasses.replace(plan, kernel=dataclasses.replace(plan.kernel, arch=arch))
        args = launch_args(
            plan,
            call["q"],
            call["k_cache"],
            call["v_cache"],
            call["cache_seqlens"],
            None,
            call["block_table"],
            call["out"],
            call["lse"],
            call["workspace"],
            torch.zeros(16, dtype=torch.int32),
            call["softmax_scale"],
            call["k_scale"],
            call["v_scale"],
        )
        assert args["E4M3_BITS"] == (arch == "sm80")
        read_as = {"sm80": torch.uint8 if offset % 4 else torch.int32, "interp": torch.float8_e4m3fn}
        assert args["k_ptr"].dtype == args["v_ptr"].dtype == read_as[arch]
        decode_attention_fwd_kernel[(4,)](**args)
        results.append((call["out"], call["lse"]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    ref_out, _ = decode_attention_ref(**inputs)
    torch.testing.assert_close(results[0][0].double(), ref_out, atol=ATOL[torch.float16], rtol=0)


@pytest.mark.parametrize("layout", ["paged16", "paged64"])
def test_page_lookup_off_the_page_grid(layout):
    """Page ids are looked up for each block inside the K/V loop, page and slot by a shift and a
    mask: block starts off the page grid (left padding, a window) and every way a sequence meets
    the tiles."""
    inputs = make_feature_inputs(
        tile_lens(128) + [700],
        8,
        2,
        128,
        torch.float16,
        layout,
        tq=2,
        leftpad=[3, 0, 17, 1, 0, 5, 2],
        window=150,
        seed=14,
    )
    check_kernel(inputs, 4, ATOL[torch.float16])


@pytest.mark.parametrize("head_dim,tq", [(128, 1), (256, 2)])
def test_pages_holding_whole_blocks(head_dim, tq):
    """Pages of BLOCK_N keys or more, blocks on the page grid (no left padding, no window): one
    page id per block, looked up by the block's first key. D=256 puts two 32-key blocks in each
    64-key page, the second starting mid-page (a lookup a block off fails here, not at D=128)."""
    inputs = make_feature_inputs(tile_lens(head_dim) + [700], 8, 2, head_dim, torch.float16, "paged64", tq=tq, seed=15)
    assert get_config(torch.device("cpu"), head_dim, torch.float16).block_n <= 64
    check_kernel(inputs, 4, ATOL[torch.float16])


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e5m2], ids=["fp16", "e5m2"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_v_strides_apart_from_k(layout, cache_dtype):
    """V in the right half of a wider allocation (its strides are not K's): the variant that forms
    V's addresses from V's strides, where a paged cache otherwise reuses K's (SAME_KV_STRIDES)."""
    inputs = make_feature_inputs(
        tile_lens(64), 8, 2, 64, torch.float16, layout, tq=2, cache_dtype=cache_dtype, window=100, seed=13
    )
    v = inputs["v_cache"]
    wide = torch.randn(*v.shape[:-1], 2 * v.shape[-1]).to(v.dtype)  # the left half is never read
    wide[..., v.shape[-1] :] = v
    inputs["v_cache"] = wide[..., v.shape[-1] :]
    layout_of = CacheLayout.of(inputs["k_cache"], inputs["v_cache"], inputs["block_table"])
    assert layout_of.k_strides != layout_of.v_strides
    assert _kernel_call(inputs, 4)["plan"].features.kv_strides_differ
    check_kernel(inputs, 4, ATOL[torch.float16])


@pytest.mark.parametrize(
    "head_dim,dtype",
    [(40, torch.float32), (80, torch.float16), (96, torch.float16), (160, torch.float32), (192, torch.float16)],
)
def test_head_dims_padded_to_a_power_of_two(head_dim, dtype):
    inputs = make_feature_inputs(tile_lens(head_dim), 8, 2, head_dim, dtype, "paged16", seed=head_dim)
    check_kernel(inputs, 4, ATOL[dtype])


@pytest.mark.parametrize("num_programs", [1, 4, 64])
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_every_feature_together(layout, num_programs):
    inputs = make_feature_inputs(
        [0, 9, 129, 700],
        8,
        2,
        96,
        torch.float16,
        layout,
        tq=4,
        cache_dtype=torch.float8_e4m3fn,
        leftpad=[2, 0, 5, 1],
        softcap=10.0,
        window=40,
        sinks=True,
        per_head_scale=True,
        seed=9,
    )
    check_kernel(inputs, num_programs, ATOL[torch.float16])


def test_the_op_runs_every_feature_on_the_triton_backend():
    """Through lean_tp.decode_attention: the same result as the torch backend, within rounding."""
    inputs = make_feature_inputs(
        [0, 33, 200],
        8,
        2,
        80,
        torch.float16,
        "paged16",
        tq=3,
        cache_dtype=torch.float8_e5m2,
        softcap=20.0,
        window=50,
        sinks=True,
        seed=12,
    )
    got = lean_tp.decode_attention(**inputs, return_lse=True, backend="triton")
    want = lean_tp.decode_attention(**inputs, return_lse=True, backend="torch")
    torch.testing.assert_close(got[0], want[0], atol=3e-3, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [4, 36, 264])
def test_head_dim_rule(head_dim):
    reason = kernel_support(torch.device("cpu"), head_dim, torch.float16)
    assert reason.startswith(
        f"head_dim: expected a multiple of 8 up to 256 for the Triton backend, got head_dim={head_dim}"
    )
    inputs = make_feature_inputs([5], 4, 1, head_dim, torch.float16)
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 8 up to 256"):
        lean_tp.decode_attention(**inputs, backend="triton")


def test_opcheck_on_the_triton_backend():
    """Schema, registration and fake-tensor checks with the kernel running every feature but fp8
    (opcheck's schema test multiplies inputs, which CPU fp8 tensors do not support). The AOT
    dispatch test traces the op, and an interpreted kernel cannot be traced; tests/gpu compiles it."""
    inputs = make_feature_inputs(
        [0, 9, 70],
        8,
        2,
        64,
        torch.float32,
        "paged16",
        tq=3,
        leftpad=[2, 0, 4],
        softcap=10.0,
        window=20,
        sinks=True,
        seed=13,
    )
    args = (
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["cache_seqlens"],
        inputs["block_table"],
        inputs["cache_leftpad"],
        0.125,
        "triton",
        None,
        None,
        inputs["softcap"],
        inputs["window"],
        inputs["sinks"],
    )
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.lean_tp.decode_attention.default, args, test_utils=utils)
