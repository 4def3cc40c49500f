"""The merge of ``mla_decode_gluon_kernel``'s split outputs, a Triton kernel (the interpreter runs
it on CPU). One program an output and slice of COLS of its 512 columns: a split output's merge
runs beside every other's and over its columns in parallel, and no program waits on an output
that needs none. Empty sequences' outputs (no tiles, so no program of the main kernel holds them)
are written here too.
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
    HU: tl.constexpr,
    ROWS: tl.constexpr,
    DV: tl.constexpr,
    COLS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program (o, c): output o (row block b x HU + hu), columns [c COLS, (c + 1) COLS). Split, it
    is merged from its contributors' partials: the first is the program whose range names o with
    more than one contributor, contributor k's partial is in slot 0 of the first's program + k
    (the first one's in the slot its range names), weighted by exp(lse_k - max lse). Of an empty
    sequence: out 0, lse -inf. Otherwise the main kernel wrote it whole."""
    o = tl.program_id(0)
    c = tl.program_id(1)
    o_r = tl.arange(0, ROWS)
    o_c = c * COLS + tl.arange(0, COLS)
    rows = o * ROWS + o_r
    o_p = tl.arange(0, BLOCK_P)
    place = range_ptr + o_p * RANGE_FIELDS
    merges = (tl.load(place + 8, mask=o_p < num_programs, other=-1) == o) & (
        tl.load(place + 9, mask=o_p < num_programs, other=0) > 1
    )
    i = tl.min(tl.where(merges, o_p, BLOCK_P), 0)
    if i < BLOCK_P:
        n_contrib = tl.load(range_ptr + i * RANGE_FIELDS + 9)
        slot = tl.load(range_ptr + i * RANGE_FIELDS + 10)
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
            # CHUNK times less often than one contributor a step would.
            live = k0 + o_k < n_contrib
            rows_k = _slots(i, k0 + o_k, slot, n_contrib, ROWS, o_r)  # (CHUNK, ROWS)
            w = tl.exp(tl.load(part_lse_ptr + rows_k, mask=live[:, None], other=float("-inf")) - m[None, :])
            part = tl.load(
                part_out_ptr + rows_k[:, :, None] * DV + o_c[None, None, :], mask=live[:, None, None], other=0.0
            )
            acc += tl.sum(w[:, :, None] * part, 0)
            total += tl.sum(w, 0)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * DV + o_c[None, :], out.to(out_ptr.dtype.element_ty))
        tl.store(lse_ptr + rows, m + tl.log(total), mask=c == 0)
    if tl.load(seqlens_ptr + o // HU) == 0:  # HU: the units of all Tq tokens
        tl.store(out_ptr + rows[:, None] * DV + o_c[None, :], tl.zeros([ROWS, COLS], out_ptr.dtype.element_ty))
        tl.store(lse_ptr + rows, tl.full([ROWS], float("-inf"), tl.float32), mask=c == 0)
