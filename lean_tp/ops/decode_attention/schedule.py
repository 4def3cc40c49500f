"""Stream-K schedule of the decode kernel, computed on the device.

All LeanTiles are laid end to end in (lane, sequence, head unit, context) order. A head unit is
one KV head and one block of its query rows (the Tq x group rows of a KV head, in more than one
block only when they outnumber the kernel's row block). With ``lanes`` > 1 (one lane per row block:
``LANES`` in the kernel, whose grid has a program per lane) lane c holds row block c of every
sequence and KV head, and the programs are as many equal lanes: program q of each lane starts at
the same tile of its lane, so the row blocks of a KV head read each key at the same time, and all
but the first read it from L2. With one lane a head unit's row blocks follow one another. The schedule's sequences are the call's, or,
in the batch-invariant mode's verification, each of their query tokens as a sequence of its own
with the keys up to and including its own (``launch_args.token_lengths``). Sequence ``b`` holds
``HU * cdiv(span_b, TILE_N)``
tiles, where ``span_b = min(len_b, max_span)`` counts the keys any of its queries sees: the last
``window + Tq - 1`` with a sliding window (``max_span`` is then that), else all ``len_b``. Keys
before the span are never tiled, so a 4k window over a 128k cache costs like a 4k cache. With ``n_active`` programs,
program ``p`` owns tiles ``[start(p), start(p + 1))`` where ``start(p) = p * base + min(p, rem)``,
``base, rem = divmod(total, n_active)``: equal loads, ±1 tile (in each lane, over its tiles and
programs).

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
    total, and the most tiles of any one output (head unit); HU head units a sequence (a lane's:
    the call's over the lanes).

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
def _lane_start(q, total, n):
    """First tile of program q of n over total tiles."""
    return q * (total // n) + tl.minimum(q, total % n)


@triton.jit
def _lane_program(t, total, n):
    """The program of n over total tiles whose range holds tile t (inverse of ``_lane_start``)."""
    base = total // n
    rem = total % n
    big = rem * (base + 1)
    return tl.where(t < big, t // (base + 1), rem + (t - big) // tl.maximum(base, 1))


@triton.jit
def lane_programs(
    total, unit_max, num_programs, num_sms, LANES: tl.constexpr, MIN_TILES: tl.constexpr, MAX_CONTRIB: tl.constexpr
):
    """Active programs over LANES lanes (``num_active`` in each, over its total / LANES tiles,
    num_programs / LANES programs and num_sms / LANES SMs): a multiple of LANES."""
    if LANES == 1:
        return num_active(total, unit_max, num_programs, num_sms, MIN_TILES, MAX_CONTRIB)
    else:
        per_lane = num_active(
            total // LANES, unit_max, num_programs // LANES, tl.maximum(num_sms // LANES, 1), MIN_TILES, MAX_CONTRIB
        )
        return per_lane * LANES


@triton.jit
def program_range(
    pid,
    seqlens_ptr,
    B,
    HU,
    max_span,
    num_programs,
    num_sms,
    LANES: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_CONTRIB: tl.constexpr,
):
    """Program pid's place in the schedule: (total tiles, active programs, its tiles [t0, t1), its
    first tile's sequence, head unit, tile inside the unit and the sequence's length, and
    ``scan_batch``'s first block, for a caller that locates more tiles)."""
    b_cum, total, unit_max = scan_batch(seqlens_ptr, B, HU // LANES, max_span, TILE_N, BLOCK_B)
    total *= LANES
    n_active = lane_programs(total, unit_max, num_programs, num_sms, LANES, MIN_TILES, MAX_CONTRIB)
    t0 = program_start(pid, total, n_active, LANES)
    t1 = tl.where(pid < n_active, program_start(pid + 1, total, n_active, LANES), t0)
    b, hu, tile, seq_len = locate(t0, total, b_cum, seqlens_ptr, B, HU, max_span, LANES, TILE_N, BLOCK_B)
    return total, n_active, t0, t1, b, hu, tile, seq_len, b_cum


@triton.jit
def program_start(p, total, n_active, LANES: tl.constexpr):
    """First tile of program p; ``program_start(n_active, ...) == total``. Program q of lane c
    (p = c * n_active / LANES + q) starts at program q's tile of the lane's total / LANES tiles."""
    if LANES == 1:
        return _lane_start(p, total, n_active)
    else:
        n_lane = n_active // LANES
        t_lane = total // LANES
        return (p // n_lane) * t_lane + _lane_start(p % n_lane, t_lane, n_lane)


@triton.jit
def program_of_tile(t, total, n_active, LANES: tl.constexpr):
    """The program whose range holds tile t < total (inverse of ``program_start``)."""
    if LANES == 1:
        return _lane_program(t, total, n_active)
    else:
        n_lane = n_active // LANES
        t_lane = total // LANES  # t < total: t_lane >= 1
        return (t // t_lane) * n_lane + _lane_program(t % t_lane, t_lane, n_lane)


@triton.jit
def merge_group_of(i, n, FANIN: tl.constexpr):
    """Merge tree of an output with n contributors, seen from its contributor i (0-based, program
    order): (index of the first member of i's group, members of the group, groups). Groups are
    FANIN consecutive contributors; with one group its merger is the output's merger."""
    first = i // FANIN * FANIN
    return first, tl.minimum(n - first, FANIN), cdiv(n, FANIN)


@triton.jit
def locate(
    t, total, b_cum, seqlens_ptr, B, HU, max_span, LANES: tl.constexpr, TILE_N: tl.constexpr, BLOCK_B: tl.constexpr
):
    """Place tile t < total: (sequence b, head unit, tile inside the head unit's range, b's length).

    Tile t is tile t % (total / LANES) of lane t // (total / LANES), whose head units are HU / LANES
    a sequence (head unit u of lane c: u * LANES + c). b is the number of sequences whose inclusive
    cumulative tile count (a lane's: ``scan_batch`` over HU / LANES units) is <= t, which skips
    zero-length sequences; the exclusive cumulative count of b is the largest such count. b_cum is
    ``scan_batch``'s first block; only sequences past it are loaded again.
    """
    lane = 0
    if LANES > 1:
        t_lane = tl.maximum(total // LANES, 1)  # an idle program of an empty batch locates tile 0
        lane = t // t_lane
        t = t % t_lane
    HU = HU // LANES
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
    return b, (t - b_start) // n_tiles * LANES + lane, (t - b_start) % n_tiles, seq_len


@triton.jit
def next_unit(b, hu, seq_len, seqlens_ptr, B, HU, valid, LANES: tl.constexpr):
    """The head unit after (b, hu) in hu's lane that owns tiles: (b, hu + LANES), else the next
    non-empty sequence's first of the lane.

    Returns (b, hu, length of b). Only loads lengths when the walk leaves sequence b, and only
    while ``valid`` (the caller's range goes on, so a non-empty sequence lies ahead).
    """
    new_b = hu + LANES >= HU
    hu = tl.where(new_b, hu % LANES, hu + LANES)
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
    LANES: tl.constexpr,
):
    """Write out every program's segments, and its place in each output's merge tree, exactly as
    the attention kernel walks them."""
    pid = tl.program_id(0)
    total, n_active, t0, t1, b, hu, tile, seq_len, _ = program_range(
        pid, seqlens_ptr, B, HU, max_span, num_programs, num_sms, LANES, TILE_N, BLOCK_B, MIN_TILES, MAX_CONTRIB
    )
    t = t0
    n = 0
    while t < t1:
        n_tiles = cdiv(tiled_span(seq_len, max_span, True), TILE_N)
        out_start = t - tile
        seg_end = tl.minimum(t1, out_start + n_tiles)
        p_first = program_of_tile(out_start, total, n_active, LANES)
        n_contrib = program_of_tile(out_start + n_tiles - 1, total, n_active, LANES) - p_first + 1
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
        b, hu, seq_len = next_unit(b, hu, seq_len, seqlens_ptr, B, HU, t < t1, LANES)
        tile = 0
    tl.store(nseg_ptr + pid, tl.where(pid < n_active, n, -1))


# Fields of one program's place as ``program_ranges_kernel`` writes it: t0, t1, b, hu, tile,
# seq_len, total, n_active (``program_range``), then the output its last segment holds when the
# program merges it (its first contributor, the output split): that output's row block
# b * HU + hu, its contributors (0 when the program merges none) and the program's slot for it.
RANGE_FIELDS = tl.constexpr(11)


@triton.jit
def program_ranges_kernel(
    seqlens_ptr,  # (B,) int32
    range_ptr,  # (num_programs, RANGE_FIELDS) int32 out
    B,
    HU,
    num_programs,
    num_sms,
    max_span,
    TILE_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_CONTRIB: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LANES: tl.constexpr,
):
    """Write every program's place in the schedule, for a kernel that walks it with the scalar
    helpers alone (``next_unit``, ``program_of_tile``): the Gluon MLA kernel, whose language has no
    layout-free ``arange`` for the batch scans. Inactive programs get t0 == t1."""
    pid = tl.program_id(0)
    total, n_active, t0, t1, b, hu, tile, seq_len, b_cum = program_range(
        pid, seqlens_ptr, B, HU, max_span, num_programs, num_sms, LANES, TILE_N, BLOCK_B, MIN_TILES, MAX_CONTRIB
    )
    # The last segment: the output of tile t1 - 1, which may start before t0.
    t_last = tl.maximum(t1 - 1, t0)
    lb, lhu, ltile, llen = locate(t_last, total, b_cum, seqlens_ptr, B, HU, max_span, LANES, TILE_N, BLOCK_B)
    out_start = t_last - ltile
    p_first = program_of_tile(out_start, total, n_active, LANES)
    n_tiles = cdiv(tiled_span(llen, max_span, True), TILE_N)
    n_contrib = program_of_tile(out_start + n_tiles - 1, total, n_active, LANES) - p_first + 1
    merges = (t1 > t0) & (p_first == pid) & (n_contrib > 1)
    p_out = range_ptr + pid * RANGE_FIELDS
    tl.store(p_out + 0, t0)
    tl.store(p_out + 1, t1)
    tl.store(p_out + 2, b)
    tl.store(p_out + 3, hu)
    tl.store(p_out + 4, tile)
    tl.store(p_out + 5, seq_len)
    tl.store(p_out + 6, total)
    tl.store(p_out + 7, n_active)
    tl.store(p_out + 8, lb * HU + lhu)
    tl.store(p_out + 9, tl.where(merges, n_contrib, 0))
    tl.store(p_out + 10, (t0 < out_start).to(tl.int32))
