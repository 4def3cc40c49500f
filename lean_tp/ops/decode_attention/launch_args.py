"""Every argument of ``decode_attention_fwd_kernel`` by name, from a plan and the call's tensors,
and the buffers a launch owns (workspace, merge counters).

Everything here reads only shapes, strides and dtypes, never tensor values, so a launch is safe
to capture in a CUDA graph and to trace with ``torch.compile``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lean_tp.ops.decode_attention.cache import valid_keys
from lean_tp.ops.decode_attention.folds import INVARIANT_REGIONS
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.merge import COUNTER_REGIONS
from lean_tp.ops.decode_attention.plan import NO_SPAN_LIMIT, DecodePlan
from lean_tp.ops.decode_attention.tuning import INVARIANT_GROUP_CHUNKS, padded_head_dim


def e4m3_operands(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an E4M3_BITS kernel reads of float8_e4m3fn caches: int32 words of four bytes, which
    ``attend.e4m3_words_to_f16`` converts two values per instruction, where both caches allow it
    (head dim, offset and strides multiples of 4 bytes); else bytes (uint8), one value at a time."""

    def words(c: torch.Tensor) -> bool:
        return c.shape[-1] % 4 == 0 and c.storage_offset() % 4 == 0 and all(x % 4 == 0 for x in c.stride()[:-1])

    dtype = torch.int32 if words(k_cache) and words(v_cache) else torch.uint8
    return k_cache.view(dtype), v_cache.view(dtype)


def stride_align(strides: tuple[int, ...], element_size: int) -> int:
    """The largest power of two, at most 16 bytes' worth of elements, that divides every stride."""
    align = 16 // element_size
    while align > 1 and any(x % align for x in strides):
        align //= 2
    return align


def check_launch_args(kernel: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Return ``args`` if it names every parameter of ``kernel`` exactly once, else ``TypeError``.

    Launches pass arguments by name, so a parameter added to, renamed in or dropped from the kernel
    fails here, naming it, instead of silently shifting the arguments that follow it.
    """
    names = list(kernel.arg_names)
    missing = [n for n in names if n not in args]
    unknown = [n for n in args if n not in names]
    if missing or unknown:
        raise TypeError(
            f"{kernel.__name__} launch: expected exactly its parameters, got missing {missing}, unknown {unknown}"
        )
    return args


def launch_args(
    plan: DecodePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    workspace: tuple[torch.Tensor, torch.Tensor],
    counters: torch.Tensor,
    softmax_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Every argument of ``decode_attention_fwd_kernel`` by name for a Triton ``plan``; q, out
    (B, Tq, Hq, D), lse (B, Tq, Hq), other shapes as in ``launcher.decode_attention_fwd``."""
    constexprs, layout = plan.kernel.constexprs, plan.layout
    if constexprs["E4M3_BITS"]:  # strides in words (or bytes) when the caches are read so
        k_cache, v_cache = e4m3_operands(k_cache, v_cache)
        layout = layout.viewed_as(k_cache.dtype)
    strides = (q.stride(0), q.stride(1), q.stride(2), *layout.k_strides, *layout.v_strides)
    # The schedule tiles each sequence's valid keys, clamped into the cache (``cache.valid_keys``)
    # by device ops before the launch, so that no stored value can make a tile count negative or
    # overflow, move the kernel's walk backwards or send a read or a write out of bounds; left
    # padding only shifts where the keys are read.
    start, end = valid_keys(cache_seqlens, cache_leftpad, layout.capacity)
    lengths = end - start if start is not None else end
    if constexprs["SEQ_TOKENS"] > 1:
        lengths = token_lengths(lengths, constexprs["SEQ_TOKENS"])
    # Scores in the log2 domain; with a softcap, the argument of the exp2 form of tanh (attend.py).
    log2_scale = softmax_scale * math.log2(math.e)
    placeholder = lengths  # passed for pointers the variant never reads
    args = {
        "q_ptr": q,
        "k_ptr": k_cache,
        "v_ptr": v_cache,
        "seqlens_ptr": lengths,
        "leftpad_ptr": start if start is not None else placeholder,
        "bt_ptr": block_table if layout.paged else placeholder,
        "out_ptr": out,
        "lse_ptr": lse,
        "ws_acc_ptr": workspace[0],
        "ws_ml_ptr": workspace[1],
        "counter_ptr": counters,
        "k_scale_ptr": k_scale if k_scale is not None else placeholder,
        "v_scale_ptr": v_scale if v_scale is not None else placeholder,
        "sinks_ptr": sinks if sinks is not None else placeholder,
        "qk_scale": 2 * log2_scale / softcap if softcap is not None else log2_scale,
        "cap_log2": softcap * math.log2(math.e) if softcap is not None else 0.0,
        "B": q.shape[0],
        "HKV": layout.num_kv_heads,
        "num_programs": plan.num_programs,
        "num_sms": plan.num_sms,
        "max_span": plan.max_span,
        "max_groups": plan.max_groups,
        # Pages of the pool (dim 0 in any view): the kernel reads no page id outside [0, num_pages).
        "num_pages": k_cache.shape[0] if layout.paged else 0,
        "window": plan.window if plan.window is not None else NO_SPAN_LIMIT,
        "stride_qb": q.stride(0),
        "stride_qt": q.stride(1),
        "stride_qh": q.stride(2),
        "stride_kb": layout.k_strides[0],
        "stride_kn": layout.k_strides[1],
        "stride_kh": layout.k_strides[2],
        "stride_vb": layout.v_strides[0],
        "stride_vn": layout.v_strides[1],
        "stride_vh": layout.v_strides[2],
        "stride_bt": block_table.stride(0) if layout.paged else 0,
        # A (1,) scale is per tensor: stride 0 reads it for every KV head.
        "stride_ks": int(k_scale is not None and k_scale.numel() > 1),
        "stride_vs": int(v_scale is not None and v_scale.numel() > 1),
        # The strides are not specialized (a new value must not recompile), so the kernel is told
        # how far they keep rows 16-byte aligned: that is what allows 16-byte vector loads.
        "STRIDE_ALIGN": stride_align(strides, layout.dtype.itemsize),
        **constexprs,
    }
    return check_launch_args(decode_attention_fwd_kernel, args)


def token_lengths(lengths: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(B * num_tokens,) int32: the keys each query token sees when it is scheduled as a sequence
    of its own (``KernelVariant.seq_tokens``), token t of sequence b at b * num_tokens + t: the
    ``lengths`` (B,) count the num_tokens new tokens, and token t sees up to and including its own.
    Device ops on shapes alone, as the launch's other length arithmetic."""
    later = torch.arange(num_tokens - 1, -1, -1, dtype=lengths.dtype, device=lengths.device)
    return (lengths[:, None] - later).clamp_(min=0).flatten()


def counters_size(num_programs: int) -> int:
    """Merge counters of a grid: ``merge.COUNTER_REGIONS`` regions of one per workspace slot
    (indexed by a group's or an output's first contributor's slot), which also hold the
    batch-invariant mode's ``folds.INVARIANT_REGIONS`` of one per program."""
    return max(COUNTER_REGIONS * 2, INVARIANT_REGIONS) * num_programs


def alloc_workspace(
    num_programs: int,
    block_g: int,
    head_dim: int,
    device: torch.device | str,
    group_slots: int | None = None,
    group_chunks: int = INVARIANT_GROUP_CHUNKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of two segments per program: acc (G, 2, BLOCK_G, BLOCK_D) and (m, l) (G, 2, 2, BLOCK_G),
    fp32; BLOCK_D is head_dim (V's) padded as the kernel pads it (head units that hold half of V's
    columns, ``rows.unit_cols``, lay their partials out half as wide, in the buffer's first half).
    Its size depends on the grid alone, never on lengths: a program contributes partials to at
    most two outputs, the one its range starts in and the one it ends in.

    With ``group_slots`` (``DecodePlan.group_slots``: the batch-invariant mode), acc (S, BLOCK_G,
    BLOCK_D) and (m, l) (S, 2, BLOCK_G) for S = G * group_chunks + group_slots slots
    (``invariant.py`` lays them out; group_chunks the kernel's IGROUP), sized from shapes, never
    from lengths.
    """
    block_d = padded_head_dim(head_dim)
    if group_slots is None:
        lead: tuple[int, ...] = (num_programs, 2)
    else:
        lead = (num_programs * group_chunks + group_slots,)
    ws_acc = torch.empty(*lead, block_g, block_d, device=device, dtype=torch.float32)
    ws_ml = torch.empty(*lead, 2, block_g, device=device, dtype=torch.float32)
    return ws_acc, ws_ml


def plan_workspace(plan: DecodePlan, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``alloc_workspace`` for a Triton plan."""
    kernel = plan.kernel
    igroup = kernel.constexprs["IGROUP"]
    return alloc_workspace(plan.num_programs, kernel.block_g, plan.layout.head_dim_v, device, plan.group_slots, igroup)


def check_workspace(workspace: object, plan: DecodePlan) -> None:
    """``ValueError`` unless ``workspace`` is a pair of contiguous float32 tensors with
    ``plan_workspace``'s shapes (the kernel writes every slot of a grid-sized workspace)."""
    expected = [(tuple(w.shape), torch.float32) for w in plan_workspace(plan, "meta")]
    parts = list(workspace) if isinstance(workspace, (tuple, list)) else [workspace]
    got = [(tuple(w.shape), w.dtype) if isinstance(w, torch.Tensor) else type(w).__name__ for w in parts]
    if got != expected or not all(w.is_contiguous() for w in parts):
        raise ValueError(
            f"workspace: expected contiguous tensors (shape, dtype) {expected} (alloc_workspace({plan.num_programs}, "
            f"{plan.kernel.block_g}, {plan.layout.head_dim_v}, group_slots={plan.group_slots}, "
            f"group_chunks={plan.kernel.constexprs['IGROUP']})), got {got}"
        )
