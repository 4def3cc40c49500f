"""The merge tree of a split output, inside the decode kernel (docs/design.md, "The merge tree"):
each contributor publishes its partial to the workspace; each group's partials are merged once
its last member arrives, and the groups' once every group is merged, in column slices that the
contributors with no tiles left share (``finish_split``). Partials are un-normalized (acc, m, l)
in the log2 domain, as ``attend.attend_segment`` leaves them."""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.attend import ref_max
from lean_tp.ops.decode_attention.rows import store_output, unit_cols
from lean_tp.ops.decode_attention.schedule import merge_group_of, program_of_tile, program_start


@triton.jit
def store_partial(ws_acc_ptr, ws_ml_ptr, o_slot, n_rows, b_acc, b_m, b_l, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """Write rows [0, n_rows) of one partial (b_acc [BLOCK_G, BLOCK_D], b_m and b_l [BLOCK_G]) to
    workspace slot o_slot (2 * program + 0 or 1; ``invariant.py`` lays out its own slots)."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < n_rows
    o_slot = tl.cast(o_slot, tl.int64)
    tl.store(ws_acc_ptr + (o_slot * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :], b_acc, mask=m_g[:, None])
    tl.store(ws_ml_ptr + o_slot * 2 * BLOCK_G + o_g, b_m, mask=m_g)
    tl.store(ws_ml_ptr + (o_slot * 2 + 1) * BLOCK_G + o_g, b_l, mask=m_g)


@triton.jit
def load_partial(
    ws_acc_ptr, ws_ml_ptr, o_slot, n_rows, c0, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, COLS: tl.constexpr
):
    """Rows [0, n_rows) of workspace slot o_slot, as ``store_partial`` wrote them (the empty state
    past them): acc's columns [c0, c0 + COLS) ([BLOCK_G, COLS]), m and l ([BLOCK_G]). ``.cg``:
    other SMs wrote them."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = c0 + tl.arange(0, COLS)
    m_g = o_g < n_rows
    o_slot = tl.cast(o_slot, tl.int64)
    acc = tl.load(
        ws_acc_ptr + (o_slot * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :],
        mask=m_g[:, None],
        other=0.0,
        cache_modifier=".cg",
    )
    m = tl.load(ws_ml_ptr + o_slot * 2 * BLOCK_G + o_g, mask=m_g, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(ws_ml_ptr + (o_slot * 2 + 1) * BLOCK_G + o_g, mask=m_g, other=0.0, cache_modifier=".cg")
    return acc, m, l


@triton.jit
def _merge_partials(
    ws_acc_ptr,
    ws_ml_ptr,
    first,
    n_members,
    stride,
    out_start,
    total,
    n_active,
    n_rows,
    c0,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
    WAVE: tl.constexpr,
    LANES: tl.constexpr,
):
    """Merge columns [c0, c0 + COLS) of the partials of programs first, first + stride, ...
    (n_members of them) for the output that starts at tile out_start: (acc [BLOCK_G, COLS],
    m [BLOCK_G], l [BLOCK_G]); m and l are the same for every column slice.

    A member's partial is in its slot 1 when the output began after its first tile, else in slot 0.
    WAVE members are loaded at once, (m, l) and acc together, so each wave waits for L2 once;
    the fixed member order makes the result independent of arrival. Loads use
    ``.cg`` (L2, not the non-coherent L1): the partials were written by other SMs. Rows that no
    member saw (m = -inf) exponentiate against 0, as in ``attend_segment``.
    """
    o_w = tl.arange(0, WAVE)
    o_r = tl.arange(0, BLOCK_G)
    o_d = c0 + tl.arange(0, COLS)
    m_acc = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_acc = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, COLS], tl.float32)
    for i0 in range(0, n_members, WAVE):
        o_slot = _slot_of(first + (i0 + o_w) * stride, out_start, total, n_active, LANES)  # < 2**31: grid-sized
        m_wr = ((i0 + o_w) < n_members)[:, None] & (o_r < n_rows)[None, :]
        o_ml = (o_slot * 2)[:, None] * BLOCK_G + o_r[None, :]
        b_mp = tl.load(ws_ml_ptr + o_ml, mask=m_wr, other=float("-inf"), cache_modifier=".cg")
        b_lp = tl.load(ws_ml_ptr + o_ml + BLOCK_G, mask=m_wr, other=0.0, cache_modifier=".cg")
        o_acc = ((o_slot * BLOCK_G)[:, None, None] + o_r[None, :, None]) * BLOCK_D + o_d[None, None, :]
        b_ap = tl.load(ws_acc_ptr + o_acc, mask=m_wr[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_acc, tl.max(b_mp, 0))
        m_ref = ref_max(m_new, True)
        b_w = tl.exp2(b_mp - m_ref[None, :])
        b_alpha = tl.exp2(m_acc - m_ref)
        l_acc = l_acc * b_alpha + tl.sum(b_w * b_lp, 0)
        acc = acc * b_alpha[:, None] + tl.sum(b_w[:, :, None] * b_ap, 0)
        m_acc = m_new
    return acc, m_acc, l_acc


@triton.jit
def arrive(counter_ptr, n_members, RESET: tl.constexpr):
    """Count this program in at a merge of n_members; True for the last arriver. With RESET the
    last arriver also leaves the counter at zero for the next launch (or CUDA-graph replay);
    without, the count stays for the programs that wait on it (``await_count``), and whoever
    leaves the merge last zeroes it."""
    return _count_arrival(counter_ptr, n_members, RESET) == n_members - 1


@triton.jit
def _count_arrival(counter_ptr, n_members, RESET: tl.constexpr):
    """Count this program in at a merge of n_members and return how many were in before it; with
    RESET the last arriver leaves the counter at zero (without, whoever reads it last does).

    The caller's barrier makes every thread's partial stores happen before the (single-thread)
    release; the acq_rel atomic orders the last arriver's later loads after all members' releases.
    """
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if RESET:
        if arrived == n_members - 1:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return arrived


@triton.jit
def store_cols(ws_acc_ptr, o_slot, n_rows, acc, c0, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """Write columns [c0, c0 + COLS) of rows [0, n_rows) of a partial's acc (acc [BLOCK_G, COLS])
    to workspace slot o_slot (``store_partial`` writes all of them, and m and l)."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = c0 + tl.arange(0, acc.shape[1])
    p = ws_acc_ptr + (tl.cast(o_slot, tl.int64) * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :]
    tl.store(p, acc, mask=(o_g < n_rows)[:, None])


@triton.jit
def store_ml(ws_ml_ptr, o_slot, n_rows, b_m, b_l, BLOCK_G: tl.constexpr):
    """Write a partial's m and l ([BLOCK_G]) to workspace slot o_slot."""
    o_g = tl.arange(0, BLOCK_G)
    o_ml = tl.cast(o_slot, tl.int64) * 2 * BLOCK_G + o_g
    tl.store(ws_ml_ptr + o_ml, b_m, mask=o_g < n_rows)
    tl.store(ws_ml_ptr + o_ml + BLOCK_G, b_l, mask=o_g < n_rows)


# The merge's counters: six regions of 2 * num_programs (``launch_args.counters_size``), each
# indexed by the workspace slot of a merge's first member. A group's: its arrivals, its claimed
# column slices, its merged ones; an output's: its groups merged (the second level's arrivals),
# its second level's claimed slices, its contributors gone.
COUNTER_REGIONS = 6
_ARRIVED = tl.constexpr(0)
_GROUPS_MERGED = tl.constexpr(1)
_CLAIMED = tl.constexpr(2)
_MERGED = tl.constexpr(3)
_CLAIMED_OUT = tl.constexpr(4)
_LEFT = tl.constexpr(5)


@triton.jit
def _slot_of(p, out_start, total, n_active, LANES: tl.constexpr):
    """Workspace slot of program p's partial of the output that starts at tile out_start: slot 1
    when the output began after p's first tile, else 0 (it is then p's first segment)."""
    return p * 2 + (program_start(p, total, n_active, LANES) < out_start).to(tl.int32)


@triton.jit
def ends_within(p, out_start, n_tiles, total, n_active, LANES: tl.constexpr):
    """Whether program p's range ends within the output of tiles [out_start, out_start + n_tiles):
    it has no tiles left once its part of the output is published."""
    return program_start(p + 1, total, n_active, LANES) <= out_start + n_tiles


@triton.jit
def await_count(counter_ptr, target, POLLS: tl.constexpr):
    """Whether the counter reaches ``target`` within POLLS reads: a program with no tiles left
    waits this long, and no longer, for a merge it can take column slices of. Programs need not
    run at the same time (the interpreter runs them one after another), so the wait is bounded
    and the merge never depends on it: its last arriver claims whatever slices nobody else has."""
    n = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    polls = 1
    while (n < target) & (polls < POLLS):
        n = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    return n >= target


@triton.jit
def _merge_slices(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    claimed_ptr,
    claims,
    first,
    members,
    stride,
    is_output,
    o_group,
    o_out,
    n_groups,
    region,
    s,
    hu,
    out_start,
    total,
    n_active,
    n_rows,
    HQ,
    GROUP: tl.constexpr,
    TQ: tl.constexpr,
    SEQ_TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr,
    NUM_VC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WAVE: tl.constexpr,
    COLS: tl.constexpr,
    LANES: tl.constexpr,
):
    """Merge column slices of one merge (``_merge_partials`` of programs first, first + stride,
    ...) and store each: as the output's columns when this merge gives the output (is_output), else
    over the group's first member's slot (o_group). With ``claims``, slices are claimed at
    claimed_ptr until none is left (others may claim beside this program); without, this program
    merges them all. Whoever merges a group's last slice stores the group's m and l too (every
    slice has read its members' by then) and counts the group in at the output's second level.
    Returns whether that count made this program the second level's last arriver. ``region``: the
    stride of the counters' regions (2 * num_programs)."""
    n_slices: tl.constexpr = BLOCK_D // COLS
    owner_out = first < 0
    k = first * 0
    if claims:
        k = tl.atomic_add(claimed_ptr, 1, sem="relaxed", scope="gpu")
    while k < n_slices:
        c0 = k * COLS
        acc, b_m, b_l = _merge_partials(
            ws_acc_ptr, ws_ml_ptr, first, members, stride, out_start, total, n_active, n_rows, c0,
            BLOCK_D, BLOCK_G, COLS, WAVE, LANES,
        )  # fmt: skip
        if is_output:
            c_out = unit_cols(hu, NUM_VC, BLOCK_D) + c0
            store_output(
                out_ptr, lse_ptr, sinks_ptr, s, hu, acc, b_m, b_l, c_out, HQ,
                GROUP, TQ, SEQ_TOKENS, HEAD_DIM, COLS, BLOCK_G, NUM_GC, NUM_VC, HAS_SINKS,
            )  # fmt: skip
        else:
            store_cols(ws_acc_ptr, o_group, n_rows, acc, c0, BLOCK_D, BLOCK_G)
            tl.debug_barrier()
            merged = k
            if claims:
                merged = tl.atomic_add(counter_ptr + _MERGED * region + o_group, 1, sem="acq_rel", scope="gpu")
            if merged == n_slices - 1:
                store_ml(ws_ml_ptr, o_group, n_rows, b_m, b_l, BLOCK_G)
                tl.debug_barrier()
                groups = tl.atomic_add(counter_ptr + _GROUPS_MERGED * region + o_out, 1, sem="acq_rel", scope="gpu")
                owner_out = groups == n_groups - 1
        if claims:
            k = tl.atomic_add(claimed_ptr, 1, sem="relaxed", scope="gpu")
        else:
            k += 1
    return owner_out


@triton.jit
def finish_split(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    pid,
    slot,
    s,
    hu,
    out_start,
    n_tiles,
    total,
    n_active,
    num_programs,
    n_rows,
    b_acc,
    b_m,
    b_l,
    HQ,
    GROUP: tl.constexpr,
    TQ: tl.constexpr,
    SEQ_TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr,
    NUM_VC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FANIN: tl.constexpr,
    WAVE: tl.constexpr,
    COLS: tl.constexpr,
    LANES: tl.constexpr,
    POLLS: tl.constexpr,
):
    """Publish this program's partial of a split output of head unit hu of schedule sequence s,
    and take its part in the merge tree (docs/design.md, "The merge tree"); whoever merges a
    column slice of the output stores it (``rows.store_output``).

    Level 1: each group of FANIN consecutive contributors (``schedule.merge_group_of``) is merged
    in column slices of COLS, once its last member arrives. That member claims slices until none
    is left; members with no tiles left wait (``await_count``) and claim slices beside it. With
    one group that gives the output; otherwise each group's result goes over its first member's
    slot, and the second level merges the groups' the same way, once every group is merged. Who
    merges a slice never changes its bits: every slice folds the same partials in the same order.
    The last contributor to leave sets the output's counters back to zero for the next launch (or
    CUDA-graph replay). Partials merged in one slice (SHARED false) leave nothing to share: their
    merges are their last arrivers' alone, which zero each count as they complete it.
    """
    store_partial(ws_acc_ptr, ws_ml_ptr, pid * 2 + slot, n_rows, b_acc, b_m, b_l, BLOCK_D, BLOCK_G)
    tl.debug_barrier()  # every thread's stores before the (single-thread) release below
    region = 2 * num_programs
    p_first = program_of_tile(out_start, total, n_active, LANES)
    p_last = program_of_tile(out_start + n_tiles - 1, total, n_active, LANES)
    g_first, g_size, n_groups = merge_group_of(pid - p_first, p_last - p_first + 1, FANIN)
    o_group = _slot_of(p_first + g_first, out_start, total, n_active, LANES)
    o_out = _slot_of(p_first, out_start, total, n_active, LANES)
    # One slice: nothing to share, so nobody waits, and each count is zeroed by its last arriver.
    SHARED: tl.constexpr = BLOCK_D // COLS > 1
    idle = ends_within(pid, out_start, n_tiles, total, n_active, LANES) & SHARED
    arrived = _count_arrival(counter_ptr + _ARRIVED * region + o_group, g_size, not SHARED)
    owner = arrived == g_size - 1
    helps = owner
    if idle & (arrived < g_size - 1):
        helps = await_count(counter_ptr + _ARRIVED * region + o_group, g_size, POLLS)
    # The last contributor has tiles left unless the output ends where its range does; the others
    # have none and wait to take slices of their group's merge. Slices are claimed (an L2 round
    # trip each) unless the group's last arriver has no such member beside it.
    last_busy = not ends_within(p_last, out_start, n_tiles, total, n_active, LANES)
    busy_mate = (p_first + g_first + g_size - 1 == p_last) & (pid != p_last) & last_busy
    claims = ((g_size - 1 - busy_mate.to(tl.int32) > 0) | (arrived < g_size - 1)) & SHARED
    owner_out = arrived < 0
    if helps:
        owner_out = _merge_slices(
            ws_acc_ptr, ws_ml_ptr, counter_ptr, out_ptr, lse_ptr, sinks_ptr,
            counter_ptr + _CLAIMED * region + o_group, claims, p_first + g_first, g_size, 1, n_groups == 1,
            o_group, o_out, n_groups, region, s, hu, out_start, total, n_active, n_rows, HQ,
            GROUP, TQ, SEQ_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC, NUM_VC, HAS_SINKS, WAVE, COLS, LANES,
        )  # fmt: skip
    helps_out = owner_out
    if idle & (n_groups > 1) & (owner_out == 0):
        helps_out = await_count(counter_ptr + _GROUPS_MERGED * region + o_out, n_groups, POLLS)
    if helps_out:
        if not SHARED:
            tl.atomic_xchg(counter_ptr + _GROUPS_MERGED * region + o_out, 0, sem="relaxed", scope="gpu")
        _merge_slices(
            ws_acc_ptr, ws_ml_ptr, counter_ptr, out_ptr, lse_ptr, sinks_ptr,
            counter_ptr + _CLAIMED_OUT * region + o_out, SHARED, p_first, n_groups, FANIN, True,
            o_group, o_out, n_groups, region, s, hu, out_start, total, n_active, n_rows, HQ,
            GROUP, TQ, SEQ_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC, NUM_VC, HAS_SINKS, WAVE, COLS, LANES,
        )  # fmt: skip
    if idle | (owner & SHARED):
        _leave(counter_ptr, 1 + (owner & busy_mate).to(tl.int32), p_first, p_last, n_groups, o_out, region, out_start,
               total, n_active, FANIN, LANES)  # fmt: skip


@triton.jit
def _leave(
    counter_ptr, n_out, p_first, p_last, n_groups, o_out, region, out_start, total, n_active,
    FANIN: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """Count n_out contributors out of the output's merge; the last to leave zeroes the output's
    counters (nobody touches them after leaving). Every contributor leaves once: the idle ones and
    the group mergers themselves, and a last contributor with tiles left that did not merge its
    group (it touches nothing after arriving) through its group's merger, so that it goes on to
    its next tiles without waiting for a count."""
    left = tl.atomic_add(counter_ptr + _LEFT * region + o_out, n_out, sem="acq_rel", scope="gpu")
    if left + n_out == p_last - p_first + 1:
        for g in range(0, n_groups):
            o_g = _slot_of(p_first + g * FANIN, out_start, total, n_active, LANES)
            tl.atomic_xchg(counter_ptr + _ARRIVED * region + o_g, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(counter_ptr + _CLAIMED * region + o_g, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(counter_ptr + _MERGED * region + o_g, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + _GROUPS_MERGED * region + o_out, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + _CLAIMED_OUT * region + o_out, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + _LEFT * region + o_out, 0, sem="relaxed", scope="gpu")
