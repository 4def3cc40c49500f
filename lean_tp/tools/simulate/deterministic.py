"""The inference engines' deterministic (batch-invariant) decode modes, in modelled time, beside lean's
batch-invariant mode (``python -m lean_tp.tools.simulate --deterministic-sweep``).

- **vllm**: ``VLLM_BATCH_INVARIANT=1``. Its backends for standard attention on A100 and H100
  (FlashAttention 2/3, Triton unified attention) then never split the KV: one CTA per (sequence,
  KV head, its query heads packed) over the whole sequence, and no combine kernel. SGLang's own
  default in ``--enable-deterministic-inference`` on A100 and H100 (its ``fa3`` backend with
  ``num_splits=1``) has the same schedule, as has SGLang's FlashInfer backend inside a CUDA graph.
- **sglang_flashinfer**: SGLang's FlashInfer backend outside a CUDA graph: fixed 2048-token splits
  per request (FlashInfer's tensor-core decode, which runs its prefill scheduler); a merge kernel
  whenever any request has more than one split.
- **sglang_triton**: SGLang's Triton backend: ``ceil(len / 256)`` splits per request, each a CTA
  per (sequence, KV head, split); the stage-2 reduce kernel always follows, one CTA per (sequence,
  query head) folding that request's splits in order.

Every engine mode gets the simulator's memory model and CTA dispatch (``_cta_schedule``). A
reduce that folds many partials in one CTA is also bounded by that CTA's chain of dependent loads
(``_serial_reduce``): SGLang's Triton splits reach thousands per request at long context.
"""

from __future__ import annotations

import math

from lean_tp.tools.gpus import GPUModel
from lean_tp.tools.simulate.problems import Problem
from lean_tp.tools.simulate.schedules import Schedule, _cta_schedule, _serial_reduce, lean_sim_schedule, partial_bytes

# The engine versions read: vLLM 0.33.0, SGLang 0.5.23 (which pins FlashInfer 0.7.2).
ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23", "flashinfer": "0.7.2"}

# SGLang's FlashInfer decode split in deterministic mode, in tokens (its pages are one token):
# SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE, default in python/sglang/srt/environ.py, passed as
# fixed_split_size in python/sglang/srt/layers/attention/flashinfer_backend.py. FlashInfer's
# PrefillSplitQOKVIndptr (include/flashinfer/attention/scheduler.cuh) makes it the KV chunk size:
# ceil(len / 2048) chunks per request, at least one.
SGLANG_FLASHINFER_SPLIT = 2048
# FlashInfer's merge (PersistentVariableLengthMergeStatesKernel, include/flashinfer/attention/
# cascade.cuh): 4 shared-memory stages of bdy = 8 partials (head_dim 128, 16-bit) in flight per CTA;
# its partials are the output dtype (16-bit) plus a float lse.
FLASHINFER_MERGE_IN_FLIGHT = 4 * 8
# SGLang's Triton decode split in deterministic mode: SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE
# (python/sglang/srt/environ.py; python/sglang/srt/layers/attention/triton_backend.py,
# get_num_kv_splits: num_kv_splits = ceil(len / 256), no cap).
SGLANG_TRITON_SPLIT = 256
# python/sglang/kernels/ops/attention/decode_attention.py: a split's length is ceil(len / splits)
# rounded up to _MIN_BLOCK_KV = 32 tokens; the grouped stage-1 kernel packs _GROUPED_BLOCK_H = 16
# query heads of one KV head a CTA; stage 2 (_fwd_kernel_stage2) loads fp32 partials in a
# tl.range(num_stages=2) loop, so at most 2 are in flight.
SGLANG_TRITON_MIN_BLOCK_KV, SGLANG_TRITON_BLOCK_H, SGLANG_TRITON_REDUCE_IN_FLIGHT = 32, 16, 2

# (constant, value, source) for the docs and the JSON.
ENGINE_CONSTANTS = [
    ("vLLM batch-invariant KV splits", 1,
     "vllm 0.33.0 vllm/v1/attention/backends/flash_attn.py (VLLM_BATCH_INVARIANT: max_num_splits = 1, "
     "AOT schedule off); vllm/v1/attention/ops/triton_unified_attention.py (is_batch_invariant: 2D kernel, "
     "grid (q blocks, KV heads), no 3D split kernel); vllm/v1/attention/backend.py (supports_batch_invariance "
     "False unless a backend overrides it: FlashInfer's does not)"),
    ("SGLang deterministic default backend on A100/H100: fa3, num_splits", 1,
     "sglang 0.5.23 python/sglang/srt/arg_groups/overrides.py (_deterministic_attention_backend), "
     "python/sglang/srt/layers/attention/flashattention_backend.py (num_splits = 1 if deterministic)"),
    ("SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE (tokens)", SGLANG_FLASHINFER_SPLIT,
     "sglang 0.5.23 python/sglang/srt/environ.py, layers/attention/flashinfer_backend.py (eager decode; "
     "inside a CUDA graph disable_split_kv=True: one split); flashinfer 0.7.2 scheduler.cuh"),
    ("FlashInfer merge: partials in flight per CTA", FLASHINFER_MERGE_IN_FLIGHT,
     "flashinfer 0.7.2 include/flashinfer/attention/cascade.cuh (num_smem_stages 4 x bdy 8)"),
    ("SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE (tokens)", SGLANG_TRITON_SPLIT,
     "sglang 0.5.23 python/sglang/srt/environ.py, layers/attention/triton_backend.py (get_num_kv_splits)"),
    ("SGLang Triton _MIN_BLOCK_KV, _GROUPED_BLOCK_H", f"{SGLANG_TRITON_MIN_BLOCK_KV}, {SGLANG_TRITON_BLOCK_H}",
     "sglang 0.5.23 python/sglang/kernels/ops/attention/decode_attention.py"),
    ("SGLang Triton stage 2: partials in flight", SGLANG_TRITON_REDUCE_IN_FLIGHT,
     "sglang 0.5.23 decode_attention.py (_fwd_kernel_stage2: tl.range(..., num_stages=2), grid (batch, heads))"),
]  # fmt: skip

ENGINE_MODES = ("vllm", "sglang_flashinfer", "sglang_triton")


def vllm_invariant_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """vLLM's batch-invariant decode: a CTA per (sequence, KV head) reading the whole sequence, its
    query heads packed as rows; nothing to combine."""
    ctas = [(n, b * problem.n_kv_heads + h) for b, n in enumerate(problem.lens) for h in range(problem.n_kv_heads)]
    return _cta_schedule("vllm", problem, gpu, ctas, 1, 0, programs_per_sm)


def sglang_flashinfer_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """SGLang's FlashInfer decode in deterministic mode (eager): chunks of ``SGLANG_FLASHINFER_SPLIT``
    tokens, a CTA per (chunk, KV head) in FlashInfer's grid order (chunks of all requests, then
    heads); when any request has two chunks or more, a merge of every request's partials follows."""
    split = SGLANG_FLASHINFER_SPLIT
    chunks = [max(1, math.ceil(n / split)) for n in problem.lens]
    ctas = [
        (max(0, min(n, (c + 1) * split) - c * split), b * problem.n_kv_heads + h)
        for h in range(problem.n_kv_heads)
        for b, n in enumerate(problem.lens)
        for c in range(chunks[b])
    ]
    split_kv = max(chunks) > 1
    partials = sum(chunks) * problem.n_heads if split_kv else 0
    sched = _cta_schedule("sglang_flashinfer", problem, gpu, ctas, max(chunks), partials, programs_per_sm)
    return _serial_reduce(
        sched, max(chunks), FLASHINFER_MERGE_IN_FLIGHT, partial_bytes(problem, problem.elem_size), gpu
    )


def sglang_triton_splits(length: int) -> tuple[int, int]:
    """(splits, tokens a split) of one request in SGLang's deterministic Triton decode."""
    splits = math.ceil(length / SGLANG_TRITON_SPLIT)
    per = (
        math.ceil(math.ceil(length / splits) / SGLANG_TRITON_MIN_BLOCK_KV) * SGLANG_TRITON_MIN_BLOCK_KV if splits else 0
    )
    return splits, per


def sglang_triton_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """SGLang's Triton decode in deterministic mode: stage 1 a CTA per (sequence, head tile, split),
    in its grid order (batch fastest, then head tiles, then splits); a head tile is up to 16 query
    heads of one KV head and reads that head's K/V. Stage 2 always follows."""
    group = problem.n_heads // problem.n_kv_heads
    tiles = math.ceil(group / min(SGLANG_TRITON_BLOCK_H, group))  # head tiles per KV head
    plan = [sglang_triton_splits(n) for n in problem.lens]
    most = max(s for s, _ in plan)
    ctas = [
        (max(0, min(n, (s + 1) * per) - s * per), b * problem.n_kv_heads + t // tiles)
        for s in range(most)
        for t in range(problem.n_kv_heads * tiles)
        for b, (n, (splits, per)) in enumerate(zip(problem.lens, plan))
        if s < splits
    ]
    partials = sum(s for s, _ in plan) * problem.n_heads
    sched = _cta_schedule("sglang_triton", problem, gpu, ctas, most, partials, programs_per_sm)
    return _serial_reduce(sched, most, SGLANG_TRITON_REDUCE_IN_FLIGHT, partial_bytes(problem, 4), gpu)


def deterministic_schedules(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> dict[str, Schedule]:
    """Lean (default and batch-invariant) and the engines' deterministic modes on one problem."""
    return {
        "lean": lean_sim_schedule(problem, gpu, programs_per_sm),
        "lean_invariant": lean_sim_schedule(problem, gpu, programs_per_sm, batch_invariant=True),
        "vllm": vllm_invariant_schedule(problem, gpu, programs_per_sm),
        "sglang_flashinfer": sglang_flashinfer_schedule(problem, gpu, programs_per_sm),
        "sglang_triton": sglang_triton_schedule(problem, gpu, programs_per_sm),
    }
