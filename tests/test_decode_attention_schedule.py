"""Properties of the stream-K schedule, checked on the kernel's own schedule code (interpreter on CPU)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lean_tp.ops.decode_attention import lean_schedule
from lean_tp.ops.decode_attention.launcher import merge_plan
from lean_tp.ops.decode_attention.schedule import lean_schedule_kernel
from lean_tp.ops.decode_attention.tuning import MAX_CONTRIBUTORS, MERGE_FANIN, MIN_TILES_PER_PROGRAM
from lean_tp.ops.merge_attention import merge_partials
from lean_tp.ops.utils import interpreted

needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreted(lean_schedule_kernel)), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(0, 600), min_size=1, max_size=12),
    head_units=st.integers(1, 6),
    tile_n=st.sampled_from([16, 64, 128]),
    num_sms=st.integers(1, 20),
    programs_per_sm=st.integers(1, 3),
    max_span=st.one_of(st.none(), st.integers(1, 300)),
)
def test_schedule_covers_every_tile_once_with_balanced_loads(
    lens, head_units, tile_n, num_sms, programs_per_sm, max_span
):
    """With a sliding window (max_span = window + Tq - 1) only the span's tiles exist: a sequence
    costs min(len, max_span) keys, whatever its length."""
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    span = {} if max_span is None else {"max_span": max_span}
    num_programs = num_sms * programs_per_sm
    programs = lean_schedule(seqlens, head_units, tile_n, num_programs, max_segments=128, num_sms=num_sms, **span)
    tiles_per_seq = [math.ceil(min(n, max_span or n) / tile_n) for n in lens]
    total = head_units * sum(tiles_per_seq)
    # The cost rule: >= MIN_TILES per program, few enough programs that no output has more than
    # MAX_CONTRIBUTORS; with work for 2+ programs per SM a whole number per SM, else at most one
    # per SM: the fewest programs that reach the least possible busiest load.
    per = max(MIN_TILES_PER_PROGRAM, math.ceil((max(tiles_per_seq) - 1) / (MAX_CONTRIBUTORS - 1)))
    n_max = min(num_programs, max(total // per, 1))
    most = max(1, math.ceil(total / min(n_max, num_sms)))
    expected = n_max // num_sms * num_sms if n_max >= 2 * num_sms else math.ceil(total / most)
    assert len(programs) == max(1, expected)
    if len(programs) > num_sms:
        assert len(programs) % num_sms == 0  # every SM holds as many programs

    covered = {}
    for p, segments in enumerate(programs):
        for s in segments:
            assert 0 <= s.head_unit < head_units and s.n_tiles >= 1 and s.first_tile + s.n_tiles <= tiles_per_seq[s.b]
            for tile in range(s.first_tile, s.first_tile + s.n_tiles):
                assert (s.b, s.head_unit, tile) not in covered, f"tile {(s.b, s.head_unit, tile)} covered twice"
                covered[(s.b, s.head_unit, tile)] = p
    assert len(covered) == total  # with no duplicates, this means every tile exactly once

    loads = [sum(s.n_tiles for s in segs) for segs in programs]
    assert max(loads) - min(loads) <= 1
    if len(programs) <= num_sms and total:
        assert max(loads) == most  # the least the grid allows
    if total >= per:
        assert min(loads) >= per
    # Each output's contributor count is the number of programs holding one of its tiles, and
    # programs keep the linear (sequence, head unit, tile) order, so contributors are contiguous.
    for p, segments in enumerate(programs):
        for i, s in enumerate(segments):
            owners = {q for (bb, hh, _), q in covered.items() if (bb, hh) == (s.b, s.head_unit)}
            assert s.contributors == len(owners) == max(owners) - min(owners) + 1 <= MAX_CONTRIBUTORS
            assert s.index == p - min(owners) and s.slot == int(i > 0)
    order = [covered[key] for key in sorted(covered)]
    assert order == sorted(order)
    check_merge_plan(programs)


@needs_kernel
@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.integers(0, 600), min_size=1, max_size=8),
    kv_heads=st.integers(1, 3),
    lanes=st.sampled_from([2, 4, 8]),
    num_programs=st.sampled_from([1, 3, 8, 24, 66]),
)
def test_row_blocks_read_in_step(lens, kv_heads, lanes, num_programs):
    """With lanes (a KV head's head units: DP attention's 128 heads as the two column halves of a
    128-row block) each program of lane c holds program q's tiles of lane 0, for head unit c: the
    units of a KV head read each key at the same time. Every tile still once, contributors contiguous, the merge
    tree bounded. A grid needs a program a lane (the launcher's grid has one)."""
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    head_units = kv_heads * lanes
    if num_programs < lanes:
        with pytest.raises(ValueError, match="lanes"):
            lean_schedule(seqlens, head_units, 16, num_programs, lanes=lanes)
        return
    programs = lean_schedule(seqlens, head_units, 16, num_programs, max_segments=128, lanes=lanes)
    total = head_units * sum(math.ceil(n / 16) for n in lens)
    covered = [
        (s.b, s.head_unit, t) for segs in programs for s in segs for t in range(s.first_tile, s.first_tile + s.n_tiles)
    ]
    assert len(covered) == len(set(covered)) == total
    check_merge_plan(programs)
    assert len(programs) % lanes == 0
    n_lane = len(programs) // lanes
    for p, segments in enumerate(programs):
        lane, q = divmod(p, n_lane)
        in_step = [s._replace(head_unit=s.head_unit - s.head_unit % lanes + lane) for s in programs[q]]
        assert segments == in_step


def check_merge_plan(programs) -> None:
    """Every partial of a split output is merged exactly once: each contributor in one group, groups
    of <= MERGE_FANIN consecutive programs in program order, and a serial chain (the largest group
    plus the second level's groups) within 2 x MERGE_FANIN."""
    plan = merge_plan(programs)
    split = {(s.b, s.head_unit): s.contributors for segs in programs for s in segs if s.contributors > 1}
    assert set(plan) == set(split)
    for out, groups in plan.items():
        members = [p for group in groups for p, _ in group]
        assert len(members) == len(set(members)) == split[out]
        assert members == list(range(members[0], members[0] + split[out]))
        assert all(1 <= len(group) <= MERGE_FANIN for group in groups)
        assert len(groups) == math.ceil(split[out] / MERGE_FANIN)
        assert max(map(len, groups)) + (len(groups) if len(groups) > 1 else 0) <= 2 * MERGE_FANIN


@needs_kernel
@settings(max_examples=4, deadline=None)
@given(
    tiles=st.integers(1, 3000),
    head_units=st.integers(1, 3),
    num_programs=st.sampled_from([64, 132, 396]),
)
def test_merge_plan_bounds_the_chain_on_gpu_sized_grids(tiles, head_units, num_programs):
    """Long single sequences on full-size grids (the tensor-parallel shape: one or two KV heads per
    rank): no output is shared by more than MAX_CONTRIBUTORS programs, and the tree bounds the chain."""
    seqlens = torch.tensor([tiles * 16 - 3], dtype=torch.int32, device=DEVICE)
    programs = lean_schedule(seqlens, head_units, 16, num_programs)
    check_merge_plan(programs)
    assert max(s.contributors for segs in programs for s in segs) <= MAX_CONTRIBUTORS


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    cuts=st.lists(st.floats(0, 1), max_size=6),
    seed=st.integers(0, 2**31 - 1),
    right_to_left=st.booleans(),
)
def test_merge_operator_is_associative_for_any_split(n, cuts, seed, right_to_left):
    """Softmax partials over arbitrary contiguous blocks merge, in any bracketing, to the full result."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(3, n, generator=g, dtype=torch.float64) * 4
    v = torch.randn(3, n, 8, generator=g, dtype=torch.float64)
    points = sorted({0, n, *(int(c * n) for c in cuts)})

    def partial(lo, hi):
        m = s[:, lo:hi].amax(-1) if hi > lo else torch.full((3,), float("-inf"), dtype=torch.float64)
        p = torch.exp(s[:, lo:hi] - m[:, None]) if hi > lo else s[:, :0]
        return m, p.sum(-1), torch.einsum("hn,hnd->hd", p, v[:, lo:hi])

    parts = [partial(lo, hi) for lo, hi in zip(points, points[1:])] + [partial(0, 0)]  # one empty
    if right_to_left:
        acc = parts[-1]
        for part in reversed(parts[:-1]):
            acc = merge_partials(part, acc)
    else:
        acc = parts[0]
        for part in parts[1:]:
            acc = merge_partials(acc, part)
    m, l, o = acc
    torch.testing.assert_close(o / l[:, None], torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v))
    torch.testing.assert_close(m + torch.log(l), torch.logsumexp(s, -1))


@needs_kernel
def test_schedule_makes_room_for_many_segments():
    """300 one-tile sequences on 2 programs: 150 segments each, past the first 64 slots."""
    seqlens = torch.ones(300, dtype=torch.int32, device=DEVICE)
    programs = lean_schedule(seqlens, 1, 16, 2)
    assert [len(segments) for segments in programs] == [150, 150]
    assert sorted(s.b for segments in programs for s in segments) == list(range(300))
    with pytest.raises(ValueError, match="max_segments: expected at least 150"):
        lean_schedule(seqlens, 1, 16, 2, max_segments=64)
