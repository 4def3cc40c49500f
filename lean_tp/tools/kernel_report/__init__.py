"""What ``decode_attention_fwd_kernel`` compiles to for every tuning-table entry, read on CPU.

    python -m lean_tp.tools.kernel_report            # markdown table (docs/kernel_report.md)
    python -m lean_tp.tools.kernel_report --json     # one object per kernel, for machines
    python -m lean_tp.tools.kernel_report --set block_n=128   # a trial: every entry with a field changed
    python -m lean_tp.tools.kernel_report --only arch=sm90 --only features=tq4   # a few kernels, quickly

Each kernel is compiled for sm_80 or sm_90 exactly as a launch would specialize it
(``grid.compile_as_launched``), with a GQA group of 4. Read from the cubin and PTX:

- ``regs``, ``spill_bytes`` (the stack frame; Triton kernels make no calls, so it holds spills),
  ``shared_bytes`` (dynamic + static); ``loop_spills``: local-memory loads and stores (``LDL``,
  ``STL``) inside the K/V loop. ptxas spills a few cold values (read once per segment or once per
  program) when that reaches the next occupancy step (e.g. 128 registers: 2 programs of 8 warps);
  a spill inside the loop would cost on every K/V block;
- ``programs_per_sm`` on an A100 (sm_80) or H100 (sm_90), from ``grid.programs_per_sm``;
- ``k_load_bytes``, ``v_load_bytes``: width of the K and of the V global loads, the most frequent
  width among the ``cp.async`` copies of K's and of V's commit groups (the kernel loads each block's
  K, then its V: the groups alternate; 4-byte copies are page ids), or among ``ld.global`` data
  loads for both when nothing is copied asynchronously;
- ``kv_buffers``: K/V tiles the shared memory holds per operand (2 or more: multi-buffered; the
  pipeliner's (buffers, BLOCK_N, BLOCK_D) allocations in the TTGIR, which an fp8 kernel's staged
  16-bit tiles do not change), and
  ``wait_group``: the most ``cp.async`` groups left in flight while computing (0: none);
- ``sass_per_iter``: SASS instructions in one iteration of the K/V loop (BLOCK_N keys), read from
  ``cuobjdump -sass``: the innermost loop holding the most multiply-accumulates (``HMMA``, or
  ``FFMA`` for fp32's "ieee" dots);
- ``page_id_loads``, ``page_ids_read_same_iter``: block-table loads (32-bit ``LDG.E``, or 4-byte
  ``LDGSTS.E`` copies a stage ahead) of one thread in one K/V-loop iteration, and how many of them
  the same iteration reads (each such read waits for a global load; ``page_id_timing``);
- ``merge_wave``: partials the merge loads per loop iteration (``WAVE``; ``SLICE_WAVE`` column slices
  where the batch-invariant folds are sliced), ``merge_sass_per_wave`` and
  ``merge_loads_per_wave``: SASS instructions and L2 (``.cg``) loads of one iteration of the merge
  loop, which merges one wave; SASS per contributor is their ratio to ``merge_wave``.

No GPU is needed: ``ptxas`` and ``cuobjdump`` come with Triton.
"""

from lean_tp.tools.kernel_report.cli import main
from lean_tp.tools.kernel_report.report import (
    FEATURES,
    INVARIANT_BASE,
    LAYOUTS,
    OTHER_ARCHS,
    REPORT_ARCHS,
    REPORT_GROUP,
    KernelStats,
    arch_jobs,
    arch_markdown,
    arch_row_start,
    compile_stats,
    only_field,
    report_group,
    report_jobs,
    run_report,
    sample_jobs,
    select_jobs,
    to_markdown,
)
from lean_tp.tools.kernel_report.sass import kv_loop_of_sass, merge_loop_of_sass, page_id_timing

__all__ = [
    "FEATURES",
    "INVARIANT_BASE",
    "LAYOUTS",
    "OTHER_ARCHS",
    "REPORT_ARCHS",
    "REPORT_GROUP",
    "KernelStats",
    "arch_jobs",
    "arch_markdown",
    "arch_row_start",
    "compile_stats",
    "kv_loop_of_sass",
    "main",
    "merge_loop_of_sass",
    "only_field",
    "page_id_timing",
    "report_group",
    "report_jobs",
    "run_report",
    "sample_jobs",
    "select_jobs",
    "to_markdown",
]
