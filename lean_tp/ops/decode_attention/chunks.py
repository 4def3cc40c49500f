"""Chunk partials of the batch-invariant mode (invariant.py): keys cut on the TILE_N grid, each
chunk attended from a fresh state, and the fold of two partials in a fixed order."""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.attend import INTERPRETED, attend_block, bad_pages, q_operands, ref_max


@triton.jit
def empty_state(BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fold's start (acc [BLOCK_G, BLOCK_D], m, l [BLOCK_G]): no key seen. Folding a partial
    into it gives the partial's bits back."""
    return (
        tl.zeros([BLOCK_G, BLOCK_D], tl.float32),
        tl.full([BLOCK_G], float("-inf"), tl.float32),
        tl.zeros([BLOCK_G], tl.float32),
    )


@triton.jit
def fold_pair(acc1, m1, l1, acc2, m2, l2):
    """Partial 1 followed by partial 2, with explicit fused multiply-adds: the compiler cannot
    contract the two products differently where this is inlined in different places."""
    m = tl.maximum(m1, m2)
    ref = ref_max(m, True)
    a1 = tl.exp2(m1 - ref)
    a2 = tl.exp2(m2 - ref)
    return tl.fma(acc2, a2[:, None], acc1 * a1[:, None]), m, tl.fma(l2, a2, l1 * a1)


@triton.jit
def _store_in_place(p, x):
    """tl.store(p, x) of fp32 x from the threads that hold x, in x's layout: a tl.store converts x
    to a coalesced layout through shared memory, whose buffer inside the K/V loop comes on top of
    the pipeline's (a program per SM on sm_90 D=128). No mask: a per-element predicate held
    across the K/V loop costs registers (spills on sm_90 D=128)."""
    if INTERPRETED:
        tl.store(p, x)
    else:
        tl.inline_asm_elementwise(
            "{ st.global.f32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,f",
            [p.to(tl.int64, bitcast=True), x],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _store_chunk(ws_acc_ptr, ws_ml_ptr, o_slot, b_acc, b_m, b_l, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """``merge.store_partial`` from inside the K/V loop (``_store_in_place``), of all BLOCK_G rows:
    the slot holds them, and its readers take rows [0, n_rows) alone (``merge.load_partial``)."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    o_slot = tl.cast(o_slot, tl.int64)
    _store_in_place(ws_acc_ptr + (o_slot * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :], b_acc)
    _store_in_place(ws_ml_ptr + o_slot * 2 * BLOCK_G + o_g, b_m)
    _store_in_place(ws_ml_ptr + (o_slot * 2 + 1) * BLOCK_G + o_g, b_l)


@triton.jit
def attend_chunks(
    b_q,
    b_qt,
    k_ptr,
    v_ptr,
    bt_ptr,
    ws_acc_ptr,
    ws_ml_ptr,
    lead_slot0,
    group_slot0,
    c_lead,
    whole,
    b,
    h_kv,
    n_base,
    n_lo,
    n_hi,
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    IGROUP: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    E4M3_BITS: tl.constexpr,
    BLOCK_IN_PAGE: tl.constexpr,
    HEAD_DIM_T: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    V_IN_K: tl.constexpr,
    SCORES_T: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    """The chunks of keys [n_lo, n_hi) of a span of ``span`` keys (n_lo on the TILE_N grid; n_hi a
    chunk's end or the span's), each attended from a fresh state, its acc multiplied by v_scale
    (with HAS_SCALES). Chunks before chunk c_lead go one by one to workspace slots lead_slot0 + i
    (the i-th chunk of the range); the rest are folded left to right in groups of IGROUP (on the
    span's chunk grid), and each group completed here is written to slot group_slot0 + its index,
    except, with ``whole`` (the range holds the whole output), the output's last group, which
    is returned. Returns (g, bad): g the fold of the chunks after the last group written (a group
    the range ends inside, or that last group), bad whether a page id of the range lies outside
    the pool (``attend_segment``; the caller poisons what was written).

    One K/V loop covers every chunk and group, and their ends only move states (registers, or a
    store from the registers that hold them), so the pipeliner's copies of the next keys are in
    flight across them: the pipeline fills once per call, as in the default mode. The loop holds
    two states, the chunk's and the group's (the output's fold of its groups reads them from the
    workspace after the loop: ``invariant.attend_invariant``), which keeps the invariant kernel in
    the default kernel's registers. A chunk's operations are those of ``attend_segment`` over it,
    wherever the range begins. With IGROUP 1 (wide row blocks), ``_attend_group_chunks``: one
    state."""
    if IGROUP == 1:
        return _attend_group_chunks(
            b_q, b_qt, k_ptr, v_ptr, bt_ptr, ws_acc_ptr, ws_ml_ptr, group_slot0, whole, b, h_kv, n_base, n_lo, n_hi,
            span, b_lo, b_hi, qk_scale, cap_log2, v_scale, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
            stride_vh, stride_bt, num_pages, HEAD_DIM, BLOCK_D, BLOCK_G, BLOCK_N, TILE_N, PAGED, PAGE_SIZE,
            DOT_PRECISION, ROW_MASK, SOFTCAP, E4M3_BITS, BLOCK_IN_PAGE, HEAD_DIM_T, BLOCK_DT, V_IN_K, SCORES_T,
            HAS_SCALES,
        )  # fmt: skip
    g_acc, g_m, g_l = empty_state(BLOCK_G, BLOCK_D)
    c_acc, c_m, c_l = empty_state(BLOCK_G, BLOCK_D)
    # The batch-invariant variant computes whole rows (DecodeConfig.v_col_blocks): one column block.
    b_q, _, b_qt = q_operands(b_q, b_q, b_qt, SCORES_T)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        c_acc, c_m, c_l = attend_block(
            c_acc,
            c_m,
            c_l,
            b_q,
            b_q,
            b_qt,
            k_ptr,
            v_ptr,
            bt_ptr,
            b,
            h_kv,
            0,
            n_base,
            n0,
            n_hi,
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
            BLOCK_N,
            PAGED,
            PAGE_SIZE,
            DOT_PRECISION,
            ROW_MASK,
            SOFTCAP,
            E4M3_BITS,
            BLOCK_IN_PAGE,
            HEAD_DIM_T,
            BLOCK_DT,
            V_IN_K,
            SCORES_T,
            1,
        )
        if ((n0 + BLOCK_N) % TILE_N == 0) | (n0 + BLOCK_N >= n_hi):  # chunk n0 // TILE_N ends here
            chunk = n0 // TILE_N
            if HAS_SCALES:
                c_acc = c_acc * v_scale
            if chunk < c_lead:
                _store_chunk(
                    ws_acc_ptr,
                    ws_ml_ptr,
                    lead_slot0 + chunk - n_lo // TILE_N,
                    c_acc,
                    c_m,
                    c_l,
                    BLOCK_D,
                    BLOCK_G,
                )
            else:
                g_acc, g_m, g_l = fold_pair(g_acc, g_m, g_l, c_acc, c_m, c_l)
                last = n0 + BLOCK_N >= span
                if (((chunk + 1) % IGROUP == 0) | last) & ~(whole & last):  # and its group
                    _store_chunk(
                        ws_acc_ptr,
                        ws_ml_ptr,
                        group_slot0 + chunk // IGROUP,
                        g_acc,
                        g_m,
                        g_l,
                        BLOCK_D,
                        BLOCK_G,
                    )
                    g_acc, g_m, g_l = empty_state(BLOCK_G, BLOCK_D)
            c_acc, c_m, c_l = empty_state(BLOCK_G, BLOCK_D)
    bad = False
    if PAGED:
        bad = bad_pages(bt_ptr, b, n_base, n_lo, n_hi, stride_bt, num_pages, PAGE_SIZE)
    return g_acc, g_m, g_l, bad


@triton.jit
def _attend_group_chunks(
    b_q, b_qt, k_ptr, v_ptr, bt_ptr, ws_acc_ptr, ws_ml_ptr, group_slot0, whole, b, h_kv, n_base, n_lo, n_hi, span,
    b_lo, b_hi, qk_scale, cap_log2, v_scale, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_bt, num_pages, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROW_MASK: tl.constexpr, SOFTCAP: tl.constexpr, E4M3_BITS: tl.constexpr,
    BLOCK_IN_PAGE: tl.constexpr, HEAD_DIM_T: tl.constexpr, BLOCK_DT: tl.constexpr, V_IN_K: tl.constexpr,
    SCORES_T: tl.constexpr, HAS_SCALES: tl.constexpr,
):  # fmt: skip
    """``attend_chunks`` where a chunk is its group (IGROUP 1: wide row blocks' chunks of
    ``DecodeConfig.invariant_wide_tile_n`` keys): each chunk attended from a fresh state and
    written to slot group_slot0 + its index, but the output's last with ``whole``. Returns the
    range's last chunk (with ``whole``, the output's, unwritten) and ``bad``. A group of one
    chunk is the chunk (folding a partial into the empty state gives its bits back), so the loop
    holds one state, and no group begins in an earlier program. A K/V loop a chunk: the loop is
    the default's, its end (reset and store) outside it (sm_90's 64-row block, paged64: 676 SASS
    an iteration against 991 with the end in one loop over the range), at one pipeline fill a
    chunk of 16 blocks."""
    b_q, _, b_qt = q_operands(b_q, b_q, b_qt, SCORES_T)
    c_acc, c_m, c_l = empty_state(BLOCK_G, BLOCK_D)
    for c0 in range(n_lo, n_hi, TILE_N):
        c_acc, c_m, c_l = empty_state(BLOCK_G, BLOCK_D)
        c_hi = tl.minimum(c0 + TILE_N, n_hi)
        for n0 in range(c0, c_hi, BLOCK_N):
            c_acc, c_m, c_l = attend_block(
                c_acc, c_m, c_l, b_q, b_q, b_qt, k_ptr, v_ptr, bt_ptr, b, h_kv, 0, n_base, n0, c_hi, b_lo, b_hi,
                qk_scale, cap_log2, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
                num_pages, HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, ROW_MASK, SOFTCAP, E4M3_BITS,
                BLOCK_IN_PAGE, HEAD_DIM_T, BLOCK_DT, V_IN_K, SCORES_T, 1,
            )  # fmt: skip
        if HAS_SCALES:
            c_acc = c_acc * v_scale
        if ~(whole & (c_hi >= span)):
            _store_chunk(ws_acc_ptr, ws_ml_ptr, group_slot0 + c0 // TILE_N, c_acc, c_m, c_l, BLOCK_D, BLOCK_G)
    bad = False
    if PAGED:
        bad = bad_pages(bt_ptr, b, n_base, n_lo, n_hi, stride_bt, num_pages, PAGE_SIZE)
    return c_acc, c_m, c_l, bad
