"""Launcher of ``decode_attention_fwd_kernel``: grid sizing, workspace, strides.

Everything here depends only on shapes, dtypes and the device, never on tensor values, so the launch
is safe to capture in a CUDA graph and to trace with ``torch.compile``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import triton

from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.schedule import lean_schedule_kernel
from lean_tp.ops.decode_attention.tuning import (
    INTERPRETER_PROGRAMS,
    MIN_TILES_PER_PROGRAM,
    SCHEDULE_BLOCK_B,
    DecodeConfig,
    block_g_for,
    get_config,
)

_TRITON_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def kernel_constexprs(
    config: DecodeConfig, head_dim: int, group: int, dtype: torch.dtype, page_size: int | None,
    has_leftpad: bool = False,
) -> dict[str, Any]:
    """Compile-time arguments of the kernel for one problem family."""
    block_g = block_g_for(group, config)
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_G": block_g,
        "NUM_GC": math.ceil(group / block_g),
        "BLOCK_N": config.block_n,
        "TILE_N": config.tile_n,
        "PAGED": page_size is not None,
        "PAGE_SIZE": page_size or 1,
        "MIN_TILES": MIN_TILES_PER_PROGRAM,
        "BLOCK_B": SCHEDULE_BLOCK_B,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "HAS_LEFTPAD": has_leftpad,
    }


def kernel_signature(dtype: torch.dtype, constexprs: dict[str, Any]) -> dict[str, str]:
    """Argument types for ``triton.compile(ASTSource(...))``, as the JIT would infer them."""
    ty = _TRITON_DTYPES[dtype]
    sig: dict[str, str] = {}
    for name in decode_attention_fwd_kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr"):
            sig[name] = f"*{ty}"
        elif name in ("seqlens_ptr", "leftpad_ptr", "bt_ptr", "counter_ptr"):
            sig[name] = "*i32"
        elif name in ("ws_acc_ptr", "ws_ml_ptr", "lse_ptr"):
            sig[name] = "*fp32"
        elif name == "scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_for_target(
    target: Any, dtype: torch.dtype, constexprs: dict[str, Any], config: DecodeConfig
) -> Any:
    """Compile one kernel configuration ahead of time for ``target`` (a ``GPUTarget``).

    Used for occupancy on a GPU and, on CPU-only machines, to prove each configuration compiles.
    """
    from triton.compiler import ASTSource

    sig = kernel_signature(dtype, constexprs)
    aligned = [i for i, name in enumerate(sig) if name.endswith("_ptr")]
    src = ASTSource(
        fn=decode_attention_fwd_kernel,
        signature=sig,
        constexprs=constexprs,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(src, target=target, options={"num_warps": config.num_warps, "num_stages": config.num_stages})


@functools.lru_cache(maxsize=None)
def _programs_per_sm(device_index: int, dtype: torch.dtype, constexpr_items: tuple, config: DecodeConfig) -> tuple[int, int]:
    """(SM count, resident programs per SM) of a compiled configuration on one CUDA device."""
    from triton.runtime import driver

    target = driver.active.get_current_target()
    with torch.cuda.device(device_index):
        kernel = compile_for_target(target, dtype, dict(constexpr_items), config)
        kernel._init_handles()
    props = driver.active.utils.get_device_properties(device_index)
    cuda_props = torch.cuda.get_device_properties(device_index)
    threads = config.num_warps * props["warpSize"]
    by_threads = getattr(cuda_props, "max_threads_per_multi_processor", 2048) // threads
    regs_per_sm = getattr(cuda_props, "regs_per_multiprocessor", props["max_num_regs"])
    by_regs = regs_per_sm // max(kernel.n_regs * threads, 1)
    smem_per_sm = getattr(cuda_props, "shared_memory_per_multiprocessor", props["max_shared_mem"])
    by_smem = smem_per_sm // kernel.metadata.shared if kernel.metadata.shared else by_threads
    occupancy = max(1, min(by_threads, by_regs, by_smem, config.max_programs_per_sm))
    return props["multiprocessor_count"], occupancy


def grid_size(device: torch.device, dtype: torch.dtype, head_dim: int, group: int, page_size: int | None = None) -> int:
    """Programs of the persistent grid on ``device``: SM count x resident programs per SM.

    Queried once per (device, configuration) and cached, so ranks on different GPU models each get
    their own size. On CPU (the Triton interpreter) it is ``INTERPRETER_PROGRAMS``.
    """
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    config = get_config(device, head_dim, dtype)
    constexprs = kernel_constexprs(config, head_dim, group, dtype, page_size)
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, per_sm = _programs_per_sm(index, dtype, tuple(sorted(constexprs.items())), config)
    return sms * per_sm


def alloc_workspace(num_programs: int, block_g: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of two segments per program: acc (G, 2, BLOCK_G, D) and (m, l) (G, 2, 2, BLOCK_G), fp32.

    Its size depends on the grid alone, never on lengths: a program contributes partials to at
    most two outputs, the one its range starts in and the one it ends in.
    """
    ws_acc = torch.empty(num_programs, 2, block_g, head_dim, device=device, dtype=torch.float32)
    ws_ml = torch.empty(num_programs, 2, 2, block_g, device=device, dtype=torch.float32)
    return ws_acc, ws_ml


def decode_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    *,
    cache_leftpad: torch.Tensor | None = None,
    num_programs: int | None = None,
    config: DecodeConfig | None = None,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: Callable[[Any], Any] = lambda kernel: kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the LeanAttention decode kernel on validated inputs.

    Args:
        q: (B, Hq, D).
        k_cache, v_cache: (B, Hkv, S_max, D) with ``stride(-1) == 1``, or paged
            (num_pages, page_size, Hkv, D) together with ``block_table``.
        cache_seqlens: (B,) int32.
        block_table: (B, max_pages_per_seq) int32 or None.
        softmax_scale: multiplier of q.k.
        cache_leftpad: (B,) int32 or None: sequence b's keys are cache positions
            [cache_leftpad[b], cache_seqlens[b]) instead of [0, cache_seqlens[b]).
        num_programs: grid size override (tests force tiny and huge grids); default ``grid_size``.
        config: tuning override; default the tuning-table entry.
        counters: (>= B * Hkv * NUM_GC,) int32 zeros, reused across launches (the kernel leaves
            them at zero); default a fresh zeroed buffer.
        out, lse: preallocated results (tests pass NaN-filled ones to catch unwritten elements).
        workspace: preallocated ``alloc_workspace`` buffers; their contents are never read before
            they are written.
        launch: wraps the kernel before launch (``torch.library.wrap_triton`` under the op).

    Returns:
        out (B, Hq, D) in q's dtype and lse (B, Hq) float32, natural log.
    """
    batch, num_q_heads, head_dim = q.shape
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    num_kv_heads = layout.num_kv_heads
    group = num_q_heads // num_kv_heads
    config = config or get_config(q.device, head_dim, layout.dtype)
    constexprs = kernel_constexprs(config, head_dim, group, layout.dtype, layout.page_size, cache_leftpad is not None)
    if num_programs is None:
        num_programs = grid_size(q.device, layout.dtype, head_dim, group, layout.page_size)
    block_g, num_gc = constexprs["BLOCK_G"], constexprs["NUM_GC"]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = torch.empty(batch, num_q_heads, device=q.device, dtype=torch.float32)
    ws_acc, ws_ml = workspace or alloc_workspace(num_programs, block_g, head_dim, q.device)
    if counters is None:
        counters = torch.zeros(batch * num_kv_heads * num_gc, device=q.device, dtype=torch.int32)
    bt = block_table if layout.paged else cache_seqlens  # any int32 pointer; never read when not paged
    # The schedule tiles each sequence's valid keys; left padding only shifts where they are read.
    lengths = cache_seqlens if cache_leftpad is None else cache_seqlens - cache_leftpad
    leftpad = cache_leftpad if cache_leftpad is not None else cache_seqlens  # never read without it
    launch(decode_attention_fwd_kernel)[(num_programs,)](
        q, k_cache, v_cache, lengths, leftpad, bt, out, lse, ws_acc, ws_ml, counters,
        softmax_scale * math.log2(math.e), batch, num_kv_heads, num_programs,
        q.stride(0), q.stride(1),
        *layout.k_strides, *layout.v_strides,
        block_table.stride(0) if layout.paged else 0,
        out.stride(0), out.stride(1), lse.stride(0),
        num_warps=config.num_warps, num_stages=config.num_stages, **constexprs,
    )  # fmt: skip
    return out, lse


def lean_schedule(
    cache_seqlens: torch.Tensor, head_units: int, tile_n: int, num_programs: int, max_segments: int | None = None
) -> list[list[tuple[int, int, int, int, int]]]:
    """The kernel's stream-K schedule, computed by the kernel's own schedule code.

    Args:
        cache_seqlens: (B,) int32, on CUDA or on CPU under the Triton interpreter.
        head_units: KV heads x row blocks per KV head (``Hkv * NUM_GC``).
        tile_n: LeanTile size in tokens; num_programs: launched grid size.
        max_segments: room for segments per program; ``ValueError`` if a program has more. By
            default as much as needed: too little room reruns with the count the kernel reported.

    Returns:
        One list per active program of segments ``(b, head_unit, first_tile, n_tiles, contributors)``,
        where contributors counts the programs that share that output. Inactive programs are omitted.
    """
    device = cache_seqlens.device
    room = max_segments or 64
    while True:
        segs = torch.full((num_programs, room, 5), -1, dtype=torch.int32, device=device)
        nseg = torch.empty(num_programs, dtype=torch.int32, device=device)
        lean_schedule_kernel[(num_programs,)](
            cache_seqlens, segs, nseg, cache_seqlens.shape[0], head_units, num_programs,
            TILE_N=tile_n, MIN_TILES=MIN_TILES_PER_PROGRAM, BLOCK_B=SCHEDULE_BLOCK_B, MAX_SEGS=room,
        )  # fmt: skip
        counts = nseg.tolist()
        if max(counts) <= room:
            break
        if max_segments is not None:
            raise ValueError(f"max_segments: expected at least {max(counts)} (the most any program has), got {max_segments}")
        room = triton.next_power_of_2(max(counts))  # a power of two: few MAX_SEGS variants to compile
    rows = segs.tolist()
    return [[tuple(s) for s in rows[p][:n]] for p, n in enumerate(counts) if n >= 0]
