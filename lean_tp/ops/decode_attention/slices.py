"""A fold in column slices that a fold's holders share (the batch-invariant mode's, ``folds`` and
``output_fold``): who takes part, and the store and count of each slice."""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.merge import await_count, ends_within, store_cols, store_ml


@triton.jit
def takes_part(owner, count_ptr, target, pid, t0, n_tiles, total, n_active, POLLS: tl.constexpr):
    """Whether this program takes slices of a fold in column slices: its ``owner``, or a holder
    whose range ends within tiles [t0, t0 + n_tiles) (no tiles left) once the fold's count at
    count_ptr reaches ``target`` within POLLS reads (``merge.await_count``)."""
    helps = owner
    if (owner == 0) & ends_within(pid, t0, n_tiles, total, n_active, 1):
        helps = await_count(count_ptr, target, POLLS)
    return helps


@triton.jit
def slice_stored(
    ws_acc_ptr,
    ws_ml_ptr,
    merged_ptr,
    o_slot,
    n_rows,
    acc,
    m,
    l,
    c0,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
):
    """Store columns [c0, c0 + COLS) of a value folded in column slices (acc) into slot o_slot and
    count the slice at merged_ptr: whoever stores the last also stores the value's m and l (every
    slice's are the same) and gets True, the value is known."""
    store_cols(ws_acc_ptr, o_slot, n_rows, acc, c0, BLOCK_D, BLOCK_G)
    tl.debug_barrier()  # every thread's stores of the slice before the count
    merged = tl.atomic_add(merged_ptr, 1, sem="acq_rel", scope="gpu")
    last = merged == BLOCK_D // COLS - 1
    if last:
        store_ml(ws_ml_ptr, o_slot, n_rows, m, l, BLOCK_G)
    return last
