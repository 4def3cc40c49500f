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
  a group that began in an earlier program (at most IGROUP - 2 of them, all at the range's start);
- ``p * IGROUP + IGROUP - 1``: the fold of the chunks program p holds of the group its range ends
  in, when that group began inside the range and goes on past it;
- from ``num_programs * IGROUP + (b * HU + hu) * out_slots(max_groups)``: the output's group k's
  value at + k, supergroup s's at + max_groups + s (an output of one supergroup that one program
  holds folds its groups in registers).
Counters: a split group's at its first holder p, a split output's at num_programs + its first
holder, a split supergroup's at 2 num_programs + its first holder (a program's range ends in at
most one group, supergroup and output that go on past it). A supergroup or output that one
program holds needs none: its values are known in order, in that program.
"""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.chunks import attend_chunks, empty_state, fold_pair
from lean_tp.ops.decode_attention.merge import arrive, load_partial, store_partial
from lean_tp.ops.decode_attention.schedule import cdiv, program_of_tile, program_start


@triton.jit
def out_slots(max_groups, ISUPER: tl.constexpr):
    """Workspace slots of one output: its groups' values, then its supergroups' (``plan.invariant_slots``)."""
    return max_groups + cdiv(max_groups, ISUPER)


@triton.jit
def _fold_slots(
    ws_acc_ptr, ws_ml_ptr, slot0, n, n_rows, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, WAVE: tl.constexpr
):
    """Fold the values in slots [slot0, slot0 + n), left to right, WAVE at a time: a wave's loads
    do not wait on its folds, so it waits for L2 about once. Past n a load reads nothing and gives
    the empty state, whose fold leaves every bit as it was (``chunks.fold_pair``: its weight is
    exp2(-inf) = 0, the state's exp2(0) = 1)."""
    acc, m, l = empty_state(BLOCK_G, BLOCK_D)
    for k0 in range(0, n, WAVE):
        for w in tl.static_range(WAVE):
            rows = tl.where(k0 + w < n, n_rows, 0)
            g_acc, g_m, g_l = load_partial(ws_acc_ptr, ws_ml_ptr, slot0 + k0 + w, rows, BLOCK_D, BLOCK_G)
            acc, m, l = fold_pair(acc, m, l, g_acc, g_m, g_l)
    return acc, m, l


@triton.jit
def _count_in(counter_ptr, t_first, t_last, n_members, total, n_active, in_order):
    """Whether this program makes the last of n_members values of a fold over tiles [t_first,
    t_last] known: by count at the counter of their first holder, or, when one program holds them
    all (so it makes each known, in order), where ``in_order`` says this one is the last."""
    tl.debug_barrier()  # every thread's stores of the value before the count (``merge.arrive``)
    p_first = program_of_tile(t_first, total, n_active)
    last = in_order
    if p_first != program_of_tile(t_last, total, n_active):
        last = arrive(counter_ptr + p_first, n_members)
    return last


@triton.jit
def _group_known(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    k,
    held,
    g_acc,
    g_m,
    g_l,
    out_start,
    n_tiles,
    slot0,
    max_groups,
    total,
    n_active,
    num_programs,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    IGROUP: tl.constexpr,
    ISUPER: tl.constexpr,
    WAVE: tl.constexpr,
):
    """Group k's value is in its slot (slot0 + k), written by this program (and in g when
    ``held``): the last of its supergroup's groups to be known folds the supergroup, and the last
    supergroup the output. A supergroup of one group is that group's value: nothing to count.
    Returns (whether this program finished the output, and its state when it did)."""
    n_groups = cdiv(n_tiles, IGROUP)
    k0 = k // ISUPER * ISUPER
    k1 = tl.minimum(k0 + ISUPER, n_groups)
    t_end = out_start + tl.minimum(k1 * IGROUP, n_tiles)
    single = k1 - k0 == 1
    s_done = single
    if k1 - k0 > 1:
        s_done = _count_in(
            counter_ptr + 2 * num_programs, out_start + k0 * IGROUP, t_end - 1, k1 - k0, total, n_active, k == k1 - 1
        )
    done = False
    acc, m, l = empty_state(BLOCK_G, BLOCK_D)
    if s_done:
        if single & held:
            acc, m, l = g_acc, g_m, g_l
        else:
            acc, m, l = _fold_slots(ws_acc_ptr, ws_ml_ptr, slot0 + k0, k1 - k0, n_rows, BLOCK_D, BLOCK_G, WAVE)
        n_supers = cdiv(n_groups, ISUPER)
        done = n_supers == 1
        if n_supers > 1:
            s = k // ISUPER
            store_partial(ws_acc_ptr, ws_ml_ptr, slot0 + max_groups + s, n_rows, acc, m, l, BLOCK_D, BLOCK_G)
            done = _count_in(
                counter_ptr + num_programs,
                out_start,
                out_start + n_tiles - 1,
                n_supers,
                total,
                n_active,
                s == n_supers - 1,
            )
            if done:
                acc, m, l = _fold_slots(
                    ws_acc_ptr, ws_ml_ptr, slot0 + max_groups, n_supers, n_rows, BLOCK_D, BLOCK_G, WAVE
                )
    return done, acc, m, l


@triton.jit
def _fold_group(
    ws_acc_ptr,
    ws_ml_ptr,
    g0,
    g1,
    total,
    n_active,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    IGROUP: tl.constexpr,
    WAVE: tl.constexpr,
):
    """Value of the group of chunks [g0, g1) (linear tile indices) that several programs hold: the
    first holder's fold of its chunks, then each later chunk from its holder's slot, in order."""
    p = program_of_tile(g0, total, n_active)
    acc, m, l = load_partial(ws_acc_ptr, ws_ml_ptr, p * IGROUP + IGROUP - 1, n_rows, BLOCK_D, BLOCK_G)
    for t0 in range(program_start(p + 1, total, n_active), g1, WAVE):
        for w in tl.static_range(WAVE):  # a wave of chunks, as in _fold_output
            t = t0 + w
            holder = program_of_tile(t, total, n_active)
            o_slot = holder * IGROUP + t - program_start(holder, total, n_active)
            rows = tl.where(t < g1, n_rows, 0)
            c_acc, c_m, c_l = load_partial(ws_acc_ptr, ws_ml_ptr, o_slot, rows, BLOCK_D, BLOCK_G)
            acc, m, l = fold_pair(acc, m, l, c_acc, c_m, c_l)
    return acc, m, l


@triton.jit
def _finish_group(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    k,
    out_start,
    n_tiles,
    slot0,
    max_groups,
    total,
    n_active,
    num_programs,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    IGROUP: tl.constexpr,
    ISUPER: tl.constexpr,
    WAVE: tl.constexpr,
):
    """Count this program in at group k of a split output, after publishing its chunks of it; the
    last holder to arrive folds the group and makes its value known (``_group_known``). Returns
    (whether this program finished the output, and its state when it did)."""
    g0 = out_start + k * IGROUP
    g1 = tl.minimum(g0 + IGROUP, out_start + n_tiles)
    p_first = program_of_tile(g0, total, n_active)
    done = False
    acc, m, l = empty_state(BLOCK_G, BLOCK_D)
    if _count_in(
        counter_ptr, g0, g1 - 1, program_of_tile(g1 - 1, total, n_active) - p_first + 1, total, n_active, False
    ):
        g_acc, g_m, g_l = _fold_group(
            ws_acc_ptr, ws_ml_ptr, g0, g1, total, n_active, n_rows, BLOCK_D, BLOCK_G, IGROUP, WAVE
        )
        store_partial(ws_acc_ptr, ws_ml_ptr, slot0 + k, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
        done, acc, m, l = _group_known(
            ws_acc_ptr,
            ws_ml_ptr,
            counter_ptr,
            k,
            True,
            g_acc,
            g_m,
            g_l,
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
        )
    return done, acc, m, l


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
    WAVE: tl.constexpr,
):
    """The batch-invariant form of one segment (chunks [tile, tile + seg_n) of an output of
    n_tiles chunks; n_rows real rows): each chunk attended from a fresh state and folded as this
    module's docstring fixes. Returns (whether this program finishes the output, and its state when it does)."""
    # An output of one supergroup that this program holds whole folds its groups in registers.
    in_registers = (tile == 0) & (seg_n == n_tiles) & (n_tiles <= IGROUP * ISUPER)
    stop = tile + seg_n
    # Chunks [tile, lead_end) finish a group that an earlier program began: published one by one.
    lead_end = tl.minimum(cdiv(tile, IGROUP) * IGROUP, stop)
    # int32: the slots number fewer than the batch's tiles (``plan.check_tile_count``).
    slot0 = num_programs * IGROUP + (b * HU + hu) * out_slots(max_groups, ISUPER)
    o_acc, o_m, o_l, g_acc, g_m, g_l, bad = attend_chunks(
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
        in_registers,
        n_rows,
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
        HAS_SCALES,
    )
    # The groups that began and ended in the range: their values are in their slots (or in o).
    k_lo = cdiv(lead_end, IGROUP)
    k_hi = tl.where(stop == n_tiles, cdiv(n_tiles, IGROUP), stop // IGROUP)
    if bad:  # poison every value the range wrote or holds (``attend_segment``)
        o_acc, o_l, g_acc, g_l = _nan_like(o_acc, o_l, g_acc, g_l)
        for i in range(0, lead_end - tile):
            store_partial(ws_acc_ptr, ws_ml_ptr, pid * IGROUP + i, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
        for k in range(k_lo, k_hi):
            store_partial(ws_acc_ptr, ws_ml_ptr, slot0 + k, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
    done = in_registers
    if ~in_registers:
        for k in range(k_lo, k_hi):
            fin, f_acc, f_m, f_l = _group_known(
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
            )
            done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
    if lead_end > tile:
        fin, f_acc, f_m, f_l = _finish_group(
            ws_acc_ptr,
            ws_ml_ptr,
            counter_ptr,
            tile // IGROUP,
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
        )
        done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
    if (stop % IGROUP != 0) & (stop < n_tiles) & (stop // IGROUP * IGROUP >= lead_end):
        # The range ends inside a group it began: publish the fold of its chunks of it.
        store_partial(ws_acc_ptr, ws_ml_ptr, pid * IGROUP + IGROUP - 1, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
        fin, f_acc, f_m, f_l = _finish_group(
            ws_acc_ptr,
            ws_ml_ptr,
            counter_ptr,
            stop // IGROUP,
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
        )
        done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
    return done, o_acc, o_m, o_l


@triton.jit
def _nan_like(o_acc, o_l, g_acc, g_l):
    """NaN in place of the accs and ls: a state that poisons every fold it enters."""
    nan = float("nan")
    return (
        tl.full(o_acc.shape, nan, tl.float32),
        tl.full(o_l.shape, nan, tl.float32),
        tl.full(g_acc.shape, nan, tl.float32),
        tl.full(g_l.shape, nan, tl.float32),
    )


@triton.jit
def _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l):
    """The finished output's state (f) where ``fin``, else the one held (o)."""
    return (done | fin, tl.where(fin, f_acc, o_acc), tl.where(fin, f_m, o_m), tl.where(fin, f_l, o_l))
