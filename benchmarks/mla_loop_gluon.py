"""An experiment: MLA decode's K/V loop written in Gluon for sm_90, with the layouts Triton's own
choice does not give (docs/mla.md).

One program computes 64 query rows of one sequence over its whole latent cache: q (64 x 576 bf16:
512 latent and 64 rope columns) is copied to shared memory once by TMA; 64-key blocks of the cache
are copied by TMA into two buffers, each block's copy issued while the block before it computes.
The two warp groups split every product by columns (``NVMMADistributedLayout`` with warps
[4, 2]): the score S = q K^T (each group 32 of the 64 keys, q read from shared memory by
``warpgroup_mma``), and P.V (each group 256 of the 512 output columns, P through shared memory,
V the block's latent columns). The softmax's row max and sum cross the groups through Triton's
reduction. Compiled for sm_90 (triton 3.7.1): 193 registers (244 with triton 3.6), no local
memory, 225 KB of shared memory, 524 SASS a 64-key iteration and 4832 bytes of shared-memory reads
a key, against lean's 64-row loop's 670 SASS a 32-key iteration and 13120 bytes a key (kernel
report).

Measured on an H200 (docs/results/2026-11-27-nvidia-h200.json, triton 3.6): exact against
float64, 1303 us for 66 sequences of 128 heads and 32k keys against lean_tp.decode_attention's
2685 on the same problem, 2.54 us a 64-key iteration.

It is not lean's kernel: no stream-K split, no pages, no fp8, no Tq. ``python
benchmarks/mla_loop_gluon.py`` prints the compiled statistics on any machine; on an sm_90 GPU
it also checks the result against float64 and times the loop beside ``lean_tp.decode_attention``
on the same problem (DP attention's 128 heads, one program a row block, a program an SM).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
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
    n_keys,
    scale_log2,
    BLOCKS_PER_SEQ: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Program p: rows [64 p, 64 p + 64) of q (qn_desc: [R, 512] blocks, qr_desc: [R, 64] at column
    512) against sequence p // BLOCKS_PER_SEQ, cache rows [s n_keys, (s + 1) n_keys) (kn_desc: [N,
    512] blocks, kr_desc: [N, 64] at column 512; V is the latent columns). out [R, 512] bf16 and lse
    [R] fp32 (natural log); n_keys >= 1. scale_log2: the softmax scale times log2(e)."""
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
    row0 = (pid // BLOCKS_PER_SEQ) * n_keys  # the sequence's first cache row
    num_blocks = gl.cdiv(n_keys, BLOCK_N)
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [pid * M, 0], q_bar, qn_smem)
    tma.async_copy_global_to_shared(qr_desc, [pid * M, DV], q_bar, qr_smem)
    for st in gl.static_range(STAGES):
        mbarrier.expect(kn_bars.index(st), kn_desc.block_type.nbytes, pred=st < num_blocks)
        mbarrier.expect(kr_bars.index(st), kr_desc.block_type.nbytes, pred=st < num_blocks)
        tma.async_copy_global_to_shared(
            kn_desc, [row0 + st * BLOCK_N, 0], kn_bars.index(st), kn_smem.index(st), pred=st < num_blocks
        )
        tma.async_copy_global_to_shared(
            kr_desc, [row0 + st * BLOCK_N, DV], kr_bars.index(st), kr_smem.index(st), pred=st < num_blocks
        )
    mbarrier.wait(q_bar, phase=0)

    m_i = gl.full([M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([M], 0.0, gl.float32, row_s)
    acc = gl.zeros([M, DV], gl.float32, o_layout)
    s_zero = gl.zeros([M, BLOCK_N], gl.float32, s_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for j in range(num_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        kn = kn_smem.index(slot)
        kr = kr_smem.index(slot)
        mbarrier.wait(kn_bars.index(slot), phase)
        mbarrier.wait(kr_bars.index(slot), phase)
        # S = q K^T: q from shared memory, the K tile viewed [D, BLOCK_N].
        s_tok = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_tok = warpgroup_mma(qr_smem, kr.permute((1, 0)), s_tok, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        # Keys past the sequence's end (the next sequence's rows, or TMA's zero fill) get -inf.
        scores = gl.where(gl.expand_dims(j * BLOCK_N + cols < n_keys, 0), scores * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(scores - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        # P through shared memory: each warp group wrote half its columns and reads all of them.
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        o_tok = warpgroup_mma(p_smem, kn, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        # Block j + STAGES into the slot once both groups are done with it and with P; the expects
        # go before the CTA barrier so that the copies need no other.
        nxt = j + STAGES
        mbarrier.expect(kn_bars.index(slot), kn_desc.block_type.nbytes, pred=nxt < num_blocks)
        mbarrier.expect(kr_bars.index(slot), kr_desc.block_type.nbytes, pred=nxt < num_blocks)
        _cta_barrier()
        tma.async_copy_global_to_shared(
            kn_desc, [row0 + nxt * BLOCK_N, 0], kn_bars.index(slot), kn, pred=nxt < num_blocks
        )
        tma.async_copy_global_to_shared(
            kr_desc, [row0 + nxt * BLOCK_N, DV], kr_bars.index(slot), kr, pred=nxt < num_blocks
        )
    mbarrier.invalidate(q_bar)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(kn_bars.index(st))
        mbarrier.invalidate(kr_bars.index(st))

    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    rows_o = pid * M + gl.arange(0, M, layout=row_o)
    cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + gl.expand_dims(rows_o, 1) * DV + gl.expand_dims(cols_o, 0), out.to(gl.bfloat16))
    gl.store(lse_ptr + pid * M + gl.arange(0, M, layout=row_s), (m_i + gl.log2(l_i)) * 0.6931471805599453)


def _smem_layout(shape: list[int]):
    return gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)


def compile_sm90(blocks_per_seq: int = 2):
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
        "out_ptr": "*bf16",
        "lse_ptr": "*fp32",
        "n_keys": "i32",
        "scale_log2": "fp32",
        "BLOCKS_PER_SEQ": "constexpr",
        "BLOCK_N": "constexpr",
        "STAGES": "constexpr",
    }
    constexprs = {"BLOCKS_PER_SEQ": blocks_per_seq, "BLOCK_N": BLOCK_N, "STAGES": STAGES}
    attrs = {(4,): [["tt.divisibility", 16]], (5,): [["tt.divisibility", 16]]}
    source = GluonASTSource(mla_loop_kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


def mla_loop(
    q: torch.Tensor,
    cache: torch.Tensor,
    n_keys: int,
    blocks_per_seq: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [R, 512] bf16 and lse [R] fp32 of q [R, 576] bf16 (R = 64 x programs; program p's rows
    against sequence p // blocks_per_seq) over cache [sequences x n_keys, 576] bf16, scale 576^-0.5;
    out and lse start as NaN unless given."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t: torch.Tensor, shape: list[int]) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t, shape, _smem_layout(shape))

    rows = q.shape[0]
    if out is None:
        out = torch.full((rows, DV), float("nan"), device=q.device, dtype=torch.bfloat16)
    if lse is None:
        lse = torch.full((rows,), float("nan"), device=q.device, dtype=torch.float32)
    descs = desc(q, [ROWS, DV]), desc(q, [ROWS, DR]), desc(cache, [BLOCK_N, DV]), desc(cache, [BLOCK_N, DR])
    scale_log2 = q.shape[1] ** -0.5 * math.log2(math.e)
    mla_loop_kernel[(rows // ROWS,)](*descs, out, lse, n_keys, scale_log2, blocks_per_seq, BLOCK_N, STAGES, num_warps=8)
    return out, lse


def reference(
    q: torch.Tensor, cache: torch.Tensor, n_keys: int, blocks_per_seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_loop`` in float64."""
    heads = blocks_per_seq * ROWS
    q64 = q.double().view(-1, heads, q.shape[1])
    kv = cache.double().view(q64.shape[0], n_keys, cache.shape[1])
    scores = torch.einsum("shd,snd->shn", q64, kv) * q.shape[1] ** -0.5
    out = torch.einsum("shn,snd->shd", scores.softmax(-1), kv[..., :DV])
    return out.reshape(-1, DV), scores.logsumexp(-1).reshape(-1)


def lean_inputs(
    q: torch.Tensor, cache: torch.Tensor, n_keys: int, blocks_per_seq: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mla_loop``'s problem as ``lean_tp.decode_attention``'s arguments: q [S, heads, 576], the
    cache as K [S, 1, n_keys, 576] and V its first 512 columns, and cache_seqlens [S] int32."""
    heads = blocks_per_seq * ROWS
    kv = cache.view(-1, 1, n_keys, cache.shape[1])
    lens = torch.full((kv.shape[0],), n_keys, device=q.device, dtype=torch.int32)
    return q.view(-1, heads, q.shape[1]), kv, kv[..., :DV], lens


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


def run_on_gpu(n_keys: int) -> str:
    """Exactness against float64, then the loop's time beside lean's on DP attention's shape: 128
    heads a sequence (2 programs), one sequence per 2 SMs, ``n_keys`` keys each."""
    from bench_decode import Timer

    import lean_tp

    def median_us(fn) -> float:
        return Timer(torch.device("cuda"), 20)([fn])[0] * 1e6

    torch.manual_seed(0)
    sequences = torch.cuda.get_device_properties(0).multi_processor_count // 2
    q = torch.randn(sequences * 2 * ROWS, DR + DV, device="cuda").bfloat16()
    cache = torch.randn(sequences * n_keys, DR + DV, device="cuda").bfloat16()
    check_rows = 4 * ROWS  # two sequences: the float64 reference of all of them is the cost
    out, lse = mla_loop(q, cache, n_keys, 2)
    ref_out, ref_lse = reference(q[:check_rows], cache[: 2 * n_keys], n_keys, 2)
    unwritten = int(out.isnan().sum()) + int(lse.isnan().sum())
    out_err = (out[:check_rows].double() - ref_out).abs().max().item()
    lse_err = (lse[:check_rows].double() - ref_lse).abs().max().item()
    gluon_us = median_us(lambda: mla_loop(q, cache, n_keys, 2, out, lse))
    lean_args = lean_inputs(q, cache, n_keys, 2)
    lean_us = median_us(lambda: lean_tp.decode_attention(*lean_args))
    iterations = -(-n_keys // BLOCK_N)
    return (
        f"{sequences} sequences x 128 heads x {n_keys} keys: {unwritten} values unwritten, "
        f"max |out - float64| {out_err:.2e}, "
        f"|lse - float64| {lse_err:.2e}; gluon loop {gluon_us:.1f} us ({gluon_us / iterations:.2f} us a "
        f"{BLOCK_N}-key iteration), lean.decode_attention {lean_us:.1f} us"
    )


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
        print(run_on_gpu(args.keys))
    else:
        print("no sm_90 GPU: compiled statistics only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
