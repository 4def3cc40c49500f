"""``torch.library`` registration of ``lean_tp::decode_attention``, and the public Python entry point.

The op is a ``triton_op`` so that ``torch.compile`` sees the Triton kernel itself (through
``wrap_triton``) on CUDA, and traces the plain-torch body on CPU. It always returns (out, lse);
the Python wrapper drops lse unless asked. The op is inference-only: it has no autograd formula.
A call whose plan routes it to the Gluon MLA kernel (``DecodePlan.gluon``) runs the custom op
``lean_tp::mla_decode_gluon`` instead of the Triton kernel.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from lean_tp.ops.decode_attention.checks import check_flag, check_inputs, check_scalar_types, check_types, scale_tensor
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, plan_decode
from lean_tp.ops.decode_attention.torch_impl import decode_attention_torch
from lean_tp.ops.mla_gluon import op as _mla_gluon_op  # noqa: F401  registers lean_tp::mla_decode_gluon
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Registered op; see ``decode_attention`` for the arguments (fp8 scales as float32 tensors).
    Returns (out, lse). The call is checked and planned once (``plan_decode``); the backend the
    plan names runs it."""
    plan = plan_decode(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        cache_leftpad,
        backend=backend,
        k_scale=k_scale,
        v_scale=v_scale,
        softcap=softcap,
        window=window,
        sinks=sinks,
        softmax_scale=softmax_scale,
        batch_invariant=batch_invariant,
    )
    if plan.kernel is None:
        return decode_attention_torch(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            block_table,
            softmax_scale,
            cache_leftpad,
            k_scale,
            v_scale,
            softcap,
            window,
            sinks,
            batch_invariant,
            plan=plan,
        )
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if plan.gluon:
        seqlens = cache_seqlens.contiguous()
        return torch.ops.lean_tp.mla_decode_gluon(
            q.contiguous(), k_cache, seqlens, block_table, softmax_scale, k_scale, v_scale
        )
    return decode_attention_fwd(
        q,
        k_cache,
        v_cache,
        cache_seqlens.contiguous(),
        block_table,
        softmax_scale,
        plan=plan,
        cache_leftpad=cache_leftpad.contiguous() if cache_leftpad is not None else None,
        k_scale=k_scale,
        v_scale=v_scale,
        softcap=softcap,
        sinks=sinks,
        launch=_launch,
    )


@decode_attention_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table,
    cache_leftpad,
    softmax_scale,
    backend,
    k_scale=None,
    v_scale=None,
    softcap=None,
    window=None,
    sinks=None,
    batch_invariant=False,
):
    check_inputs(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        backend,
        cache_leftpad,
        k_scale,
        v_scale,
        softcap,
        window,
        sinks,
        softmax_scale,
        batch_invariant=batch_invariant,
    )
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1]), lse


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
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of the newest query tokens of each sequence against its KV cache (LeanAttention).

    Args:
        q: (B, Hq, D), or (B, Tq, Hq, D) for 1 <= Tq <= 16 new tokens per sequence (any Tq with
            ``batch_invariant``); fp16, bf16 or fp32.
        k_cache, v_cache: contiguous (B, Hkv, S_max, D), any strides with ``stride(-1) == 1``;
            or paged (num_pages, page_size, Hkv, D) together with ``block_table``.
            q's dtype, or fp8 (``float8_e4m3fn``/``float8_e5m2``) with an fp16/bf16 q and scales.
            Same device as q; Hq must be a multiple of Hkv. v_cache's last dim Dv may be below
            D (MLA, docs/mla.md): a tensor of K's shape but its last dim, or
            ``k_cache[..., :Dv]``, whose values the kernel reads from K's rows.
        cache_seqlens: (B,) int32 on q's device, counting the new tokens: query t sits at
            position ``cache_seqlens[b] - Tq + t`` and sees the keys up to and including it.
            Values are clamped to ``[0, capacity]`` (and ``cache_leftpad`` to ``[0, cache_seqlens]``)
            on the device, so no value hangs the kernel or writes out of bounds (``cache.valid_keys``).
        block_table: (B, max_pages_per_seq) int32, page indices of each sequence, for paged caches.
        cache_leftpad: (B,) int32, for left-padded batches: sequence b's keys are cache positions
            ``[cache_leftpad[b], cache_seqlens[b])`` instead of ``[0, cache_seqlens[b])``.
        softmax_scale: multiplier of q.k; default ``1 / sqrt(D)``.
        return_lse: also return lse (see Returns).
        backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``. The
            Triton backend takes head dims that are multiples of 8 up to 256, and (D, Dv) =
            (576, 512) with a 16-bit q; the torch backend any.
        k_scale, v_scale: fp8 caches only (required there): the value used is
            ``cache.float() * scale``; a float, or a float32 tensor on q's device of shape (Hkv,)
            (per KV head) or (1,) (per tensor, as vLLM keeps it).
        softcap: logit cap > 0: scores are ``softcap * tanh(softmax_scale * q.k / softcap)``.
        window: the last ``window`` keys up to each query's position, itself included.
        sinks: (Hq,) float32 on q's device: one extra logit per query head in the softmax
            denominator (not scaled or capped), with no value.
        batch_invariant: make each sequence's out and lse bitwise independent of the rest of the
            batch (its batch-mates, their number, lengths and order; docs/design.md,
            "Batch-invariant mode"), and each of its Tq query tokens' bitwise its one-token decode's
            (the call with its q row and the keys up to its own). Costs a little speed in decode,
            and a read of the keys per token in a verification (docs/BENCHMARKS.md); same values up
            to rounding.

    Returns:
        out in q's shape (last dim Dv) and dtype, or (out, lse) when ``return_lse``; lse is float32, q's shape
        without D, the natural log of the softmax denominator (``-inf`` when a query sees no key
        and there are no sinks).
    """
    check_types(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        cache_leftpad=cache_leftpad,
        sinks=sinks,
    )
    check_scalar_types(softcap, window, softmax_scale)
    check_flag("return_lse", return_lse)
    check_flag("batch_invariant", batch_invariant)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    k_scale, v_scale = scale_tensor("k_scale", k_scale, q.device), scale_tensor("v_scale", v_scale, q.device)
    if isinstance(softcap, int) and not isinstance(softcap, bool):
        softcap = float(softcap)
    out, lse = torch.ops.lean_tp.decode_attention(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        cache_leftpad,
        float(softmax_scale),
        backend,
        k_scale,
        v_scale,
        softcap,
        window,
        sinks,
        batch_invariant,
    )
    return (out, lse) if return_lse else out
