"""The decode problems the simulator models: one step's lengths, head counts and head dim, the
tensor-parallel presets, and the sweeps' problem sets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lean_tp.ops.decode_attention.tuning import config_for

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

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token of one KV head."""
        return 2 * self.head_dim * self.elem_size

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
        return f"B={len(self.lens)} Hq={self.n_heads} Hkv={self.n_kv_heads} D={self.head_dim} {lens}"


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
