"""MLA decode for sm_90 in Gluon: lean's stream-K schedule over 64-row blocks of query rows, with
the layouts Triton's own choice does not give (docs/mla.md).

A head unit is 64 query rows of one sequence (DP attention's 128 heads are two); its tiles are the
sequence's 64-key blocks, each one page of a pool of 64-row pages (FlashMLA's page size) read
through a block table. Program p walks its tiles ``[t0, t1)`` of the schedule
(``schedule.program_ranges_kernel`` writes where it starts), a segment an output: q (64 x 576
bf16: 512 latent and 64 rope columns) copied to shared memory by TMA, the segment's blocks
copied by TMA into two buffers, each block's copy issued while the block before it computes. The
two warp groups split every product by columns (``NVMMADistributedLayout`` with warps [4, 2]): the
score S = q K^T (each group 32 of the 64 keys, q read from shared memory by ``warpgroup_mma``),
and P.V (each group 256 of the 512 output columns, P through shared memory, V the block's latent
columns). An output no other program shares is stored normalized in bf16 with its lse; a split
one's fp32 partial goes to the program's workspace slot for ``combine.mla_combine_kernel``.

An e4m3 pool (``FP8``) is copied in bytes, half a 16-bit block's, into the same two buffers; all
8 warps convert each block into one bf16 copy (exact: every e4m3 value is a bf16 one), which both
products read as they read a 16-bit block, and the block's buffer is reloaded as soon as it is
converted. The two 36 KB buffers and the 72 KB copy take the shared memory two 72 KB buffers take.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lean_tp.ops.decode_attention.attend import E4M3_TO_BF16_ASM
from lean_tp.ops.decode_attention.schedule import RANGE_FIELDS, cdiv, next_unit, program_of_tile

# The CTA barrier is gl.thread_barrier in triton 3.6 and gl.barrier from 3.7 (inside a
# warp-specialized partition, a barrier of the partition's warps).
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# A TMA load is tma.async_load from triton 3.8 (3.9 removes async_copy_global_to_shared), and
# tma.async_copy_global_to_shared before it; the arguments are the same.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def mla_decode_gluon_kernel(
    qn_desc,
    qr_desc,
    kn_desc,
    kr_desc,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    range_ptr,
    seqlens_ptr,
    block_table_ptr,
    table_stride,
    B,
    scale_log2,
    HU: gl.constexpr,
    LANES: gl.constexpr,
    TQ: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    FP8: gl.constexpr,
):
    """q rows of head unit (b, hu): [64 (b HU + hu), +64) of qn_desc ([R, 512] blocks) and qr_desc
    ([R, 64] at column 512); key j of sequence b on page block_table[b, j // 64] of the pool
    (kn_desc: [pages x 64, 512] blocks, kr_desc: [pages x 64, 64] at column 512; V is the latent
    columns), seqlens[b] keys. Outputs: out [R, 512] bf16 and lse [R] fp32 (natural log) of the
    outputs this program holds whole; part_out [programs, 2, 64, 512] and part_lse
    [programs, 2, 64] fp32 of the split ones, in slot 0 for the program's first segment and 1 for
    its last. Rows are (token, head) of TQ query tokens a sequence, HU // TQ units a token; token t
    sees keys [0, seqlens[b] - TQ + t]. scale_log2: the softmax scale times log2(e). ``FP8``: the
    pool is float8_e4m3fn (the descriptors' type), each row's value its bytes times k_scale[0] in
    the score and v_scale[0] in the output (both fp32); each block is converted to bf16 in shared
    memory before its products (``_convert_block``)."""
    M: gl.constexpr = 64
    DV: gl.constexpr = 512
    # Warp group g computes keys [g BLOCK_N / 2, (g + 1) BLOCK_N / 2) of the score and columns
    # [256 g, 256 g + 256) of the output (128 fp32 registers a thread).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DV // 2, 16]
    )
    qn_smem, qr_smem, kn_smem, kr_smem, p_smem, q_bar, kn_bars, kr_bars = _allocate(
        qn_desc, qr_desc, kn_desc, kr_desc, BLOCK_N, STAGES
    )
    # An fp8 pool's blocks land in kn_smem/kr_smem as bytes; both products read a bf16 copy.
    cvt = (kn_smem, kr_smem)
    if FP8:
        cvt = (
            gl.allocate_shared_memory(
                gl.bfloat16, [BLOCK_N, DV], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], gl.bfloat16)
            ),
            gl.allocate_shared_memory(
                gl.bfloat16, [BLOCK_N, 64], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
            ),
        )
        scale_log2 = scale_log2 * gl.load(k_scale_ptr)
    pid = gl.program_id(0)
    place = range_ptr + pid * RANGE_FIELDS
    t0 = gl.load(place + 0)
    t1 = gl.load(place + 1)
    b = gl.load(place + 2)
    hu = gl.load(place + 3)
    tile = gl.load(place + 4)
    seq_len = gl.load(place + 5)
    total = gl.load(place + 6)
    n_active = gl.load(place + 7)
    t = t0
    done = t0 * 0  # blocks this program has consumed: each buffer's barrier phase
    segments = t0 * 0  # q's barrier phase
    while t < t1:
        n_tiles = cdiv(seq_len, BLOCK_N)
        out_start = t - tile
        seg_end = gl.minimum(t1, out_start + n_tiles)
        p_first = program_of_tile(out_start, total, n_active, LANES)
        n_contrib = program_of_tile(out_start + n_tiles - 1, total, n_active, LANES) - p_first + 1
        row0 = (b * HU + hu) * M
        # The unit's query token t (rows are token-major) sees the keys up to its position,
        # seq_len - TQ + t; its blocks are those that hold any of them, every one but the last whole.
        unit_len = gl.maximum(seq_len - (TQ - 1 - hu // (HU // TQ)), 0)
        n_blocks = gl.minimum(gl.maximum(cdiv(unit_len, BLOCK_N) - tile, 0), seg_end - t)
        # Where the result goes, decided before the loop so that nothing else stays live across it.
        split = n_contrib > 1
        dest = gl.where(split, (pid * 2 + (t0 < out_start).to(gl.int32)) * M, row0)
        m_i = gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.full([M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([M, DV], gl.float32, o_layout)
        if n_blocks > 0:
            m_i, l_i, acc = _segment(
                qn_desc, qr_desc, kn_desc, kr_desc, qn_smem, qr_smem, kn_smem, kr_smem, p_smem, q_bar, kn_bars,
                kr_bars, cvt, row0, block_table_ptr + b * table_stride + tile, n_blocks,
                unit_len - (tile + n_blocks - 1) * BLOCK_N, done, segments, scale_log2, m_i, l_i, acc,
                BLOCK_N, STAGES, FP8,
            )  # fmt: skip
            segments += 1
        if split:
            _store(part_out_ptr, part_lse_ptr, dest, m_i, l_i, acc, v_scale_ptr, FP8)
        else:
            _store(out_ptr, lse_ptr, dest, m_i, l_i, acc, v_scale_ptr, FP8)
        done += n_blocks
        t = seg_end
        b, hu, seq_len = next_unit(b, hu, seq_len, seqlens_ptr, B, HU, t < t1, LANES)
        tile = 0
    mbarrier.invalidate(q_bar)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(kn_bars.index(st))
        mbarrier.invalidate(kr_bars.index(st))


@gluon.jit
def _allocate(qn_desc, qr_desc, kn_desc, kr_desc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The program's shared memory: q's two parts, STAGES K/V buffers (latent and rope parts, in
    the pool's type), P, and the copies' barriers, initialized."""
    M: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    kv_type: gl.constexpr = kn_desc.block_type.element_ty
    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [M, DV], qn_desc.layout)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [M, DR], qr_desc.layout)
    kn_smem = gl.allocate_shared_memory(kv_type, [STAGES, BLOCK_N, DV], kn_desc.layout)
    kr_smem = gl.allocate_shared_memory(kv_type, [STAGES, BLOCK_N, DR], kr_desc.layout)
    p_smem = gl.allocate_shared_memory(
        gl.bfloat16, [M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([M, BLOCK_N], gl.bfloat16)
    )
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # A barrier per copy: with one for both, the shared-memory barrier pass adds a CTA barrier
    # between the two copies (it counts both as writes to it).
    kn_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kr_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(kn_bars.index(st), count=1)
        mbarrier.init(kr_bars.index(st), count=1)
    fence_async_shared()
    return qn_smem, qr_smem, kn_smem, kr_smem, p_smem, q_bar, kn_bars, kr_bars


@gluon.jit
def _segment(
    qn_desc, qr_desc, kn_desc, kr_desc, qn_smem, qr_smem, kn_smem, kr_smem, p_smem, q_bar, kn_bars, kr_bars,
    cvt, q_row, pages, n_blocks, last_valid, done, segments, scale_log2, m_i, l_i, acc,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
):  # fmt: skip
    """One output's blocks of this program (n_blocks >= 1), folded into (m_i, l_i, acc): the pages
    from ``pages`` against q rows [q_row, q_row + 64), the last block's keys from ``last_valid``
    (1 to 64) on masked and its rows there zeroed; block i uses buffer (done + i) % STAGES. With
    ``FP8`` each block is converted into ``cvt`` (bf16 latent and rope parts), and its buffer
    reloaded as soon as it is converted. Returns (row max in log2 units, row sum, unnormalized
    output)."""
    DV: gl.constexpr = 512
    # The previous segment's blocks and q are read by both warp groups until here.
    cta_barrier()
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma_load(qn_desc, [q_row, 0], q_bar, qn_smem)
    tma_load(qr_desc, [q_row, DV], q_bar, qr_smem)
    for st in gl.static_range(STAGES):
        slot = (done + st) % STAGES
        row = gl.load(pages + st, mask=st < n_blocks, other=0) * BLOCK_N
        _copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, row, st < n_blocks)
    mbarrier.wait(q_bar, phase=segments & 1)

    # Every block but the segment's last is whole: no mask.
    for j in range(n_blocks - 1):
        slot = (done + j) % STAGES
        phase = ((done + j) // STAGES) & 1
        nxt = j + STAGES
        # The page of block j + STAGES, loaded while this block computes.
        nxt_row = gl.load(pages + nxt, mask=nxt < n_blocks, other=0) * BLOCK_N
        mbarrier.wait(kn_bars.index(slot), phase)
        mbarrier.wait(kr_bars.index(slot), phase)
        kn = kn_smem.index(slot)
        kr = kr_smem.index(slot)
        if FP8:
            _convert_block(kn, kr, cvt[0], cvt[1], BLOCK_N, False)
            _copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, nxt_row, nxt < n_blocks)
            kn = cvt[0]
            kr = cvt[1]
        m_i, l_i, acc = _attend_block(
            qn_smem, qr_smem, kn, kr, p_smem, m_i, l_i, acc, BLOCK_N, scale_log2, BLOCK_N, False
        )
        # Both groups are done with the block and with P: block j + STAGES into the slot (an fp8
        # block's: the next block into the bf16 copy).
        cta_barrier()
        if not FP8:
            _copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, nxt_row, nxt < n_blocks)
    last = done + n_blocks - 1
    mbarrier.wait(kn_bars.index(last % STAGES), (last // STAGES) & 1)
    mbarrier.wait(kr_bars.index(last % STAGES), (last // STAGES) & 1)
    kn = kn_smem.index(last % STAGES)
    kr = kr_smem.index(last % STAGES)
    if FP8:
        _convert_block(kn, kr, cvt[0], cvt[1], last_valid, True)
        kn = cvt[0]
        kr = cvt[1]
    elif last_valid < BLOCK_N:  # a whole block (most segments' last) has no row to zero
        zero_rows_from(kn, last_valid)
    return _attend_block(qn_smem, qr_smem, kn, kr, p_smem, m_i, l_i, acc, last_valid, scale_log2, BLOCK_N, True)


@gluon.jit
def _copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, row, pred):
    """The 64 cache rows from ``row`` into buffer ``slot`` (latent and rope columns, a barrier each),
    when ``pred``."""
    DV: gl.constexpr = 512
    mbarrier.expect(kn_bars.index(slot), kn_desc.block_type.nbytes, pred=pred)
    mbarrier.expect(kr_bars.index(slot), kr_desc.block_type.nbytes, pred=pred)
    tma_load(kn_desc, [row, 0], kn_bars.index(slot), kn_smem.index(slot), pred=pred)
    tma_load(kr_desc, [row, DV], kr_bars.index(slot), kr_smem.index(slot), pred=pred)


@gluon.jit
def _attend_block(
    qn_smem, qr_smem, kn, kr, p_smem, m_i, l_i, acc, valid, scale_log2, BLOCK_N: gl.constexpr, MASK: gl.constexpr
):
    """One block of keys into the running (m_i, l_i, acc) of the program's 64 rows: S = q K^T
    (q from shared memory, the K tile viewed [D, BLOCK_N]), with ``MASK`` keys from ``valid`` on
    at -inf, then P.V with P through shared memory (each warp group wrote half its columns and
    reads all of them)."""
    s_layout: gl.constexpr = m_i.type.layout.parent
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_tok = warpgroup_mma(qr_smem, kr.permute((1, 0)), s_tok, is_async=True)
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,)) * scale_log2
    if MASK:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        scores = gl.where(gl.expand_dims(cols < valid, 0), scores, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(scores - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    cta_barrier()
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    o_tok = warpgroup_mma(p_smem, kn, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    return m_new, l_i, acc


@gluon.jit
def _convert_block(kn8, kr8, kn, kr, first, MASK: gl.constexpr):
    """An fp8 block's latent (kn8 [64, 512]) and rope rows (kr8 [64, 64]) converted to bf16 into
    kn and kr (exact: every e4m3 value is a bf16 one), with ``MASK`` rows from ``first`` on zeroed
    (past a sequence's end, as ``zero_rows_from``), by all the CTA's warps: 16 bytes a thread a
    load, the latent rows in column slices of 128 so the registers it needs stay few."""
    COLS: gl.constexpr = 128
    wide: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
    narrow: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, kn8.shape[0], layout=gl.SliceLayout(1, wide))
    for c in gl.static_range(kn8.shape[1] // COLS):
        part = e4m3_to_bf16(kn8.slice(c * COLS, COLS, dim=1).load(wide))
        if MASK:
            part = gl.where(gl.expand_dims(rows < first, 1), part, 0.0)
        kn.slice(c * COLS, COLS, dim=1).store(part)
    rope = e4m3_to_bf16(kr8.load(narrow))
    if MASK:
        rows_r = gl.arange(0, kr8.shape[0], layout=gl.SliceLayout(1, narrow))
        rope = gl.where(gl.expand_dims(rows_r < first, 1), rope, 0.0)
    kr.store(rope)
    fence_async_shared()
    cta_barrier()


@gluon.jit
def e4m3_to_bf16(x):
    """float8_e4m3fn values as bf16, exactly: ``attend.E4M3_TO_BF16_ASM``, as the Triton kernel
    converts them."""
    return gl.inline_asm_elementwise(E4M3_TO_BF16_ASM, "=r,=r,r", [x], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def zero_rows_from(tile, first):
    """Rows [first, rows) of a K/V tile ([rows, 512] bf16) in shared memory set to 0 by the warps
    that run it (the CTA's, or a warp-specialized partition's): past a sequence's end its last
    page holds whatever the pool has there, and a masked score (P = 0) times a NaN there is NaN.
    In column slices of 128, so the registers it needs stay few."""
    COLS: gl.constexpr = 128
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    keep = gl.expand_dims(gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, layout)) < first, 1)
    for c in gl.static_range(tile.shape[1] // COLS):
        part = tile.slice(c * COLS, COLS, dim=1)
        part.store(gl.where(keep, part.load(layout), 0.0).to(gl.bfloat16))
    fence_async_shared()
    cta_barrier()


@gluon.jit
def _store(out_ptr, lse_ptr, row0, m_i, l_i, acc, v_scale_ptr, FP8: gl.constexpr):
    """Rows [row0, row0 + 64) of out (acc / l, times v_scale[0] with ``FP8``, in out's dtype) and
    lse (natural log); a unit that sees no key (l = 0: a verified token before the first key) gets
    0 and -inf."""
    M: gl.constexpr = 64
    DV: gl.constexpr = 512
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)
    if FP8:
        out = out * gl.load(v_scale_ptr)
    rows_o = row0 + gl.arange(0, M, layout=row_o)
    cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + gl.expand_dims(rows_o, 1) * DV + gl.expand_dims(cols_o, 0), out.to(out_ptr.dtype.element_ty))
    gl.store(lse_ptr + row0 + gl.arange(0, M, layout=m_i.type.layout), (m_i + gl.log2(l_i)) * 0.6931471805599453)


# Gluon's types of the tensors the kernel's descriptors take (``str`` of each: its name in a
# compiled signature).
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def smem_layout(shape: list[int], dtype: torch.dtype = torch.bfloat16):
    """The NVMMA shared layout of a [rows, cols] TMA box of a bf16 or e4m3 tensor (the descriptors'
    and the buffers')."""
    return gl.NVMMASharedLayout.get_default_for(shape, GL_DTYPES[dtype])
