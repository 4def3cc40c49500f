"""Launcher of the Gluon MLA kernel: the checks, the schedule's ranges, the kernel, the merge."""

from __future__ import annotations

import math

import torch
import triton

from lean_tp.ops.decode_attention.cache import valid_keys
from lean_tp.ops.decode_attention.plan import NO_SPAN_LIMIT, DecodePlan, check_tile_count
from lean_tp.ops.decode_attention.schedule import RANGE_FIELDS, program_ranges_kernel
from lean_tp.ops.decode_attention.tuning import FP_FUSION, MAX_CONTRIBUTORS, MIN_TILES_PER_PROGRAM, SCHEDULE_BLOCK_B
from lean_tp.ops.mla_gluon.combine import mla_combine_kernel

# The kernel's shape (its bodies restate them as Gluon constexprs): query rows a head unit, latent
# and rope columns of a cache row; keys a tile (a page), K/V buffers.
ROWS, DV, DR = 64, 512, 64
BLOCK_N, STAGES = 64, 2
# A 16-bit pool's loop with each block's score issued behind the P.V before it, the row sums added
# once a segment, the row max exchanged between the warp groups with one barrier and q's rope
# columns held in registers (``loops.blocks_overlapped``): 4 CTA barriers a 64-key iteration
# against 9, the tensor cores given P.V and the next score back to back, 488 SASS against 495, 4544
# bytes of shared-memory reads a key against 4832, no local memory (compiled for sm_90). Not yet
# run on a GPU, so calls keep the loop the H200 measured until benchmarks/mla_decode_gluon.py's
# lines show it exact and faster.
OVERLAP = False
# The merge's form, (columns a program folds, partials it loads a step, warps), by whether an
# output has many contributors when lengths are even (programs / outputs: shapes only, no sync).
# Many (one sequence on every SM: 66 an output): 32 programs an output, each waiting on memory 5
# times rather than 66 (compiled for sm_90: 121 registers, no local memory, 16-byte loads); the H200
# took B=1 at 128 heads from 88 to 38.6 us at 4k and from 110 to 60.3 at 32k. Few (B=32 at 128
# heads: 2 or 3 an output): 4 programs of 4 warps an output (160 registers, no local memory), so
# that a batch's merge stays a few waves of programs (the many form, as 32 programs of 8 warps for
# every one of the 132 main-kernel programs, cost the H200 80 us more at B=32, 4k).
COMBINE_MANY = 8
COMBINE_FORMS = {True: (16, 16, 8), False: (128, 1, 4)}
MAX_TQ = 16  # query tokens a sequence, as lean_tp.decode_attention takes them
# The latent caches the kernel reads: 16-bit, or e4m3 bytes it converts to bf16 a block at a time.
POOL_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def gluon_takes(plan: DecodePlan) -> bool:
    """Whether ``lean_tp.decode_attention`` runs a planned call on this kernel: its tuning entry
    (16-bit or e4m3: the entries are the cache's) routes calls of ``DecodeConfig.gluon_rows``
    query rows or more here (Tq x heads of the one KV head), and the kernel takes the call as
    ``check_gluon_inputs`` would: an sm_90 CUDA device, a bf16 q and a bf16 or e4m3 latent cache
    in contiguous 64-row pages with V its rows' first 512 columns, heads a multiple of 64,
    Tq <= 16, and no e5m2, softcap, window, sinks, left padding or batch-invariant mode. Shapes,
    dtypes and the device only: never a tensor's values."""
    kernel, layout, f = plan.kernel, plan.layout, plan.features
    rows = kernel and kernel.config.gluon_rows
    if not rows or plan.device.type != "cuda" or kernel.arch != "sm90" or f.num_tokens * plan.group < rows:
        return False
    pool_strides = (BLOCK_N * (DV + DR), DV + DR)  # (pages, 64, 1, 576) as (pages, 64, 576)
    takes_cache = layout.paged and layout.page_size == BLOCK_N and layout.k_strides[:2] == pool_strides
    takes_cache = takes_cache and (f.fp8 or plan.dtype) in POOL_DTYPES
    takes_dims = plan.head_dim == DV + DR and layout.head_dim_v == DV and f.v_in_k
    takes_heads = layout.num_kv_heads == 1 and plan.group % ROWS == 0 and f.num_tokens <= MAX_TQ
    plain = not (f.softcap or f.window or f.sinks or f.leftpad or f.batch_invariant)
    return plan.dtype == torch.bfloat16 and takes_cache and takes_dims and takes_heads and plain


def check_gluon_inputs(
    q: torch.Tensor,
    pool: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    overlap: bool = False,
):
    """``ValueError``/``TypeError`` naming the argument for anything the kernel does not take (the
    device last)."""
    if not isinstance(overlap, bool):  # a constexpr of the kernel: any other value compiles anew
        raise TypeError(f"overlap: expected a bool, got {type(overlap).__name__}")
    if q.dtype != torch.bfloat16 or pool.dtype not in POOL_DTYPES:
        raise TypeError(f"q, pool: expected bfloat16 and one of {POOL_DTYPES}, got {q.dtype} and {pool.dtype}")
    fp8 = pool.dtype == torch.float8_e4m3fn
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        takes = isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.shape == (1,)
        if fp8 and not (takes and scale.device == q.device):
            got = f"{scale.dtype} {tuple(scale.shape)} on {scale.device}" if isinstance(scale, torch.Tensor) else scale
            raise ValueError(f"{name}: expected a (1,) float32 tensor on {q.device} with an fp8 pool, got {got}")
        if not fp8 and scale is not None:
            raise ValueError(f"{name}: expected None with a {pool.dtype} pool (scales are for fp8), got a scale")
    tq = q.shape[1] if q.dim() == 4 else 1
    if q.dim() not in (3, 4) or q.shape[-2] % ROWS or q.shape[-1] != DV + DR or not q.is_contiguous() or tq > MAX_TQ:
        raise ValueError(
            f"q: expected a contiguous (B, H, {DV + DR}) or (B, Tq, H, {DV + DR}) with H a multiple of {ROWS} and "
            f"Tq <= {MAX_TQ}, got {tuple(q.shape)}"
        )
    if pool.dim() != 3 or pool.shape[1:] != (BLOCK_N, DV + DR) or not pool.is_contiguous():
        raise ValueError(f"pool: expected a contiguous (pages, {BLOCK_N}, {DV + DR}), got {tuple(pool.shape)}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (q.shape[0],):
        raise ValueError(
            f"cache_seqlens: expected int32 ({q.shape[0]},), got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    if cache_seqlens.stride(0) != 1:
        raise ValueError(f"cache_seqlens: expected contiguous, got stride {cache_seqlens.stride()}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(
            f"block_table: expected int32 ({q.shape[0]}, pages), got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if block_table.stride(1) != 1:  # the kernel reads a sequence's page ids as one run
        raise ValueError(
            f"block_table: expected rows contiguous (stride 1 in dim 1), got strides {block_table.stride()}"
        )
    on_sm90 = q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] == 9
    if not on_sm90:
        raise ValueError(f"q: expected a tensor on an sm_90 CUDA device (TMA and wgmma), got one on {q.device}")


def program_ranges(cache_seqlens: torch.Tensor, head_units: int, num_programs: int) -> torch.Tensor:
    """(num_programs, RANGE_FIELDS) int32: each program's place in lean's schedule of 64-key tiles
    over ``head_units`` 64-row blocks a sequence (all its Tq tokens'), read in step (one lane a row
    block)."""
    ranges = torch.empty(num_programs, RANGE_FIELDS.value, dtype=torch.int32, device=cache_seqlens.device)
    program_ranges_kernel[(num_programs,)](
        cache_seqlens, ranges, cache_seqlens.shape[0], head_units, num_programs, num_programs, NO_SPAN_LIMIT,
        TILE_N=BLOCK_N, MIN_TILES=MIN_TILES_PER_PROGRAM, MAX_CONTRIB=MAX_CONTRIBUTORS, BLOCK_B=SCHEDULE_BLOCK_B,
        LANES=head_units, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return ranges


def combine(
    ranges: torch.Tensor,
    cache_seqlens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    head_units: int,
) -> None:
    """``mla_combine_kernel`` into out (B x head_units x 64, 512) and lse (B x head_units x 64,)
    from the main kernel's part_out (programs, 2, 64, 512) and part_lse (programs, 2, 64);
    head_units counts all of a sequence's Tq tokens."""
    num_programs, outputs = ranges.shape[0], out.shape[0] // ROWS
    cols, chunk, warps = combine_form(num_programs, outputs)
    mla_combine_kernel[(outputs, DV // cols)](
        ranges, cache_seqlens, part_out, part_lse, out, lse, num_programs,
        HU=head_units, ROWS=ROWS, DV=DV, COLS=cols, CHUNK=chunk, BLOCK_P=triton.next_power_of_2(num_programs),
        num_warps=warps, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip


def combine_form(num_programs: int, outputs: int) -> tuple[int, int, int]:
    """The merge's (columns a program folds, partials it loads a step, warps) for a launch of
    ``num_programs`` programs over ``outputs`` row blocks (``COMBINE_FORMS``)."""
    return COMBINE_FORMS[num_programs >= COMBINE_MANY * outputs]


def gluon_grid(sms: int, head_units: int) -> int:
    """Programs of a launch on ``sms`` SMs: one 225 KB program an SM, as many in every lane (each
    head unit's tiles are a lane's)."""
    return max(sms // head_units, 1) * head_units


def mla_gluon_schedule(
    cache_seqlens: torch.Tensor, block_table: torch.Tensor, heads: int, tq: int = 1, num_programs: int | None = None
) -> torch.Tensor:
    """(programs, RANGE_FIELDS) int32 on cache_seqlens' device: where each program of
    ``mla_decode_gluon`` starts in lean's schedule, for one step's lengths and ``heads`` query heads
    (a multiple of 64) of ``tq`` tokens a sequence. Computed once a step, every layer's call takes
    it (``schedule=``), as FlashMLA's metadata is; one launch, no sync. ``num_programs``: the grid
    (default the SM count: one 225 KB program an SM), rounded to whole lanes."""
    if heads < 1 or heads % ROWS or not 1 <= tq <= MAX_TQ:
        raise ValueError(f"heads, tq: expected heads a multiple of {ROWS} and 1 <= tq <= {MAX_TQ}, got {heads}, {tq}")
    seqlens = valid_keys(cache_seqlens, None, block_table.shape[1] * BLOCK_N)[1]
    return _schedule(seqlens, block_table, tq * heads // ROWS, num_programs)


def _schedule(seqlens: torch.Tensor, block_table: torch.Tensor, head_units: int, num_programs: int | None):
    """``mla_gluon_schedule`` of lengths already clamped to the block table's capacity."""
    num_programs = gluon_grid(
        num_programs or torch.cuda.get_device_properties(seqlens.device).multi_processor_count, head_units
    )
    check_tile_count(seqlens.shape[0], head_units, block_table.shape[1] * BLOCK_N, BLOCK_N)
    return program_ranges(seqlens, head_units, num_programs)


def mla_decode_gluon(
    q: torch.Tensor,
    pool: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    num_programs: int | None = None,
    softmax_scale: float | None = None,
    schedule: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    overlap: bool = OVERLAP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode on sm_90: out (q's shape, last dim 512) bf16 and lse (q's shape without its last
    dim) fp32 (natural log; 0 and -inf for a query that sees no key).

    Args:
        q: (B, H, 576) or (B, Tq, H, 576) bf16, H a multiple of 64, Tq <= 16: query token t of
            sequence b sees keys [0, cache_seqlens[b] - Tq + t].
        pool: (pages, 64, 576) bf16 or float8_e4m3fn, the latent cache's pages; V is each row's
            first 512 columns.
        cache_seqlens: (B,) int32, clamped to the block table's capacity as lean's launch clamps it.
        block_table: (B, max pages) int32.
        num_programs: the grid when ``schedule`` is None (``mla_gluon_schedule``'s).
        softmax_scale: default 576 ** -0.5.
        schedule: ``mla_gluon_schedule(cache_seqlens, block_table, H, Tq)``, computed once a step
            for these lengths; computed here when None.
        k_scale, v_scale: (1,) float32 on q's device, an fp8 pool's only (required there): a row's
            value is its bytes times k_scale in the score and v_scale in the output.
        overlap: a 16-bit pool's blocks through the overlapped loop (``OVERLAP``); an e4m3 pool's
            blocks keep the serial one.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from lean_tp.ops.mla_gluon.kernel import mla_decode_gluon_kernel
    from lean_tp.ops.mla_gluon.tiles import smem_layout

    check_gluon_inputs(q, pool, cache_seqlens, block_table, k_scale, v_scale, overlap)
    fp8 = pool.dtype == torch.float8_e4m3fn
    batch, heads, tq = q.shape[0], q.shape[-2], (q.shape[1] if q.dim() == 4 else 1)
    head_units = tq * heads // ROWS
    seqlens = valid_keys(cache_seqlens, None, block_table.shape[1] * BLOCK_N)[1]
    if schedule is None:
        schedule = _schedule(seqlens, block_table, head_units, num_programs)
    check_schedule(schedule, head_units, q.device)
    num_programs = schedule.shape[0]
    out = torch.empty(batch * tq * heads, DV, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(batch * tq * heads, dtype=torch.float32, device=q.device)
    part_out = torch.empty(num_programs, 2, ROWS, DV, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_programs, 2, ROWS, dtype=torch.float32, device=q.device)

    def desc(t: torch.Tensor, shape: list[int]) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t, shape, smem_layout(shape, t.dtype))

    q2, pool2 = q.view(-1, DV + DR), pool.view(-1, DV + DR)  # rows (b, token, head)
    scale = softmax_scale if softmax_scale is not None else (DV + DR) ** -0.5
    mla_decode_gluon_kernel[(num_programs,)](
        desc(q2, [ROWS, DV]), desc(q2, [ROWS, DR]), desc(pool2, [BLOCK_N, DV]), desc(pool2, [BLOCK_N, DR]),
        out, lse, part_out, part_lse, k_scale if fp8 else lse, v_scale if fp8 else lse, schedule, seqlens,
        block_table, block_table.stride(0), batch, scale * math.log2(math.e), 0, head_units, head_units, tq,
        BLOCK_N, STAGES, fp8, overlap and not fp8, num_warps=8, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    combine(schedule, seqlens, part_out, part_lse, out, lse, head_units)
    return out.view(*q.shape[:-1], DV), lse.view(q.shape[:-1])


def check_schedule(schedule: torch.Tensor, head_units: int, device: torch.device) -> None:
    """``ValueError`` unless ``schedule`` is a schedule's shape for ``head_units`` 64-row units."""
    fields = RANGE_FIELDS.value
    ok = schedule.dtype == torch.int32 and schedule.dim() == 2 and schedule.shape[1] == fields
    if not ok or schedule.shape[0] % head_units or schedule.device != device:
        raise ValueError(
            f"schedule: expected mla_gluon_schedule's int32 (programs, {fields}) on {device} with programs a "
            f"multiple of {head_units}, got {schedule.dtype} {tuple(schedule.shape)} on {schedule.device}"
        )


def compile_sm90(head_units: int = 2, tq: int = 1, fp8: bool = False, overlap: bool = False):
    """The kernel compiled for sm_90 on any machine, its descriptors' types as a launch has them
    (``fp8``: an e4m3 pool's; ``overlap``: the 16-bit loop that issues a block's score behind the
    P.V before it)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from lean_tp.ops.mla_gluon.kernel import mla_decode_gluon_kernel
    from lean_tp.ops.mla_gluon.tiles import GL_DTYPES, smem_layout

    def desc(shape: list[int], dtype: torch.dtype = torch.bfloat16) -> str:
        return f"tensordesc<{GL_DTYPES[dtype]}[{shape[0]},{shape[1]}],{smem_layout(shape, dtype)!r}>"

    kv = torch.float8_e4m3fn if fp8 else torch.bfloat16
    pointers = dict(out_ptr="*bf16", lse_ptr="*fp32", part_out_ptr="*fp32", part_lse_ptr="*fp32")
    pointers.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    pointers.update(range_ptr="*i32", seqlens_ptr="*i32", block_table_ptr="*i32")
    signature = {
        "qn_desc": desc([ROWS, DV]), "qr_desc": desc([ROWS, DR]), "kn_desc": desc([BLOCK_N, DV], kv),
        "kr_desc": desc([BLOCK_N, DR], kv), **pointers, "table_stride": "i32", "B": "i32", "scale_log2": "fp32",
        "zero": "i32", "HU": "constexpr", "LANES": "constexpr", "TQ": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr",
        "FP8": "constexpr", "OVERLAP": "constexpr",
    }  # fmt: skip
    constexprs = {"HU": head_units, "LANES": head_units, "TQ": tq, "BLOCK_N": BLOCK_N, "STAGES": STAGES, "FP8": fp8}
    constexprs["OVERLAP"] = overlap
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4, 13)}
    source = GluonASTSource(mla_decode_gluon_kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": 8, "enable_fp_fusion": FP_FUSION}  # as launched
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
