"""Launcher of ``decode_attention_fwd_kernel``: the call's plan, its buffers, the launch; and the
host's view of the kernel's schedule (``lean_schedule``, ``merge_plan``) for tests and the simulator.

Everything on the launch path depends only on shapes, dtypes and the device, never on tensor
values, so the launch is safe to capture in a CUDA graph and to trace with ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, NamedTuple

import torch
import triton

from lean_tp.ops.decode_attention.cache import is_prefix_view, valid_keys
from lean_tp.ops.decode_attention.checks import check_inputs, uses_triton
from lean_tp.ops.decode_attention.grid import grid_size, sm_count
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launch_args import (
    check_workspace,
    counters_size,
    launch_args,
    plan_workspace,
)
from lean_tp.ops.decode_attention.plan import (
    NO_SPAN_LIMIT,
    DecodePlan,
    Features,
    KernelVariant,
    check_tile_count,
    is_one_sequence,
)
from lean_tp.ops.decode_attention.schedule import SEGMENT_FIELDS, lean_schedule_kernel
from lean_tp.ops.decode_attention.tuning import (
    FP_FUSION,
    MAX_CONTRIBUTORS,
    MERGE_FANIN,
    MIN_TILES_PER_PROGRAM,
    SCHEDULE_BLOCK_B,
    DecodeConfig,
    arch_of,
)
from lean_tp.ops.mla_gluon.launcher import gluon_takes


def plan_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    *,
    backend: str = "triton",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    batch_invariant: bool = False,
    config: DecodeConfig | None = None,
    num_programs: int | None = None,
    num_sms: int | None = None,
) -> DecodePlan:
    """Check a call (``checks.check_inputs``) and plan it: the one place its layout, features,
    backend, tuning entry, kernel constants and grid are decided. Arguments as in
    ``decode_attention_fwd``; ``backend`` as in ``lean_tp.decode_attention``. ``config``,
    ``num_programs`` and ``num_sms`` override the tuning entry and the grid (tests force tiny and
    huge grids)."""
    layout = check_inputs(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        backend,
        cache_leftpad,
        k_scale,
        v_scale,
        softcap,
        window,
        sinks,
        softmax_scale,
        batch_invariant=batch_invariant,
    )
    num_tokens = q.shape[1] if q.dim() == 4 else 1
    features = Features(
        num_tokens=num_tokens,
        fp8=layout.dtype if layout.dtype != q.dtype else None,
        softcap=softcap is not None,
        window=window is not None,
        sinks=sinks is not None,
        leftpad=cache_leftpad is not None,
        kv_strides_differ=layout.k_strides != layout.v_strides,
        batch_invariant=batch_invariant,
        v_in_k=is_prefix_view(v_cache, k_cache),
        one_sequence=is_one_sequence(q.shape[0], num_tokens, q.shape[-2] // layout.num_kv_heads),
    )
    plan = DecodePlan(q.shape[0], q.shape[-2], q.shape[-1], q.dtype, q.device, layout, features, window)
    if not uses_triton(q.device, q.shape[-1], q.dtype, backend, features.fp8, layout.head_dim_v):
        return plan
    kernel = KernelVariant(
        arch_of(q.device), q.dtype, q.shape[-1], plan.group, layout.page_size, features, config, layout.head_dim_v
    )
    if num_programs is None:
        num_programs, num_sms = grid_size(q.device, kernel), num_sms or sm_count(q.device)
    num_sms = num_sms or num_programs
    if num_sms < 1 or num_programs % num_sms:
        raise ValueError(f"num_sms: expected a divisor of num_programs={num_programs}, got {num_sms}")
    # A program for each lane of the schedule (a GPU's grid always has; tests' tiny grids grow).
    num_programs *= -(-kernel.lanes // num_programs)
    plan = dataclasses.replace(plan, kernel=kernel, num_programs=num_programs, num_sms=num_sms)
    check_tile_count(plan.schedule_batch, plan.head_units, layout.capacity, kernel.constexprs["TILE_N"])
    return dataclasses.replace(plan, gluon=gluon_takes(plan))


def decode_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    *,
    plan: DecodePlan | None = None,
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
    """Launch the LeanAttention decode kernel.

    Args:
        q: (B, Hq, D) or (B, Tq, Hq, D).
        k_cache, v_cache: (B, Hkv, S_max, D) with ``stride(-1) == 1``, or paged
            (num_pages, page_size, Hkv, D) together with ``block_table``; q's dtype or fp8.
            v_cache's last dim Dv may be below D (``cache.py``: MLA's ``k_cache[..., :Dv]``).
        cache_seqlens: (B,) int32.
        block_table: (B, max_pages_per_seq) int32 or None.
        softmax_scale: multiplier of q.k.
        plan: the call's ``plan_decode`` (the op passes the one it built); by default planned
            here with ``config``, ``num_programs`` and ``num_sms``.
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
        workspace: preallocated ``plan_workspace`` buffers; their contents are never read before
            they are written.
        launch: wraps the kernel before launch (``torch.library.wrap_triton`` under the op).

    Returns:
        out in q's shape with last dim Dv, q's dtype; lse float32 in q's shape without D, natural log.
    """
    if plan is not None and (config, num_programs, num_sms) != (None, None, None):
        raise ValueError(
            "config, num_programs, num_sms: expected None with a plan (plan_decode takes them), got values"
        )
    if plan is None:
        plan = plan_decode(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            block_table,
            cache_leftpad,
            k_scale=k_scale,
            v_scale=v_scale,
            softcap=softcap,
            window=window,
            sinks=sinks,
            softmax_scale=softmax_scale,
            batch_invariant=batch_invariant,
            config=config,
            num_programs=num_programs,
            num_sms=num_sms,
        )
    q4 = q if q.dim() == 4 else q[:, None]
    if q4.stride(-1) != 1:
        q4 = q4.contiguous()
    if out is None:
        out = q.new_empty(*q.shape[:-1], plan.layout.head_dim_v)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32) if lse is None else lse
    if not (out.is_contiguous() and lse.is_contiguous()):
        raise ValueError(f"out, lse: expected contiguous tensors, got strides {out.stride()} and {lse.stride()}")
    if workspace is None:
        workspace = plan_workspace(plan, q.device)
    else:
        check_workspace(workspace, plan)
    if counters is None:
        counters = torch.zeros(counters_size(plan.num_programs), device=q.device, dtype=torch.int32)
    elif counters.numel() < counters_size(plan.num_programs):
        raise ValueError(
            f"counters: expected at least {counters_size(plan.num_programs)} elements, got {counters.numel()}"
        )
    args = launch_args(
        plan,
        q4,
        k_cache,
        v_cache,
        cache_seqlens,
        cache_leftpad,
        block_table,
        out.view(*q4.shape[:-1], plan.layout.head_dim_v),
        lse.view(q4.shape[:-1]),
        workspace,
        counters,
        softmax_scale,
        k_scale,
        v_scale,
        softcap,
        sinks,
    )
    with device_guard(q.device):
        launch(decode_attention_fwd_kernel)[(plan.num_programs,)](**args, **plan.kernel.compile_options())
    return out, lse


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a launch runs in: ``device`` made current for CUDA tensors. Triton launches on
    the current device, which need not be q's (``device_map="auto"`` puts layers on several GPUs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
    cache_seqlens: torch.Tensor,
    head_units: int,
    tile_n: int,
    num_programs: int,
    max_segments: int | None = None,
    max_span: int = NO_SPAN_LIMIT,
    num_sms: int | None = None,
    capacity: int | None = None,
    max_contributors: int | None = None,
    lanes: int = 1,
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
        max_contributors: most programs that share one output (``DecodeConfig.max_contributors``);
            default ``MAX_CONTRIBUTORS``.
        lanes: the schedule's lanes (``KernelVariant.constexprs["LANES"]``: a KV head's row
            blocks, read in step), dividing head_units; 1 by default.

    Returns:
        One list of ``Segment`` per active program; inactive programs are omitted.
    """
    device = cache_seqlens.device
    if capacity is None:
        capacity = max(1, int(cache_seqlens.max())) if cache_seqlens.numel() else 1
    check_tile_count(cache_seqlens.shape[0], head_units, capacity, tile_n)
    if num_programs < lanes or head_units % lanes:
        raise ValueError(
            f"lanes: expected a divisor of head_units={head_units} and at most num_programs={num_programs}, got {lanes}"
        )
    cache_seqlens = valid_keys(cache_seqlens, None, capacity)[1]
    room = max_segments or 64
    while True:
        segs = torch.full((num_programs, room, SEGMENT_FIELDS.value), -1, dtype=torch.int32, device=device)
        nseg = torch.empty(num_programs, dtype=torch.int32, device=device)
        lean_schedule_kernel[(num_programs,)](
            cache_seqlens,
            segs,
            nseg,
            cache_seqlens.shape[0],
            head_units,
            num_programs,
            num_sms or num_programs,
            max_span,
            TILE_N=tile_n,
            MIN_TILES=MIN_TILES_PER_PROGRAM,
            MAX_CONTRIB=max_contributors or MAX_CONTRIBUTORS,
            FANIN=MERGE_FANIN,
            BLOCK_B=SCHEDULE_BLOCK_B,
            MAX_SEGS=room,
            LANES=lanes,
            enable_fp_fusion=FP_FUSION,
        )
        counts = nseg.tolist()
        if max(counts) <= room:
            break
        if max_segments is not None:
            raise ValueError(
                f"max_segments: expected at least {max(counts)} (the most any program has), got {max_segments}"
            )
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
    return {
        out: [[(p, slot) for _, p, slot in sorted(members)] for _, members in sorted(groups.items())]
        for out, groups in plan.items()
    }
