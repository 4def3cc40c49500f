"""Context parallelism: the sequence layout, the merge op against float64, and each rank's partial
merged over C simulated ranks against the float64 reference of the unsharded call, for every
serving feature. The collective path runs under gloo in tests/test_decode_tp.py (decode_tp --cp)."""

import pytest
import torch
from helpers import ATOL
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

import lean_tp
from lean_tp.distributed.cp import ContextShard, context_parallel_attention, local_partial
from lean_tp.ops.merge_attention import merge_attention, merge_attention_ref


@given(size=st.integers(1, 8), block=st.sampled_from([1, 3, 16]), n=st.integers(0, 300))
@settings(max_examples=60, deadline=None)
def test_shards_partition_the_sequence(size, block, n):
    """Every position has one owner; each rank's positions fill its slots 0..count-1 in order and
    fit its capacity; counts differ by at most one block between ranks."""
    shards = [ContextShard(size, r, block) for r in range(size)]
    pos = torch.arange(n)
    owners = torch.stack([s.owns(pos) for s in shards]).int()
    assert (owners.sum(0) == 1).all()
    counts = [s.count(n) for s in shards]
    assert sum(counts) == n and max(counts) - min(counts) <= block
    for s, count in zip(shards, counts):
        mine = s.positions(n)
        assert mine.shape == (count,) and torch.equal(mine, pos[s.owns(pos)])
        assert torch.equal(s.slot(mine), torch.arange(count)) and count <= s.capacity(n)
        assert int(s.count(torch.tensor(n))) == count and s.count(-3) == 0


@pytest.mark.parametrize("rows", [(4,), (2, 3, 8)], ids=["B4", "B2-Tq3-H8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merge_attention_matches_float64(rows, dtype):
    g = torch.Generator().manual_seed(7)
    out = torch.randn(5, *rows, 64, generator=g).to(dtype)
    lse = torch.randn(5, *rows, generator=g) * 4
    lse[:, 0] = float("-inf")  # a row no partial saw
    lse[1:4, -1] = float("-inf")  # rows that some partials did not see
    out[1, -1] = float("nan")  # an empty partial's out is ignored, whatever it holds
    got, got_lse = merge_attention(out, lse)
    ref, ref_lse = merge_attention_ref(out, lse)
    assert got.dtype == dtype and got_lse.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=ATOL[dtype], rtol=0)
    assert (got[0] == 0).all() and torch.isneginf(got_lse[0]).all()
    torch.testing.assert_close(got_lse.double(), ref_lse, atol=1e-5, rtol=1e-6)


def test_merge_attention_opcheck_compile_and_errors():
    out, lse = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4)
    torch.library.opcheck(torch.ops.lean_tp.merge_attention.default, (out, lse))
    compiled = torch.compile(merge_attention, fullgraph=True)
    torch.testing.assert_close(compiled(out, lse), merge_attention(out, lse))
    with pytest.raises(ValueError, match=r"lse: expected shape \(3, 2, 4\) \(out's without D\), got \(3, 2\)"):
        merge_attention(out, lse[..., 0])
    with pytest.raises(TypeError, match="lse: expected dtype torch.float32, got torch.float16"):
        merge_attention(out, lse.half())
    with pytest.raises(TypeError, match="out: expected a torch.Tensor, got list"):
        merge_attention([out], lse)


def shard_cache(cache: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """(B, Hkv, N, D) -> this rank's (B, Hkv, capacity, D); slots past its share hold large values
    that would spoil the result if read."""
    n = cache.shape[2]
    local = torch.full((*cache.shape[:2], shard.capacity(n) + 5, cache.shape[3]), 100.0, device=cache.device)
    local = local.to(cache.dtype)
    pos = shard.positions(n, cache.device)
    local[:, :, : pos.numel()] = cache[:, :, pos]
    return local


def simulate_cp(inputs: dict, size: int, block: int, backend: str = "torch"):
    """Each of ``size`` ranks' partial over its share, merged in rank order (what exchange_and_merge
    does after its all-gather)."""
    parts = []
    for rank in range(size):
        shard = ContextShard(size, rank, block)
        call = dict(
            inputs, k_cache=shard_cache(inputs["k_cache"], shard), v_cache=shard_cache(inputs["v_cache"], shard)
        )
        call.pop("block_table"), call.pop("cache_leftpad")
        parts.append(local_partial(shard=shard, backend=backend, **call))
    return merge_attention(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


# Lengths: empty, one token (one rank holds it, the others nothing), a block +- 1, long.
LENS = [0, 1, 15, 16, 17, 150]
CASES = {  # (C, block, Tq, features)
    "C2-Tq1": (2, 16, 1, {}),
    "C8-Tq1-window5-sinks": (8, 4, 1, dict(window=5, sinks=True)),
    "C3-Tq1-softcap-fp8": (3, 16, 1, dict(softcap=20.0, cache_dtype=torch.float8_e4m3fn, per_head_scale=True)),
    "C4-Tq4": (4, 2, 4, {}),
    "C2-Tq16-sinks": (2, 16, 16, dict(sinks=True)),
    "C3-Tq5-window3": (3, 1, 5, dict(window=3)),  # window < Tq: no slot common to all queries
    "C4-Tq6-window40-softcap": (4, 4, 6, dict(window=40, softcap=15.0)),
    "C2-Tq3-window9-fp8e5m2-sinks": (2, 16, 3, dict(window=9, sinks=True, cache_dtype=torch.float8_e5m2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_partials_merge_to_the_unsharded_result(case):
    size, block, tq, features = CASES[case]
    dtype = torch.bfloat16 if "cache_dtype" in features else torch.float32
    inputs = make_feature_inputs(LENS, 8, 2, 32, dtype, tq=tq, seed=len(case), **features)
    out, lse = simulate_cp(inputs, size, block)
    assert_matches_feature_ref(out, lse, inputs, ATOL[dtype])


@pytest.mark.parametrize("tq, window", [(1, None), (3, 4)], ids=["Tq1", "Tq3-window4"])
def test_sharded_partials_on_the_triton_kernel(tq, window):
    """The kernel with the left padding and the 16-slot pages the partials use, in the interpreter."""
    inputs = make_feature_inputs([0, 1, 17, 80], 4, 2, 16, torch.float32, tq=tq, window=window, seed=3)
    out, lse = simulate_cp(inputs, 3, 4, backend="triton")
    assert_matches_feature_ref(out, lse, inputs, ATOL[torch.float32])


def test_one_rank_without_a_group_is_the_plain_op():
    inputs = make_feature_inputs([0, 5, 40], 4, 2, 16, torch.float32, tq=2, window=7, sinks=True, seed=9)
    call = {k: v for k, v in inputs.items() if k not in ("block_table", "cache_leftpad", "cache_dtype")}
    got = context_parallel_attention(shard=ContextShard(1, 0), group=None, return_lse=True, **call)
    want = lean_tp.decode_attention(**call, return_lse=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_bad_arguments_fail_on_every_rank():
    """Checked in full on each rank, including the arguments only rank 0 passes on (sinks)."""
    inputs = make_feature_inputs([3, 5], 4, 2, 16, torch.float32, seed=1)
    call = dict(
        q=inputs["q"], k_cache=inputs["k_cache"], v_cache=inputs["v_cache"], cache_seqlens=inputs["cache_seqlens"]
    )
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\) \(Hq\), got \(3,\)"):
        context_parallel_attention(**call, shard=ContextShard(2, 1), group=None, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="shard: expected a ContextShard, got int"):
        context_parallel_attention(**call, shard=1, group=None)
    with pytest.raises(ValueError, match=r"ContextShard: expected rank in \[0, 2\), got 2"):
        ContextShard(2, 2)


def test_debug_checks_hold_global_lengths_against_the_shard(monkeypatch):
    """With LEAN_TP_DEBUG=1, rank 0 of 2 takes global lengths past its local capacity (it holds
    its share of them), and still refuses a share that does not fit its cache."""
    from lean_tp.distributed import cp

    monkeypatch.setenv("LEAN_TP_DEBUG", "1")
    monkeypatch.setattr(cp.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(cp.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(cp, "exchange_and_merge", lambda out, lse, group: (out, lse))  # this rank's partial
    inputs = make_feature_inputs([0, 5, 150], 4, 2, 16, torch.float32, seed=2)
    shard = ContextShard(2, 0)
    call = dict(
        q=inputs["q"],
        k_cache=shard_cache(inputs["k_cache"], shard),
        v_cache=shard_cache(inputs["v_cache"], shard),
        cache_seqlens=inputs["cache_seqlens"],
    )
    assert call["k_cache"].shape[2] < 150
    got = context_parallel_attention(**call, shard=shard, group=object(), return_lse=True)
    torch.testing.assert_close(got, local_partial(**call, shard=shard))
    short = dict(call, k_cache=call["k_cache"][:, :, :40], v_cache=call["v_cache"][:, :, :40])  # rank 0 holds 80 of 150
    with pytest.raises(ValueError, match="cache_seqlens: expected values in"):
        context_parallel_attention(**short, shard=shard, group=object())


def test_a_shard_that_is_not_this_rank_in_the_group_is_refused():
    inputs = make_feature_inputs([3, 5], 4, 2, 16, torch.float32, seed=1)
    call = dict(
        q=inputs["q"], k_cache=inputs["k_cache"], v_cache=inputs["v_cache"], cache_seqlens=inputs["cache_seqlens"]
    )
    with pytest.raises(
        ValueError, match=r"shard: expected ContextShard\(size=1, rank=0\) \(this rank in group\), got size=2, rank=1"
    ):
        context_parallel_attention(**call, shard=ContextShard(2, 1), group=None)
