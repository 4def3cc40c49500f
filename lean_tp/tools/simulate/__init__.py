"""Decode simulator: LeanAttention's schedule and merge tree against fixed-split kernels and their
combine kernels, in modelled time on an A100, H100, B200 or L40S (A100 and H100 unless ``--gpu`` says).

    python -m lean_tp.tools.simulate --gpu A100 H100 B200 --batch 4 --heads 32 --kv-heads 8 --lens 65536
    python -m lean_tp.tools.simulate --model llama-3-70b --tp 8 --batch 1 --lens 32768    # one rank of TP=8
    python -m lean_tp.tools.simulate --tp-sweep --json sweep.json                         # every preset, B 1-64, 1k-1M
    python -m lean_tp.tools.simulate --cp-sweep --gpu H100                                # TP alone vs TP x CP
    python -m lean_tp.tools.simulate --mla-sweep                                          # DeepSeek-V3 MLA vs FlashMLA
    python -m lean_tp.tools.simulate --deterministic-sweep                                # invariant vs vLLM/SGLang's
    python -m lean_tp.tools.simulate --heads 32 --kv-heads 32 --lens 30000,2000,500,8000 --plot gantt.png

    problems.py   what is modelled: one step's problem, presets, sweeps
    schedules.py  lean's schedule in modelled time (the kernel's own schedule code), FA2's and Flex's
    mla.py        MLA decode's peers, each constant with its source
    methods.py    which methods a problem runs with (simulate)
    l2.py         which re-read rows the L2 serves
    deterministic.py  vLLM's and SGLang's deterministic decode modes, each constant with its source
    tables.py     rows and tables; plots.py: charts; cli.py: the command line
    ../gpus.py    the GPU and link constants, each with its source
"""

from lean_tp.tools.gpus import GPUS, LINKS, GPUModel, link_of
from lean_tp.tools.simulate.cli import main
from lean_tp.tools.simulate.deterministic import (
    ENGINE_CONSTANTS,
    ENGINE_VERSIONS,
    deterministic_schedules,
    sglang_flashinfer_schedule,
    sglang_triton_schedule,
    sglang_triton_splits,
    vllm_invariant_schedule,
)
from lean_tp.tools.simulate.methods import simulate
from lean_tp.tools.simulate.mla import (
    MLA_PEER_CONSTANTS,
    MLA_PEERS,
    flashinfer_mla_schedule,
    flashmla_schedule,
    mla_peer_takes,
    sglang_mla_schedule,
    sglang_mla_splits,
    triton_mla_schedule,
    triton_mla_split_count,
    triton_mla_splits,
)
from lean_tp.tools.simulate.problems import (
    MODEL_PRESETS,
    Problem,
    cp_layouts,
    cp_sweep_cases,
    deterministic_sweep_cases,
    mla_sweep_problems,
    rank_heads,
    verification_sweep_cases,
)
from lean_tp.tools.simulate.schedules import (
    Schedule,
    fa2_num_splits,
    fa2_splits,
    flex_splits,
)
from lean_tp.tools.simulate.tables import (
    cp_merge_us,
    cp_row,
    deterministic_table_rows,
    table_rows,
    table_rows_parallel,
    verification_table_rows,
)

__all__ = [
    "ENGINE_CONSTANTS",
    "ENGINE_VERSIONS",
    "GPUModel",
    "GPUS",
    "LINKS",
    "MLA_PEERS",
    "MLA_PEER_CONSTANTS",
    "MODEL_PRESETS",
    "Problem",
    "Schedule",
    "cp_layouts",
    "cp_merge_us",
    "cp_row",
    "cp_sweep_cases",
    "deterministic_schedules",
    "deterministic_sweep_cases",
    "deterministic_table_rows",
    "fa2_num_splits",
    "fa2_splits",
    "flashinfer_mla_schedule",
    "flashmla_schedule",
    "flex_splits",
    "link_of",
    "main",
    "mla_peer_takes",
    "mla_sweep_problems",
    "rank_heads",
    "sglang_flashinfer_schedule",
    "sglang_mla_schedule",
    "sglang_mla_splits",
    "sglang_triton_schedule",
    "sglang_triton_splits",
    "simulate",
    "table_rows",
    "table_rows_parallel",
    "triton_mla_schedule",
    "triton_mla_split_count",
    "triton_mla_splits",
    "verification_sweep_cases",
    "verification_table_rows",
    "vllm_invariant_schedule",
]
