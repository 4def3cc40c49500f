"""Schedule simulator: how evenly LeanAttention and fixed-split decode kernels load a GPU's SMs.

    python -m lean_tp.simulate --sms 108 132 148 --batch 4 --heads 32 --kv-heads 8 --lens 65536
    python -m lean_tp.simulate --sms 132 --heads 32 --kv-heads 32 --lens 30000,2000,500,8000 --plot gantt.png

Work is counted in K/V tokens read, the cost of memory-bound decode. An SM's time is the work of
everything placed on it, so ``efficiency = mean / max work per SM`` is the fraction of the GPU's
bandwidth a schedule can use, and the ratio of two schedules' maxima bounds the speedup between them.
Merges of split outputs are not counted, for either method.

- **lean**: the kernel's own schedule (``lean_schedule`` runs the kernel's schedule code), a grid of
  ``SMs x programs per SM``, program p on SM ``p mod SMs``.
- **fa2**: FlashAttention-2's ``num_splits_heuristic``, the FlashDecoding rule, with its splits sized
  from the cache capacity; CTAs go, in launch order, to the least-loaded SM (ideal dynamic dispatch).
- **flex**: FlexAttention's decode rule, ``max(SMs // (B * Hkv) * 2, 1)`` splits of the capacity.

On CPU the schedule code runs in the Triton interpreter; this module re-executes itself with
``TRITON_INTERPRET=1`` when needed.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sys
from dataclasses import dataclass, field

import torch

from lean_tp.ops.decode_attention.launcher import kernel_constexprs, lean_schedule
from lean_tp.ops.decode_attention.schedule import lean_schedule_kernel
from lean_tp.ops.decode_attention.tuning import config_for
from lean_tp.ops.utils import interpreted, map_in_processes

# Tuning-table architecture of each simulated GPU. B200 (148 SMs) has no table row of its own yet,
# so it uses the Hopper one.
ARCH_BY_SMS = {108: "sm80", 132: "sm90", 148: "sm90"}
GPU_NAMES = {108: "A100", 132: "H100/H200", 148: "B200"}
METHODS = ("lean", "fa2", "flex")
ELEM_DTYPES = {2: torch.float16, 4: torch.float32}


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

    def describe(self) -> str:
        lens = f"len {self.lens[0]}" if len(set(self.lens)) == 1 else f"lens {min(self.lens)}-{max(self.lens)} (mean {sum(self.lens) // len(self.lens)})"
        return f"B={len(self.lens)} Hq={self.n_heads} Hkv={self.n_kv_heads} D={self.head_dim} {lens}"


@dataclass
class Schedule:
    method: str
    sms: int
    units: int  # programs (lean) or CTAs (fixed split) that do work
    splits: int  # lean: outputs split across programs; fixed split: splits per output
    sm_work: list[int]
    bars: list[tuple[int, int, int, int]] = field(default_factory=list)  # (sm, start, tokens, output)

    @property
    def makespan(self) -> int:
        return max(self.sm_work)

    @property
    def efficiency(self) -> float:
        return sum(self.sm_work) / (len(self.sm_work) * self.makespan) if self.makespan else 1.0


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


def fixed_split_schedule(method: str, problem: Problem, sms: int, splits: int, block_n: int) -> Schedule:
    """CTAs (b, KV head, split) over equal ranges of the capacity, each reading only its sequence's
    tokens in that range, dispatched in launch order to the least-loaded SM."""
    per_split = math.ceil(math.ceil(problem.kv_len / block_n) / splits) * block_n
    load = [(0, sm) for sm in range(sms)]
    work, bars, units = [0] * sms, [], 0
    for b, length in enumerate(problem.lens):
        for h in range(problem.n_kv_heads):
            for s in range(splits):
                tokens = max(0, min(length, (s + 1) * per_split) - s * per_split)
                if tokens == 0:
                    continue  # an empty split exits at once; its cost is ignored, as lean's merges are
                start, sm = heapq.heappop(load)
                heapq.heappush(load, (start + tokens, sm))
                work[sm] += tokens
                bars.append((sm, start, tokens, b * problem.n_kv_heads + h))
                units += 1
    return Schedule(method, sms, units, splits, work, bars)


def lean_config(problem: Problem, sms: int):
    return config_for(ARCH_BY_SMS.get(sms, "sm90"), problem.head_dim, ELEM_DTYPES[problem.elem_size])


def lean_sim_schedule(problem: Problem, sms: int, programs_per_sm: int | None = None) -> Schedule:
    """The kernel's stream-K schedule on ``sms`` SMs, from the kernel's own schedule code."""
    config = lean_config(problem, sms)
    grid = sms * (programs_per_sm or config.max_programs_per_sm)
    dtype = ELEM_DTYPES[problem.elem_size]
    num_gc = kernel_constexprs(config, problem.head_dim, problem.n_heads // problem.n_kv_heads, dtype, None)["NUM_GC"]
    head_units, tile = problem.n_kv_heads * num_gc, config.tile_n
    device = "cuda" if torch.cuda.is_available() else "cpu"
    programs = lean_schedule(torch.tensor(problem.lens, dtype=torch.int32, device=device), head_units, tile, grid)
    work, clock, bars = [0] * sms, [0] * sms, []
    split_outputs = set()
    for p, segments in enumerate(programs):
        sm = p % sms
        for b, hu, first, n_tiles, contributors in segments:
            tokens = min(problem.lens[b], (first + n_tiles) * tile) - first * tile
            bars.append((sm, clock[sm], tokens, b * problem.n_kv_heads + hu // num_gc))
            clock[sm] += tokens
            work[sm] += tokens
            if contributors > 1:
                split_outputs.add((b, hu))
    return Schedule("lean", sms, len(programs), len(split_outputs), work, bars)


def simulate(problem: Problem, sms: int, programs_per_sm: int | None = None) -> dict[str, Schedule]:
    """Lean, FA2 and Flex schedules of one problem on ``sms`` SMs."""
    fa2, block_n = fa2_splits(problem, sms)
    return {
        "lean": lean_sim_schedule(problem, sms, programs_per_sm),
        "fa2": fixed_split_schedule("fa2", problem, sms, fa2, block_n),
        "flex": fixed_split_schedule("flex", problem, sms, flex_splits(problem, sms), 64),
    }


def table_rows(problem: Problem, sms_list: list[int], programs_per_sm: int | None = None) -> list[dict]:
    rows = []
    for sms in sms_list:
        result = simulate(problem, sms, programs_per_sm)
        lean = result["lean"]
        row = {"gpu": f"{GPU_NAMES.get(sms, '?')} ({sms} SMs)", "problem": problem.describe()}
        for name, sched in result.items():
            row[f"{name}_eff"] = sched.efficiency
            row[f"{name}_splits"] = sched.splits
            if name != "lean":
                row[f"speedup_vs_{name}"] = sched.makespan / lean.makespan if lean.makespan else 1.0
        rows.append(row)
    return rows


def table_rows_parallel(problems: list[Problem], sms_list: list[int], programs_per_sm: int | None = None,
                        workers: int | None = None, progress: bool = True) -> list[dict]:
    """``table_rows`` of every problem on every SM count, in that order, each distinct one computed once.

    Off the GPU the schedule kernel runs in the interpreter, one program at a time on one core, so
    the (problem, SM count) runs are spread over one process per core.
    """
    jobs = [(prob, sms) for prob in problems for sms in sms_list]
    unique = list(dict.fromkeys(jobs))
    calls = [(prob, [sms], programs_per_sm) for prob, sms in unique]
    if torch.cuda.is_available():
        from tqdm import tqdm

        results = [table_rows(*call) for call in tqdm(calls, desc="simulating", unit="run", disable=not progress, file=sys.stderr)]
    else:  # the workers inherit TRITON_INTERPRET=1
        results = map_in_processes(table_rows, calls, "simulating", "run", workers, progress)
    done = {job: rows[0] for job, rows in zip(unique, results)}
    return [done[job] for job in jobs]


def format_table(rows: list[dict]) -> str:
    head = "| GPU | problem | lean eff. | FA2 splits | FA2 eff. | Flex splits | Flex eff. | bound vs FA2 | bound vs Flex |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['gpu']} | {r['problem']} | {r['lean_eff']:.3f} | {r['fa2_splits']} | {r['fa2_eff']:.3f} | "
            f"{r['flex_splits']} | {r['flex_eff']:.3f} | {r['speedup_vs_fa2']:.2f}x | {r['speedup_vs_flex']:.2f}x |"
        )
    return "\n".join(lines)


def plot_gantt(problem: Problem, sms: int, path: str, programs_per_sm: int | None = None) -> None:
    """Lean next to FA2's fixed split: one row per SM, one bar per piece of work, colored by output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = simulate(problem, sms, programs_per_sm)
    horizon = max(result["lean"].makespan, result["fa2"].makespan)
    fig, axes = plt.subplots(1, 2, figsize=(14, max(4, sms * 0.06)), sharey=True)
    cmap = plt.get_cmap("tab20")
    for ax, name in zip(axes, ("lean", "fa2")):
        sched = result[name]
        for sm, start, tokens, output in sched.bars:
            ax.barh(sm, tokens, left=start, height=0.9, color=cmap(output % 20), edgecolor="white", linewidth=0.3)
        ax.axvline(sched.makespan, color="red", linewidth=1.5, label="finish (makespan)")
        title = "LeanAttention (stream-K)" if name == "lean" else f"FlashDecoding / FA2 fixed split ({sched.splits} splits)"
        ax.set_title(f"{title}\nefficiency {sched.efficiency:.2f}, finish {sched.makespan} tokens")
        ax.set_xlim(0, horizon * 1.02)
        ax.set_xlabel("time (K/V tokens read per SM)")
    axes[0].set_ylabel(f"SM ({GPU_NAMES.get(sms, '')}, {sms} SMs)")
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{problem.describe()}\nbar: one piece of work, its length the K/V tokens it reads; colour: the "
                 "output (sequence, KV head) it belongs to, so one colour on several SMs is a split output")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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


def _ensure_schedule_backend(argv: list[str]) -> None:
    """The schedule kernel needs CUDA or the interpreter, chosen before lean_tp's kernels are defined."""
    if torch.cuda.is_available() or interpreted(lean_schedule_kernel):
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("simulate: TRITON_INTERPRET=1 is set but lean_tp's kernels were defined without it")
    os.execve(sys.executable, [sys.executable, "-m", "lean_tp.simulate", *argv], os.environ | {"TRITON_INTERPRET": "1"})


def parse_lens(text: str, batch: int) -> tuple[int, ...]:
    try:
        lens = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--lens: expected an integer or a comma list of integers, got {text!r}") from None
    return lens * batch if len(lens) == 1 else lens


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sms", type=int, nargs="+", default=[108, 132, 148], help="SM counts (A100 108, H100 132, B200 148)")
    p.add_argument("--batch", type=int, default=4, help="sequences, when --lens is one length")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--lens", default="16384", help="one length for every sequence, or a comma list (ragged)")
    p.add_argument("--capacity", type=int, default=0, help="KV cache capacity fixed-split kernels size splits from")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--programs-per-sm", type=int, help="lean grid = SMs x this (default: the tuning table's cap)")
    p.add_argument("--paper", action="store_true", help="print the table for the paper's shapes instead")
    p.add_argument("--plot", help="write a Gantt chart (lean vs FA2, first --sms) to this PNG")
    args = p.parse_args(argv)
    _ensure_schedule_backend(argv)
    if args.paper:
        print(format_table(table_rows_parallel(paper_problems(), args.sms, args.programs_per_sm)))
        return 0
    print(f"simulating on {', '.join(map(str, args.sms))} SMs (the schedule kernel runs in the Triton interpreter "
          "on CPU: ~10 s per GPU) ...", file=sys.stderr, flush=True)
    problem = Problem(parse_lens(args.lens, args.batch), args.heads, args.kv_heads, args.head_dim, args.capacity)
    print(format_table(table_rows(problem, args.sms, args.programs_per_sm)))
    if args.plot:
        plot_gantt(problem, args.sms[0], args.plot, args.programs_per_sm)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
