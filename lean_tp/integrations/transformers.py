"""LeanAttention as a Hugging Face transformers attention implementation.

    import lean_tp.integrations.transformers as lean_hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=lean_hf.register())

Every decode step (one query token) runs ``lean_tp.decode_attention`` on the layer's cache, whatever
the cache class (``DynamicCache``, ``StaticCache``). The valid keys of each sequence come from the
mask transformers builds: the first and last attended positions become ``cache_leftpad`` and
``cache_seqlens``, which covers left padding, the unfilled tail of a static cache and sliding
windows. Prefill and anything the op cannot express (a mask whose attended positions are not one
contiguous run, float masks, softcapping, attention sinks, dropout, head sizes the kernel lacks)
go to transformers' SDPA implementation. Each such reason is logged once, not on every step.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lean_tp.ops.decode_attention import decode_attention, kernel_support

NAME = "lean"
logger = logging.getLogger("lean_tp")
_logged: set[str] = set()
# What each live mask tensor gives in eager mode: (cache_leftpad, cache_seqlens), or None when its
# rows are not one run. Every layer of one forward gets the same mask tensor, so the bounds and the
# host check on them are computed once per forward, not once per layer; an entry goes with its mask.
_mask_bounds: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register() -> str:
    """Register ``"lean"`` with transformers' attention and mask interfaces (idempotent); returns ``"lean"``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, lean_attention_forward)
    # Without a registered mask function transformers passes no mask at all to a custom implementation.
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


PREFILL = "prefill (more than one query token)"


def _log_once(reason: str) -> None:
    if reason not in _logged and not torch.compiler.is_compiling():
        _logged.add(reason)
        level = logging.INFO if reason == PREFILL else logging.WARNING  # prefill on SDPA is by design
        logger.log(level, "lean attention uses SDPA for %s (logged once)", reason)


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _unsupported(query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> str | None:
    """Why this call cannot run on the decode op, or None. Reads only shapes, dtypes and arguments."""
    if query.shape[2] != 1:
        return PREFILL
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return f"a {attention_mask.dtype} (additive) mask"
    if dropout:
        return "dropout > 0"
    for name in ("softcap", "s_aux", "position_bias", "sinks"):
        if kwargs.get(name) is not None:
            return f"{name} is not supported by the decode op"
    if query.is_cuda:  # "auto" runs the Triton kernel on CUDA: ask whether it takes this call
        return kernel_support(query.device, query.shape[-1], query.dtype)
    return None


def mask_bounds(attention_mask: torch.Tensor | None, batch: int, kv_length: int, device: torch.device):
    """(cache_leftpad, cache_seqlens, contiguous) from a (B, 1, 1, kv_length) bool mask, all (B,).

    The attended positions of row b are [leftpad[b], seqlens[b]) exactly when contiguous[b]."""
    if attention_mask is None:  # transformers drops the mask when every key is attended
        full = torch.full((batch,), kv_length, dtype=torch.int32, device=device)
        return torch.zeros_like(full), full, torch.ones(batch, dtype=torch.bool, device=device)
    valid = attention_mask[:, 0, -1, :].expand(batch, kv_length)
    pos = torch.arange(kv_length, device=device)
    end = torch.where(valid, pos + 1, 0).amax(-1)
    start = torch.minimum(torch.where(valid, pos, kv_length).amin(-1), end)
    contiguous = valid.sum(-1) == end - start
    return start.to(torch.int32), end.to(torch.int32), contiguous


def _decode_bounds(attention_mask: torch.Tensor | None, batch: int, kv_length: int, device: torch.device):
    """(cache_leftpad, cache_seqlens) for the decode op, or None if a row's attended positions are
    not one contiguous run. Eager: checked on the host, once per mask. Compiled: no host sync; a
    device-side assert makes a non-contiguous mask fail loudly instead of giving a wrong answer."""
    if attention_mask is None or torch.compiler.is_compiling():
        leftpad, seqlens, contiguous = mask_bounds(attention_mask, batch, kv_length, device)
        if attention_mask is not None:
            torch._assert_async(contiguous.all(), "lean attention: mask rows are not one contiguous run (right padding?)")
        return leftpad, seqlens
    if attention_mask not in _mask_bounds:
        leftpad, seqlens, contiguous = mask_bounds(attention_mask, batch, kv_length, device)
        _mask_bounds[attention_mask] = (leftpad, seqlens) if bool(contiguous.all()) else None
    return _mask_bounds[attention_mask]


def lean_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function. query (B, Hq, q_len, D); key, value (B, Hkv, kv_len, D), the
    layer's whole cache; attention_mask (B, 1, q_len, kv_len) bool or None. Returns (B, q_len, Hq, D)."""
    reason = _unsupported(query, attention_mask, dropout, kwargs)
    if reason is None:
        bounds = _decode_bounds(attention_mask, query.shape[0], key.shape[2], query.device)
        if bounds is not None:
            leftpad, seqlens = bounds
            out = decode_attention(
                query[:, :, 0], key, value, seqlens, cache_leftpad=leftpad,
                softmax_scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
            )  # fmt: skip
            return out[:, None], None
        reason = "a mask whose attended positions are not one contiguous run (right padding?)"
    _log_once(reason)
    return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
