"""A probe of FlashMLA's "seesaw" schedule in Gluon for sm_90: whether one 64-key block's softmax
overlapped with the other block's products takes DP attention's 64-key iteration below the Gluon
kernel's 2.6-2.7 us (``lean_tp.ops.mla_gluon``, H200). Not part of lean_tp: one program a head unit
(64 query rows of one sequence, one query token) over all its pages, no stream-K split.

The schedule is FlashMLA's (csrc/sm90/decode/dense/splitkv_mla.cuh, wg0_subroutine and
wg1_subroutine), in two warp-specialized partitions of 4 warps instead of a branch on the warp
group:
- warp group 0 computes the scores of even blocks (buffer 0) and owns output columns 0-255, warp
  group 1 the odd blocks (buffer 1) and columns 256-511;
- in a pair of blocks, group 0's row max m0 and rescale go to group 1 through shared memory and
  group 1's m1 and rescale come back; each group multiplies its own P by its half of V from
  registers and the other group's P from shared memory (group 0 writes P0 rescaled to m1), so
  neither waits on the other's softmax; each keeps its own row sums, added after the loop;
- q's rope columns are held in registers, so their buffer holds group 1's P (224 KB and P0's 8 KB
  of shared memory);
- a buffer is reloaded by halves, each by its last reader, so no group waits on a release: buffer
  0's left half (read by group 0 alone) right after group 0's P0.V, its right half after group
  1's P0.V; buffer 1's right half after group 1's P1.V, its left half after group 0's P1.V. The
  scores of a block multiply the half that was reloaded first first.

Compiled for sm_90: 256 registers a thread in both groups (setmaxnreg), 231716 bytes of shared
memory, HGMMA 64x64 (scores) and 64x256 (P.V, P from registers or shared memory), no local
memory on triton 3.6, 3.7.1 and 3.9; each group's loop over a pair of blocks 1298 and 1428 SASS
(3.7.1). The loops index q's and the K/V buffers at a runtime 0 (``zero``): at constant indices
the worker partition reloads its operand descriptors from local memory just before the HGMMAs
(74 local accesses on 3.7.1, 77 on 3.6, 236 on 3.9), and with a pair's odd block behind a branch
inside the loop it spills 110, so the pairs with both blocks run in the loop and a last even
block after it; a third, one-warp partition issuing the copies would leave the groups 240
registers, at 250 spills (both at constant indices). Not yet run on a GPU. ``--json``: the
compiled statistics; on an sm_90 GPU, exact against float64 on ragged lengths and timed beside the
Gluon kernel (its serial and overlapped loops) on one head unit an SM.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lean_tp.ops.decode_attention.tuning import FP_FUSION

# The Gluon kernel's version shims (the barrier of the warps that run it, the TMA load), its
# buffers' shared layout and its zeroing of a page's rows past a sequence's end.
from lean_tp.ops.mla_gluon.tiles import cta_barrier, smem_layout, tma_load, zero_rows_from

# The kernel's shape: query rows a program, latent and rope columns, keys a block (a page), V's
# columns a warp group.
ROWS, DV, DR, BLOCK_N, HALF = (gl.constexpr(v) for v in (64, 512, 64, 64, 256))
# Registers a thread of the second warp group (setmaxnreg), the first's being the same: 256 threads.
WG1_REGS = gl.constexpr(256)


# A warp group's layouts: the scores (64 x 64) and its half of the output (64 x 256), by wgmma.
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))


@gluon.jit
def _rope_of_q(qr_smem, bars):
    """q's rope columns in registers, the scores' operand, once q's copy landed."""
    mbarrier.wait(bars.index(0), 0)
    q_rope = qr_smem.load(gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2))
    cta_barrier()
    return q_rope


@gluon.jit
def _load_half(kn_desc, kr_desc, kn_smem, kr_smem, full, pages, slot, j, n_blocks, RIGHT: gl.constexpr):
    """Block j's left (latent columns 0-255) or right half (256-511, and the rope columns) into
    buffer ``slot``, signalling full[2 slot + RIGHT]; nothing past the sequence's last block."""
    pred = j < n_blocks
    row = gl.load(pages + j, mask=pred, other=0) * BLOCK_N
    bar = full.index(2 * slot + RIGHT)
    if RIGHT:
        mbarrier.expect(bar, kn_desc.block_type.nbytes + kr_desc.block_type.nbytes, pred=pred)
        tma_load(kn_desc, [row, HALF], bar, kn_smem.index(slot).slice(HALF, HALF, dim=1), pred=pred)
        tma_load(kr_desc, [row, DV], bar, kr_smem.index(slot), pred=pred)
    else:
        mbarrier.expect(bar, kn_desc.block_type.nbytes, pred=pred)
        tma_load(kn_desc, [row, 0], bar, kn_smem.index(slot).slice(0, HALF, dim=1), pred=pred)


@gluon.jit
def _scores(
    qn_smem, q_rope, kn, kr, full, slot, ph, scale_log2, valid, RIGHT_FIRST: gl.constexpr, s_layout: gl.constexpr
):
    """One block's scores (64 x 64, log2 units) from buffer ``slot``, the half loaded first
    multiplied first: q's latent columns from shared memory, its rope columns from registers;
    keys from ``valid`` on at -inf."""
    first: gl.constexpr = HALF if RIGHT_FIRST else 0
    second: gl.constexpr = 0 if RIGHT_FIRST else HALF
    mbarrier.wait(full.index(2 * slot + RIGHT_FIRST), ph)
    s = gl.zeros([64, 64], gl.float32, s_layout)
    s = warpgroup_mma(
        qn_smem.slice(first, HALF, dim=1), kn.slice(first, HALF, dim=1).permute((1, 0)), s, use_acc=False, is_async=True
    )
    mbarrier.wait(full.index(2 * slot + 1 - RIGHT_FIRST), ph)
    s = warpgroup_mma(
        qn_smem.slice(second, HALF, dim=1), kn.slice(second, HALF, dim=1).permute((1, 0)), s, is_async=True
    )
    s = warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,)) * scale_log2
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
    return gl.where(gl.expand_dims(cols < valid, 0), s, float("-inf"))


@gluon.jit
def _group0(shared, out_ptr, lse_ptr, row0, n, n_blocks, scale_log2, zero):
    """Warp group 0: even blocks' scores, output columns [0, 256), the row max's owner at a pair's
    start, the lse. bars: q, q rope copied, m0 ready, m1 ready, P0 ready, P1 ready, l1 ready, l
    ready. The pairs with both blocks run in the loop, a last even block alone after it (a
    branch inside the loop would have ptxas hoist and spill the other group's operand addresses)."""
    qn_smem, qr_smem, kn_smem, kr_smem, sp0, exch, bars, full, kn_desc, kr_desc, pages = shared
    row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    q_rope = _rope_of_q(qr_smem, bars)
    mbarrier.arrive(bars.index(1))  # qr_smem may now hold group 1's P
    m = gl.full([64], float("-inf"), gl.float32, row_s)
    l = gl.zeros([64], gl.float32, row_s)
    o = gl.zeros([64, HALF], gl.float32, O_LAYOUT)
    for i in range(n_blocks // 2):
        m, l, o = _pair0(shared, q_rope, i, n, n_blocks, scale_log2, m, l, o, True, i & zero)
    if n_blocks % 2 == 1:
        m, l, o = _pair0(shared, q_rope, n_blocks // 2, n, n_blocks, scale_log2, m, l, o, False, zero)
    mbarrier.wait(bars.index(6), 0)
    l = l + exch.slice(1 * 64, 64).load(row_s)
    exch.slice(0 * 64, 64).store(l)
    cta_barrier()
    mbarrier.arrive(bars.index(7))
    _store_half(out_ptr, row0, 0, o, l)
    gl.store(lse_ptr + row0 + gl.arange(0, 64, layout=row_s), (m + gl.log2(l)) * 0.6931471805599453)


@gluon.jit
def _pair0(shared, q_rope, i, n, n_blocks, scale_log2, m, l, o, HAS_ODD: gl.constexpr, z):
    """Group 0's part of pair i: block 2i's scores and P0.V, then block 2i + 1's P1.V where the
    pair has it. It reloads buffer 0's left half (only it reads that) after its P0.V, and buffer
    1's left half after its P1.V (group 1's scores of that block are done: P1 was ready)."""
    qn_smem, qr_smem, kn_smem, kr_smem, sp0, exch, bars, full, kn_desc, kr_desc, pages = shared
    row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    row_o: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    ph = i & 1
    valid = gl.minimum(n - 2 * i * BLOCK_N, BLOCK_N)
    s = _scores(
        qn_smem.index(z), q_rope, kn_smem.index(z), kr_smem.index(z), full, 0, ph, scale_log2, valid, False, S_LAYOUT
    )
    m0 = gl.maximum(m, gl.max(s, axis=1))
    scale0 = gl.exp2(m - m0)
    exch.slice(0 * 64, 64).store(m0)
    exch.slice(1 * 64, 64).store(scale0)
    cta_barrier()
    mbarrier.arrive(bars.index(2))
    p = gl.exp2(s - gl.expand_dims(m0, 1))
    l = l * scale0 + gl.sum(p, axis=1)
    if valid < BLOCK_N:
        zero_rows_from(kn_smem.index(0), valid)
    o = o * gl.expand_dims(gl.convert_layout(scale0, row_o), 1)
    p_a = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))
    o = warpgroup_mma(p_a, kn_smem.index(z).slice(0, HALF, dim=1), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    cta_barrier()
    _load_half(kn_desc, kr_desc, kn_smem, kr_smem, full, pages, 0, 2 * i + 2, n_blocks, False)
    mbarrier.wait(bars.index(3), ph)
    m = exch.slice(2 * 64, 64).load(row_s)
    scale1 = exch.slice(3 * 64, 64).load(row_s)
    # P0 at group 1's max; group 1 read the last pair's P0 before it reloaded buffer 0's right
    # half, which this group's scores waited for.
    sp0.store((p * gl.expand_dims(scale1, 1)).to(gl.bfloat16))
    fence_async_shared()
    cta_barrier()
    mbarrier.arrive(bars.index(4))
    o = o * gl.expand_dims(gl.convert_layout(scale1, row_o), 1)
    l = l * scale1
    if HAS_ODD:
        mbarrier.wait(bars.index(5), ph)
        o = warpgroup_mma(qr_smem, kn_smem.index(1 + z).slice(0, HALF, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        cta_barrier()
        _load_half(kn_desc, kr_desc, kn_smem, kr_smem, full, pages, 1, 2 * i + 3, n_blocks, False)
    return m, l, o


@gluon.jit
def _take_max(exch, bars, ph, row_max):
    """Group 1's half of a pair's exchange: group 0's max m0 and rescale scale0, then m1 = max(m0,
    row_max) and scale1 = 2^(m0 - m1) for group 0. Returns m1 and the rescale of this group's
    state, scale0 scale1."""
    mbarrier.wait(bars.index(2), ph)
    m0 = exch.slice(0 * 64, 64).load(row_max.type.layout)
    scale0 = exch.slice(1 * 64, 64).load(row_max.type.layout)
    m1 = gl.maximum(m0, row_max)
    scale1 = gl.exp2(m0 - m1)
    exch.slice(2 * 64, 64).store(m1)
    exch.slice(3 * 64, 64).store(scale1)
    cta_barrier()
    mbarrier.arrive(bars.index(3))
    return m1, scale0 * scale1


@gluon.jit
def _group1(shared, out_ptr, row0, n, n_blocks, scale_log2, zero):
    """Warp group 1: odd blocks' scores and output columns [256, 512); the pairs with both blocks
    in the loop, a last even block's P0.V after it."""
    qn_smem, qr_smem, kn_smem, kr_smem, sp0, exch, bars, full, kn_desc, kr_desc, pages = shared
    row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    q_rope = _rope_of_q(qr_smem, bars)
    mbarrier.wait(bars.index(1), 0)
    l = gl.zeros([64], gl.float32, row_s)
    o = gl.zeros([64, HALF], gl.float32, O_LAYOUT)
    for i in range(n_blocks // 2):
        l, o = _pair1(shared, q_rope, i, n, n_blocks, scale_log2, l, o, True, i & zero)
    if n_blocks % 2 == 1:
        l, o = _pair1(shared, q_rope, n_blocks // 2, n, n_blocks, scale_log2, l, o, False, zero)
    # Slots 0 and 1 are free: group 0 writes m0 and its rescale no more, and read group 1's last
    # m1 before the P0 this group waited for.
    exch.slice(1 * 64, 64).store(l)
    cta_barrier()
    mbarrier.arrive(bars.index(6))
    mbarrier.wait(bars.index(7), 0)
    _store_half(out_ptr, row0, HALF, o, exch.slice(0 * 64, 64).load(row_s))


@gluon.jit
def _pair1(shared, q_rope, i, n, n_blocks, scale_log2, l, o, HAS_ODD: gl.constexpr, z):
    """Group 1's part of pair i: block 2i + 1's scores and P1.V where the pair has it, then block
    2i's P0.V. It reloads buffer 1's right half (only it reads that) after its P1.V, and buffer 0's
    right half after its P0.V (group 0's scores of that block are done: P0 was ready)."""
    qn_smem, qr_smem, kn_smem, kr_smem, sp0, exch, bars, full, kn_desc, kr_desc, pages = shared
    row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    row_o: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    ph = i & 1
    if HAS_ODD:
        valid = gl.minimum(n - (2 * i + 1) * BLOCK_N, BLOCK_N)
        s = _scores(
            qn_smem.index(z),
            q_rope,
            kn_smem.index(1 + z),
            kr_smem.index(1 + z),
            full,
            1,
            ph,
            scale_log2,
            valid,
            True,
            S_LAYOUT,
        )
        m1, scale = _take_max(exch, bars, ph, gl.max(s, axis=1))
        o = o * gl.expand_dims(gl.convert_layout(scale, row_o), 1)
        p = gl.exp2(s - gl.expand_dims(m1, 1))
        l = l * scale + gl.sum(p, axis=1)
        if valid < BLOCK_N:
            zero_rows_from(kn_smem.index(1), valid)
        p_a = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))
        o = warpgroup_mma(p_a, kn_smem.index(1 + z).slice(HALF, HALF, dim=1), o, is_async=True)
        # P1 into q's rope buffer: group 0 read that buffer's q before the loop, and its P1.V of
        # the last pair before it reloaded buffer 1's left half, which these scores waited for.
        qr_smem.store(p_a)
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(bars.index(5))
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        cta_barrier()
        _load_half(kn_desc, kr_desc, kn_smem, kr_smem, full, pages, 1, 2 * i + 3, n_blocks, True)
    else:
        m1, scale = _take_max(exch, bars, ph, gl.full([64], float("-inf"), gl.float32, row_s))
        o = o * gl.expand_dims(gl.convert_layout(scale, row_o), 1)
        l = l * scale
    mbarrier.wait(bars.index(4), ph)
    o = warpgroup_mma(sp0, kn_smem.index(z).slice(HALF, HALF, dim=1), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    cta_barrier()
    _load_half(kn_desc, kr_desc, kn_smem, kr_smem, full, pages, 0, 2 * i + 2, n_blocks, True)
    return l, o


@gluon.jit
def _store_half(out_ptr, row0, col0, o, l):
    """Columns [col0, col0 + 256) of rows [row0, row0 + 64) of out: o / l in bf16 (0 where l = 0)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o.type.layout)
    l_o = gl.convert_layout(l, row_o)
    out = o / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)
    rows = row0 + gl.arange(0, 64, layout=row_o)
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, o.type.layout))
    gl.store(out_ptr + gl.expand_dims(rows, 1) * DV + gl.expand_dims(cols, 0), out.to(gl.bfloat16))


@gluon.jit(do_not_specialize=["zero"])
def mla_seesaw_kernel(
    qn_desc, qr_desc, kn_desc, kr_desc, out_ptr, lse_ptr, seqlens_ptr, block_table_ptr, table_stride, scale_log2,
    zero, HU: gl.constexpr,
):  # fmt: skip
    """Program p: rows [64 p, 64 p + 64) of q (head unit p % HU of sequence p // HU) against the
    sequence's seqlens[b] keys on pages block_table[b, :]; out [rows, 512] bf16, lse [rows] fp32.
    kn_desc: [pages x 64, 256] boxes (half a block's latent columns), kr_desc [pages x 64, 64].

    ``zero`` is 0: the loops index q's and the K/V buffers at ``i & zero`` (+ 1), not at constants.
    With constant indices every operand descriptor of a pair's 44 HGMMAs (64 bits each) is loop
    invariant, LLVM computes them all before the loop, and the worker partition spills them (74
    local accesses on triton 3.7.1, 34 in its loop); from an index the compiler cannot fold they
    are formed in the loop, and neither partition touches local memory."""
    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [1, ROWS, DV], qn_desc.layout)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, DR], qr_desc.layout)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DV], qn_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DR], kr_desc.layout)
    sp0 = gl.allocate_shared_memory(gl.bfloat16, [ROWS, BLOCK_N], qr_desc.layout)
    exch = gl.allocate_shared_memory(gl.float32, [4 * ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # (buffer, half)
    for k in gl.static_range(8):
        mbarrier.init(bars.index(k), count=1)
    for k in gl.static_range(4):
        mbarrier.init(full.index(k), count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    b = pid // HU
    row0 = pid * ROWS
    n = gl.load(seqlens_ptr + b)
    n_blocks = (n + BLOCK_N - 1) // BLOCK_N
    pages = block_table_ptr + b * table_stride
    mbarrier.expect(bars.index(0), qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma_load(qn_desc, [row0, 0], bars.index(0), qn_smem.index(0))
    tma_load(qr_desc, [row0, DV], bars.index(0), qr_smem)
    for j in gl.static_range(2):
        _load_half(kn_desc, kr_desc, kn_smem, kr_smem, full, pages, j, j, n_blocks, False)
        _load_half(kn_desc, kr_desc, kn_smem, kr_smem, full, pages, j, j, n_blocks, True)
    # The buffers, barriers and descriptors both groups take, as one argument.
    shared = (qn_smem, qr_smem, kn_smem, kr_smem, sp0, exch, bars, full, kn_desc, kr_desc, pages)
    gl.warp_specialize(
        [
            (_group0, (shared, out_ptr, lse_ptr, row0, n, n_blocks, scale_log2, zero)),
            (_group1, (shared, out_ptr, row0, n, n_blocks, scale_log2, zero)),
        ],
        [4],
        [WG1_REGS],
    )


def mla_decode_seesaw(
    q: torch.Tensor, pool: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor, poison: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, 512) bf16 and lse (B, H) fp32 of q (B, H, 576) bf16 (H a multiple of 64) over
    pool (pages, 64, 576) bf16 through block_table (B, max pages) int32, seqlens (B,) int32;
    ``poison``: out and lse NaN before the launch, so that what it leaves unwritten shows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    batch, heads = q.shape[0], q.shape[1]
    out = torch.empty(batch * heads, DV.value, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(batch * heads, dtype=torch.float32, device=q.device)
    if poison:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    q2, pool2 = q.reshape(-1, DV.value + DR.value), pool.view(-1, DV.value + DR.value)

    def desc(t: torch.Tensor, shape: list[int]):
        return TensorDescriptor.from_tensor(t, shape, smem_layout(shape))

    mla_seesaw_kernel[(batch * heads // 64,)](
        desc(q2, [64, 512]), desc(q2, [64, 64]), desc(pool2, [64, 256]), desc(pool2, [64, 64]),
        out, lse, seqlens, block_table, block_table.stride(0), 576**-0.5 * math.log2(math.e), 0, heads // 64,
        num_warps=4, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out.view(batch, heads, DV.value), lse.view(batch, heads)


def compiled_stats() -> dict:
    """The kernel compiled for sm_90: registers, stack and shared bytes, local accesses, the
    setmaxnreg counts of its partitions, its HGMMA shapes, and each partition's K/V loop (a pair
    of blocks) as [SASS, local accesses]."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from lean_tp.tools.kernel_report.sass import dump, mma_loops_of_sass, resources

    def desc(shape: list[int]) -> str:
        return f"tensordesc<bf16[{shape[0]},{shape[1]}],{smem_layout(shape)!r}>"

    signature = {
        "qn_desc": desc([64, 512]), "qr_desc": desc([64, 64]), "kn_desc": desc([64, 256]),
        "kr_desc": desc([64, 64]), "out_ptr": "*bf16", "lse_ptr": "*fp32", "seqlens_ptr": "*i32",
        "block_table_ptr": "*i32", "table_stride": "i32", "scale_log2": "fp32", "zero": "i32",
        "HU": "constexpr",
    }  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4, 8)}
    source = GluonASTSource(mla_seesaw_kernel, signature, constexprs={"HU": 2}, attrs=attrs)
    options = {"num_warps": 4, "enable_fp_fusion": FP_FUSION}  # as launched
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    sass = dump(kernel.asm["cubin"], "-sass")
    regs, stack, static_shared = resources(kernel.asm["cubin"])
    return dict(
        registers=regs,
        stack_bytes=stack,
        shared_bytes=kernel.metadata.shared + static_shared,
        local=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        setmaxnreg=re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"]),
        hgmma=sorted({m for m in re.findall(r"HGMMA\.64x\d+x16\.F32\.BF16", sass)}),
        loops=[list(loop) for loop in mma_loops_of_sass(sass)],
    )


def run_on_gpu(n_keys: int) -> list[str]:
    """Exactness against float64 (ragged lengths in one launch, NaN in the pool's rows no sequence
    holds, out and lse NaN before it) and the time beside the Gluon kernel (both its loops) on one
    head unit an SM."""
    import mla_decode_gluon as gluon_bench
    from bench_decode import Timer

    from lean_tp.ops.mla_gluon import mla_decode_gluon, mla_gluon_schedule

    lines = []
    ragged = gluon_bench.paged_problem([1, 63, 64, 65, 130, 0, 700, 4099], heads=128, seed=3)
    out, lse = mla_decode_seesaw(*ragged, poison=True)
    ref_out, ref_lse = gluon_bench.reference(*ragged)
    lines.append(
        f"ragged lengths 0-4099, 128 heads: max |out - float64| {(out.double() - ref_out).abs().max().item():.2e}, "
        f"|lse - float64| {(lse.double() - ref_lse).abs().nan_to_num(0.0).max().item():.2e}, "
        f"lse -inf where the reference's is: {bool(((lse == float('-inf')) == (ref_lse == float('-inf'))).all())}, "
        f"{int(out.isnan().sum()) + int(lse.isnan().sum())} values NaN"
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    problem = gluon_bench.paged_problem([n_keys] * (sms // 2), heads=128)
    step = mla_gluon_schedule(problem[2], problem[3], 128)  # once a step, as the decode loop computes it
    timer = Timer(torch.device("cuda"), 20)
    seesaw_us, gluon_us, overlapped_us = (
        t * 1e6
        for t in timer(
            [
                lambda: mla_decode_seesaw(*problem),
                lambda: mla_decode_gluon(*problem, schedule=step, overlap=False),
                lambda: mla_decode_gluon(*problem, schedule=step, overlap=True),
            ]
        )
    )
    iterations = -(-n_keys // 64)
    lines.append(
        f"{sms // 2} sequences x 128 heads x {n_keys} keys: seesaw {seesaw_us:.1f} us ({seesaw_us / iterations:.2f} us "
        f"a 64-key iteration of an SM), the Gluon kernel {gluon_us:.1f} us ({gluon_us / iterations:.2f}), its "
        f"overlapped loop {overlapped_us:.1f} us ({overlapped_us / iterations:.2f})"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=32768, help="keys a sequence, on a GPU (32768)")
    parser.add_argument("--json", action="store_true", help="print the compiled statistics as JSON, nothing else")
    args = parser.parse_args(argv)
    stats = compiled_stats()
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"sm_90: {stats}")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        print("\n".join(run_on_gpu(args.keys)))
    else:
        print("no sm_90 GPU: compiled statistics only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
