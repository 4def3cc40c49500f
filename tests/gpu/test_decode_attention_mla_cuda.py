"""CUDA tests of MLA decode (one latent head of 576 dims, V its first 512): DeepSeek's TP-8 rank
(16 heads), Kimi-K2 and DeepSeek under DP attention (64 and 128 heads: on sm_90 64-row blocks with
keys-major scores, and 128-row blocks in two column halves, each merged in column slices), 16-bit
and e4m3 latent caches, MTP's Tq, forced grids, the batch-invariant mode and CUDA-graph replay.

Skipped without a CUDA device; ``python scripts/gpu_check.py`` runs them on a GPU.
"""

import pytest
import torch
from helpers import run_kernel
from test_decode_attention_features import assert_matches_feature_ref
from test_decode_attention_mla import mla_inputs

import lean_tp
from lean_tp.ops.decode_attention.checks import scale_tensor
from lean_tp.ops.decode_attention.launcher import plan_decode

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (python scripts/gpu_check.py runs it on a GPU)", allow_module_level=True)

DQK, DV = 576, 512
ATOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
LENS = [0, 1, 63, 64, 65, 129, 4099, 17000]


def _inputs(lens, group, dtype, layout, tq=1, fp8=False, seed=0) -> dict:
    """A latent cache on the GPU (``mla_inputs``: V a view of K's first 512 columns) with Tq query
    tokens; e4m3 with one scale."""
    inputs = mla_inputs(layout, group, dtype, seed, DQK, DV, lens, device="cuda")
    if tq > 1:
        inputs["q"] = torch.randn(len(lens), tq, group, DQK, device="cuda").to(dtype)
    if fp8:
        latent = (inputs["k_cache"].float() * 8).to(torch.float8_e4m3fn)
        scale = scale_tensor("k_scale", 0.125, torch.device("cuda"))
        inputs.update(k_cache=latent, v_cache=latent[..., :DV], k_scale=scale, v_scale=scale)
    return inputs


def _check(out, lse, inputs, atol) -> None:
    assert_matches_feature_ref(out, lse, dict(inputs, softmax_scale=DQK**-0.5), atol, lse_atol=1e-3, lse_rtol=1e-4)


def _atol(inputs) -> float:
    return ATOL[inputs["q"].dtype] * (2 if inputs["k_cache"].dtype.itemsize == 1 else 1)


@pytest.mark.parametrize(
    "group, layout, dtype, tq, fp8",
    [
        (16, "paged64", torch.bfloat16, 1, False),
        (16, "paged64", torch.bfloat16, 2, True),
        (16, "contiguous", torch.float16, 4, False),
        (64, "paged64", torch.bfloat16, 1, False),
        (64, "paged16", torch.float16, 2, False),
        (128, "paged64", torch.bfloat16, 1, False),
        (128, "paged64", torch.bfloat16, 1, True),
        (128, "paged1", torch.bfloat16, 2, False),
        (128, "contiguous", torch.float16, 1, False),
        (128, "paged64", torch.bfloat16, 4, True),
    ],
    ids=str,
)
def test_mla_cuda(group, layout, dtype, tq, fp8):
    """Every group DeepSeek and Kimi serve, page sizes 1-64, ragged lengths around the tile and
    long enough to split every output over many programs (17k keys), against float64; the output
    starts as NaN."""
    inputs = _inputs(LENS, group, dtype, layout, tq, fp8, seed=group + tq)
    out, lse = run_kernel(inputs)  # out, lse and the merge workspace start as NaN
    _check(out, lse, inputs, _atol(inputs))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_mla_cuda_one_sequence_of_drafts(fp8):
    """Kimi-K2's TP-8 rank (8 heads) verifying one MTP draft of one sequence of 32k keys: its 16
    rows are planned as one token's call (``plan.is_one_sequence``: on sm_90 up to 128 programs an
    output), exact against float64."""
    inputs = _inputs([32768], 8, torch.bfloat16, "paged64", 2, fp8, seed=8)
    assert plan_decode(**inputs).kernel.features.one_sequence
    out, lse = run_kernel(inputs)
    _check(out, lse, inputs, _atol(inputs))


@pytest.mark.parametrize("num_programs", [1, 3, 7, 264, 2000])
def test_mla_cuda_forced_grids(num_programs):
    """DP attention's 128 heads (two lanes: the 128-row block's head units) on grids from one
    program (grown to a program a lane) to more programs than tiles: every split and merge tree
    shape."""
    inputs = _inputs([20000, 0, 129, 1, 3000], 128, torch.bfloat16, "paged64", seed=num_programs)
    plan = plan_decode(**inputs, num_programs=num_programs)
    assert plan.kernel.lanes == 2 and plan.num_programs == max(num_programs, 2)
    out, lse = run_kernel(inputs, num_programs=num_programs)
    _check(out, lse, inputs, ATOL[torch.bfloat16])


@pytest.mark.parametrize("group", [16, 128])
def test_mla_cuda_batch_invariant(group):
    """A request's bits alone and among others in the batch-invariant mode, and a token verified
    among MTP drafts (Tq 2) has the bits of its one-token decode."""
    lens = [9000, 17, 128, 1]
    inputs = _inputs(lens, group, torch.bfloat16, "paged64", tq=2, seed=group)
    out, lse = run_kernel(inputs, batch_invariant=True)
    _check(out, lse, inputs, ATOL[torch.bfloat16])
    first = dict(q=inputs["q"][:1, 0].contiguous(), cache_seqlens=inputs["cache_seqlens"][:1] - 1)
    alone, alone_lse = run_kernel(dict(inputs, **first, block_table=inputs["block_table"][:1]), batch_invariant=True)
    assert torch.equal(alone[0], out[0, 0]) and torch.equal(alone_lse[0], lse[0, 0])


def test_mla_cuda_graph_replay_with_new_lengths():
    """DP attention's 128 heads on an e4m3 latent cache, captured once and replayed with new
    lengths (empty, short, past the capture's longest)."""
    capacity = 8192  # every page of the block table valid, so any new length reads real pages
    inputs = _inputs([capacity] * 4, 128, torch.bfloat16, "paged64", fp8=True, seed=3)
    inputs["cache_seqlens"].copy_(torch.tensor([3000, 5, 700, 64], dtype=torch.int32))
    lean_tp.decode_attention(**inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = lean_tp.decode_attention(**inputs, return_lse=True)
    for new in ([1, capacity, 77, 0], [0, 0, 0, 0], [4, 4096, capacity - 1, 3]):
        inputs["cache_seqlens"].copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, inputs, _atol(inputs))


@pytest.mark.parametrize("group,fp8", [(16, False), (128, True)])
def test_mla_cuda_compiled(group, fp8):
    """``torch.compile(fullgraph=True)`` of a call on V's view of K gives the eager call's bits:
    the compiled plan reads V from K's tile too (read apart, sm_90's tiles would not fit its
    shared memory)."""
    inputs = _inputs(LENS, group, torch.bfloat16, "paged64", fp8=fp8, seed=4)
    eager = lean_tp.decode_attention(**inputs, return_lse=True)
    compiled = torch.compile(
        lambda: lean_tp.decode_attention(**inputs, return_lse=True), fullgraph=True, dynamic=False
    )()
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("lens", [[4096], [131072], [4096] * 8], ids=["B1-4k", "B1-128k", "B8-4k"])
def test_mla_cuda_shared_merge_slices(lens, batch_invariant):
    """DeepSeek-V3's TP-8 rank (16 heads), its 16 x 512 partials merged in 8 column slices that the
    contributors with no tiles left claim beside each merge's last arriver (``merge.finish_split``;
    in the batch-invariant mode, a split group's chunks, a split supergroup's groups and an output's
    supergroups: ``folds.finish_group``, ``output_fold.finish_super``, ``output_fold.finish_output``):
    on a GPU they run at the same time, so here the slices are shared. 20 launches on one counters
    buffer: exact against float64, bitwise the same each time whoever merged which slice, and the
    counters back at zero after every launch."""
    from lean_tp.ops.decode_attention.launch_args import counters_size

    inputs = _inputs(lens, 16, torch.bfloat16, "paged64", seed=len(lens))
    plan = plan_decode(**inputs, batch_invariant=batch_invariant)
    assert plan.kernel.constexprs["BLOCK_D"] // plan.kernel.constexprs["MERGE_COLS"] == 8
    counters = torch.zeros(counters_size(plan.num_programs), dtype=torch.int32, device="cuda")
    first = run_kernel(inputs, counters=counters, batch_invariant=batch_invariant)
    _check(*first, inputs, ATOL[torch.bfloat16])
    for _ in range(20):
        again = run_kernel(inputs, counters=counters, batch_invariant=batch_invariant)
        assert (counters == 0).all()
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
