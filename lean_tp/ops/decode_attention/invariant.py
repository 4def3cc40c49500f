"""The batch-invariant fold of the decode kernel (docs/design.md, "Batch-invariant mode").

In this mode an output's value is one fixed expression over its own keys: the keys are cut into
chunks of TILE_N on the sequence's own grid (the schedule's tiles: chunk c holds keys
[c TILE_N, (c + 1) TILE_N) of the span), each chunk is attended from a fresh state, chunks are
folded left to right within groups of IGROUP chunks (group k holds chunks [k IGROUP, (k + 1) IGROUP)),
and the groups' values are folded left to right into the output. Which program computes what,
and where a program's range starts or ends, changes only where partials wait (registers or the
workspace), never the order or the operands of a fold, so the bits of an output do not depend on
the batch around it.

Workspace slots (``store_partial``'s layout, BLOCK_G rows each):
- ``p * IGROUP + i`` for i < IGROUP - 1: the i-th chunk of program p's range, for the chunks of
  a group that began in an earlier program (at most IGROUP - 2 of them, all at the range's start);
- ``p * IGROUP + IGROUP - 1``: the fold of the chunks program p holds of the group its range ends
  in, when that group began inside the range and goes on past it;
- ``num_programs * IGROUP + (b * HU + hu) * max_groups + k``: group k's value, for an output that
  more than one program holds (an output one program holds is folded in registers).
Counters: a split group's at its first holder p, a split output's at num_programs + its first
holder (a program's range ends in at most one group and one output that go on past it).
"""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.attend import attend_segment
from lean_tp.ops.decode_attention.merge import arrive, load_partial, ref_max, store_partial
from lean_tp.ops.decode_attention.schedule import cdiv, program_of_tile, program_start


@triton.jit
def _empty_state(BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fold's start (acc [BLOCK_G, BLOCK_D], m, l [BLOCK_G]): no key seen. Folding a partial
    into it gives the partial's bits back."""
    return (
        tl.zeros([BLOCK_G, BLOCK_D], tl.float32),
        tl.full([BLOCK_G], float("-inf"), tl.float32),
        tl.zeros([BLOCK_G], tl.float32),
    )


@triton.jit
def _fold_pair(acc1, m1, l1, acc2, m2, l2):
    """Partial 1 followed by partial 2, with explicit fused multiply-adds: the compiler cannot
    contract the two products differently where this is inlined twice (registers, workspace)."""
    m = tl.maximum(m1, m2)
    ref = ref_max(m, True)
    a1 = tl.exp2(m1 - ref)
    a2 = tl.exp2(m2 - ref)
    return tl.fma(acc2, a2[:, None], acc1 * a1[:, None]), m, tl.fma(l2, a2, l1 * a1)


@triton.jit
def _fold_output(
    ws_acc_ptr,
    ws_ml_ptr,
    group_slot0,
    n_groups,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    WAVE: tl.constexpr,
):
    """Fold the values of an output's n_groups groups (slots group_slot0 + k), left to right, WAVE
    at a time: a wave's loads do not wait on its folds, so it waits for L2 about once. Past
    n_groups a load reads nothing and gives the empty state, whose fold leaves every bit as it was
    (``_fold_pair``: its weight is exp2(-inf) = 0, the state's exp2(0) = 1)."""
    acc, m, l = _empty_state(BLOCK_G, BLOCK_D)
    for k0 in range(0, n_groups, WAVE):
        for w in tl.static_range(WAVE):
            rows = tl.where(k0 + w < n_groups, n_rows, 0)
            g_acc, g_m, g_l = load_partial(ws_acc_ptr, ws_ml_ptr, group_slot0 + k0 + w, rows, BLOCK_D, BLOCK_G)
            acc, m, l = _fold_pair(acc, m, l, g_acc, g_m, g_l)
    return acc, m, l


@triton.jit
def _publish_group(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    group_slot0,
    k,
    n_groups,
    out_counter,
    n_rows,
    g_acc,
    g_m,
    g_l,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    WAVE: tl.constexpr,
):
    """Write group k's value of a split output and count it in; the last of the output's groups
    to arrive folds them all. Returns (whether this program did, and the output's state)."""
    store_partial(ws_acc_ptr, ws_ml_ptr, group_slot0 + k, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
    tl.debug_barrier()
    done = arrive(counter_ptr + out_counter, n_groups)
    acc, m, l = _empty_state(BLOCK_G, BLOCK_D)
    if done:
        acc, m, l = _fold_output(ws_acc_ptr, ws_ml_ptr, group_slot0, n_groups, n_rows, BLOCK_D, BLOCK_G, WAVE)
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
            acc, m, l = _fold_pair(acc, m, l, c_acc, c_m, c_l)
    return acc, m, l


@triton.jit
def _finish_group(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    k,
    out_start,
    n_tiles,
    group_slot0,
    out_counter,
    total,
    n_active,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    IGROUP: tl.constexpr,
    WAVE: tl.constexpr,
):
    """Count this program in at group k of a split output, after publishing its chunks of it; the
    last holder to arrive folds the group and publishes its value. Returns ``_publish_group``'s
    result (nothing done when this program was not the last holder)."""
    tl.debug_barrier()
    g0 = out_start + k * IGROUP
    g1 = tl.minimum(g0 + IGROUP, out_start + n_tiles)
    p_first = program_of_tile(g0, total, n_active)
    holders = program_of_tile(g1 - 1, total, n_active) - p_first + 1
    done = False
    acc, m, l = _empty_state(BLOCK_G, BLOCK_D)
    if arrive(counter_ptr + p_first, holders):
        g_acc, g_m, g_l = _fold_group(
            ws_acc_ptr, ws_ml_ptr, g0, g1, total, n_active, n_rows, BLOCK_D, BLOCK_G, IGROUP, WAVE
        )
        done, acc, m, l = _publish_group(
            ws_acc_ptr,
            ws_ml_ptr,
            counter_ptr,
            group_slot0,
            k,
            cdiv(n_tiles, IGROUP),
            out_counter,
            n_rows,
            g_acc,
            g_m,
            g_l,
            BLOCK_D,
            BLOCK_G,
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
    HEAD_DIM_T: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    V_IN_K: tl.constexpr,
    WAVE: tl.constexpr,
):
    """The batch-invariant form of one segment (chunks [tile, tile + seg_n) of an output of
    n_tiles chunks; n_rows real rows): each chunk attended from a fresh state and folded as this
    module's docstring fixes. Returns (whether this program finishes the output, and its state when it does)."""
    whole = (tile == 0) & (seg_n == n_tiles)
    # Chunks [tile, lead_end) finish a group that an earlier program began: published one by one.
    lead_end = tl.minimum(cdiv(tile, IGROUP) * IGROUP, tile + seg_n)
    group_slot0 = num_programs * IGROUP + (tl.cast(b, tl.int64) * HU + hu) * max_groups
    out_counter = num_programs + program_of_tile(out_start, total, n_active)
    done = whole
    o_acc, o_m, o_l = _empty_state(BLOCK_G, BLOCK_D)
    g_acc, g_m, g_l = _empty_state(BLOCK_G, BLOCK_D)
    for c in range(tile, tile + seg_n):
        c_acc, c_m, c_l = attend_segment(
            b_q,
            b_qt,
            k_ptr,
            v_ptr,
            bt_ptr,
            b,
            h_kv,
            n_base,
            c * TILE_N,
            tl.minimum((c + 1) * TILE_N, span),
            b_lo,
            b_hi,
            qk_scale,
            cap_log2,
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
        )
        if HAS_SCALES:
            c_acc = c_acc * v_scale
        if c < lead_end:
            store_partial(ws_acc_ptr, ws_ml_ptr, pid * IGROUP + c - tile, n_rows, c_acc, c_m, c_l, BLOCK_D, BLOCK_G)
        else:
            g_acc, g_m, g_l = _fold_pair(g_acc, g_m, g_l, c_acc, c_m, c_l)
            if ((c + 1) % IGROUP == 0) | (c + 1 == n_tiles):  # group c // IGROUP is complete
                if whole:
                    o_acc, o_m, o_l = _fold_pair(o_acc, o_m, o_l, g_acc, g_m, g_l)
                else:
                    fin, f_acc, f_m, f_l = _publish_group(
                        ws_acc_ptr,
                        ws_ml_ptr,
                        counter_ptr,
                        group_slot0,
                        c // IGROUP,
                        cdiv(n_tiles, IGROUP),
                        out_counter,
                        n_rows,
                        g_acc,
                        g_m,
                        g_l,
                        BLOCK_D,
                        BLOCK_G,
                        WAVE,
                    )
                    done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
                g_acc, g_m, g_l = _empty_state(BLOCK_G, BLOCK_D)
    stop = tile + seg_n
    if lead_end > tile:
        fin, f_acc, f_m, f_l = _finish_group(
            ws_acc_ptr,
            ws_ml_ptr,
            counter_ptr,
            tile // IGROUP,
            out_start,
            n_tiles,
            group_slot0,
            out_counter,
            total,
            n_active,
            n_rows,
            BLOCK_D,
            BLOCK_G,
            IGROUP,
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
            group_slot0,
            out_counter,
            total,
            n_active,
            n_rows,
            BLOCK_D,
            BLOCK_G,
            IGROUP,
            WAVE,
        )
        done, o_acc, o_m, o_l = _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l)
    return done, o_acc, o_m, o_l


@triton.jit
def _take(fin, done, f_acc, f_m, f_l, o_acc, o_m, o_l):
    """The finished output's state (f) where ``fin``, else the one held (o)."""
    return (done | fin, tl.where(fin, f_acc, o_acc), tl.where(fin, f_m, o_m), tl.where(fin, f_l, o_l))
