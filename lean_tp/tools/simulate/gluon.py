"""The Gluon MLA kernel (``lean_tp.ops.mla_gluon``) in modelled time, for the calls a tuning entry
routes there (``mla_gluon.gluon_takes``), with the cache in 64-row pages (the kernel's layout,
and FlashMLA's).

Its programs walk lean's stream-K schedule as ``program_ranges_kernel`` lays it out: 64-row head
units of one token, each a lane of a KV head's tiles, one program an SM, at most
MAX_CONTRIBUTORS programs an output. A program streams its tiles at a 64-key block an iteration
of ``GLUON_LOOP_US`` (measured) or at its bytes in flight, whichever is slower, with rows its lane
mates read at about the same time credited to the L2 (``l2.hbm_share``). Split outputs are merged
after the kernel by a second launch (``combine``): one program an output and column slice, each
loading its contributors' partials a chunk a step (``combine_form``), so the longest output's
chain of L2 round trips, or all partials through the L2, whichever is longer.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lean_tp.ops.decode_attention import KernelVariant, lean_schedule
from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.plan import DecodePlan
from lean_tp.ops.decode_attention.tuning import MAX_CONTRIBUTORS
from lean_tp.ops.mla_gluon.launcher import BLOCK_N, DV, ROWS, STAGES, combine_form, gluon_grid, gluon_takes
from lean_tp.tools.gpus import GPUModel, issue_us
from lean_tp.tools.simulate.l2 import hbm_share
from lean_tp.tools.simulate.problems import Problem
from lean_tp.tools.simulate.schedules import (
    Schedule,
    _shared_clock,
    _stream_rates,
    compute_roof,
    lean_reads,
    segment_bytes,
)

# Measured time of one 64-key iteration of a 64-row head unit, one program an SM: an H200 ran
# DeepSeek-V3's 128 heads (two units a token), bf16, 32k keys, in 668.6 us at B=32 and 2721 us at
# B=128 (docs/results/2026-11-27-nvidia-h200-5.json): 32 x 512 x 2 and 128 x 512 x 2 iterations
# over 132 SMs, 2.69 and 2.74 us each. The H100 shares the H200's SM and clocks (gpus.LOOP_US).
GLUON_LOOP_US = {"sm90": 2.7}
# An e4m3 pool's iteration adds its block's conversion to bf16 (``mla_gluon.tiles.convert_block``:
# all 8 warps, in series with the products): 288 integer and 72 bf16x2 instructions a thread
# (compiled for sm_90, triton 3.7.1), charged at their rates (``gpus.issue_us``).
# Modelled, unmeasured; it applies where an e4m3 entry routes here (none does: gluon_takes).
GLUON_E4M3_CONVERSION = (288, 72)
# K/V blocks in flight while one computes: the kernel's TMA buffers but the one it reads.
GLUON_BLOCKS_IN_FLIGHT = STAGES - 1


def gluon_loop_us(gpu: GPUModel, elem_size: int) -> float | None:
    """A 64-key iteration of the kernel on ``gpu`` (``GLUON_LOOP_US``), an e4m3 pool's (``elem_size``
    1) with its conversion's issue time (``GLUON_E4M3_CONVERSION``); None where unmeasured."""
    loop = GLUON_LOOP_US.get(gpu.arch)
    if loop is None or elem_size != 1:
        return loop
    integer, bf16x2 = GLUON_E4M3_CONVERSION
    return loop + issue_us(gpu, integer=integer, bf16x2=bf16x2)


def gluon_plan(problem: Problem, variant: KernelVariant) -> DecodePlan:
    """The plan of ``problem``'s call on a CUDA device of ``variant``'s arch, its cache in 64-row
    pages with V a view of K (what ``plan_decode`` gives there, but for the grid)."""
    d, dv, hkv = problem.head_dim, problem.head_dim_v or problem.head_dim, problem.n_kv_heads
    q_dtype, fp8 = problem.dtypes
    strides = (BLOCK_N * hkv * d, hkv * d, d)  # (page, row, head) of (pages, 64, Hkv, D)
    capacity = -(-problem.kv_len // BLOCK_N) * BLOCK_N
    layout = CacheLayout(True, hkv, d, BLOCK_N, capacity, fp8 or q_dtype, strides, strides, dv)
    kernel = dataclasses.replace(variant, page_size=BLOCK_N)
    return DecodePlan(
        len(problem.lens), problem.n_heads, d, q_dtype, torch.device("cuda"), layout, variant.features, None, kernel
    )


def routes_to_gluon(problem: Problem, variant: KernelVariant) -> bool:
    """Whether ``problem``'s call on paged MLA caches runs on the Gluon kernel (``gluon_takes``)."""
    return problem.latent and gluon_takes(gluon_plan(problem, variant))


def gluon_sim_schedule(problem: Problem, gpu: GPUModel) -> Schedule:
    """The Gluon kernel's schedule of ``problem`` on ``gpu``, its time and its merge's."""
    units = problem.num_tokens * problem.n_heads // ROWS  # one KV head: gluon_takes
    num_programs = gluon_grid(gpu.sms, units)
    lens, bpt = list(problem.lens), problem.bytes_per_token
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    programs = lean_schedule(seqlens, units, BLOCK_N, num_programs, max_contributors=MAX_CONTRIBUTORS, lanes=units)
    seg_bytes = segment_bytes(programs, lens, BLOCK_N, bpt)
    n_on_sm = [int(sm < len(programs)) for sm in range(gpu.sms)]
    block = BLOCK_N * bpt
    blocks, loop = (block, GLUON_BLOCKS_IN_FLIGHT * block), gluon_loop_us(gpu, problem.elem_size)
    roof = compute_roof(problem, gpu, ROWS)

    def clocks_at(from_hbm: float) -> list:
        rates = _stream_rates(n_on_sm, problem, gpu, 1, from_hbm, loop, blocks=blocks, roof=roof)
        return [_shared_clock([sum(seg_bytes[p])], rates[p] or 1.0) for p in range(len(programs))]

    clocks = clocks_at(1.0)
    from_hbm = hbm_share(lean_reads(problem, programs, seg_bytes, clocks, gpu.sms, BLOCK_N, units), gpu)
    if from_hbm < 1.0:
        clocks = clocks_at(from_hbm)
    kv_end = max((gpu.hbm_latency_us + clocks[p](sum(b)) for p, b in enumerate(seg_bytes)), default=0.0)
    bars, work = [], [0] * gpu.sms  # (sm, first token, tokens, output) as lean's, program p on SM p
    for p, segments in enumerate(programs):
        for s, nbytes in zip(segments, seg_bytes[p]):
            bars.append((p, work[p], nbytes // bpt, s.b * units + s.head_unit))
            work[p] += nbytes // bpt
    merge_us, chain, partial = _combine_us(programs, len(lens) * units, num_programs, gpu)
    return Schedule(
        "lean",
        gpu.sms,
        units=len(programs),
        splits=len(_split_outputs(programs)),
        sm_work=work,
        time_us=kv_end + merge_us,
        merge_us=merge_us,
        chain=chain,
        merge_bytes=chain * partial,
        bars=bars,
    )


def _combine_us(programs: list, outputs: int, num_programs: int, gpu: GPUModel) -> tuple[float, int, int]:
    """(time, longest chain in partials, a partial's bytes a merge program reads) of the merge
    launch: its gap, then the longest output's chain (the ranges and each chunk's lse and partial
    loads, an L2 round trip each, and its partials through the SM's L2 port) or every split
    output's partials through the L2, whichever is longer."""
    cols, chunk, _ = combine_form(num_programs, outputs)
    partial = ROWS * (cols + 1) * 4  # a contributor's column slice, fp32, and its lse
    counts = _split_outputs(programs).values()
    chain = max(counts, default=1)
    if chain == 1:
        return gpu.launch_gap_us + gpu.l2_latency_us, 1, partial
    trips = 1 + 2 * math.ceil(chain / chunk)
    serial = gpu.l2_latency_us * trips + chain * partial / (gpu.l2_port_gbps * 1e3)
    everything = sum(counts) * ROWS * (DV + 1) * 4 / (gpu.l2_read_tbps * 1e6)
    return gpu.launch_gap_us + max(serial, everything), chain, partial


def _split_outputs(programs: list) -> dict[tuple[int, int], int]:
    """Contributors of each split output, keyed (sequence, head unit)."""
    return {(s.b, s.head_unit): s.contributors for segments in programs for s in segments if s.contributors > 1}
