"""The K/V loop of the decode kernel: one program's un-normalized partial over a range of keys.

Scores are kept in the log2 domain (``qk * scale * log2(e)``, ``exp2``). Every value is upcast to
fp32 right after loading except the ``tl.dot`` operands, which are in q's dtype so tensor cores do
the products (fp32 uses "ieee"; an fp8 cache is converted to q's dtype after loading, and its
scales are folded into the score and output scales).
"""

import os

import triton
import triton.language as tl

E4M3_BITS_SCALE = tl.constexpr(256.0)  # see _upcast
# Read when the module is imported, as ``triton.jit`` reads it; compiled kernels never see the branch.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# The Triton interpreter computes bf16 arithmetic wrongly (numpy has no bf16; its loads, stores and
# conversions are exact), so there q is upcast on loading and the dots take fp32 operands.
BF16_DOTS_IN_FP32 = INTERPRETED


@triton.jit
def ref_max(b_m, MAY_BE_EMPTY: tl.constexpr):
    """The running max to exponentiate against: m, or 0 for rows that have seen no key (m = -inf,
    possible only with MAY_BE_EMPTY), so that exp2(-inf - ref) = 0 instead of NaN."""
    if MAY_BE_EMPTY:
        return tl.where(b_m == float("-inf"), 0.0, b_m)
    else:
        return b_m


@triton.jit
def _kv_index(
    bt_ptr,
    b,
    n_first,
    o_n,
    m_n,
    stride_bt,
    num_pages,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_IN_PAGE: tl.constexpr,
):
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
        # An id outside [0, num_pages) reads the pool's last page instead (its sequence's result is
        # made NaN by attend_segment): one unsigned min, since a negative id is a huge unsigned one.
        # A compare feeding the loads' masks costs more, and feeding a flag makes the pipeliner
        # load the ids a second time in the iteration that reads them (docs/design.md).
        last = (num_pages - 1).to(tl.uint32, bitcast=True)
        o_page = tl.minimum(o_page.to(tl.uint32, bitcast=True), last).to(tl.int32, bitcast=True)
        o_row, o_pos = tl.cast(o_page, tl.int64), tl.cast(o_n & (PAGE_SIZE - 1), tl.int64)
    else:
        o_row, o_pos = tl.cast(b, tl.int64), tl.cast(o_n, tl.int64)
    return o_row, o_pos


# Page ids ``_has_bad_page`` compares at once: 4 per thread of a 4-warp program.
SCAN_PAGES = tl.constexpr(512)


@triton.jit
def _has_bad_page(bt_ptr, b, c_lo, c_hi, stride_bt, num_pages):
    """Whether a page id in columns [c_lo, c_hi) of sequence b's block table lies outside
    [0, num_pages). Called after the K/V loop, which copied the same ids with ``cp.async.ca``
    (cached in L1 as well as L2): one L1 or L2 round trip per SCAN_PAGES ids."""
    n_pages = num_pages.to(tl.uint32, bitcast=True)
    bt_row = bt_ptr + tl.cast(b, tl.int64) * stride_bt
    bad = 0
    for c0 in range(c_lo, c_hi, SCAN_PAGES):
        o_c = c0 + tl.arange(0, SCAN_PAGES)
        b_ids = tl.load(bt_row + o_c, mask=o_c < c_hi, other=0)
        bad = tl.maximum(bad, tl.max((b_ids.to(tl.uint32, bitcast=True) >= n_pages).to(tl.int32), 0))
    return bad != 0


@triton.jit
def load_rows(p, m_rows, o_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load [rows, BLOCK_D] at pointers p, zero for masked rows and for the padding past HEAD_DIM."""
    if HEAD_DIM == BLOCK_D:  # no column mask: keeps the loads' vector width provable
        x = tl.load(p, mask=m_rows[:, None], other=0.0)
    else:
        x = tl.load(p, mask=m_rows[:, None] & (o_d < HEAD_DIM)[None, :], other=0.0)
    return x


@triton.jit
def other_cols(d_own, BLOCK_D: tl.constexpr):
    """The first of V's columns that the other of two column blocks holds, where this one's
    first is d_own (``rows.unit_cols``)."""
    return BLOCK_D - d_own


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
def e4m3_words_to_f16(w):
    """[R, C] int32, four float8_e4m3fn bytes per word (little-endian) -> [R, 4 C] fp16, each
    value x 2^-8 as ``_upcast`` makes it, two values per 32-bit operation: the odd bytes (each
    16-bit half's high byte) move right by 1, the even bytes left by 7 (8 for the sign). On sm_80
    that is 9 instructions per word (4 LOP3, 3 shifts, 2 PRMT pairing the halves), 2.25 per
    value against 3.3 for bytes. The NaN codes become +-1.875 (a KV cache holds none)."""
    w = w.to(tl.uint32, bitcast=True)
    odd = (w & 0x80008000) | ((w >> 1) & 0x3F803F80)
    even = ((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80)
    # [R, C, a, c] holds byte 2a + c of word C: the bytes back in cache order.
    x = tl.join(
        tl.join(even.to(tl.uint16), (even >> 16).to(tl.uint16)), tl.join(odd.to(tl.uint16), (odd >> 16).to(tl.uint16))
    )
    return tl.reshape(x, (w.shape[0], 4 * w.shape[1])).to(tl.float16, bitcast=True)


# Four float8_e4m3fn bytes (one 32-bit register, the first in the low byte) to four bf16 (two
# registers, the first two in the first), exactly and without the conversion unit, which issues 16
# results a clock an SM (CUDA C++ Programming Guide, arithmetic instruction throughput, compute
# capability 9.0) and which Triton's conversion uses 1.5 times a value (e4m3 to fp16 a pair, fp16
# to bf16 a value): each byte to the high byte of a 16-bit lane (prmt), its 7 low bits shifted to
# bf16's bits 4..10 and its sign kept at bit 15, which is the bf16 of the value x 2^-120
# (subnormals included, as bf16 subnormals); then times 2^120 (0x7B80) plus -0 (0x8000, which
# keeps a zero's sign) by a bf16x2 fma (sm_80 on), which takes subnormal inputs. The NaN codes
# become +-480 (a KV cache holds none). tests/test_mla_decode_gluon.py runs these instructions on
# all 256 codes.
E4M3_TO_BF16_ASM = tl.constexpr("""{
.reg .b32 a0, a1, b0, b1, c, z;
prmt.b32 a0, 0, $2, 0x5140;
prmt.b32 a1, 0, $2, 0x7362;
and.b32 b0, a0, 0x7f007f00;
and.b32 b1, a1, 0x7f007f00;
shr.b32 b0, b0, 4;
shr.b32 b1, b1, 4;
lop3.b32 b0, b0, a0, 0x80008000, 0xf8;
lop3.b32 b1, b1, a1, 0x80008000, 0xf8;
mov.b32 c, 0x7b807b80;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, b0, c, z;
fma.rn.bf16x2 $1, b1, c, z;
}""")


@triton.jit
def e4m3_to_bf16(x):
    """float8_e4m3fn values as bf16 (``E4M3_TO_BF16_ASM``), a tile read in 16-byte rows converted
    as a whole: the asm is opaque to Triton, which would otherwise convert it as it loads a dot
    operand (``_opaque``)."""
    return tl.inline_asm_elementwise(E4M3_TO_BF16_ASM, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=4)


@triton.jit
def _upcast(x, dtype: tl.constexpr, E4M3_BITS: tl.constexpr):
    """K/V values in q's dtype. With E4M3_BITS, x holds float8_e4m3fn values (Triton has no e4m3
    type before sm_89) as int32 words of four (``launch_args.e4m3_operands``: where the caches'
    offsets and strides allow) or as uint8. A value's sign at an fp16's bit 15 and its 7 low bits
    at bits 7..13 is the fp16 of value x 2^-8 exactly, subnormals included (the caller multiplies
    the scales by E4M3_BITS_SCALE = 2^8): a byte gets there sign-extended, shifted left by 7, with
    bit 14 cleared; words through ``e4m3_words_to_f16``. A float8_e4m3fn tile for a bf16 q is
    converted by ``e4m3_to_bf16`` where compiled."""
    if E4M3_BITS and x.dtype == tl.int32:
        x = _opaque(e4m3_words_to_f16(x).to(dtype))
    elif x.dtype == tl.float8e4nv and dtype == tl.bfloat16 and not INTERPRETED:
        x = e4m3_to_bf16(x)
    elif x.dtype.primitive_bitwidth == 8:
        if E4M3_BITS:
            x = ((x.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16385).to(tl.float16, bitcast=True)
        x = _opaque(x.to(dtype))
    return x.to(dtype)


@triton.jit
def _per_row(x, SCORES_T: tl.constexpr):
    """x [BLOCK_G] (one value a query row) broadcast against the scores."""
    if SCORES_T:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _per_key(x, SCORES_T: tl.constexpr):
    """x [BLOCK_N] (one value a key) broadcast against the scores."""
    if SCORES_T:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def q_operands(b_q, b_qo, b_qt, SCORES_T: tl.constexpr):
    """q's dot operands for the K/V loop (``rows.load_q``'s b_q, b_qo, b_qt), transposed with
    SCORES_T.

    Called before the loop: the transpose of a value held in registers is a copy through shared
    memory, which Triton then keeps for the loop's dots to read (one copy per segment); a
    transpose inside the loop copies q there on every block (sm_90, 64-row blocks: 290 local
    accesses an iteration; kernel report)."""
    if SCORES_T:
        return tl.trans(b_q), tl.trans(b_qo), tl.trans(b_qt)
    else:
        return b_q, b_qo, b_qt


@triton.jit
def _qk(b_q, b_k, b_s, DOT_PRECISION: tl.constexpr, SCORES_T: tl.constexpr):
    """b_s plus q.k of every row of q and key of b_k [BLOCK_N, C]: b_q is q [BLOCK_G, C], and
    the scores [BLOCK_G, BLOCK_N]; with SCORES_T b_q is q^T [C, BLOCK_G] (``q_operands``) and the
    scores K q^T [BLOCK_N, BLOCK_G]."""
    if SCORES_T:
        return tl.dot(b_k, b_q, b_s, input_precision=DOT_PRECISION)
    else:
        return tl.dot(b_q, tl.trans(b_k), b_s, input_precision=DOT_PRECISION)


@triton.jit
def attend_block(
    b_acc,
    b_m,
    b_l,
    b_q,
    b_qo,
    b_qt,
    k_ptr,
    v_ptr,
    bt_ptr,
    b,
    h_kv,
    d_own,
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    NUM_VC: tl.constexpr,
):
    """The state (acc [BLOCK_G, BLOCK_D], m, l [BLOCK_G]) after keys [n0, min(n0 + BLOCK_N, n_hi))
    are added to it: one iteration of the K/V loop (``attend_segment`` gives the arguments)."""
    # A cache of 4-byte words (E4M3_BITS, see _upcast) has a quarter of the columns.
    PER_COL: tl.constexpr = 4 if k_ptr.dtype.element_ty == tl.int32 else 1
    UNIT_D: tl.constexpr = HEAD_DIM // NUM_VC  # V's columns of the head unit
    o_d = tl.arange(0, BLOCK_D // PER_COL)
    o_n = n0 + tl.arange(0, BLOCK_N)
    m_n = o_n < n_hi
    # Page ids looked up for this block (one per key, or one for the block with BLOCK_IN_PAGE):
    # the pipeliner requests them a stage ahead of the K/V copies they address (launched with
    # DecodeConfig.paged_stages). The lookup is shared by K and V, and with SAME_KV_STRIDES the
    # addresses too.
    o_row, o_pos = _kv_index(
        bt_ptr, b, n_base + n0, n_base + o_n, m_n, stride_bt, num_pages, PAGED, PAGE_SIZE, BLOCK_IN_PAGE
    )
    o_k = o_row * stride_kb + o_pos * stride_kn + tl.cast(h_kv, tl.int64) * stride_kh
    p_k = k_ptr + o_k[:, None] + d_own // PER_COL + o_d[None, :]
    o_v = o_row * stride_vb + o_pos * stride_vn + tl.cast(h_kv, tl.int64) * stride_vh
    p_v = v_ptr + o_v[:, None] + d_own // PER_COL + o_d[None, :]
    b_k = _upcast(load_rows(p_k, m_n, o_d, UNIT_D // PER_COL, BLOCK_D // PER_COL), b_q.dtype, E4M3_BITS)
    b_s = _qk(b_q, b_k, None, DOT_PRECISION, SCORES_T)
    if NUM_VC == 2:
        # The other column block's part of the score, added to this one's: a sum the two blocks
        # form alike (addition commutes), so their scores, m and l are the same bits.
        p_ko = k_ptr + o_k[:, None] + other_cols(d_own, BLOCK_D) // PER_COL + o_d[None, :]
        b_ko = _upcast(load_rows(p_ko, m_n, o_d, BLOCK_D // PER_COL, BLOCK_D // PER_COL), b_q.dtype, E4M3_BITS)
        b_s = b_s + _qk(b_qo, b_ko, None, DOT_PRECISION, SCORES_T)
    if HEAD_DIM_T > 0:
        o_dt = tl.arange(0, BLOCK_DT // PER_COL)
        p_kt = k_ptr + o_k[:, None] + (HEAD_DIM // PER_COL + o_dt)[None, :]
        b_kt = _upcast(load_rows(p_kt, m_n, o_dt, HEAD_DIM_T // PER_COL, BLOCK_DT // PER_COL), b_q.dtype, E4M3_BITS)
        b_s = _qk(b_qt, b_kt, b_s, DOT_PRECISION, SCORES_T)
    b_s = b_s * qk_scale
    if SOFTCAP:
        b_s = cap_log2 * (1.0 - 2.0 / (tl.exp2(b_s) + 1.0))
    if ROW_MASK:
        o_nk = _per_key(o_n, SCORES_T)
        m_s = _per_key(m_n, SCORES_T) & (o_nk >= _per_row(b_lo, SCORES_T)) & (o_nk < _per_row(b_hi, SCORES_T))
    else:
        m_s = _per_key(m_n, SCORES_T)
    ROW_AXIS: tl.constexpr = 0 if SCORES_T else 1  # the scores' axis of keys, reduced per row
    b_s = tl.where(m_s, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, ROW_AXIS))
    b_m_ref = ref_max(b_m_new, ROW_MASK)
    b_alpha = tl.exp2(b_m - b_m_ref)
    b_p = tl.exp2(b_s - _per_row(b_m_ref, SCORES_T))
    b_l = b_l * b_alpha + tl.sum(b_p, ROW_AXIS)
    if V_IN_K:
        b_v = b_k
    else:
        b_v = _upcast(load_rows(p_v, m_n, o_d, UNIT_D // PER_COL, BLOCK_D // PER_COL), b_q.dtype, E4M3_BITS)
    b_p = b_p.to(b_q.dtype)
    if SCORES_T:  # P.V's A operand is [BLOCK_G, BLOCK_N]
        b_p = tl.trans(b_p)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision=DOT_PRECISION)
    return b_acc, b_m_new, b_l


@triton.jit
def bad_pages(bt_ptr, b, n_base, n_lo, n_hi, stride_bt, num_pages, PAGE_SIZE: tl.constexpr):
    """Whether the page of a key in [n_lo, n_hi) (cache positions from n_base) lies outside
    [0, num_pages): ``_has_bad_page`` over the block-table columns of those keys."""
    PAGE_SHIFT: tl.constexpr = PAGE_SIZE.bit_length() - 1
    c_lo, c_hi = (n_base + n_lo) >> PAGE_SHIFT, ((n_base + n_hi - 1) >> PAGE_SHIFT) + 1
    return _has_bad_page(bt_ptr, b, c_lo, c_hi, stride_bt, num_pages)


@triton.jit
def attend_segment(
    b_q,
    b_qo,
    b_qt,
    k_ptr,
    v_ptr,
    bt_ptr,
    b,
    h_kv,
    d_own,
    n_base,
    n_lo,
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    NUM_VC: tl.constexpr,
):
    """Un-normalized partial (acc [BLOCK_G, BLOCK_D], m [BLOCK_G], l [BLOCK_G]) over keys [n_lo, n_hi).

    Key i sits at cache position n_base + i. V has HEAD_DIM columns, K those and HEAD_DIM_T more
    (MLA's rope dims; b_qt holds q's, ``rows.load_q``): the score takes both dots. With NUM_VC = 2
    the partial holds V's columns [d_own, d_own + BLOCK_D) (b_q's), and the score adds the other
    half's product (b_qo's) to this half's, so both column blocks compute the same scores, m and
    l. With V_IN_K, V is K's first HEAD_DIM columns (a latent cache): the K tile loaded for the
    score is the V tile, so each key's row is read once for both products. With ROW_MASK (several query tokens) row g sees only
    keys [b_lo[g], b_hi[g]), so a row may see none of a block or of the whole range: its m stays
    -inf and its l 0, and its exponentials are taken against 0 instead of -inf. Without it every
    row sees every key, and the caller guarantees n_lo < n_hi, so m is finite after the first block.
    With SOFTCAP, qk_scale is 2 log2(e) scale / softcap and the score is
    ``cap_log2 * tanh(..)`` written with exp2: tanh(x) = 1 - 2 / (e^{2x} + 1).

    Paged: a page id outside [0, num_pages) is never used as an address (``_kv_index`` reads the
    pool's last page in its place), and a range with such an id gives acc and l NaN (m as
    computed), which every merge and fold carries into the output and its lse: a bad block table
    poisons its own sequence, and no other output reads this partial. ``_has_bad_page`` finds
    such ids after the K/V loop, which holds no value for it.
    """
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    b_q, b_qo, b_qt = q_operands(b_q, b_qo, b_qt, SCORES_T)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        b_acc, b_m, b_l = attend_block(
            b_acc,
            b_m,
            b_l,
            b_q,
            b_qo,
            b_qt,
            k_ptr,
            v_ptr,
            bt_ptr,
            b,
            h_kv,
            d_own,
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
            NUM_VC,
        )
    if PAGED:
        bad = bad_pages(bt_ptr, b, n_base, n_lo, n_hi, stride_bt, num_pages, PAGE_SIZE)
        b_l = tl.where(bad, float("nan"), b_l)
        b_acc = tl.where(bad, float("nan"), b_acc)
    return b_acc, b_m, b_l


@triton.jit
def kv_scale(scale_ptr, h_kv, stride, HAS_SCALES: tl.constexpr, E4M3_BITS: tl.constexpr):
    """fp8 scale of KV head h_kv (stride 0: one for the tensor) in the units ``_upcast`` leaves
    values in; 1 without scales."""
    if HAS_SCALES:
        scale = tl.load(scale_ptr + h_kv * stride)
        if E4M3_BITS:
            scale = scale * E4M3_BITS_SCALE
    else:
        scale = 1.0
    return scale
