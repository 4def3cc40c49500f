"""A compact Llama-family decoder built for decode: RMSNorm, RoPE (with Llama-3 scaling), SwiGLU,
GQA and a static KV cache in the layout ``lean_tp.decode_attention`` takes.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.
q_proj.weight`` …), so a checkpoint's tensors load by name and tools that address modules by those
names (DeepSpeed injection policies, say) find them.

Prefill runs ``scaled_dot_product_attention`` over right-padded prompts with a causal mask; a
padded position never influences a real one, and its K/V are ignored later because every decode
step passes per-sequence lengths (``input_pos + 1``) to the attention op as ``cache_seqlens``. The batch is ragged by length, not
padded into attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lean_tp.ops import decode_attention

ATTENTION_IMPLS = ("lean", "sdpa")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency scaling (``rope_type: "llama3"`` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0 means dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_word_embeddings: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0: each token caches one
    # latent row of kv_lora_rank + qk_rope_head_dim values; q is low-rank too when q_lora_rank > 0.
    # head_dim is then q's and K's per-head width, qk_nope_head_dim + qk_rope_head_dim.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kv_lora_rank:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(
                        f"{name}: expected a positive integer with kv_lora_rank, got {getattr(self, name)}"
                    )
            object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads: expected a multiple of n_kv_heads ({self.n_kv_heads}), got {self.n_heads}")
        if self.rope_dim % 2:
            raise ValueError(f"head_dim: expected an even number of rotary dims, got {self.rope_dim}")

    @property
    def rope_dim(self) -> int:
        """Dims each head rotates: all of head_dim, or MLA's decoupled rope dims."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim


# Published shapes. Real runs load weights with --checkpoint; these names give random weights of
# the right size for speed runs. "tiny" has Hq=8, Hkv=2 so that 4 and 8 ranks replicate KV heads.
CONFIGS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        vocab_size=1024, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, intermediate_size=1024, max_seq_len=4096
    ),
    # DeepSeek-V2's attention at toy width: DeepSeek-V3's 512 + 64 latent row (the kernel's tuning
    # pair), 16 heads (so 8 ranks hold 2 each), a low-rank q; the MLP is dense.
    "tiny-mla": ModelArgs(
        vocab_size=1024,
        dim=256,
        n_layers=2,
        n_heads=16,
        n_kv_heads=16,
        intermediate_size=512,
        max_seq_len=4096,
        kv_lora_rank=512,
        q_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
    ),
    "llama-3-8b": ModelArgs(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "llama-3.1-8b": ModelArgs(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(),
        max_seq_len=131072,
    ),
    "llama-3-70b": ModelArgs(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        intermediate_size=28672,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "mistral-7b": ModelArgs(
        vocab_size=32768,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        rope_theta=1000000.0,
        max_seq_len=32768,
    ),
    "phi-3-medium": ModelArgs(
        vocab_size=32064, dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, intermediate_size=17920, max_seq_len=4096
    ),
}


def rope_inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """(rope_dim // 2,) float32 inverse frequencies, with Llama-3 scaling when configured."""
    exponents = torch.arange(0, args.rope_dim, 2, dtype=torch.int64, device=device).float() / args.rope_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    s = args.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> cos, sin (B, 1, T, head_dim), computed in float32 then cast."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, head_dim), rotate-half convention (the Hugging Face checkpoint layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# fp8 caches (``--kv-dtype fp8``): e4m3 values with one scale per KV head, set from the prompt's
# largest magnitude with this much headroom; later tokens beyond the range saturate.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max
FP8_HEADROOM = 2.0


class CacheShard(Protocol):
    """Which positions of each sequence this rank's cache holds, and in which slots
    (``lean_tp.distributed.ContextShard``, which context parallelism installs)."""

    def capacity(self, n: int) -> int: ...
    def positions(self, n: int, device: torch.device | str | None = None) -> torch.Tensor: ...
    def owns(self, pos: torch.Tensor) -> torch.Tensor: ...
    def slot(self, pos: torch.Tensor) -> torch.Tensor: ...


# Decode attention over a layer's cache: (q (B, Hq, D), cache, lengths (B,) int32 including this
# token, backend, softmax_scale or None) -> (B, Hq, Dv). ``lean_tp.distributed.apply_tp`` installs
# context parallelism's.
AttendFn = Callable[[torch.Tensor, "KVCache", torch.Tensor, str, float | None], torch.Tensor]


class KVCache(nn.Module):
    """Static cache, k and v (B, Hkv, S, D), written in place so CUDA graphs can replay steps.

    S is ``capacity`` (global positions), or under context parallelism (``shard``) this rank's
    ``shard.capacity(capacity)`` slots plus one spare slot: a token another rank owns is written
    there, so every rank runs the same step without a branch on the position.

    With an fp8 ``dtype`` it stores ``x / scale`` and keeps k_scale, v_scale (Hkv,) float32, the
    per-KV-head scales the decode op takes; they are set at prefill, on the device, without a sync,
    from the whole prompt (so they agree on every CP rank).
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: CacheShard | None = None,
    ) -> None:
        super().__init__()
        self.capacity, self.shard = capacity, shard
        slots = capacity if shard is None else shard.capacity(capacity) + 1
        shape = (batch, n_kv_heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.fp8 = dtype == FP8_KV_DTYPE
        scales = torch.ones(n_kv_heads, dtype=torch.float32, device=device) if self.fp8 else None
        self.register_buffer("k_scale", scales, persistent=False)
        self.register_buffer("v_scale", None if scales is None else scales.clone(), persistent=False)

    def _store(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """x (B, Hkv, ...) in the cache's dtype."""
        if not self.fp8:
            return x
        scale = scale.view(1, -1, *([1] * (x.dim() - 2)))
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)

    def write_prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, Hkv, T, D) for positions 0..T-1 (under CP: all of them; this rank keeps its own)."""
        if self.fp8:
            for scale, x in ((self.k_scale, k), (self.v_scale, v)):
                scale.copy_((x.detach().abs().amax(dim=(0, 2, 3)).float() * FP8_HEADROOM / FP8_MAX).clamp_min(1e-8))
        if self.shard is not None:
            mine = self.shard.positions(k.shape[2], k.device)
            k, v = k[:, :, mine], v[:, :, mine]
        self.k[:, :, : k.shape[2]] = self._store(k, self.k_scale)
        self.v[:, :, : v.shape[2]] = self._store(v, self.v_scale)

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The slots of positions (B,): themselves, or under CP this rank's slot or the spare one."""
        if self.shard is None:
            return positions
        return torch.where(self.shard.owns(positions), self.shard.slot(positions), self.k.shape[2] - 1)

    def write_token(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v (B, Hkv, D) for one token per sequence, at positions (B,)."""
        rows, slots = torch.arange(k.shape[0], device=k.device), self._slots(positions)
        self.k[rows, :, slots] = self._store(k, self.k_scale)
        self.v[rows, :, slots] = self._store(v, self.v_scale)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as float32 values (fp8) or as stored (B, Hkv, S, D)."""
        if not self.fp8:
            return self.k, self.v
        return self.k.float() * self.k_scale.view(1, -1, 1, 1), self.v.float() * self.v_scale.view(1, -1, 1, 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None
        self.impl = "lean"
        self.backend = "auto"
        # Context parallelism (lean_tp.distributed.apply_tp): this rank's share of each sequence,
        # and the attention that merges it with the other ranks' shares.
        self.shard: CacheShard | None = None
        self.attend: AttendFn | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor | None
    ) -> torch.Tensor:
        """x (B, T, dim). input_pos None: prefill at positions 0..T-1; else (B,) int32 lengths
        before this step, and T == 1."""
        if self.kv_cache is None:
            raise RuntimeError("Attention: call setup_caches() on the model before running it")
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if input_pos is None:
            self.kv_cache.write_prefill(k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            self.kv_cache.write_token(k[:, :, 0], v[:, :, 0], input_pos)
            y = self.decode(q[:, :, 0], input_pos + 1)[:, :, None]  # the op's cache_seqlens count the new token
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim))

    def decode(self, q: torch.Tensor, lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q (B, Hq, D), lengths (B,) int32 including this token -> (B, Hq, Dv); ``scale``: the
        softmax scale, 1/sqrt(D) by default."""
        cache = self.kv_cache
        if self.attend is not None:
            return self.attend(q, cache, lengths, self.backend, scale)
        if self.impl == "lean":
            return decode_attention(
                q,
                cache.k,
                cache.v,
                lengths,
                softmax_scale=scale,
                backend=self.backend,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
            )
        k_cache, v_cache = (x.to(q.dtype) for x in cache.dequantized())
        mask = torch.arange(k_cache.shape[2], device=q.device) < lengths[:, None]
        y = F.scaled_dot_product_attention(
            q[:, :, None], k_cache, v_cache, attn_mask=mask[:, None, None], scale=scale, enable_gqa=True
        )
        return y[:, :, 0]

    def make_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(batch, self.n_kv_heads, capacity, self.head_dim, dtype, device, self.shard)


class LatentCache(KVCache):
    """MLA's static cache: one latent row per token, k (B, 1, S, rank + rope); v is a view of its
    first ``rank`` columns, so the decode op reads each row once for both products. Slots, context
    parallelism and fp8 as in ``KVCache``, with one scale for the latent rows (``v_scale`` is
    ``k_scale``)."""

    def __init__(
        self,
        batch: int,
        capacity: int,
        dim: int,
        dim_v: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: CacheShard | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.capacity, self.shard, self.dim_v = capacity, shard, dim_v
        slots = capacity if shard is None else shard.capacity(capacity) + 1
        self.register_buffer("k", torch.zeros(batch, 1, slots, dim, dtype=dtype, device=device), persistent=False)
        self.fp8 = dtype == FP8_KV_DTYPE
        scale = torch.ones(1, dtype=torch.float32, device=device) if self.fp8 else None
        self.register_buffer("k_scale", scale, persistent=False)

    @property
    def v(self) -> torch.Tensor:
        return self.k[..., : self.dim_v]

    @property
    def v_scale(self) -> torch.Tensor | None:
        return self.k_scale

    def write_prefill(self, latent: torch.Tensor) -> None:
        """latent (B, 1, T, rank + rope) for positions 0..T-1 (under CP: this rank keeps its own)."""
        if self.fp8:
            self.k_scale.copy_((latent.detach().abs().amax().float() * FP8_HEADROOM / FP8_MAX).clamp_min(1e-8))
        if self.shard is not None:
            latent = latent[:, :, self.shard.positions(latent.shape[2], latent.device)]
        self.k[:, :, : latent.shape[2]] = self._store(latent, self.k_scale)

    def write_token(self, latent: torch.Tensor, positions: torch.Tensor) -> None:
        """latent (B, 1, rank + rope) for one token per sequence, at positions (B,)."""
        rows = torch.arange(latent.shape[0], device=latent.device)
        self.k[rows, :, self._slots(positions)] = self._store(latent, self.k_scale)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.k_scale) if t is not None)


class MLAAttention(nn.Module):
    """DeepSeek-V2's multi-head latent attention, with Hugging Face's module names.

    Prefill expands the latent rows into per-head K and V (``kv_b_proj``) and runs SDPA. Decode
    runs absorbed: each head's q_nope is multiplied into the latent space by its slice of
    ``kv_b_proj`` (W_UK), so q is (B, H, rank + rope) against the cached latent rows as K, and
    their first ``rank`` columns as V; the (B, H, rank) result is turned into each head's value by
    W_UV. The latent head is shared by every query head: under tensor parallelism each rank keeps
    its query heads and the whole latent cache; context parallelism shards the cache's positions.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, 1
        self.nope, self.rope, self.v_dim, self.rank = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
            args.kv_lora_rank,
        )
        self.head_dim = self.rank + self.rope  # the decode op's q and K width
        self.scale = args.head_dim**-0.5  # of the expanded heads' q.k, as in prefill
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, args.norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, args.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.kv_cache: LatentCache | None = None
        self.impl, self.backend = "lean", "auto"
        self.shard: CacheShard | None = None
        self.attend: AttendFn | None = None

    decode = Attention.decode

    def make_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> LatentCache:
        return LatentCache(batch, capacity, self.head_dim, self.rank, dtype, device, self.shard)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor | None
    ) -> torch.Tensor:
        """x (B, T, dim); input_pos as in ``Attention.forward``."""
        if self.kv_cache is None:
            raise RuntimeError("MLAAttention: call setup_caches() on the model before running it")
        bsz, seqlen, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(bsz, seqlen, self.n_heads, -1).transpose(1, 2).split([self.nope, self.rope], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], -1)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe[:, None], cos, sin)  # k_pe (B, 1, T, rope)
        c = self.kv_a_layernorm(c)[:, None]  # (B, 1, T, rank)
        w_b = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        if input_pos is None:
            self.kv_cache.write_prefill(torch.cat((c, k_pe), -1))
            k_nope, v = (c[:, 0] @ w_b.flatten(0, 1).T).view(bsz, seqlen, self.n_heads, -1).transpose(1, 2).split(
                [self.nope, self.v_dim], -1
            )  # fmt: skip
            k = torch.cat((k_nope, k_pe.expand(-1, self.n_heads, -1, -1)), -1)
            y = F.scaled_dot_product_attention(torch.cat((q_nope, q_pe), -1), k, v, is_causal=True, scale=self.scale)
        else:
            self.kv_cache.write_token(torch.cat((c, k_pe), -1)[:, :, 0], input_pos)
            q_latent = torch.einsum("bhn,hnr->bhr", q_nope[:, :, 0], w_b[:, : self.nope])
            out = self.decode(torch.cat((q_latent, q_pe[:, :, 0]), -1), input_pos + 1, self.scale)  # (B, H, rank)
            y = torch.einsum("bhr,hvr->bhv", out, w_b[:, self.nope :])[:, :, None]
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.v_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = MLAAttention(args) if args.kv_lora_rank else Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, input_pos):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    """Decoder-only LM. Build, optionally shard (``lean_tp.distributed.apply_tp``), load weights,
    then ``setup_caches`` and call ``prefill`` once and ``decode_step`` per token."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.inv_freq: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when configured (again after ``to_empty``, which unties)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_modules(self) -> list[Attention | MLAAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def set_attention(self, impl: str = "lean", backend: str = "auto") -> None:
        """Decode attention: ``"lean"`` (``lean_tp.decode_attention`` with ``backend``) or ``"sdpa"``."""
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"impl: expected one of {ATTENTION_IMPLS}, got {impl!r}")
        if impl != "lean" and self.attention_modules()[0].shard is not None:
            raise ValueError(
                f"impl: expected 'lean' under context parallelism (the merge needs each share's lse), got {impl!r}"
            )
        for attn in self.attention_modules():
            attn.impl, attn.backend = impl, backend

    def setup_caches(self, max_batch: int, max_seq_len: int, dtype: torch.dtype | None = None) -> None:
        """Allocate each layer's (max_batch, local Hkv, max_seq_len, head_dim) cache (MLA: one
        latent head) on the weights' device; call after sharding, so each rank holds only its own KV heads. ``dtype``: the
        weights' by default, or ``FP8_KV_DTYPE`` for an fp8 cache with per-KV-head scales."""
        if max_seq_len > self.args.max_seq_len:
            raise ValueError(f"max_seq_len: expected <= the model's {self.args.max_seq_len}, got {max_seq_len}")
        weight = self.lm_head.weight
        dtype = dtype or weight.dtype
        for attn in self.attention_modules():
            attn.kv_cache = attn.make_cache(max_batch, max_seq_len, dtype, weight.device)
        self.inv_freq = rope_inv_freq(self.args, weight.device)

    def cache_capacity(self) -> int:
        """Positions each sequence's cache can hold (under CP: of the whole sequence, over all ranks)."""
        cache = self.attention_modules()[0].kv_cache
        return 0 if cache is None else cache.capacity

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV caches, over all layers."""
        return sum(attn.kv_cache.nbytes() for attn in self.attention_modules() if attn.kv_cache is not None)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, input_pos)
        return self.model.norm(x)

    def prefill(self, tokens: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64, right-padded; prompt_lens (B,) int, each in [1, T].
        Fills the cache for positions 0..T-1 and returns (B, vocab) logits of each last prompt token."""
        bsz, seqlen = tokens.shape
        positions = torch.arange(seqlen, device=tokens.device).expand(bsz, seqlen)
        h = self._layers(tokens, positions, None)
        last = h[torch.arange(bsz, device=h.device), prompt_lens.long() - 1]
        return self.lm_head(last)

    def decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens (B,) int64 at positions input_pos (B,) int32 (each sequence's length before this
        token, as gpt-fast names it). Writes their K/V, attends over input_pos + 1 tokens, returns
        (B, vocab) logits."""
        h = self._layers(tokens[:, None], input_pos[:, None], input_pos)
        return self.lm_head(h[:, 0])


def build_model(args: ModelArgs | str, device: torch.device | str = "meta") -> Transformer:
    """The model on ``device`` (``"meta"`` by default: no memory until weights are loaded)."""
    if isinstance(args, str):
        if args not in CONFIGS:
            raise ValueError(f"model: expected one of {sorted(CONFIGS)}, got {args!r}")
        args = CONFIGS[args]
    with torch.device(device):
        return Transformer(args)
