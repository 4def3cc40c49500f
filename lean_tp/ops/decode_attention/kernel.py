"""LeanAttention decode kernel: stream-K over LeanTiles, single launch, last-arriver merge.

Scores are kept in the log2 domain (``qk * scale * log2(e)``, ``exp2``) and converted to a natural
log only for the returned LSE. Every value is upcast to fp32 right after loading except the ``tl.dot``
operands, which stay in the cache dtype so tensor cores do the products (fp32 caches use "ieee").
"""

import triton
import triton.language as tl

from lean_tp.ops.decode_attention.schedule import (
    _cdiv,
    _locate,
    _next_unit,
    _num_active,
    _program_of_tile,
    _program_start,
    _scan_batch,
)

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _kv_index(bt_ptr, b, o_n, m_n, stride_bt, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(row, position in row) of tokens o_n of sequence b: (b, token) or, when paged, (page, slot)."""
    # One return: the two branches give different types (tensor vs scalar row); a constexpr if
    # generates only the taken one, but separate returns must agree in type.
    if PAGED:
        o_page = tl.load(bt_ptr + tl.cast(b, tl.int64) * stride_bt + o_n // PAGE_SIZE, mask=m_n, other=0)
        o_row, o_pos = tl.cast(o_page, tl.int64), tl.cast(o_n % PAGE_SIZE, tl.int64)
    else:
        o_row, o_pos = tl.cast(b, tl.int64), tl.cast(o_n, tl.int64)
    return o_row, o_pos


@triton.jit
def _attend(
    b_q, k_ptr, v_ptr, bt_ptr, b, h_kv, n_base, n_lo, n_hi, scale_log2,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Un-normalized partial (acc [BLOCK_G, D], m [BLOCK_G], l [BLOCK_G]) over keys [n_lo, n_hi).

    Key i of the sequence sits at cache position n_base + i (n_base: its left padding). The caller
    guarantees n_lo < n_hi, so the first block has a valid key and m is finite.
    """
    o_d = tl.arange(0, HEAD_DIM)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    o_n = n_lo + tl.arange(0, BLOCK_N)
    o_row, o_pos = _kv_index(bt_ptr, b, n_base + o_n, o_n < n_hi, stride_bt, PAGED, PAGE_SIZE)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_hi
        # The next block's (row, position) is carried to the next iteration, so K/V addresses do
        # not depend on a load of the same iteration and the pipeliner can multi-buffer paged
        # K/V as it does contiguous K/V. The page lookup is shared by K and V.
        o_row_next, o_pos_next = _kv_index(bt_ptr, b, n_base + o_n + BLOCK_N, o_n + BLOCK_N < n_hi, stride_bt,
                                           PAGED, PAGE_SIZE)  # fmt: skip
        p_k = k_ptr + (o_row * stride_kb + o_pos * stride_kn + tl.cast(h_kv, tl.int64) * stride_kh)[:, None] + o_d[None, :]
        p_v = v_ptr + (o_row * stride_vb + o_pos * stride_vn + tl.cast(h_kv, tl.int64) * stride_vh)[:, None] + o_d[None, :]
        b_k = tl.load(p_k, mask=m_n[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * scale_log2
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_v, mask=m_n[:, None], other=0.0)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new
        o_row, o_pos = o_row_next, o_pos_next
    return b_acc, b_m, b_l


@triton.jit
def _store_output(
    out_ptr, lse_ptr, b, h_q, n_rows, b_acc, b_m, b_l, stride_ob, stride_oh, stride_lb,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Normalize and store rows h_q .. h_q + n_rows of sequence b. l == 0 (empty) gives 0 and -inf."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, HEAD_DIM)
    m_g = o_g < n_rows
    b_empty = b_l == 0.0
    b_out = b_acc / tl.where(b_empty, 1.0, b_l)[:, None]
    b_lse = tl.where(b_empty, float("-inf"), (b_m + tl.log2(tl.where(b_empty, 1.0, b_l))) * LN2)
    p_o = out_ptr + tl.cast(b, tl.int64) * stride_ob + (h_q + o_g).to(tl.int64)[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_out.to(out_ptr.dtype.element_ty), mask=m_g[:, None])
    tl.store(lse_ptr + tl.cast(b, tl.int64) * stride_lb + h_q + o_g, b_lse, mask=m_g)


@triton.jit
def _store_partial(ws_acc_ptr, ws_ml_ptr, o_slot, n_rows, b_acc, b_m, b_l, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr):
    """Write rows [0, n_rows) of one partial to workspace slot o_slot (= 2 * program + 0 or 1)."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, HEAD_DIM)
    m_g = o_g < n_rows
    o_slot = tl.cast(o_slot, tl.int64)
    tl.store(ws_acc_ptr + (o_slot * BLOCK_G + o_g)[:, None] * HEAD_DIM + o_d[None, :], b_acc, mask=m_g[:, None])
    tl.store(ws_ml_ptr + o_slot * 2 * BLOCK_G + o_g, b_m, mask=m_g)
    tl.store(ws_ml_ptr + (o_slot * 2 + 1) * BLOCK_G + o_g, b_l, mask=m_g)


@triton.jit
def _merge_partials(
    ws_acc_ptr, ws_ml_ptr, out_start, p_first, p_last, total, n_active, pid, n_rows, b_acc, b_m, b_l,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Merge the partials of one output in program order, so the result never depends on arrival.

    Contributor p left its partial in slot 1 when the output began after p's first tile (it was p's
    last segment), else in slot 0; the merger's own partial (b_acc, b_m, b_l) is taken from
    registers. Loads use ``.cg`` (L2, not the non-coherent L1): the partials were written by other
    SMs, and this SM may hold stale copies of neighbouring lines. Rows >= n_rows are padding.
    """
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, HEAD_DIM)
    m_acc = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_acc = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for p in range(p_first, p_last + 1):
        slot = (_program_start(p, total, n_active) < out_start).to(tl.int64)
        o_slot = tl.cast(p, tl.int64) * 2 + slot
        m_g = (o_g < n_rows) & (p != pid)
        b_mp = tl.load(ws_ml_ptr + o_slot * 2 * BLOCK_G + o_g, mask=m_g, other=0.0, cache_modifier=".cg")
        b_lp = tl.load(ws_ml_ptr + (o_slot * 2 + 1) * BLOCK_G + o_g, mask=m_g, other=0.0, cache_modifier=".cg")
        p_acc = ws_acc_ptr + (o_slot * BLOCK_G + o_g)[:, None] * HEAD_DIM + o_d[None, :]
        b_accp = tl.load(p_acc, mask=m_g[:, None], other=0.0, cache_modifier=".cg")
        b_mp = tl.where(p == pid, b_m, b_mp)
        b_lp = tl.where(p == pid, b_l, b_lp)
        b_accp = tl.where(p == pid, b_acc, b_accp)
        m_new = tl.maximum(m_acc, b_mp)
        b_a = tl.exp2(m_acc - m_new)
        b_c = tl.exp2(b_mp - m_new)
        l_acc = l_acc * b_a + b_lp * b_c
        acc = acc * b_a[:, None] + b_accp * b_c[:, None]
        m_acc = m_new
    return acc, m_acc, l_acc


@triton.jit
def _write_empty_sequences(
    pid, n_active, seqlens_ptr, out_ptr, lse_ptr, B, HKV, GROUP, NUM_GC,
    stride_ob, stride_oh, stride_lb, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Zero-length sequences own no tile; active programs share them round-robin: out 0, lse -inf."""
    b_zero = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    b_none = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_nol = tl.zeros([BLOCK_G], tl.float32)
    for b in range(tl.where(pid < n_active, pid, B), B, n_active):
        if tl.load(seqlens_ptr + b) == 0:
            for hu in range(0, HKV * NUM_GC):
                row0 = (hu % NUM_GC) * BLOCK_G
                h_q = (hu // NUM_GC) * GROUP + row0
                _store_output(out_ptr, lse_ptr, b, h_q, tl.minimum(GROUP - row0, BLOCK_G), b_zero, b_none, b_nol,
                              stride_ob, stride_oh, stride_lb, HEAD_DIM, BLOCK_G)


@triton.jit
def _finish_split(
    ws_acc_ptr, ws_ml_ptr, counter_ptr, unit, pid, slot, out_start, n_tiles, total, n_active, n_rows,
    b_acc, b_m, b_l, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Publish this program's partial of a split output; if it arrives last, merge and return True.

    The barrier makes every thread's partial stores happen before the (single-thread) release
    atomic; the acq_rel atomic orders the merger's later loads after all contributors' releases.
    """
    _store_partial(ws_acc_ptr, ws_ml_ptr, pid * 2 + slot, n_rows, b_acc, b_m, b_l,
                   HEAD_DIM, BLOCK_G)  # fmt: skip
    tl.debug_barrier()
    p_first = _program_of_tile(out_start, total, n_active)
    p_last = _program_of_tile(out_start + n_tiles - 1, total, n_active)
    arrived = tl.atomic_add(counter_ptr + unit, 1, sem="acq_rel", scope="gpu")
    is_last = arrived == p_last - p_first
    if is_last:
        # Leave the counter at zero so the next launch (or CUDA-graph replay) starts clean.
        tl.atomic_xchg(counter_ptr + unit, 0, sem="relaxed", scope="gpu")
        b_acc, b_m, b_l = _merge_partials(
            ws_acc_ptr, ws_ml_ptr, out_start, p_first, p_last, total, n_active, pid, n_rows, b_acc, b_m, b_l,
            HEAD_DIM, BLOCK_G,
        )  # fmt: skip
    return is_last, b_acc, b_m, b_l


@triton.jit
def _seq_base(leftpad_ptr, b, valid, HAS_LEFTPAD: tl.constexpr):
    """Cache position of sequence b's first valid key: its left padding, or 0."""
    if HAS_LEFTPAD:
        return tl.load(leftpad_ptr + b, mask=valid, other=0)
    else:
        return b * 0


@triton.jit
def _load_q(q_ptr, b, hu, valid, stride_qb, stride_qh, dtype: tl.constexpr, GROUP: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, NUM_GC: tl.constexpr):  # fmt: skip
    """The query rows of head unit hu of sequence b ([BLOCK_G, HEAD_DIM] in the cache dtype; zero
    rows past the group), or nothing loaded when not ``valid``."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, HEAD_DIM)
    row0 = (hu % NUM_GC) * BLOCK_G
    h_q = (hu // NUM_GC) * GROUP + row0
    p_q = q_ptr + tl.cast(b, tl.int64) * stride_qb + (h_q + o_g).to(tl.int64)[:, None] * stride_qh + o_d[None, :]
    return tl.load(p_q, mask=((o_g < GROUP - row0) & valid)[:, None], other=0.0).to(dtype)


# Values that change with the batch, the grid or the cache allocation: specializing on them (a
# value of 1 becomes a constant, multiples of 16 get an attribute) would compile a new kernel for
# each; STRIDE_ALIGN restores the alignment facts the vector loads need.
_NOT_SPECIALIZED = [
    "B", "HKV", "num_programs", "stride_qb", "stride_qh", "stride_kb", "stride_kn", "stride_kh",
    "stride_vb", "stride_vn", "stride_vh", "stride_bt",
]  # fmt: skip


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def decode_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, leftpad_ptr, bt_ptr, out_ptr, lse_ptr, ws_acc_ptr, ws_ml_ptr, counter_ptr,
    scale_log2, B, HKV, num_programs,
    stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, NUM_GC: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MIN_TILES: tl.constexpr, BLOCK_B: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
):  # fmt: skip
    """One persistent program of the stream-K grid; see schedule.py for the tile order.

    seqlens_ptr holds each sequence's number of valid keys; with HAS_LEFTPAD they start at cache
    position leftpad_ptr[b] instead of 0 (left-padded batches). STRIDE_ALIGN divides every q and
    K/V stride (the launcher checks); dividing and multiplying by it is exact and lets the
    compiler prove the alignment (``tl.multiple_of`` does not attach to scalar arguments).
    """
    stride_qb = stride_qb // STRIDE_ALIGN * STRIDE_ALIGN
    stride_qh = stride_qh // STRIDE_ALIGN * STRIDE_ALIGN
    stride_kb = stride_kb // STRIDE_ALIGN * STRIDE_ALIGN
    stride_kn = stride_kn // STRIDE_ALIGN * STRIDE_ALIGN
    stride_kh = stride_kh // STRIDE_ALIGN * STRIDE_ALIGN
    stride_vb = stride_vb // STRIDE_ALIGN * STRIDE_ALIGN
    stride_vn = stride_vn // STRIDE_ALIGN * STRIDE_ALIGN
    stride_vh = stride_vh // STRIDE_ALIGN * STRIDE_ALIGN
    # out and lse are contiguous (the launcher allocates or checks them): strides from the shape.
    stride_lb = HKV * GROUP
    stride_ob = stride_lb * HEAD_DIM
    stride_oh = HEAD_DIM
    pid = tl.program_id(0)
    HU = HKV * NUM_GC
    b_cum, total = _scan_batch(seqlens_ptr, B, HU, TILE_N, BLOCK_B)
    n_active = _num_active(total, num_programs, MIN_TILES)
    t0 = _program_start(pid, total, n_active)
    t1 = tl.where(pid < n_active, _program_start(pid + 1, total, n_active), t0)
    # The first segment is placed by one search; each later one is the next head unit, whose
    # place, base and q are requested before the current segment's result is stored or merged.
    b, hu, tile, seq_len = _locate(t0, b_cum, seqlens_ptr, B, HU, TILE_N, BLOCK_B)
    b_q = _load_q(q_ptr, b, hu, t0 < t1, stride_qb, stride_qh, k_ptr.dtype.element_ty, GROUP, HEAD_DIM, BLOCK_G, NUM_GC)
    n_base = _seq_base(leftpad_ptr, b, t0 < t1, HAS_LEFTPAD)
    t = t0
    slot = 0  # workspace slot of this segment's partial: 0 for the program's first segment, else 1
    while t < t1:
        n_tiles = _cdiv(seq_len, TILE_N)
        out_start = t - tile
        seg_end = tl.minimum(t1, out_start + n_tiles)
        b_acc, b_m, b_l = _attend(
            b_q, k_ptr, v_ptr, bt_ptr, b, hu // NUM_GC, n_base, tile * TILE_N,
            tl.minimum((tile + seg_end - t) * TILE_N, seq_len), scale_log2,
            stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
            HEAD_DIM, BLOCK_G, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION,
        )  # fmt: skip
        nb, nhu, n_seq_len = _next_unit(b, hu, seq_len, seqlens_ptr, B, HU, seg_end < t1)
        b_q = _load_q(q_ptr, nb, nhu, seg_end < t1, stride_qb, stride_qh, k_ptr.dtype.element_ty,
                      GROUP, HEAD_DIM, BLOCK_G, NUM_GC)  # fmt: skip
        n_base_next = _seq_base(leftpad_ptr, nb, seg_end < t1, HAS_LEFTPAD)
        row0 = (hu % NUM_GC) * BLOCK_G
        n_rows = tl.minimum(GROUP - row0, BLOCK_G)
        do_store = (tile == 0) & (out_start + n_tiles <= t1)  # the program holds the whole output
        if not do_store:
            do_store, b_acc, b_m, b_l = _finish_split(
                ws_acc_ptr, ws_ml_ptr, counter_ptr, b * HU + hu, pid, slot, out_start, n_tiles,
                total, n_active, n_rows, b_acc, b_m, b_l, HEAD_DIM, BLOCK_G,
            )  # fmt: skip
        if do_store:
            _store_output(out_ptr, lse_ptr, b, (hu // NUM_GC) * GROUP + row0, n_rows, b_acc, b_m, b_l,
                          stride_ob, stride_oh, stride_lb, HEAD_DIM, BLOCK_G)  # fmt: skip
        t, b, hu, tile, seq_len, n_base, slot = seg_end, nb, nhu, tile * 0, n_seq_len, n_base_next, 1
    # Off the critical path: nothing waits on the outputs of empty sequences.
    _write_empty_sequences(pid, n_active, seqlens_ptr, out_ptr, lse_ptr, B, HKV, GROUP, NUM_GC,
                           stride_ob, stride_oh, stride_lb, HEAD_DIM, BLOCK_G)  # fmt: skip
