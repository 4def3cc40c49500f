"""``LEAN_MLA``: MLA decode (DeepSeek-V2/V3, Kimi-K2) on ``lean_tp.decode_attention``, in vLLM's
MLA common backend.

vLLM's MLA layer runs prefill non-absorbed through the impl's prefill path and decode absorbed
through ``forward_mqa``: q (rows, H, kv_lora_rank + rope) over the latent cache (num_blocks,
block_size, kv_lora_rank + rope). ``LEAN_MLA`` keeps vLLM's prefill, metadata and cache writes
and runs ``forward_mqa`` on lean, the cache passed as K and its first ``kv_lora_rank`` columns as
V (a view: the kernel reads each latent row once for both products). Decode requests share one
query length (vLLM's uniform split), except under ``VLLM_BATCH_INVARIANT=1``, where every leading
request of up to the reorder threshold's tokens is a decode and each length runs as one lean call.
The impl is vLLM's MLA common impl on GPUs (the prefill path Triton MLA runs; metadata from
``MLACommonMetadataBuilder``) and its CPU MLA's on CPU, where vLLM always picks ``CPU_MLA``, so
``LEAN_MLA`` runs in its place (``lean_tp.integrations.vllm.in_place_of("CPU_MLA")``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm import envs
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

from lean_tp.integrations.vllm.backend import FP8_CACHE_DTYPES, PAGE_SIZES, LeanGroup, lean_groups, op_backend
from lean_tp.ops.decode_attention import decode_attention
from lean_tp.ops.decode_attention.checks import max_query_tokens

logger = init_logger(__name__)

NAME_MLA = "LEAN_MLA"
# The latent row the kernel has a tuning entry for (kv_lora_rank 512 + 64 rope dims).
MLA_HEAD_SIZES = [576]
# Latent caches on GPUs: vLLM's MLA forward views every fp8 cache as e4m3 (Triton MLA's set), so an
# e5m2 cache would be read as e4m3 bytes.
MLA_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")


def lean_forward_mqa(
    impl, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, metadata, layer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed decode of ``metadata.decode``'s requests on lean: q (rows, H, rank + rope), rows =
    requests x a uniform query length, or any lengths with ``decode.groups`` (one lean call per
    length); kv_cache (num_blocks, block_size, rank + rope), fp8 viewed as such by vLLM, with
    ``layer._k_scale`` for the latent rows. Returns out (rows, H, rank) in q's dtype and lse
    (rows, H) float32, natural log: under decode context parallelism (DCP) the attention over this
    rank's keys, which vLLM's DCP combine merges across ranks by the lse.

    A causal block of up to ``MAX_QUERY_TOKENS`` drafts per request (any number in the
    batch-invariant mode) runs as one query of Tq tokens; longer or non-causal blocks, and every
    multi-token block under DCP, run one row per query token, each with its own length.
    """
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    decode = metadata.decode
    causal = getattr(metadata, "causal", True)
    groups = getattr(decode, "groups", None)
    if not groups:
        lens = decode.seq_lens if impl.dcp_world_size == 1 else decode.dcp_tot_seq_lens
        return _mqa(impl, q, kv_cache, lens, decode.block_table, causal, layer)
    rows, heads = q.shape[:2]
    out = q.new_zeros(rows, heads, impl.kv_lora_rank)
    lse = torch.zeros(rows, heads, dtype=torch.float32, device=q.device)
    for g in groups:
        group_out, group_lse = _mqa(impl, q[g.tokens], kv_cache, g.seq_lens, g.block_table, causal, layer)
        out.index_copy_(0, g.tokens, group_out)
        lse.index_copy_(0, g.tokens, group_lse)
    return out, lse


def _mqa(impl, q, kv_cache, seq_lens, block_table, causal: bool, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """One lean call: q (rows, H, rank + rope), rows = requests x one query length; seq_lens
    (requests,) keys of each whole sequence (under DCP, over every rank: each row's extent is
    mapped to the keys this rank holds, by vLLM's own interleave rule)."""
    requests, (rows, heads, _) = seq_lens.shape[0], q.shape
    tq = rows // requests if requests else 1
    dcp = impl.dcp_world_size
    kv = kv_cache.unsqueeze(2)  # one latent "head"
    scale = layer._k_scale if kv.dtype in FP8_CACHE_DTYPES.values() else None
    if tq > 1 and not (causal and tq <= max_query_tokens(impl.batch_invariant) and dcp == 1):
        block_table = block_table.repeat_interleave(tq, dim=0)
        offsets = torch.arange(1 - tq, 1, device=seq_lens.device, dtype=seq_lens.dtype) if causal else 0
        seq_lens = (seq_lens[:, None] + offsets).expand(-1, tq).flatten().clamp_min(0)
        tq = 1
    if dcp > 1:
        seq_lens = get_dcp_local_seq_lens(seq_lens, dcp, impl.dcp_rank, impl.dcp_interleave)
    out, lse = decode_attention(
        q.view(rows // tq, tq, heads, -1) if tq > 1 else q,
        kv,
        kv[..., : impl.kv_lora_rank],
        seq_lens.to(torch.int32),
        block_table=block_table.to(torch.int32),
        softmax_scale=impl.scale,
        return_lse=True,
        backend=impl.op_backend,
        k_scale=scale,
        v_scale=scale,
        batch_invariant=impl.batch_invariant,
    )
    return out.view(rows, heads, -1), lse.view(rows, heads)


def _dcp_interleave() -> int:
    """Consecutive keys a DCP rank holds before the next rank's (vLLM's
    ``cp_kv_cache_interleave_size``; 1 outside an engine)."""
    config = get_current_vllm_config_or_none()
    return 1 if config is None else config.parallel_config.cp_kv_cache_interleave_size


class LeanMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """GPU: vLLM's MLA common impl (its prefill path, as Triton MLA runs it) with decode on lean.
    Every attribute lean reads is set here, so no parent's ``__init__`` matters beyond
    ``MLACommonImpl``'s. fp8 latent caches (e4m3) run on sm_80 too: the kernel converts e4m3 by
    hand there. Decode context parallelism: ``forward_mqa`` returns each rank's lse."""

    supports_dcp: bool = True
    can_return_lse_for_decode: bool = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:  # fmt: skip
        _check_layer(alibi_slopes, sliding_window, logits_soft_cap, attn_type, kv_cache_dtype)
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        if kv_cache_dtype in FP8_CACHE_DTYPES:
            self.supports_quant_query_input = False  # bf16 q against the fp8 latent rows
        self.op_backend, self.batch_invariant = op_backend(), bool(envs.VLLM_BATCH_INVARIANT)
        self.dcp_interleave = _dcp_interleave()
        _no_prefix_caching_when_invariant(self.batch_invariant)

    def reserve_workspace(self) -> None:
        """The profile run's claim (vLLM 0.33 calls it with no metadata): none. Lean's workspace
        is sized by the grid, 64 KB a slot of 16 rows x 512 fp32 (``alloc_workspace``): 2 slots a
        program by default, 8.4 MB for an H100's 132 programs, and 8 a program and more in the
        batch-invariant mode. It is allocated per call from torch's caching allocator, out of the
        memory vLLM keeps outside the KV cache. Triton MLA's split-KV scratch, which its
        ``reserve_workspace`` claims, lean never uses."""

    forward_mqa = lean_forward_mqa


class LeanCPUMLAImpl(CPUMLAImpl):
    """CPU: vLLM's CPU MLA impl (its SDPA prefill and cache writes) with decode on lean."""

    def __init__(self, *args, **mla_args) -> None:
        super().__init__(*args, **mla_args)
        self.op_backend, self.batch_invariant = op_backend(), bool(envs.VLLM_BATCH_INVARIANT)
        self.dcp_interleave = _dcp_interleave()
        _no_prefix_caching_when_invariant(self.batch_invariant)

    def reserve_workspace(self) -> None:
        """No scratch to claim in the profile run (see ``LeanMLAImpl.reserve_workspace``)."""

    forward_mqa = lean_forward_mqa


def _no_prefix_caching_when_invariant(batch_invariant: bool) -> None:
    """Under ``VLLM_BATCH_INVARIANT=1`` prefix caching goes off, as vLLM turns it off for Triton MLA
    by name: MLA's prefill over a cached prefix attends the prefix and the new tokens apart and
    merges the two, so a prompt's bits would depend on whether another request cached its prefix.
    Lean's decode does not depend on it; the prefill path it shares with Triton MLA does."""
    config = get_current_vllm_config_or_none() if batch_invariant else None  # an engine builds layers under one
    cache_config = None if config is None else config.cache_config
    if cache_config is not None and cache_config.enable_prefix_caching:
        logger.warning_once(f"Disabling prefix caching for {NAME_MLA} with batch invariance (MLA prefill).")
        cache_config.enable_prefix_caching = False


def _check_layer(alibi_slopes, sliding_window, logits_soft_cap, attn_type, kv_cache_dtype: str) -> None:
    """MLA layers as DeepSeek's: decoder self-attention with none of alibi, window or softcap, over
    a 16-bit or e4m3 latent cache (vLLM's MLA layer views every fp8 cache as e4m3)."""
    if kv_cache_dtype not in MLA_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: expected one of {MLA_CACHE_DTYPES} for the {NAME_MLA} backend, got {kv_cache_dtype!r}"
        )
    given = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    for name, value in given.items():
        if value:
            raise ValueError(f"{name}: expected None for the {NAME_MLA} backend (MLA models use none), got {value!r}")
    if attn_type != AttentionType.DECODER:
        raise ValueError(f"attn_type: expected decoder self-attention for the {NAME_MLA} backend, got {attn_type!r}")


@dataclass
class LeanMLADecodeMetadata(MLACommonDecodeMetadata):
    # Decodes of several query lengths (batch-invariant mode): the requests of each length, which
    # forward_mqa runs as one lean call each.
    groups: list[LeanGroup] = field(default_factory=list)


class LeanMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    # Uniform multi-token decode blocks (MTP/EAGLE verification) go to forward_mqa, as one query
    # of Tq tokens or one row per token; CUDA graphs capture uniform decode batches.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    supports_non_causal_multi_token_decode: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        # Batch-invariant mode: a request's path may depend only on its own query length, so every
        # leading request of 1 to the reorder threshold's tokens is a decode (VARLEN), not only
        # those of the first one's length; the decode metadata then groups them by length.
        self.batch_invariant = bool(envs.VLLM_BATCH_INVARIANT)
        if self.batch_invariant:
            self.query_len_support = QueryLenSupport.VARLEN
        super().__init__(*args, **kwargs)

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> LeanMLADecodeMetadata:
        groups = []
        lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
        longest = int(lens.max()) if lens.numel() else 0
        # A (B, Tq) view of the decode rows needs one length, or padding requests on padded tokens.
        uniform = bool(((lens == longest) | (lens == 0)).all()) and num_decode_tokens == lens.numel() * longest
        if self.batch_invariant and not uniform:
            # Under DCP, groups carry whole-sequence lengths: forward_mqa maps each row's to this rank's.
            whole = seq_lens_device if dcp_tot_seq_lens_device is None else dcp_tot_seq_lens_device
            groups = lean_groups(query_start_loc_cpu, range(lens.numel()), longest, whole, block_table_tensor)
        return LeanMLADecodeMetadata(block_table_tensor, seq_lens_device, dcp_tot_seq_lens_device, groups)


class LeanMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = (
        [torch.float16, torch.bfloat16, torch.float32] if current_platform.is_cpu() else [torch.float16, torch.bfloat16]
    )
    # vLLM's CPU MLA cache write stores the model's dtype only.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"] if current_platform.is_cpu() else list(MLA_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME_MLA

    @staticmethod
    def get_impl_cls() -> type[MLACommonImpl]:
        return LeanCPUMLAImpl if current_platform.is_cpu() else LeanMLAImpl

    @staticmethod
    def get_builder_cls() -> type[LeanMLAMetadataBuilder]:
        return LeanMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(MLA_HEAD_SIZES)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(PAGE_SIZES)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size in PAGE_SIZES

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # under VLLM_BATCH_INVARIANT=1 decode runs the op's batch-invariant mode

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8  # sm_80 and later: the kernel's tuning entries
