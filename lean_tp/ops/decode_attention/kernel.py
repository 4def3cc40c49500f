"""LeanAttention decode kernel: stream-K over LeanTiles, single launch, in-kernel merge tree.

One persistent program walks its range of the schedule (schedule.py), computes each segment's
partial with the K/V loop (attend.py) and merges split outputs (merge.py; invariant.py in the
batch-invariant mode). The LSE is kept in the log2 domain until it is stored.

A head unit's rows (rows.py) are the query tokens x the GQA group of one KV head, padded to
BLOCK_G, and its columns of V all of them or, with NUM_VC = 2, one half (BLOCK_D each); head dims
that are not a power of two are padded to BLOCK_D with masked loads. In the
batch-invariant mode a Tq-token call is scheduled as Tq one-token decodes (SEQ_TOKENS = TQ, each
token over the keys up to its own: docs/design.md), so a token's bits are its decode's.
"""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.attend import attend_segment, kv_scale
from lean_tp.ops.decode_attention.invariant import attend_invariant
from lean_tp.ops.decode_attention.merge import finish_split
from lean_tp.ops.decode_attention.output_fold import finish_output
from lean_tp.ops.decode_attention.rows import (
    load_q,
    row_bounds,
    seq_base,
    store_output,
    unit_cols,
    write_empty_sequences,
)
from lean_tp.ops.decode_attention.schedule import cdiv, next_unit, program_range, tiled_span

# Values that change with the batch, the grid, the cache allocation or the model: specializing on
# them (a value of 1 becomes a constant, multiples of 16 get an attribute) would compile a new
# kernel for each; STRIDE_ALIGN restores the alignment facts the vector loads need.
_NOT_SPECIALIZED = [
    "B",
    "HKV",
    "num_programs",
    "num_sms",
    "max_span",
    "window",
    "stride_qb",
    "stride_qt",
    "stride_qh",
    "stride_kb",
    "stride_kn",
    "stride_kh",
    "stride_vb",
    "stride_vn",
    "stride_vh",
    "stride_bt",
    "stride_ks",
    "stride_vs",
    "max_groups",
    "num_pages",
]


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def decode_attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seqlens_ptr,
    leftpad_ptr,
    bt_ptr,
    out_ptr,
    lse_ptr,
    ws_acc_ptr,
    ws_ml_ptr,
    counter_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    qk_scale,
    cap_log2,
    B,
    HKV,
    num_programs,
    num_sms,
    max_span,
    window,
    max_groups,
    num_pages,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_bt,
    stride_ks,
    stride_vs,
    GROUP: tl.constexpr,
    TQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_T: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    V_IN_K: tl.constexpr,
    SCORES_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr,
    NUM_VC: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_CONTRIB: tl.constexpr,
    FANIN: tl.constexpr,
    WAVE: tl.constexpr,
    MERGE_COLS: tl.constexpr,
    SLICE_WAVE: tl.constexpr,
    MERGE_POLLS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    E4M3_BITS: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
    INVARIANT: tl.constexpr,
    IGROUP: tl.constexpr,
    ISUPER: tl.constexpr,
    SEQ_TOKENS: tl.constexpr,
):
    """One persistent program of the stream-K grid; see schedule.py for the tile order.

    Head dims: q and K have HEAD_DIM + HEAD_DIM_T columns, V and out HEAD_DIM (HEAD_DIM_T > 0:
    MLA's latent + rope row, ``attend_segment``); V_IN_K: V is K's first HEAD_DIM columns, read
    from K's tile. seqlens_ptr holds each sequence's number of valid keys; with HAS_LEFTPAD they start at cache
    position leftpad_ptr[b] instead of 0 (left-padded batches). Only the last min(len, max_span)
    of them (the span) are tiled and read: max_span is window + TQ - 1 with a window. qk_scale
    turns q.k into the log2-domain score (see ``attend_segment`` for SOFTCAP); with HAS_SCALES (fp8) it
    is multiplied by the KV head's k_scale and the partial by its v_scale (E4M3_BITS: see
    ``_upcast``). SAME_KV_STRIDES: use K's strides for V (the launcher found them equal).
    STRIDE_ALIGN divides
    every q and K/V stride (the launcher checks); dividing and multiplying by it is exact and lets
    the compiler prove the alignment (``tl.multiple_of`` does not attach to scalar arguments).
    INVARIANT: the batch-invariant mode (invariant.py), with chunks folded in groups of IGROUP, groups
    in supergroups of ISUPER, and max_groups groups per output at most, supergroups' values folded
    in column slices of MERGE_COLS, SLICE_WAVE at once where SLICE_WAVE > 0; the default mode
    ignores max_groups (and has SLICE_WAVE 0).
    num_pages: the paged pool's size; a key on a page id outside [0, num_pages) is never read and
    makes its sequence's output rows and lse NaN (``attend_segment``).
    SEQ_TOKENS: the call's sequences are scheduled whole (1), or each of their TQ query tokens as a
    sequence of its own (TQ; schedule.py): B * SEQ_TOKENS schedule sequences, whose head units
    hold TQ // SEQ_TOKENS tokens' rows.
    """
    # Inductor types a float argument of a user kernel fp64 where the JIT types it fp32; the
    # scores and the loop-carried state stay fp32 either way.
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap_log2 = tl.cast(cap_log2, tl.float32)
    stride_qb = stride_qb // STRIDE_ALIGN * STRIDE_ALIGN
    stride_qt = stride_qt // STRIDE_ALIGN * STRIDE_ALIGN
    stride_qh = stride_qh // STRIDE_ALIGN * STRIDE_ALIGN
    stride_kb = stride_kb // STRIDE_ALIGN * STRIDE_ALIGN
    stride_kn = stride_kn // STRIDE_ALIGN * STRIDE_ALIGN
    stride_kh = stride_kh // STRIDE_ALIGN * STRIDE_ALIGN
    stride_vb = stride_vb // STRIDE_ALIGN * STRIDE_ALIGN
    stride_vn = stride_vn // STRIDE_ALIGN * STRIDE_ALIGN
    stride_vh = stride_vh // STRIDE_ALIGN * STRIDE_ALIGN
    if SAME_KV_STRIDES:  # then K's offsets are V's: each key's address is formed once, not twice
        stride_vb, stride_vn, stride_vh = stride_kb, stride_kn, stride_kh
    # Blocks start at multiples of BLOCK_N (tile_n is one; without left padding or a window the keys
    # start at position 0), so pages of BLOCK_N keys or more hold whole blocks: one page id a block.
    BLOCK_IN_PAGE: tl.constexpr = PAGED and PAGE_SIZE >= BLOCK_N and not HAS_LEFTPAD and not HAS_WINDOW
    ROWS_TQ: tl.constexpr = TQ // SEQ_TOKENS  # query tokens in a head unit's rows
    # The next unit's q is requested before this segment's result is stored or merged, except in
    # column blocks (NUM_VC = 2): there q (BLOCK_G x 576, 144 registers a thread at 128 rows) would
    # be live beside the accumulator (128), which spills.
    Q_AHEAD: tl.constexpr = NUM_VC == 1
    # The batch-invariant folds of a split group's chunks and of an output's supergroups go in
    # column slices (``plan``'s SLICE_WAVE, ``folds.finish_group`` and
    # ``output_fold.finish_output``), else whole, by the program that makes the last member known.
    FOLD_SLICED: tl.constexpr = SLICE_WAVE > 0
    pid = tl.program_id(0)
    HU = HKV * NUM_GC
    NS = B * SEQ_TOKENS
    # The first segment is placed by one search; each later one is the next head unit, whose
    # place, base and q are requested before the current segment's result is stored or merged.
    # b is a schedule sequence; the call's sequence (cache row, left padding) is b // SEQ_TOKENS.
    total, n_active, t0, t1, b, hu, tile, seq_len, _ = program_range(
        pid, seqlens_ptr, NS, HU, max_span, num_programs, num_sms, LANES, TILE_N, BLOCK_B, MIN_TILES, MAX_CONTRIB
    )
    b_q, b_qo, b_qt = load_q(
        q_ptr,
        b,
        hu,
        t0 < t1,
        stride_qb,
        stride_qt,
        stride_qh,
        GROUP,
        TQ,
        SEQ_TOKENS,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_G,
        NUM_GC,
        NUM_VC,
        HEAD_DIM_T,
        BLOCK_DT,
    )
    n_base = seq_base(leftpad_ptr, b // SEQ_TOKENS, t0 < t1, HAS_LEFTPAD)
    t = t0
    slot = 0  # workspace slot of this segment's partial: 0 for the program's first segment, else 1
    while t < t1:
        span = tiled_span(seq_len, max_span, HAS_WINDOW)
        n_tiles = cdiv(span, TILE_N)
        out_start = t - tile
        seg_end = tl.minimum(t1, out_start + n_tiles)
        h_kv = hu // NUM_GC
        b_lo, b_hi = row_bounds(hu, span, window, GROUP, ROWS_TQ, BLOCK_G, NUM_GC, NUM_VC, HAS_WINDOW)
        k_scale = kv_scale(k_scale_ptr, h_kv, stride_ks, HAS_SCALES, E4M3_BITS)
        n_rows = tl.minimum(ROWS_TQ * GROUP - (hu % NUM_GC // NUM_VC) * BLOCK_G, BLOCK_G)  # real rows of the head unit
        if INVARIANT:
            do_store, owner, own_lead, own_end, b_acc, b_m, b_l = attend_invariant(
                b_q,
                b_qt,
                k_ptr,
                v_ptr,
                bt_ptr,
                ws_acc_ptr,
                ws_ml_ptr,
                counter_ptr,
                b,
                b // SEQ_TOKENS,
                hu,
                h_kv,
                n_base + seq_len - span,
                span,
                b_lo,
                b_hi,
                qk_scale * k_scale,
                cap_log2,
                kv_scale(v_scale_ptr, h_kv, stride_vs, HAS_SCALES, E4M3_BITS),
                pid,
                tile,
                seg_end - t,
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
                ROWS_TQ,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_G,
                BLOCK_N,
                TILE_N,
                PAGED,
                PAGE_SIZE,
                DOT_PRECISION,
                SOFTCAP,
                E4M3_BITS,
                BLOCK_IN_PAGE,
                HAS_SCALES,
                IGROUP,
                ISUPER,
                HEAD_DIM_T,
                BLOCK_DT,
                V_IN_K,
                SCORES_T,
                WAVE,
                MERGE_COLS,
                SLICE_WAVE,
                MERGE_POLLS,
            )
        else:
            b_acc, b_m, b_l = attend_segment(
                b_q,
                b_qo,
                b_qt,
                k_ptr,
                v_ptr,
                bt_ptr,
                b // SEQ_TOKENS,
                h_kv,
                unit_cols(hu, NUM_VC, BLOCK_D),
                n_base + seq_len - span,
                tile * TILE_N,
                tl.minimum((tile + seg_end - t) * TILE_N, span),
                b_lo,
                b_hi,
                qk_scale * k_scale,
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
                ROWS_TQ > 1,
                SOFTCAP,
                E4M3_BITS,
                BLOCK_IN_PAGE,
                HEAD_DIM_T,
                BLOCK_DT,
                V_IN_K,
                SCORES_T,
                NUM_VC,
            )
            if HAS_SCALES:
                b_acc = b_acc * kv_scale(v_scale_ptr, h_kv, stride_vs, HAS_SCALES, E4M3_BITS)
        nb, nhu, n_seq_len = next_unit(b, hu, seq_len, seqlens_ptr, NS, HU, seg_end < t1, LANES)
        n_base_next = seq_base(leftpad_ptr, nb // SEQ_TOKENS, seg_end < t1, HAS_LEFTPAD)
        # The next unit's q is loaded before this segment's result is stored or merged (Q_AHEAD),
        # or after it: the two steps in that order.
        for step in tl.static_range(2):
            if (step == 0) == Q_AHEAD:
                b_q, b_qo, b_qt = load_q(
                    q_ptr,
                    nb,
                    nhu,
                    seg_end < t1,
                    stride_qb,
                    stride_qt,
                    stride_qh,
                    GROUP,
                    TQ,
                    SEQ_TOKENS,
                    HEAD_DIM,
                    BLOCK_D,
                    BLOCK_G,
                    NUM_GC,
                    NUM_VC,
                    HEAD_DIM_T,
                    BLOCK_DT,
                )
            else:
                if FOLD_SLICED:
                    finish_output(
                        ws_acc_ptr, ws_ml_ptr, counter_ptr, out_ptr, lse_ptr, sinks_ptr, owner, own_lead, own_end,
                        pid, b, hu, tile, seg_end - t, out_start, n_tiles, total, n_active, num_programs, max_groups,
                        HU, n_rows, HKV * GROUP, GROUP, TQ, SEQ_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC, NUM_VC,
                        HAS_SINKS, IGROUP, ISUPER, MERGE_COLS, SLICE_WAVE, MERGE_POLLS,
                    )  # fmt: skip
                if not INVARIANT:
                    do_store = (tile == 0) & (out_start + n_tiles <= t1)  # the program holds the whole output
                    if not do_store:  # the output's last merger stores it
                        finish_split(
                            ws_acc_ptr,
                            ws_ml_ptr,
                            counter_ptr,
                            out_ptr,
                            lse_ptr,
                            sinks_ptr,
                            pid,
                            slot,
                            b,
                            hu,
                            out_start,
                            n_tiles,
                            total,
                            n_active,
                            num_programs,
                            n_rows,
                            b_acc,
                            b_m,
                            b_l,
                            HKV * GROUP,
                            GROUP,
                            TQ,
                            SEQ_TOKENS,
                            HEAD_DIM,
                            BLOCK_D,
                            BLOCK_G,
                            NUM_GC,
                            NUM_VC,
                            HAS_SINKS,
                            FANIN,
                            WAVE,
                            MERGE_COLS,
                            LANES,
                            MERGE_POLLS,
                        )
                if do_store:
                    store_output(
                        out_ptr,
                        lse_ptr,
                        sinks_ptr,
                        b,
                        hu,
                        b_acc,
                        b_m,
                        b_l,
                        unit_cols(hu, NUM_VC, BLOCK_D),
                        HKV * GROUP,
                        GROUP,
                        TQ,
                        SEQ_TOKENS,
                        HEAD_DIM,
                        BLOCK_D,
                        BLOCK_G,
                        NUM_GC,
                        NUM_VC,
                        HAS_SINKS,
                    )
        t, b, hu, tile, seq_len, n_base, slot = seg_end, nb, nhu, tile * 0, n_seq_len, n_base_next, 1
    # Off the critical path: nothing waits on the outputs of empty sequences.
    write_empty_sequences(
        pid,
        n_active,
        seqlens_ptr,
        out_ptr,
        lse_ptr,
        sinks_ptr,
        NS,
        HKV,
        GROUP,
        TQ,
        SEQ_TOKENS,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_G,
        NUM_GC,
        NUM_VC,
        HAS_SINKS,
    )
