"""Stream-K schedule of the decode kernel, computed on the device.

All LeanTiles are laid end to end in (sequence, head unit, context) order. A head unit is one KV
head and one block of its query rows (the Tq x group rows of a KV head, in more than one block
only when they outnumber the kernel's row block). The schedule's sequences are the call's, or,
in the batch-invariant mode's verification, each of their query tokens as a sequence of its own
with the keys up to and including its own (``launch_args.token_lengths``). Sequence ``b`` holds
``HU * cdiv(span_b, TILE_N)``
tiles, where ``span_b = min(len_b, max_span)`` counts the keys any of its queries sees: the last
``window + Tq - 1`` with a sliding window (``max_span`` is then that), else all ``len_b``. Keys
before the span are never tiled, so a 4k window over a 128k cache costs like a 4k cache. With ``n_active`` programs,
program ``p`` owns tiles ``[start(p), start(p + 1))`` where ``start(p) = p * base + min(p, rem)``,
``base, rem = divmod(total, n_active)``: equal loads, ±1 tile.

These ``@triton.jit`` helpers are the only implementation of the schedule: the attention kernel
calls them, and ``lean_schedule_kernel`` below writes their results out so that tests and the
schedule simulator use the very same code.
"""

import triton
import triton.language as tl


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def tiled_span(seq_len, max_span, LIMITED: tl.constexpr):
    """Keys of a sequence that are tiled: its last min(len, max_span). LIMITED=False (a constexpr:
    the kernel without a window) skips the minimum, which would otherwise cost registers."""
    if LIMITED:
        return tl.minimum(seq_len, max_span)
    else:
        return seq_len


@triton.jit
def _tile_counts(seqlens_ptr, b0, B, HU, max_span, TILE_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Tiles of sequences b0 .. b0 + BLOCK_B - 1 ([BLOCK_B]; 0 past the batch): HU * cdiv(span, TILE_N)."""
    o_b = b0 + tl.arange(0, BLOCK_B)
    return cdiv(tiled_span(tl.load(seqlens_ptr + o_b, mask=o_b < B, other=0), max_span, True), TILE_N) * HU


@triton.jit
def scan_batch(seqlens_ptr, B, HU, max_span, TILE_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Inclusive cumulative tile counts of the first BLOCK_B sequences ([BLOCK_B]), the batch's
    total, and the most tiles of any one output (head unit).

    The first block's counts are loaded once and kept in registers: ``locate`` reuses them, so a
    decode batch (B <= BLOCK_B) reads the lengths once before its first K/V request.
    """
    counts = _tile_counts(seqlens_ptr, 0, B, HU, max_span, TILE_N, BLOCK_B)
    b_cum = tl.cumsum(counts, axis=0)
    total = tl.max(b_cum, axis=0)
    unit_max = tl.max(counts, axis=0)
    for b0 in range(BLOCK_B, B, BLOCK_B):
        counts = _tile_counts(seqlens_ptr, b0, B, HU, max_span, TILE_N, BLOCK_B)
        total += tl.sum(counts, axis=0)
        unit_max = tl.maximum(unit_max, tl.max(counts, axis=0))
    return b_cum, total, unit_max // HU


@triton.jit
def num_active(total, unit_max, num_programs, num_sms, MIN_TILES: tl.constexpr, MAX_CONTRIB: tl.constexpr):
    """Active programs: the cost rule that weighs K/V reads against merges (docs/design.md).

    Every active program gets at least ``per`` tiles: MIN_TILES, and cdiv(unit_max - 1,
    MAX_CONTRIB - 1), so that an output of unit_max tiles spans at most MAX_CONTRIB programs (its
    first holds one tile or more, each other >= base) and its merge chain stays within the tree's
    bound. That allows up to ``n_max`` programs. With work for two or more programs per SM
    (num_sms), a whole number of programs per SM keeps the SMs' loads within a tile of each
    other. Otherwise at most one program per SM: the fewest programs that reach the least
    possible load of the busiest one, since more would not finish sooner (SMs streaming together
    share the memory bandwidth) and would only add partials to merge. Never below 1.
    """
    per = tl.maximum(cdiv(unit_max - 1, MAX_CONTRIB - 1), MIN_TILES)
    n_max = tl.minimum(num_programs, tl.maximum(total // per, 1))
    fewest = cdiv(total, tl.maximum(cdiv(total, tl.minimum(n_max, num_sms)), 1))
    return tl.maximum(tl.where(n_max >= 2 * num_sms, n_max // num_sms * num_sms, fewest), 1)


@triton.jit
def program_start(p, total, n_active):
    """First tile of program p; ``program_start(n_active, ...) == total``."""
    base = total // n_active
    rem = total % n_active
    return p * base + tl.minimum(p, rem)


@triton.jit
def program_of_tile(t, total, n_active):
    """The program whose range holds tile t (inverse of ``program_start``)."""
    base = total // n_active
    rem = total % n_active
    big = rem * (base + 1)
    return tl.where(t < big, t // (base + 1), rem + (t - big) // tl.maximum(base, 1))


@triton.jit
def merge_group_of(i, n, FANIN: tl.constexpr):
    """Merge tree of an output with n contributors, seen from its contributor i (0-based, program
    order): (index of the first member of i's group, members of the group, groups). Groups are
    FANIN consecutive contributors; with one group its merger is the output's merger."""
    first = i // FANIN * FANIN
    return first, tl.minimum(n - first, FANIN), cdiv(n, FANIN)


@triton.jit
def locate(t, b_cum, seqlens_ptr, B, HU, max_span, TILE_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Place tile t < total: (sequence b, head unit, tile inside the head unit's range, b's length).

    b is the number of sequences whose inclusive cumulative tile count is <= t, which skips
    zero-length sequences; the exclusive cumulative count of b is the largest such count. b_cum is
    ``scan_batch``'s first block; only sequences past it are loaded again.
    """
    o_b = tl.arange(0, BLOCK_B)
    m_before = (b_cum <= t) & (o_b < B)
    b = tl.sum(m_before.to(tl.int32), axis=0)
    b_start = tl.max(tl.where(m_before, b_cum, 0), axis=0)
    running = tl.max(b_cum, axis=0)
    for b0 in range(BLOCK_B, B, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        b_cum_next = running + tl.cumsum(_tile_counts(seqlens_ptr, b0, B, HU, max_span, TILE_N, BLOCK_B), axis=0)
        m_before = (b_cum_next <= t) & (o_b < B)
        b += tl.sum(m_before.to(tl.int32), axis=0)
        b_start = tl.maximum(b_start, tl.max(tl.where(m_before, b_cum_next, 0), axis=0))
        running = tl.max(b_cum_next, axis=0)
    seq_len = tl.load(seqlens_ptr + b, mask=b < B, other=0)
    n_tiles = tl.maximum(cdiv(tiled_span(seq_len, max_span, True), TILE_N), 1)  # t >= total: an idle program
    return b, (t - b_start) // n_tiles, (t - b_start) % n_tiles, seq_len


@triton.jit
def next_unit(b, hu, seq_len, seqlens_ptr, B, HU, valid):
    """The head unit after (b, hu) that owns tiles: (b, hu + 1), else the next non-empty sequence.

    Returns (b, hu, length of b). Only loads lengths when the walk leaves sequence b, and only
    while ``valid`` (the caller's range goes on, so a non-empty sequence lies ahead).
    """
    new_b = hu + 1 == HU
    hu = tl.where(new_b, 0, hu + 1)
    b = b + new_b.to(tl.int32)
    n_len = tl.load(seqlens_ptr + b, mask=valid & new_b & (b < B), other=0)
    n_len = tl.where(new_b, n_len, seq_len)
    while valid & (n_len == 0):
        b += 1
        n_len = tl.load(seqlens_ptr + b, mask=b < B, other=1)
    return b, hu, n_len


# Fields of one segment as ``lean_schedule_kernel`` writes it (``launcher.Segment`` names them).
SEGMENT_FIELDS = tl.constexpr(10)


@triton.jit
def lean_schedule_kernel(
    seqlens_ptr,  # (B,) int32
    seg_ptr,  # (num_programs, MAX_SEGS, SEGMENT_FIELDS) int32 out, see launcher.Segment
    nseg_ptr,  # (num_programs,) int32 out: segments of each program (-1 when inactive)
    B,
    HU,
    num_programs,
    num_sms,  # SMs the grid is spread over (num_programs is a multiple)
    max_span,  # keys of a sequence that are tiled: window + Tq - 1, or more than any length
    TILE_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_CONTRIB: tl.constexpr,
    FANIN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MAX_SEGS: tl.constexpr,
):
    """Write out every program's segments, and its place in each output's merge tree, exactly as
    the attention kernel walks them."""
    pid = tl.program_id(0)
    b_cum, total, unit_max = scan_batch(seqlens_ptr, B, HU, max_span, TILE_N, BLOCK_B)
    n_active = num_active(total, unit_max, num_programs, num_sms, MIN_TILES, MAX_CONTRIB)
    t0 = program_start(pid, total, n_active)
    t1 = tl.where(pid < n_active, program_start(pid + 1, total, n_active), t0)
    b, hu, tile, seq_len = locate(t0, b_cum, seqlens_ptr, B, HU, max_span, TILE_N, BLOCK_B)
    t = t0
    n = 0
    while t < t1:
        n_tiles = cdiv(tiled_span(seq_len, max_span, True), TILE_N)
        out_start = t - tile
        seg_end = tl.minimum(t1, out_start + n_tiles)
        p_first = program_of_tile(out_start, total, n_active)
        n_contrib = program_of_tile(out_start + n_tiles - 1, total, n_active) - p_first + 1
        g_first, g_size, n_groups = merge_group_of(pid - p_first, n_contrib, FANIN)
        p_seg = seg_ptr + (pid * MAX_SEGS + n) * SEGMENT_FIELDS
        m_room = n < MAX_SEGS
        tl.store(p_seg + 0, b, mask=m_room)
        tl.store(p_seg + 1, hu, mask=m_room)
        tl.store(p_seg + 2, tile, mask=m_room)
        tl.store(p_seg + 3, seg_end - t, mask=m_room)
        tl.store(p_seg + 4, n_contrib, mask=m_room)
        tl.store(p_seg + 5, pid - p_first, mask=m_room)
        tl.store(p_seg + 6, (t0 < out_start).to(tl.int32), mask=m_room)
        tl.store(p_seg + 7, g_first, mask=m_room)
        tl.store(p_seg + 8, g_size, mask=m_room)
        tl.store(p_seg + 9, n_groups, mask=m_room)
        n += 1
        t = seg_end
        b, hu, seq_len = next_unit(b, hu, seq_len, seqlens_ptr, B, HU, t < t1)
        tile = 0
    tl.store(nseg_ptr + pid, tl.where(pid < n_active, n, -1))
