"""The batch-invariant mode's folds across programs (invariant.py defines the fold): a split
group's chunks, a supergroup's groups and an output's supergroups, each folded left to right from
the workspace by the last program to make a member known."""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.chunks import empty_state, fold_pair
from lean_tp.ops.decode_attention.merge import arrive, load_partial, store_partial
from lean_tp.ops.decode_attention.schedule import cdiv, program_of_tile, program_start


@triton.jit
def out_slots(max_groups, ISUPER: tl.constexpr):
    """Workspace slots of one output: its groups' values, then its supergroups' (``plan.invariant_slots``)."""
    return max_groups + cdiv(max_groups, ISUPER)


@triton.jit
def fold_slots(
    ws_acc_ptr,
    ws_ml_ptr,
    slot0,
    n,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    WAVE: tl.constexpr,
    MOST: tl.constexpr,
):
    """Fold the values in slots [slot0, slot0 + n), left to right, WAVE at a time: a wave's loads
    do not wait on its folds, so it waits for L2 about once. Past n a load reads nothing and gives
    the empty state, whose fold leaves every bit as it was (``chunks.fold_pair``: its weight is
    exp2(-inf) = 0, the state's exp2(0) = 1). MOST: the most values the call can have (WAVE where
    there is no bound); a wave is no wider, the same single wait with fewer loads for the kernel
    to hold (each inlined fold's loads add to its compile time, which grows faster than they do)."""
    W: tl.constexpr = WAVE if WAVE < MOST else MOST
    acc, m, l = empty_state(BLOCK_G, BLOCK_D)
    for k0 in range(0, n, W):
        for w in tl.static_range(W):
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
    p_first = program_of_tile(t_first, total, n_active, 1)
    last = in_order
    if p_first != program_of_tile(t_last, total, n_active, 1):
        last = arrive(counter_ptr + p_first, n_members)
    return last


@triton.jit
def group_known(
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
            acc, m, l = fold_slots(ws_acc_ptr, ws_ml_ptr, slot0 + k0, k1 - k0, n_rows, BLOCK_D, BLOCK_G, WAVE, ISUPER)
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
                acc, m, l = fold_slots(
                    ws_acc_ptr, ws_ml_ptr, slot0 + max_groups, n_supers, n_rows, BLOCK_D, BLOCK_G, WAVE, WAVE
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
    p = program_of_tile(g0, total, n_active, 1)
    acc, m, l = load_partial(ws_acc_ptr, ws_ml_ptr, p * IGROUP + IGROUP - 1, n_rows, BLOCK_D, BLOCK_G)
    for t0 in range(program_start(p + 1, total, n_active, 1), g1, WAVE):
        for w in tl.static_range(WAVE):  # a wave of chunks, as in fold_slots
            t = t0 + w
            holder = program_of_tile(t, total, n_active, 1)
            o_slot = holder * IGROUP + t - program_start(holder, total, n_active, 1)
            rows = tl.where(t < g1, n_rows, 0)
            c_acc, c_m, c_l = load_partial(ws_acc_ptr, ws_ml_ptr, o_slot, rows, BLOCK_D, BLOCK_G)
            acc, m, l = fold_pair(acc, m, l, c_acc, c_m, c_l)
    return acc, m, l


@triton.jit
def finish_group(
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
    last holder to arrive folds the group and makes its value known (``group_known``). Returns
    (whether this program finished the output, and its state when it did)."""
    g0 = out_start + k * IGROUP
    g1 = tl.minimum(g0 + IGROUP, out_start + n_tiles)
    p_first = program_of_tile(g0, total, n_active, 1)
    done = False
    acc, m, l = empty_state(BLOCK_G, BLOCK_D)
    if _count_in(
        counter_ptr, g0, g1 - 1, program_of_tile(g1 - 1, total, n_active, 1) - p_first + 1, total, n_active, False
    ):
        g_acc, g_m, g_l = _fold_group(
            ws_acc_ptr, ws_ml_ptr, g0, g1, total, n_active, n_rows, BLOCK_D, BLOCK_G, IGROUP, WAVE
        )
        store_partial(ws_acc_ptr, ws_ml_ptr, slot0 + k, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
        done, acc, m, l = group_known(
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
