"""The batch-invariant mode's upper folds of a split output (invariant.py defines the fold), in
column slices that its contributors with no tiles left share: a split supergroup's groups, the
output's supergroups, and the zeroing of every counter the output's folds used, once all its
contributors have left."""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.folds import (
    INVARIANT_REGIONS,
    OUT_CLAIMED,
    OUT_KNOWN,
    OUT_LEFT,
    SUPER_ARRIVED,
    SUPER_CLAIMED,
    SUPER_MERGED,
    fold_slots,
    out_slot0,
    super_counted,
    super_in_slices,
    super_span,
    supers_of,
)
from lean_tp.ops.decode_attention.merge import await_count, ends_within
from lean_tp.ops.decode_attention.rows import store_output, unit_cols
from lean_tp.ops.decode_attention.schedule import program_of_tile
from lean_tp.ops.decode_attention.slices import slice_stored, takes_part

_REGIONS = tl.constexpr(INVARIANT_REGIONS)


@triton.jit
def finish_output(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    owner,
    own_lead,
    own_end,
    pid,
    s,
    hu,
    tile,
    seg_n,
    out_start,
    n_tiles,
    total,
    n_active,
    num_programs,
    max_groups,
    HU,
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
    IGROUP: tl.constexpr,
    ISUPER: tl.constexpr,
    COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
    POLLS: tl.constexpr,
):
    """Finish this program's segment, chunks [tile, tile + seg_n), of an output, where its folds go
    in column slices (``group_known``'s SLICED): first the supergroup folds in slices it owns
    (``own_lead``, ``own_end``: ``finish_super``) or helps with, then, for an output of several
    supergroups (wide row blocks, IGROUP 1: of any number), the output's, once the last of them is
    known: slices of COLS, SLICE_WAVE values loaded at once. The output's ``owner`` claims slices
    until none is left, and its contributors with no tiles left wait for the count
    (``merge.await_count``) and claim slices beside it. Every slice folds the same values in the same order, so who folds it never changes its bits. Where
    several programs hold the output (of any number of supergroups), each counts itself out here,
    and the last zeroes the counters of the output and of its groups and supergroups
    (``_zero_counters``) for the next launch (or CUDA-graph replay)."""
    n_supers = supers_of(n_tiles, IGROUP, ISUPER)
    p_first = program_of_tile(out_start, total, n_active, 1)
    p_last = program_of_tile(out_start + n_tiles - 1, total, n_active, 1)
    shared = p_first != p_last
    if shared:
        # The supergroups in slices this segment takes part in: its first chunk's, where it owns
        # that fold, and its last chunk's, where it owns that fold or its program has no tiles left
        # (it helps); any other lies inside the segment. One or two, in a loop so that the kernel
        # holds one copy of the fold.
        sg_lead = tile // IGROUP // ISUPER
        sg_end = (tile + seg_n - 1) // IGROUP // ISUPER
        sg_first = tl.where(own_lead & (sg_lead != sg_end), sg_lead, sg_end)
        for sg in range(sg_first, sg_end + 1, tl.maximum(sg_end - sg_first, 1)):
            owner |= finish_super(
                ws_acc_ptr, ws_ml_ptr, counter_ptr, out_ptr, lse_ptr, sinks_ptr, (sg != sg_end) | own_end, pid,
                sg, s, hu, out_start, n_tiles, total, n_active, num_programs, max_groups, HU, n_rows, HQ, GROUP,
                TQ, SEQ_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC, NUM_VC, HAS_SINKS, IGROUP, ISUPER, COLS,
                SLICE_WAVE, POLLS,
            )  # fmt: skip
    # Wide row blocks (IGROUP 1) fold an output of one supergroup from its slot too (``group_known``).
    folds_output = n_supers > 1
    if IGROUP == 1:
        folds_output = n_supers > 0
    if folds_output:
        known = counter_ptr + OUT_KNOWN * num_programs + p_first
        claimed = counter_ptr + OUT_CLAIMED * num_programs + p_first
        helps = owner
        if shared & (owner == 0) & ends_within(pid, out_start, n_tiles, total, n_active, 1):
            helps = await_count(known, n_supers, POLLS)
        if helps:
            first = out_slot0(s, hu, HU, num_programs, max_groups, IGROUP, ISUPER) + max_groups
            k = pid * 0
            if shared:
                k = tl.atomic_add(claimed, 1, sem="relaxed", scope="gpu")
            while k < BLOCK_D // COLS:
                c0 = k * COLS
                acc, m, l = fold_slots(ws_acc_ptr, ws_ml_ptr, first, n_supers, n_rows, c0, BLOCK_D, BLOCK_G, COLS,
                                       SLICE_WAVE, SLICE_WAVE)  # fmt: skip
                store_output(
                    out_ptr, lse_ptr, sinks_ptr, s, hu, acc, m, l, unit_cols(hu, NUM_VC, BLOCK_D) + c0, HQ,
                    GROUP, TQ, SEQ_TOKENS, HEAD_DIM, COLS, BLOCK_G, NUM_GC, NUM_VC, HAS_SINKS,
                )  # fmt: skip
                k += 1
                if shared:
                    k = tl.atomic_add(claimed, 1, sem="relaxed", scope="gpu")
    if shared:
        if (
            tl.atomic_add(counter_ptr + OUT_LEFT * num_programs + p_first, 1, sem="acq_rel", scope="gpu")
            == p_last - p_first
        ):
            _zero_counters(counter_ptr, p_first, p_last, num_programs)


@triton.jit
def finish_super(
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    owner,
    pid,
    sg,
    s,
    hu,
    out_start,
    n_tiles,
    total,
    n_active,
    num_programs,
    max_groups,
    HU,
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
    IGROUP: tl.constexpr,
    ISUPER: tl.constexpr,
    COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
    POLLS: tl.constexpr,
):
    """Fold supergroup sg, where it goes in column slices (``folds.super_in_slices``), once its
    last group is known: its ``owner`` (who made that group known) claims slices until none is
    left, and its holders with no tiles left wait for the count and claim slices beside it. Each
    slice folds its columns of the groups' values in order, as the whole fold does. An output of one
    supergroup is stored slice by slice; otherwise each slice goes to the supergroup's slot, and
    whoever folds the last stores the value's m and l and counts it in at the output (its last to
    be known owns the output's fold: returns True)."""
    t0, t1, k0, k1 = super_span(out_start, n_tiles, sg, IGROUP, ISUPER)
    out_owner = False
    if super_in_slices(t0, t1, k0, k1, total, n_active):
        p0 = program_of_tile(t0, total, n_active, 1)
        arrived = counter_ptr + SUPER_ARRIVED * num_programs + p0
        if takes_part(owner, arrived, k1 - k0, pid, t0, t1 - t0, total, n_active, POLLS):
            n_supers = supers_of(n_tiles, IGROUP, ISUPER)
            slot0 = out_slot0(s, hu, HU, num_programs, max_groups, IGROUP, ISUPER)
            o_slot = slot0 + max_groups + sg
            claimed = counter_ptr + SUPER_CLAIMED * num_programs + p0
            c = tl.atomic_add(claimed, 1, sem="relaxed", scope="gpu")
            while c < BLOCK_D // COLS:
                c0 = c * COLS
                acc, m, l = fold_slots(
                    ws_acc_ptr, ws_ml_ptr, slot0 + k0, k1 - k0, n_rows, c0, BLOCK_D, BLOCK_G, COLS, SLICE_WAVE, ISUPER
                )
                if (n_supers == 1) & (IGROUP > 1):  # wide blocks' go to the slot (``finish_output``)
                    store_output(
                        out_ptr, lse_ptr, sinks_ptr, s, hu, acc, m, l, unit_cols(hu, NUM_VC, BLOCK_D) + c0, HQ,
                        GROUP, TQ, SEQ_TOKENS, HEAD_DIM, COLS, BLOCK_G, NUM_GC, NUM_VC, HAS_SINKS,
                    )  # fmt: skip
                else:
                    merged = counter_ptr + SUPER_MERGED * num_programs + p0
                    if slice_stored(
                        ws_acc_ptr, ws_ml_ptr, merged, o_slot, n_rows, acc, m, l, c0, BLOCK_D, BLOCK_G, COLS
                    ):
                        out_owner = super_counted(
                            counter_ptr, sg, out_start, n_tiles, total, n_active, num_programs, IGROUP, ISUPER, True
                        )
                c = tl.atomic_add(claimed, 1, sem="relaxed", scope="gpu")
    return out_owner


@triton.jit
def _zero_counters(counter_ptr, p_first, p_last, num_programs):
    """Zero the counters of an output that programs [p_first, p_last] share, for the next launch (or
    CUDA-graph replay): every region at p_first .. p_last - 1, where its split groups and
    supergroups and the output itself keep them (invariant.py). Nobody touches them once every
    contributor has left; p_last's belong to the output its range goes on to, if any."""
    for p0 in range(p_first, p_last, 64):
        o_p = p0 + tl.arange(0, 64)
        for region in tl.static_range(_REGIONS):
            tl.store(counter_ptr + region * num_programs + o_p, 0, mask=o_p < p_last)
