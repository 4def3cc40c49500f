"""Launcher of ``decode_attention_fwd_kernel``: grid sizing, workspace, strides.

Everything here depends only on shapes, dtypes and the device, never on tensor values, so the launch
is safe to capture in a CUDA graph and to trace with ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import torch
import triton

from lean_tp.ops.decode_attention.cache import CacheLayout, valid_keys
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.schedule import SEGMENT_FIELDS, lean_schedule_kernel
from lean_tp.ops.decode_attention.tuning import (
    INTERPRETER_PROGRAMS,
    INVARIANT_GROUP_CHUNKS,
    MAX_CONTRIBUTORS,
    MERGE_FANIN,
    MIN_TILES_PER_PROGRAM,
    SCHEDULE_BLOCK_B,
    arch_of,
    DecodeConfig,
    block_g_for,
    get_config,
    padded_head_dim,
)

@dataclasses.dataclass(frozen=True)
class KernelFeatures:
    """What a call uses beyond one-token decode of a 16/32-bit cache; each selects a kernel variant."""

    num_tokens: int = 1  # Tq, query tokens per sequence
    fp8: torch.dtype | None = None  # the cache's fp8 dtype, None when the cache has q's dtype
    softcap: bool = False
    window: bool = False
    sinks: bool = False
    # V's (row, token, head) strides differ from K's; otherwise a paged kernel forms each key's
    # address once for K and V (``DecodeConfig.share_kv_addresses``).
    kv_strides_differ: bool = False
    # Each output's bits depend on its own inputs alone (``invariant.py``), not on the batch.
    batch_invariant: bool = False


def e4m3_as_bits(fp8: torch.dtype | None, arch: str) -> bool:
    """Whether an fp8 cache is read as bytes and converted by hand: float8_e4m3fn before sm_89,
    where Triton has no e4m3 type (sm_80 compiles e5m2, sm_90 and the interpreter both)."""
    return fp8 == torch.float8_e4m3fn and arch == "sm80"


def e4m3_operands(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an E4M3_BITS kernel reads of float8_e4m3fn caches: int32 words of four bytes, which
    ``attend._e4m3_words_to_f16`` converts two values per instruction, where both caches allow it
    (head dim, offset and strides multiples of 4 bytes); else bytes (uint8), one value at a time."""
    def words(c: torch.Tensor) -> bool:
        return c.shape[-1] % 4 == 0 and c.storage_offset() % 4 == 0 and all(x % 4 == 0 for x in c.stride()[:-1])

    dtype = torch.int32 if words(k_cache) and words(v_cache) else torch.uint8
    return k_cache.view(dtype), v_cache.view(dtype)


def kernel_constexprs(
    config: DecodeConfig, head_dim: int, group: int, dtype: torch.dtype, page_size: int | None,
    has_leftpad: bool = False, features: KernelFeatures = KernelFeatures(), arch: str = "interp",
) -> dict[str, Any]:  # fmt: skip
    """Compile-time arguments of the kernel for one problem family (``dtype``: q's dtype; ``arch``:
    the tuning-table key of the target)."""
    block_g = block_g_for(features.num_tokens * group, config)
    block_d = padded_head_dim(head_dim)
    return {
        "GROUP": group,
        "TQ": features.num_tokens,
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_G": block_g,
        "NUM_GC": math.ceil(features.num_tokens * group / block_g),
        "BLOCK_N": config.block_n,
        "TILE_N": config.tile_n,
        "PAGED": page_size is not None,
        "PAGE_SIZE": page_size or 1,
        "MIN_TILES": MIN_TILES_PER_PROGRAM,
        "MAX_CONTRIB": MAX_CONTRIBUTORS,
        "FANIN": MERGE_FANIN,
        "WAVE": merge_wave(block_g, block_d, config.merge_wave_elems),
        "BLOCK_B": SCHEDULE_BLOCK_B,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "HAS_LEFTPAD": has_leftpad,
        "HAS_WINDOW": features.window,
        "SOFTCAP": features.softcap,
        "HAS_SINKS": features.sinks,
        "HAS_SCALES": features.fp8 is not None,
        "E4M3_BITS": e4m3_as_bits(features.fp8, arch),
        "SAME_KV_STRIDES": page_size is not None and config.share_kv_addresses and not features.kv_strides_differ,
        "INVARIANT": features.batch_invariant,
        "IGROUP": INVARIANT_GROUP_CHUNKS,
    }


def merge_wave(rows: int, block_d: int, elems: int) -> int:
    """Partials a merge loads at once: as many as ``elems`` fp32 elements hold (the tuning entry's
    ``merge_wave_elems``; a power of two, for ``tl.arange``), at least 1, at most the fan-in."""
    fit = max(1, elems // (rows * block_d))
    return min(MERGE_FANIN, 1 << (fit.bit_length() - 1))


def counters_size(num_programs: int) -> int:
    """Merge counters of a grid: one per workspace slot for the groups and one per slot for the
    outputs' second level (indexed by a group's or an output's first contributor)."""
    return 4 * num_programs


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
        **config.compile_options(args["PAGED"], args["BLOCK_G"]),
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
    device: torch.device | str = "meta", features: KernelFeatures = KernelFeatures(), arch: str = "interp",
) -> dict[str, Any]:
    """Launch arguments of a typical call for target ``arch`` (aligned, contiguous buffers; meta
    tensors by default).

    The kernel does not specialize on batch, heads, grid size or strides, so these compile to the
    same kernel as any real call of the family with 16-byte aligned buffers.
    """
    batch, num_kv_heads, pages = 2, 1, 4
    q = torch.empty(batch, features.num_tokens, group * num_kv_heads, head_dim, dtype=dtype, device=device)
    cache_dtype = features.fp8 or dtype
    if page_size is None:
        shape = (batch, num_kv_heads, pages * 16, head_dim)
    else:
        shape = (batch * pages, page_size, num_kv_heads, head_dim)
    cache = torch.empty(shape, dtype=cache_dtype, device=device)
    v_cache = cache
    if features.kv_strides_differ:  # V's rows twice as far apart: every other row of an allocation
        v_cache = torch.empty(2 * shape[0], *shape[1:], dtype=cache_dtype, device=device)[::2]
    lens = torch.empty(batch, dtype=torch.int32, device=device)
    table = lens.new_empty(batch, pages) if page_size is not None else None
    constexprs = kernel_constexprs(config, head_dim, group, dtype, page_size, has_leftpad, features)
    workspace = alloc_workspace(1, constexprs["BLOCK_G"], head_dim, torch.device(device))  # row blocks only
    vector = torch.empty(group * num_kv_heads, device=device)
    return launch_args(
        q, cache, v_cache, lens, lens if has_leftpad else None, table, torch.empty_like(q),
        torch.empty(q.shape[:-1], device=device), workspace, lens, 1.0, 1, config,
        k_scale=vector[:1] if features.fp8 else None, v_scale=vector[:1] if features.fp8 else None,
        softcap=30.0 if features.softcap else None, window=128 if features.window else None,
        sinks=vector if features.sinks else None, arch=arch,
    )  # fmt: skip


@functools.lru_cache(maxsize=None)
def _programs_per_sm_on(
    index: int, dtype: torch.dtype, head_dim: int, group: int, page_size: int | None, features: KernelFeatures,
    has_leftpad: bool = False,
) -> int:  # fmt: skip
    """Programs per SM of the variant a call launches on CUDA device ``index`` (every constexpr of
    the call: left padding and ``features`` too, which can cost registers), capped by the table."""
    from triton.runtime import driver

    config = get_config(torch.device("cuda", index), head_dim, dtype, features.fp8)
    args = example_args(dtype, head_dim, group, page_size, has_leftpad, config, features=features,
                        arch=arch_of(torch.device("cuda", index)))  # fmt: skip
    with torch.cuda.device(index):
        kernel = compile_as_launched(args, config, driver.active.get_current_target())
        kernel._init_handles()
    occupancy = programs_per_sm(kernel.n_regs, kernel.metadata.shared, config.num_warps, SMLimits.of_device(index))
    return max(1, min(occupancy, config.max_programs_per_sm))


def grid_size(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int, page_size: int | None = None,
    features: KernelFeatures = KernelFeatures(), has_leftpad: bool = False,
) -> int:  # fmt: skip
    """Programs of the persistent grid on ``device``: SM count x resident programs per SM of the
    kernel variant the call launches.

    Queried once per (device, configuration, features, left padding) and cached, so ranks on
    different GPU models each get their own size. On CPU (the Triton interpreter) it is
    ``INTERPRETER_PROGRAMS``. ``dtype`` is q's dtype (an fp8 cache is named in ``features``).
    """
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sm_count(device) * _programs_per_sm_on(index, dtype, head_dim, group, page_size, features, has_leftpad)


def sm_count(device: torch.device) -> int:
    """SMs the grid is spread over: the device's, or ``INTERPRETER_PROGRAMS`` (one program each) on CPU."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def alloc_workspace(
    num_programs: int, block_g: int, head_dim: int, device: torch.device | str, group_slots: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of two segments per program: acc (G, 2, BLOCK_G, BLOCK_D) and (m, l) (G, 2, 2, BLOCK_G),
    fp32; BLOCK_D is head_dim padded as the kernel pads it. Its size depends on the grid alone,
    never on lengths: a program contributes partials to at most two outputs, the one its range
    starts in and the one it ends in.

    With ``group_slots`` (``invariant_group_slots``: the batch-invariant mode), acc (S, BLOCK_G,
    BLOCK_D) and (m, l) (S, 2, BLOCK_G) for S = G * INVARIANT_GROUP_CHUNKS + group_slots slots
    (``invariant.py`` lays them out), sized from shapes, never from lengths.
    """
    block_d = padded_head_dim(head_dim)
    if group_slots is None:
        lead: tuple[int, ...] = (num_programs, 2)
    else:
        lead = (num_programs * INVARIANT_GROUP_CHUNKS + group_slots,)
    ws_acc = torch.empty(*lead, block_g, block_d, device=device, dtype=torch.float32)
    ws_ml = torch.empty(*lead, 2, block_g, device=device, dtype=torch.float32)
    return ws_acc, ws_ml


def invariant_groups(capacity: int, max_span: int, tile_n: int) -> int:
    """Most chunk groups one output has in the batch-invariant mode (every length is clamped to
    the capacity, and at most ``max_span`` keys are tiled)."""
    tiles = -(-min(capacity, max_span) // tile_n)
    return -(-tiles // INVARIANT_GROUP_CHUNKS)


def invariant_group_slots(batch: int, head_units: int, capacity: int, max_span: int, tile_n: int) -> int:
    """Workspace slots of group values in the batch-invariant mode: one per group of each output."""
    return batch * head_units * invariant_groups(capacity, max_span, tile_n)


def check_workspace(
    workspace: object, num_programs: int, block_g: int, head_dim: int, group_slots: int | None = None
) -> None:
    """``ValueError`` unless ``workspace`` is a pair of contiguous float32 tensors with
    ``alloc_workspace``'s shapes (the kernel writes every slot of a grid-sized workspace)."""
    expected = [(tuple(w.shape), torch.float32)
                for w in alloc_workspace(num_programs, block_g, head_dim, "meta", group_slots)]  # fmt: skip
    parts = list(workspace) if isinstance(workspace, (tuple, list)) else [workspace]
    got = [(tuple(w.shape), w.dtype) if isinstance(w, torch.Tensor) else type(w).__name__ for w in parts]
    if got != expected or not all(w.is_contiguous() for w in parts):
        raise ValueError(f"workspace: expected contiguous tensors (shape, dtype) {expected} "
                         f"(alloc_workspace({num_programs}, {block_g}, {head_dim}, group_slots={group_slots})), "
                         f"got {got}")  # fmt: skip


def decode_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    *,
    cache_leftpad: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
    num_programs: int | None = None,
    num_sms: int | None = None,
    config: DecodeConfig | None = None,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: Callable[[Any], Any] = lambda kernel: kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the LeanAttention decode kernel on validated inputs.

    Args:
        q: (B, Hq, D) or (B, Tq, Hq, D).
        k_cache, v_cache: (B, Hkv, S_max, D) with ``stride(-1) == 1``, or paged
            (num_pages, page_size, Hkv, D) together with ``block_table``; q's dtype or fp8.
        cache_seqlens: (B,) int32.
        block_table: (B, max_pages_per_seq) int32 or None.
        softmax_scale: multiplier of q.k.
        cache_leftpad: (B,) int32 or None: sequence b's keys are cache positions
            [cache_leftpad[b], cache_seqlens[b]) instead of [0, cache_seqlens[b]).
        k_scale, v_scale: (Hkv,) or (1,) float32, fp8 caches only.
        softcap, window, batch_invariant: as in ``lean_tp.decode_attention``; sinks: (Hq,) float32 or None.
        num_programs: grid size override (tests force tiny and huge grids); default ``grid_size``.
        num_sms: SMs the grid is spread over (``num_programs`` a multiple of it); default the
            device's with the default grid, else ``num_programs`` (one program per SM).
        config: tuning override; default the tuning-table entry.
        counters: (counters_size(num_programs),) int32 zeros, reused across launches (the kernel
            leaves them at zero); default a fresh zeroed buffer. A launch that did not complete
            (a killed process, a CUDA error) may leave them non-zero, and a later launch with
            them merges partials wrongly: zero them (``counters.zero_()``) after such a failure.
        out, lse: preallocated results of the shapes returned (tests pass NaN-filled ones to catch
            unwritten elements).
        workspace: preallocated ``alloc_workspace`` buffers (with ``group_slots`` from
            ``invariant_group_slots`` when ``batch_invariant``); their contents are never read
            before they are written.
        launch: wraps the kernel before launch (``torch.library.wrap_triton`` under the op).

    Returns:
        out in q's shape and dtype, and lse float32 in q's shape without D, natural log.
    """
    q4 = q if q.dim() == 4 else q[:, None]
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    head_dim, group = q.shape[-1], q.shape[-2] // layout.num_kv_heads
    features = features_of(q4, layout, softcap, window, sinks, batch_invariant)
    config = config or get_config(q.device, head_dim, q.dtype, layout.dtype)
    if num_programs is None:
        num_programs = grid_size(q.device, q.dtype, head_dim, group, layout.page_size, features, cache_leftpad is not None)
        num_sms = num_sms or sm_count(q.device)
    num_sms = num_sms or num_programs
    if num_sms < 1 or num_programs % num_sms:
        raise ValueError(f"num_sms: expected a divisor of num_programs={num_programs}, got {num_sms}")
    if q4.stride(-1) != 1:
        q4 = q4.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32) if lse is None else lse
    if not (out.is_contiguous() and lse.is_contiguous()):
        raise ValueError(f"out, lse: expected contiguous tensors, got strides {out.stride()} and {lse.stride()}")
    out4, lse4 = out.view(q4.shape), lse.view(q4.shape[:-1])
    rows = kernel_constexprs(config, head_dim, group, q.dtype, layout.page_size, features=features)
    group_slots = None
    if batch_invariant:
        group_slots = invariant_group_slots(q.shape[0], layout.num_kv_heads * rows["NUM_GC"], layout.capacity,
                                            span_limit(window, q4.shape[1]), config.tile_n)  # fmt: skip
    if workspace is None:
        workspace = alloc_workspace(num_programs, rows["BLOCK_G"], head_dim, q.device, group_slots)
    else:
        check_workspace(workspace, num_programs, rows["BLOCK_G"], head_dim, group_slots)
    if counters is None:
        counters = torch.zeros(counters_size(num_programs), device=q.device, dtype=torch.int32)
    elif counters.numel() < counters_size(num_programs):
        raise ValueError(f"counters: expected at least {counters_size(num_programs)} elements, got {counters.numel()}")
    args = launch_args(q4, k_cache, v_cache, cache_seqlens, cache_leftpad, block_table, out4, lse4, workspace, counters,
                       softmax_scale, num_programs, config, k_scale, v_scale, softcap, window, sinks,
                       num_sms=num_sms, batch_invariant=batch_invariant)  # fmt: skip
    with device_guard(q.device):
        launch(decode_attention_fwd_kernel)[(num_programs,)](**args, **config.compile_options(layout.paged, args["BLOCK_G"]))
    return out, lse


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a launch runs in: ``device`` made current for CUDA tensors. Triton launches on
    the current device, which need not be q's (``device_map="auto"`` puts layers on several GPUs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def features_of(
    q4: torch.Tensor, layout: CacheLayout, softcap: float | None, window: int | None, sinks: torch.Tensor | None,
    batch_invariant: bool = False,
) -> KernelFeatures:
    """The kernel variant a call needs; q4 is (B, Tq, Hq, D)."""
    fp8 = layout.dtype if layout.dtype != q4.dtype else None
    return KernelFeatures(q4.shape[1], fp8, softcap is not None, window is not None, sinks is not None,
                          layout.k_strides != layout.v_strides, batch_invariant)  # fmt: skip


def _stride_align(strides: tuple[int, ...], element_size: int) -> int:
    """The largest power of two, at most 16 bytes' worth of elements, that divides every stride."""
    align = 16 // element_size
    while align > 1 and any(x % align for x in strides):
        align //= 2
    return align


# More keys than any cache holds: without a window every valid key is tiled.
NO_SPAN_LIMIT = 2**30


def span_limit(window: int | None, num_tokens: int) -> int:
    """Keys of a sequence that any of its ``num_tokens`` queries sees: ``window + Tq - 1`` with a
    window, else all of them (``NO_SPAN_LIMIT``)."""
    return window + num_tokens - 1 if window is not None else NO_SPAN_LIMIT


def check_tile_count(batch: int, head_units: int, capacity: int, tile_n: int) -> None:
    """``ValueError`` unless the schedule's int32 tile arithmetic holds for any lengths: each length
    is clamped to the capacity, so the most tiles a batch can have is what must fit."""
    if capacity > NO_SPAN_LIMIT or batch * head_units * -(-capacity // tile_n) >= 2**31:
        raise ValueError(
            f"k_cache: expected a capacity of at most {NO_SPAN_LIMIT} keys per sequence and fewer than 2**31 "
            f"LeanTiles of {tile_n} keys for the batch at full capacity, got capacity {capacity}, batch {batch}, "
            f"{head_units} head units"
        )


def launch_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
    workspace: tuple[torch.Tensor, torch.Tensor], counters: torch.Tensor, softmax_scale: float, num_programs: int,
    config: DecodeConfig, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    softcap: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
    arch: str | None = None, num_sms: int | None = None, batch_invariant: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Every argument of ``decode_attention_fwd_kernel`` by name; q, out (B, Tq, Hq, D), lse
    (B, Tq, Hq), other shapes as in ``decode_attention_fwd``. ``arch``: the target's tuning key,
    by default that of q's device; ``num_sms``: SMs the grid is spread over, by default one per
    program."""
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    group = q.shape[2] // layout.num_kv_heads
    features = features_of(q, layout, softcap, window, sinks, batch_invariant)
    arch = arch or arch_of(q.device)
    constexprs = kernel_constexprs(config, q.shape[-1], group, q.dtype, layout.page_size, cache_leftpad is not None,
                                   features, arch)  # fmt: skip
    if constexprs["E4M3_BITS"]:  # strides in words when the caches are read as words
        k_cache, v_cache = e4m3_operands(k_cache, v_cache)
        layout = CacheLayout.of(k_cache, v_cache, block_table)
    strides = (q.stride(0), q.stride(1), q.stride(2), *layout.k_strides, *layout.v_strides)
    check_tile_count(q.shape[0], layout.num_kv_heads * constexprs["NUM_GC"], layout.capacity, config.tile_n)
    # The schedule tiles each sequence's valid keys, clamped into the cache (``cache.valid_keys``)
    # by device ops before the launch, so that no stored value can make a tile count negative or
    # overflow, move the kernel's walk backwards or send a read or a write out of bounds; left
    # padding only shifts where the keys are read.
    start, end = valid_keys(cache_seqlens, cache_leftpad, layout.capacity)
    lengths = end - start if start is not None else end
    # Scores in the log2 domain; with a softcap, the argument of the exp2 form of tanh (see _attend).
    log2_scale = softmax_scale * math.log2(math.e)
    placeholder = lengths  # passed for pointers the variant never reads
    args = {
        "q_ptr": q, "k_ptr": k_cache, "v_ptr": v_cache, "seqlens_ptr": lengths,
        "leftpad_ptr": start if start is not None else placeholder,
        "bt_ptr": block_table if layout.paged else placeholder,
        "out_ptr": out, "lse_ptr": lse, "ws_acc_ptr": workspace[0], "ws_ml_ptr": workspace[1], "counter_ptr": counters,
        "k_scale_ptr": k_scale if k_scale is not None else placeholder,
        "v_scale_ptr": v_scale if v_scale is not None else placeholder,
        "sinks_ptr": sinks if sinks is not None else placeholder,
        "qk_scale": 2 * log2_scale / softcap if softcap is not None else log2_scale,
        "cap_log2": softcap * math.log2(math.e) if softcap is not None else 0.0,
        "B": q.shape[0], "HKV": layout.num_kv_heads, "num_programs": num_programs, "num_sms": num_sms or num_programs,
        "max_span": span_limit(window, q.shape[1]),
        "max_groups": invariant_groups(layout.capacity, span_limit(window, q.shape[1]), config.tile_n),
        "window": window if window is not None else NO_SPAN_LIMIT,
        "stride_qb": q.stride(0), "stride_qt": q.stride(1), "stride_qh": q.stride(2),
        "stride_kb": layout.k_strides[0], "stride_kn": layout.k_strides[1], "stride_kh": layout.k_strides[2],
        "stride_vb": layout.v_strides[0], "stride_vn": layout.v_strides[1], "stride_vh": layout.v_strides[2],
        "stride_bt": block_table.stride(0) if layout.paged else 0,
        # A (1,) scale is per tensor: stride 0 reads it for every KV head.
        "stride_ks": int(k_scale is not None and k_scale.numel() > 1),
        "stride_vs": int(v_scale is not None and v_scale.numel() > 1),
        # The strides are not specialized (a new value must not recompile), so the kernel is told
        # how far they keep rows 16-byte aligned: that is what allows 16-byte vector loads.
        "STRIDE_ALIGN": _stride_align(strides, layout.dtype.itemsize),
        **constexprs,
    }  # fmt: skip
    return check_launch_args(decode_attention_fwd_kernel, args)


class Segment(NamedTuple):
    """One program's piece of one output, as ``lean_schedule_kernel`` writes it."""

    b: int  # sequence
    head_unit: int
    first_tile: int  # inside the head unit's tiles
    n_tiles: int
    contributors: int  # programs that share the output (1: not split)
    index: int  # this program's place among them, in program order
    slot: int  # workspace slot of its partial: 0 for the program's first segment, else 1
    group_first: int  # index of the first member of its merge group
    group_size: int
    groups: int  # merge groups of the output (1: one level)


def lean_schedule(
    cache_seqlens: torch.Tensor, head_units: int, tile_n: int, num_programs: int, max_segments: int | None = None,
    max_span: int = NO_SPAN_LIMIT, num_sms: int | None = None, capacity: int | None = None,
) -> list[list[Segment]]:
    """The kernel's stream-K schedule and merge tree, computed by the kernel's own schedule code.

    Args:
        cache_seqlens: (B,) int32, on CUDA or on CPU under the Triton interpreter.
        head_units: KV heads x row blocks per KV head (``Hkv * NUM_GC``).
        tile_n: LeanTile size in tokens; num_programs: launched grid size.
        max_segments: room for segments per program; ``ValueError`` if a program has more. By
            default as much as needed: too little room reruns with the count the kernel reported.
        max_span: keys of a sequence that are tiled, its last ``min(len, max_span)``
            (``window + Tq - 1`` with a sliding window).
        num_sms: SMs the grid is spread over (a divisor of num_programs); default num_programs.
        capacity: most keys a sequence holds; each length is clamped to [0, capacity] as a
            launch clamps it. Default: the longest length (at least 1).

    Returns:
        One list of ``Segment`` per active program; inactive programs are omitted.
    """
    device = cache_seqlens.device
    if capacity is None:
        capacity = max(1, int(cache_seqlens.max())) if cache_seqlens.numel() else 1
    check_tile_count(cache_seqlens.shape[0], head_units, capacity, tile_n)
    cache_seqlens = valid_keys(cache_seqlens, None, capacity)[1]
    room = max_segments or 64
    while True:
        segs = torch.full((num_programs, room, SEGMENT_FIELDS.value), -1, dtype=torch.int32, device=device)
        nseg = torch.empty(num_programs, dtype=torch.int32, device=device)
        lean_schedule_kernel[(num_programs,)](
            cache_seqlens, segs, nseg, cache_seqlens.shape[0], head_units, num_programs, num_sms or num_programs, max_span,
            TILE_N=tile_n, MIN_TILES=MIN_TILES_PER_PROGRAM, MAX_CONTRIB=MAX_CONTRIBUTORS, FANIN=MERGE_FANIN,
            BLOCK_B=SCHEDULE_BLOCK_B, MAX_SEGS=room,
        )  # fmt: skip
        counts = nseg.tolist()
        if max(counts) <= room:
            break
        if max_segments is not None:
            raise ValueError(f"max_segments: expected at least {max(counts)} (the most any program has), got {max_segments}")
        room = triton.next_power_of_2(max(counts))  # a power of two: few MAX_SEGS variants to compile
    rows = segs.tolist()
    return [[Segment(*s) for s in rows[p][:n]] for p, n in enumerate(counts) if n >= 0]


def merge_plan(programs: list[list[Segment]]) -> dict[tuple[int, int], list[list[tuple[int, int]]]]:
    """Who merges whom: for each split output (b, head_unit), its merge groups in merge order, each
    a list of (program, slot) partials in merge order. The last arriver of a group merges it; with
    more than one group, each group's result replaces its first member's partial and the last
    group merger merges those first members' partials, in group order.

    Built from what ``lean_schedule`` wrote, so tests and the simulator check the kernel's own tree.
    """
    plan: dict[tuple[int, int], dict[int, list[tuple[int, int, int]]]] = {}
    for p, segments in enumerate(programs):
        for s in segments:
            if s.contributors > 1:
                plan.setdefault((s.b, s.head_unit), {}).setdefault(s.group_first, []).append((s.index, p, s.slot))
    return {out: [[(p, slot) for _, p, slot in sorted(members)] for _, members in sorted(groups.items())]
            for out, groups in plan.items()}  # fmt: skip
