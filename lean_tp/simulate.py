"""Decode simulator: LeanAttention's schedule and merge tree against fixed-split kernels and their
combine kernels, in modelled time on an A100 or an H100.

    python -m lean_tp.simulate --gpu A100 H100 --batch 4 --heads 32 --kv-heads 8 --lens 65536
    python -m lean_tp.simulate --model llama-3-70b --tp 8 --batch 1 --lens 32768    # one rank of TP=8
    python -m lean_tp.simulate --tp-sweep --json sweep.json                         # every preset, B 1-64, 1k-1M
    python -m lean_tp.simulate --cp-sweep --gpu H100                                # TP alone vs TP x CP, 8 and 16 GPUs
    python -m lean_tp.simulate --heads 32 --kv-heads 32 --lens 30000,2000,500,8000 --plot gantt.png

- **lean**: the kernel's own schedule and merge tree (``lean_schedule``/``merge_plan`` run the
  kernel's schedule code), a grid of ``SMs x programs per SM``, program p on SM ``p mod SMs``.
- **fa2**: FlashAttention-2's ``num_splits_heuristic``, the FlashDecoding rule, with its splits sized
  from the cache capacity; CTAs go, in launch order, to the least-loaded SM (ideal dynamic
  dispatch), and a split output costs a combine kernel.
- **flex**: FlexAttention's decode rule, ``max(SMs // (B * Hkv) * 2, 1)`` splits of the capacity,
  then its reduction kernel.

Time model (``GPUS`` holds every constant with its source): an SM streams K/V at
``min(L2 port, bytes in flight / HBM latency)``, all SMs together at most the measured copy
bandwidth; a merge costs L2 round trips (one per atomic, one per wave of partial loads) plus its
partial bytes over the merging SM's L2 port; a second kernel costs a launch gap. Every method
gets the same memory model, so the comparison isolates schedules and merges.

On CPU the schedule code runs in the Triton interpreter; this module re-executes itself with
``TRITON_INTERPRET=1`` when needed.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch

from lean_tp import cli
from lean_tp.ops.decode_attention.launcher import kernel_constexprs, lean_schedule, merge_plan
from lean_tp.ops.decode_attention.schedule import lean_schedule_kernel
from lean_tp.ops.decode_attention.tuning import INVARIANT_GROUP_CHUNKS, config_for
from lean_tp.ops.utils import interpreted, map_in_processes

METHODS = ("lean", "fa2", "flex")
ELEM_DTYPES = {2: torch.float16, 4: torch.float32}


@dataclass(frozen=True)
class GPUModel:
    """The constants of the time model for one GPU (sources in ``MODEL_SOURCES``)."""

    name: str
    sms: int
    arch: str  # tuning-table key
    clock_ghz: float  # SM clock under load
    hbm_tbps: float  # device-to-device copy bandwidth, TB/s (bytes read + written)
    hbm_latency_us: float  # loaded HBM latency, what Little's law needs in flight
    l2_latency_cycles: int  # L2 hit and atomic round trip
    l2_bytes_per_clk_per_sm: int  # what one SM can pull from L2
    launch_gap_us: float  # a dependent second kernel's start after the first ends (CUDA graph)
    combine_ctas_per_sm: int = 4  # resident CTAs of a combine kernel

    @property
    def l2_latency_us(self) -> float:
        return self.l2_latency_cycles / (self.clock_ghz * 1e3)

    @property
    def l2_port_gbps(self) -> float:
        return self.l2_bytes_per_clk_per_sm * self.clock_ghz


GPUS = {
    "A100": GPUModel("A100", 108, "sm80", 1.41, 1.5, 0.6, 200, 47, 1.0),
    "H100": GPUModel("H100", 132, "sm90", 1.755, 3.0, 0.7, 260, 64, 1.0),
}
MODEL_SOURCES = {
    "sms": "NVIDIA A100 and H100 (SXM) whitepapers: 108 and 132 SMs",
    "clock_ghz": "Chips and Cheese, 'Nvidia's H100: Funny L2, and Tons of Bandwidth' (2023): 1755 MHz H100 boost, "
                 "A100 held at 1410 MHz under load",
    "hbm_tbps": "H100: ~3.0 TB/s device-to-device copy measured on this project's H100 machine (BRIEF.md); "
                "A100: ~1.5 TB/s as measured on A100-SXM4 parts (peak 1.55-2.0 TB/s)",
    "hbm_latency_us": "loaded latency for Little's law, 0.6-0.8 us on H100 (BRIEF.md); A100 assumed 0.6 us",
    "l2_latency_cycles": "L2 hit ~260 cycles on H100 (BRIEF.md, Chips and Cheese 2023); ~200 cycles on A100 "
                         "(Chips and Cheese 2023, Jia et al., 'Dissecting the Ampere GPU architecture', GTC 2021)",
    "l2_bytes_per_clk_per_sm": "A100 whitepaper: 5120 B/clk L2 read bandwidth over 108 SMs = 47; H100 assumed 64 "
                               "(unmeasured)",
    "launch_gap_us": "assumed 1 us between dependent kernels inside a CUDA graph (unmeasured here)",
}  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """One decode step: ``lens`` (B,) tokens per sequence, head counts, head_dim, cache capacity."""

    lens: tuple[int, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int = 128
    capacity: int = 0  # 0 means max(lens): fixed-split kernels size their splits from this
    elem_size: int = 2

    def __post_init__(self) -> None:
        if not self.lens or min(self.lens) < 0:
            raise ValueError(f"lens: expected one or more lengths >= 0, got {self.lens}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads: expected a multiple of n_kv_heads={self.n_kv_heads}, got {self.n_heads}")
        if self.capacity and self.capacity < max(self.lens):
            raise ValueError(f"capacity: expected >= max(lens)={max(self.lens)}, got {self.capacity}")
        config_for("sm90", self.head_dim, ELEM_DTYPES[self.elem_size])  # ValueError for a head_dim with no kernel

    @property
    def kv_len(self) -> int:
        return self.capacity or max(self.lens)

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token of one KV head."""
        return 2 * self.head_dim * self.elem_size

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a ragged-aware kernel must read."""
        return self.n_kv_heads * sum(self.lens) * self.bytes_per_token

    def describe(self) -> str:
        lens = f"len {self.lens[0]}" if len(set(self.lens)) == 1 else f"lens {min(self.lens)}-{max(self.lens)} (mean {sum(self.lens) // len(self.lens)})"
        return f"B={len(self.lens)} Hq={self.n_heads} Hkv={self.n_kv_heads} D={self.head_dim} {lens}"


# Flag bounds: beyond every model's context and head count, and small enough that the schedule's
# int32 tile counts and the event simulation stay within reach.
MAX_LEN, MAX_BATCH, MAX_HEADS = 1 << 24, 4096, 1024

# Full (unsharded) attention head counts of the tensor-parallel presets: (Hq, Hkv, D).
MODEL_PRESETS = {
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b": (64, 8, 128),
    "qwen2.5-72b": (64, 8, 128),
    "mixtral-8x7b": (32, 8, 128),
}


def rank_heads(n_heads: int, n_kv_heads: int, tp: int) -> tuple[int, int]:
    """(Hq, Hkv) of one rank of a ``tp``-way head split; KV heads are replicated when the ranks
    outnumber them (as ``lean_tp.distributed`` does)."""
    if tp < 1 or n_heads % tp:
        raise ValueError(f"--tp: expected a divisor of the {n_heads} query heads, got {tp}")
    return n_heads // tp, max(1, n_kv_heads // tp)


@dataclass
class Schedule:
    """One method's plan for one problem, with its modelled time."""

    method: str
    sms: int
    units: int  # programs (lean) or CTAs (fixed split) that do work
    splits: int  # lean: outputs split across programs; fixed split: splits per output
    sm_work: list[int]  # K/V tokens per SM
    time_us: float = 0.0  # modelled kernel time (+ the combine kernel for fixed splits)
    merge_us: float = 0.0  # what merging adds: lean's tree past its last K/V byte, or the combine kernel
    chain: int = 0  # lean: the longest serial merge chain, in partials (a final merger reads its group's and the groups')
    merge_bytes: int = 0  # lean: the most partial bytes one program reads in merges
    bars: list[tuple[int, int, int, int]] = field(default_factory=list)  # (sm, start, tokens, output)

    @property
    def makespan(self) -> int:
        return max(self.sm_work)

    @property
    def busy_sms(self) -> int:
        """SMs that stream any K/V."""
        return sum(1 for w in self.sm_work if w)

    @property
    def efficiency(self) -> float:
        """Load balance over the SMs that stream K/V: their mean work over the busiest one's (1.0:
        all finish together). SMs a method leaves idle on purpose (lean's grid shrinks for short
        contexts, since SMs streaming together share the bandwidth) do not count against it; the
        modelled time is what compares methods."""
        return sum(self.sm_work) / (self.busy_sms * self.makespan) if self.busy_sms else 1.0


def fa2_num_splits(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's ``num_splits_heuristic``: the fewest splits whose wave efficiency is within
    85% of the best, or 1 when the (batch, head, m-block) CTAs already nearly fill the GPU."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eligible = [s == 1 or math.ceil(num_n_blocks / s) != math.ceil(num_n_blocks / (s - 1)) for s in range(1, max_splits + 1)]
    efficiency = []
    for s in range(1, max_splits + 1):
        waves = batch_nheads_mblocks * s / num_sms
        efficiency.append(waves / math.ceil(waves) if eligible[s - 1] else 0.0)
    best = max(efficiency, default=0.0)
    return next((s for s in range(1, max_splits + 1) if eligible[s - 1] and efficiency[s - 1] >= 0.85 * best), 1)


def fa2_splits(problem: Problem, sms: int) -> tuple[int, int]:
    """(splits, key block) FlashAttention-2 picks for ``flash_attn_with_kvcache`` on ``sms`` SMs.

    Decode with GQA packs each group's queries as the rows of one KV head (``seqlenq_ngroups_swapped``),
    so its CTAs are (batch, KV head, 64-row block); the heuristic is given twice the SM count."""
    block_n = 256 if problem.head_dim <= 64 else (128 if problem.head_dim <= 128 else 64)
    m_blocks = math.ceil(problem.n_heads // problem.n_kv_heads / 64)
    ctas = len(problem.lens) * problem.n_kv_heads * m_blocks
    return fa2_num_splits(ctas, sms * 2, math.ceil(problem.kv_len / block_n)), block_n


def flex_splits(problem: Problem, sms: int) -> int:
    """FlexAttention decode's split count: two per SM over the (batch, KV head) pairs."""
    return max(sms // max(len(problem.lens) * problem.n_kv_heads, 1) * 2, 1)


def lean_config(problem: Problem, gpu: GPUModel):
    return config_for(gpu.arch, problem.head_dim, ELEM_DTYPES[problem.elem_size])


def _stream_rates(n_on_sm: list[int], problem: Problem, gpu: GPUModel, programs_per_sm: int) -> list[float]:
    """Bytes per microsecond each SM streams K/V at with n_on_sm[sm] programs (or CTAs) resident at
    most ``programs_per_sm``: Little's law per SM, capped by its L2 port, all SMs sharing the
    copy bandwidth in proportion. Every method gets this model."""
    config = lean_config(problem, gpu)
    in_flight = max(1, config.num_stages - 1) * config.block_n * problem.bytes_per_token
    want = [min(gpu.l2_port_gbps * 1e3, min(n, programs_per_sm) * in_flight / gpu.hbm_latency_us) for n in n_on_sm]
    share = min(1.0, gpu.hbm_tbps * 1e6 / max(sum(want), 1e-9))
    return [w * share for w in want]


def _shared_clock(works: list[float], rate: float):
    """Time at which programs sharing one SM's ``rate`` (processor sharing: the unfinished ones split
    it evenly, so one that finishes early hands its share to the rest) have each done ``x`` bytes;
    the SM finishes at sum(works) / rate."""
    levels = sorted(works)

    def clock(x: float) -> float:
        t, done, left = 0.0, 0.0, len(levels)
        for level in levels:
            step = min(x, level) - done
            if step > 0:
                t += step * left / rate
                done += step
            if x <= level:
                break
            left -= 1
        return t

    return clock


def _merge_level_us(members: int, wave: int, partial_bytes: int, gpu: GPUModel) -> float:
    """One level of the tree: the arrival atomic, one L2 round trip per wave of partial loads, and
    the partials through the merger's L2 port."""
    return gpu.l2_latency_us * (1 + math.ceil(members / wave)) + members * partial_bytes / (gpu.l2_port_gbps * 1e3)


def lean_sim_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None,
                      batch_invariant: bool = False) -> Schedule:  # fmt: skip
    """The kernel's stream-K schedule and merge tree on ``gpu``, in modelled time (with
    ``batch_invariant``, the same schedule and the invariant mode's merges: ``_invariant_merges``)."""
    config = lean_config(problem, gpu)
    per_sm = programs_per_sm or config.max_programs_per_sm
    dtype = ELEM_DTYPES[problem.elem_size]
    cx = kernel_constexprs(config, problem.head_dim, problem.n_heads // problem.n_kv_heads, dtype, None)
    head_units, tile = problem.n_kv_heads * cx["NUM_GC"], config.tile_n
    device = "cuda" if torch.cuda.is_available() else "cpu"
    programs = lean_schedule(torch.tensor(problem.lens, dtype=torch.int32, device=device), head_units, tile,
                             gpu.sms * per_sm, num_sms=gpu.sms)  # fmt: skip
    sms = gpu.sms
    n_on_sm = [len(range(sm, len(programs), sms)) for sm in range(sms)]
    rates = _stream_rates(n_on_sm, problem, gpu, per_sm)
    bytes_per_token = problem.bytes_per_token
    work, clock, bars, seg_end = [0] * sms, [0] * sms, [], {}
    seg_bytes = [[(min(problem.lens[s.b], (s.first_tile + s.n_tiles) * tile) - s.first_tile * tile) * bytes_per_token
                  for s in segments] for segments in programs]  # fmt: skip
    clocks = [_shared_clock([sum(seg_bytes[p]) for p in range(sm, len(programs), sms)], rates[sm] or 1.0)
              for sm in range(sms)]  # fmt: skip
    for p, segments in enumerate(programs):
        sm, done = p % sms, 0
        for s, nbytes in zip(segments, seg_bytes[p]):
            tokens = nbytes // bytes_per_token
            bars.append((sm, clock[sm], tokens, s.b * problem.n_kv_heads + s.head_unit // cx["NUM_GC"]))
            clock[sm] += tokens
            work[sm] += tokens
            done += nbytes
            seg_end[(p, s.slot)] = gpu.hbm_latency_us + clocks[sm](done)
    kv_end = max(seg_end.values(), default=0.0)
    # A partial's real rows (masked padding rows move no bytes): fp32 acc, m and l.
    partial = min(problem.n_heads // problem.n_kv_heads, cx["BLOCK_G"]) * (cx["BLOCK_D"] + 2) * 4
    plan = merge_plan(programs)
    if batch_invariant:
        end, chain = _invariant_merges(programs, seg_end, kv_end, partial, gpu)
    else:
        end, chain = _tree_merges(plan, seg_end, kv_end, partial, cx["WAVE"], gpu)
    return Schedule("lean", sms, units=len(programs), splits=len(plan), sm_work=work, time_us=end, merge_us=end - kv_end,
                    chain=chain, merge_bytes=chain * partial, bars=bars)  # fmt: skip


def _tree_merges(plan: dict, seg_end: dict, kv_end: float, partial: int, wave: int, gpu: GPUModel) -> tuple[float, int]:
    """(end, longest chain of partials) of the default mode's merge tree (``merge_plan``): each
    group once its members' segments end, then the output's second level."""
    end, chain = kv_end, 0
    for groups in plan.values():
        done = [max(seg_end[m] for m in g) + _merge_level_us(len(g), wave, partial, gpu) for g in groups]
        finish = max(done)
        if len(groups) > 1:
            finish += gpu.l2_latency_us + _merge_level_us(len(groups), wave, partial, gpu)
        end = max(end, finish)
        chain = max(chain, max(map(len, groups)) + (len(groups) if len(groups) > 1 else 0))
    return end, chain


def _invariant_merges(programs, seg_end: dict, kv_end: float, partial: int, gpu: GPUModel) -> tuple[float, int]:
    """(end, longest chain of partials) of the batch-invariant mode's merges (``invariant.py``). For
    each split output, each group of ``INVARIANT_GROUP_CHUNKS`` chunks is ready when its holders'
    segments end; a group with several holders is then merged from its first holder's fold and
    each later chunk's partial, and the output from its groups' values, both as sequential folds:
    one L2 round trip per partial (the loads are not assumed to overlap) plus the arrival atomic."""
    holders: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for p, segments in enumerate(programs):
        for s in segments:
            if s.contributors > 1:
                holders.setdefault((s.b, s.head_unit), []).append((s.first_tile, s.n_tiles, seg_end[(p, s.slot)]))
    end, chain = kv_end, 0
    for pieces in holders.values():
        n = max(first + n_tiles for first, n_tiles, _ in pieces)
        groups = []
        for g0 in range(0, n, INVARIANT_GROUP_CHUNKS):
            g1 = min(g0 + INVARIANT_GROUP_CHUNKS, n)
            own = sorted(x for x in pieces if x[0] < g1 and x[0] + x[1] > g0)
            ready = max(t for _, _, t in own)
            loads = 1 + (g1 - (own[0][0] + own[0][1])) if len(own) > 1 else 0
            if loads:
                ready += _merge_level_us(loads, 1, partial, gpu)
            groups.append((ready, loads))
        end = max(end, max(r for r, _ in groups) + _merge_level_us(len(groups), 1, partial, gpu))
        chain = max(chain, max(c for _, c in groups) + len(groups))
    return end, chain


def fixed_split_schedule(method: str, problem: Problem, gpu: GPUModel, splits: int, block_n: int,
                         programs_per_sm: int | None = None) -> Schedule:  # fmt: skip
    """CTAs (b, KV head, split) over equal ranges of the capacity, each reading only its sequence's
    tokens in that range, dispatched in launch order to the least-loaded SM; with splits > 1 a
    combine kernel follows (a launch gap, two dependent L2 reads, the partials over every SM's port)."""
    sms = gpu.sms
    per_split = math.ceil(math.ceil(problem.kv_len / block_n) / splits) * block_n
    load = [(0, sm) for sm in range(sms)]
    work, bars, ctas = [0] * sms, [], [0] * sms
    for b, length in enumerate(problem.lens):
        for h in range(problem.n_kv_heads):
            for s in range(splits):
                tokens = max(0, min(length, (s + 1) * per_split) - s * per_split)
                if tokens == 0:
                    continue  # an empty split exits at once
                start, sm = heapq.heappop(load)
                heapq.heappush(load, (start + tokens, sm))
                work[sm] += tokens
                ctas[sm] += 1
                bars.append((sm, start, tokens, b * problem.n_kv_heads + h))
    per_sm = programs_per_sm or lean_config(problem, gpu).max_programs_per_sm
    rates = _stream_rates(ctas, problem, gpu, per_sm)
    bytes_per_token = problem.bytes_per_token
    kernel = max((gpu.hbm_latency_us + w * bytes_per_token / r for w, r in zip(work, rates) if w), default=0.0)
    combine = 0.0
    if splits > 1 and any(work):  # no CTA wrote a partial: nothing to combine
        partials = len(problem.lens) * problem.n_heads * splits * (problem.head_dim + 1) * 4
        combine = gpu.launch_gap_us + 2 * gpu.l2_latency_us + partials / (sms * gpu.l2_port_gbps * 1e3)
    return Schedule(method, sms, units=sum(ctas), splits=splits, sm_work=work, time_us=kernel + combine,
                    merge_us=combine, bars=bars)  # fmt: skip


def simulate(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> dict[str, Schedule]:
    """Lean (default and batch-invariant), FA2 and Flex plans of one problem on ``gpu``."""
    fa2, block_n = fa2_splits(problem, gpu.sms)
    return {
        "lean": lean_sim_schedule(problem, gpu, programs_per_sm),
        "lean_invariant": lean_sim_schedule(problem, gpu, programs_per_sm, batch_invariant=True),
        "fa2": fixed_split_schedule("fa2", problem, gpu, fa2, block_n, programs_per_sm),
        "flex": fixed_split_schedule("flex", problem, gpu, flex_splits(problem, gpu.sms), 64, programs_per_sm),
    }


def row_of(problem: Problem, gpu: GPUModel, result: dict[str, Schedule]) -> dict:
    """One table row: every method's modelled time and merge, lean's chain and bandwidth share."""
    lean = result["lean"]
    row = {"gpu": gpu.name, "problem": problem.describe(), "kv_mb": problem.kv_bytes / 1e6,
           "lean_programs": lean.units, "lean_chain": lean.chain, "lean_merge_kb": lean.merge_bytes / 1024,
           "lean_bw": problem.kv_bytes / (lean.time_us * 1e6 * gpu.hbm_tbps) if lean.time_us else 0.0}  # fmt: skip
    for method, sched in result.items():
        row |= {f"{method}_us": sched.time_us, f"{method}_merge_us": sched.merge_us,
                f"{method}_eff": sched.efficiency, f"{method}_splits": sched.splits}  # fmt: skip
        if method != "lean":
            # None where lean has nothing to do (every length 0): no ratio to report.
            row[f"speedup_vs_{method}"] = sched.time_us / lean.time_us if lean.time_us else None
    return row


def table_rows(problem: Problem, gpus: list[str], programs_per_sm: int | None = None) -> list[dict]:
    return [row_of(problem, GPUS[name], simulate(problem, GPUS[name], programs_per_sm)) for name in gpus]


def table_rows_parallel(problems: list[Problem], gpus: list[str], programs_per_sm: int | None = None,
                        workers: int | None = None, progress: bool = True) -> list[dict]:
    """``table_rows`` of every problem on every GPU, in that order, each distinct one computed once.

    Off the GPU the schedule kernel runs in the interpreter, one program at a time on one core, so
    the (problem, GPU) runs are spread over one process per core.
    """
    jobs = [(prob, gpu) for prob in problems for gpu in gpus]
    unique = list(dict.fromkeys(jobs))
    calls = [(prob, [gpu], programs_per_sm) for prob, gpu in unique]
    if torch.cuda.is_available():
        results = [table_rows(*call) for call in cli.progress(calls, desc="simulating", unit="run", disable=not progress)]
    else:  # the workers inherit TRITON_INTERPRET=1
        results = map_in_processes(table_rows, calls, "simulating", "run", workers, progress)
    done = {job: rows[0] for job, rows in zip(unique, results)}
    return [done[job] for job in jobs]


def format_table(rows: list[dict]) -> str:
    head = ("| GPU | problem | lean us | lean merge us | chain | merge KB | programs | lean BW | FA2 splits | FA2 us "
            "| FA2 combine us | Flex splits | Flex us | vs FA2 | vs Flex | invariant us | invariant / lean |")  # fmt: skip
    lines = [head, "|" + "---|" * 17]
    for r in rows:
        lines.append(
            f"| {r['gpu']} | {r['problem']} | {r['lean_us']:.1f} | {r['lean_merge_us']:.2f} | {r['lean_chain']} "
            f"| {r['lean_merge_kb']:.0f} "
            f"| {r['lean_programs']} | {r['lean_bw']:.2f} | {r['fa2_splits']} | {r['fa2_us']:.1f} | {r['fa2_merge_us']:.2f} "
            f"| {r['flex_splits']} | {r['flex_us']:.1f} | {_ratio(r['speedup_vs_fa2'])} | {_ratio(r['speedup_vs_flex'])} "
            f"| {r['lean_invariant_us']:.1f} | {_ratio(r['speedup_vs_lean_invariant'])} |"
        )
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def plot_gantt(problem: Problem, gpu: GPUModel, result: dict[str, Schedule], path: str) -> None:
    """Lean next to FA2's fixed split (``result`` of ``simulate``): one row per SM, one bar per
    piece of work, colored by output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizon = max(result["lean"].makespan, result["fa2"].makespan)
    fig, axes = plt.subplots(1, 2, figsize=(14, max(4, gpu.sms * 0.06)), sharey=True)
    cmap = plt.get_cmap("tab20")
    for ax, name in zip(axes, ("lean", "fa2")):
        sched = result[name]
        for sm, start, tokens, output in sched.bars:
            ax.barh(sm, tokens, left=start, height=0.9, color=cmap(output % 20), edgecolor="white", linewidth=0.3)
        ax.axvline(sched.makespan, color="red", linewidth=1.5, label="finish (makespan)")
        title = "LeanAttention (stream-K)" if name == "lean" else f"FlashDecoding / FA2 fixed split ({sched.splits} splits)"
        ax.set_title(f"{title}\nload balance {sched.efficiency:.2f} over the {sched.busy_sms} SMs with work, "
                     f"modelled {sched.time_us:.1f} us")  # fmt: skip
        ax.set_xlim(0, horizon * 1.02)
        ax.set_xlabel("K/V tokens read per SM")
    axes[0].set_ylabel(f"SM ({gpu.name}, {gpu.sms} SMs)")
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{problem.describe()}\nbar: one piece of work, its length the K/V tokens it reads; colour: the "
                 "output (sequence, KV head) it belongs to, so one colour on several SMs is a split output")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: str) -> None:
    """Modelled FA2 time over lean time against context: one panel per (GPU, preset model), one
    line per batch size, each in its own colour and marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus, models = sorted({r["gpu"] for r in rows}), sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(gpus), len(models), figsize=(3.6 * len(models), 3.2 * len(gpus)), sharex=True,
                             sharey=True, squeeze=False)  # fmt: skip
    for i, gpu in enumerate(gpus):
        for j, model in enumerate(models):
            ax = axes[i][j]
            for k, batch in enumerate(batches):
                points = sorted((r["context"], r["speedup_vs_fa2"]) for r in rows
                                if (r["gpu"], r["model"], r["batch"]) == (gpu, model, batch))  # fmt: skip
                if points:
                    ax.plot(*zip(*points), color=f"C{k}", marker="os^Dv"[k % 5], markersize=3, label=f"B={batch}")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{gpu}, {model}", fontsize=9)
            if i == len(gpus) - 1:
                ax.set_xlabel("context (tokens)")
        axes[i][0].set_ylabel("FA2 time / lean time")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center right", fontsize=8, title="batch")
    fig.suptitle(f"One rank of TP={rows[0]['tp']}: FlashDecoding (FA2) over lean, modelled, merges counted (> 1: lean faster)")
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cp_sweep(rows: list[dict], path: str, model: str = "llama-3-70b") -> None:
    """KV memory and modelled attention time per rank against context for ``model`` on the first
    GPU's rows: one row of panels per batch size (the smallest and the largest), one colour,
    marker and line style per layout, so that layouts with equal values stay visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = rows[0]["gpu"]
    mine = [r for r in rows if r["gpu"] == gpu and r["model"] == model]
    batches = sorted({min(r["batch"] for r in mine), max(r["batch"] for r in mine)})
    layouts = sorted({(r["gpus"], r["tp"], r["cp"]) for r in mine})
    fig, axes = plt.subplots(len(batches), 2, figsize=(13, 4 * len(batches)), sharex=True, squeeze=False)
    panels = (("kv_gb_per_rank", "KV cache per rank (GB, all layers)"), ("attention_us", "attention per layer per rank (us)"))
    for row, batch in zip(axes, batches):
        for ax, (key, label) in zip(row, panels):
            drawn: list[tuple[str, list]] = []
            for i, (gpus, tp, cp) in enumerate(layouts):
                points = sorted((r["context"], r[key]) for r in mine if (r["gpus"], r["tp"], r["cp"], r["batch"]) == (gpus, tp, cp, batch))
                name = f"{gpus} GPUs, TP {tp} x CP {cp}"
                # A layout whose values equal an earlier one's lies under it: the legend says so.
                same = [n for n, pts in drawn if all(math.isclose(a[1], b[1], rel_tol=0.01) for a, b in zip(pts, points))]
                drawn.append((name, points))
                # Drawn wide to narrow, hollow markers: a layout under another still shows its edge.
                ax.plot(*zip(*points), ("-", "--", ":", "-.")[i % 4], color=f"C{i}", marker="osD^v<>"[i % 7],
                        markersize=7 - i, markerfacecolor="none", linewidth=2.5 - 0.3 * i,
                        label=name + (f" (= {same[0].split(', ')[1]})" if same else ""))  # fmt: skip
            ax.legend(fontsize=7)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.set_title(f"B={batch}", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("context (tokens)")
    fig.suptitle(f"{model} on {gpu}: one rank, TP alone against TP x CP (CP exchange counted, modelled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paper_problems() -> list[Problem]:
    """The paper's sweeps (context, heads, batch) with D=128 plus ragged batches and Llama-3-70B/TP8."""
    problems = [Problem((n,) * 4, 32, 32) for n in (1024, 4096, 16384, 65536, 262144)]
    problems += [Problem((262144,), h, h) for h in (8, 32, 56, 128)]
    problems += [Problem((16384,) * b, 32, 32) for b in (1, 8, 32)]
    problems += [Problem((65536, 4096, 1024, 30000, 500, 12000, 64000, 2000), 32, 8),  # ragged, GQA
                 Problem((8192,) * 16, 8, 1),  # Llama-3-70B on 8 GPUs: 8 query heads, 1 KV head per rank
                 Problem((4096,) * 4, 256 // 8, 256 // 8)]  # 256 heads x batch 4 over 8 GPUs
    return problems


SWEEP_BATCHES = (1, 4, 16, 64)
SWEEP_CONTEXTS = tuple(1024 * 4**i for i in range(6))  # 1k .. 1M


def tp_sweep_problems(tp: int) -> list[tuple[str, int, int, Problem]]:
    """(preset, batch, context, one rank's problem) for every preset, batch and context; presets
    whose ranks have the same shape share one problem (computed once)."""
    out = []
    for name, (hq, hkv, d) in MODEL_PRESETS.items():
        rank_hq, rank_hkv = rank_heads(hq, hkv, tp)
        out += [(name, b, n, Problem((n,) * b, rank_hq, rank_hkv, d)) for b in SWEEP_BATCHES for n in SWEEP_CONTEXTS]
    return out


@dataclass(frozen=True)
class Link:
    """One kind of link between the ranks of a collective (sources in ``LINK_SOURCES``)."""

    name: str
    gbps: float  # GB/s per GPU, one direction
    latency_us: float  # a small collective's fixed cost over this link


# (A100 link, H100 link) by kind; a collective whose ranks span nodes runs at the network's figures.
LINKS = {
    "nvlink": (Link("NVLink 3", 300.0, 10.0), Link("NVLink 4", 450.0, 10.0)),
    "network": (Link("HDR InfiniBand", 25.0, 20.0), Link("NDR InfiniBand", 50.0, 20.0)),
}
LINK_SOURCES = {
    "gbps": "NVIDIA A100 and H100 (SXM) whitepapers: NVLink 600 and 900 GB/s per GPU, both directions together; "
            "one 200 Gb/s HDR (A100 systems) or 400 Gb/s NDR (H100 systems) InfiniBand adapter per GPU (DGX A100 "
            "and DGX H100 user guides)",
    "latency_us": "assumed, unmeasured here: NCCL's small-message collectives take ~10 us within an NVSwitch node "
                  "and ~20 us across InfiniBand nodes",
    "gpus_per_node": "8 GPUs per node (DGX/HGX A100 and H100)",
}  # fmt: skip
GPUS_PER_NODE = 8
CP_GPU_COUNTS = (8, 16)
CP_CONTEXTS = (32768, 131072, 524288, 1048576)
CP_BATCHES = (1, 8)
# Per-layer figures become per-model ones with the presets' layer counts (their Hugging Face configs).
PRESET_LAYERS = {"llama-3-8b": 32, "llama-3-70b": 80, "qwen2.5-72b": 80, "mixtral-8x7b": 32}


def cp_layouts(n_heads: int, n_kv_heads: int, gpus: int) -> list[tuple[int, int]]:
    """(tp, cp) pairs to compare on ``gpus`` ranks: TP alone, and TP over the KV heads with the rest
    as CP (or, with no more ranks than KV heads, TP / 2 x CP 2, to show what CP costs there)."""
    tp = n_kv_heads if gpus > n_kv_heads else gpus // 2
    layouts = [(gpus, 1)] if n_heads % gpus == 0 else []
    return layouts + ([(tp, gpus // tp)] if tp >= 1 and n_heads % tp == 0 and gpus % tp == 0 else [])


def cp_merge_us(batch: int, n_heads: int, head_dim: int, tp: int, cp: int, gpu: GPUModel) -> float:
    """The CP exchange of one layer: an all-gather of every rank's (out, lse) partials, float32
    (B x Hq x (D + 1) x 4 bytes a rank), over NVLink when the world fits in one node and over the
    network otherwise (CP ranks are tp apart), then the merge kernel's launch gap."""
    if cp == 1:
        return 0.0
    link = LINKS["nvlink" if tp * cp <= GPUS_PER_NODE else "network"][gpu.name == "H100"]
    partial = batch * n_heads * (head_dim + 1) * 4
    return link.latency_us + (cp - 1) * partial / (link.gbps * 1e3) + gpu.launch_gap_us


def cp_sweep_cases() -> list[tuple[str, int, int, int, int, int, Problem]]:
    """(preset, GPUs, tp, cp, batch, context, one rank's problem) of the CP sweep."""
    cases = []
    for name, (hq, hkv, d) in MODEL_PRESETS.items():
        for gpus in CP_GPU_COUNTS:
            for tp, cp in cp_layouts(hq, hkv, gpus):
                rank_hq, rank_hkv = rank_heads(hq, hkv, tp)
                cases += [(name, gpus, tp, cp, b, n, Problem((-(-n // cp),) * b, rank_hq, rank_hkv, d))
                          for b in CP_BATCHES for n in CP_CONTEXTS]  # fmt: skip
    return cases


def cp_row(case: tuple, row: dict, gpu: GPUModel) -> dict:
    """One rank's KV memory and modelled attention time per layer (lean kernel + CP exchange)."""
    name, gpus, tp, cp, batch, context, problem = case
    merge = cp_merge_us(batch, problem.n_heads, problem.head_dim, tp, cp, gpu)
    kv_gb = PRESET_LAYERS[name] * problem.kv_bytes / 1e9
    return {"gpu": gpu.name, "model": name, "gpus": gpus, "tp": tp, "cp": cp, "batch": batch, "context": context,
            "rank_problem": problem.describe(), "kv_gb_per_rank": kv_gb, "lean_us": row["lean_us"],
            "cp_merge_us": merge, "attention_us": row["lean_us"] + merge}  # fmt: skip


def format_cp_table(rows: list[dict]) -> str:
    head = "| GPU | model | GPUs | TP x CP | B | context | rank shape | KV GB / rank | kernel us | CP merge us | attention us / layer |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['gpu']} | {r['model']} | {r['gpus']} | {r['tp']} x {r['cp']} | {r['batch']} | {r['context']} "
                     f"| {r['rank_problem']} | {r['kv_gb_per_rank']:.1f} | {r['lean_us']:.1f} | {r['cp_merge_us']:.1f} "
                     f"| {r['attention_us']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def _ensure_schedule_backend(argv: list[str]) -> None:
    """The schedule kernel needs CUDA or the interpreter, chosen before lean_tp's kernels are defined."""
    if torch.cuda.is_available() or interpreted(lean_schedule_kernel):
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("simulate: TRITON_INTERPRET=1 is set but lean_tp's kernels were defined without it")
    os.execve(sys.executable, [sys.executable, "-m", "lean_tp.simulate", *argv], os.environ | {"TRITON_INTERPRET": "1"})


def _parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m lean_tp.simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", nargs="+", default=list(GPUS), type=cli.choice(*GPUS), help="GPUs to model (A100 H100)")
    # The one-problem flags default to None, so that a sweep can tell that one was given (and refuse it).
    p.add_argument("--batch", type=cli.integer(1, MAX_BATCH), help="sequences, when --lens is one length (4)")
    p.add_argument("--heads", type=cli.integer(1, MAX_HEADS), help="query heads (with --tp: of the whole model) (32)")
    p.add_argument("--kv-heads", type=cli.integer(1, MAX_HEADS), help="KV heads (with --tp: of the whole model) (8)")
    p.add_argument("--model", type=cli.choice(*MODEL_PRESETS), help="head counts and head_dim of a preset model")
    p.add_argument("--tp", type=cli.integer(1, MAX_HEADS), help="tensor-parallel size: simulate one rank's heads (1; 8 with --tp-sweep)")
    p.add_argument("--lens", type=cli.integer_list(0, MAX_LEN), help="one length for every sequence, or a comma list (ragged) (16384)")
    p.add_argument("--capacity", type=cli.integer(0, MAX_LEN),
                   help="KV cache capacity fixed-split kernels size splits from (0: the longest length)")
    p.add_argument("--head-dim", type=cli.integer(1, 1024), help="(128)")
    p.add_argument("--programs-per-sm", type=cli.integer(1, 64), help="lean grid = SMs x this (default: the tuning table's cap)")
    p.add_argument("--paper", action="store_true", help="the paper's shapes instead of one problem")
    p.add_argument("--tp-sweep", action="store_true", help="every preset at --tp (default 8), batch 1-64, context 1k-1M")
    p.add_argument("--cp-sweep", action="store_true",
                   help="every preset on 8 and 16 GPUs, TP alone against TP x CP: KV memory and attention time per rank")
    p.add_argument("--json", metavar="PATH", type=cli.output_file, help="also write the rows as JSON to PATH ('-': stdout, no table)")
    p.add_argument("--plot", metavar="PNG", type=cli.output_file,
                   help="a Gantt chart (one problem, first --gpu) or the sweep's speedups")
    return p


# The flags that describe one problem, with their defaults.
ONE_PROBLEM_DEFAULTS = {"batch": 4, "heads": 32, "kv_heads": 8, "lens": [16384], "capacity": 0, "head_dim": 128}


def _check_flags(p: cli.ArgumentParser, args) -> None:
    """Rules across flags: every flag given must be used (one-problem flags mean nothing to the
    sweeps, --tp nothing to --paper or --cp-sweep), and --batch must agree with a list of lengths."""
    if args.plot == "-":
        p.fail("--plot", "a PNG file path", args.plot)
    modes = [flag for flag, on in (("--paper", args.paper), ("--tp-sweep", args.tp_sweep), ("--cp-sweep", args.cp_sweep)) if on]
    if len(modes) > 1:
        p.fail(modes[1], f"one of --paper, --tp-sweep, --cp-sweep (not with {modes[0]})", True)
    sweep = modes[0] if modes else None
    if sweep:
        unused = [name for name in (*ONE_PROBLEM_DEFAULTS, "model") if getattr(args, name) is not None]
        if args.tp is not None and not args.tp_sweep:
            unused.append("tp")
        if unused:
            flag = "--" + unused[0].replace("_", "-")
            p.fail(flag, f"no {flag} with {sweep} (it sets its own problems)", getattr(args, unused[0]))
    if args.model and (args.heads or args.kv_heads or args.head_dim):
        p.fail("--model", "no --heads, --kv-heads or --head-dim with --model (the preset sets them)", args.model)
    if args.batch is not None and args.lens is not None and len(args.lens) > 1 and len(args.lens) != args.batch:
        p.fail("--batch", f"the number of --lens ({len(args.lens)}) or no --batch with a list of lengths", args.batch)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = _parser()
    args = p.parse_args(argv)
    _check_flags(p, args)
    if args.tp is None:
        args.tp = 8 if args.tp_sweep else 1
    if args.model:
        args.heads, args.kv_heads, args.head_dim = MODEL_PRESETS[args.model]
    for name, default in ONE_PROBLEM_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    lens = tuple(args.lens) * args.batch if len(args.lens) == 1 else tuple(args.lens)
    try:
        heads, kv_heads = rank_heads(args.heads, args.kv_heads, args.tp)
        problem = Problem(lens, heads, kv_heads, args.head_dim, args.capacity)
    except ValueError as e:  # a rule across flags: name the flag the message's argument comes from
        name, _, rest = str(e).partition(": ")
        flag = {"--tp": "--tp", "lens": "--lens", "n_heads": "--heads", "capacity": "--capacity", "head_dim": "--head-dim"}
        p.error(f"argument {flag[name]}: {rest}" if name in flag else str(e))
    _ensure_schedule_backend(argv)
    if args.cp_sweep:
        cases = cp_sweep_cases()
        rows = table_rows_parallel([c[-1] for c in cases], args.gpu, args.programs_per_sm)
        rows = [cp_row(c, r, GPUS[r["gpu"]]) for c, r in zip((c for c in cases for _ in args.gpu), rows)]
    elif args.tp_sweep:
        cases = tp_sweep_problems(args.tp)
        rows = table_rows_parallel([c[3] for c in cases], args.gpu, args.programs_per_sm)
        rows = [{"model": c[0], "tp": args.tp, "batch": c[1], "context": c[2], **r}
                for c, r in zip((c for c in cases for _ in args.gpu), rows)]  # fmt: skip
    elif args.paper:
        rows = table_rows_parallel(paper_problems(), args.gpu, args.programs_per_sm)
    else:
        print(f"simulating on {', '.join(args.gpu)} (the schedule kernel runs in the Triton interpreter on CPU: "
              "~10 s per GPU) ...", file=sys.stderr, flush=True)  # fmt: skip
        results = {name: simulate(problem, GPUS[name], args.programs_per_sm) for name in args.gpu}
        rows = [row_of(problem, GPUS[name], result) for name, result in results.items()]
    if args.json:
        text = json.dumps({"model": {g: dataclasses.asdict(GPUS[g]) for g in args.gpu}, "sources": MODEL_SOURCES,
                           **({"links": LINKS, "link_sources": LINK_SOURCES} if args.cp_sweep else {}),
                           "rows": rows}, indent=1, default=dataclasses.asdict)  # fmt: skip
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print(format_cp_table(rows) if args.cp_sweep else format_table(rows))
    if args.plot:
        if args.cp_sweep:
            plot_cp_sweep(rows, args.plot)
        elif args.tp_sweep:
            plot_sweep(rows, args.plot)
        else:
            plot_gantt(problem, GPUS[args.gpu[0]], results[args.gpu[0]], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
