"""The vLLM attention backend: backend class, metadata, metadata builder and impl.

The cache is vLLM's Triton-attention cache, one tensor per layer of logical shape
(num_blocks, Hkv, block_size, 2 * D) in the LBNHC physical order; its K and V halves, viewed as
(num_blocks, block_size, Hkv, D), are what ``lean_tp.decode_attention`` takes with a block table.
The builder reorders each batch so that decode requests come first (vLLM's reorder threshold) and
splits it: the leading requests that share one query length of at most ``MAX_QUERY_TOKENS`` (any
length up to vLLM's reorder threshold, 1 + the speculative tokens, in the batch-invariant mode) run
on lean in one call; the rest (prefills, chunked prefills, odd-length requests) run on the delegate,
vLLM's own Triton attention, with its metadata built for just those requests. Under
``VLLM_BATCH_INVARIANT=1`` every request of 1 to the reorder threshold's query tokens runs on lean
whatever its batch-mates' lengths: a batch that mixes lengths runs one lean call per length, and
the delegate takes only the requests from the first longer one on. Where vLLM runs no Triton (CPU)
the delegate and the cache writes are ``cpu.py``'s plain-torch paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from vllm import envs
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.ubatch_utils import UBatchSlice, split_attn_metadata

from lean_tp.integrations import op_backend_from_env
from lean_tp.integrations.vllm import NAME, cpu
from lean_tp.ops.decode_attention import decode_attention
from lean_tp.ops.decode_attention.checks import max_query_tokens
from lean_tp.ops.decode_attention.tuning import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, kernel_takes_head_dim

# Block sizes vLLM allocates that are pages the op takes: vLLM's block sizes are multiples of 16,
# the op's pages powers of two; both up to 256.
PAGE_SIZES = [16, 32, 64, 128, 256]
# vLLM's fp8 cache dtypes (stored as uint8) and what they hold.
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# vLLM's Triton attention, the delegate on GPUs, takes head sizes from 32 up.
MIN_HEAD_SIZE = 32
# The op's backend for decode: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch".
BACKEND_ENV = "LEAN_TP_VLLM_BACKEND"


def _triton_delegate() -> bool:
    """Whether vLLM's Triton attention takes prefill and writes the cache (it runs no Triton on CPU)."""
    return current_platform.is_cuda()


def head_size_problem(head_size: int) -> str | None:
    """Why the backend cannot take a head size, or None."""
    if head_size >= MIN_HEAD_SIZE and kernel_takes_head_dim(head_size):
        return None
    return (
        f"head_size: expected a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_SIZE}, {MAX_HEAD_DIM}] for the "
        f"{NAME} attention backend, got {head_size}"
    )


def op_backend() -> str:
    """The op backend decode runs on, from ``LEAN_TP_VLLM_BACKEND`` (default "auto")."""
    return op_backend_from_env(BACKEND_ENV)


class LeanAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_CACHE_DTYPES]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[LeanAttentionImpl]:
        return LeanAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[LeanAttentionMetadataBuilder]:
        return LeanAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(PAGE_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size_problem(head_size) is None

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major pages (page, slot, head, K|V): the layout vLLM's Triton attention defaults to.
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # Under VLLM_BATCH_INVARIANT=1 decode runs the op's batch-invariant mode (the impl reads it).
        return True

    @classmethod
    def supports_combination(
        cls,
        head_size,
        dtype,
        kv_cache_dtype,
        block_size,
        use_mla,
        has_sink,
        use_sparse,
        use_mm_prefix,
        device_capability,
    ) -> str | None:
        if kv_cache_dtype in FP8_CACHE_DTYPES and dtype not in (torch.float16, torch.bfloat16):
            return f"an fp8 KV cache needs a float16 or bfloat16 model, got {dtype}"
        return None


@dataclass
class CpuPrefill:
    """The requests after the decodes, for ``cpu.prefill_attention``."""

    query_start_loc: list[int]  # R + 1 token offsets, from 0
    seq_lens: torch.Tensor  # (R,) int32
    block_table: torch.Tensor  # (R, max_pages) int32


@dataclass
class LeanGroup:
    """Requests of one query length that run on lean in one call, wherever they sit in the batch."""

    query_len: int  # 1..the reorder threshold
    tokens: torch.Tensor  # (n * query_len,) int64, the requests' token rows, request after request
    seq_lens: torch.Tensor  # (n,) int32, keys per request including its new tokens
    block_table: torch.Tensor  # (n, max_pages) int32


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to ``device`` without waiting for the device's queued work."""
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def lean_groups(
    query_start_loc_cpu: torch.Tensor,
    requests: range,
    max_query_len: int,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> list[LeanGroup]:
    """The requests in ``requests`` with 1 to ``max_query_len`` query tokens, one group per query
    length (ascending), found on the host; their indices reach the device in one copy.

    query_start_loc_cpu: host token offsets, one per request and one past the last; seq_lens (R,)
    and block_table (R, max_pages) on the device, indexed by request."""
    starts = query_start_loc_cpu[: requests.stop + 1].long()
    lens = starts[requests.start + 1 :] - starts[requests.start : -1]
    lengths = [n for n in torch.unique(lens).tolist() if 1 <= n <= max_query_len]
    if not lengths:
        return []
    host = []  # per length: its requests, then their token rows
    for n in lengths:
        reqs = requests.start + torch.nonzero(lens == n).flatten()
        host += [reqs, (starts[reqs, None] + torch.arange(n)).flatten()]
    index = _to_device(torch.cat(host), seq_lens.device).split([t.numel() for t in host])
    return [
        LeanGroup(n, index[2 * i + 1], seq_lens[index[2 * i]], block_table[index[2 * i]]) for i, n in enumerate(lengths)
    ]


@dataclass
class LeanAttentionMetadata:
    num_actual_tokens: int
    num_decodes: int  # leading requests that run on lean, q viewed as (num_decodes, Tq, Hq, D)
    decode_query_len: int  # their common query length, 1..the reorder threshold
    seq_lens: torch.Tensor  # (num_decodes,) int32, keys per request including its new tokens
    block_table: torch.Tensor  # (num_decodes, max_pages) int32
    slot_mapping: torch.Tensor  # (num_actual_tokens,) int64
    # The delegate's metadata for the requests whose tokens run from prefill_start on, or None.
    prefill: object | None = None
    prefill_start: int = 0
    # Batch-invariant mode, a batch of several query lengths: the requests that run on lean, one
    # call per length (num_decodes is then 0). A request the delegate also took is overwritten.
    groups: list[LeanGroup] = field(default_factory=list)


class LeanAttentionMetadataBuilder(AttentionMetadataBuilder[LeanAttentionMetadata]):
    # A CUDA graph is captured for batches of decodes of one query length, which run on lean alone
    # as the leading run; a mixed batch's split (and its lean groups) is decided on the host, so it
    # is never replayed from a graph.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first; with speculative decoding a verification request (1 + k tokens) is a decode.
        # The batch-invariant mode takes any query length, so every verification runs on lean.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.batch_invariant = bool(envs.VLLM_BATCH_INVARIANT)
        self.reorder_batch_threshold = min(self.reorder_batch_threshold, max_query_tokens(self.batch_invariant))
        self.delegate = None
        if _triton_delegate():
            from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

            self.delegate = TritonAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)

    def _decode_split(self, common: CommonAttentionMetadata) -> tuple[int, int]:
        """(leading requests that run on lean, their query length); (0, 1) when none can."""
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            common, decode_threshold=self.reorder_batch_threshold, require_uniform=True
        )
        if num_decodes == 0:
            return 0, 1
        starts = common.query_start_loc_cpu[: num_decodes + 1]
        query_len = int((starts[1:] - starts[:-1]).max())
        # Padding requests (query length 0) must sit on padded tokens for the (B, Tq) view.
        if query_len == 0 or num_decode_tokens != num_decodes * query_len:
            return 0, 1
        return num_decodes, query_len

    def _invariant_split(self, common: CommonAttentionMetadata, num_decodes: int) -> tuple[list[LeanGroup], int]:
        """Batch-invariant mode: (the lean groups, the first request the delegate takes). A request's
        path may depend only on its own query length, so when requests of 1 to the threshold's
        tokens follow the leading run (another length, or behind a prefill), every such request
        runs in its length's group; the delegate takes the requests from the first longer one on."""
        starts = common.query_start_loc_cpu[: common.num_reqs + 1]
        lens = starts[1:] - starts[:-1]
        threshold = self.reorder_batch_threshold
        rest = lens[num_decodes:]
        if not bool(((rest >= 1) & (rest <= threshold)).any()):
            return [], num_decodes
        longer = torch.nonzero(lens > threshold)
        groups = lean_groups(starts, range(common.num_reqs), threshold, common.seq_lens, common.block_table_tensor)
        block_size = self.kv_cache_spec.block_size
        groups = [replace(g, block_table=_pages_in_use(g.block_table, g.seq_lens, block_size)) for g in groups]
        return groups, int(longer[0]) if len(longer) else common.num_reqs

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> LeanAttentionMetadata:
        common = common_attn_metadata
        num_decodes, query_len = self._decode_split(common)
        groups, first_delegated = [], num_decodes
        if self.batch_invariant:
            groups, first_delegated = self._invariant_split(common, num_decodes)
            if groups:
                num_decodes = 0
        prefill_start = int(common.query_start_loc_cpu[first_delegated])
        metadata = LeanAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_decodes=num_decodes,
            decode_query_len=query_len,
            seq_lens=common.seq_lens[:num_decodes],
            block_table=_pages_in_use(
                common.block_table_tensor[:num_decodes], common.seq_lens[:num_decodes], self.kv_cache_spec.block_size
            ),
            slot_mapping=common.slot_mapping,
            prefill_start=prefill_start,
            groups=groups,
        )
        if first_delegated < common.num_reqs and prefill_start < common.num_actual_tokens:
            rest = UBatchSlice(slice(first_delegated, common.num_reqs), slice(prefill_start, common.num_actual_tokens))
            rest_metadata = split_attn_metadata([rest], common)[0]
            if self.delegate is not None:
                metadata.prefill = self.delegate.build(0, rest_metadata, fast_build)
            else:
                metadata.prefill = CpuPrefill(
                    rest_metadata.query_start_loc_cpu.tolist(), rest_metadata.seq_lens, rest_metadata.block_table_tensor
                )
        return metadata


def _pages_in_use(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """On CPU, the block table's leading columns that hold the longest request's pages, so that the
    torch backend's work follows the requests' lengths, not vLLM's longest allowed one (reading a
    CPU tensor costs no sync). On GPUs the whole table: its width is the cache's capacity, which a
    captured CUDA graph keeps for every replay, so it must not shrink with one batch's lengths.
    block_table (R, max_pages) int32, seq_lens (R,) int32."""
    if block_table.device.type != "cpu" or seq_lens.numel() == 0:
        return block_table
    return block_table[:, : max(1, -(-int(seq_lens.max()) // block_size))]


class LeanAttentionImpl(AttentionImpl[LeanAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported,
    ) -> None:
        _check_layer(head_size, alibi_slopes, kv_cache_dtype, attn_type, unsupported)
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.window = sliding_window
        self.softcap = logits_soft_cap or None  # vLLM's 0 means no cap, as the op's None does
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.op_backend = op_backend()
        # vLLM's batch-invariant mode: a request's decode bits must not depend on its batch-mates.
        self.batch_invariant = bool(envs.VLLM_BATCH_INVARIANT)
        self.delegate = None
        if _triton_delegate():
            from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

            self.delegate = TritonAttentionImpl(
                num_heads,
                head_size,
                scale,
                num_kv_heads,
                None,
                sliding_window,
                kv_cache_dtype,
                logits_soft_cap,
                attn_type,
                kv_sharing_target_layer_name,
                sinks,
            )
        # What an fp8 cache holds is what its writer stores: vLLM's Triton cache write stores every
        # fp8 cache, "fp8_e5m2" included, in its platform's fp8 type (e4m3); cpu.py stores the named one.
        self.fp8_dtype = FP8_CACHE_DTYPES.get(kv_cache_dtype)
        if self.fp8_dtype is not None and self.delegate is not None:
            self.fp8_dtype = current_platform.fp8_dtype()

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_blocks, Hkv, block_size, 2D) cache -> K and V as (num_blocks, block_size, Hkv, D)."""
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        if self.fp8_dtype is not None:
            key_cache, value_cache = key_cache.view(self.fp8_dtype), value_cache.view(self.fp8_dtype)
        return key_cache, value_cache

    def _scales(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's fp8 k_scale and v_scale as (1,) float32 views; None for a 16/32-bit cache."""
        if self.fp8_dtype is None:
            return None, None
        return layer._k_scale.view(1), layer._v_scale.view(1)

    def _features(self, layer) -> dict:
        """The op's keyword arguments for this layer."""
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()  # (Hq,): a small copy, same shape every step
        k_scale, v_scale = self._scales(layer)
        return dict(
            softmax_scale=self.scale,
            softcap=self.softcap,
            window=self.window,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def do_kv_cache_update(
        self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write the batch's new K and V, (T, Hkv, D) each, at ``slot_mapping`` (T,) int64 (-1: padding)
        into ``kv_cache`` (num_blocks, Hkv, block_size, 2 * D)."""
        if self.delegate is not None:
            self.delegate.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return
        cpu.write_kv_cache(key, value, *self._kv_views(kv_cache), slot_mapping, *self._scales(layer))

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: LeanAttentionMetadata | None,
        output: torch.Tensor,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        """Attention of the batch's query tokens into ``output``.

        Args:
            query: (T, Hq, D), decodes' tokens first (vLLM's reorder).
            key, value: (T, Hkv, D), already in the cache (``do_kv_cache_update`` ran first); only
                the delegate's signature takes them.
            kv_cache: (num_blocks, Hkv, block_size, 2 * D) logical, LBNHC physical.
            output: (T, Hq, D), written for every real token.
        """
        if output_scale is not None or output_block_scale is not None:
            raise ValueError(
                f"output_scale: expected None (the {NAME} backend fuses no output quantization), got a scale"
            )
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        meta = attn_metadata
        caches = self._kv_views(kv_cache)
        features = self._features(layer)
        if meta.num_decodes:
            split = meta.num_decodes * meta.decode_query_len
            out = self._decode(query[:split], meta.decode_query_len, meta.seq_lens, meta.block_table, caches, features)
            output[:split].copy_(out)
        if meta.prefill is not None:
            start, end = meta.prefill_start, meta.num_actual_tokens
            if self.delegate is not None:
                self.delegate.forward(
                    layer, query[start:end], key[start:end], value[start:end], kv_cache, meta.prefill, output[start:end]
                )
            else:
                p = meta.prefill
                cpu.prefill_attention(
                    query[start:end],
                    *caches,
                    output[start:end],
                    p.query_start_loc,
                    p.seq_lens,
                    p.block_table,
                    **features,
                )
        # After the delegate: a group's request that it took too (behind a longer one) gets lean's rows.
        for g in meta.groups:
            out = self._decode(query[g.tokens], g.query_len, g.seq_lens, g.block_table, caches, features)
            output.index_copy_(0, g.tokens, out.to(output.dtype))
        return output

    def _decode(self, q, query_len: int, seq_lens, block_table, caches, features: dict) -> torch.Tensor:
        """Lean on q (B * query_len, Hq, D), each request's tokens together, over ``caches`` (K and V
        as ``_kv_views`` gives them); returns (B * query_len, Hq, D) in q's dtype."""
        tokens = q.shape[0]
        if query_len > 1:
            q = q.view(tokens // query_len, query_len, *q.shape[1:])
        out = decode_attention(
            q,
            *caches,
            seq_lens,
            block_table=block_table,
            backend=self.op_backend,
            batch_invariant=self.batch_invariant,
            **features,
        )
        return out.view(tokens, *out.shape[-2:])


def _check_layer(head_size: int, alibi_slopes, kv_cache_dtype: str, attn_type: str, unsupported: dict) -> None:
    """ValueError naming the setting for a layer the backend cannot run."""
    problem = head_size_problem(head_size)
    if problem is not None:
        raise ValueError(problem)
    if attn_type != AttentionType.DECODER:
        got = getattr(attn_type, "value", attn_type)
        raise ValueError(f"attn_type: expected {AttentionType.DECODER.value!r} for the {NAME} backend, got {got!r}")
    if alibi_slopes is not None:
        raise ValueError(f"alibi_slopes: expected None (the {NAME} backend has no ALiBi), got slopes")
    if kv_cache_dtype not in LeanAttentionBackend.supported_kv_cache_dtypes:
        raise ValueError(
            f"kv_cache_dtype: expected one of {LeanAttentionBackend.supported_kv_cache_dtypes} for the {NAME} backend, "
            f"got {kv_cache_dtype!r}"
        )
    # Layer arguments that change the attention itself; the defaults mean "off".
    defaults = {"use_alibi_sqrt": False, "chunk_lookback": -1}
    for name, value in unsupported.items():
        if name not in defaults or value != defaults[name]:
            raise ValueError(f"{name}: expected it unset for the {NAME} backend, got {value!r}")
