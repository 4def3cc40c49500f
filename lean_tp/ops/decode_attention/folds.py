"""The batch-invariant mode's folds across programs (invariant.py defines the fold): a split
group's chunks, a supergroup's groups and an output's supergroups, each folded left to right from
the workspace by the last program to make a member known; where the plan says so (SLICE_WAVE), a
group's chunks (``finish_group``), a split supergroup's groups (``output_fold.finish_super``) and
an output's supergroups (``output_fold.finish_output``) in column slices that the holders with no
tiles left share."""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.chunks import empty_state, fold_pair
from lean_tp.ops.decode_attention.merge import arrive, load_partial, store_cols, store_ml, store_partial
from lean_tp.ops.decode_attention.schedule import cdiv, program_of_tile, program_start
from lean_tp.ops.decode_attention.slices import slice_stored, takes_part
from lean_tp.ops.decode_attention.tuning import INVARIANT_SLICE_HOLDERS, INVARIANT_SUPER_SLICE_HOLDERS

# The counters' regions (num_programs each, invariant.py), indexed by a fold's first holder: a
# split group's arrivals, claimed column slices and slices folded; a split supergroup's arrivals,
# claimed column slices and slices folded; a split output's supergroups known, claimed column
# slices and contributors gone (``launch_args.counters_size`` allocates them).
GROUP_ARRIVED = tl.constexpr(0)
OUT_KNOWN = tl.constexpr(1)
SUPER_ARRIVED = tl.constexpr(2)
OUT_CLAIMED = tl.constexpr(3)
OUT_LEFT = tl.constexpr(4)
GROUP_CLAIMED = tl.constexpr(5)
GROUP_MERGED = tl.constexpr(6)
SUPER_CLAIMED = tl.constexpr(7)
SUPER_MERGED = tl.constexpr(8)
INVARIANT_REGIONS = 9
_SLICE_HOLDERS = tl.constexpr(INVARIANT_SLICE_HOLDERS)
_SUPER_SLICE_HOLDERS = tl.constexpr(INVARIANT_SUPER_SLICE_HOLDERS)


@triton.jit
def out_slots(max_groups, ISUPER: tl.constexpr):
    """Workspace slots of one output: its groups' values, then its supergroups' (``plan.invariant_slots``)."""
    return max_groups + cdiv(max_groups, ISUPER)


@triton.jit
def out_slot0(s, hu, HU, num_programs, max_groups, IGROUP: tl.constexpr, ISUPER: tl.constexpr):
    """Workspace slot of group 0's value of head unit hu of schedule sequence s (invariant.py's layout).
    int32: the slots number fewer than the batch's tiles (``plan.check_tile_count``)."""
    return num_programs * IGROUP + (s * HU + hu) * out_slots(max_groups, ISUPER)


@triton.jit
def fold_slots(
    ws_acc_ptr,
    ws_ml_ptr,
    slot0,
    n,
    n_rows,
    c0,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
    WAVE: tl.constexpr,
    MOST: tl.constexpr,
):
    """Fold columns [c0, c0 + COLS) of the values in slots [slot0, slot0 + n), left to right, WAVE
    at a time: a wave's loads do not wait on its folds, so it waits for L2 about once. Every column
    folds as it does in a whole fold (``chunks.fold_pair`` is by row and column). Past n a load
    reads nothing and gives the empty state, whose fold leaves every bit as it was (its weight is
    exp2(-inf) = 0, the state's exp2(0) = 1). MOST: the most values the call can have (WAVE where
    there is no bound); a wave is no wider, the same single wait with fewer loads for the kernel
    to hold (each inlined fold's loads add to its compile time, which grows faster than they do)."""
    W: tl.constexpr = WAVE if WAVE < MOST else MOST
    acc, m, l = empty_state(BLOCK_G, COLS)
    for k0 in range(0, n, W):
        for w in tl.static_range(W):
            rows = tl.where(k0 + w < n, n_rows, 0)
            g_acc, g_m, g_l = load_partial(ws_acc_ptr, ws_ml_ptr, slot0 + k0 + w, rows, c0, BLOCK_D, BLOCK_G, COLS)
            acc, m, l = fold_pair(acc, m, l, g_acc, g_m, g_l)
    return acc, m, l


@triton.jit
def _fold_in_slices(
    ws_acc_ptr,
    ws_ml_ptr,
    slot0,
    n,
    o_slot,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
    MOST: tl.constexpr,
):
    """The fold of the values in slots [slot0, slot0 + n) into slot o_slot, by this program, column
    slice by column slice (``fold_slots``: each column folds as in a whole fold)."""
    acc, m, l = empty_state(BLOCK_G, COLS)
    for c0 in range(0, BLOCK_D, COLS):
        acc, m, l = fold_slots(ws_acc_ptr, ws_ml_ptr, slot0, n, n_rows, c0, BLOCK_D, BLOCK_G, COLS, SLICE_WAVE, MOST)
        store_cols(ws_acc_ptr, o_slot, n_rows, acc, c0, BLOCK_D, BLOCK_G)
    store_ml(ws_ml_ptr, o_slot, n_rows, m, l, BLOCK_G)


@triton.jit
def count_in(counter_ptr, t_first, t_last, n_members, total, n_active, in_order, RESET: tl.constexpr):
    """Whether this program makes the last of n_members values of a fold over tiles [t_first,
    t_last] known: by count at the counter of their first holder (``merge.arrive``: RESET zeroes
    it there), or, when one program holds them all (so it makes each known, in order), where
    ``in_order`` says this one is the last."""
    tl.debug_barrier()  # every thread's stores of the value before the count (``merge.arrive``)
    p_first = program_of_tile(t_first, total, n_active, 1)
    last = in_order
    if p_first != program_of_tile(t_last, total, n_active, 1):
        last = arrive(counter_ptr + p_first, n_members, RESET)
    return last


@triton.jit
def supers_of(n_tiles, IGROUP: tl.constexpr, ISUPER: tl.constexpr):
    """Supergroups of an output of n_tiles chunks."""
    return cdiv(cdiv(n_tiles, IGROUP), ISUPER)


@triton.jit
def super_span(out_start, n_tiles, sg, IGROUP: tl.constexpr, ISUPER: tl.constexpr):
    """Supergroup sg of the output of tiles [out_start, out_start + n_tiles): its tiles [t0, t1)
    and groups [k0, k1)."""
    k0 = sg * ISUPER
    k1 = tl.minimum(k0 + ISUPER, cdiv(n_tiles, IGROUP))
    return out_start + k0 * IGROUP, out_start + tl.minimum(k1 * IGROUP, n_tiles), k0, k1


@triton.jit
def super_in_slices(t0, t1, k0, k1, total, n_active):
    """Whether, where the kernel folds in column slices, the supergroup of tiles [t0, t1) and groups
    [k0, k1) is folded in slices (``output_fold.finish_super``): it has several groups and
    INVARIANT_SUPER_SLICE_HOLDERS holders or more (tuning.py)."""
    holders = program_of_tile(t1 - 1, total, n_active, 1) - program_of_tile(t0, total, n_active, 1) + 1
    return (k1 - k0 > 1) & (holders >= _SUPER_SLICE_HOLDERS)


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
    COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
):
    """Group k's value is in its slot (slot0 + k), written by this program (and in g when
    ``held``): the last of its supergroup's groups to be known folds the supergroup, or, where the
    supergroup is folded in column slices (SLICE_WAVE and ``super_in_slices``), owns that fold
    (``output_fold.finish_super``). A supergroup of one group is that group's value: nothing to
    count. An output of one supergroup is its value; of several, each is stored and counted in, and
    the last to be known folds the output, or, where the output is folded in column slices
    (SLICE_WAVE), owns that fold (``output_fold.finish_output``, whose last leaver zeroes the
    counts). Wide row blocks (IGROUP 1) fold a supergroup into its slot in column slices of COLS,
    and own the output's fold for any number of supergroups: a 64 x 512 value folded whole takes
    two such states in registers, which ptxas makes room for by reloading values held across the
    K/V loop there. Returns (whether this program finished the output, whether it owns the
    output's sliced fold, whether it owns the supergroup's, and the output's state when it
    finished it)."""
    SLICED: tl.constexpr = SLICE_WAVE > 0
    sg = k // ISUPER
    t0, t_end, k0, k1 = super_span(out_start, n_tiles, sg, IGROUP, ISUPER)
    single = k1 - k0 == 1
    s_done = single
    if k1 - k0 > 1:
        s_done = count_in(
            counter_ptr + SUPER_ARRIVED * num_programs, t0, t_end - 1, k1 - k0, total, n_active, k == k1 - 1,
            not SLICED,
        )  # fmt: skip
    s_owner = False
    if SLICED:
        s_owner = s_done & super_in_slices(t0, t_end, k0, k1, total, n_active)
    done = False
    owner = False
    acc, m, l = empty_state(BLOCK_G, BLOCK_D)
    if s_done & (s_owner == 0):
        if IGROUP == 1:
            _fold_in_slices(
                ws_acc_ptr, ws_ml_ptr, slot0 + k0, k1 - k0, slot0 + max_groups + sg, n_rows, BLOCK_D, BLOCK_G, COLS,
                SLICE_WAVE, ISUPER,
            )  # fmt: skip
            owner = super_counted(
                counter_ptr, sg, out_start, n_tiles, total, n_active, num_programs, IGROUP, ISUPER, True
            )
        else:
            done, owner, acc, m, l = _fold_super(
                ws_acc_ptr, ws_ml_ptr, counter_ptr, sg, k0, k1, single & held, g_acc, g_m, g_l, out_start, n_tiles,
                slot0, max_groups, total, n_active, num_programs, n_rows, BLOCK_D, BLOCK_G, IGROUP, ISUPER, WAVE,
                SLICED,
            )  # fmt: skip
    return done, owner, s_owner, acc, m, l


@triton.jit
def _fold_super(
    ws_acc_ptr, ws_ml_ptr, counter_ptr, sg, k0, k1, held, g_acc, g_m, g_l, out_start, n_tiles, slot0, max_groups,
    total, n_active, num_programs, n_rows, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, IGROUP: tl.constexpr,
    ISUPER: tl.constexpr, WAVE: tl.constexpr, SLICED: tl.constexpr,
):  # fmt: skip
    """``group_known``'s fold of supergroup sg (groups [k0, k1)) whole: its one group's value in g
    (``held``) or its groups' from their slots. An output of one supergroup is that value (done);
    of several, the value is stored and counted in, and the last known folds the output, or, with
    SLICED, owns its fold. Returns (done, owner, and the output's state when done)."""
    owner = False
    if held:
        acc, m, l = g_acc, g_m, g_l
    else:
        acc, m, l = fold_slots(
            ws_acc_ptr, ws_ml_ptr, slot0 + k0, k1 - k0, n_rows, 0, BLOCK_D, BLOCK_G, BLOCK_D, WAVE, ISUPER
        )
    n_supers = supers_of(n_tiles, IGROUP, ISUPER)
    done = n_supers == 1
    if n_supers > 1:
        store_partial(ws_acc_ptr, ws_ml_ptr, slot0 + max_groups + sg, n_rows, acc, m, l, BLOCK_D, BLOCK_G)
        last = super_counted(counter_ptr, sg, out_start, n_tiles, total, n_active, num_programs, IGROUP, ISUPER, SLICED)
        if SLICED:
            owner = last
        else:
            done = last
            if done:
                acc, m, l = fold_slots(
                    ws_acc_ptr, ws_ml_ptr, slot0 + max_groups, n_supers, n_rows, 0, BLOCK_D, BLOCK_G, BLOCK_D, WAVE,
                    WAVE,
                )  # fmt: skip
    return done, owner, acc, m, l


@triton.jit
def super_counted(
    counter_ptr,
    sg,
    out_start,
    n_tiles,
    total,
    n_active,
    num_programs,
    IGROUP: tl.constexpr,
    ISUPER: tl.constexpr,
    SLICED: tl.constexpr,
):
    """Count supergroup sg's value, stored in its slot, in at its output of several supergroups:
    True for the last to be known (without SLICED its count is zeroed there)."""
    n_supers = supers_of(n_tiles, IGROUP, ISUPER)
    return count_in(
        counter_ptr + OUT_KNOWN * num_programs, out_start, out_start + n_tiles - 1, n_supers, total, n_active,
        sg == n_supers - 1, not SLICED,
    )  # fmt: skip


@triton.jit
def _fold_group(
    ws_acc_ptr,
    ws_ml_ptr,
    g0,
    g1,
    total,
    n_active,
    n_rows,
    c0,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    IGROUP: tl.constexpr,
    COLS: tl.constexpr,
    WAVE: tl.constexpr,
):
    """Columns [c0, c0 + COLS) of the value of the group of chunks [g0, g1) (linear tile indices)
    that several programs hold: the first holder's fold of its chunks, then each later chunk from
    its holder's slot, in order."""
    p = program_of_tile(g0, total, n_active, 1)
    acc, m, l = load_partial(ws_acc_ptr, ws_ml_ptr, p * IGROUP + IGROUP - 1, n_rows, c0, BLOCK_D, BLOCK_G, COLS)
    W: tl.constexpr = WAVE if WAVE < IGROUP else IGROUP
    for t0 in range(program_start(p + 1, total, n_active, 1), g1, W):
        for w in tl.static_range(W):  # a wave of chunks, as in fold_slots
            t = t0 + w
            holder = program_of_tile(t, total, n_active, 1)
            o_slot = holder * IGROUP + t - program_start(holder, total, n_active, 1)
            rows = tl.where(t < g1, n_rows, 0)
            c_acc, c_m, c_l = load_partial(ws_acc_ptr, ws_ml_ptr, o_slot, rows, c0, BLOCK_D, BLOCK_G, COLS)
            acc, m, l = fold_pair(acc, m, l, c_acc, c_m, c_l)
    return acc, m, l


@triton.jit
def _fold_group_slices(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    owner,
    pid,
    g0,
    g1,
    p_first,
    n_members,
    o_slot,
    total,
    n_active,
    num_programs,
    n_rows,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    IGROUP: tl.constexpr,
    COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
    POLLS: tl.constexpr,
):
    """Fold a split group's value in column slices into slot o_slot: its last holder to arrive
    (``owner``) claims slices until none is left, and its holders with no tiles past it wait for
    the count (``merge.await_count``) and claim slices beside it. Whoever folds the last slice
    stores the value's m and l (every slice's are the same) and returns True: the value is known."""
    arrived = counter_ptr + GROUP_ARRIVED * num_programs + p_first
    known = False
    if takes_part(owner, arrived, n_members, pid, g0, g1 - g0, total, n_active, POLLS):
        claimed = counter_ptr + GROUP_CLAIMED * num_programs + p_first
        k = tl.atomic_add(claimed, 1, sem="relaxed", scope="gpu")
        while k < BLOCK_D // COLS:
            c0 = k * COLS
            acc, m, l = _fold_group(
                ws_acc_ptr, ws_ml_ptr, g0, g1, total, n_active, n_rows, c0, BLOCK_D, BLOCK_G, IGROUP, COLS, SLICE_WAVE
            )
            merged = counter_ptr + GROUP_MERGED * num_programs + p_first
            if slice_stored(ws_acc_ptr, ws_ml_ptr, merged, o_slot, n_rows, acc, m, l, c0, BLOCK_D, BLOCK_G, COLS):
                known = True
            k = tl.atomic_add(claimed, 1, sem="relaxed", scope="gpu")
    return known


@triton.jit
def finish_group(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    pid,
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
    COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
    POLLS: tl.constexpr,
):
    """Count this program in at group k of a split output, after publishing its chunks of it; the
    last holder to arrive folds the group, whole or, where the plan folds in column slices
    (SLICE_WAVE) and the group has INVARIANT_SLICE_HOLDERS holders or more (tuning.py), in slices
    its idle holders share (``_fold_group_slices``), and makes its value known (``group_known``).
    Returns ``group_known``'s (whether this program finished the output, whether it owns the
    output's fold, whether it owns the group's supergroup's, and the output's state when it
    finished it)."""
    SLICED: tl.constexpr = SLICE_WAVE > 0
    g0 = out_start + k * IGROUP
    g1 = tl.minimum(g0 + IGROUP, out_start + n_tiles)
    p_first = program_of_tile(g0, total, n_active, 1)
    n_members = program_of_tile(g1 - 1, total, n_active, 1) - p_first + 1
    # In a sliced kernel the count stays for the holders that wait on it; the output's last
    # leaver zeroes it.
    last = count_in(
        counter_ptr + GROUP_ARRIVED * num_programs, g0, g1 - 1, n_members, total, n_active, False, not SLICED
    )
    whole = last
    held = True  # where nothing is sliced, the last holder always has the value in registers
    if SLICED:
        sliced = n_members >= _SLICE_HOLDERS
        whole = last & (sliced == 0)
        held = whole
        if sliced:
            last = _fold_group_slices(
                ws_acc_ptr, ws_ml_ptr, counter_ptr, last, pid, g0, g1, p_first, n_members, slot0 + k, total,
                n_active, num_programs, n_rows, BLOCK_D, BLOCK_G, IGROUP, COLS, SLICE_WAVE, POLLS,
            )  # fmt: skip
    g_acc, g_m, g_l = empty_state(BLOCK_G, BLOCK_D)
    if whole:
        g_acc, g_m, g_l = _fold_group(
            ws_acc_ptr, ws_ml_ptr, g0, g1, total, n_active, n_rows, 0, BLOCK_D, BLOCK_G, IGROUP, BLOCK_D, WAVE
        )
        store_partial(ws_acc_ptr, ws_ml_ptr, slot0 + k, n_rows, g_acc, g_m, g_l, BLOCK_D, BLOCK_G)
    done = False
    owner = False
    s_owner = False
    acc, m, l = empty_state(BLOCK_G, BLOCK_D)
    if last:
        done, owner, s_owner, acc, m, l = group_known(
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
            BLOCK_D,
            BLOCK_G,
            IGROUP,
            ISUPER,
            WAVE,
            COLS,
            SLICE_WAVE,
        )
    return done, owner, s_owner, acc, m, l
