"""The simulator's rows and tables: every method's modelled time of a problem on a GPU, and the
context-parallel sweep's per-rank memory and time."""

from __future__ import annotations

from statistics import geometric_mean

import torch

from lean_tp import cli
from lean_tp.tools.gpus import GPUS, GPUModel, link_of
from lean_tp.tools.processes import map_in_processes
from lean_tp.tools.simulate.deterministic import ENGINE_CONSTANTS, ENGINE_MODES, deterministic_schedules
from lean_tp.tools.simulate.methods import simulate
from lean_tp.tools.simulate.mla import MLA_PEERS
from lean_tp.tools.simulate.problems import PRESET_LAYERS, Problem
from lean_tp.tools.simulate.schedules import Schedule, lean_sim_schedule


def row_of(problem: Problem, gpu: GPUModel, result: dict[str, Schedule | None]) -> dict:
    """One table row: every method's modelled time and merge, lean's chain and bandwidth share; a
    method that does not run the problem (None) has None for each."""
    lean = result["lean"]
    row = {
        "gpu": gpu.name,
        "problem": problem.describe(),
        "kv_mb": problem.kv_bytes / 1e6,
        "lean_programs": lean.units,
        "lean_chain": lean.chain,
        "lean_merge_kb": lean.merge_bytes / 1024,
        "lean_bw": problem.kv_bytes / (lean.time_us * 1e6 * gpu.hbm_tbps) if lean.time_us else 0.0,
    }
    for method, sched in result.items():
        if sched is None:
            row |= dict.fromkeys(f"{method}_{k}" for k in ("us", "merge_us", "eff", "splits"))
            row[f"speedup_vs_{method}"] = None
            continue
        row |= {
            f"{method}_us": sched.time_us,
            f"{method}_merge_us": sched.merge_us,
            f"{method}_eff": sched.efficiency,
            f"{method}_splits": sched.splits,
        }
        if method != "lean":
            # None where lean has nothing to do (every length 0): no ratio to report.
            row[f"speedup_vs_{method}"] = sched.time_us / lean.time_us if lean.time_us else None
    return row


def table_rows(problem: Problem, gpus: list[str], programs_per_sm: int | None = None) -> list[dict]:
    return [row_of(problem, GPUS[name], simulate(problem, GPUS[name], programs_per_sm)) for name in gpus]


def deterministic_table_rows(problem: Problem, gpus: list[str], programs_per_sm: int | None = None) -> list[dict]:
    """``--deterministic-sweep``'s rows: lean's modes and the engines' deterministic modes, each
    engine's time over lean invariant's (above 1: lean invariant is faster)."""
    rows = []
    for name in gpus:
        result = deterministic_schedules(problem, GPUS[name], programs_per_sm)
        invariant = result["lean_invariant"].time_us
        row = {"gpu": name, "problem": problem.describe(), "kv_mb": problem.kv_bytes / 1e6}
        for method, sched in result.items():
            row |= {
                f"{method}_us": sched.time_us,
                f"{method}_merge_us": sched.merge_us,
                f"{method}_splits": sched.splits,
            }
        row["invariant_over_lean"] = invariant / row["lean_us"] if row["lean_us"] else None
        for engine in ENGINE_MODES:
            row[f"{engine}_over_invariant"] = result[engine].time_us / invariant if invariant else None
        rows.append(row)
    return rows


def verification_table_rows(problem: Problem, gpus: list[str], programs_per_sm: int | None = None) -> list[dict]:
    """``--deterministic-sweep``'s verification rows: a Tq-token verification in lean's default and
    batch-invariant modes (the latter decodes each token as a sequence of its own over its keys, so
    it reads the keys once per token), the invariant's time over the default's."""
    rows = []
    for name in gpus:
        default = lean_sim_schedule(problem, GPUS[name], programs_per_sm)
        invariant = lean_sim_schedule(problem, GPUS[name], programs_per_sm, batch_invariant=True)
        rows.append(
            {
                "gpu": name,
                "problem": problem.describe(),
                "kv_mb": problem.kv_bytes / 1e6,
                "lean_us": default.time_us,
                "lean_invariant_us": invariant.time_us,
                "invariant_over_lean": invariant.time_us / default.time_us if default.time_us else None,
            }
        )
    return rows


def table_rows_parallel(
    problems: list[Problem],
    gpus: list[str],
    programs_per_sm: int | None = None,
    workers: int | None = None,
    progress: bool = True,
    rows_of=table_rows,
) -> list[dict]:
    """``rows_of`` (``table_rows`` or ``deterministic_table_rows``) of every problem on every GPU, in
    that order, each distinct one computed once.

    Off the GPU the schedule kernel runs in the interpreter, one program at a time on one core, so
    the (problem, GPU) runs are spread over one process per core.
    """
    jobs = [(prob, gpu) for prob in problems for gpu in gpus]
    unique = list(dict.fromkeys(jobs))
    calls = [(prob, [gpu], programs_per_sm) for prob, gpu in unique]
    if torch.cuda.is_available():
        results = [rows_of(*call) for call in cli.progress(calls, desc="simulating", unit="run", disable=not progress)]
    else:  # the workers inherit TRITON_INTERPRET=1
        results = map_in_processes(rows_of, calls, "simulating", "run", workers, progress)
    done = {job: rows[0] for job, rows in zip(unique, results)}
    return [done[job] for job in jobs]


def format_table(rows: list[dict]) -> str:
    head = (
        "| GPU | problem | lean us | lean merge us | chain | merge KB | programs | lean BW | FA2 splits | FA2 us "
        "| FA2 combine us | Flex splits | Flex us | vs FA2 | vs Flex | invariant us | invariant / lean |"
    )
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


def cp_merge_us(batch: int, n_heads: int, head_dim: int, tp: int, cp: int, gpu: GPUModel) -> float:
    """The CP exchange of one layer: an all-gather of every rank's (out, lse) partials, float32
    (B x Hq x (D + 1) x 4 bytes a rank), over NVLink when the world fits in one node and over the
    network otherwise (CP ranks are tp apart), then the merge kernel's launch gap."""
    if cp == 1:
        return 0.0
    link = link_of(gpu, tp * cp)
    partial = batch * n_heads * (head_dim + 1) * 4
    return link.latency_us + (cp - 1) * partial / (link.gbps * 1e3) + gpu.launch_gap_us


def cp_row(case: tuple, row: dict, gpu: GPUModel) -> dict:
    """One rank's KV memory and modelled attention time per layer (lean kernel + CP exchange)."""
    name, gpus, tp, cp, batch, context, problem = case
    merge = cp_merge_us(batch, problem.n_heads, problem.head_dim, tp, cp, gpu)
    kv_gb = PRESET_LAYERS[name] * problem.kv_bytes / 1e9
    return {
        "gpu": gpu.name,
        "model": name,
        "gpus": gpus,
        "tp": tp,
        "cp": cp,
        "batch": batch,
        "context": context,
        "rank_problem": problem.describe(),
        "kv_gb_per_rank": kv_gb,
        "lean_us": row["lean_us"],
        "cp_merge_us": merge,
        "attention_us": row["lean_us"] + merge,
    }


def format_cp_table(rows: list[dict]) -> str:
    head = "| GPU | model | GPUs | TP x CP | B | context | rank shape | KV GB / rank | kernel us | CP merge us | attention us / layer |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['gpu']} | {r['model']} | {r['gpus']} | {r['tp']} x {r['cp']} | {r['batch']} | {r['context']} "
            f"| {r['rank_problem']} | {r['kv_gb_per_rank']:.1f} | {r['lean_us']:.1f} | {r['cp_merge_us']:.1f} "
            f"| {r['attention_us']:.1f} |"
        )
    return "\n".join(lines)


def format_tp_table(rows: list[dict]) -> str:
    """The tensor-parallel sweep's rows (``--tp-sweep``) as one table; presets whose ranks have the
    same shape (Hq, Hkv, D) share a row."""
    head = (
        "| GPU | model (rank shape) | B | context | lean us | merge us | chain | merge KB | programs | FA2 splits "
        "| FA2 us | FA2 combine us | FA2 / lean | Flex / lean | invariant / lean |"
    )
    merged: dict[tuple[str, str], tuple[dict, list[str]]] = {}
    for r in rows:
        merged.setdefault((r["problem"], r["gpu"]), (r, []))[1].append(r["model"])
    lines = [head, "|" + "---|" * 15]
    for r, models in merged.values():
        shape = r["problem"].split(" ", 1)[1].rsplit(" len ", 1)[0]
        lines.append(
            f"| {r['gpu']} | {' / '.join(models)} ({shape}) | {r['batch']} | {r['context']} | {r['lean_us']:.1f} "
            f"| {r['lean_merge_us']:.2f} | {r['lean_chain']} | {r['lean_merge_kb']:.0f} | {r['lean_programs']} "
            f"| {r['fa2_splits']} | {r['fa2_us']:.1f} | {r['fa2_merge_us']:.2f} | {_ratio(r['speedup_vs_fa2'])} "
            f"| {_ratio(r['speedup_vs_flex'])} | {_ratio(r['speedup_vs_lean_invariant'])} |"
        )
    return "\n".join(lines)


MLA_PEER_NAMES = ("FlashMLA", "FlashInfer", "vLLM Triton", "SGLang Triton")  # mla.MLA_PEERS' order


def taking_peer_ratios(row: dict) -> dict[str, float]:
    """An MLA sweep row's peer time over lean's, of the peers whose code takes its cache."""
    return {peer: row[f"speedup_vs_{peer}"] for peer in MLA_PEERS if row[f"speedup_vs_{peer}"] is not None}


def format_mla_table(rows: list[dict]) -> str:
    """The MLA sweep's rows (``--mla-sweep``): lean against each MLA peer (``mla.MLA_PEERS``), the
    peer's time over lean's (above 1: lean is faster); "-" and "n/a" where the peer's code does not
    take the cache (``mla.mla_peer_takes``)."""
    head = (
        "| GPU | model | rank (heads) | cache | Tq | B | context | lean us | merge us | programs | "
        + " | ".join(f"{n} us" for n in MLA_PEER_NAMES)
        + " | "
        + " | ".join(f"{n} / lean" for n in MLA_PEER_NAMES)
        + " |"
    )
    lines = [head, "|" + "---|" * (10 + 2 * len(MLA_PEER_NAMES))]
    for r in rows:
        times = " | ".join("-" if r[f"{peer}_us"] is None else f"{r[f'{peer}_us']:.1f}" for peer in MLA_PEERS)
        ratios = " | ".join(_ratio(r[f"speedup_vs_{peer}"]) for peer in MLA_PEERS)
        lines.append(
            f"| {r['gpu']} | {r['model']} | {r['parallel']} ({r['heads']}) | {r['cache']} | {r['tq']} | {r['batch']} "
            f"| {r['context']} | {r['lean_us']:.1f} | {r['lean_merge_us']:.2f} | {r['lean_programs']} | {times} | {ratios} |"
        )
    return "\n".join(lines)


def format_mla_summary(rows: list[dict]) -> str:
    """The MLA sweep by GPU and rank: each peer's time over lean's over the shapes its code takes
    (range, geometric mean, and at how many lean is at least as fast), then the shapes where lean is
    at least as fast as every peer that takes them, of those some peer takes."""
    lines = ["| GPU | rank | " + " | ".join(MLA_PEER_NAMES) + " | every peer |", "|" + "---|" * (3 + len(MLA_PEERS))]
    gpus = list(dict.fromkeys(r["gpu"] for r in rows))
    ranks = dict.fromkeys((r["gpu"], r["model"], r["parallel"], r["heads"]) for r in rows)
    for gpu, model, parallel, heads in sorted(ranks, key=lambda rank: gpus.index(rank[0])):
        mine = [r for r in rows if (r["gpu"], r["model"], r["parallel"], r["heads"]) == (gpu, model, parallel, heads)]
        taken = [taking_peer_ratios(r) for r in mine]
        cells = []
        for peer in MLA_PEERS:
            xs = [ratios[peer] for ratios in taken if peer in ratios]
            count = f"({sum(x >= 1 for x in xs)}/{len(xs)})"
            cells.append(f"{min(xs):.2f}-{max(xs):.2f}, {geometric_mean(xs):.2f} {count}" if xs else "-")
        every = sum(min(ratios.values()) >= 1 for ratios in taken if ratios)
        lines.append(
            f"| {gpu} | {model} {parallel} ({heads}) | {' | '.join(cells)} | {every}/{sum(map(bool, taken))} |"
        )
    return "\n".join(lines)


def format_deterministic_table(rows: list[dict]) -> str:
    """``--deterministic-sweep``'s rows: lean invariant against vLLM's batch-invariant mode and
    SGLang's deterministic FlashInfer and Triton modes (ratios: the engine's time over lean invariant's)."""
    head = (
        "| GPU | shapes | problem | lean us | invariant us | invariant / lean | vLLM us | FlashInfer splits "
        "| FlashInfer us | Triton splits | Triton us | Triton reduce us | vLLM / inv | FlashInfer / inv "
        "| Triton / inv |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['gpu']} | {r['shapes']} | {r['problem']} | {r['lean_us']:.1f} | {r['lean_invariant_us']:.1f} "
            f"| {_ratio(r['invariant_over_lean'])} | {r['vllm_us']:.1f} | {r['sglang_flashinfer_splits']} "
            f"| {r['sglang_flashinfer_us']:.1f} | {r['sglang_triton_splits']} | {r['sglang_triton_us']:.1f} "
            f"| {r['sglang_triton_merge_us']:.1f} | {_ratio(r['vllm_over_invariant'])} "
            f"| {_ratio(r['sglang_flashinfer_over_invariant'])} | {_ratio(r['sglang_triton_over_invariant'])} |"
        )
    return "\n".join(lines)


DETERMINISTIC_COMMAND = (
    "python -m lean_tp.tools.simulate --deterministic-sweep --json docs/simulator/deterministic.json "
    "--plot docs/simulator/deterministic.png > docs/simulator/deterministic.md"
)
ENGINE_NAMES = {
    "vllm": "vLLM batch-invariant",
    "sglang_flashinfer": "SGLang FlashInfer",
    "sglang_triton": "SGLang Triton",
}


def format_deterministic_report(rows: list[dict]) -> str:
    """``--deterministic-sweep``'s whole page (docs/simulator/deterministic.md): how it is made, the
    engines' constants with their sources, each engine's range against lean invariant, every row."""
    lines = [
        "# Simulated deterministic decode: lean's batch-invariant mode against the engines'",
        "",
        f"`{DETERMINISTIC_COMMAND}` writes this page (the schedule code runs in the Triton interpreter on CPU).",
        "Modelled, not measured: the time model of "
        "[BENCHMARKS.md](../BENCHMARKS.md#deterministic-modes---deterministic-sweep),",
        "the engines' modes in `lean_tp/tools/simulate/deterministic.py`. Ratios are the engine's time over lean "
        "invariant's: above 1, lean invariant is faster.",
        "",
        "| constant | value | source |",
        "|---|---|---|",
        *(f"| {name} | {value} | {source} |" for name, value, source in ENGINE_CONSTANTS),
        "",
        "| GPU | mode | over lean invariant | lean invariant faster (> 1.01x) | within 1% | slower (< 0.99x) |",
        "|---|---|---|---|---|---|",
    ]
    engines = [r for r in rows if r.get("table") != "verification"]
    verification = [r for r in rows if r.get("table") == "verification"]
    for gpu in sorted({r["gpu"] for r in engines}):
        mine = [r for r in engines if r["gpu"] == gpu]
        ratios = {"lean default (invariant / lean)": [r["invariant_over_lean"] for r in mine]}
        ratios |= {ENGINE_NAMES[e]: [r[f"{e}_over_invariant"] for r in mine] for e in ENGINE_MODES}
        for name, values in ratios.items():
            values = [v for v in values if v is not None]
            counts = [
                sum(v > 1.01 for v in values),
                sum(0.99 <= v <= 1.01 for v in values),
                sum(v < 0.99 for v in values),
            ]
            shares = " | ".join("-" if name.startswith("lean") else f"{n} of {len(values)}" for n in counts)
            lines.append(f"| {gpu} | {name} | {_range(values)} | {shares} |")
    lines += ["", format_deterministic_table(engines)]
    if verification:
        lines += ["", *format_verification(verification)]
    return "\n".join(lines)


def format_verification(rows: list[dict]) -> list[str]:
    """The verification table's lines: per GPU, shape and Tq, the range of lean invariant's time over
    lean default's, then every row."""
    lines = [
        "## Speculative verification in the batch-invariant mode",
        "",
        "Each query token of a Tq-token verification is decoded as a sequence of its own over the keys up to "
        "its own, so that its bits are those of its one-token decode (docs/design.md); it reads the keys once "
        "per token where the default mode reads them once per row block. A re-read of keys another program "
        "read shortly before is an L2 hit (the L2 model, docs/BENCHMARKS.md). Shapes: a TP-8 rank (one KV "
        "head, D=128) of each GQA group and "
        "DeepSeek-V3's MLA rank (16 heads, 576/512), one and sixteen sequences of 4k and 32k keys.",
        "",
        "| GPU | shape | Tq | invariant / default |",
        "|---|---|---|---|",
    ]
    keys = dict.fromkeys((r["gpu"], r["shapes"], r["tq"]) for r in rows)
    for gpu, shape, tq in keys:
        values = [
            r["invariant_over_lean"]
            for r in rows
            if (r["gpu"], r["shapes"], r["tq"]) == (gpu, shape, tq) and r["invariant_over_lean"] is not None
        ]
        lines.append(f"| {gpu} | {shape} | {tq} | {_range(values)} |")
    lines += [
        "",
        "| GPU | shape | problem | default us | invariant us | invariant / default |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['gpu']} | {r['shapes']} | {r['problem']} | {r['lean_us']:.1f} | {r['lean_invariant_us']:.1f} "
        f"| {_ratio(r['invariant_over_lean'])} |"
        for r in rows
    ]
    return lines


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "n/a"
