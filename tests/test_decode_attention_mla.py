"""MLA decode: V's head dim below K's, V the first Dv columns of each latent K row.

The float64 reference and the torch backend take any Dqk > Dv (a scaled-down 72/64 row here); the
Triton kernel takes the pairs with a tuning entry, DeepSeek's 576/512, and reads V from K's tile
when v_cache is ``k_cache[..., :512]`` (``cache.is_prefix_view``; the compiled loop's bytes per key
are checked in test_kernel_report.py). Kernel tests run in the interpreter, against float64.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ATOL, make_inputs, run_kernel, select
from test_decode_attention_features import assert_matches_feature_ref

import lean_tp
from lean_tp.ops.decode_attention.launcher import plan_decode
from lean_tp.ops.decode_attention.naive import decode_attention_ref
from lean_tp.ops.decode_attention.torch_impl import decode_attention_torch

# A scaled-down latent row (DeepSeek-V3: Dqk 576 = 512 latent + 64 rope, Dv 512), so that the
# rope columns are read by QK^T only.
DQK, DV = 72, 64
LENS = [0, 1, 15, 16, 17, 70]
# The kernel's pair; its interpreter entry tiles 64 keys (fp8: 128).
KERNEL_DQK, KERNEL_DV, TILE = 576, 512, 64
KERNEL_LENS = [0, 1, TILE - 1, TILE, TILE + 1, 3 * TILE + 5]


def mla_inputs(
    layout: str, num_q_heads: int, dtype: torch.dtype, seed: int, dqk=DQK, dv=DV, lens=LENS, device="cpu"
) -> dict:
    inputs = make_inputs(lens, num_q_heads, 1, dqk, dtype, layout, device=device, seed=seed)
    inputs["v_cache"] = inputs["k_cache"][..., :dv]  # the same storage: one latent cache
    return inputs


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_attention_ref_mla_is_full_v_sliced(layout):
    """Attention is linear in V's columns: the prefix-view answer is the full-row answer's first Dv."""
    inputs = mla_inputs(layout, 16, torch.float32, seed=1)
    out, lse = decode_attention_ref(**inputs, softmax_scale=DQK**-0.5)
    full_out, full_lse = decode_attention_ref(**dict(inputs, v_cache=inputs["k_cache"]), softmax_scale=DQK**-0.5)
    assert out.shape == (len(LENS), 16, DV)
    torch.testing.assert_close(out, full_out[..., :DV], rtol=0, atol=0)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads", [16, 64])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_decode_attention_torch_mla(layout, num_q_heads, dtype):
    inputs = mla_inputs(layout, num_q_heads, dtype, seed=2)
    ref_out, ref_lse = decode_attention_ref(**inputs, softmax_scale=DQK**-0.5)
    out, lse = decode_attention_torch(**inputs, softmax_scale=DQK**-0.5)
    assert out.shape == (len(LENS), num_q_heads, DV) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=ATOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=ATOL[torch.float32] * 10)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()  # length 0: no key, empty row


@pytest.mark.parametrize(
    "layout, group, dtype",
    [
        ("contiguous", 16, torch.float16),
        ("paged1", 32, torch.float16),
        ("paged16", 128, torch.bfloat16),
        ("paged32", 64, torch.float16),
        ("paged64", 16, torch.bfloat16),
    ],
)
def test_decode_attention_kernel_mla(layout, group, dtype):
    """The kernel on a latent cache (V a view of K's rows) against float64: every page size DeepSeek
    serving uses, groups 16 (TP 8) to 128 (TP 1: 8 row blocks, each reading the latent rows),
    ragged lengths around the tile."""
    inputs = mla_inputs(layout, group, dtype, seed=group, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=KERNEL_LENS)
    plan = plan_decode(**inputs)
    assert plan.kernel.features.v_in_k and plan.kernel.constexprs["HEAD_DIM_T"] == KERNEL_DQK - KERNEL_DV
    out, lse = run_kernel(inputs)
    assert out.shape == (len(KERNEL_LENS), group, KERNEL_DV)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[dtype])


def test_decode_attention_kernel_mla_64_row_blocks():
    """Kimi-K2's DP rank (64 heads on one latent head): one 64-row block with the scores computed
    keys-major, each output split over several programs and merged in 64-column slices, beside a
    whole short output and an empty one, against float64."""
    lens = [10 * TILE + 3, 5, 0]
    inputs = mla_inputs("paged16", 64, torch.bfloat16, seed=7, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
    cx = plan_decode(**inputs, num_programs=12).kernel.constexprs
    assert (cx["BLOCK_G"], cx["NUM_GC"], cx["NUM_VC"], cx["SCORES_T"], cx["MERGE_COLS"]) == (64, 1, 1, True, 64)
    out, lse = run_kernel(inputs, num_programs=12)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.bfloat16])


@pytest.mark.parametrize("group, tq", [(128, 1), (64, 2)], ids=["deepseek-dp", "kimi-dp-mtp"])
def test_decode_attention_kernel_mla_column_halves(group, tq):
    """128 query rows of a latent head (DeepSeek-V3's DP rank, or Kimi-K2's with a draft token:
    causal rows) in one row block of two head units (the sm_90 entry's ``split_v_rows``), each
    holding half of V's 512 columns and computing the whole score as q K^T: outputs split over
    several programs and merged in column slices, a whole short one and an empty one, against
    float64 (out and lse start as NaN, so a column or an lse that no unit stores fails)."""
    lens = [10 * TILE + 3, 5, 0]
    inputs = mla_inputs("paged16", group, torch.bfloat16, seed=8, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
    inputs["q"] = torch.randn(len(lens), tq, group, KERNEL_DQK).bfloat16()
    cx = plan_decode(**inputs, num_programs=12).kernel.constexprs
    assert (cx["BLOCK_G"], cx["NUM_GC"], cx["NUM_VC"], cx["BLOCK_D"], cx["SCORES_T"]) == (128, 2, 2, 256, False)
    assert cx["LANES"] == 2 and cx["MERGE_COLS"] < cx["BLOCK_D"]
    out, lse = run_kernel(inputs, num_programs=12)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.bfloat16])


def test_one_sequence_of_128_heads_takes_16_row_blocks():
    """DP attention's 128 heads for one sequence of one token (``Features.one_sequence``): the sm_90
    entry's 16-row blocks of 64 keys, 8 row blocks read in step, the kernel the benchmark's
    ``lean-rows16`` measured at B=1 but for its contributor cap; with a second sequence or a draft
    token, the 128-row column halves, and Kimi-K2's 64 heads keep their 64-row block. The
    batch-invariant mode keeps its own blocks (64 rows, whole, whatever the batch) and takes the
    one sequence's cap of programs. The one sequence split over programs is exact against
    float64."""
    import dataclasses
    import sys
    from pathlib import Path

    from lean_tp.ops.decode_attention.plan import KernelVariant
    from lean_tp.ops.decode_attention.tuning import TUNING_TABLE

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from peers import MLA_ABLATIONS

    inputs = mla_inputs("paged64", 128, torch.bfloat16, seed=10, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=[10 * TILE + 3])
    kernel = plan_decode(**inputs, num_programs=12).kernel
    cx = kernel.constexprs
    assert kernel.features.one_sequence and (cx["BLOCK_G"], cx["NUM_GC"], cx["LANES"], cx["BLOCK_N"]) == (16, 8, 8, 64)
    entry = TUNING_TABLE[("sm90", 576, 2)]
    on_sm90 = dataclasses.replace(kernel, arch="sm90", config=None)
    measured = KernelVariant(  # as the benchmark ran it: the entry with its ablation's overrides
        "sm90", kernel.dtype, KERNEL_DQK, 128, 64, dataclasses.replace(kernel.features, one_sequence=False),
        dataclasses.replace(entry, **MLA_ABLATIONS["lean-rows16"]), KERNEL_DV,
    )  # fmt: skip
    # but for its cap of 128 programs an output (at 1.0x of 64 there: ``lean-contributors128``)
    capped = measured.constexprs | {"MAX_CONTRIB": entry.one_sequence_max_contributors}
    assert on_sm90.constexprs == capped and capped != measured.constexprs
    out, lse = run_kernel(inputs, num_programs=12)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.bfloat16])
    two = mla_inputs("paged64", 128, torch.bfloat16, seed=10, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=[5, 7])
    draft = dict(inputs, q=inputs["q"][:, None].expand(1, 2, 128, KERNEL_DQK).contiguous())
    for call in (two, draft):
        features = plan_decode(**call).kernel.features
        assert not features.one_sequence, features
    alone, batched = (plan_decode(**dict(call, batch_invariant=True)).kernel for call in (inputs, two))
    assert alone.features.one_sequence and alone.block_g == batched.block_g == 64
    on_sm90 = [dataclasses.replace(kernel, arch="sm90", config=None).constexprs for kernel in (alone, batched)]
    assert (on_sm90[0]["MAX_CONTRIB"], on_sm90[1]["MAX_CONTRIB"]) == (entry.one_sequence_max_contributors, 64)
    assert {**on_sm90[0], "MAX_CONTRIB": 64} == on_sm90[1]
    kimi = mla_inputs("paged64", 64, torch.bfloat16, seed=10, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=[5])
    assert plan_decode(**kimi).kernel.block_g == 64  # no column halves to replace: unmeasured there


def test_drafts_in_one_narrow_row_block_are_one_sequence():
    """One sequence whose Tq x heads rows fit one 16-row block (Kimi-K2's 8 heads at TP 8 with an
    MTP draft) is planned as one token's call (``plan.is_one_sequence``): the same rows and
    partials, so the entry's one-sequence cap of programs (sm_90: 128), in both modes.
    DeepSeek-V3's 16 heads at Tq 2 (32 rows) and a second sequence are not."""
    from lean_tp.ops.decode_attention.plan import is_one_sequence

    def one_sequence(heads: int, tokens: int, lens: list[int], **kw) -> bool:
        inputs = mla_inputs("paged64", heads, torch.bfloat16, seed=3, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
        q = inputs["q"][:, None].expand(len(lens), tokens, heads, KERNEL_DQK).contiguous()
        return plan_decode(**dict(inputs, q=q), **kw).kernel.features.one_sequence

    assert one_sequence(8, 2, [70]) and one_sequence(16, 1, [70]) and one_sequence(1, 16, [70])
    assert not one_sequence(16, 2, [70]) and not one_sequence(8, 2, [70, 9])
    assert one_sequence(8, 2, [70], batch_invariant=True) and not one_sequence(8, 2, [70, 9], batch_invariant=True)
    assert is_one_sequence(1, 1, 128) and not is_one_sequence(1, 2, 128)


def test_a_grid_has_a_program_for_each_row_block():
    """MTP at DP attention (Tq 4 x 128 heads: 4 row blocks of 128, each in two column halves: 8
    head units) on a 3-program grid: the launcher grows the grid to 9, a program for each lane of
    the schedule, and the result is exact."""
    lens = [TILE + 6, 3]
    inputs = mla_inputs("paged16", 128, torch.bfloat16, seed=9, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
    inputs["q"] = torch.randn(len(lens), 4, 128, KERNEL_DQK).bfloat16()
    plan = plan_decode(**inputs, num_programs=3)
    assert (plan.kernel.lanes, plan.num_programs) == (8, 9)
    out, lse = run_kernel(inputs, num_programs=3)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.bfloat16])


def test_decode_attention_kernel_mla_v_of_its_own():
    """V a tensor of its own with K's layout but 512 columns (not a view): read apart from K."""
    inputs = mla_inputs("paged16", 16, torch.float16, seed=3, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=KERNEL_LENS)
    inputs["v_cache"] = torch.randn(inputs["v_cache"].shape).half()
    assert not plan_decode(**inputs).kernel.features.v_in_k
    out, lse = run_kernel(inputs)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.float16])


@pytest.mark.parametrize("tq", [1, 4])
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_decode_attention_kernel_mla_fp8(layout, tq):
    """An e4m3 latent cache with one per-tensor scale (as vLLM's and SGLang's fp8 MLA caches keep
    it) and a bf16 q, with Tq 1 and 4 (MTP drafts, causal among themselves)."""
    lens = [0, 1, 127, 128, 129, 300]
    inputs = mla_inputs(layout, 16, torch.bfloat16, seed=4 + tq, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
    if tq > 1:
        inputs["q"] = torch.randn(len(lens), tq, 16, KERNEL_DQK).bfloat16()
    latent = (inputs["k_cache"].float() * 8).to(torch.float8_e4m3fn)
    inputs.update(k_cache=latent, v_cache=latent[..., :KERNEL_DV], k_scale=0.125, v_scale=0.125)
    out, lse = lean_tp.decode_attention(**inputs, backend="triton", return_lse=True)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.bfloat16])


def test_decode_attention_kernel_mla_features():
    """Window, softcap and sinks (no MLA model uses them) work on MLA's layout too, with Tq 3."""
    inputs = mla_inputs("paged16", 16, torch.float16, seed=5, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=KERNEL_LENS)
    inputs["q"] = torch.randn(len(KERNEL_LENS), 3, 16, KERNEL_DQK).half()
    inputs.update(window=70, softcap=20.0, sinks=torch.randn(16))
    out, lse = lean_tp.decode_attention(**inputs, backend="triton", return_lse=True)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.float16])


def test_decode_attention_kernel_mla_batch_invariant():
    """A request's bits alone and among others, on different grids; and against float64."""
    lens = [3 * TILE + 5, 17, 2 * TILE, 1]
    inputs = mla_inputs("paged16", 16, torch.bfloat16, seed=6, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
    out, lse = run_kernel(select(inputs, [0, 1, 2, 3]), batch_invariant=True, num_programs=3)
    alone, alone_lse = run_kernel(select(inputs, [0]), batch_invariant=True, num_programs=4)
    assert torch.equal(out[0], alone[0]) and torch.equal(lse[0], alone_lse[0])
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.bfloat16])


@pytest.mark.parametrize("group", [64, 128])
def test_mla_wide_blocks_batch_invariant(group):
    """The batch-invariant mode in DP attention's wide row blocks (64 rows: Kimi-K2's 64 heads one
    block, DeepSeek-V3's 128 two), each chunk of 512 keys its own group (one state in the K/V
    loop): a request's bits alone on two grids equal its bits among others (outputs split over
    programs, several supergroups of chunks, a chunk's last key, a chunk and a key, empty and
    one-key sequences), and every output matches float64 (out, lse and workspace start as NaN)."""
    from lean_tp.ops.decode_attention.tuning import INVARIANT_WIDE_TILE_N

    chunk = INVARIANT_WIDE_TILE_N
    lens = [4 * chunk + 70, 0, chunk, chunk + 1, 1, 2 * chunk - 3]
    inputs = mla_inputs("paged64", group, torch.bfloat16, seed=group + 1, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
    cx = plan_decode(**select(inputs, [0]), batch_invariant=True).kernel.constexprs
    assert (cx["BLOCK_G"], cx["NUM_GC"], cx["TILE_N"], cx["IGROUP"]) == (64, group // 64, chunk, 1)
    out, lse = run_kernel(select(inputs, list(range(len(lens)))), batch_invariant=True, num_programs=5)
    for programs in (2, 7):
        alone, alone_lse = run_kernel(select(inputs, [0]), batch_invariant=True, num_programs=programs)
        assert torch.equal(out[0], alone[0]) and torch.equal(lse[0], alone_lse[0]), programs
    pair, pair_lse = run_kernel(select(inputs, [3, 5]), batch_invariant=True, num_programs=3)
    assert torch.equal(out[[3, 5]], pair) and torch.equal(lse[[3, 5]], pair_lse)
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=KERNEL_DQK**-0.5), ATOL[torch.bfloat16])


@pytest.mark.parametrize(
    "group, layout, fp8",
    [(16, "paged16", False), (64, "contiguous", False), (128, "paged64", True)],
    ids=["tp8-deepseek", "dp-kimi", "dp-deepseek-fp8"],
)
def test_an_mla_token_verified_among_drafts_has_its_decode_bits(group, layout, fp8):
    """MTP's verification (Tq 2) in the batch-invariant mode at DeepSeek's 16 heads a rank (TP 8)
    and 128 (DP attention: 8 row blocks a token), Kimi-K2's 64, and an e4m3 latent cache: each
    token has the bits of its one-token decode, and the block matches float64."""
    from test_decode_attention_batch_invariant import check_verified_tokens

    lens = [TILE + 7, 2, 1]
    inputs = mla_inputs(layout, group, torch.bfloat16, seed=group, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=lens)
    inputs["q"] = torch.randn(len(lens), 2, group, KERNEL_DQK).bfloat16()
    if fp8:
        latent = (inputs["k_cache"].float() * 8).to(torch.float8_e4m3fn)
        inputs.update(k_cache=latent, v_cache=latent[..., :KERNEL_DV], k_scale=0.125, v_scale=torch.tensor([0.125]))
    inputs.update(softcap=None, window=None, sinks=None)
    check_verified_tokens(inputs, (0, 1), config=None)


def test_decode_attention_mla_bad_input():
    """A v_cache neither of K's layout nor narrower than K, a pair without a tuning entry on the
    Triton backend, and a wrong fp8 scale shape: ValueError naming the argument."""
    inputs = mla_inputs("paged16", 16, torch.float16, seed=7)
    with pytest.raises(ValueError, match=r"v_cache: expected k_cache's shape .* last dim Dv <= 72"):
        lean_tp.decode_attention(**dict(inputs, v_cache=torch.randn(*inputs["k_cache"].shape[:-1], 80).half()))
    with pytest.raises(ValueError, match=r"v_cache: expected k_cache's shape"):
        lean_tp.decode_attention(**dict(inputs, v_cache=inputs["k_cache"][:-1, ..., :DV]))
    with pytest.raises(ValueError, match=r"v_cache: expected \(K, V\) head dims in \[\(576, 512\)\]"):
        lean_tp.decode_attention(**inputs, backend="triton")
    assert lean_tp.decode_attention(**inputs, backend="torch").shape == (len(LENS), 16, DV)
    kernel = mla_inputs("contiguous", 16, torch.float32, seed=8, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=[5])
    with pytest.raises(ValueError, match=r"float16 or bfloat16 q .* got \(576, 512\) with torch.float32 q"):
        lean_tp.decode_attention(**kernel, backend="triton")
    latent = kernel["k_cache"].to(torch.float8_e4m3fn)
    fp8 = dict(kernel, q=kernel["q"].bfloat16(), k_cache=latent, v_cache=latent[..., :KERNEL_DV], v_scale=0.5)
    with pytest.raises(ValueError, match=r"k_scale: expected shape \(1,\) \(Hkv\) or \(1,\), got \(2,\)"):
        lean_tp.decode_attention(**fp8, k_scale=torch.ones(2), backend="triton")


def test_decode_attention_mla_opcheck():
    """The registered op (fake implementation included) with V a view of K's rows, out Dv wide: every
    check on the torch backend; on the kernel, those that do not trace it (an interpreted kernel
    cannot be traced, as in test_opcheck_on_the_triton_backend)."""
    inputs = mla_inputs("paged16", 16, torch.float16, seed=9, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=[0, 5, 70])
    args = (*(inputs[k] for k in ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "cache_leftpad")),)
    op = torch.ops.lean_tp.decode_attention.default
    torch.library.opcheck(op, (*args, KERNEL_DQK**-0.5, "torch"))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, (*args, KERNEL_DQK**-0.5, "triton"), test_utils=utils)


def test_a_compiled_call_reads_v_from_ks_tile(monkeypatch):
    """Under torch.compile the op's body sees functional wrappers of K and V, which alias nothing:
    the plan still finds V to be K's prefix (so sm_90 gets the kernel that fits its shared memory
    and the Gluon route stays open), eager and compiled alike."""
    from lean_tp.ops.decode_attention import op

    seen = []

    def planned(*args, **kwargs):
        plan = plan_decode(*args, **kwargs)
        seen.append(plan.features.v_in_k)
        return plan

    monkeypatch.setattr(op, "plan_decode", planned)
    inputs = mla_inputs("paged64", 16, torch.bfloat16, seed=10, dqk=KERNEL_DQK, dv=KERNEL_DV, lens=[5, 70])
    eager = lean_tp.decode_attention(**inputs)
    compiled = torch.compile(lambda: lean_tp.decode_attention(**inputs), backend="aot_eager", fullgraph=True)()
    assert len(seen) > 1 and all(seen)  # the eager call, then the compiled trace's
    assert torch.equal(compiled, eager)
