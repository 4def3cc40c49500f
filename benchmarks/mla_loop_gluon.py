"""An experiment: MLA decode's K/V loop written in Gluon for sm_90, with the layouts Triton's own
choice does not give (docs/mla.md).

One program computes 64 query rows of one sequence over its whole latent cache: q (64 x 576 bf16:
512 latent and 64 rope columns) is copied to shared memory once by TMA; the cache is a pool of
64-row pages (FlashMLA's page size) read through a block table, a page a 64-key block, copied by
TMA into two buffers, each block's copy issued while the block before it computes. The two warp
groups split every product by columns (``NVMMADistributedLayout`` with warps [4, 2]): the score
S = q K^T (each group 32 of the 64 keys, q read from shared memory by ``warpgroup_mma``), and P.V
(each group 256 of the 512 output columns, P through shared memory, V the block's latent
columns). The softmax's row max and sum cross the groups through Triton's reduction. Lengths are
ragged: every block but a sequence's last is whole and unmasked; the last one's rows past the end
are zeroed in shared memory and their scores masked. Compiled for sm_90 (triton 3.7.1): 210
registers (208 with triton 3.6), no local memory, 225 KB of shared memory, 505 SASS a 64-key
iteration and 4832 bytes of shared-memory reads a key, against lean's 64-row loop's 670 SASS a
32-key iteration and 13120 bytes a key (kernel report).

Measured on an H200 (docs/results/2026-11-27-nvidia-h200.json, triton 3.6), in its contiguous
form before pages and ragged lengths (524 SASS an iteration, every block masked): exact against
float64, 1303 us for 66 sequences of 128 heads and 32k keys against lean_tp.decode_attention's
2685 on the same problem, 2.54 us a 64-key iteration.

A sequence's blocks can be split over programs (``splits``: equal runs of whole blocks), whose
fp32 partials a Triton kernel combines (``combine``). It is not lean's kernel: no stream-K
schedule, no fp8, no Tq. ``python benchmarks/mla_loop_gluon.py`` prints the compiled statistics on
any machine; on an sm_90 GPU it also checks the result against float64 and times the loop beside
``lean_tp.decode_attention`` on the same problems (DP attention's 128 heads on 64-row pages: a
sequence per 2 SMs, a program a row block; and B=32, split to fill the SMs)."""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

ROWS, DV, DR = 64, 512, 64  # query rows a program, latent and rope columns of a cache row
BLOCK_N, STAGES = 64, 2
# The CTA barrier is gl.thread_barrier in triton 3.6 and gl.barrier from 3.7.
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def mla_loop_kernel(
    qn_desc,
    qr_desc,
    kn_desc,
    kr_desc,
    out_ptr,
    lse_ptr,
    seqlens_ptr,
    block_table_ptr,
    table_stride,
    scale_log2,
    BLOCKS_PER_SEQ: gl.constexpr,
    SPLITS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Program p: rows [64 r, 64 r + 64) of q, r = p // SPLITS (qn_desc: [R, 512] blocks, qr_desc:
    [R, 64] at column 512), against split p % SPLITS of sequence s = r // BLOCKS_PER_SEQ: seqlens[s]
    keys, key j on page block_table[s, j // 64] of the pool (kn_desc: [pages x 64, 512] blocks,
    kr_desc: [pages x 64, 64] at column 512; V is the latent columns), the split's keys a run of
    whole blocks. out rows [64 p, 64 p + 64) of [R x SPLITS, 512] (bf16, or fp32 partials when
    split) and lse [R x SPLITS] fp32 (natural log); no keys give out 0, lse -inf. scale_log2: the
    softmax scale times log2(e)."""
    M: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    # Warp group g computes keys [g BLOCK_N / 2, (g + 1) BLOCK_N / 2) of the score and columns
    # [256 g, 256 g + 256) of the output (128 fp32 registers a thread).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DV // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [M, DV], qn_desc.layout)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [M, DR], qr_desc.layout)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DV], kn_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DR], kr_desc.layout)
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

    pid = gl.program_id(0)
    q_row = (pid // SPLITS) * M
    seq = pid // (SPLITS * BLOCKS_PER_SEQ)
    n_keys = gl.load(seqlens_ptr + seq)
    per_split = gl.cdiv(gl.cdiv(n_keys, BLOCK_N), SPLITS)
    first = (pid % SPLITS) * per_split  # the split's blocks [first, end), [first, first + n) here
    pages = block_table_ptr + seq * table_stride + first  # a page holds one BLOCK_N-key block
    n_keys = gl.minimum(gl.maximum(n_keys - first * BLOCK_N, 0), per_split * BLOCK_N)
    num_blocks = gl.cdiv(n_keys, BLOCK_N)
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, qn_smem)
    tma.async_copy_global_to_shared(qr_desc, [q_row, DV], q_bar, qr_smem)
    for st in gl.static_range(STAGES):
        row = gl.load(pages + st, mask=st < num_blocks, other=0) * BLOCK_N
        mbarrier.expect(kn_bars.index(st), kn_desc.block_type.nbytes, pred=st < num_blocks)
        mbarrier.expect(kr_bars.index(st), kr_desc.block_type.nbytes, pred=st < num_blocks)
        tma.async_copy_global_to_shared(kn_desc, [row, 0], kn_bars.index(st), kn_smem.index(st), pred=st < num_blocks)
        tma.async_copy_global_to_shared(kr_desc, [row, DV], kr_bars.index(st), kr_smem.index(st), pred=st < num_blocks)
    mbarrier.wait(q_bar, phase=0)

    m_i = gl.full([M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([M], 0.0, gl.float32, row_s)
    acc = gl.zeros([M, DV], gl.float32, o_layout)
    # Every block but the split's last is whole: no mask. The last one's rows past the sequence's
    # end are the rest of its page.
    for j in range(num_blocks - 1):
        slot = j % STAGES
        nxt = j + STAGES
        # The page of block j + STAGES, loaded while this block computes.
        nxt_row = gl.load(pages + nxt, mask=nxt < num_blocks, other=0) * BLOCK_N
        mbarrier.wait(kn_bars.index(slot), (j // STAGES) & 1)
        mbarrier.wait(kr_bars.index(slot), (j // STAGES) & 1)
        kn = kn_smem.index(slot)
        kr = kr_smem.index(slot)
        m_i, l_i, acc = _attend_block(
            qn_smem, qr_smem, kn, kr, p_smem, m_i, l_i, acc, BLOCK_N, scale_log2, BLOCK_N, False
        )
        # Block j + STAGES into the slot once both groups are done with it and with P; the expects
        # go before the CTA barrier so that the copies need no other.
        mbarrier.expect(kn_bars.index(slot), kn_desc.block_type.nbytes, pred=nxt < num_blocks)
        mbarrier.expect(kr_bars.index(slot), kr_desc.block_type.nbytes, pred=nxt < num_blocks)
        _cta_barrier()
        tma.async_copy_global_to_shared(kn_desc, [nxt_row, 0], kn_bars.index(slot), kn, pred=nxt < num_blocks)
        tma.async_copy_global_to_shared(kr_desc, [nxt_row, DV], kr_bars.index(slot), kr, pred=nxt < num_blocks)
    if num_blocks > 0:
        last = num_blocks - 1
        mbarrier.wait(kn_bars.index(last % STAGES), (last // STAGES) & 1)
        mbarrier.wait(kr_bars.index(last % STAGES), (last // STAGES) & 1)
        kn = kn_smem.index(last % STAGES)
        valid = n_keys - last * BLOCK_N
        _zero_rows_from(kn, valid, BLOCK_N, DV)
        kr = kr_smem.index(last % STAGES)
        m_i, l_i, acc = _attend_block(qn_smem, qr_smem, kn, kr, p_smem, m_i, l_i, acc, valid, scale_log2, BLOCK_N, True)
    mbarrier.invalidate(q_bar)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(kn_bars.index(st))
        mbarrier.invalidate(kr_bars.index(st))

    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)  # no keys: 0, not 0 / 0
    rows_o = pid * M + gl.arange(0, M, layout=row_o)
    cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + gl.expand_dims(rows_o, 1) * DV + gl.expand_dims(cols_o, 0), out.to(out_ptr.dtype.element_ty))
    gl.store(lse_ptr + pid * M + gl.arange(0, M, layout=row_s), (m_i + gl.log2(l_i)) * 0.6931471805599453)


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
    _cta_barrier()
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    o_tok = warpgroup_mma(p_smem, kn, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    return m_new, l_i, acc


@gluon.jit
def _zero_rows_from(tile, first, BLOCK_N: gl.constexpr, DV: gl.constexpr):
    """Rows [first, BLOCK_N) of a K/V tile in shared memory set to 0: past a sequence's end its
    last page holds whatever the pool has there, and a masked score (P = 0) times a NaN there is
    NaN. In column slices of 128, so the registers it needs stay few."""
    COLS: gl.constexpr = 128
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    keep = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout)) < first, 1)
    for c in gl.static_range(DV // COLS):
        part = tile.slice(c * COLS, COLS, dim=1)
        part.store(gl.where(keep, part.load(layout), 0.0).to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()


def _smem_layout(shape: list[int]):
    return gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)


def compile_sm90(blocks_per_seq: int = 2, splits: int = 1):
    """The kernel compiled for sm_90 on any machine (its host descriptors' types as a launch has them)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(shape: list[int]) -> str:
        return f"tensordesc<bf16[{shape[0]},{shape[1]}],{_smem_layout(shape)!r}>"

    signature = {
        "qn_desc": desc([ROWS, DV]),
        "qr_desc": desc([ROWS, DR]),
        "kn_desc": desc([BLOCK_N, DV]),
        "kr_desc": desc([BLOCK_N, DR]),
        "out_ptr": "*fp32" if splits > 1 else "*bf16",
        "lse_ptr": "*fp32",
        "seqlens_ptr": "*i32",
        "block_table_ptr": "*i32",
        "table_stride": "i32",
        "scale_log2": "fp32",
        "BLOCKS_PER_SEQ": "constexpr",
        "SPLITS": "constexpr",
        "BLOCK_N": "constexpr",
        "STAGES": "constexpr",
    }
    constexprs = {"BLOCKS_PER_SEQ": blocks_per_seq, "SPLITS": splits, "BLOCK_N": BLOCK_N, "STAGES": STAGES}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (4, 5, 6, 7)}
    source = GluonASTSource(mla_loop_kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


def mla_loop(
    q: torch.Tensor,
    pool: torch.Tensor,
    seqlens: torch.Tensor,
    block_table: torch.Tensor,
    blocks_per_seq: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [R, 512] bf16 and lse [R] fp32 of q [R, 576] bf16 (R = 64 x row blocks; row block r's
    rows against sequence r // blocks_per_seq) over a paged latent pool [pages x 64, 576] bf16
    (pages of 64 rows, FlashMLA's), seqlens [S] int32 and block_table [S, max pages] int32, scale
    576^-0.5; each sequence's blocks in ``splits`` runs, a program each, whose fp32 partials
    ``combine`` merges. out and lse start as NaN unless given."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t: torch.Tensor, shape: list[int]) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t, shape, _smem_layout(shape))

    rows = q.shape[0]
    if out is None:
        out = torch.full((rows, DV), float("nan"), device=q.device, dtype=torch.bfloat16)
    if lse is None:
        lse = torch.full((rows,), float("nan"), device=q.device, dtype=torch.float32)
    part_out, part_lse = out, lse
    if splits > 1:
        part_out = torch.full((rows * splits, DV), float("nan"), device=q.device, dtype=torch.float32)
        part_lse = torch.full((rows * splits,), float("nan"), device=q.device, dtype=torch.float32)
    descs = desc(q, [ROWS, DV]), desc(q, [ROWS, DR]), desc(pool, [BLOCK_N, DV]), desc(pool, [BLOCK_N, DR])
    scale_log2 = q.shape[1] ** -0.5 * math.log2(math.e)
    mla_loop_kernel[(rows // ROWS * splits,)](
        *descs,
        part_out,
        part_lse,
        seqlens,
        block_table,
        block_table.stride(0),
        scale_log2,
        blocks_per_seq,
        splits,
        BLOCK_N,
        STAGES,
        num_warps=8,
    )
    if splits > 1:
        combine(part_out, part_lse, splits, out, lse)
    return out, lse


@triton.jit
def combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, SPLITS: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr
):
    """Row r of out [R, DV] and lse [R] from its SPLITS partials: row (r // ROWS x SPLITS + s) x
    ROWS + r % ROWS of part_out [R x SPLITS, DV] fp32 and part_lse (natural log), weighted by
    exp(lse_s - lse); no keys in any split: out 0, lse -inf."""
    r = tl.program_id(0)
    first = (r // ROWS) * SPLITS * ROWS + r % ROWS
    m = float("-inf")
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(part_lse_ptr + first + s * ROWS))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    cols = tl.arange(0, DV)
    acc = tl.zeros([DV], tl.float32)
    total = 0.0
    for s in tl.static_range(SPLITS):
        w = tl.exp(tl.load(part_lse_ptr + first + s * ROWS) - m_safe)
        acc += w * tl.load(part_out_ptr + (first + s * ROWS) * DV + cols)
        total += w
    tl.store(out_ptr + r * DV + cols, (acc / tl.where(total > 0, total, 1.0)).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + r, m_safe + tl.log(total))


def combine(part_out: torch.Tensor, part_lse: torch.Tensor, splits: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    """``combine_kernel`` over out's R rows (out [R, 512], lse [R]; part_out [R x splits, 512] fp32,
    part_lse [R x splits])."""
    combine_kernel[(out.shape[0],)](part_out, part_lse, out, lse, splits, ROWS, DV)


def paged_problem(
    lens: list[int], blocks_per_seq: int, device: str = "cuda", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [S x blocks_per_seq x 64, 576], a pool whose pages are shuffled and whose rows no sequence
    holds are NaN (the rest of a last page, and a page of its own), seqlens [S] and block_table
    [S, max pages] (its entries past a sequence's pages point at the NaN page)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-n // BLOCK_N) for n in lens]
    order = torch.randperm(sum(pages) + 1, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((len(lens), max(max(pages), 1)), int(order[-1]), dtype=torch.int32)
    held = torch.zeros((sum(pages) + 1) * BLOCK_N, dtype=torch.bool)
    first = 0
    for s, n in enumerate(lens):
        table[s, : pages[s]] = order[first : first + pages[s]]
        held[(table[s, : pages[s]].long()[:, None] * BLOCK_N + torch.arange(BLOCK_N)).reshape(-1)[:n]] = True
        first += pages[s]
    pool = torch.randn(held.numel(), DR + DV, generator=gen, device=device).bfloat16()
    pool[~held.to(device)] = float("nan")
    q = torch.randn(len(lens) * blocks_per_seq * ROWS, DR + DV, generator=gen, device=device).bfloat16()
    return q, pool, torch.tensor(lens, dtype=torch.int32, device=device), table.to(device)


def _keys(pool: torch.Tensor, block_table: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """Sequence ``seq``'s ``n`` latent rows [n, 576], gathered through its pages."""
    rows = block_table[seq, : -(-n // BLOCK_N)].long()[:, None] * BLOCK_N + torch.arange(BLOCK_N, device=pool.device)
    return pool[rows.reshape(-1)[:n]]


def reference(
    q: torch.Tensor, pool: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor, blocks_per_seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_loop`` in float64, for the sequences q's rows cover."""
    heads = blocks_per_seq * ROWS
    q64 = q.double().view(-1, heads, q.shape[1])
    outs, lses = [], []
    for s in range(q64.shape[0]):
        kv = _keys(pool, block_table, s, int(seqlens[s])).double()
        scores = q64[s] @ kv.T * q.shape[1] ** -0.5
        if kv.shape[0] == 0:  # out 0, lse -inf
            outs.append(torch.zeros(heads, DV, dtype=torch.float64, device=q.device))
            lses.append(torch.full((heads,), float("-inf"), dtype=torch.float64, device=q.device))
            continue
        outs.append(scores.softmax(-1) @ kv[:, :DV])
        lses.append(scores.logsumexp(-1))
    return torch.cat(outs), torch.cat(lses)


def lean_inputs(
    q: torch.Tensor, pool: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor, blocks_per_seq: int
) -> dict[str, torch.Tensor]:
    """``mla_loop``'s problem as ``lean_tp.decode_attention``'s arguments: q [S, heads, 576], the
    pool as K [pages, 64, 1, 576] and V its first 512 columns, cache_seqlens and block_table."""
    heads = blocks_per_seq * ROWS
    kv = pool.view(-1, BLOCK_N, 1, pool.shape[1])
    return dict(
        q=q.view(-1, heads, q.shape[1]),
        k_cache=kv,
        v_cache=kv[..., :DV],
        cache_seqlens=seqlens,
        block_table=block_table,
    )


def compiled_stats() -> dict[str, int]:
    """The sm_90 kernel's registers, stack bytes, shared memory bytes, and its K/V loop's SASS,
    local loads/stores and shared-memory bytes read a key (``lean_tp.tools.kernel_report.sass``),
    with the HGMMA shapes of the loop."""
    from lean_tp.tools.kernel_report.sass import (
        _kv_loop_instructions,
        dump,
        kv_loop_of_sass,
        kv_smem_read_bytes,
        resources,
    )

    kernel = compile_sm90()
    regs, stack, _ = resources(kernel.asm["cubin"])
    sass = dump(kernel.asm["cubin"], "-sass")
    instructions, local = kv_loop_of_sass(sass)
    # The opcode reads "HGMMA.64" and its operands "x32x16.F32.BF16 ...": the shape is both.
    hgmma = sorted(
        {(op + operands.split()[0]).rstrip(",") for op, operands in _kv_loop_instructions(sass) if op == "HGMMA.64"}
    )
    return dict(
        registers=regs,
        stack_bytes=stack,
        shared_bytes=kernel.metadata.shared,
        loop_sass=instructions,
        loop_local=local,
        smem_read_per_key=kv_smem_read_bytes(sass, 8) // BLOCK_N,
        hgmma=hgmma,
    )


def stats_line(stats: dict) -> str:
    return (
        f"sm_90: {stats['registers']} registers, {stats['stack_bytes']} bytes of stack, {stats['loop_local']} local "
        f"loads/stores in the loop, {stats['shared_bytes']} bytes of shared memory, {stats['loop_sass']} SASS a "
        f"{BLOCK_N}-key iteration, {stats['smem_read_per_key']} bytes of shared-memory reads a key, {stats['hgmma']}"
    )


def run_on_gpu(n_keys: int) -> list[str]:
    """Exactness against float64, then the loop's time beside lean's on DP attention's shape, 128
    heads a sequence on 64-row pages, ``n_keys`` keys each: a sequence per 2 SMs (a program a row
    block), and the benchmark's B=32 with each sequence's keys split over enough programs to fill
    the SMs (their partials merged by ``combine``)."""
    from bench_decode import Timer

    import lean_tp

    def median_us(fn) -> float:
        return Timer(torch.device("cuda"), 20)([fn])[0] * 1e6

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = []
    for sequences, splits in ((sms // 2, 1), (32, max(1, sms // 64))):
        problem = paged_problem([n_keys] * sequences, 2)
        out, lse = mla_loop(*problem, 2, splits=splits)
        q, pool, seqlens, table = problem
        ref_out, ref_lse = reference(q[: 2 * 2 * ROWS], pool, seqlens, table, 2)  # 2 sequences: float64's cost
        unwritten = int(out.isnan().sum()) + int(lse.isnan().sum())
        out_err = (out[: len(ref_out)].double() - ref_out).abs().max().item()
        lse_err = (lse[: len(ref_lse)].double() - ref_lse).abs().max().item()
        gluon_us = median_us(lambda: mla_loop(*problem, 2, out, lse, splits=splits))
        lean_args = lean_inputs(*problem, 2)
        lean_us = median_us(lambda: lean_tp.decode_attention(**lean_args))
        iterations = -(-n_keys // BLOCK_N) / splits
        lines.append(
            f"{sequences} sequences x 128 heads x {n_keys} keys, 64-row pages, {splits} split(s): {unwritten} values "
            f"unwritten, max |out - float64| {out_err:.2e}, |lse - float64| {lse_err:.2e}; gluon loop "
            f"{gluon_us:.1f} us ({gluon_us / iterations:.2f} us a {BLOCK_N}-key iteration), lean.decode_attention "
            f"{lean_us:.1f} us"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=32768, help="keys a sequence, on a GPU (32768)")
    parser.add_argument("--json", action="store_true", help="print the compiled statistics as JSON, nothing else")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(compiled_stats()))
        return 0
    print(stats_line(compiled_stats()))
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        print("\n".join(run_on_gpu(args.keys)))
    else:
        print("no sm_90 GPU: compiled statistics only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
