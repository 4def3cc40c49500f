"""LeanAttention decode kernel: stream-K over LeanTiles, single launch, last-arriver merge.

Scores are kept in the log2 domain (``qk * scale * log2(e)``, ``exp2``) and converted to a natural
log only for the returned LSE. Every value is upcast to fp32 right after loading except the ``tl.dot``
operands, which are in q's dtype so tensor cores do the products (fp32 uses "ieee"; an fp8 cache is
converted to q's dtype after loading, and its scales are folded into the score and output scales).

The rows of one head unit are the Tq query tokens x the GQA group of one KV head, token-major
(row r is token r // GROUP, query head r % GROUP of the KV head), padded to BLOCK_G. Head dims
that are not a power of two are padded to BLOCK_D with masked loads.
"""

import os

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.merge import _finish_split, _ref_max
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
E4M3_BITS_SCALE = tl.constexpr(256.0)  # see _upcast
# Read when the module is imported, as ``triton.jit`` reads it; compiled kernels never see the branch.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# The Triton interpreter computes bf16 arithmetic wrongly (numpy has no bf16; its loads, stores and
# conversions are exact), so there q is upcast on loading and the dots take fp32 operands.
BF16_DOTS_IN_FP32 = INTERPRETED


@triton.jit
def _kv_index(bt_ptr, b, n_first, o_n, m_n, stride_bt, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
              BLOCK_IN_PAGE: tl.constexpr):
    """(row, position in row) of tokens o_n (n_first first) of sequence b: (b, token) or, when
    paged, (page, slot). BLOCK_IN_PAGE: the caller knows they lie in one page."""
    # One return: the two branches give different types (tensor vs scalar row); a constexpr if
    # generates only the taken one, but separate returns must agree in type.
    if PAGED:
        # A shift and a mask, not // and %: PAGE_SIZE is a power of two and positions are never
        # negative, which the compiler cannot know (signed division costs a rounding fix per key).
        bt_row = bt_ptr + tl.cast(b, tl.int64) * stride_bt
        if BLOCK_IN_PAGE:  # one page id for the block: the row's address is one scalar
            o_page = tl.load(bt_row + (n_first >> PAGE_SIZE.bit_length() - 1))
        else:
            o_page = tl.load(bt_row + (o_n >> PAGE_SIZE.bit_length() - 1), mask=m_n, other=0)
        o_row, o_pos = tl.cast(o_page, tl.int64), tl.cast(o_n & (PAGE_SIZE - 1), tl.int64)
    else:
        o_row, o_pos = tl.cast(b, tl.int64), tl.cast(o_n, tl.int64)
    return o_row, o_pos


@triton.jit
def _load_rows(p, m_rows, o_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load [rows, BLOCK_D] at pointers p, zero for masked rows and for the padding past HEAD_DIM."""
    if HEAD_DIM == BLOCK_D:  # no column mask: keeps the loads' vector width provable
        x = tl.load(p, mask=m_rows[:, None], other=0.0)
    else:
        x = tl.load(p, mask=m_rows[:, None] & (o_d < HEAD_DIM)[None, :], other=0.0)
    return x


@triton.jit
def _opaque(x):
    """x unchanged (16-bit values), through an op that Triton does not move into a dot operand's
    shared-memory load. Without it, Triton converts an fp8 tile to 16 bits as it loads the dot
    operand, which reads V (n-major for the P.V product) byte by byte (64 LDS.U8 per thread per
    block at D=128) and copies it in 8-byte pieces; with it, the tile is read in 16-byte rows,
    converted, and staged as a 16-bit operand (docs/kernel_report.md, "The fp8 operand path").
    The ``mov`` costs nothing: ptxas removes it. Not in the interpreter, which runs no PTX."""
    if INTERPRETED:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def _e4m3_words_to_f16(w):
    """[R, C] int32, four float8_e4m3fn bytes per word (little-endian) -> [R, 4 C] fp16, each
    value x 2^-8 as ``_upcast`` makes it, two values per 32-bit operation: the odd bytes (each
    16-bit half's high byte) move right by 1, the even bytes left by 7 (8 for the sign). On sm_80
    that is 9 instructions per word (4 LOP3, 3 shifts, 2 PRMT pairing the halves), 2.25 per
    value against 3.3 for bytes. The NaN codes become +-1.875 (a KV cache holds none)."""
    w = w.to(tl.uint32, bitcast=True)
    odd = (w & 0x80008000) | ((w >> 1) & 0x3F803F80)
    even = ((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80)
    # [R, C, a, c] holds byte 2a + c of word C: the bytes back in cache order.
    x = tl.join(tl.join(even.to(tl.uint16), (even >> 16).to(tl.uint16)),
                tl.join(odd.to(tl.uint16), (odd >> 16).to(tl.uint16)))  # fmt: skip
    return tl.reshape(x, (w.shape[0], 4 * w.shape[1])).to(tl.float16, bitcast=True)


@triton.jit
def _upcast(x, dtype: tl.constexpr, E4M3_BITS: tl.constexpr):
    """K/V values in q's dtype. With E4M3_BITS, x holds float8_e4m3fn values (Triton has no e4m3
    type before sm_89) as int32 words of four (``launcher.e4m3_operands``: where the caches'
    offsets and strides allow) or as uint8. A value's sign at an fp16's bit 15 and its 7 low bits
    at bits 7..13 is the fp16 of value x 2^-8 exactly, subnormals included (the caller multiplies
    the scales by E4M3_BITS_SCALE = 2^8): a byte gets there sign-extended, shifted left by 7, with
    bit 14 cleared; words through ``_e4m3_words_to_f16``."""
    if E4M3_BITS and x.dtype == tl.int32:
        x = _opaque(_e4m3_words_to_f16(x).to(dtype))
    elif x.dtype.primitive_bitwidth == 8:
        if E4M3_BITS:
            x = ((x.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16385).to(tl.float16, bitcast=True)
        x = _opaque(x.to(dtype))
    return x.to(dtype)


@triton.jit
def _attend(
    b_q, k_ptr, v_ptr, bt_ptr, b, h_kv, n_base, n_lo, n_hi, b_lo, b_hi, qk_scale, cap_log2,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROW_MASK: tl.constexpr, SOFTCAP: tl.constexpr, E4M3_BITS: tl.constexpr, BLOCK_IN_PAGE: tl.constexpr,
):  # fmt: skip
    """Un-normalized partial (acc [BLOCK_G, BLOCK_D], m [BLOCK_G], l [BLOCK_G]) over keys [n_lo, n_hi).

    Key i sits at cache position n_base + i. With ROW_MASK (several query tokens) row g sees only
    keys [b_lo[g], b_hi[g]), so a row may see none of a block or of the whole range: its m stays
    -inf and its l 0, and its exponentials are taken against 0 instead of -inf. Without it every
    row sees every key, and the caller guarantees n_lo < n_hi, so m is finite after the first block.
    With SOFTCAP, qk_scale is 2 log2(e) scale / softcap and the score is
    ``cap_log2 * tanh(..)`` written with exp2: tanh(x) = 1 - 2 / (e^{2x} + 1).
    """
    # A cache of 4-byte words (E4M3_BITS, see _upcast) has a quarter of the columns.
    PER_COL: tl.constexpr = 4 if k_ptr.dtype.element_ty == tl.int32 else 1
    o_d = tl.arange(0, BLOCK_D // PER_COL)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_hi
        # Page ids looked up for this block (one per key, or one for the block with BLOCK_IN_PAGE):
        # the pipeliner requests them a stage ahead of the K/V copies they address (launched with
        # DecodeConfig.paged_stages). The lookup is shared by K and V, and with SAME_KV_STRIDES the
        # addresses too.
        o_row, o_pos = _kv_index(bt_ptr, b, n_base + n0, n_base + o_n, m_n, stride_bt, PAGED, PAGE_SIZE, BLOCK_IN_PAGE)
        p_k = k_ptr + (o_row * stride_kb + o_pos * stride_kn + tl.cast(h_kv, tl.int64) * stride_kh)[:, None] + o_d[None, :]
        p_v = v_ptr + (o_row * stride_vb + o_pos * stride_vn + tl.cast(h_kv, tl.int64) * stride_vh)[:, None] + o_d[None, :]
        b_k = _upcast(_load_rows(p_k, m_n, o_d, HEAD_DIM // PER_COL, BLOCK_D // PER_COL), b_q.dtype, E4M3_BITS)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            b_s = cap_log2 * (1.0 - 2.0 / (tl.exp2(b_s) + 1.0))
        if ROW_MASK:
            m_s = m_n[None, :] & (o_n[None, :] >= b_lo[:, None]) & (o_n[None, :] < b_hi[:, None])
        else:
            m_s = m_n[None, :]
        b_s = tl.where(m_s, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_ref = _ref_max(b_m_new, ROW_MASK)
        b_alpha = tl.exp2(b_m - b_m_ref)
        b_p = tl.exp2(b_s - b_m_ref[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = _upcast(_load_rows(p_v, m_n, o_d, HEAD_DIM // PER_COL, BLOCK_D // PER_COL), b_q.dtype, E4M3_BITS)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new
    return b_acc, b_m, b_l


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
    "stride_ks", "stride_vs",
]  # fmt: skip


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def decode_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, leftpad_ptr, bt_ptr, out_ptr, lse_ptr, ws_acc_ptr, ws_ml_ptr, counter_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr,
    qk_scale, cap_log2, B, HKV, num_programs, num_sms, max_span, window,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
    stride_ks, stride_vs,
    GROUP: tl.constexpr, TQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MIN_TILES: tl.constexpr, MAX_CONTRIB: tl.constexpr, FANIN: tl.constexpr, WAVE: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SCALES: tl.constexpr,
    E4M3_BITS: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
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
        if HAS_SCALES:
            k_scale = tl.load(k_scale_ptr + h_kv * stride_ks)
            if E4M3_BITS:
                k_scale = k_scale * E4M3_BITS_SCALE
        else:
            k_scale = 1.0
        b_acc, b_m, b_l = _attend(
            b_q, k_ptr, v_ptr, bt_ptr, b, h_kv, n_base + seq_len - span, tile * TILE_N,
            tl.minimum((tile + seg_end - t) * TILE_N, span), b_lo, b_hi, qk_scale * k_scale, cap_log2,
            stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
            HEAD_DIM, BLOCK_D, BLOCK_G, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, TQ > 1, SOFTCAP,
            E4M3_BITS, BLOCK_IN_PAGE,
        )  # fmt: skip
        if HAS_SCALES:
            v_scale = tl.load(v_scale_ptr + h_kv * stride_vs)
            if E4M3_BITS:
                v_scale = v_scale * E4M3_BITS_SCALE
            b_acc = b_acc * v_scale
        nb, nhu, n_seq_len = _next_unit(b, hu, seq_len, seqlens_ptr, B, HU, seg_end < t1)
        b_q = _load_q(q_ptr, nb, nhu, seg_end < t1, stride_qb, stride_qt, stride_qh,
                      GROUP, TQ, HEAD_DIM, BLOCK_D, BLOCK_G, NUM_GC)  # fmt: skip
        n_base_next = _seq_base(leftpad_ptr, nb, seg_end < t1, HAS_LEFTPAD)
        n_rows = tl.minimum(TQ * GROUP - (hu % NUM_GC) * BLOCK_G, BLOCK_G)
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
