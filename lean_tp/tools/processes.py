"""A process pool with a progress bar, for the tools' CPU-bound work."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

from lean_tp.cli import progress as progress_bar


def map_in_processes(
    fn: Callable[..., Any],
    jobs: Sequence[tuple],
    desc: str,
    unit: str,
    workers: int | None = None,
    progress: bool = True,
) -> list[Any]:
    """``[fn(*job) for job in jobs]``, one process per core, with a progress bar as jobs finish.

    For CPU-bound single-threaded work (Triton compiles, interpreted kernels). Workers are spawned,
    so they import afresh and inherit the environment as it is at the call (``TRITON_INTERPRET``).
    """
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers or os.cpu_count(), mp_context=ctx) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        for _ in progress_bar(
            concurrent.futures.as_completed(futures), total=len(futures), desc=desc, unit=unit, disable=not progress
        ):
            pass
        return [f.result() for f in futures]
