"""Properties of the stream-K schedule, checked on the kernel's own schedule code (interpreter on CPU)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lean_tp.ops.decode_attention import lean_schedule, merge_partials
from lean_tp.ops.decode_attention.schedule import lean_schedule_kernel
from lean_tp.ops.decode_attention.tuning import MIN_TILES_PER_PROGRAM
from lean_tp.ops.utils import interpreted

needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreted(lean_schedule_kernel)), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 600), min_size=1, max_size=12),
    head_units=st.integers(1, 6),
    tile_n=st.sampled_from([16, 64, 128]),
    num_programs=st.integers(1, 40),
    max_span=st.one_of(st.none(), st.integers(1, 300)),
)
def test_schedule_covers_every_tile_once_with_balanced_loads(lens, head_units, tile_n, num_programs, max_span):
    """With a sliding window (max_span = window + Tq - 1) only the span's tiles exist: a sequence
    costs min(len, max_span) keys, whatever its length."""
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    span = {} if max_span is None else {"max_span": max_span}
    programs = lean_schedule(seqlens, head_units, tile_n, num_programs, max_segments=128, **span)
    tiles_per_seq = [math.ceil(min(n, max_span or n) / tile_n) for n in lens]
    total = head_units * sum(tiles_per_seq)
    expected_active = max(1, min(num_programs, total // MIN_TILES_PER_PROGRAM))
    assert len(programs) == expected_active

    covered = {}
    for p, segments in enumerate(programs):
        for b, hu, first, n, _ in segments:
            assert 0 <= hu < head_units and n >= 1 and first + n <= tiles_per_seq[b]
            for tile in range(first, first + n):
                assert (b, hu, tile) not in covered, f"tile {(b, hu, tile)} covered twice"
                covered[(b, hu, tile)] = p
    assert len(covered) == total  # with no duplicates, this means every tile exactly once

    loads = [sum(n for *_, n, _ in segs) for segs in programs]
    assert max(loads) - min(loads) <= 1
    if total >= MIN_TILES_PER_PROGRAM:
        assert min(loads) >= MIN_TILES_PER_PROGRAM
    # Each output's contributor count is the number of programs holding one of its tiles, and
    # programs keep the linear (sequence, head unit, tile) order, so contributors are contiguous.
    for segments in programs:
        for b, hu, *_, contributors in segments:
            owners = {p for (bb, hh, _), p in covered.items() if (bb, hh) == (b, hu)}
            assert contributors == len(owners) == max(owners) - min(owners) + 1
    order = [covered[key] for key in sorted(covered)]
    assert order == sorted(order)


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
    assert sorted(b for segments in programs for b, *_ in segments) == list(range(300))
    with pytest.raises(ValueError, match="max_segments: expected at least 150"):
        lean_schedule(seqlens, 1, 16, 2, max_segments=64)
