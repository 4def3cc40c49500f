"""The decode problems the simulator models: one step's lengths, head counts and head dim, the
tensor-parallel presets, and the sweeps' problem sets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lean_tp.ops.decode_attention.tuning import config_for

# A 16-bit cache is bf16, as served models keep it: fp16 plans the same kernels but for the Gluon
# MLA route, which takes bf16. An fp8 cache (element size 1) is read by a 16-bit q.
ELEM_DTYPES = {2: torch.bfloat16, 4: torch.float32}
FP8_CACHE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Problem:
    """One decode step: ``lens`` (B,) tokens per sequence, head counts, head_dim, cache capacity.
    ``head_dim_v`` below ``head_dim`` makes it MLA's: one latent row per token and KV head, V its
    first ``head_dim_v`` columns (read with K's); ``elem_size`` 1 is an fp8 cache with a 16-bit q."""

    lens: tuple[int, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int = 128
    capacity: int = 0  # 0 means max(lens): fixed-split kernels size their splits from this
    elem_size: int = 2
    head_dim_v: int = 0  # 0: head_dim
    num_tokens: int = 1  # query tokens per sequence (speculative verification), counted in lens

    def __post_init__(self) -> None:
        if not self.lens or min(self.lens) < 0:
            raise ValueError(f"lens: expected one or more lengths >= 0, got {self.lens}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads: expected a multiple of n_kv_heads={self.n_kv_heads}, got {self.n_heads}")
        if self.capacity and self.capacity < max(self.lens):
            raise ValueError(f"capacity: expected >= max(lens)={max(self.lens)}, got {self.capacity}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens: expected an int >= 1, got {self.num_tokens}")
        config_for("sm90", self.head_dim, *self.dtypes, self.head_dim_v or None)  # ValueError: no kernel

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype | None]:
        """(q's dtype, the cache's when it is not q's)."""
        return (torch.bfloat16, FP8_CACHE) if self.elem_size == 1 else (ELEM_DTYPES[self.elem_size], None)

    @property
    def latent(self) -> bool:
        """MLA: V is the first head_dim_v columns of each K row."""
        return 0 < self.head_dim_v < self.head_dim

    @property
    def kv_len(self) -> int:
        return self.capacity or max(self.lens)

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token of one KV head (MLA: the latent row, once)."""
        return (1 if self.latent else 2) * self.head_dim * self.elem_size

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a ragged-aware kernel must read."""
        return self.n_kv_heads * sum(self.lens) * self.bytes_per_token

    def describe(self) -> str:
        lens = (
            f"len {self.lens[0]}"
            if len(set(self.lens)) == 1
            else f"lens {min(self.lens)}-{max(self.lens)} (mean {sum(self.lens) // len(self.lens)})"
        )
        dims = f"{self.head_dim}/{self.head_dim_v}" if self.latent else str(self.head_dim)
        fp8 = " fp8" if self.elem_size == 1 else ""
        tokens = f" Tq={self.num_tokens}" if self.num_tokens > 1 else ""
        return f"B={len(self.lens)}{tokens} Hq={self.n_heads} Hkv={self.n_kv_heads} D={dims}{fp8} {lens}"


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


def paper_problems() -> list[Problem]:
    """The paper's sweeps (context, heads, batch) with D=128 plus ragged batches and Llama-3-70B/TP8."""
    problems = [Problem((n,) * 4, 32, 32) for n in (1024, 4096, 16384, 65536, 262144)]
    problems += [Problem((262144,), h, h) for h in (8, 32, 56, 128)]
    problems += [Problem((16384,) * b, 32, 32) for b in (1, 8, 32)]
    problems += [
        Problem((65536, 4096, 1024, 30000, 500, 12000, 64000, 2000), 32, 8),  # ragged, GQA
        Problem((8192,) * 16, 8, 1),  # Llama-3-70B on 8 GPUs: 8 query heads, 1 KV head per rank
        Problem((4096,) * 4, 256 // 8, 256 // 8),
    ]  # 256 heads x batch 4 over 8 GPUs
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


# --deterministic-sweep's TP-8 subset: the Llama-3-70B / Qwen2.5-72B rank (8 query heads over 1 KV
# head; Llama-3-8B's and Mixtral's rank of 4 query heads gives the engines the same CTAs), every
# batch, 4 of the 6 contexts, so that the sweep with the paper's shapes runs in ~3 minutes on 2 cores.
DETERMINISTIC_TP8_MODELS = ("llama-3-70b", "qwen2.5-72b")
DETERMINISTIC_CONTEXTS = (1024, 16384, 262144, 1048576)


def deterministic_sweep_cases() -> list[tuple[str, int, int, Problem]]:
    """(shape set, batch, context, problem) of ``--deterministic-sweep``: the TP-8 subset, then the
    paper's shapes (batch and context 0 where the lengths are ragged)."""
    tp8 = [
        ("TP-8 " + " / ".join(DETERMINISTIC_TP8_MODELS), b, n, p)
        for preset, b, n, p in tp_sweep_problems(8)
        if preset == DETERMINISTIC_TP8_MODELS[0] and n in DETERMINISTIC_CONTEXTS
    ]
    paper = list(dict.fromkeys(paper_problems()))
    return tp8 + [("paper", len(p.lens), p.lens[0] if len(set(p.lens)) == 1 else 0, p) for p in paper]


# --deterministic-sweep's verification table: speculative verification of Tq tokens in the
# batch-invariant mode against the default mode, on a TP-8 rank (one KV head) of each GQA group and
# on DeepSeek-V3's MLA rank (16 heads), at one and sixteen sequences of 4k and 32k keys.
VERIFY_GROUPS = (1, 4, 8, 16)
VERIFY_TOKENS = (2, 4, 8, 16)
VERIFY_BATCHES = (1, 16)
VERIFY_CONTEXTS = (4096, 32768)


def verification_sweep_cases() -> list[tuple[str, int, int, int, Problem]]:
    """(shape, Tq, batch, context, problem) of the verification table: GQA groups over one KV head
    (D=128) and DeepSeek-V3's MLA rank, every Tq, batch and context."""
    dqk, dv = MLA_DIMS
    shapes = [(f"group {g}", dict(n_heads=g, n_kv_heads=1)) for g in VERIFY_GROUPS]
    shapes.append(("MLA 16", dict(n_heads=MLA_HEADS // 8, n_kv_heads=1, head_dim=dqk, head_dim_v=dv)))
    return [
        (name, tq, b, n, Problem((n,) * b, num_tokens=tq, **dims))
        for name, dims in shapes
        for tq in VERIFY_TOKENS
        for b in VERIFY_BATCHES
        for n in VERIFY_CONTEXTS
    ]


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


def cp_sweep_cases() -> list[tuple[str, int, int, int, int, int, Problem]]:
    """(preset, GPUs, tp, cp, batch, context, one rank's problem) of the CP sweep."""
    cases = []
    for name, (hq, hkv, d) in MODEL_PRESETS.items():
        for gpus in CP_GPU_COUNTS:
            for tp, cp in cp_layouts(hq, hkv, gpus):
                rank_hq, rank_hkv = rank_heads(hq, hkv, tp)
                cases += [
                    (name, gpus, tp, cp, b, n, Problem((-(-n // cp),) * b, rank_hq, rank_hkv, d))
                    for b in CP_BATCHES
                    for n in CP_CONTEXTS
                ]
    return cases


# DeepSeek-V3 (and R1; Kimi-K2 has the same layout with 64 heads): 128 query heads over one latent
# KV head of 576 dims, V its first 512 (the models' Hugging Face configs: num_attention_heads 128
# and 64, kv_lora_rank 512, qk_rope_head_dim 64).
MLA_HEADS, MLA_DIMS = 128, (576, 512)
# The ranks served: (model, parallelism, query heads a rank). TP 8 splits the heads; DP attention
# (DeepSeek's own "MLA DP", SGLang's --enable-dp-attention, vLLM's data-parallel attention) gives
# every rank all of them.
MLA_RANKS = (("deepseek-v3", "TP 8", 16), ("deepseek-v3", "DP", 128), ("kimi-k2", "TP 8", 8), ("kimi-k2", "DP", 64))
MLA_TOKENS = (1, 2)  # decode, and one MTP draft verified
MLA_BATCHES = (1, 8, 32, 128)
MLA_CONTEXTS = (4096, 32768, 131072)


def mla_sweep_problems() -> list[tuple[str, str, int, int, Problem]]:
    """(model, parallelism, batch, context, one rank's problem) of MLA decode: every served rank of
    ``MLA_RANKS``, 16-bit and fp8 latent caches, Tq 1 and 2, ``MLA_BATCHES`` x ``MLA_CONTEXTS``."""
    dqk, dv = MLA_DIMS
    return [
        (model, parallel, b, n, Problem((n,) * b, heads, 1, dqk, elem_size=elem, head_dim_v=dv, num_tokens=tq))
        for model, parallel, heads in MLA_RANKS
        for elem in (2, 1)
        for tq in MLA_TOKENS
        for b in MLA_BATCHES
        for n in MLA_CONTEXTS
    ]
