"""The batch-invariant fold of the decode kernel (docs/design.md, "Batch-invariant mode").

In this mode an output's value is one fixed expression over its own keys: the keys are cut into
chunks of TILE_N on the sequence's own grid (the schedule's tiles: chunk c holds keys
[c TILE_N, (c + 1) TILE_N) of the span), each chunk is attended from a fresh state, and three
levels of left-to-right folds follow: chunks within groups of IGROUP (group k holds chunks
[k IGROUP, (k + 1) IGROUP)), groups' values within supergroups of ISUPER (supergroup s holds
groups [s ISUPER, (s + 1) ISUPER)), and supergroups' values into the output. An output of one
supergroup is its value (folding a value into the empty state gives its bits back). Which program
computes what, and where a program's range starts or ends, changes only where partials wait
(registers or the workspace), never the order or the operands of a fold, so the bits of an output
do not depend on the batch around it.

Workspace slots (``store_partial``'s layout, BLOCK_G rows each):
- ``p * IGROUP + i`` for i < IGROUP - 1: the i-th chunk of program p's range, for the chunks of
  a group that began in an earlier program (at most IGROUP - 1 of them, all at the range's start);
- ``p * IGROUP + IGROUP - 1``: the fold of the chunks program p holds of the group its range ends
  in, when that group began inside the range and goes on past it;
- from ``num_programs * IGROUP + (s * HU + hu) * out_slots(max_groups)`` (s the schedule's
  sequence, schedule.py): the output's group k's value at + k, supergroup s's at + max_groups + s
  (an output of one supergroup that one program holds keeps its last group in registers, and
  that program folds the others from their slots).
Where the plan folds in column slices (SLICE_WAVE), a group held by INVARIANT_SLICE_HOLDERS
programs or more, a supergroup of several groups held by INVARIANT_SUPER_SLICE_HOLDERS or more and
an output of several supergroups are folded in column slices that their holders with no tiles
left share (``folds.finish_group``, ``output_fold.finish_super``, ``output_fold.finish_output``).
Counters (``folds``' regions of num_programs each), at a fold's first holder p (a program's range
ends in at most one group, supergroup and output that go on past it): a split group's arrivals,
claimed slices and folded slices; a split supergroup's the same; a split output's known
supergroups, claimed slices and contributors gone. A supergroup or output that one program holds
needs none: its values are known in order, in that program. In a sliced kernel every contributor
of a split output counts itself out, and the last zeroes the output's counters and its groups'
and supergroups' (``output_fold._zero_counters``); elsewhere each count is zeroed by its last
arriver.
"""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.chunks import attend_chunks, empty_state, fold_pair
from lean_tp.ops.decode_attention.folds import finish_group, fold_slots, group_known, out_slot0
from lean_tp.ops.decode_attention.merge import store_partial
from lean_tp.ops.decode_attention.schedule import cdiv


@triton.jit
def attend_invariant(
    b_q,
    b_qt,
    k_ptr,
    v_ptr,
    bt_ptr,
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    s,
    b,
    hu,
    h_kv,
    n_base,
    span,
    b_lo,
    b_hi,
    qk_scale,
    cap_log2,
    v_scale,
    pid,
    tile,
    seg_n,
    n_tiles,
    out_start,
    total,
    n_active,
    num_programs,
    max_groups,
    HU,
    n_rows,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_bt,
    num_pages,
    TQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    E4M3_BITS: tl.constexpr,
    BLOCK_IN_PAGE: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    IGROUP: tl.constexpr,
    ISUPER: tl.constexpr,
    HEAD_DIM_T: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    V_IN_K: tl.constexpr,
    SCORES_T: tl.constexpr,
    WAVE: tl.constexpr,
    COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
    POLLS: tl.constexpr,
):
    """The batch-invariant form of one segment (chunks [tile, tile + seg_n) of the output of head
    unit hu of schedule sequence s, whose keys are in the cache's sequence b; n_tiles chunks; n_rows
    real rows): each chunk attended from a fresh state and folded as this module's docstring fixes;
    where SLICE_WAVE is set, a split group's chunks, a split supergroup's groups and an output's
    supergroups are folded in column slices of COLS (``folds.finish_group``,
    ``output_fold.finish_output``). Returns (whether this program finishes the output, whether it
    owns the output's sliced fold, whether it owns the sliced fold of the supergroup of chunk tile,
    of chunk stop - 1, and the output's state when it finishes it)."""
    # An output of one supergroup that this program holds whole is folded by it, with no count;
    # wide row blocks' (IGROUP 1) are folded in column slices from the workspace (``group_known``).
    whole = (tile == 0) & (seg_n == n_tiles) & (n_tiles <= IGROUP * ISUPER)
    if IGROUP == 1:
        whole = False
    stop = tile + seg_n
    # Chunks [tile, lead_end) finish a group that an earlier program began: published one by one.
    lead_end = tl.minimum(cdiv(tile, IGROUP) * IGROUP, stop)
    slot0 = out_slot0(s, hu, HU, num_programs, max_groups, IGROUP, ISUPER)
    g_acc, g_m, g_l, bad = attend_chunks(
        b_q,
        b_qt,
        k_ptr,
        v_ptr,
        bt_ptr,
        ws_acc_ptr,
        ws_ml_ptr,
        pid * IGROUP,
        slot0,
        lead_end,
        whole,
        b,
        h_kv,
        n_base,
        tile * TILE_N,
        tl.minimum(stop * TILE_N, span),
        span,
        b_lo,
        b_hi,
        qk_scale,
        cap_log2,
        v_scale,
        stride_kb,
        stride_kn,
        stride_kh,
        stride_vb,
        stride_vn,
        stride_vh,
        stride_bt,
        num_pages,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_G,
        BLOCK_N,
        TILE_N,
        IGROUP,
        PAGED,
        PAGE_SIZE,
        DOT_PRECISION,
        TQ > 1,
        SOFTCAP,
        E4M3_BITS,
        BLOCK_IN_PAGE,
        HEAD_DIM_T,
        BLOCK_DT,
        V_IN_K,
        SCORES_T,
        HAS_SCALES,
    )
    # The groups that began and ended in the range: their values are in their slots (the output's
    # last in g when the range holds the whole output).
    k_lo = cdiv(lead_end, IGROUP)
    k_hi = tl.where(stop == n_tiles, cdiv(n_tiles, IGROUP), stop // IGROUP)
    if bad:  # poison every value the range wrote or holds (``attend_segment``)
        g_acc = tl.full(g_acc.shape, float("nan"), tl.float32)
        g_l = tl.full(g_l.shape, float("nan"), tl.float32)
        for i in range(0, lead_end - tile):
            store_partial(ws_acc_ptr, ws_ml_ptr, pid * IGROUP + i, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
        for k in range(k_lo, k_hi):
            store_partial(ws_acc_ptr, ws_ml_ptr, slot0 + k, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
    o_acc, o_m, o_l = empty_state(BLOCK_G, BLOCK_D)
    done = whole
    owner = tile < 0
    own_lead = owner  # owns the sliced fold of the supergroup of chunk tile, of chunk stop - 1
    own_end = owner
    if whole:
        tl.debug_barrier()  # the group values this program's threads stored, before its loads of them
        # The output is one supergroup: fewer than ISUPER groups' values in slots.
        o_acc, o_m, o_l = fold_slots(
            ws_acc_ptr, ws_ml_ptr, slot0, k_hi - 1, n_rows, 0, BLOCK_D, BLOCK_G, BLOCK_D, WAVE, ISUPER
        )
        o_acc, o_m, o_l = fold_pair(o_acc, o_m, o_l, g_acc, g_m, g_l)
    else:
        for k in range(k_lo, k_hi):
            fin, f_owner, s_owner, f_acc, f_m, f_l = group_known(
                ws_acc_ptr,
                ws_ml_ptr,
                counter_ptr,
                k,
                False,
                o_acc,
                o_m,
                o_l,
                out_start,
                n_tiles,
                slot0,
                max_groups,
                total,
                n_active,
                num_programs,
                n_rows,
                BLOCK_D,
                BLOCK_G,
                IGROUP,
                ISUPER,
                WAVE,
                COLS,
                SLICE_WAVE,
            )
            done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
            owner = owner | f_owner
            own_lead, own_end = _owns(own_lead, own_end, s_owner, k, tile, stop, IGROUP, ISUPER)
    if IGROUP > 1:  # groups split over programs (a group of one chunk never is)
        if lead_end > tile:
            fin, f_owner, s_owner, f_acc, f_m, f_l = finish_group(
                ws_acc_ptr, ws_ml_ptr, counter_ptr, pid, tile // IGROUP, out_start, n_tiles, slot0, max_groups, total,
                n_active, num_programs, n_rows, BLOCK_D, BLOCK_G, IGROUP, ISUPER, WAVE, COLS, SLICE_WAVE, POLLS,
            )  # fmt: skip
            done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
            owner = owner | f_owner
            own_lead, own_end = _owns(own_lead, own_end, s_owner, tile // IGROUP, tile, stop, IGROUP, ISUPER)
        if (stop % IGROUP != 0) & (stop < n_tiles) & (stop // IGROUP * IGROUP >= lead_end):
            # The range ends inside a group it began: publish the fold of its chunks of it.
            store_partial(ws_acc_ptr, ws_ml_ptr, pid * IGROUP + IGROUP - 1, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
            fin, f_owner, s_owner, f_acc, f_m, f_l = finish_group(
                ws_acc_ptr, ws_ml_ptr, counter_ptr, pid, stop // IGROUP, out_start, n_tiles, slot0, max_groups, total,
                n_active, num_programs, n_rows, BLOCK_D, BLOCK_G, IGROUP, ISUPER, WAVE, COLS, SLICE_WAVE, POLLS,
            )  # fmt: skip
            done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
            owner = owner | f_owner
            own_lead, own_end = _owns(own_lead, own_end, s_owner, stop // IGROUP, tile, stop, IGROUP, ISUPER)
    return done, owner, own_lead, own_end, o_acc, o_m, o_l


@triton.jit
def _owns(own_lead, own_end, s_owner, k, tile, stop, IGROUP: tl.constexpr, ISUPER: tl.constexpr):
    """Which sliced supergroup folds a segment of chunks [tile, stop) owns, once it may own group
    k's (``s_owner``): its first chunk's supergroup's, its last chunk's."""
    sg = k // ISUPER
    return own_lead | (s_owner & (sg == tile // IGROUP // ISUPER)), own_end | (
        s_owner & (sg == (stop - 1) // IGROUP // ISUPER)
    )


@triton.jit
def _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l):
    """The finished output's state (f) where ``fin``, else the one held (o)."""
    return (done | fin, tl.where(fin, f_acc, o_acc), tl.where(fin, f_m, o_m), tl.where(fin, f_l, o_l))
