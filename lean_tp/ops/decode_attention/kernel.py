"""LeanAttention decode kernel: stream-K over LeanTiles, single launch, last-arriver merge.

One persistent program walks its range of the schedule (schedule.py), computes each segment's
partial with the K/V loop (attend.py) and merges split outputs (merge.py; invariant.py in the
batch-invariant mode). The LSE is kept in the log2 domain until it is stored.

The rows of one head unit are the Tq query tokens x the GQA group of one KV head, token-major
(row r is token r // GROUP, query head r % GROUP of the KV head), padded to BLOCK_G. Head dims
that are not a power of two are padded to BLOCK_D with masked loads.
"""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.attend import BF16_DOTS_IN_FP32, _attend, _kv_scale, _load_rows
from lean_tp.ops.decode_attention.invariant import _attend_invariant
from lean_tp.ops.decode_attention.merge import _finish_split
from lean_tp.ops.decode_attention.schedule import (
    _cdiv,
    _locate,
    _next_unit,
    _num_active,
    _program_start,
    _scan_batch,
    _span,
)

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _rows(hu, GROUP: tl.constexpr, TQ: tl.constexpr, BLOCK_G: tl.constexpr, NUM_GC: tl.constexpr):
    """Rows of head unit hu ([BLOCK_G] each): query token, query head, and whether the row is real."""
    o_r = (hu % NUM_GC) * BLOCK_G + tl.arange(0, BLOCK_G)
    if TQ == 1:  # heads in a line: simpler address math, and padded rows need no wrap-around
        o_t = o_r * 0
        o_h = (hu // NUM_GC) * GROUP + o_r
    else:
        o_t = o_r // GROUP
        o_h = (hu // NUM_GC) * GROUP + o_r % GROUP
    return o_t, o_h, o_r < TQ * GROUP


@triton.jit
def _store_output(
    out_ptr, lse_ptr, sinks_ptr, b, hu, b_acc, b_m, b_l, HQ, GROUP: tl.constexpr, TQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, NUM_GC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Normalize and store the rows of head unit hu of sequence b into out (B, TQ, HQ, HEAD_DIM) and
    lse (B, TQ, HQ), both contiguous. A sink joins the denominator here, once per output; without
    sinks l == 0 (no key seen) gives out 0 and lse -inf."""
    o_t, o_h, m_g = _rows(hu, GROUP, TQ, BLOCK_G, NUM_GC)
    o_d = tl.arange(0, BLOCK_D)
    if HAS_SINKS:
        b_sink = tl.load(sinks_ptr + o_h, mask=m_g, other=0.0) * LOG2E
        b_m_new = tl.maximum(b_m, b_sink)
        b_alpha = tl.exp2(b_m - b_m_new)
        b_acc = b_acc * b_alpha[:, None]
        b_l = b_l * b_alpha + tl.exp2(b_sink - b_m_new)
        b_m = b_m_new
    b_empty = b_l == 0.0
    b_out = b_acc / tl.where(b_empty, 1.0, b_l)[:, None]
    b_lse = tl.where(b_empty, float("-inf"), (b_m + tl.log2(tl.where(b_empty, 1.0, b_l))) * LN2)
    o_row = (tl.cast(b, tl.int64) * TQ + o_t) * HQ + o_h
    m_o = m_g[:, None] & (o_d < HEAD_DIM)[None, :]
    tl.store(out_ptr + o_row[:, None] * HEAD_DIM + o_d[None, :], b_out.to(out_ptr.dtype.element_ty), mask=m_o)
    tl.store(lse_ptr + o_row, b_lse, mask=m_g)


@triton.jit
def _write_empty_sequences(
    pid, n_active, seqlens_ptr, out_ptr, lse_ptr, sinks_ptr, B, HKV, GROUP: tl.constexpr, TQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, NUM_GC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Zero-length sequences own no tile; active programs share them round-robin: out 0, lse -inf
    (the sink's logit with sinks)."""
    b_zero = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    b_none = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_nol = tl.zeros([BLOCK_G], tl.float32)
    for b in range(tl.where(pid < n_active, pid, B), B, n_active):
        if tl.load(seqlens_ptr + b) == 0:
            for hu in range(0, HKV * NUM_GC):
                _store_output(out_ptr, lse_ptr, sinks_ptr, b, hu, b_zero, b_none, b_nol, HKV * GROUP,
                              GROUP, TQ, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC, HAS_SINKS)  # fmt: skip


@triton.jit
def _seq_base(leftpad_ptr, b, valid, HAS_LEFTPAD: tl.constexpr):
    """Cache position of sequence b's first valid key: its left padding, or 0."""
    if HAS_LEFTPAD:
        return tl.load(leftpad_ptr + b, mask=valid, other=0)
    else:
        return b * 0


@triton.jit
def _load_q(q_ptr, b, hu, valid, stride_qb, stride_qt, stride_qh, GROUP: tl.constexpr, TQ: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, NUM_GC: tl.constexpr):  # fmt: skip
    """The query rows of head unit hu of sequence b ([BLOCK_G, BLOCK_D] in q's dtype, fp32 for bf16 in
    the interpreter; zero past the rows and past HEAD_DIM), or nothing loaded when not ``valid``."""
    o_t, o_h, m_g = _rows(hu, GROUP, TQ, BLOCK_G, NUM_GC)
    o_d = tl.arange(0, BLOCK_D)
    o_q = tl.cast(b, tl.int64) * stride_qb + o_t.to(tl.int64) * stride_qt + o_h.to(tl.int64) * stride_qh
    b_q = _load_rows(q_ptr + o_q[:, None] + o_d[None, :], m_g & valid, o_d, HEAD_DIM, BLOCK_D)
    if BF16_DOTS_IN_FP32 and b_q.dtype == tl.bfloat16:
        b_q = b_q.to(tl.float32)
    return b_q


@triton.jit
def _row_bounds(hu, span, window, GROUP: tl.constexpr, TQ: tl.constexpr, BLOCK_G: tl.constexpr,
                NUM_GC: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
    """Keys [lo, hi) of the span each row sees ([BLOCK_G] each): query token t is the span's key
    span - TQ + t and sees itself and the keys before it, the last ``window`` with a window."""
    o_t, _, _ = _rows(hu, GROUP, TQ, BLOCK_G, NUM_GC)
    b_hi = span - TQ + 1 + o_t
    if HAS_WINDOW:
        b_lo = tl.maximum(b_hi - window, 0)
    else:
        b_lo = b_hi * 0
    return b_lo, b_hi


# Values that change with the batch, the grid, the cache allocation or the model: specializing on
# them (a value of 1 becomes a constant, multiples of 16 get an attribute) would compile a new
# kernel for each; STRIDE_ALIGN restores the alignment facts the vector loads need.
_NOT_SPECIALIZED = [
    "B", "HKV", "num_programs", "num_sms", "max_span", "window", "stride_qb", "stride_qt", "stride_qh",
    "stride_kb", "stride_kn", "stride_kh", "stride_vb", "stride_vn", "stride_vh", "stride_bt",
    "stride_ks", "stride_vs", "max_groups",
]  # fmt: skip


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def decode_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, leftpad_ptr, bt_ptr, out_ptr, lse_ptr, ws_acc_ptr, ws_ml_ptr, counter_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr,
    qk_scale, cap_log2, B, HKV, num_programs, num_sms, max_span, window, max_groups,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
    stride_ks, stride_vs,
    GROUP: tl.constexpr, TQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MIN_TILES: tl.constexpr, MAX_CONTRIB: tl.constexpr, FANIN: tl.constexpr, WAVE: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SCALES: tl.constexpr,
    E4M3_BITS: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    INVARIANT: tl.constexpr, IGROUP: tl.constexpr,
):  # fmt: skip
    """One persistent program of the stream-K grid; see schedule.py for the tile order.

    seqlens_ptr holds each sequence's number of valid keys; with HAS_LEFTPAD they start at cache
    position leftpad_ptr[b] instead of 0 (left-padded batches). Only the last min(len, max_span)
    of them (the span) are tiled and read: max_span is window + TQ - 1 with a window. qk_scale
    turns q.k into the log2-domain score (see ``_attend`` for SOFTCAP); with HAS_SCALES (fp8) it
    is multiplied by the KV head's k_scale and the partial by its v_scale (E4M3_BITS: see
    ``_upcast``). SAME_KV_STRIDES: use K's strides for V (the launcher found them equal).
    STRIDE_ALIGN divides
    every q and K/V stride (the launcher checks); dividing and multiplying by it is exact and lets
    the compiler prove the alignment (``tl.multiple_of`` does not attach to scalar arguments).
    INVARIANT: the batch-invariant mode (invariant.py), with chunks folded in groups of IGROUP and
    max_groups group slots per output in the workspace; the default mode ignores max_groups.
    """
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
    pid = tl.program_id(0)
    HU = HKV * NUM_GC
    b_cum, total, unit_max = _scan_batch(seqlens_ptr, B, HU, max_span, TILE_N, BLOCK_B)
    n_active = _num_active(total, unit_max, num_programs, num_sms, MIN_TILES, MAX_CONTRIB)
    t0 = _program_start(pid, total, n_active)
    t1 = tl.where(pid < n_active, _program_start(pid + 1, total, n_active), t0)
    # The first segment is placed by one search; each later one is the next head unit, whose
    # place, base and q are requested before the current segment's result is stored or merged.
    b, hu, tile, seq_len = _locate(t0, b_cum, seqlens_ptr, B, HU, max_span, TILE_N, BLOCK_B)
    b_q = _load_q(q_ptr, b, hu, t0 < t1, stride_qb, stride_qt, stride_qh, GROUP, TQ, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC)
    n_base = _seq_base(leftpad_ptr, b, t0 < t1, HAS_LEFTPAD)
    t = t0
    slot = 0  # workspace slot of this segment's partial: 0 for the program's first segment, else 1
    while t < t1:
        span = _span(seq_len, max_span, HAS_WINDOW)
        n_tiles = _cdiv(span, TILE_N)
        out_start = t - tile
        seg_end = tl.minimum(t1, out_start + n_tiles)
        h_kv = hu // NUM_GC
        b_lo, b_hi = _row_bounds(hu, span, window, GROUP, TQ, BLOCK_G, NUM_GC, HAS_WINDOW)
        k_scale = _kv_scale(k_scale_ptr, h_kv, stride_ks, HAS_SCALES, E4M3_BITS)
        n_rows = tl.minimum(TQ * GROUP - (hu % NUM_GC) * BLOCK_G, BLOCK_G)  # real rows of the head unit
        if INVARIANT:
            do_store, b_acc, b_m, b_l = _attend_invariant(
                b_q, k_ptr, v_ptr, bt_ptr, ws_acc_ptr, ws_ml_ptr, counter_ptr, b, hu, h_kv, n_base + seq_len - span,
                span, b_lo, b_hi, qk_scale * k_scale, cap_log2, _kv_scale(v_scale_ptr, h_kv, stride_vs, HAS_SCALES, E4M3_BITS),
                pid, tile, seg_end - t, n_tiles, out_start, total, n_active, num_programs, max_groups, HU, n_rows,
                stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
                TQ, HEAD_DIM, BLOCK_D, BLOCK_G, BLOCK_N, TILE_N, PAGED, PAGE_SIZE, DOT_PRECISION,
                SOFTCAP, E4M3_BITS, BLOCK_IN_PAGE, HAS_SCALES, IGROUP,
            )  # fmt: skip
        else:
            b_acc, b_m, b_l = _attend(
                b_q, k_ptr, v_ptr, bt_ptr, b, h_kv, n_base + seq_len - span, tile * TILE_N,
                tl.minimum((tile + seg_end - t) * TILE_N, span), b_lo, b_hi, qk_scale * k_scale, cap_log2,
                stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
                HEAD_DIM, BLOCK_D, BLOCK_G, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, TQ > 1, SOFTCAP,
                E4M3_BITS, BLOCK_IN_PAGE,
            )  # fmt: skip
            if HAS_SCALES:
                b_acc = b_acc * _kv_scale(v_scale_ptr, h_kv, stride_vs, HAS_SCALES, E4M3_BITS)
        nb, nhu, n_seq_len = _next_unit(b, hu, seq_len, seqlens_ptr, B, HU, seg_end < t1)
        b_q = _load_q(q_ptr, nb, nhu, seg_end < t1, stride_qb, stride_qt, stride_qh,
                      GROUP, TQ, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC)  # fmt: skip
        n_base_next = _seq_base(leftpad_ptr, nb, seg_end < t1, HAS_LEFTPAD)
        if not INVARIANT:
            do_store = (tile == 0) & (out_start + n_tiles <= t1)  # the program holds the whole output
            if not do_store:
                do_store, b_acc, b_m, b_l = _finish_split(
                    ws_acc_ptr, ws_ml_ptr, counter_ptr, pid, slot, out_start, n_tiles, total, n_active, num_programs,
                    n_rows, b_acc, b_m, b_l, BLOCK_D, BLOCK_G, FANIN, WAVE,
                )  # fmt: skip
        if do_store:
            _store_output(out_ptr, lse_ptr, sinks_ptr, b, hu, b_acc, b_m, b_l, HKV * GROUP,
                          GROUP, TQ, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC, HAS_SINKS)  # fmt: skip
        t, b, hu, tile, seq_len, n_base, slot = seg_end, nb, nhu, tile * 0, n_seq_len, n_base_next, 1
    # Off the critical path: nothing waits on the outputs of empty sequences.
    _write_empty_sequences(pid, n_active, seqlens_ptr, out_ptr, lse_ptr, sinks_ptr, B, HKV,
                           GROUP, TQ, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC, HAS_SINKS)  # fmt: skip
