"""What the vLLM backend runs where vLLM itself runs no Triton (its CPU build): cache writes and
prefill in plain torch, on the same cache layout vLLM's Triton attention uses on GPUs.

vLLM's own CPU attention cannot stand in for them: it stores K in a packed, per-ISA order that no
other kernel reads. These paths exist so that the backend runs, and is tested, end to end on CPU;
on GPUs the backend uses vLLM's Triton kernels for both.
"""

from __future__ import annotations

import torch

from lean_tp.ops.decode_attention import decode_attention_torch
from lean_tp.ops.decode_attention.checks import FP8_DTYPES


def _to_cache(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x as stored in a cache of ``dtype``: fp8 holds ``x / scale``, saturated to the format's
    largest finite value as vLLM's GPU cache writes do."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    big = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-big, big).to(dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Store each token's K and V at its slot (``page * page_size + offset``).

    Args:
        key, value: (T, Hkv, D) new tokens.
        key_cache, value_cache: (num_pages, page_size, Hkv, D) views of the layer's cache.
        slot_mapping: (>= T,) int64; slot -1 (padding) writes nothing.
        k_scale, v_scale: (1,) float32 for fp8 caches, else None.
    """
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens]
    keep = slots >= 0
    slots = slots[keep]
    k_flat = key_cache.view(-1, *key_cache.shape[2:])  # a view or an error, never a silent copy
    v_flat = value_cache.view(-1, *value_cache.shape[2:])
    k_flat[slots] = _to_cache(key[keep], k_scale, key_cache.dtype)
    v_flat[slots] = _to_cache(value[keep], v_scale, value_cache.dtype)


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    **features,
) -> None:
    """Causal attention of each request's query tokens over its cached keys, one request at a time.

    Args:
        query: (T, Hq, D) the requests' tokens, request i at ``query_start_loc[i]:[i + 1]``.
        key_cache, value_cache: (num_pages, page_size, Hkv, D).
        output: (T, Hq, D), written.
        seq_lens: (R,) int32, keys per request, its new tokens included (they are the last ones).
        block_table: (R, max_pages) int32.
        features: softmax_scale, k_scale, v_scale, softcap, window, sinks, as ``decode_attention``
            takes them (scales as (1,) float32 tensors).
    """
    for i, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
        if end == start:
            continue
        out, _ = decode_attention_torch(
            query[None, start:end],
            key_cache,
            value_cache,
            seq_lens[i : i + 1],
            block_table[i : i + 1],
            features["softmax_scale"],
            None,
            features["k_scale"],
            features["v_scale"],
            features["softcap"],
            features["window"],
            features["sinks"],
        )
        output[start:end] = out[0]
