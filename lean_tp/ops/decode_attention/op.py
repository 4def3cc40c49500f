"""``torch.library`` registration of ``lean_tp::decode_attention``, and the public Python entry point.

The op is a ``triton_op`` so that ``torch.compile`` sees the Triton kernel itself (through
``wrap_triton``) on CUDA, and traces the plain-torch body on CPU. It always returns (out, lse);
the Python wrapper drops lse unless asked. The op is inference-only: it has no autograd formula.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from lean_tp.ops.decode_attention.checks import check_inputs, check_types, uses_triton
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd
from lean_tp.ops.decode_attention.torch_impl import decode_attention_torch
from lean_tp.ops.utils import interpreted

# Under the interpreter the kernel is launched as is: torch 2.11's wrap_triton rejects the
# interpreter's kernel object, and torch.compile cannot trace an interpreted kernel on any version.
_launch = (lambda kernel: kernel) if interpreted(decode_attention_fwd_kernel) else wrap_triton


@triton_op("lean_tp::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    softmax_scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Registered op; see ``decode_attention`` for the arguments. Returns (out, lse)."""
    check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, backend, cache_leftpad)
    if uses_triton(q.device, q.shape[-1], q.dtype, backend):
        if block_table is not None and block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        return decode_attention_fwd(
            q, k_cache, v_cache, cache_seqlens.contiguous(), block_table, softmax_scale,
            cache_leftpad=cache_leftpad.contiguous() if cache_leftpad is not None else None, launch=_launch,
        )  # fmt: skip
    return decode_attention_torch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, cache_leftpad)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad, softmax_scale, backend):
    check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, backend, cache_leftpad)
    batch, num_q_heads, _ = q.shape
    lse = q.new_empty(batch, num_q_heads, dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of one query token per sequence against its KV cache (LeanAttention).

    Args:
        q: (B, Hq, D), fp16, bf16 or fp32.
        k_cache, v_cache: contiguous (B, Hkv, S_max, D), any strides with ``stride(-1) == 1``;
            or paged (num_pages, page_size, Hkv, D) together with ``block_table``.
            Same dtype and device as q; Hq must be a multiple of Hkv.
        cache_seqlens: (B,) int32 on q's device, ``0 <= cache_seqlens[b] <= capacity``.
        block_table: (B, max_pages_per_seq) int32, page indices of each sequence, for paged caches.
        cache_leftpad: (B,) int32, for left-padded batches: sequence b's keys are cache positions
            ``[cache_leftpad[b], cache_seqlens[b])`` instead of ``[0, cache_seqlens[b])``.
        softmax_scale: multiplier of q.k; default ``1 / sqrt(D)``.
        return_lse: also return lse (B, Hq) float32, natural log (``-inf`` for empty sequences).
        backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.

    Returns:
        out (B, Hq, D) in q's dtype, or (out, lse) when ``return_lse``.
    """
    check_types(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                cache_leftpad=cache_leftpad)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    out, lse = torch.ops.lean_tp.decode_attention(
        q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad, float(softmax_scale), backend
    )
    return (out, lse) if return_lse else out
