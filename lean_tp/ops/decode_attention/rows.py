"""The rows of a head unit, and what the kernel loads and stores per row: q, the keys each row
sees, the normalized output and lse.

The rows of one head unit are the query tokens x the GQA group of one KV head of one of the
schedule's sequences, token-major (row r is token r // GROUP, query head r % GROUP of the KV
head), padded to BLOCK_G. A KV head has NUM_GC head units: its row blocks of BLOCK_G rows, each
in NUM_VC column blocks (``unit_cols``) that hold V's columns in parts of BLOCK_D. A schedule
sequence is a call's sequence with all its TQ tokens, or, with SEQ_TOKENS = TQ (the
batch-invariant mode's verification, docs/design.md), one of its tokens: sequence s is token
s % TQ of the call's sequence s // TQ, decoded over the keys up to and including its own, so its
rows are those of that token's one-token decode.
"""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.attend import BF16_DOTS_IN_FP32, INTERPRETED, load_rows, other_cols

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def head_unit_rows(
    hu, GROUP: tl.constexpr, TQ: tl.constexpr, BLOCK_G: tl.constexpr, NUM_GC: tl.constexpr, NUM_VC: tl.constexpr
):
    """Rows of head unit hu ([BLOCK_G] each): query token, query head, and whether the row is real."""
    o_r = (hu % NUM_GC // NUM_VC) * BLOCK_G + tl.arange(0, BLOCK_G)
    if TQ == 1:  # heads in a line: simpler address math, and padded rows need no wrap-around
        o_t = o_r * 0
        o_h = (hu // NUM_GC) * GROUP + o_r
    else:
        o_t = o_r // GROUP
        o_h = (hu // NUM_GC) * GROUP + o_r % GROUP
    return o_t, o_h, o_r < TQ * GROUP


@triton.jit
def unit_cols(hu, NUM_VC: tl.constexpr, BLOCK_D: tl.constexpr):
    """The first of V's columns that head unit hu holds (BLOCK_D of them): 0, a constant, with one
    column block."""
    return hu % NUM_VC * BLOCK_D if NUM_VC > 1 else 0


@triton.jit
def seq_rows(
    s,
    hu,
    GROUP: tl.constexpr,
    TQ: tl.constexpr,
    SEQ_TOKENS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr,
    NUM_VC: tl.constexpr,
):
    """Rows of head unit hu of schedule sequence s: (the call's sequence, and per row [BLOCK_G]
    its query token, query head and whether the row is real)."""
    o_t, o_h, m_g = head_unit_rows(hu, GROUP, TQ // SEQ_TOKENS, BLOCK_G, NUM_GC, NUM_VC)
    return s // SEQ_TOKENS, o_t + s % SEQ_TOKENS, o_h, m_g


@triton.jit
def store_output(
    out_ptr,
    lse_ptr,
    sinks_ptr,
    s,
    hu,
    b_acc,
    b_m,
    b_l,
    c0,
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
):
    """Normalize and store the rows of head unit hu of schedule sequence s into out (B, TQ, HQ,
    HEAD_DIM) and lse (B, TQ, HQ), both contiguous: b_acc [BLOCK_G, BLOCK_D] holds columns
    [c0, c0 + BLOCK_D) of the rows (c0 > 0: a merge's later column slice or a later column block,
    which leave the lse to the first; every column block's m and l are the same). A sink joins the
    denominator here, once per output; without sinks l == 0 (no key seen) gives out 0 and lse -inf."""
    b, o_t, o_h, m_g = seq_rows(s, hu, GROUP, TQ, SEQ_TOKENS, BLOCK_G, NUM_GC, NUM_VC)
    o_d = c0 + tl.arange(0, BLOCK_D)
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
    m_lse = m_g & (c0 == 0)
    if INTERPRETED:  # its block & scalar of int1 holds int32, which triton 3.8+'s stores refuse as a mask
        m_lse = tl.where(c0 == 0, m_g, False)
    tl.store(lse_ptr + o_row, b_lse, mask=m_lse)


@triton.jit
def write_empty_sequences(
    pid,
    n_active,
    seqlens_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    NS,
    HKV,
    GROUP: tl.constexpr,
    TQ: tl.constexpr,
    SEQ_TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr,
    NUM_VC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Zero-length schedule sequences (NS of them) own no tile; active programs share them
    round-robin: out 0, lse -inf (the sink's logit with sinks)."""
    b_zero = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    b_none = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_nol = tl.zeros([BLOCK_G], tl.float32)
    for s in range(tl.where(pid < n_active, pid, NS), NS, n_active):
        if tl.load(seqlens_ptr + s) == 0:
            for hu in range(0, HKV * NUM_GC):
                store_output(
                    out_ptr,
                    lse_ptr,
                    sinks_ptr,
                    s,
                    hu,
                    b_zero,
                    b_none,
                    b_nol,
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


@triton.jit
def seq_base(leftpad_ptr, b, valid, HAS_LEFTPAD: tl.constexpr):
    """Cache position of the call's sequence b's first valid key: its left padding, or 0."""
    if HAS_LEFTPAD:
        return tl.load(leftpad_ptr + b, mask=valid, other=0)
    else:
        return b * 0


@triton.jit
def load_q(
    q_ptr,
    s,
    hu,
    valid,
    stride_qb,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    TQ: tl.constexpr,
    SEQ_TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr,
    NUM_VC: tl.constexpr,
    HEAD_DIM_T: tl.constexpr,
    BLOCK_DT: tl.constexpr,
):
    """The query rows of head unit hu of schedule sequence s, or nothing loaded when not ``valid``:
    b_q [BLOCK_G, BLOCK_D], q's columns of V's that the unit holds (``unit_cols``: all HEAD_DIM,
    V's head dim, with one column block); b_qo [BLOCK_G, BLOCK_D], the other column block's (b_q
    again with one); b_qt [BLOCK_G, BLOCK_DT], q's HEAD_DIM_T columns after V's (K's columns past
    V's; b_q again when there are none). In q's dtype (fp32 for bf16 in the interpreter), zero past
    the rows and the columns."""
    b, o_t, o_h, m_g = seq_rows(s, hu, GROUP, TQ, SEQ_TOKENS, BLOCK_G, NUM_GC, NUM_VC)
    o_d = tl.arange(0, BLOCK_D)
    o_q = tl.cast(b, tl.int64) * stride_qb + o_t.to(tl.int64) * stride_qt + o_h.to(tl.int64) * stride_qh
    m_q = m_g & valid
    if INTERPRETED:  # its block & scalar of int1 holds int32, which triton 3.8+'s loads refuse as a mask
        m_q = tl.where(valid, m_g, False)
    d_own = unit_cols(hu, NUM_VC, BLOCK_D)
    b_q = load_rows(q_ptr + o_q[:, None] + d_own + o_d[None, :], m_q, o_d, HEAD_DIM // NUM_VC, BLOCK_D)
    if BF16_DOTS_IN_FP32 and b_q.dtype == tl.bfloat16:
        b_q = b_q.to(tl.float32)
    b_qo = b_q
    if NUM_VC == 2:
        p_qo = q_ptr + o_q[:, None] + other_cols(d_own, BLOCK_D) + o_d[None, :]
        b_qo = load_rows(p_qo, m_q, o_d, BLOCK_D, BLOCK_D)
        b_qo = b_qo.to(b_q.dtype)
    b_qt = b_q
    if HEAD_DIM_T > 0:
        o_dt = tl.arange(0, BLOCK_DT)
        b_qt = load_rows(q_ptr + o_q[:, None] + (HEAD_DIM + o_dt)[None, :], m_q, o_dt, HEAD_DIM_T, BLOCK_DT)
        b_qt = b_qt.to(b_q.dtype)
    return b_q, b_qo, b_qt


@triton.jit
def row_bounds(
    hu,
    span,
    window,
    GROUP: tl.constexpr,
    TQ: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_GC: tl.constexpr,
    NUM_VC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Keys [lo, hi) of the span each row sees ([BLOCK_G] each): query token t is the span's key
    span - TQ + t and sees itself and the keys before it, the last ``window`` with a window."""
    o_t, _, _ = head_unit_rows(hu, GROUP, TQ, BLOCK_G, NUM_GC, NUM_VC)
    b_hi = span - TQ + 1 + o_t
    if HAS_WINDOW:
        b_lo = tl.maximum(b_hi - window, 0)
    else:
        b_lo = b_hi * 0
    return b_lo, b_hi
