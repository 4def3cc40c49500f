"""The one description of a KV cache that ``decode_attention`` takes.

Two layouts, told apart by whether a block table comes with the cache:

- contiguous: ``(B, Hkv, S_max, D)``, any strides with ``stride(-1) == 1``; a "row" is a sequence;
- paged: ``(num_pages, page_size, Hkv, D)`` with ``block_table (B, max_pages_per_seq)``; a "row"
  is a page, and token ``n`` of sequence ``b`` is slot ``n % page_size`` of page
  ``block_table[b, n // page_size]``.

V's head dim may be below K's (MLA's latent cache): ``v_cache`` is then either a tensor of K's
shape but its last dim, or ``k_cache[..., :Dv]``, a view of K's own rows (``is_prefix_view``),
which the kernel reads once for both products.

Everything else (input checks, the launcher, the torch backend, the float64 reference, the
tests) reads heads, page size, capacity and strides from here instead of deriving them again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch._subclasses.functional_tensor import mb_unwrap_functional_tensor

# Each layout's shape in words, keyed by ``paged``, for error messages.
SHAPES = {False: "(B, Hkv, S_max, D)", True: "(num_pages, page_size, Hkv, D) with block_table"}


@dataclass(frozen=True)
class CacheLayout:
    paged: bool
    num_kv_heads: int
    head_dim: int  # K's
    page_size: int | None  # None for a contiguous cache
    capacity: int  # most tokens one sequence can hold
    dtype: torch.dtype
    k_strides: tuple[int, int, int]  # (row, token, head), in elements
    v_strides: tuple[int, int, int]
    head_dim_v: int  # V's: head_dim, or less

    @classmethod
    def of(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None) -> CacheLayout:
        """Describe 4-dim caches (shapes already checked by ``checks.check_inputs``)."""
        paged = block_table is not None
        # Contiguous (B, Hkv, S, D): row, token, head are dims 0, 2, 1. Paged (pages, page, Hkv, D): 0, 1, 2.
        dims = (0, 1, 2) if paged else (0, 2, 1)
        return cls(
            paged=paged,
            num_kv_heads=k_cache.shape[dims[2]],
            head_dim=k_cache.shape[-1],
            page_size=k_cache.shape[1] if paged else None,
            capacity=block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[2],
            dtype=k_cache.dtype,
            k_strides=tuple(k_cache.stride(d) for d in dims),
            v_strides=tuple(v_cache.stride(d) for d in dims),
            head_dim_v=v_cache.shape[-1],
        )

    def viewed_as(self, dtype: torch.dtype) -> CacheLayout:
        """The layout of the caches viewed as ``dtype`` (``Tensor.view(dtype)``): strides in its
        elements (the strides must be multiples of its size in bytes)."""
        ratio = dtype.itemsize // self.dtype.itemsize
        scale = lambda strides: tuple(x // ratio for x in strides)  # noqa: E731
        return dataclasses.replace(
            self,
            head_dim=self.head_dim // ratio,
            head_dim_v=self.head_dim_v // ratio,
            dtype=dtype,
            k_strides=scale(self.k_strides),
            v_strides=scale(self.v_strides),
        )


def is_prefix_view(v_cache: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether v_cache is ``k_cache[..., :Dv]`` with Dv below K's head dim: K's storage at K's
    offset and strides, so each of its rows is the start of K's (one tensor passed as both K and V
    is read as two, like any pair). Reads metadata only: fake tensors keep their views' aliasing,
    but Dynamo cannot trace the alias test, so only the op's plan asks (``launcher.plan_decode``).
    Under torch.compile the op's body sees functional wrappers, which alias nothing; the test asks
    the tensors they wrap."""
    v_cache, k_cache = mb_unwrap_functional_tensor(v_cache), mb_unwrap_functional_tensor(k_cache)
    return (
        v_cache.shape[-1] < k_cache.shape[-1]
        and torch._C._is_alias_of(v_cache, k_cache)
        and v_cache.dtype == k_cache.dtype
        and v_cache.storage_offset() == k_cache.storage_offset()
        and v_cache.stride() == k_cache.stride()
    )


def valid_keys(
    cache_seqlens: torch.Tensor, cache_leftpad: torch.Tensor | None, capacity: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(start, end), each (B,): sequence b's keys are cache positions ``[start[b], end[b])``;
    start is None (every sequence starts at 0) without left padding.

    The stored values clamped into the cache, ``end = clamp(cache_seqlens, 0, capacity)`` and
    ``start = clamp(cache_leftpad, 0, end)``, so that any value a scheduler writes, negative or
    past the capacity, names keys inside the cache (none when ``start == end``). The torch backend
    masks by it and the launcher hands the kernel its results: elementwise device ops, no sync.
    """
    end = cache_seqlens.clamp(0, capacity)
    start = torch.minimum(cache_leftpad.clamp_min(0), end) if cache_leftpad is not None else None
    return start, end
