"""Batch-invariant mode: a request's out and lse bits do not depend on the batch around it.

Each request of a pool is run alone, then inside batches of random others (other lengths, other
positions, other grid sizes), and its rows must be bitwise identical. The kernel runs in the
Triton interpreter with 16-key chunks (``CONFIG``), so that groups of
``INVARIANT_GROUP_CHUNKS`` chunks, outputs split over several programs and chunks published one
by one all occur at lengths the interpreter runs quickly; one test uses the table's own entry.
"""

import dataclasses
import random

import pytest
import torch
from helpers import ATOL, run_kernel, select
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

import lean_tp
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launch_args import alloc_workspace, counters_size
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, plan_decode
from lean_tp.ops.decode_attention.tuning import INVARIANT_GROUP_CHUNKS, INVARIANT_SUPER_GROUPS, DecodeConfig
from lean_tp.ops.utils import interpreted

pytestmark = pytest.mark.skipif(
    not interpreted(decode_attention_fwd_kernel),
    reason="runs the kernel in the Triton interpreter (TRITON_INTERPRET=1)",
)

CHUNK = 16
CONFIG = DecodeConfig(
    tile_n=CHUNK,
    block_n=16,
    max_block_g=64,
    num_warps=4,
    num_stages=1,
    max_programs_per_sm=1,
    reason="tests: 16-key chunks, groups of 256 keys",
)
GROUP_KEYS = CHUNK * INVARIANT_GROUP_CHUNKS
SUPER_KEYS = GROUP_KEYS * INVARIANT_SUPER_GROUPS
# 0, 1, chunk - 1, chunk, chunk + 1, a group's keys +- 1, lengths of several groups, and one of
# two supergroups.
POOL_LENS = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, GROUP_KEYS - 1, GROUP_KEYS + 1, 530, SUPER_KEYS + 60]


def run(inputs: dict, idx: list[int], num_programs: int, batch_invariant: bool = True, config=CONFIG):
    """The kernel on requests ``idx`` of the pool; out and lse start as NaN, and the merge counters
    must be back at zero afterwards."""
    counters = torch.zeros(counters_size(num_programs), dtype=torch.int32)
    out, lse = run_kernel(
        select(inputs, idx), counters, batch_invariant=batch_invariant, num_programs=num_programs, config=config
    )
    assert not counters.any(), "a merge left its counter set"
    return out, lse


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_same_bits(got, want, what):
    for g, w, name in zip(got, want, ("out", "lse")):
        assert torch.equal(bits(g), bits(w)), (
            f"{what}: {name} differs, max |diff| {(g.float() - w.float()).abs().max()}"
        )


def check_invariance(inputs: dict, batches: int, seed: int, max_programs: int = 13, config=CONFIG) -> None:
    """Every request alone (4 programs), against the float64 reference, then ``batches`` random
    batches of the pool in random order on random grids, bitwise against alone."""
    n = len(inputs["cache_seqlens"])
    alone = [run(inputs, [i], 4, config=config) for i in range(n)]
    atol = ATOL[inputs["q"].dtype] * (4 if inputs["k_cache"].dtype.itemsize == 1 else 1)
    for i, (out, lse) in enumerate(alone):
        assert_matches_feature_ref(out, lse, select(inputs, [i]), atol)
    rnd = random.Random(seed)
    for _ in range(batches):
        idx = rnd.sample(range(n), rnd.randint(2, n))
        programs = rnd.randint(1, max_programs)
        out, lse = run(inputs, idx, programs, config=config)
        for j, i in enumerate(idx):
            assert_same_bits(
                (out[j], lse[j]),
                (alone[i][0][0], alone[i][1][0]),
                f"request {i} at {j} of batch {idx} on {programs} programs",
            )


# Folds of 4 partials a wave (rows 16 x D 64: 1024 elements a partial); CONFIG folds one at a time.
WAVE_CONFIG = dataclasses.replace(CONFIG, merge_wave_elems=4096)


def test_folds_in_waves_keep_the_one_at_a_time_bits():
    """An output's groups and a group's chunks folded 4 at a time give the bits of folding them
    one at a time: outputs of exactly one wave of groups (4) and of one more (5), on 29 programs, so
    that groups are split over several programs and their chunks folded in waves too."""
    lens = [4 * GROUP_KEYS, 4 * GROUP_KEYS + 1]
    inputs = make_feature_inputs(lens, 4, 1, 64, torch.float32, "paged16", seed=23)
    call = select(inputs, list(range(len(lens))))
    waves = [
        plan_decode(**call, batch_invariant=True, config=c).kernel.constexprs["WAVE"] for c in (WAVE_CONFIG, CONFIG)
    ]
    assert waves == [4, 1]
    got = run(inputs, [0, 1], 29, config=WAVE_CONFIG)
    assert_same_bits(got, run(inputs, [0, 1], 29), "29 programs")


def _paged_copy(cache: torch.Tensor, table: torch.Tensor, page: int) -> torch.Tensor:
    """A pool (pages, page, Hkv, D) holding contiguous ``cache`` (B, Hkv, S, D) at the pages of
    ``table`` (B, S / page), random values in every other page."""
    batch, heads, capacity, dim = cache.shape
    pool = torch.randn(table.numel() + 2, page, heads, dim).to(cache.dtype)
    rows = cache.view(batch, heads, capacity // page, page, dim).permute(0, 2, 3, 1, 4)
    pool[table.long().flatten()] = rows.reshape(-1, page, heads, dim)
    return pool


def test_the_same_bits_in_a_contiguous_cache_and_in_paged_caches_of_every_page_size():
    """Chunks lie on each sequence's token grid, not the page grid: a contiguous cache and pools
    of 1-, 16- and 64-token pages holding the same keys give the same bits (two groups of chunks,
    split over 7 programs)."""
    inputs = make_feature_inputs([300, 1], 8, 2, 64, torch.float16, "contiguous", seed=5)
    capacity = 320  # a multiple of every page size
    for name in ("k_cache", "v_cache"):
        cache = inputs[name]
        inputs[name] = torch.nn.functional.pad(cache, (0, 0, 0, capacity - cache.shape[2]))
    want = run(inputs, [0, 1], 7)
    for page in (1, 16, 64):
        table = torch.randperm(2 * capacity // page + 2)[: 2 * capacity // page].view(2, -1).int()
        pool = {name: _paged_copy(inputs[name], table, page) for name in ("k_cache", "v_cache")}
        assert_same_bits(run(dict(inputs, **pool, block_table=table), [0, 1], 7), want, f"page size {page}")


def check_verified_tokens(inputs: dict, tokens, config=CONFIG) -> None:
    """Query tokens ``tokens`` of a Tq-token verification block (causal among the drafts; 7
    programs) have the bits of decoding each alone at its position (Tq = 1, the keys up to and
    including it; 5 programs), and the block matches float64."""
    n, tq = len(inputs["cache_seqlens"]), inputs["q"].shape[1]
    out, lse = run(inputs, list(range(n)), 7, config=config)
    atol = ATOL[inputs["q"].dtype] * (4 if inputs["k_cache"].dtype.itemsize == 1 else 1)
    assert_matches_feature_ref(out, lse, select(inputs, list(range(n))), atol)
    for t in tokens:
        seqlens = (inputs["cache_seqlens"] - (tq - 1 - t)).clamp(min=0)
        alone = run(dict(inputs, q=inputs["q"][:, t], cache_seqlens=seqlens), list(range(n)), 5, config=config)
        assert_same_bits(alone, (out[:, t], lse[:, t]), f"token {t} of {tq}")


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Every group's row block (1: 15 padding rows; 16: a full block), Tq 2 to 16, every cache layout
# and page size, fp8 caches, and every feature (a window moves where a token's keys begin).
VERIFY_CASES = {
    "group1-tq2-contiguous": dict(hq=2, hkv=2, tq=2, layout="contiguous"),
    "group4-tq4-paged16": dict(hq=8, hkv=2, tq=4, layout="paged16"),
    "group8-tq16-paged1": dict(hq=8, hkv=1, tq=16, layout="paged1"),
    "group16-tq3-paged64-e4m3": dict(hq=16, hkv=1, tq=3, layout="paged64", cache_dtype=E4M3, per_head_scale=True),
    "group2-tq20-paged16": dict(hq=2, hkv=1, tq=20, layout="paged16"),  # past the default mode's Tq bound
    "group3-tq5-e5m2-window-softcap-sinks-leftpad": dict(
        hq=6, hkv=2, tq=5, cache_dtype=E5M2, window=40, softcap=12.0, sinks=True, leftpad=[3, 0, 9]
    ),
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_a_token_verified_among_drafts_has_its_decode_bits(case):
    """Each query token's dots are those of its one-token decode (its group's rows in a block of
    the decode's shape, the keys past it not in its tiles), so any matrix unit that gives equal
    results for equal operands gives it its decode bits."""
    kw = dict(VERIFY_CASES[case])
    tq, hq, hkv = kw.pop("tq"), kw.pop("hq"), kw.pop("hkv")
    lens = (
        [270, 17, tq] if "leftpad" in kw else [270, 17, tq - 1]
    )  # one shorter than the block: its first tokens see nothing
    inputs = make_feature_inputs(lens, hq, hkv, 64, torch.float16, tq=tq, seed=tq + hq, **kw)
    check_verified_tokens(inputs, range(tq) if tq <= 5 else (0, 7, tq - 1))


CASES = {
    "contiguous": dict(layout="contiguous"),
    "paged16": dict(layout="paged16"),
    "tq3-window-softcap-sinks-paged16": dict(layout="paged16", tq=3, window=300, softcap=12.0, sinks=True),
    "fp8-e4m3-per-head-scales": dict(layout="contiguous", cache_dtype=torch.float8_e4m3fn, per_head_scale=True),
    "left-padding": dict(layout="contiguous", leftpad=[3, 0, 17, 1, 0, 5, 2, 9, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_request_bits_do_not_depend_on_the_batch(case):
    inputs = make_feature_inputs(POOL_LENS, 4, 1, 64, torch.float16, seed=21, **CASES[case])
    check_invariance(inputs, batches=3, seed=len(case))


def test_supergroups_and_chunks_of_several_key_blocks():
    """Chunks of two 16-key blocks (one K/V loop runs across their boundaries) and outputs of one
    and two supergroups, held whole by one program (1 program) or split so that some supergroups
    lie in one program and others span several."""
    config = dataclasses.replace(CONFIG, tile_n=2 * CHUNK)
    super_keys = 2 * SUPER_KEYS
    inputs = make_feature_inputs([super_keys + 300, 33, super_keys, 0], 4, 1, 32, torch.float16, "paged16", seed=29)
    check_invariance(inputs, batches=3, seed=29, config=config)
    out, lse = run(inputs, [0], 1, config=config)
    assert_same_bits((out, lse), run(inputs, [0], 4, config=config), "one program against four")


def test_gqa_and_two_row_blocks():
    """Group 24 in row blocks of 16: two row blocks per KV head (head units), two KV heads, and a
    2-token verification (each token its own schedule sequence with two head units)."""
    config = dataclasses.replace(CONFIG, max_block_g=16)
    inputs = make_feature_inputs([0, 17, 150, 290], 48, 2, 32, torch.bfloat16, tq=2, seed=22)
    assert plan_decode(**select(inputs, [0]), batch_invariant=True, config=config).kernel.row_blocks == 2
    check_invariance(inputs, batches=2, seed=3, config=config)


def test_in_batches_of_up_to_64():
    """One long request among up to 63 short ones of random lengths, at random positions."""
    rnd = random.Random(5)
    lens = [600] + [rnd.choice([0, 1, 9, 16, 17, 40]) for _ in range(63)]
    inputs = make_feature_inputs(lens, 2, 1, 16, torch.float16, "paged16", seed=23)
    want = run(inputs, [0], 4)
    for size, programs in ((2, 3), (17, 8), (64, 13)):
        others = rnd.sample(range(1, 64), size - 1)
        idx = others[: size // 2] + [0] + others[size // 2 :]
        out, lse = run(inputs, idx, programs)
        assert_same_bits((out[idx.index(0)], lse[idx.index(0)]), (want[0][0], want[1][0]), f"batch of {size}")


def test_a_request_alone_split_over_more_programs_keeps_its_bits():
    """A request alone is one sequence (``Features.one_sequence``), which an entry may split over
    more programs than a batch's outputs (``one_sequence_max_contributors``: sm_90's MLA entries
    take 128 against 64): alone on more than 64 programs, it has the bits it has in a batch, where
    it spans at most 64, and matches float64."""
    from lean_tp.ops.decode_attention.launcher import lean_schedule

    config = dataclasses.replace(CONFIG, one_sequence_max_contributors=128)
    inputs = make_feature_inputs([80 * CHUNK + 5, 17], 2, 1, 16, torch.float16, "paged16", seed=31)
    spans = []
    for idx in ([0], [1, 0]):
        cx = plan_decode(**select(inputs, idx), batch_invariant=True, config=config, num_programs=96).kernel.constexprs
        lens = inputs["cache_seqlens"][idx]
        programs = lean_schedule(lens, 1, CHUNK, 96, max_contributors=cx["MAX_CONTRIB"])
        spans.append(sum(any(s.b == idx.index(0) for s in segs) for segs in programs))
    assert spans[0] > 64 >= spans[1], spans
    alone = run(inputs, [0], 96, config=config)
    out, lse = run(inputs, [1, 0], 96, config=config)
    assert_same_bits((out[1], lse[1]), (alone[0][0], alone[1][0]), "alone on more programs than in a batch")
    assert_matches_feature_ref(*alone, select(inputs, [0]), ATOL[torch.float16])


def test_the_tables_own_chunk():
    """The interpreter's table entry (D=64: 256-key chunks), with a request of several groups."""
    inputs = make_feature_inputs([INVARIANT_GROUP_CHUNKS * 256 + 300, 5, 256], 2, 1, 64, torch.float16, seed=24)
    alone = run(inputs, [0], 4, config=None)
    out, lse = run(inputs, [1, 0, 2], 7, config=None)
    assert_same_bits((out[1], lse[1]), (alone[0][0], alone[1][0]), "table entry")
    assert_matches_feature_ref(*alone, select(inputs, [0]), ATOL[torch.float16])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    head_dim=st.sampled_from([16, 40, 64]),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3, 4]),
    tq=st.integers(1, 2),
    lens=st.lists(st.integers(0, 600), min_size=2, max_size=5),
    position=st.integers(0, 4),
    programs=st.integers(1, 9),
)
def test_invariance_over_shapes(head_dim, kv_heads, group, tq, lens, position, programs):
    """Request 0 alone and at ``position`` of the batch of all requests, on ``programs`` programs."""
    inputs = make_feature_inputs(lens, group * kv_heads, kv_heads, head_dim, torch.float16, tq=tq, seed=sum(lens))
    idx = list(range(1, len(lens)))
    idx.insert(min(position, len(idx)), 0)
    alone = run(inputs, [0], 4)
    out, lse = run(inputs, idx, programs)
    j = idx.index(0)
    assert_same_bits((out[j], lse[j]), (alone[0][0], alone[1][0]), f"batch {idx} on {programs} programs")


def test_the_default_mode_does_depend_on_the_batch():
    """Why the mode exists, and proof that the comparison above can fail: the default mode's
    split points move with the batch, and with them the rounding of a request's output."""
    inputs = make_feature_inputs([700, 530, 300], 4, 1, 64, torch.float16, seed=25)
    alone = run(inputs, [0], 4, batch_invariant=False)
    out, _ = run(inputs, [1, 0, 2], 5, batch_invariant=False)
    assert not torch.equal(bits(out[1]), bits(alone[0][0]))
    torch.testing.assert_close(out[1], alone[0][0], atol=ATOL[torch.float16], rtol=0)


def test_torch_backend_is_batch_invariant():
    inputs = make_feature_inputs(
        [5000, 3, 17, 600], 4, 2, 40, torch.float32, "paged16", tq=2, window=4500, softcap=20.0, sinks=True, seed=26
    )
    for idx in ([0], [3, 0, 1], [1, 2, 0, 3]):
        call = select(inputs, idx)
        got = lean_tp.decode_attention(**call, return_lse=True, backend="torch", batch_invariant=True)
        if idx == [0]:
            want = got
        else:
            j = idx.index(0)
            assert_same_bits((got[0][j], got[1][j]), (want[0][0], want[1][0]), f"torch backend, batch {idx}")


def test_torch_backend_gives_a_verified_token_its_decode_bits():
    """The torch backend's invariant mode: token t of a Tq = 4 block (window, softcap, sinks; one
    sequence shorter than the block) has the bits of decoding it alone at its position."""
    inputs = make_feature_inputs(
        [300, 2, 40], 8, 2, 32, torch.float32, "paged16", tq=4, window=200, softcap=20.0, sinks=True, seed=30
    )
    call = select(inputs, [0, 1, 2])
    out, lse = lean_tp.decode_attention(**call, return_lse=True, backend="torch", batch_invariant=True)
    for t in range(4):
        alone = dict(call, q=call["q"][:, t], cache_seqlens=(call["cache_seqlens"] - 3 + t).clamp(min=0))
        want = lean_tp.decode_attention(**alone, return_lse=True, backend="torch", batch_invariant=True)
        assert_same_bits((out[:, t], lse[:, t]), want, f"token {t} of 4")


def test_op_and_launcher_agree_and_the_flag_is_checked():
    inputs = make_feature_inputs([0, 40, 300], 4, 1, 64, torch.float16, "paged16", seed=27)
    call = select(inputs, [0, 1, 2])
    got = lean_tp.decode_attention(**call, return_lse=True, backend="triton", batch_invariant=True)
    want = decode_attention_fwd(**call, softmax_scale=64**-0.5, batch_invariant=True)
    assert_same_bits(got, want, "op against launcher")
    with pytest.raises(TypeError, match="batch_invariant: expected a bool, got str 'yes'"):
        lean_tp.decode_attention(**call, batch_invariant="yes")


def test_workspace_is_sized_from_shapes():
    """Group and supergroup values take one slot per group and supergroup of each output's
    capacity; a grid-sized workspace is refused."""
    inputs = make_feature_inputs([0, 40, 1300], 4, 1, 64, torch.float16, seed=28)
    call = select(inputs, [0, 1, 2])
    slots = plan_decode(**call, batch_invariant=True, num_programs=4, config=CONFIG).group_slots
    groups = -(-call["k_cache"].shape[2] // GROUP_KEYS)
    assert groups > INVARIANT_SUPER_GROUPS
    assert slots == 3 * (groups + -(-groups // INVARIANT_SUPER_GROUPS))
    with pytest.raises(ValueError, match="workspace: expected contiguous tensors"):
        decode_attention_fwd(
            **call,
            softmax_scale=0.125,
            batch_invariant=True,
            num_programs=4,
            config=CONFIG,
            workspace=alloc_workspace(4, 16, 64, "cpu"),
        )
    workspace = alloc_workspace(4, 16, 64, "cpu", slots)
    out, _ = decode_attention_fwd(
        **call, softmax_scale=0.125, batch_invariant=True, num_programs=4, config=CONFIG, workspace=workspace
    )
    assert not out.isnan().any()
