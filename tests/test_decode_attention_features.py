"""Serving features (multi-token queries, fp8 KV caches, softcap, sliding window, sinks) on the
torch backend, against the float64 reference in ``naive.py``; their input checks; opcheck and
``torch.compile(fullgraph=True)`` with every feature on. The Triton kernel's side is
tests/test_decode_attention_kernel_features.py.
"""

import math

import pytest
import torch
from helpers import ATOL, make_inputs

import lean_tp
from lean_tp.ops.decode_attention import decode_attention_ref
from lean_tp.ops.decode_attention.checks import MAX_QUERY_TOKENS

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make_feature_inputs(
    lens,
    hq,
    hkv,
    d,
    dtype,
    layout="contiguous",
    tq=1,
    cache_dtype=None,
    leftpad=None,
    softcap=None,
    window=None,
    sinks=False,
    per_head_scale=False,
    seed=0,
):
    """make_inputs plus a (B, Tq, Hq, D) q, an fp8 cache with scales, and the feature arguments.

    Left padding is added on top of ``lens`` (as in make_inputs); the lengths count the new tokens.
    """
    inputs = make_inputs(lens, hq, hkv, d, dtype, layout, seed=seed, leftpad=leftpad)
    g = torch.Generator().manual_seed(seed + 1)
    if tq > 1:
        inputs["q"] = torch.randn(len(lens), tq, hq, d, generator=g).to(dtype)
    if cache_dtype is not None:
        # Values spread over fp8's range, so the scale matters and rounding is visible.
        for name in ("k_cache", "v_cache"):
            inputs[name] = (inputs[name].float() * 8).to(cache_dtype)
        inputs["k_scale"] = torch.rand(hkv, generator=g) / 8 + 0.05 if per_head_scale else 0.11
        inputs["v_scale"] = torch.rand(hkv, generator=g) / 8 + 0.05 if per_head_scale else torch.tensor([0.13])
    inputs["softcap"], inputs["window"] = softcap, window
    inputs["sinks"] = torch.randn(hq, generator=g) * 2 if sinks else None
    return inputs


def assert_matches_feature_ref(out, lse, inputs, atol, lse_atol=1e-4, lse_rtol=1e-5):
    """out and lse (on any device) against the float64 reference with the call's feature arguments:
    shapes and dtype, no NaN (unwritten elements), and rows that see no key and have no sink give
    exactly out 0 and lse -inf."""
    q = inputs["q"]
    assert out.shape == (*q.shape[:-1], inputs["v_cache"].shape[-1]) and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1]
    ref_out, ref_lse = decode_attention_ref(
        **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    )
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (NaN) output elements"
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~finite]).all() and (out[~finite] == 0).all()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=lse_atol, rtol=lse_rtol)


def check_against_ref(inputs, atol):
    out, lse = lean_tp.decode_attention(**inputs, return_lse=True, backend="torch")
    assert_matches_feature_ref(out, lse, inputs, atol)


# Lengths around the 4096-token chunk of the torch backend and small edge cases: 0, 1, fewer keys
# than query tokens.
LENS = [0, 1, 3, 17, 4097]


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "paged16"])
@pytest.mark.parametrize("tq", [1, 3, 8])
def test_multi_token_queries(tq, layout):
    inputs = make_feature_inputs(LENS, 8, 2, 64, torch.float32, layout, tq=tq, seed=tq)
    check_against_ref(inputs, ATOL[torch.float32])


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("per_head_scale", [False, True], ids=["tensor_scale", "head_scale"])
def test_fp8_cache(cache_dtype, dtype, per_head_scale):
    inputs = make_feature_inputs(
        [5, 0, 300], 8, 2, 128, dtype, "paged16", cache_dtype=cache_dtype, per_head_scale=per_head_scale, seed=3
    )
    check_against_ref(inputs, ATOL[dtype])


@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_softcap(softcap):
    inputs = make_feature_inputs([40, 0, 129], 8, 4, 64, torch.float32, softcap=softcap, seed=5)
    inputs["q"] *= 8  # large logits, so the cap bites
    check_against_ref(inputs, ATOL[torch.float32])


@pytest.mark.parametrize("window", [1, 16, 100, 5000])
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_sliding_window(window, layout):
    inputs = make_feature_inputs(LENS, 8, 2, 64, torch.float32, layout, window=window, leftpad=[0, 2, 0, 9, 31], seed=6)
    check_against_ref(inputs, ATOL[torch.float32])


def test_sinks_and_empty_sequences():
    inputs = make_feature_inputs([0, 1, 77], 8, 2, 64, torch.float32, sinks=True, seed=7)
    check_against_ref(inputs, ATOL[torch.float32])
    out, lse = lean_tp.decode_attention(**inputs, return_lse=True, backend="torch")
    assert (out[0] == 0).all()
    torch.testing.assert_close(lse[0], inputs["sinks"])  # the denominator is e^sink alone


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_feature_together(dtype, layout):
    inputs = make_feature_inputs(
        [0, 2, 64, 1000],
        16,
        2,
        128,
        dtype,
        layout,
        tq=4,
        cache_dtype=torch.float8_e4m3fn,
        leftpad=[1, 0, 5, 3],
        softcap=20.0,
        window=50,
        sinks=True,
        per_head_scale=True,
        seed=8,
    )
    check_against_ref(inputs, ATOL[dtype])


def test_reference_definitions_on_a_hand_sized_case():
    """The reference's window and sinks, checked against the formula written out by hand."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 1, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    lens = torch.tensor([6], dtype=torch.int32)
    sinks = torch.tensor([0.7])
    out, lse = decode_attention_ref(q, k, v, lens, softmax_scale=0.5, window=2, sinks=sinks, softcap=3.0)
    s = 3.0 * torch.tanh(0.5 * (k[0, 0, 4:] @ q[0, 0]) / 3.0)  # the last 2 keys
    denom = math.exp(0.7) + s.exp().sum()
    torch.testing.assert_close(out[0, 0], (s.exp()[:, None] * v[0, 0, 4:]).sum(0) / denom)
    torch.testing.assert_close(lse[0, 0], torch.log(denom))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_one_token_in_the_four_dim_form(backend):
    """(B, 1, Hq, D) is plain decode: the Triton kernel takes it, with out (B, 1, Hq, D)."""
    inputs = make_feature_inputs([0, 5, 130], 8, 2, 64, torch.float32, "paged16", tq=1, seed=11)
    inputs["q"] = inputs["q"][:, None]
    out, lse = lean_tp.decode_attention(**inputs, return_lse=True, backend=backend)
    assert out.shape == (3, 1, 8, 64) and lse.shape == (3, 1, 8)
    ref_out, ref_lse = decode_attention_ref(**inputs)
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL[torch.float32], rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    flat = lean_tp.decode_attention(**{**inputs, "q": inputs["q"][:, 0]}, return_lse=True, backend=backend)
    torch.testing.assert_close(out[:, 0], flat[0], atol=0, rtol=0)
    torch.testing.assert_close(lse[:, 0], flat[1], atol=0, rtol=0)


def _bad(**changes):
    inputs = make_feature_inputs([5, 9], 8, 2, 64, torch.float16, cache_dtype=torch.float8_e4m3fn)
    inputs.update(changes)
    return inputs


BAD_CALLS = {
    "fp8 without k_scale": (
        dict(k_scale=None),
        ValueError,
        r"k_scale: expected a float or a \(2,\) float32 tensor with an fp8 cache, got None",
    ),
    "scale of the wrong shape": (
        dict(v_scale=torch.ones(3)),
        ValueError,
        r"v_scale: expected shape \(2,\) \(Hkv\) or \(1,\), got \(3,\)",
    ),
    "scale of the wrong dtype": (
        dict(k_scale=torch.ones(2, dtype=torch.float64)),
        TypeError,
        "k_scale: expected dtype torch.float32",
    ),
    "negative scale": (dict(k_scale=-1.0), ValueError, "k_scale: expected a finite float > 0"),
    "scale without fp8": (
        dict(k_cache=torch.randn(2, 2, 16, 64).half(), v_cache=torch.randn(2, 2, 16, 64).half()),
        ValueError,
        "k_scale: expected None for a torch.float16 cache",
    ),
    "fp8 with fp32 q": (
        dict(q=torch.randn(2, 8, 64)),
        TypeError,
        "q: expected float16 or bfloat16 with an fp8 k_cache",
    ),
    "window 0": (dict(window=0), ValueError, "window: expected an int >= 1 or None, got 0"),
    "window float": (dict(window=2.5), TypeError, "window: expected an int or None, got float 2.5"),
    "softcap 0": (dict(softcap=0.0), ValueError, "softcap: expected a finite float > 0 or None, got 0.0"),
    "sinks shape": (dict(sinks=torch.zeros(2)), ValueError, r"sinks: expected shape \(8,\) \(Hq\), got \(2,\)"),
    "sinks dtype": (dict(sinks=torch.zeros(8, dtype=torch.float16)), TypeError, "sinks: expected dtype torch.float32"),
    "too many tokens": (
        dict(q=torch.randn(2, MAX_QUERY_TOKENS + 1, 8, 64).half()),
        ValueError,
        rf"q: expected 1 <= Tq <= {MAX_QUERY_TOKENS} \(batch_invariant=True takes any Tq\) query tokens",
    ),
    "no tokens": (dict(q=torch.randn(2, 0, 8, 64).half(), batch_invariant=True), ValueError, "q: expected Tq >= 1"),
    "q with 5 dims": (dict(q=torch.randn(2, 1, 1, 8, 64).half()), ValueError, "q: expected 3 dims .* or 4 dims"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_feature_arguments_name_the_argument(case):
    changes, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=message):
        lean_tp.decode_attention(**_bad(**changes), backend="torch")


def _op_args(inputs):
    return (
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["cache_seqlens"],
        inputs["block_table"],
        inputs["cache_leftpad"],
        inputs["q"].shape[-1] ** -0.5,
        "torch",
        inputs.get("k_scale"),
        inputs.get("v_scale"),
        inputs["softcap"],
        inputs["window"],
        inputs["sinks"],
    )


def _all_features(layout="paged16", cache_dtype=torch.float8_e5m2):
    inputs = make_feature_inputs(
        [0, 9, 70],
        8,
        2,
        64,
        torch.bfloat16,
        layout,
        tq=3,
        cache_dtype=cache_dtype,
        leftpad=[2, 0, 4],
        softcap=10.0,
        window=20,
        sinks=True,
        per_head_scale=True,
        seed=10,
    )
    return inputs


def test_opcheck_with_every_feature():
    inputs = _all_features(cache_dtype=None)
    torch.library.opcheck(torch.ops.lean_tp.decode_attention.default, _op_args(inputs))


def test_opcheck_fp8():
    """opcheck's schema test multiplies the inputs, which CPU fp8 tensors do not support; the
    fake-tensor, registration and AOT-dispatch tests run."""
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.lean_tp.decode_attention.default, _op_args(_all_features()), test_utils=utils)


def test_compile_fullgraph_with_every_feature():
    inputs = _all_features("contiguous")

    def step(**kw):
        return lean_tp.decode_attention(**kw, return_lse=True)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for got, want in zip(compiled(**inputs), step(**inputs)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    inputs["cache_seqlens"] = torch.tensor([4, 30, 77], dtype=torch.int32)  # new lengths, no recompilation
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled(**inputs)
    torch.testing.assert_close(got[0], step(**inputs)[0], atol=2e-2, rtol=0)
