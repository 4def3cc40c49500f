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

A block's products run in series with its softmax (``loops.blocks_serial``, the loop the H200
measured), or, with ``OVERLAP`` (a 16-bit pool), each block's score is issued right behind the
P.V of the block before it, the row sums are added up once a segment, the row max is exchanged
with one barrier and q's rope columns are held in registers (``loops.blocks_overlapped``).

An e4m3 pool (``FP8``) is copied in bytes, half a 16-bit block's, into the same two buffers; all
8 warps convert each block into one bf16 copy (exact: every e4m3 value is a bf16 one), which both
products read as they read a 16-bit block, and the block's buffer is reloaded as soon as it is
converted. The two 36 KB buffers and the 72 KB copy take the shared memory two 72 KB buffers take.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
)

from lean_tp.ops.decode_attention.schedule import RANGE_FIELDS, cdiv, next_unit, program_of_tile
from lean_tp.ops.mla_gluon.loops import blocks_overlapped, blocks_serial, copy_block
from lean_tp.ops.mla_gluon.tiles import cta_barrier, tma_load


@gluon.jit(do_not_specialize=["zero"])
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
    zero,
    HU: gl.constexpr,
    LANES: gl.constexpr,
    TQ: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    FP8: gl.constexpr,
    OVERLAP: gl.constexpr,
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
    memory before its products (``tiles.convert_block``). ``zero`` is 0: the loops index q and
    that copy with it (``loops._fixed_index``), so that they form the products' operand
    descriptors in the loop."""
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
                gl.bfloat16, [1, BLOCK_N, DV], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], gl.bfloat16)
            ),
            gl.allocate_shared_memory(
                gl.bfloat16, [1, BLOCK_N, 64], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
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
        # Row sums: kept per key where the blocks overlap (``_softmax``), else added up each block.
        if OVERLAP:
            l_i = gl.zeros([M, BLOCK_N], gl.float32, s_layout)
        else:
            l_i = gl.full([M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([M, DV], gl.float32, o_layout)
        if n_blocks > 0:
            m_i, l_i, acc = _segment(
                qn_desc, qr_desc, kn_desc, kr_desc, qn_smem, qr_smem, kn_smem, kr_smem, p_smem, q_bar, kn_bars,
                kr_bars, cvt, row0, block_table_ptr + b * table_stride + tile, n_blocks,
                unit_len - (tile + n_blocks - 1) * BLOCK_N, done, segments, scale_log2, zero, m_i, l_i, acc,
                BLOCK_N, STAGES, FP8, OVERLAP,
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
    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [1, M, DV], qn_desc.layout)
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
    cvt, q_row, pages, n_blocks, last_valid, done, segments, scale_log2, zero, m_i, l_i, acc,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr, OVERLAP: gl.constexpr,
):  # fmt: skip
    """One output's blocks of this program (n_blocks >= 1), folded into (m_i, l_i, acc): the pages
    from ``pages`` against q rows [q_row, q_row + 64), the last block's keys from ``last_valid``
    (1 to 64) on masked and its rows there zeroed; block i uses buffer (done + i) % STAGES. Returns
    (row max in log2 units, row sums as ``_softmax`` keeps them, unnormalized output)."""
    DV: gl.constexpr = 512
    # The previous segment's blocks and q are read by both warp groups until here.
    cta_barrier()
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma_load(qn_desc, [q_row, 0], q_bar, qn_smem.index(0))
    tma_load(qr_desc, [q_row, DV], q_bar, qr_smem)
    for st in gl.static_range(STAGES):
        slot = (done + st) % STAGES
        row = gl.load(pages + st, mask=st < n_blocks, other=0) * BLOCK_N
        copy_block(kn_desc, kr_desc, kn_smem, kr_smem, kn_bars, kr_bars, slot, row, st < n_blocks)
    mbarrier.wait(q_bar, phase=segments & 1)
    bufs = (kn_smem, kr_smem, kn_bars, kr_bars)
    if OVERLAP:
        m_i, l_i, acc = blocks_overlapped(
            kn_desc, kr_desc, qn_smem, qr_smem, bufs, p_smem, pages, n_blocks, last_valid, done, scale_log2, zero,
            m_i, l_i, acc, BLOCK_N, STAGES,
        )  # fmt: skip
    else:
        m_i, l_i, acc = blocks_serial(
            kn_desc, kr_desc, qn_smem, qr_smem, bufs, p_smem, cvt, pages, n_blocks, last_valid, done, scale_log2, zero,
            m_i, l_i, acc, BLOCK_N, STAGES, FP8,
        )  # fmt: skip
    return m_i, l_i, acc


@gluon.jit
def _store(out_ptr, lse_ptr, row0, m_i, l_i, acc, v_scale_ptr, FP8: gl.constexpr):
    """Rows [row0, row0 + 64) of out (acc / l, times v_scale[0] with ``FP8``, in out's dtype) and
    lse (natural log); a unit that sees no key (l = 0: a verified token before the first key) gets
    0 and -inf."""
    M: gl.constexpr = 64
    DV: gl.constexpr = 512
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_sum = l_i
    if len(l_i.shape) == 2:  # per key (``_softmax``)
        l_sum = gl.sum(l_i, axis=1)
    l_o = gl.convert_layout(l_sum, row_o)
    out = acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)
    if FP8:
        out = out * gl.load(v_scale_ptr)
    rows_o = row0 + gl.arange(0, M, layout=row_o)
    cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + gl.expand_dims(rows_o, 1) * DV + gl.expand_dims(cols_o, 0), out.to(out_ptr.dtype.element_ty))
    gl.store(lse_ptr + row0 + gl.arange(0, M, layout=m_i.type.layout), (m_i + gl.log2(l_sum)) * 0.6931471805599453)
