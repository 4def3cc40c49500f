"""The merge tree of a split output, inside the decode kernel (docs/design.md, "The merge tree"):
each contributor publishes its partial to the workspace; the last arriver of a group merges the
group's partials, and the last group merger merges the groups'. Partials are un-normalized
(acc, m, l) in the log2 domain, as ``attend.attend_segment`` leaves them."""

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
def load_partial(ws_acc_ptr, ws_ml_ptr, o_slot, n_rows, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """Rows [0, n_rows) of workspace slot o_slot, as ``store_partial`` wrote them (the empty state
    past them). ``.cg``: other SMs wrote them."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
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
        p = first + (i0 + o_w) * stride
        o_slot = p * 2 + (program_start(p, total, n_active, LANES) < out_start).to(tl.int32)  # < 2**31: grid-sized
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
def arrive(counter_ptr, n_members):
    """Count this program in at a merge (a group or an output) of n_members; True for the last
    arriver, which also leaves the counter at zero for the next launch (or CUDA-graph replay).

    The caller's barrier makes every thread's partial stores happen before the (single-thread)
    release; the acq_rel atomic orders the last arriver's later loads after all members' releases.
    """
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = arrived == n_members - 1
    if is_last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return is_last


@triton.jit
def _store_cols(ws_acc_ptr, o_slot, n_rows, acc, c0, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """Write columns [c0, c0 + COLS) of rows [0, n_rows) of a partial's acc (acc [BLOCK_G, COLS])
    to workspace slot o_slot (``store_partial`` writes all of them, and m and l)."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = c0 + tl.arange(0, acc.shape[1])
    p = ws_acc_ptr + (tl.cast(o_slot, tl.int64) * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :]
    tl.store(p, acc, mask=(o_g < n_rows)[:, None])


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
):
    """Publish this program's partial of a split output of head unit hu of schedule sequence s,
    and take its part in the merge tree; the program that merges the output last stores it
    (``rows.store_output``).

    Level 1: the last arriver of each group of FANIN consecutive contributors merges the group
    (``schedule.merge_group_of``). With one group that is the output's merge; otherwise it writes the
    group's partial over its first member's slot, and the last group merger merges the groups'
    partials (from their first members' slots). Counters: a group's at 2 * (first member) + its
    slot, an output's second level at 2 * num_programs + 2 * (first contributor) + its slot.

    Each merge runs over column slices of COLS (BLOCK_D, or less for partials wider than the
    tuning entry's merge wave): the merger's own partial is in the workspace by then, so no
    [BLOCK_G, BLOCK_D] state is held across the merge (64-row MLA blocks: its registers would
    spill in the K/V loop). Slice c of a group's partial is written after every member's slice c
    was read; m and l, read by every slice, after the last.
    """
    store_partial(ws_acc_ptr, ws_ml_ptr, pid * 2 + slot, n_rows, b_acc, b_m, b_l, BLOCK_D, BLOCK_G)
    tl.debug_barrier()
    p_first = program_of_tile(out_start, total, n_active, LANES)
    n_contrib = program_of_tile(out_start + n_tiles - 1, total, n_active, LANES) - p_first + 1
    g_first, g_size, n_groups = merge_group_of(pid - p_first, n_contrib, FANIN)
    first, members, stride = p_first + g_first, g_size, 1
    o_counter = first * 2 + (program_start(first, total, n_active, LANES) < out_start).to(tl.int32)
    go = arrive(counter_ptr + o_counter, members)
    # One merge per level, in a loop: one copy of the merge in the code.
    while go:
        last = (stride != 1) | (n_groups == 1)  # this merge gives the output
        for c0 in range(0, BLOCK_D, COLS):
            acc, b_m, b_l = _merge_partials(
                ws_acc_ptr,
                ws_ml_ptr,
                first,
                members,
                stride,
                out_start,
                total,
                n_active,
                n_rows,
                c0,
                BLOCK_D,
                BLOCK_G,
                COLS,
                WAVE,
                LANES,
            )
            if last:
                store_output(
                    out_ptr,
                    lse_ptr,
                    sinks_ptr,
                    s,
                    hu,
                    acc,
                    b_m,
                    b_l,
                    unit_cols(hu, NUM_VC, BLOCK_D) + c0,
                    HQ,
                    GROUP,
                    TQ,
                    SEQ_TOKENS,
                    HEAD_DIM,
                    COLS,
                    BLOCK_G,
                    NUM_GC,
                    NUM_VC,
                    HAS_SINKS,
                )
            else:
                _store_cols(ws_acc_ptr, o_counter, n_rows, acc, c0, BLOCK_D, BLOCK_G)
        go = (stride == 1) & (n_groups > 1)
        if go:
            tl.debug_barrier()
            o_g = tl.arange(0, BLOCK_G)
            o_ml = tl.cast(o_counter, tl.int64) * 2 * BLOCK_G + o_g
            tl.store(ws_ml_ptr + o_ml, b_m, mask=o_g < n_rows)
            tl.store(ws_ml_ptr + o_ml + BLOCK_G, b_l, mask=o_g < n_rows)
            tl.debug_barrier()
            first, members, stride = p_first, n_groups, FANIN
            o_counter = (
                2 * num_programs + first * 2 + (program_start(first, total, n_active, LANES) < out_start).to(tl.int32)
            )
            go = arrive(counter_ptr + o_counter, members)
