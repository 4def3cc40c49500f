"""The kernel report's command line (``python -m lean_tp.tools.kernel_report``)."""

from __future__ import annotations

import json
from collections.abc import Callable

from lean_tp import cli
from lean_tp.ops.decode_attention.tuning import config_override
from lean_tp.tools.kernel_report.report import (
    arch_jobs,
    arch_markdown,
    only_field,
    report_jobs,
    run_report,
    sample_jobs,
    select_jobs,
    to_markdown,
)


def _parse_items(p: cli.ArgumentParser, flag: str, items: list[str], parse: Callable[[str], tuple]) -> tuple:
    """Each of a repeated ``FIELD=VALUE`` flag's items through ``parse``; one line naming the flag
    for the first it refuses."""
    parsed = []
    for item in items:
        try:
            parsed.append(parse(item))
        except ValueError as exc:
            p.fail(flag, str(exc), item)
    return tuple(parsed)


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(
        prog="python -m lean_tp.tools.kernel_report",
        description="What decode_attention_fwd_kernel compiles to for every tuning-table entry, read on CPU.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per kernel instead of markdown")
    p.add_argument("--variants", action="store_true", help="also compile bf16, other groups and left padding")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="trial: replace a tuning-table field (e.g. block_n=128) in every entry",
    )
    p.add_argument(
        "--sample",
        action="store_true",
        help="each feature and variant on one head dim per arch, not on every entry (the CPU tests); with --archs: "
        "paged16 and fp32 rows alone, the batch-invariant variant on one head dim a part (CI's check)",
    )
    p.add_argument(
        "--archs",
        action="store_true",
        help="the architectures beyond sm_80 and sm_90 (sm_86, sm_89, sm_100, sm_120), each against its limits",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="compile only the kernels whose field reads VALUE (arch, head_dim, dtype, layout, group, features; "
        "e.g. --only arch=sm90 --only features=tq4): a quick look before regenerating the report",
    )
    p.add_argument(
        "--workers", type=cli.integer(1, 256), default=None, help="parallel compiles (default: one per core)"
    )
    args = p.parse_args(argv)
    only = _parse_items(p, "--only", args.only, only_field)
    overrides = _parse_items(p, "--set", args.set, config_override)
    if args.archs:
        rows = run_report(select_jobs(arch_jobs(sample=args.sample, overrides=overrides), only), args.workers)
        print(json.dumps([r.as_json() for r in rows], indent=1) if args.json else arch_markdown(rows), end="")
        return 0
    jobs = report_jobs(args.variants, overrides)
    rows = run_report(select_jobs(sample_jobs(jobs) if args.sample else jobs, only), args.workers)
    if args.json:
        print(json.dumps([r.as_json() for r in rows], indent=1))
    else:
        print(to_markdown([r for r in rows if not r.leftpad and r.dtype != "bf16"]), end="")
    return 0
