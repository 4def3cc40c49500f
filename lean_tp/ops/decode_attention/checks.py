"""Input validation for ``decode_attention``, and the one rule for which calls the Triton kernel takes.

Every check here reads only shapes, strides, dtypes and devices, so it costs no host sync and
runs unchanged under ``torch.compile``. Checks that must read tensor values (lengths within the
cache's capacity, page indices within the pool) run only when ``LEAN_TP_DEBUG=1``.
"""

from __future__ import annotations

import os

import torch

from lean_tp.ops.decode_attention.cache import SHAPES, CacheLayout
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.tuning import get_config
from lean_tp.ops.utils import interpreted

BACKENDS = ("auto", "triton", "torch")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _require_tensor(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _check_tensor(name: str, x: object, ndim: int, layout: str) -> None:
    _require_tensor(name, x)
    assert isinstance(x, torch.Tensor)
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims {layout}, got shape {tuple(x.shape)}")


def _check_int32(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (q's device), got {x.device}")


def check_types(**tensors: object) -> None:
    """TypeError for a non-tensor argument, before the dispatcher rejects it with a RuntimeError."""
    for name, x in tensors.items():
        if x is not None or name not in ("block_table", "cache_leftpad"):
            _require_tensor(name, x)


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    backend: str,
    cache_leftpad: torch.Tensor | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument for any malformed call."""
    if not (isinstance(backend, str) and backend in BACKENDS):
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    _check_tensor("q", q, 3, "(B, Hq, D)")
    if q.dtype not in DTYPES:
        raise TypeError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    batch, num_q_heads, head_dim = q.shape
    paged = block_table is not None
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, cache, 4, SHAPES[paged])
        if cache.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (q's dtype), got {cache.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (q's device), got {cache.device}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: expected stride(-1) == 1, got strides {cache.stride()}")
        if cache.shape[-1] != head_dim:
            raise ValueError(f"{name}: expected head_dim {head_dim} (q's last dim), got shape {tuple(cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if paged:
        _check_paged(block_table, k_cache, batch, q.device)
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    num_kv_heads = layout.num_kv_heads
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q: expected Hq to be a multiple of Hkv={num_kv_heads}, got Hq={num_q_heads}")
    if not paged and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache: expected batch {batch} (q's), got shape {tuple(k_cache.shape)}")
    _check_tensor("cache_seqlens", cache_seqlens, 1, "(B,)")
    _check_int32("cache_seqlens", cache_seqlens, q.device)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens: expected shape ({batch},), got {tuple(cache_seqlens.shape)}")
    if cache_leftpad is not None:
        _check_tensor("cache_leftpad", cache_leftpad, 1, "(B,)")
        _check_int32("cache_leftpad", cache_leftpad, q.device)
        if cache_leftpad.shape[0] != batch:
            raise ValueError(f"cache_leftpad: expected shape ({batch},), got {tuple(cache_leftpad.shape)}")
    if os.environ.get("LEAN_TP_DEBUG") == "1" and not torch.compiler.is_compiling():
        _check_values(layout, k_cache.shape[0], cache_seqlens, block_table, cache_leftpad)


def _check_paged(block_table: object, k_cache: torch.Tensor, batch: int, device: torch.device) -> None:
    _check_tensor("block_table", block_table, 2, "(B, max_pages_per_seq)")
    assert isinstance(block_table, torch.Tensor)
    _check_int32("block_table", block_table, device)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (q's batch), got shape {tuple(block_table.shape)}")
    page_size = k_cache.shape[1]
    if page_size < 16 or page_size & (page_size - 1) != 0:
        raise ValueError(f"k_cache: expected a page size (dim 1) that is a power of two >= 16, got {page_size}")


def _check_values(
    layout: CacheLayout, num_rows: int, cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
) -> None:
    """LEAN_TP_DEBUG=1 only: checks that read tensor values and so synchronize with the device."""
    cap = layout.capacity
    lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
    if not (lo >= 0 and hi <= cap):
        raise ValueError(f"cache_seqlens: expected values in [0, {cap}] (the cache capacity), got min {lo}, max {hi}")
    if cache_leftpad is not None and not bool(((cache_leftpad >= 0) & (cache_leftpad <= cache_seqlens)).all()):
        raise ValueError(
            f"cache_leftpad: expected 0 <= cache_leftpad[b] <= cache_seqlens[b], got {cache_leftpad.tolist()[:8]} "
            f"with cache_seqlens {cache_seqlens.tolist()[:8]}"
        )
    if layout.paged and block_table.numel():
        used = torch.arange(block_table.shape[1], device=block_table.device) * layout.page_size < cache_seqlens[:, None]
        pages = block_table[used]
        bad = pages[(pages < 0) | (pages >= num_rows)]
        if bad.numel() != 0:
            raise ValueError(f"block_table: expected page indices in [0, {num_rows}) for used pages, got {bad[:4].tolist()}")


def kernel_support(device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the Triton kernel cannot take a call on ``device`` with this head_dim and dtype, or None.

    The one home of that rule: the op's dispatch, the transformers integration, the simulator and
    the tensor-parallel grid report all ask here.
    """
    if device.type != "cuda" and not interpreted(decode_attention_fwd_kernel):
        return (
            f"backend: 'triton' on {device.type} tensors runs through the Triton interpreter; "
            "expected TRITON_INTERPRET=1 set before lean_tp is imported, got it unset"
        )
    try:
        get_config(device, head_dim, dtype)
    except ValueError as exc:
        return str(exc)
    return None


def uses_triton(device: torch.device, head_dim: int, dtype: torch.dtype, backend: str) -> bool:
    """Which implementation a call runs; raises ``ValueError`` when "triton" is asked for (or "auto"
    on CUDA) and the kernel cannot take the call."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    reason = kernel_support(device, head_dim, dtype)
    if reason is not None:
        raise ValueError(reason)
    return True
