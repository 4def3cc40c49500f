"""The persistent grid: SM count x resident programs per SM of the kernel variant a call launches,
read from the compiled kernel (registers, shared memory) by the CUDA occupancy rules.

``compile_as_launched`` and ``example_args`` also serve the kernel report, which compiles the
same variants for sm_80 and sm_90 on a CPU-only machine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton

from lean_tp.ops.decode_attention.archs import ARCHS, PARTS, REPORT_PART, Arch, arch_for_capability, cuda_index
from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launch_args import check_launch_args, launch_args, plan_workspace
from lean_tp.ops.decode_attention.plan import DecodePlan, KernelVariant
from lean_tp.ops.decode_attention.tuning import INTERPRETER_PROGRAMS


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """Per-SM resources that bound resident programs (CUDA occupancy calculator terms)."""

    sm_count: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int  # bytes usable by blocks
    smem_reserved_per_block: int  # the driver reserves 1 KB per block on sm_80 and later

    @classmethod
    def of_arch(cls, arch: Arch, sm_count: int) -> SMLimits:
        return cls(
            sm_count,
            arch.regs_per_sm,
            arch.max_threads_per_sm,
            arch.max_blocks_per_sm,
            arch.smem_per_sm,
            arch.smem_reserved_per_block,
        )

    @classmethod
    def of_device(cls, index: int) -> SMLimits:
        """The device's own figures, and its architecture entry's for what torch does not report."""
        p = torch.cuda.get_device_properties(index)
        arch = arch_for_capability(p.major, p.minor, p.name)
        return dataclasses.replace(
            cls.of_arch(arch, p.multi_processor_count),
            regs_per_sm=p.regs_per_multiprocessor,
            max_threads_per_sm=p.max_threads_per_multi_processor,
            smem_per_sm=p.shared_memory_per_multiprocessor,
        )


# For the CPU kernel report: each architecture's limits with the SM count of the part it names.
SM_LIMITS = {key: SMLimits.of_arch(ARCHS[key], PARTS[part].sms) for key, part in REPORT_PART.items()}


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


def compile_as_launched(args: dict[str, Any], variant: KernelVariant, target: Any) -> Any:
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
        **variant.compile_options(),
        "debug": fn.debug or knobs.runtime.debug,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
    }
    bound, specialization, options = binder(**check_launch_args(fn, args), **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_variant(variant: KernelVariant, target: Any) -> Any:
    """``compile_as_launched`` on ``example_args(variant)``, also while torch.compile traces the op:
    the tracer's fake and functional tensor modes are set aside, since the JIT's binder reads the
    example tensors' data pointers (plain meta tensors)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return compile_as_launched(example_args(variant), variant, target)


def example_args(variant: KernelVariant, device: torch.device | str = "meta") -> dict[str, Any]:
    """Launch arguments of a typical call of ``variant`` (aligned, contiguous buffers; meta tensors
    by default).

    The kernel does not specialize on batch, heads, grid size or strides, so these compile to the
    same kernel as any real call of the variant with 16-byte aligned buffers.
    """
    f = variant.features
    batch, num_kv_heads, pages = 2, 1, 4
    q = torch.empty(
        batch, f.num_tokens, variant.group * num_kv_heads, variant.head_dim, dtype=variant.dtype, device=device
    )
    cache_dtype = f.fp8 or variant.dtype
    if variant.page_size is None:
        shape = (batch, num_kv_heads, pages * 16, variant.head_dim)
    else:
        shape = (batch * pages, variant.page_size, num_kv_heads, variant.head_dim)
    cache = torch.empty(shape, dtype=cache_dtype, device=device)
    head_dim_v = variant.head_dim_v or variant.head_dim
    v_cache = cache[..., :head_dim_v]  # V_IN_K reads it from K's tile; other variants as a tensor of its own
    if f.kv_strides_differ:  # V's rows twice as far apart: every other row of an allocation
        v_cache = torch.empty(2 * shape[0], *shape[1:], dtype=cache_dtype, device=device)[::2, ..., :head_dim_v]
    lens = torch.empty(batch, dtype=torch.int32, device=device)
    table = lens.new_empty(batch, pages) if variant.page_size is not None else None
    layout = CacheLayout.of(cache, v_cache, table)
    plan = DecodePlan(
        batch,
        q.shape[2],
        variant.head_dim,
        variant.dtype,
        torch.device(device),
        layout,
        f,
        window=128 if f.window else None,
        kernel=variant,
        num_programs=1,
        num_sms=1,
    )
    vector = torch.empty(q.shape[2], device=device)
    scale = vector[:1] if f.fp8 else None
    return launch_args(
        plan,
        q,
        cache,
        v_cache,
        lens,
        lens if f.leftpad else None,
        table,
        q.new_empty(*q.shape[:-1], head_dim_v),
        torch.empty(q.shape[:-1], device=device),
        plan_workspace(plan, device),
        lens,
        1.0,
        k_scale=scale,
        v_scale=scale,
        softcap=30.0 if f.softcap else None,
        sinks=vector if f.sinks else None,
    )


@functools.lru_cache(maxsize=None)
def _programs_per_sm_on(index: int, variant: KernelVariant) -> int:
    """Programs per SM of ``variant`` on CUDA device ``index`` (every constexpr of the call: left
    padding and features too, which can cost registers), capped by the tuning entry."""
    from triton.runtime import driver

    with torch.cuda.device(index):
        kernel = compile_variant(variant, driver.active.get_current_target())
        kernel._init_handles()
    config = variant.config
    occupancy = programs_per_sm(kernel.n_regs, kernel.metadata.shared, variant.num_warps, SMLimits.of_device(index))
    return max(1, min(occupancy, config.max_programs_per_sm))


def grid_size(device: torch.device, variant: KernelVariant) -> int:
    """Programs of the persistent grid on ``device`` for ``variant`` (whose ``arch`` is
    ``device``'s): SM count x resident programs per SM.

    Queried once per (device, variant) and cached, so ranks on different GPU models each get
    their own size. On CPU (the Triton interpreter) it is ``INTERPRETER_PROGRAMS``.
    """
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return sm_count(device) * _programs_per_sm_on(cuda_index(device), variant)


def sm_count(device: torch.device) -> int:
    """SMs the grid is spread over: the device's, or ``INTERPRETER_PROGRAMS`` (one program each) on CPU."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(cuda_index(device)).multi_processor_count
