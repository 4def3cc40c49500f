"""The merge of ``mla_decode_gluon_kernel``'s split outputs, a Triton kernel (the interpreter runs
it on CPU). Each split output is merged by its first contributor's programs here, one a slice of
COLS of the 512 columns, so a split output's merge runs beside every other's and over its columns
in parallel; empty sequences' outputs (no tiles, so no program of the main kernel holds them) are
written here too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.schedule import RANGE_FIELDS


@triton.jit
def _slots(i, k, slot, n_contrib, ROWS: tl.constexpr, o_r):
    """(len(k), ROWS) row indices into the partials of contributors k of program i's output:
    contributor k's partial is in slot 0 of program i + k, the first one's in the slot the
    range names (indices past n_contrib point at the first's, so they stay in bounds)."""
    k = tl.where(k < n_contrib, k, 0)
    at = (i + k) * 2 + tl.where(k == 0, slot, 0)
    return at[:, None] * ROWS + o_r[None, :]


@triton.jit
def mla_combine_kernel(
    range_ptr,  # (num_programs, RANGE_FIELDS) int32: schedule.program_ranges_kernel's
    seqlens_ptr,  # (B,) int32
    part_out_ptr,  # (num_programs, 2, ROWS, DV) fp32: normalized partials, in each program's slots
    part_lse_ptr,  # (num_programs, 2, ROWS) fp32, natural log
    out_ptr,  # (B x HU x ROWS, DV) bf16
    lse_ptr,  # (B x HU x ROWS,) fp32
    num_programs,
    B,
    HU: tl.constexpr,
    ROWS: tl.constexpr,
    DV: tl.constexpr,
    COLS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program (i, c), columns [c COLS, (c + 1) COLS): as program i of the main kernel, the output
    its last segment holds when it is that output's first contributor and others share it:
    contributor k's partial is in slot 0 of program i + k, the first one's in the slot the range
    names, weighted by exp(lse_k - max lse). As row block i (i < B x HU) of an empty sequence:
    out 0, lse -inf."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    o_r = tl.arange(0, ROWS)
    o_c = c * COLS + tl.arange(0, COLS)
    place = range_ptr + i * RANGE_FIELDS
    n_contrib = tl.load(place + 9, mask=i < num_programs, other=0)
    if n_contrib > 1:
        row0 = tl.load(place + 8) * ROWS
        slot = tl.load(place + 10)
        o_k = tl.arange(0, CHUNK)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for k0 in range(0, n_contrib, CHUNK):
            lse_k = tl.load(
                part_lse_ptr + _slots(i, k0 + o_k, slot, n_contrib, ROWS, o_r),
                mask=(k0 + o_k < n_contrib)[:, None],
                other=float("-inf"),
            )
            m = tl.maximum(m, tl.max(lse_k, 0))
        m = tl.where(m == float("-inf"), 0.0, m)  # no contributor saw a key: out 0, lse -inf
        acc = tl.zeros([ROWS, COLS], tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, n_contrib, CHUNK):
            # CHUNK contributors' partials a step, loaded together: the merge waits on memory
            # CHUNK times less often than one contributor a step would (the partials of one
            # sequence on every SM number over a hundred).
            live = k0 + o_k < n_contrib
            rows_k = _slots(i, k0 + o_k, slot, n_contrib, ROWS, o_r)  # (CHUNK, ROWS)
            w = tl.exp(tl.load(part_lse_ptr + rows_k, mask=live[:, None], other=float("-inf")) - m[None, :])
            part = tl.load(
                part_out_ptr + rows_k[:, :, None] * DV + o_c[None, None, :], mask=live[:, None, None], other=0.0
            )
            acc += tl.sum(w[:, :, None] * part, 0)
            total += tl.sum(w, 0)
        rows = row0 + o_r
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * DV + o_c[None, :], out.to(out_ptr.dtype.element_ty))
        tl.store(lse_ptr + rows, m + tl.log(total), mask=c == 0)
    seq_len = tl.load(seqlens_ptr + i // HU, mask=i < B * HU, other=1)  # HU: the units of all Tq tokens
    if seq_len == 0:
        rows = i * ROWS + o_r
        tl.store(out_ptr + rows[:, None] * DV + o_c[None, :], tl.zeros([ROWS, COLS], out_ptr.dtype.element_ty))
        tl.store(lse_ptr + rows, tl.full([ROWS], float("-inf"), tl.float32), mask=c == 0)
