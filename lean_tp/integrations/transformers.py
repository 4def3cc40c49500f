"""LeanAttention as a Hugging Face transformers attention implementation.

    import lean_tp.integrations.transformers as lean_hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=lean_hf.register())

Every step with at most ``MAX_QUERY_TOKENS`` query tokens (decode, and the verification step of
assisted generation) runs ``lean_tp.decode_attention`` on the layer's cache, whatever the cache
class (``DynamicCache``, ``StaticCache``). The valid keys of each sequence come from the mask
transformers builds: the first attended position of the first query row and the last of the last
row become ``cache_leftpad`` and ``cache_seqlens``, which covers left padding and the unfilled tail
of a static cache. The layer's own arguments carry the rest: ``sliding_window`` (Mistral, Qwen2,
Gemma 2/3, gpt-oss), ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's sinks). The op's mask implied
by those is checked against transformers' mask; a call whose mask differs (right padding, custom
masks), a float mask, dropout or a longer prefill goes to transformers' SDPA, or to the model's
own eager attention for softcap and sinks, which SDPA lacks. Each such reason is logged once.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lean_tp.ops.decode_attention import decode_attention, kernel_support
from lean_tp.ops.decode_attention.checks import MAX_QUERY_TOKENS

NAME = "lean"
logger = logging.getLogger("lean_tp")
_logged: set[str] = set()
# What each live mask tensor gives in eager mode, per window: (cache_leftpad, cache_seqlens), or
# None when the op cannot express it. Every layer of one forward gets the same mask tensor, so the
# bounds and the host check on them are computed once per forward, not once per layer; an entry
# goes with its mask.
_mask_bounds: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register() -> str:
    """Register ``"lean"`` with transformers' attention and mask interfaces (idempotent); returns ``"lean"``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, lean_attention_forward)
    # Without a registered mask function transformers passes no mask at all to a custom implementation.
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


PREFILL = f"prefill (more than {MAX_QUERY_TOKENS} query tokens)"


def _log_once(reason: str) -> None:
    if reason not in _logged and not torch.compiler.is_compiling():
        _logged.add(reason)
        level = logging.INFO if reason == PREFILL else logging.WARNING  # prefill on SDPA is by design
        logger.log(level, "lean attention uses SDPA for %s (logged once)", reason)


def fallback(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA; for softcap or sinks, which SDPA lacks, the model's own eager attention."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is not None and (kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None):
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager adds its mask
            attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
        return eager(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _features(query: torch.Tensor, kwargs: dict) -> dict:
    """The op's feature arguments for this layer: window (only needed with several query rows:
    for one, the mask's first attended position is already the window's start), softcap, sinks."""
    window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
    return {
        "window": int(window) if window is not None and query.shape[2] > 1 else None,
        "softcap": float(kwargs["softcap"]) if kwargs.get("softcap") is not None else None,
        "sinks": sinks.detach().float() if sinks is not None else None,
    }


def _unsupported(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict
) -> str | None:
    """Why this call cannot run on the decode op, or None. Reads only shapes, dtypes and arguments."""
    if query.shape[2] > MAX_QUERY_TOKENS:
        return PREFILL
    if query.shape[2] > 1 and attention_mask is not None and torch.compiler.is_compiling():
        # Padded prompt rows make such masks ones the op does not imply; only a host check tells.
        return "several query tokens with a mask under torch.compile (checking the mask needs a host sync)"
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return f"a {attention_mask.dtype} (additive) mask"
    if dropout:
        return "dropout > 0"
    if kwargs.get("position_bias") is not None:
        return "position_bias is not supported by the decode op"
    if query.is_cuda:  # "auto" runs the Triton kernel on CUDA: ask whether it takes this call
        return kernel_support(query.device, query.shape[-1], query.dtype)
    return None


def mask_bounds(
    attention_mask: torch.Tensor | None,
    batch: int,
    q_len: int,
    kv_length: int,
    window: int | None,
    device: torch.device,
):
    """(cache_leftpad, cache_seqlens, matches) from a (B, 1, q_len, kv_length) bool mask, all (B,).

    leftpad is the first row's first attended position, seqlens the last row's last one + 1;
    ``matches[b]`` says whether row b of the mask is exactly what the op attends with those bounds,
    q_len query tokens and ``window``."""
    if attention_mask is None:
        # transformers drops the mask when every key is attended (one query) or for SDPA's
        # top-left causal mask (several): query t sees keys [0, t] of the cache.
        full = torch.full((batch,), kv_length if q_len == 1 else q_len, dtype=torch.int32, device=device)
        return torch.zeros_like(full), full, torch.ones(batch, dtype=torch.bool, device=device)
    valid = attention_mask[:, 0].expand(batch, q_len, kv_length)
    pos = torch.arange(kv_length, device=device)
    end = torch.where(valid[:, -1], pos + 1, 0).amax(-1)
    start = torch.minimum(torch.where(valid[:, 0], pos, kv_length).amin(-1), end)
    hi = end[:, None] - q_len + 1 + torch.arange(q_len, device=device)  # (B, q_len): the op's rows
    lo = start[:, None] if window is None else torch.maximum(start[:, None], hi - window)
    implied = (pos >= lo[..., None]) & (pos < hi[..., None])
    return start.to(torch.int32), end.to(torch.int32), (implied == valid).all(-1).all(-1)


def _decode_bounds(attention_mask: torch.Tensor | None, query: torch.Tensor, kv_length: int, window: int | None):
    """(cache_leftpad, cache_seqlens) for the decode op, or None if the mask is not one it implies.
    Eager: checked on the host, once per mask and window. Compiled: no host sync; a device-side
    assert makes such a mask fail loudly instead of giving a wrong answer."""
    batch, q_len = query.shape[0], query.shape[2]
    if attention_mask is None or torch.compiler.is_compiling():
        leftpad, seqlens, matches = mask_bounds(attention_mask, batch, q_len, kv_length, window, query.device)
        if attention_mask is not None:
            torch._assert_async(
                matches.all(), "lean attention: the mask is not one the decode op implies (right padding?)"
            )
        return leftpad, seqlens
    per_window = _mask_bounds.setdefault(attention_mask, {})
    if window not in per_window:
        leftpad, seqlens, matches = mask_bounds(attention_mask, batch, q_len, kv_length, window, query.device)
        per_window[window] = (leftpad, seqlens) if bool(matches.all()) else None
    return per_window[window]


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
    reason = _unsupported(query, key, attention_mask, dropout, kwargs)
    if reason is None:
        features = _features(query, kwargs)
        bounds = _decode_bounds(attention_mask, query, key.shape[2], features["window"])
        if bounds is not None:
            leftpad, seqlens = bounds
            out = decode_attention(
                query.transpose(1, 2),
                key,
                value,
                seqlens,
                cache_leftpad=leftpad,
                softmax_scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
                **features,
            )
            return out, None
        reason = "a mask the decode op does not imply (right padding, or a custom mask)"
    _log_once(reason)
    return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
