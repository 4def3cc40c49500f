"""MLA decode's peers, in modelled time: FlashMLA, FlashInfer's Hopper MLA, vLLM's and SGLang's
Triton MLA, each constant with its source (``MLA_PEER_CONSTANTS``).

Each peer's CTAs read their key ranges through the simulator's memory model (``_cta_schedule``,
re-reads credited to the L2 by ``l2.hbm_share``), no faster than their SM's tensor cores compute
their tile's rows (``compute_roof``: what binds under DP attention's 128 heads), and each merges
its split outputs as its code does: a chain of dependent L2 loads in one CTA per output
(``_serial_reduce``), after a second launch or, for FlashInfer, after a grid barrier inside its
persistent kernel.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch
import triton

from lean_tp.ops.decode_attention.archs import ARCHS
from lean_tp.ops.decode_attention.launch_args import token_lengths
from lean_tp.tools.gpus import GPUModel
from lean_tp.tools.simulate.problems import Problem
from lean_tp.tools.simulate.schedules import (
    Schedule,
    _cta_schedule,
    _merge_level_us,
    _serial_reduce,
    compute_roof,
    partial_bytes,
)

# FlashMLA (deepseek-ai/FlashMLA 9241ae3): its scheduler (csrc/smxx/decode/get_decoding_sched_meta/
# get_decoding_sched_meta.cu, one CTA of 32 threads, run once a step and reused by every layer:
# csrc/api/dense_decode.h) gives num_sm_parts = SMs / Hkv / ceil(Tq x heads / 64) parts, each
# ceil(total / parts) + 5 blocks of 64 keys, 5 blocks of overhead a request or piece. The decode
# kernel (csrc/sm90/decode/dense/, sm_90a only) runs a CTA per (64-row block, KV head, part). Its
# combine kernel (csrc/smxx/decode/combine/combine.cu), launched programmatically dependent on the
# decode kernel, has a warp per head and 8 heads a CTA; a warp loads every split's lse at once,
# then one split's 512 fp32 at a time (``#pragma unroll 1``, the next split loaded after this
# one's sums): 1 + splits dependent L2 loads.
FLASHMLA_BLOCK_M, FLASHMLA_BLOCK_N, FLASHMLA_OVERHEAD = 64, 64, 5
# FlashMLA's compute-bound rate, as its README publishes it: up to 660 TFLOP/s on an H800 SXM5
# (the H100 SXM's 132 SMs and clocks), taken for every sm_90 part. Elsewhere its schedule stands
# in for the part's own MLA kernel (its dense decode is sm_90's only), at the part's peak.
FLASHMLA_SM90_TFLOPS = 660.0
FLASHMLA_COMBINE_HEADS, FLASHMLA_COMBINE_IN_FLIGHT = 8, 1
# vLLM's Triton MLA (vllm 0.33.0 vllm/v1/attention/backends/mla/triton_mla.py and
# vllm/v1/attention/ops/triton_decode_attention.py): 16 query heads a CTA; the batch's longest
# length over 512 tokens a split, rounded up to a power of two, at most 2 per SM; draft tokens
# run as rows of their own lengths; the stage-2 reduce (grid (rows, heads), num_stages=2) always
# follows and loads a split's partial a step ahead.
TRITON_MLA_BLOCK_H, TRITON_MLA_MIN_SPLIT, TRITON_MLA_SPLITS_PER_SM, TRITON_MLA_REDUCE_IN_FLIGHT = 16, 512, 2, 2
# SGLang's Triton MLA (sglang 0.5.23 srt/layers/attention/triton_backend.py, kernels/ops/attention/
# metadata.py and decode_attention.py): at most max(8, min(next_pow2(SMs), next_pow2(context_len /
# 32))) splits (_mla_decode_kv_splits_cap); per request get_num_kv_splits_triton's two rules;
# a split ceil(len / splits) rounded up to 32 keys; 16 heads a CTA; stage 2 a tl.range(num_stages=2)
# loop per (row, head). With an e4m3 cache its dots take e4m3 operands, at twice the 16-bit rate
# (dense FP8 against BF16 tensor peaks: H100 whitepaper, 1979 against 989.4 TFLOP/s).
SGLANG_MLA_BASE_SPLITS, SGLANG_MLA_MIN_BLOCK_KV, SGLANG_MLA_BLOCK_H, SGLANG_MLA_REDUCE_IN_FLIGHT = 8, 32, 16, 2
SGLANG_MLA_FP8_DOT_SPEEDUP = 2
# FlashInfer's Hopper MLA (flashinfer 0.6.18 include/flashinfer/attention/mla_hopper.cuh and
# scheduler.cuh MLAPlan): a persistent cooperative grid of SMs CTAs of 64 rows x 64 keys, in
# clusters of 2 CTAs (the same keys, 64 rows each) when a request packs more than 64 rows; KV
# chunks of kv_len_limit keys given to the least-loaded cluster (cost 2 x rows + keys); split
# rows merged in the same kernel after a grid barrier (mla.cuh DevicePersistentMergeStates: 4
# rows a CTA at a time, 8 partials in flight, bf16 partials).
FLASHINFER_MLA_TILE_Q, FLASHINFER_MLA_MERGE_ROWS, FLASHINFER_MLA_MERGE_IN_FLIGHT = 64, 4, 8

# The context length SGLang's split cap reads (the model's max_position_embeddings): Kimi-K2's
# 131072 and DeepSeek-V3's 163840 both put the cap at next_pow2(SMs) on the modelled GPUs.
SGLANG_MLA_CONTEXT_LEN = 131072

MLA_PEERS = ("flashmla", "flashinfer_mla", "triton_mla", "sglang_mla")


def mla_peer_takes(peer: str, problem: Problem, gpu: GPUModel) -> bool:
    """Whether ``peer``'s code takes ``problem``'s latent cache on ``gpu`` (its rows of
    ``MLA_PEER_CONSTANTS`` give the sources). A 16-bit cache: every peer. An e4m3 cache: never
    FlashMLA's dense decode (the cache must be q's dtype; its fp8 layout is sparse decode's);
    FlashInfer's MLA on sm_90 only; vLLM's and SGLang's Triton MLA where Triton compiles its
    fp8e4nv type, sm_89 and later (``Arch.native_e4m3``; vLLM refuses the cache before that)."""
    if problem.elem_size != 1:
        return True
    return {
        "flashmla": False,
        "flashinfer_mla": gpu.arch == "sm90",
        "triton_mla": ARCHS[gpu.arch].native_e4m3,
        "sglang_mla": ARCHS[gpu.arch].native_e4m3,
    }[peer]


# (peer, constant, value, source) for the docs and the JSON.
MLA_PEER_CONSTANTS = [
    ("FlashMLA", "rows, keys a block; overhead blocks a piece", "64, 64; 5",
     "deepseek-ai/FlashMLA csrc/sm90/decode/dense/config.h, csrc/api/dense_decode.h (fixed_overhead_num_blocks)"),
    ("FlashMLA", "num_sm_parts", "SMs / Hkv / ceil(Tq x heads / 64)", "csrc/api/dense_decode.h"),
    ("FlashMLA", "scheduler kernel", "1 CTA x 32 threads, once a step (every layer reuses it): not charged",
     "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu, csrc/api/dense_decode.h"),
    ("FlashMLA", "combine: heads a CTA; splits in flight a head", "8; 1 (1 + splits dependent L2 loads)",
     "csrc/smxx/decode/combine/combine.cu (a warp a head, #pragma unroll 1 over splits, PDL)"),
    ("FlashMLA", "latent caches (dense decode)", "q's dtype, bf16 or fp16; no e4m3 (its fp8 cache is sparse decode's)",
     "csrc/api/dense_decode.h (kcache.dtype() == q_dtype), flash_mla/flash_mla_interface.py (is_fp8_kvcache)"),
    ("FlashMLA", "compute rate", "660 TFLOP/s on sm_90 (H800 SXM5, as published); elsewhere the part's peak",
     "README (Performance Update 2025.04.22)"),
    ("every peer", "compute rate", "the GPU's dense 16-bit tensor peak (FlashMLA: its own), for its tile's rows, padding included",
     "lean_tp/tools/gpus.py MODEL_SOURCES (tensor_tflops)"),
    ("FlashInfer MLA", "CTA tile; cluster", "64 rows x 64 keys; 2 CTAs when a request packs > 64 rows",
     "flashinfer 0.6.18 include/flashinfer/attention/mla_hopper.cuh, scheduler.cuh (MLAPlan)"),
    ("FlashInfer MLA", "kv_len_limit", "f(ceil(sum of keys x q tiles / clusters)): 32, 64, 128, 192, else 256s",
     "scheduler.cuh (MLAPlan), cost 2 x rows + keys (cost_function)"),
    ("FlashInfer MLA", "merge", "in-kernel after a grid barrier; 4 rows a CTA, 8 partials in flight, bf16",
     "mla.cuh (DevicePersistentMergeStates), mla_hopper.cuh (grid.sync)"),
    ("FlashInfer MLA", "e4m3 latent cache", "sm_90 only (fa2 and fa3 backends), repacked to bf16 in shared memory",
     "flashinfer/mla/_core.py (_SUPPORTED_MLA_KV_DTYPES and its SM90 check), mla_hopper.cuh (repack_fp8_kv_to_bf16)"),
    ("vLLM Triton MLA", "heads a CTA; splits", "16; min(next_pow2(max(1, longest // 512)), 2 x SMs)",
     "vllm 0.33.0 vllm/v1/attention/backends/mla/triton_mla.py, vllm/v1/attention/ops/triton_decode_attention.py"),
    ("vLLM Triton MLA", "stage 2: splits in flight", "2 (always launched)", "triton_decode_attention.py (_fwd_kernel_stage2)"),
    ("vLLM Triton MLA", "e4m3 latent cache", "sm_89 and later (ValueError before); dequantized to q's dtype on load",
     "triton_mla.py (supported_kv_cache_dtypes, its SM89 check), triton_decode_attention.py (k.dtype.is_fp8())"),
    ("SGLang Triton MLA", "split cap", "max(8, min(next_pow2(SMs), next_pow2(context_len / 32)))",
     "sglang 0.5.23 srt/layers/attention/triton_backend.py (_mla_decode_kv_splits_cap)"),
    ("SGLang Triton MLA", "splits a request", "get_num_kv_splits_triton; splits of ceil(len / n) rounded to 32",
     "kernels/ops/attention/metadata.py, decode_attention.py"),
    ("SGLang Triton MLA", "stage 2: splits in flight", "2 (always launched)", "decode_attention.py (_fwd_kernel_stage2)"),
    ("SGLang Triton MLA", "e4m3 latent cache", "Triton's fp8e4nv, compiled from sm_89; q and P cast to e4m3 for the dots",
     "decode_attention.py (q.to(K_Buffer.dtype.element_ty)); triton backends/nvidia/compiler.py (supported_fp8_dtypes)"),
    ("SGLang Triton MLA", "e4m3 compute rate", "2x the 16-bit peak (e4m3 dots)",
     "H100 whitepaper: dense FP8 1979, BF16 989.4 TFLOP/s"),
]  # fmt: skip


def _rows(problem: Problem) -> int:
    """Query rows a request packs on its KV head: Tq x the heads of the KV head."""
    return problem.num_tokens * (problem.n_heads // problem.n_kv_heads)


def _token_rows(problem: Problem) -> list[tuple[int, int]]:
    """(request, keys) of each query token as a row of its own: token t of a Tq-token request sees
    its keys up to its own (the Triton kernels' draft rows; ``launch_args.token_lengths``)."""
    lens = token_lengths(torch.tensor(problem.lens, dtype=torch.int32), problem.num_tokens).tolist()
    return [(i // problem.num_tokens, n) for i, n in enumerate(lens)]


def flashmla_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """FlashMLA's split-KV plan (``FLASHMLA_*``): parts of ``ceil(total / parts) + 5`` blocks of
    the requests in order, a request cut where a part's budget ends; a CTA per (64-row block, KV
    head, part); then the combine's chain for split requests."""
    m_blocks = math.ceil(_rows(problem) / FLASHMLA_BLOCK_M)
    parts = max(gpu.sms // problem.n_kv_heads // m_blocks, 1)
    blocks = [max(1, math.ceil(n / FLASHMLA_BLOCK_N)) for n in problem.lens]
    payload = math.ceil(sum(b + FLASHMLA_OVERHEAD for b in blocks) / parts) + FLASHMLA_OVERHEAD
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]  # per part: (request, first, end block)
    part, budget, req, first = 0, payload, 0, 0
    while req < len(blocks) and part < parts:
        left = blocks[req] - first
        if budget >= left + FLASHMLA_OVERHEAD:
            pieces[part].append((req, first, blocks[req]))
            budget -= left + FLASHMLA_OVERHEAD
            req, first = req + 1, 0
            continue
        if budget - FLASHMLA_OVERHEAD > 0:
            pieces[part].append((req, first, first + budget - FLASHMLA_OVERHEAD))
            first += budget - FLASHMLA_OVERHEAD
        part, budget = part + 1, payload
    split = [0] * len(blocks)
    for own in pieces:
        for r, _, _ in own:
            split[r] += 1
    keys = lambda r, b0, b1: max(0, min(problem.lens[r], b1 * FLASHMLA_BLOCK_N) - b0 * FLASHMLA_BLOCK_N)  # noqa: E731
    ctas = [
        (sum(keys(r, b0, b1) for r, b0, b1 in pieces[p]), h, [(r, h, b0 * FLASHMLA_BLOCK_N, keys(r, b0, b1)) for r, b0, b1 in pieces[p]])
        for p in range(parts)
        for h in range(problem.n_kv_heads)
        for _ in range(m_blocks)
    ]  # fmt: skip
    rows = _rows(problem)
    partials = sum(n for n in split if n > 1) * rows * problem.n_kv_heads  # the combine reads split requests' only
    roof = compute_roof(problem, gpu, FLASHMLA_BLOCK_M, FLASHMLA_SM90_TFLOPS if gpu.arch == "sm90" else None)
    sched = _cta_schedule("flashmla", problem, gpu, ctas, max(split, default=1), partials, programs_per_sm, roof)
    heads = min(FLASHMLA_COMBINE_HEADS, rows)
    # Launched programmatically dependent: the decode kernel's end is one L2 round trip away.
    return _serial_reduce(sched, max(split, default=1), FLASHMLA_COMBINE_IN_FLIGHT,
                          heads * partial_bytes(problem, 4), gpu, gap_us=gpu.l2_latency_us)  # fmt: skip


def triton_mla_splits(problem: Problem, gpu: GPUModel) -> int:
    """vLLM's Triton MLA split count: one for the whole batch, from its longest sequence."""
    return triton_mla_split_count(max(problem.lens), gpu.sms)


def triton_mla_split_count(longest: int, sms: int) -> int:
    """vLLM's Triton MLA split count for a batch whose longest sequence has ``longest`` keys on a
    GPU of ``sms`` SMs (``_compute_num_kv_splits`` in its backend)."""
    return min(triton.next_power_of_2(max(1, longest // TRITON_MLA_MIN_SPLIT)), sms * TRITON_MLA_SPLITS_PER_SM)


def triton_mla_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """vLLM's Triton MLA plan: CTAs (row, 16-head block, split), split s of a row reading its keys
    ``[s, s + 1) x ceil(len / splits)``, each head block reading the latent rows; the reduce
    kernel always follows (it runs with one split too), a chain of the splits per (row, head)."""
    splits = triton_mla_splits(problem, gpu)
    head_blocks = math.ceil(problem.n_heads / min(TRITON_MLA_BLOCK_H, problem.n_heads // problem.n_kv_heads))
    rows = _token_rows(problem)
    ctas = [
        (k1 - k0, b, [(b, 0, k0, k1 - k0)])
        for s in range(splits)
        for _ in range(head_blocks)
        for b, n in rows
        for per in (math.ceil(n / splits),)
        for k0, k1 in ((min(n, s * per), min(n, (s + 1) * per)),)
    ]
    partials, roof = len(rows) * splits * problem.n_heads, compute_roof(problem, gpu, TRITON_MLA_BLOCK_H)
    sched = _cta_schedule("triton_mla", problem, gpu, ctas, splits, partials, programs_per_sm, roof)
    return _serial_reduce(sched, splits, TRITON_MLA_REDUCE_IN_FLIGHT, partial_bytes(problem, 4), gpu)


def sglang_mla_splits(problem: Problem, gpu: GPUModel, context_len: int = SGLANG_MLA_CONTEXT_LEN) -> list[int]:
    """SGLang's Triton MLA splits of each row (``get_num_kv_splits_triton``, rows grouped by token)."""
    cap = max(
        SGLANG_MLA_BASE_SPLITS,
        min(triton.next_power_of_2(gpu.sms), triton.next_power_of_2(math.ceil(context_len / SGLANG_MLA_MIN_BLOCK_KV))),
    )
    longest, shortest = max(problem.lens), max(1, min(problem.lens))
    if longest * 8 < shortest * 10:
        shortest = longest
    chunk_1 = math.ceil(longest / min(math.ceil(longest / shortest), cap))
    spread = int(gpu.sms * max(math.log2(max(longest, 1) / 64), 1.0))
    grid = (
        len(problem.lens) * problem.num_tokens * math.ceil(problem.n_heads / min(SGLANG_MLA_BLOCK_H, problem.n_heads))
    )
    chunk_2 = math.ceil(longest / min(math.ceil(spread / grid), cap))
    return [max(math.ceil(n / chunk_1), math.ceil(n / chunk_2)) for _, n in _token_rows(problem)]


def sglang_mla_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """SGLang's Triton MLA plan: CTAs (row, 16-head block, split) in its grid order, split s of a
    row reading ``ceil(len / splits)`` keys rounded up to 32; stage 2 always follows."""
    splits = sglang_mla_splits(problem, gpu)
    head_blocks = math.ceil(problem.n_heads / min(SGLANG_MLA_BLOCK_H, problem.n_heads))
    rows = _token_rows(problem)
    most = max(splits, default=1)
    ctas = []
    for s in range(most):
        for _ in range(head_blocks):
            for (b, n), count in zip(rows, splits):
                per = math.ceil(math.ceil(n / count) / SGLANG_MLA_MIN_BLOCK_KV) * SGLANG_MLA_MIN_BLOCK_KV if n else 0
                k0, k1 = min(n, s * per), min(n, (s + 1) * per)
                if s < count:
                    ctas.append((k1 - k0, b, [(b, 0, k0, k1 - k0)]))
    speedup = SGLANG_MLA_FP8_DOT_SPEEDUP if problem.elem_size == 1 else 1
    roof = compute_roof(problem, gpu, SGLANG_MLA_BLOCK_H, speedup * gpu.tensor_tflops)
    sched = _cta_schedule("sglang_mla", problem, gpu, ctas, most, sum(splits) * problem.n_heads, programs_per_sm, roof)
    return _serial_reduce(sched, most, SGLANG_MLA_REDUCE_IN_FLIGHT, partial_bytes(problem, 4), gpu)


def _kv_len_limit(keys_per_cluster: int) -> int:
    """FlashInfer MLAPlan's chunk size for the average keys a cluster gets."""
    for most, limit in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if keys_per_cluster <= most:
            return limit
    return math.ceil(keys_per_cluster / 256) * 256


def flashinfer_mla_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """FlashInfer's Hopper MLA plan (``FLASHINFER_MLA_*``): chunks of each request's q tiles given
    to the least-loaded of ``SMs / cluster`` clusters, each CTA of a cluster 64 rows of the same
    chunks; split rows merged after a grid barrier, spread over the CTAs."""
    rows = _rows(problem)
    cluster = 2 if rows > FLASHINFER_MLA_TILE_Q else 1
    clusters, tile = gpu.sms // cluster, FLASHINFER_MLA_TILE_Q * cluster
    q_tiles = math.ceil(rows / tile)
    limit = _kv_len_limit(max(1, math.ceil(sum(problem.lens) * q_tiles * problem.n_kv_heads / clusters)))
    heap = [(0.0, c) for c in range(clusters)]
    work: list[list[tuple[int, int, int, int]]] = [[] for _ in range(clusters)]
    chunks = [0] * len(problem.lens)
    for b, n in enumerate(problem.lens):
        for _ in range(q_tiles):
            for k0 in range(0, max(n, 1), limit):
                for h in range(problem.n_kv_heads):
                    cost, c = heapq.heappop(heap)
                    heapq.heappush(heap, (cost + 2 * tile + min(limit, n - k0), c))
                    work[c].append((b, h, k0, max(0, min(limit, n - k0))))
            chunks[b] = math.ceil(n / limit) if n > limit else 1
    ctas = [(sum(p[3] for p in work[c]), c, work[c]) for c in range(clusters) for _ in range(cluster)]
    roof = compute_roof(problem, gpu, FLASHINFER_MLA_TILE_Q)
    sched = _cta_schedule("flashinfer_mla", problem, gpu, ctas, max(chunks), 0, programs_per_sm, roof)
    split_rows = sum(rows * problem.n_kv_heads for n in chunks if n > 1)
    if not split_rows:
        return sched
    # A grid barrier (an arrival and its release: two L2 round trips), then each CTA's share of the
    # split rows, 4 at a time, each a chain of its chunks' bf16 partials, 8 in flight.
    per_cta = math.ceil(split_rows / gpu.sms)
    steps = math.ceil(per_cta / FLASHINFER_MLA_MERGE_ROWS)
    merge = 2 * gpu.l2_latency_us + steps * _merge_level_us(
        max(chunks), FLASHINFER_MLA_MERGE_IN_FLIGHT, FLASHINFER_MLA_MERGE_ROWS * partial_bytes(problem, 2), gpu, False
    )
    return dataclasses.replace(sched, time_us=sched.time_us + merge, merge_us=merge)
