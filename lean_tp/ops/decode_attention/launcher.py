"""Launcher of ``decode_attention_fwd_kernel``: grid sizing, workspace, strides.

Everything here depends only on shapes, dtypes and the device, never on tensor values, so the launch
is safe to capture in a CUDA graph and to trace with ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
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


def check_launch_args(kernel: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Return ``args`` if it names every parameter of ``kernel`` exactly once, else ``TypeError``.

    Launches pass arguments by name, so a parameter added to, renamed in or dropped from the kernel
    fails here, naming it, instead of silently shifting the arguments that follow it.
    """
    names = list(kernel.arg_names)
    missing = [n for n in names if n not in args]
    unknown = [n for n in args if n not in names]
    if missing or unknown:
        raise TypeError(f"{kernel.__name__} launch: expected exactly its parameters, got missing {missing}, unknown {unknown}")
    return args


def compile_as_launched(args: dict[str, Any], config: DecodeConfig, target: Any) -> Any:
    """The kernel a launch with ``args`` runs, compiled for ``target`` (a ``GPUTarget``).

    Types, divisibility-by-16 attributes and constants come from the JIT's own specialization of
    the arguments (tensors may be on the meta device), so registers, spills and shared memory are
    those of the launched kernel. Needs ``decode_attention_fwd_kernel`` to be a JIT function (not
    interpreted): on CPU-only machines call it from a process without ``TRITON_INTERPRET=1``.
    """
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = decode_attention_fwd_kernel
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "debug": fn.debug or knobs.runtime.debug,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
    }
    bound, specialization, options = binder(**check_launch_args(fn, args), **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """Per-SM resources that bound resident programs (CUDA occupancy calculator terms)."""

    sm_count: int
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 233472  # bytes usable by blocks; sm_90: 228 KB
    smem_reserved_per_block: int = 1024  # the driver reserves 1 KB per block on sm_80 and later

    @classmethod
    def of_device(cls, index: int) -> SMLimits:
        p = torch.cuda.get_device_properties(index)
        return cls(p.multi_processor_count, p.regs_per_multiprocessor, p.max_threads_per_multi_processor,
                   32, p.shared_memory_per_multiprocessor)  # fmt: skip


# Published limits, for the CPU kernel report: A100-SXM4 (sm_80) and H100-SXM5 (sm_90).
SM_LIMITS = {"sm80": SMLimits(108, smem_per_sm=167936), "sm90": SMLimits(132, smem_per_sm=233472)}


def programs_per_sm(n_regs: int, shared: int, num_warps: int, limits: SMLimits) -> int:
    """Resident programs per SM of a compiled kernel: the least of the thread, block, register and
    shared-memory bounds. Registers are allocated per warp in units of 256 and split over the SM's
    4 sub-partitions; every block also takes the driver's reserved shared memory."""
    by_threads = limits.max_threads_per_sm // (num_warps * 32)
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    warps_by_regs = 4 * ((limits.regs_per_sm // 4) // regs_per_warp) if regs_per_warp else 1 << 30
    by_regs = warps_by_regs // num_warps
    by_smem = limits.smem_per_sm // (shared + limits.smem_reserved_per_block)
    return min(by_threads, limits.max_blocks_per_sm, by_regs, by_smem)


def example_args(
    dtype: torch.dtype, head_dim: int, group: int, page_size: int | None, has_leftpad: bool, config: DecodeConfig,
    device: torch.device | str = "meta",
) -> dict[str, Any]:
    """Launch arguments of a typical call (aligned, contiguous buffers; meta tensors by default).

    The kernel does not specialize on batch, heads, grid size or strides, so these compile to the
    same kernel as any real call of the family with 16-byte aligned buffers.
    """
    batch, num_kv_heads, pages = 2, 1, 4
    q = torch.empty(batch, group * num_kv_heads, head_dim, dtype=dtype, device=device)
    if page_size is None:
        cache = torch.empty(batch, num_kv_heads, pages * 16, head_dim, dtype=dtype, device=device)
    else:
        cache = torch.empty(batch * pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    lens = torch.empty(batch, dtype=torch.int32, device=device)
    table = lens.new_empty(batch, pages) if page_size is not None else None
    constexprs = kernel_constexprs(config, head_dim, group, dtype, page_size, has_leftpad)
    workspace = alloc_workspace(1, constexprs["BLOCK_G"], head_dim, torch.device(device))
    return launch_args(
        q, cache, cache, lens, lens if has_leftpad else None, table, torch.empty_like(q),
        torch.empty(batch, group, device=device), workspace, lens, 1.0, 1, config,
    )  # fmt: skip


@functools.lru_cache(maxsize=None)
def _programs_per_sm_on(index: int, dtype: torch.dtype, head_dim: int, group: int, page_size: int | None) -> int:
    """Programs per SM of the family's launched kernel on CUDA device ``index``, capped by the table."""
    from triton.runtime import driver

    config = get_config(torch.device("cuda", index), head_dim, dtype)
    args = example_args(dtype, head_dim, group, page_size, False, config)
    with torch.cuda.device(index):
        kernel = compile_as_launched(args, config, driver.active.get_current_target())
        kernel._init_handles()
    occupancy = programs_per_sm(kernel.n_regs, kernel.metadata.shared, config.num_warps, SMLimits.of_device(index))
    return max(1, min(occupancy, config.max_programs_per_sm))


def grid_size(device: torch.device, dtype: torch.dtype, head_dim: int, group: int, page_size: int | None = None) -> int:
    """Programs of the persistent grid on ``device``: SM count x resident programs per SM.

    Queried once per (device, configuration) and cached, so ranks on different GPU models each get
    their own size. On CPU (the Triton interpreter) it is ``INTERPRETER_PROGRAMS``.
    """
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return sms * _programs_per_sm_on(index, dtype, head_dim, group, page_size)


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
    group = num_q_heads // layout.num_kv_heads
    config = config or get_config(q.device, head_dim, layout.dtype)
    if num_programs is None:
        num_programs = grid_size(q.device, layout.dtype, head_dim, group, layout.page_size)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = torch.empty(batch, num_q_heads, device=q.device, dtype=torch.float32)
    if not (out.is_contiguous() and lse.is_contiguous()):
        raise ValueError(f"out, lse: expected contiguous tensors, got strides {out.stride()} and {lse.stride()}")
    rows = kernel_constexprs(config, head_dim, group, layout.dtype, layout.page_size)  # row blocks: BLOCK_G, NUM_GC
    workspace = workspace or alloc_workspace(num_programs, rows["BLOCK_G"], head_dim, q.device)
    if counters is None:
        counters = torch.zeros(batch * layout.num_kv_heads * rows["NUM_GC"], device=q.device, dtype=torch.int32)
    args = launch_args(q, k_cache, v_cache, cache_seqlens, cache_leftpad, block_table, out, lse, workspace, counters,
                       softmax_scale, num_programs, config)  # fmt: skip
    launch(decode_attention_fwd_kernel)[(num_programs,)](**args, num_warps=config.num_warps, num_stages=config.num_stages)
    return out, lse


def launch_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
    workspace: tuple[torch.Tensor, torch.Tensor], counters: torch.Tensor, softmax_scale: float, num_programs: int,
    config: DecodeConfig,
) -> dict[str, Any]:
    """Every argument of ``decode_attention_fwd_kernel`` by name (shapes as in ``decode_attention_fwd``)."""
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    group = q.shape[1] // layout.num_kv_heads
    strides = (q.stride(0), q.stride(1), *layout.k_strides, *layout.v_strides)
    # The strides are not specialized (a new value must not recompile), so the kernel is told that
    # they keep rows 16-byte aligned when they do: that is what allows 16-byte vector loads.
    vec = 16 // q.element_size()
    constexprs = kernel_constexprs(config, q.shape[-1], group, layout.dtype, layout.page_size, cache_leftpad is not None)
    # The schedule tiles each sequence's valid keys; left padding only shifts where they are read.
    lengths = cache_seqlens if cache_leftpad is None else cache_seqlens - cache_leftpad
    args = {
        "q_ptr": q, "k_ptr": k_cache, "v_ptr": v_cache, "seqlens_ptr": lengths,
        "leftpad_ptr": cache_leftpad if cache_leftpad is not None else lengths,  # never read without left padding
        "bt_ptr": block_table if layout.paged else lengths,  # never read when not paged
        "out_ptr": out, "lse_ptr": lse, "ws_acc_ptr": workspace[0], "ws_ml_ptr": workspace[1], "counter_ptr": counters,
        "scale_log2": softmax_scale * math.log2(math.e), "B": q.shape[0], "HKV": layout.num_kv_heads,
        "num_programs": num_programs,
        "stride_qb": q.stride(0), "stride_qh": q.stride(1),
        "stride_kb": layout.k_strides[0], "stride_kn": layout.k_strides[1], "stride_kh": layout.k_strides[2],
        "stride_vb": layout.v_strides[0], "stride_vn": layout.v_strides[1], "stride_vh": layout.v_strides[2],
        "stride_bt": block_table.stride(0) if layout.paged else 0,
        "STRIDE_ALIGN": vec if all(x % vec == 0 for x in strides) else 1,
        **constexprs,
    }  # fmt: skip
    return check_launch_args(decode_attention_fwd_kernel, args)


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
