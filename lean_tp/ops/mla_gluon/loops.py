"""A segment's K/V loops of the Gluon MLA kernel (``kernel._segment`` calls one): the serial loop
the H200 measured (``blocks_serial``, 16-bit and e4m3 pools) and the overlapped one
(``blocks_overlapped``, 16-bit pools, ``launcher.OVERLAP``), with the steps they share: a block's
copy and wait, its score, its softmax and its P.V."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lean_tp.ops.mla_gluon.tiles import convert_block, cta_barrier, tma_load, zero_rows_from


@gluon.jit
def blocks_overlapped(
    kn_desc, kr_desc, qn_smem, qr_smem, bufs, p_smem, pages, n_blocks, last_valid, done, scale_log2, zero, m_i, l_i, acc,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """``_segment``'s blocks from a 16-bit pool, each block's score issued right behind the P.V of
    the block before it: the tensor cores take the two products back to back, and the buffer that
    P.V read is reloaded while the score computes. The row sums stay per key (``_softmax``), the row
    max is exchanged between the groups with one barrier (``_row_max``), and q's rope columns are
    read into registers once a segment (the score's A operand: 16 registers a thread, 256 bytes of
    shared-memory reads a key less). Every block but the segment's last is whole: no mask.
    ``zero``: 0, q's index in the loop (``_fixed_index``)."""
    kn_smem, kr_smem, kn_bars, kr_bars = bufs
    first = done % STAGES
    _wait_block(kn_bars, kr_bars, done, STAGES)
    s_layout: gl.constexpr = m_i.type.layout.parent
    mx_smem = _row_max_buffer()
    q_rope = qr_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    fence_async_shared()  # this read before the next segment's TMA copy of q into the buffer
    s_tok = _score(qn_smem.index(0), q_rope, kn_smem.index(first), kr_smem.index(first), s_layout)
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    for j in range(n_blocks - 1):
        slot = (done + j) % STAGES
        nslot = (done + j + 1) % STAGES
        nxt = j + STAGES
        # The page of block j + STAGES, loaded into this block's buffer once its P.V is done.
        nxt_row = gl.load(pages + nxt, mask=nxt < n_blocks, other=0) * BLOCK_N
        m_i, l_i, alpha = _softmax(scores, m_i, l_i, p_smem, BLOCK_N, scale_log2, False, mx_smem)
        acc = _rescale(acc, alpha)
        o_tok = warpgroup_mma(p_smem, kn_smem.index(slot), acc, is_async=True)
        _wait_block(kn_bars, kr_bars, done + j + 1, STAGES)
        q = qn_smem.index(_fixed_index(j, zero, True))
        s_tok = _score(q, q_rope, kn_smem.index(nslot), kr_smem.index(nslot), s_layout)
        # P.V was committed before the score's two products: with those two outstanding it is done.
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(o_tok,))
        cta_barrier()  # both groups are done with this block and with P
        copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, nxt_row, nxt < n_blocks)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    # Its rows past the sequence's end zeroed before P.V reads them (the score's are masked).
    last = (done + n_blocks - 1) % STAGES
    if last_valid < BLOCK_N:
        zero_rows_from(kn_smem.index(last), last_valid)
    m_i, l_i, alpha = _softmax(scores, m_i, l_i, p_smem, last_valid, scale_log2, True, mx_smem)
    acc = _rescale(acc, alpha)
    o_tok = warpgroup_mma(p_smem, kn_smem.index(last), acc, is_async=True)
    return m_i, l_i, warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))


@gluon.jit
def blocks_serial(
    kn_desc, kr_desc, qn_smem, qr_smem, bufs, p_smem, cvt, pages, n_blocks, last_valid, done, scale_log2,
    zero, m_i, l_i, acc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
):  # fmt: skip
    """``_segment``'s blocks, each block's score after the P.V before it. A 16-bit block's buffer is
    reloaded once both groups are done with its P.V; an e4m3 block is converted into ``cvt`` (bf16
    latent and rope parts), which both products read, and its buffer reloaded as soon as it is
    converted, and its row max exchanged between the groups with one barrier (``_row_max``; the
    16-bit loop keeps the reduction the H200 measured). Every block but the segment's last is
    whole: no mask. ``zero``: 0 (``_fixed_index``)."""
    kn_smem, kr_smem, kn_bars, kr_bars = bufs
    mx_smem = None
    if FP8:
        mx_smem = _row_max_buffer()
    for j in range(n_blocks - 1):
        slot = (done + j) % STAGES
        nxt = j + STAGES
        nxt_row = gl.load(pages + nxt, mask=nxt < n_blocks, other=0) * BLOCK_N
        _wait_block(kn_bars, kr_bars, done + j, STAGES)
        z = _fixed_index(j, zero, FP8)
        kv = (kn_smem.index(slot), kr_smem.index(slot))
        if FP8:
            copy = _copy_of(cvt, z)
            convert_block(kv[0], kv[1], copy[0], copy[1], BLOCK_N, False)
            copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, nxt_row, nxt < n_blocks)
            kv = copy
        q = qn_smem.index(z)
        m_i, l_i, acc = _attend_block(q, qr_smem, kv, p_smem, m_i, l_i, acc, BLOCK_N, scale_log2, False, mx_smem)
        cta_barrier()  # both groups are done with the block (or its copy) and with P
        if not FP8:
            copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, nxt_row, nxt < n_blocks)
    last = done + n_blocks - 1
    _wait_block(kn_bars, kr_bars, last, STAGES)
    kv = (kn_smem.index(last % STAGES), kr_smem.index(last % STAGES))
    if FP8:
        copy = _copy_of(cvt, 0)
        convert_block(kv[0], kv[1], copy[0], copy[1], last_valid, True)
        kv = copy
    elif last_valid < BLOCK_N:  # a whole block (most segments' last) has no row to zero
        zero_rows_from(kv[0], last_valid)
    return _attend_block(qn_smem.index(0), qr_smem, kv, p_smem, m_i, l_i, acc, last_valid, scale_log2, True, mx_smem)


@gluon.jit
def _fixed_index(j, zero, RUNTIME: gl.constexpr):
    """Iteration j's index into a buffer the products read at one address (q's latent columns,
    [1, 64, 512]; an e4m3 block's bf16 copy): 0, or with ``RUNTIME`` j & zero, a 0 the compiler
    cannot fold. At a constant index the operand descriptors of the block's 40 HGMMAs (64 bits
    each) are loop invariant: LLVM computes them all before the loop and ptxas keeps them in
    registers or spills them (the e4m3 loop: 18 local accesses an iteration on triton 3.7.1, 7 on
    3.6, 34 on 3.9; the overlapped loop: 18 on 3.9); from ``j & zero`` they are formed in the loop
    (by uniform adds on 3.6 and 3.7.1). The 16-bit serial loop keeps 0: the form the H200
    measured."""
    if RUNTIME:
        return j & zero
    else:
        return 0


@gluon.jit
def _copy_of(cvt, z):
    """The bf16 copy of an e4m3 block (``cvt``: [1, BLOCK_N, 512] and [1, BLOCK_N, 64]) at index
    ``z`` (``_fixed_index``)."""
    return cvt[0].index(z), cvt[1].index(z)


@gluon.jit
def _attend_block(qn_smem, qr_smem, kv, p_smem, m_i, l_i, acc, valid, scale_log2, MASK: gl.constexpr, mx_smem=None):
    """One block (``kv``: its latent and rope parts in shared memory) into the running (m_i, l_i,
    acc), its score and P.V in series."""
    s_layout: gl.constexpr = m_i.type.layout.parent  # a layout passes as a constexpr (triton 3.6)
    s_tok = _score(qn_smem, qr_smem, kv[0], kv[1], s_layout)
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    m_i, l_i, alpha = _softmax(scores, m_i, l_i, p_smem, valid, scale_log2, MASK, mx_smem)
    acc = _rescale(acc, alpha)
    o_tok = warpgroup_mma(p_smem, kv[0], acc, is_async=True)
    return m_i, l_i, warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))


# A [64, 2] fp32 tensor of the two warp groups' row maxima with both of a row's in each thread
# that holds the row in the score's layout (warps [4, 2], instr_shape [16, 32, 16]: rows 1, 2, 4
# by lanes 2-4, 8 by register, 16 and 32 by warps 0-1; the group by warp 2).
_ROW_PAIR = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [0, 0]],
        block_bases=[],
        shape=[64, 2],
    )
)


@gluon.jit
def _row_max_buffer():
    """``_row_max``'s exchange: [64, 2] fp32 in shared memory, a row's maximum of each warp group."""
    return gl.allocate_shared_memory(gl.float32, [64, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.jit
def _row_max(scores, mx_smem):
    """The row max of a [64, 64] block of scores split by keys over the two warp groups: each
    group's over its own 32 keys within its warps, exchanged through ``mx_smem`` ([64, 2] fp32)
    with one CTA barrier, where the reduction across warps Gluon compiles takes two. The caller
    writes ``mx_smem`` again only past a barrier of its own (``_softmax``'s, after P)."""
    part = gl.max(gl.reshape(scores, [64, 2, 32]), axis=2)
    mx_smem.store(part)
    cta_barrier()
    both = mx_smem.load(_ROW_PAIR)
    return gl.convert_layout(gl.max(both, axis=1), gl.SliceLayout(1, scores.type.layout))


@gluon.jit
def _rescale(acc, alpha):
    """The output's rows ([64, 256] a warp group) times their rescale (``_softmax``'s alpha)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)


@gluon.jit
def _wait_block(kn_bars, kr_bars, i, STAGES: gl.constexpr):
    """Until the program's block ``i`` (counted over its segments) has landed in buffer i % STAGES."""
    mbarrier.wait(kn_bars.index(i % STAGES), (i // STAGES) & 1)
    mbarrier.wait(kr_bars.index(i % STAGES), (i // STAGES) & 1)


@gluon.jit
def copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, row, pred):
    """The 64 cache rows from ``row`` into buffer ``slot`` (latent and rope columns, a barrier each),
    when ``pred``."""
    DV: gl.constexpr = 512
    mbarrier.expect(kn_bars.index(slot), kn_desc.block_type.nbytes, pred=pred)
    mbarrier.expect(kr_bars.index(slot), kr_desc.block_type.nbytes, pred=pred)
    tma_load(kn_desc, [row, 0], kn_bars.index(slot), kn_smem.index(slot), pred=pred)
    tma_load(kr_desc, [row, DV], kr_bars.index(slot), kr_smem.index(slot), pred=pred)


@gluon.jit
def _score(qn_smem, q_rope, kn, kr, s_layout: gl.constexpr):
    """S = q K^T of one block (q's latent columns from shared memory, its rope columns ``q_rope``
    from shared memory or registers; the K tile viewed [D, BLOCK_N]), issued: the token of its two
    products (latent and rope columns)."""
    N: gl.constexpr = kn.shape[0]
    s_zero = gl.zeros([64, N], gl.float32, s_layout)
    s_tok = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(q_rope, kr.permute((1, 0)), s_tok, is_async=True)


@gluon.jit
def _softmax(scores, m_i, l_i, p_smem, valid, scale_log2, MASK: gl.constexpr, mx_smem=None):
    """A block's scores into the running row max ``m_i`` (log2 units) and row sums ``l_i``, and P
    (bf16) into ``p_smem`` for both groups' P.V; ``MASK``: keys from ``valid`` on at -inf. The row
    max is exchanged by hand through ``mx_smem`` (``_row_max``) where one is given. Row sums
    of shape [64] are added up each block, a sum across the two warp groups (three CTA barriers
    compiled); of shape [64, BLOCK_N] they stay per key, each group's own, rescaled with the rows,
    and ``_store`` adds them up once. Returns (m, l, the rows' rescale)."""
    s_layout: gl.constexpr = scores.type.layout
    scores = scores * scale_log2
    if MASK:
        cols = gl.arange(0, scores.shape[1], layout=gl.SliceLayout(0, s_layout))
        scores = gl.where(gl.expand_dims(cols < valid, 0), scores, float("-inf"))
    if mx_smem is None:
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
    else:
        m_new = gl.maximum(m_i, _row_max(scores, mx_smem))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(scores - gl.expand_dims(m_new, 1))
    if len(l_i.shape) == 2:
        l_i = l_i * gl.expand_dims(alpha, 1) + p
    else:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    cta_barrier()
    return m_new, l_i, alpha
