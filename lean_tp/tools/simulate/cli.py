"""The simulator's command line (``python -m lean_tp.tools.simulate``).

On CPU the schedule code runs in the Triton interpreter; the command re-executes itself with
``TRITON_INTERPRET=1`` when needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from lean_tp import cli
from lean_tp.ops.decode_attention.schedule import lean_schedule_kernel
from lean_tp.ops.utils import interpreted
from lean_tp.tools.gpus import DEFAULT_GPUS, GPUS, LINK_SOURCES, LINKS, MODEL_SOURCES
from lean_tp.tools.simulate.deterministic import ENGINE_CONSTANTS, ENGINE_VERSIONS
from lean_tp.tools.simulate.methods import simulate
from lean_tp.tools.simulate.mla import MLA_PEER_CONSTANTS
from lean_tp.tools.simulate.plots import plot_cp_sweep, plot_deterministic_sweep, plot_gantt, plot_mla_sweep, plot_sweep
from lean_tp.tools.simulate.problems import (
    MAX_BATCH,
    MAX_HEADS,
    MAX_LEN,
    MODEL_PRESETS,
    Problem,
    cp_sweep_cases,
    deterministic_sweep_cases,
    mla_sweep_problems,
    paper_problems,
    rank_heads,
    tp_sweep_problems,
    verification_sweep_cases,
)
from lean_tp.tools.simulate.tables import (
    cp_row,
    deterministic_table_rows,
    format_cp_table,
    format_deterministic_report,
    format_mla_summary,
    format_mla_table,
    format_table,
    format_tp_table,
    row_of,
    table_rows_parallel,
    verification_table_rows,
)


def _ensure_schedule_backend(argv: list[str]) -> None:
    """The schedule kernel needs CUDA or the interpreter, chosen before lean_tp's kernels are defined."""
    if torch.cuda.is_available() or interpreted(lean_schedule_kernel):
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("simulate: TRITON_INTERPRET=1 is set but lean_tp's kernels were defined without it")
    os.execve(
        sys.executable, [sys.executable, "-m", "lean_tp.tools.simulate", *argv], os.environ | {"TRITON_INTERPRET": "1"}
    )


def _parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m lean_tp.tools.simulate",
        description="Decode simulator: LeanAttention against fixed-split kernels, in modelled time.",
    )
    p.add_argument(
        "--gpu",
        nargs="+",
        default=list(DEFAULT_GPUS),
        type=cli.choice(*GPUS),
        help=f"GPUs to model ({' '.join(DEFAULT_GPUS)}; also {' '.join(g for g in GPUS if g not in DEFAULT_GPUS)})",
    )
    # The one-problem flags default to None, so that a sweep can tell that one was given (and refuse it).
    p.add_argument("--batch", type=cli.integer(1, MAX_BATCH), help="sequences, when --lens is one length (4)")
    p.add_argument("--heads", type=cli.integer(1, MAX_HEADS), help="query heads (with --tp: of the whole model) (32)")
    p.add_argument("--kv-heads", type=cli.integer(1, MAX_HEADS), help="KV heads (with --tp: of the whole model) (8)")
    p.add_argument("--model", type=cli.choice(*MODEL_PRESETS), help="head counts and head_dim of a preset model")
    p.add_argument(
        "--tp",
        type=cli.integer(1, MAX_HEADS),
        help="tensor-parallel size: simulate one rank's heads (1; 8 with --tp-sweep)",
    )
    p.add_argument(
        "--lens",
        type=cli.integer_list(0, MAX_LEN),
        help="one length for every sequence, or a comma list (ragged) (16384)",
    )
    p.add_argument(
        "--capacity",
        type=cli.integer(0, MAX_LEN),
        help="KV cache capacity fixed-split kernels size splits from (0: the longest length)",
    )
    p.add_argument("--head-dim", type=cli.integer(1, 1024), help="(128)")
    p.add_argument(
        "--programs-per-sm", type=cli.integer(1, 64), help="lean grid = SMs x this (default: the tuning table's cap)"
    )
    p.add_argument("--paper", action="store_true", help="the paper's shapes instead of one problem")
    p.add_argument(
        "--tp-sweep", action="store_true", help="every preset at --tp (default 8), batch 1-64, context 1k-1M"
    )
    p.add_argument(
        "--mla-sweep",
        action="store_true",
        help="DeepSeek-V3's MLA decode at TP 8 and 1, 16-bit and fp8 latent caches, against FlashMLA and "
        "vLLM's Triton MLA",
    )
    p.add_argument(
        "--cp-sweep",
        action="store_true",
        help="every preset on 8 and 16 GPUs, TP alone against TP x CP: KV memory and attention time per rank",
    )
    p.add_argument(
        "--deterministic-sweep",
        action="store_true",
        help="lean's batch-invariant mode against vLLM's and SGLang's deterministic modes (TP-8 rank, paper)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        type=cli.output_file,
        help="also write the rows as JSON to PATH ('-': stdout, no table)",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        type=cli.output_file,
        help="a Gantt chart (one problem, first --gpu) or the sweep's speedups",
    )
    return p


# The flags that each run a sweep instead of one problem (at most one at a time).
SWEEP_FLAGS = ("--paper", "--tp-sweep", "--mla-sweep", "--cp-sweep", "--deterministic-sweep")


def _sweeps(args) -> list[str]:
    """The sweep flags given (``_check_flags`` allows one)."""
    return [flag for flag in SWEEP_FLAGS if getattr(args, flag[2:].replace("-", "_"))]


# The flags that describe one problem, with their defaults.
ONE_PROBLEM_DEFAULTS = {"batch": 4, "heads": 32, "kv_heads": 8, "lens": [16384], "capacity": 0, "head_dim": 128}


def _check_flags(p: cli.ArgumentParser, args) -> None:
    """Rules across flags: every flag given must be used (one-problem flags mean nothing to the
    sweeps, --tp nothing to --paper or --cp-sweep), and --batch must agree with a list of lengths."""
    if args.plot == "-":
        p.fail("--plot", "a PNG file path", args.plot)
    modes = _sweeps(args)
    if len(modes) > 1:
        p.fail(modes[1], f"one of {', '.join(SWEEP_FLAGS)} (not with {modes[0]})", True)
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


def _sweep_rows(args) -> list[dict]:
    """The rows of the sweep ``args`` asks for (``--cp-sweep``, ``--tp-sweep``, ``--mla-sweep``,
    ``--paper`` or ``--deterministic-sweep``), each with its cases' labels."""
    if args.cp_sweep:
        cases = cp_sweep_cases()
        rows = table_rows_parallel([c[-1] for c in cases], args.gpu, args.programs_per_sm)
        rows = [cp_row(c, r, GPUS[r["gpu"]]) for c, r in zip((c for c in cases for _ in args.gpu), rows)]
    elif args.tp_sweep:
        cases = tp_sweep_problems(args.tp)
        rows = table_rows_parallel([c[3] for c in cases], args.gpu, args.programs_per_sm)
        rows = [
            {"model": c[0], "tp": args.tp, "batch": c[1], "context": c[2], **r}
            for c, r in zip((c for c in cases for _ in args.gpu), rows)
        ]
    elif args.mla_sweep:
        cases = mla_sweep_problems()
        rows = table_rows_parallel([c[4] for c in cases], args.gpu, args.programs_per_sm)
        rows = [
            {"model": c[0], "parallel": c[1], "heads": c[4].n_heads, "cache": "fp8" if c[4].elem_size == 1 else "bf16",
             "tq": c[4].num_tokens, "batch": c[2], "context": c[3], **r}
            for c, r in zip((c for c in cases for _ in args.gpu), rows)
        ]  # fmt: skip
    elif args.paper:
        rows = table_rows_parallel(paper_problems(), args.gpu, args.programs_per_sm)
    else:  # --deterministic-sweep
        cases = deterministic_sweep_cases()
        rows = table_rows_parallel(
            [c[3] for c in cases], args.gpu, args.programs_per_sm, rows_of=deterministic_table_rows
        )
        rows = [
            {"table": "engines", "shapes": c[0], "batch": c[1], "context": c[2], **r}
            for c, r in zip((c for c in cases for _ in args.gpu), rows)
        ]
        verify = verification_sweep_cases()
        verified = table_rows_parallel(
            [c[4] for c in verify], args.gpu, args.programs_per_sm, rows_of=verification_table_rows
        )
        rows += [
            {"table": "verification", "shapes": c[0], "tq": c[1], "batch": c[2], "context": c[3], **r}
            for c, r in zip((c for c in verify for _ in args.gpu), verified)
        ]
    return rows


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
        flag = {
            "--tp": "--tp",
            "lens": "--lens",
            "n_heads": "--heads",
            "capacity": "--capacity",
            "head_dim": "--head-dim",
        }
        p.error(f"argument {flag[name]}: {rest}" if name in flag else str(e))
    _ensure_schedule_backend(argv)
    if _sweeps(args):
        rows = _sweep_rows(args)
    else:
        print(
            f"simulating on {', '.join(args.gpu)} (the schedule kernel runs in the Triton interpreter on CPU: "
            "~10 s per GPU) ...",
            file=sys.stderr,
            flush=True,
        )
        results = {name: simulate(problem, GPUS[name], args.programs_per_sm) for name in args.gpu}
        rows = [row_of(problem, GPUS[name], result) for name, result in results.items()]
    if args.json:
        text = json.dumps(
            {
                "model": {g: dataclasses.asdict(GPUS[g]) for g in args.gpu},
                "sources": MODEL_SOURCES,
                **({"links": {g: LINKS[g] for g in args.gpu}, "link_sources": LINK_SOURCES} if args.cp_sweep else {}),
                **(
                    {"engine_versions": ENGINE_VERSIONS, "engine_constants": ENGINE_CONSTANTS}
                    if args.deterministic_sweep
                    else {}
                ),
                **({"mla_peer_constants": MLA_PEER_CONSTANTS} if args.mla_sweep else {}),
                "rows": rows,
            },
            indent=1,
            default=dataclasses.asdict,
        )
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        tables = {
            "cp_sweep": format_cp_table,
            "tp_sweep": format_tp_table,
            "mla_sweep": lambda rows: format_mla_table(rows) + "\n\n" + format_mla_summary(rows),
            "deterministic_sweep": format_deterministic_report,
        }
        table = next((t for mode, t in tables.items() if getattr(args, mode)), format_table)
        print(table(rows))
    if args.plot:
        if args.cp_sweep:
            plot_cp_sweep(rows, args.plot)
        elif args.tp_sweep:
            plot_sweep(rows, args.plot)
        elif args.mla_sweep:
            plot_mla_sweep(rows, args.plot)
        elif args.deterministic_sweep:
            plot_deterministic_sweep(rows, args.plot)
        else:
            plot_gantt(problem, GPUS[args.gpu[0]], results[args.gpu[0]], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
