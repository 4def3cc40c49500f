"""Shared-memory tiles of the Gluon MLA kernels (``kernel``, and benchmarks/mla_decode_seesaw.py):
the Gluon version shims they share, the NVMMA layout of a TMA box, an e4m3 block's conversion to
bf16, and the zeroing of a page's rows past a sequence's end."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from lean_tp.ops.decode_attention.attend import E4M3_TO_BF16_ASM

# The CTA barrier is gl.thread_barrier in triton 3.6 and gl.barrier from 3.7 (inside a
# warp-specialized partition, a barrier of the partition's warps).
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# A TMA load is tma.async_load from triton 3.8 (3.9 removes async_copy_global_to_shared), and
# tma.async_copy_global_to_shared before it; the arguments are the same.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def convert_block(kn8, kr8, kn, kr, first, MASK: gl.constexpr):
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


# Gluon's types of the tensors the kernel's descriptors take (``str`` of each: its name in a
# compiled signature).
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def smem_layout(shape: list[int], dtype: torch.dtype = torch.bfloat16):
    """The NVMMA shared layout of a [rows, cols] TMA box of a bf16 or e4m3 tensor (the descriptors'
    and the buffers')."""
    return gl.NVMMASharedLayout.get_default_for(shape, GL_DTYPES[dtype])
