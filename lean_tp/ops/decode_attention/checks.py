"""Input validation for ``decode_attention``, and the one rule for which calls the Triton kernel takes.

Every check here reads only shapes, strides, dtypes and devices, so it costs no host sync and
runs unchanged under ``torch.compile``. Checks that must read tensor values (lengths within the
cache's capacity, page indices within the pool) run only when ``LEAN_TP_DEBUG=1``.
"""

from __future__ import annotations

import math
import os

import torch

from lean_tp.ops.decode_attention.cache import SHAPES, CacheLayout, valid_keys
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.plan import span_limit
from lean_tp.ops.decode_attention.tuning import get_config
from lean_tp.ops.utils import FLOAT_DTYPES, interpreted, require_tensor

BACKENDS = ("auto", "triton", "torch")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Query tokens per sequence (speculative decoding, multi-token prediction): Tq x group rows share
# each K/V tile, so a bound keeps the row block within what one program holds. The batch-invariant
# mode decodes each query token as a sequence of its own and takes any Tq.
MAX_QUERY_TOKENS = 16
# The shortest page a cache passed without block_table is taken to be a paged pool by, for the
# error's hint: the page size vLLM and FlashInfer allocate by default.
HINT_PAGE_SIZE = 16


def max_query_tokens(batch_invariant: bool) -> int | float:
    """Most query tokens a sequence may have in a call: ``MAX_QUERY_TOKENS``, or any number in the
    batch-invariant mode, which schedules each token as a sequence of its own."""
    return math.inf if batch_invariant else MAX_QUERY_TOKENS


def is_page_size(n: int) -> bool:
    """Whether paged caches take pages of ``n`` tokens: any power of two. The kernel finds page and
    slot by a shift and a mask; one-token pages (SGLang's token-to-KV pool) are the same loop with a
    page id looked up per key, as for any page shorter than a K/V block."""
    return n > 0 and n & (n - 1) == 0


def _check_tensor(name: str, x: object, ndim: int, layout: str) -> None:
    require_tensor(name, x)
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
        if x is not None or name not in ("block_table", "cache_leftpad", "sinks"):
            require_tensor(name, x)


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    backend: str,
    cache_leftpad: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    *,
    values: bool = True,
    batch_invariant: bool = False,
) -> CacheLayout:
    """Raise ``TypeError``/``ValueError`` naming the argument for any malformed call (fp8 scales
    as the op sees them: (Hkv,) or (1,) float32 tensors); return the cache's layout. ``values``: with ``LEAN_TP_DEBUG=1``,
    also check lengths and page indices against this cache (False where the lengths are not this
    cache's, as context parallelism's global lengths). ``batch_invariant``: the call's mode, which
    takes any number of query tokens (``max_query_tokens``)."""
    if not (isinstance(backend, str) and backend in BACKENDS):
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    require_tensor("q", q)
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected 3 dims (B, Hq, D) or 4 dims (B, Tq, Hq, D), got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if q.dim() == 4 and not 1 <= q.shape[1] <= max_query_tokens(batch_invariant):
        bound = "Tq >= 1" if batch_invariant else f"1 <= Tq <= {MAX_QUERY_TOKENS} (batch_invariant=True takes any Tq)"
        raise ValueError(f"q: expected {bound} query tokens (dim 1), got shape {tuple(q.shape)}")
    paged = block_table is not None
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, cache, 4, SHAPES[paged])
        _check_cache_dtype(name, cache.dtype, q.dtype)
        if cache.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (q's device), got {cache.device}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: expected stride(-1) == 1, got strides {cache.stride()}")
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache: expected head_dim {head_dim} (q's last dim), got shape {tuple(k_cache.shape)}")
    _check_v_shape(k_cache, v_cache)
    if paged:
        _check_paged(block_table, k_cache, batch, q.device)
    layout = CacheLayout.of(k_cache, v_cache, block_table)
    num_kv_heads = layout.num_kv_heads
    hint = "" if paged else _layout_hint(k_cache, batch, num_q_heads)
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q: expected Hq to be a multiple of Hkv={num_kv_heads}, got Hq={num_q_heads}{hint}")
    if not paged and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache: expected batch {batch} (q's), got shape {tuple(k_cache.shape)}{hint}")
    _check_tensor("cache_seqlens", cache_seqlens, 1, "(B,)")
    _check_int32("cache_seqlens", cache_seqlens, q.device)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens: expected shape ({batch},), got {tuple(cache_seqlens.shape)}")
    if cache_leftpad is not None:
        _check_tensor("cache_leftpad", cache_leftpad, 1, "(B,)")
        _check_int32("cache_leftpad", cache_leftpad, q.device)
        if cache_leftpad.shape[0] != batch:
            raise ValueError(f"cache_leftpad: expected shape ({batch},), got {tuple(cache_leftpad.shape)}")
    _check_features(
        k_cache.dtype, num_q_heads, num_kv_heads, q.device, k_scale, v_scale, softcap, window, sinks, softmax_scale
    )
    if values and os.environ.get("LEAN_TP_DEBUG") == "1" and not torch.compiler.is_compiling():
        max_span = span_limit(window, q.shape[1] if q.dim() == 4 else 1)
        _check_values(layout, k_cache.shape[0], cache_seqlens, block_table, cache_leftpad, max_span)
    return layout


def _check_v_shape(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """V has K's shape, or K's shape with a smaller last dim (V's head dim below K's, as MLA's
    ``k_cache[..., :Dv]``, ``cache.is_prefix_view``)."""
    k_shape, v_shape = tuple(k_cache.shape), tuple(v_cache.shape)
    if v_shape[:-1] != k_shape[:-1] or not 0 < v_shape[-1] <= k_shape[-1]:
        raise ValueError(
            f"v_cache: expected k_cache's shape {k_shape} with a last dim Dv <= {k_shape[-1]} (a tensor of its own, "
            f"or k_cache[..., :Dv] for a latent cache), got shape {v_shape}"
        )


def _layout_hint(k_cache: torch.Tensor, batch: int, num_q_heads: int) -> str:
    """For a cache passed without block_table that does not fit (B, Hkv, S_max, D): the layout it
    most likely has, and how to pass it."""
    rows, dim1, dim2 = k_cache.shape[:3]
    if rows == batch and dim2 > 0 and num_q_heads % dim2 == 0:
        return (
            "; k_cache looks like (B, S_max, Hkv, D) (flash-attn's layout): pass k_cache.transpose(1, 2) "
            "and v_cache.transpose(1, 2)"
        )
    if dim1 >= HINT_PAGE_SIZE and is_page_size(dim1) and dim2 > 0 and num_q_heads % dim2 == 0:
        return "; k_cache looks like a paged pool (num_pages, page_size, Hkv, D): pass block_table with it"
    return ""


def _check_cache_dtype(name: str, dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    if dtype in FP8_DTYPES:
        if q_dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"q: expected float16 or bfloat16 with an fp8 {name}, got {q_dtype}")
    elif dtype != q_dtype:
        raise TypeError(f"{name}: expected dtype {q_dtype} (q's dtype) or an fp8 dtype {FP8_DTYPES}, got {dtype}")


def _check_features(
    cache_dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    device: torch.device,
    k_scale: object,
    v_scale: object,
    softcap: object,
    window: object,
    sinks: object,
    softmax_scale: object = None,
) -> None:
    """fp8 scales (required with fp8 caches, refused otherwise), softcap, window, softmax_scale and sinks."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if cache_dtype not in FP8_DTYPES:
            if scale is not None:
                raise ValueError(
                    f"{name}: expected None for a {cache_dtype} cache (scales are for fp8 caches), got a scale"
                )
            continue
        if scale is None:
            raise ValueError(
                f"{name}: expected a float or a ({num_kv_heads},) float32 tensor with an fp8 cache, got None"
            )
        _check_vector(name, scale, num_kv_heads, "Hkv", device, per_tensor=True)
    check_scalars(softcap, window, softmax_scale)
    if sinks is not None:
        _check_vector("sinks", sinks, num_q_heads, "Hq", device)


def is_number(x: object) -> bool:
    """An int or float argument; bool is an int to Python but never a meaningful scale."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_scalar_types(softcap: object, window: object, softmax_scale: object) -> None:
    """``TypeError`` for a softcap, window or softmax_scale of the wrong type, at the Python entry
    point, before the dispatcher rejects it with a RuntimeError; the op checks their values."""
    for name, x, kind in (("softcap", softcap, "a float"), ("softmax_scale", softmax_scale, "a float")):
        if x is not None and not is_number(x):
            raise TypeError(f"{name}: expected {kind} or None, got {type(x).__name__} {x!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise TypeError(f"window: expected an int or None, got {type(window).__name__} {window!r}")


def check_scalars(softcap: object, window: object, softmax_scale: object = None) -> None:
    """softcap, window and softmax_scale values (their types are the wrapper's
    ``check_scalar_types``, and the op schema's, which converts a bool to an int or a float before
    the op sees it). A non-finite scale or cap would make every output NaN."""
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"softcap: expected a finite float > 0 or None, got {softcap!r}")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float or None, got {softmax_scale!r}")
    if window is not None and window < 1:
        raise ValueError(f"window: expected an int >= 1 or None, got {window!r}")


def check_flag(name: str, value: object) -> None:
    """A flag of the Python entry points (``return_lse``, ``batch_invariant``): a bool (a truthy
    string would pass silently)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def _check_vector(name: str, x: object, n: int, what: str, device: torch.device, per_tensor: bool = False) -> None:
    """A float32 (n,) tensor on ``device``; (1,) too when ``per_tensor`` (one value for all)."""
    require_tensor(name, x)
    assert isinstance(x, torch.Tensor)
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype torch.float32, got {x.dtype}")
    if tuple(x.shape) != (n,) and not (per_tensor and tuple(x.shape) == (1,)):
        raise ValueError(
            f"{name}: expected shape ({n},) ({what}){' or (1,)' if per_tensor else ''}, got {tuple(x.shape)}"
        )
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (q's device), got {x.device}")


def scale_tensor(name: str, scale: object, device: torch.device) -> torch.Tensor | None:
    """An fp8 scale as the op takes it: a float becomes a (1,) float32 tensor (a fill, no sync)."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    if not (is_number(scale) and 0 < scale < float("inf")):
        raise ValueError(
            f"{name}: expected a finite float > 0 or a float32 tensor of shape (Hkv,) or (1,), got {scale!r}"
        )
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def _check_paged(block_table: object, k_cache: torch.Tensor, batch: int, device: torch.device) -> None:
    _check_tensor("block_table", block_table, 2, "(B, max_pages_per_seq)")
    assert isinstance(block_table, torch.Tensor)
    _check_int32("block_table", block_table, device)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (q's batch), got shape {tuple(block_table.shape)}")
    if k_cache.shape[0] == 0:  # a bad page id reads the pool's last page in its place
        raise ValueError(f"k_cache: expected a pool of at least one page (dim 0), got shape {tuple(k_cache.shape)}")
    page_size = k_cache.shape[1]
    if not is_page_size(page_size):
        raise ValueError(f"k_cache: expected a page size (dim 1) that is a power of two, got {page_size}")


def _check_values(
    layout: CacheLayout,
    num_rows: int,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    max_span: int,
) -> None:
    """LEAN_TP_DEBUG=1 only: checks that read tensor values and so synchronize with the device.
    ``max_span``: the most keys a sequence reads (``plan.span_limit``)."""
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
        _check_page_ids(layout.page_size, num_rows, cache_seqlens, block_table, cache_leftpad, max_span)


def _check_page_ids(
    page_size: int,
    num_rows: int,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    cache_leftpad: torch.Tensor | None,
    max_span: int,
) -> None:
    """The first page id outside [0, num_rows) in a column that a sequence reads, named by sequence
    and column. Without the debug mode the same id only makes that sequence's output NaN."""
    start, end = valid_keys(cache_seqlens, cache_leftpad, block_table.shape[1] * page_size)
    first = start if start is not None else torch.zeros_like(end)
    first = torch.maximum(first, end - max_span)
    col = torch.arange(block_table.shape[1], device=block_table.device) * page_size
    read = (col < end[:, None]) & (col + page_size > first[:, None])
    bad = read & ((block_table < 0) | (block_table >= num_rows))
    if bool(bad.any()):
        b, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table: expected page ids in [0, {num_rows}) (the pool's pages) in the columns a sequence "
            f"reads, got {int(block_table[b, c])} at sequence {b}, column {c} ({int(bad.sum())} such entries)"
        )


def kernel_support(
    device: torch.device,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    head_dim_v: int | None = None,
) -> str | None:
    """Why the Triton kernel cannot take a call on ``device`` with this head_dim (K's; V's
    ``head_dim_v`` when smaller), q's dtype and the cache's, or None. The kernel implements every
    feature of the op (``plan.Features``), so only the device, head dims and dtypes decide.

    The one home of that rule: the op's dispatch, the transformers integration, the simulator and
    the tensor-parallel grid report all ask here.
    """
    if device.type != "cuda" and not interpreted(decode_attention_fwd_kernel):
        return (
            f"backend: 'triton' on {device.type} tensors runs through the Triton interpreter; "
            "expected TRITON_INTERPRET=1 set before lean_tp is imported, got it unset"
        )
    try:
        get_config(device, head_dim, dtype, cache_dtype, head_dim_v)
    except ValueError as exc:
        return str(exc)
    return None


def uses_triton(
    device: torch.device,
    head_dim: int,
    dtype: torch.dtype,
    backend: str,
    cache_dtype: torch.dtype | None = None,
    head_dim_v: int | None = None,
) -> bool:
    """Which implementation a call runs; raises ``ValueError`` when "triton" is asked for (or "auto"
    on CUDA) and the kernel cannot take the call."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    reason = kernel_support(device, head_dim, dtype, cache_dtype, head_dim_v)
    if reason is not None:
        raise ValueError(reason)
    return True
