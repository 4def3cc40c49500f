"""The SGLang attention backend: decode and chain verification on lean, the rest on a delegate.

SGLang keeps each layer's keys and values in a token-to-KV pool, ``(num_slots, Hkv, D)`` per layer
(slot 0 is padding), and maps request ``r``'s position ``j`` to a slot with
``req_to_token[r, j]``. With a page size ``ps`` that is a power of two the pool is a paged cache
``(num_slots / ps, ps, Hkv, D)`` and a request's block table is every ``ps``-th entry of its
``req_to_token`` row divided by ``ps``; SGLang's default ``ps = 1`` makes the pool one-token pages
and the row itself the block table. MLA models (DeepSeek) keep one latent row per token
(``MLATokenToKVPool``, ``(num_slots, 1, kv_lora_rank + rope)``): it is the op's K, and its first
``kv_lora_rank`` columns, a view, its V. Each forward builds that table once, for all layers, from the
columns its longest request uses (one gather per step; the op reads tables by sequence, not by
SGLang's request slot). Under CUDA graphs the table and lengths live in buffers sized at capture
and refilled before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.runtime_context import get_exec, get_spec
from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

from lean_tp.integrations import op_backend_from_env
from lean_tp.integrations.sglang import NAME
from lean_tp.ops.decode_attention import decode_attention
from lean_tp.ops.decode_attention.checks import FP8_DTYPES, is_page_size, max_query_tokens
from lean_tp.ops.decode_attention.tuning import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, head_dim_pairs, kernel_takes_head_dim

# The op backend decode runs on: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch".
BACKEND_ENV = "LEAN_TP_SGLANG_BACKEND"


@dataclass
class LeanForwardMetadata:
    """What one forward's lean calls share across layers."""

    seq_lens: torch.Tensor  # (B,) int32, keys per request including this step's tokens
    block_table: torch.Tensor  # (B, pages) int32, pages of the pool viewed as (slots / page, page, Hkv, D)
    query_len: int  # tokens per request: 1 for decode, the draft length for verification


@dataclass
class GraphBuffers:
    """Lengths and table at fixed addresses for CUDA-graph capture and replay."""

    seq_lens: torch.Tensor  # (max_bs,) int32
    block_table: torch.Tensor  # (max_bs, max_pages) int32


def cache_page_size(page_size: int) -> int:
    """The page size the op sees: SGLang's when it is a power of two, else one-token pages (every
    token's slot is in ``req_to_token``, so any page size reads correctly as pages of one)."""
    return page_size if is_page_size(page_size) else 1


def runner_problem(model_runner) -> str | None:
    """Why the backend cannot serve a model runner, naming the setting; None if it can."""
    spec = getattr(model_runner, "spec_algorithm", None)
    # Compact ragged verification (DSpark) packs each request's own number of drafts into one
    # verify batch; lean's verify call takes one number per batch (SGLang's draft_token_num).
    if spec is not None and spec.supports_ragged_verify() and read_ragged_verify_mode() is RaggedVerifyMode.COMPACT:
        return (
            f"SGLANG_RAGGED_VERIFY_MODE: expected static or cap-accept for the {NAME} backend (one draft "
            "count per verify batch), got 'compact'"
        )
    pool = model_runner.token_to_kv_pool
    if model_runner.use_mla_backend:
        if type(pool) is not MLATokenToKVPool or pool.use_dsa:
            return (
                f"KV pool: expected SGLang's MLATokenToKVPool (dense MLA) for the {NAME} backend, got "
                f"{type(pool).__name__}{' with DSA' if getattr(pool, 'use_dsa', False) else ''}"
            )
        return None
    if model_runner.model_config.is_encoder_decoder:
        return f"model: expected a decoder-only model for the {NAME} backend, got an encoder-decoder (cross attention)"
    if type(pool) is not MHATokenToKVPool:
        return (
            f"KV pool: expected SGLang's MHATokenToKVPool for the {NAME} backend, got {type(pool).__name__} "
            "(hybrid sliding-window pools: pass --disable-hybrid-swa-memory)"
        )
    if pool.use_hnd:
        return f"SGLANG_USE_HND_KVCACHE: expected it off for the {NAME} backend (token-major pages), got on"
    if pool.is_quantized_kv_cache:
        return (
            f"kv_cache_dtype: expected auto or an fp8 type for the {NAME} backend, got a quantized (scaled-block) cache"
        )
    translator = getattr(model_runner, "kv_index_translator", None)
    if translator is not None and translator.is_translating:
        return f"KV pool: expected physical slot ids for the {NAME} backend, got a unified (translated) pool"
    return None


def layer_problem(layer) -> str | None:
    """Why the backend cannot run a layer, naming the setting; None if it can."""
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        got = getattr(layer.attn_type, "value", layer.attn_type)
        return (
            f"attn_type: expected decoder self-attention for the {NAME} backend, got {got} "
            f"(cross attention: {layer.is_cross_attention})"
        )
    if layer.qk_head_dim != layer.v_head_dim:
        if (layer.qk_head_dim, layer.v_head_dim) not in head_dim_pairs():
            return (
                f"head_dim: expected equal q/k and v head dims, or an MLA pair in {head_dim_pairs()}, for the "
                f"{NAME} backend, got {layer.qk_head_dim} and {layer.v_head_dim}"
            )
    elif not kernel_takes_head_dim(layer.qk_head_dim):
        return (
            f"head_dim: expected a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM} for the {NAME} backend, "
            f"got {layer.qk_head_dim}"
        )
    if layer.logit_cap > 0 and layer.logit_capping_method != "tanh":
        return f"logit_capping_method: expected 'tanh' for the {NAME} backend, got {layer.logit_capping_method!r}"
    return None


def _or_one(scale: float | None) -> float:
    return 1.0 if scale is None else scale


def mla_scale(layer, delegate_scales_rows: bool) -> float:
    """The factor an MLA layer's latent rows are read with. SGLang's Triton backend (lean's
    delegate on GPUs) stores ``k / layer.k_scale`` whenever the layer has a KV scale, in 16-bit
    caches too, and reads rows back times ``k_scale_float``; its torch-native backend (the CPU
    delegate) stores and reads rows unscaled. Lean follows its delegate, so one pool holds one
    convention."""
    return layer.k_scale_float if delegate_scales_rows and layer.k_scale is not None else 1.0


def _is_triton(delegate: AttentionBackend) -> bool:
    """Whether the delegate is SGLang's Triton backend: it stores MLA rows divided by the layer's
    KV scale (``mla_scale``), keeps CUDA-graph state and a verify mask; the torch-native one none."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return isinstance(delegate, TritonAttnBackend)


def _check_lean_kwargs(kwargs: dict) -> None:
    """``ValueError`` for a score modifier on a forward lean runs (decode, chain verification): the
    op has none. Prefill passes them to the delegate."""
    for name in ("score_mod", "aux_tensors"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}: expected None for the {NAME} backend's decode and chain verification (the "
                f"op applies no score modifier), got {type(kwargs[name]).__name__}"
            )


def _delegate(model_runner, on_gpu: bool) -> AttentionBackend:
    """SGLang's own backend for what lean does not run: Triton on GPUs, torch-native elsewhere."""
    if on_gpu:
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(model_runner)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend(model_runner)


class LeanAttnBackend(AttentionBackend):
    """``--attention-backend lean``: ``decode_attention`` for decode and chain verification."""

    def __init__(self, model_runner):
        super().__init__()
        problem = runner_problem(model_runner)
        if problem is not None:
            raise ValueError(problem)
        # The delegate is SGLang's Triton backend on GPUs (graphs, sinks), its torch-native one elsewhere.
        self.on_gpu = torch.device(model_runner.device).type == "cuda"
        self.delegate = _delegate(model_runner, self.on_gpu)
        self.triton_delegate = _is_triton(self.delegate)
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token  # (max_reqs, max_context_len) int32
        self.page_size = cache_page_size(model_runner.page_size)
        self.max_pages = -(-self.req_to_token.shape[1] // self.page_size)  # a table row at full context
        # The EAGLE workers size a verify mask with it when a batch's seq_lens_sum is unknown.
        self.max_context_len = model_runner.model_config.context_len
        self.op_backend = op_backend_from_env(BACKEND_ENV)
        # SGLang's deterministic inference: a request's decode bits must not depend on its batch-mates.
        self.batch_invariant = bool(get_exec().deterministic.enable_deterministic_inference)
        # SGLANG_ENABLE_METADATA_GLUE_GRAPH records init_forward_metadata_out_graph into a CUDA graph,
        # which would freeze a table width taken from host lengths: graph tables are then full width.
        self.full_width_graph_tables = bool(envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get())
        self.graph: GraphBuffers | None = None
        self._graph_sizes, self._delegate_graph_state = (0, 0), False
        self.forward_metadata: LeanForwardMetadata | None = None  # None: the delegate runs this forward
        self._checked_layers: set[int] = set()

    # -- metadata ---------------------------------------------------------------------------------

    def query_len(self, forward_batch) -> int | None:
        """Tokens per request if lean runs this forward, else None."""
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return 1
        if mode.is_target_verify():
            spec = forward_batch.spec_info
            # A chain of drafts (topk 1) verifies causally; a tree needs the delegate's custom mask.
            tokens = max_query_tokens(self.batch_invariant)
            if spec is not None and getattr(spec, "topk", None) == 1 and 1 <= spec.draft_token_num <= tokens:
                return spec.draft_token_num
        return None

    def delegate_replays_graphs(self) -> bool:
        """Whether a CUDA-graph forward can reach the delegate: only a verification lean does not
        take (a tree of drafts, or more drafts than lean's bound). Decode graphs are lean's."""
        spec = get_spec()
        if not spec.speculative_algorithm:
            return False
        drafts = spec.speculative_num_draft_tokens or 1
        return (spec.speculative_eagle_topk or 1) != 1 or drafts > max_query_tokens(self.batch_invariant)

    def _pages(self, keys_cpu: torch.Tensor | None) -> int:
        """Block-table columns for a batch whose longest request has ``max(keys_cpu)`` keys (a host
        tensor SGLang keeps, so no sync); the full width when it is not known."""
        if keys_cpu is None or keys_cpu.numel() == 0:
            return self.max_pages
        return min(self.max_pages, max(1, -(-int(keys_cpu.max()) // self.page_size)))

    def _fill_table(self, out: torch.Tensor, req_pool_indices: torch.Tensor, pages: int) -> None:
        """out[:, :pages] = the requests' block tables (out: (B, >= pages) int32)."""
        rows = self.req_to_token[req_pool_indices.long(), : pages * self.page_size : self.page_size]
        out[:, :pages].copy_(rows if self.page_size == 1 else rows // self.page_size)

    def _metadata(self, forward_batch, query_len: int, graph: GraphBuffers | None) -> LeanForwardMetadata:
        seq_lens = forward_batch.seq_lens
        keys_cpu = forward_batch.seq_lens_cpu
        if query_len > 1:  # verification: seq_lens excludes the drafts, which are already in req_to_token
            seq_lens = seq_lens + query_len
            keys_cpu = None if keys_cpu is None else keys_cpu + query_len
        pages = self.max_pages if graph is not None and self.full_width_graph_tables else self._pages(keys_cpu)
        batch = seq_lens.shape[0]
        if graph is None:
            table = torch.empty(batch, pages, dtype=torch.int32, device=seq_lens.device)
            self._fill_table(table, forward_batch.req_pool_indices, pages)
            return LeanForwardMetadata(seq_lens.to(torch.int32), table, query_len)
        graph.seq_lens[:batch].copy_(seq_lens)
        self._fill_table(graph.block_table[:batch], forward_batch.req_pool_indices, pages)
        return LeanForwardMetadata(graph.seq_lens[:batch], graph.block_table[:batch], query_len)

    def init_forward_metadata(self, forward_batch):
        query_len = self.query_len(forward_batch)
        if query_len is None:
            self.forward_metadata = None
            self.delegate.init_forward_metadata(forward_batch)
        else:
            self.forward_metadata = self._metadata(forward_batch, query_len, graph=None)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        device = self.req_to_token.device
        self.graph = GraphBuffers(
            torch.zeros(max_bs, dtype=torch.int32, device=device),
            torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=device),
        )
        self._graph_sizes, self._delegate_graph_state = (max_bs, max_num_tokens), False
        # The Triton delegate's graph state (split-KV logits of tokens x heads x splits x v_head_dim
        # fp32: gigabytes for MLA) only where a captured forward can reach it; the torch-native
        # delegate keeps none.
        if self.triton_delegate and self.delegate_replays_graphs():
            self._init_delegate_graph_state()

    def _init_delegate_graph_state(self) -> None:
        self.delegate.init_cuda_graph_state(*self._graph_sizes)
        self._delegate_graph_state = True

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before capture and before each replay: refill the graph buffers (outside the graph)."""
        query_len = self.query_len(forward_batch)
        if query_len is None:
            self.forward_metadata = None
            if self.triton_delegate and self.graph is not None and not self._delegate_graph_state:
                self._init_delegate_graph_state()  # a captured mode lean did not foresee
            self.delegate.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        if self.graph is None:
            raise RuntimeError(f"the {NAME} backend: init_cuda_graph_state must run before graph capture")
        self.forward_metadata = self._metadata(forward_batch, query_len, self.graph)

    def init_forward_metadata_in_graph(self, forward_batch):
        if self.forward_metadata is None:
            self.delegate.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        # Padded requests (request slot 0, their output dropped) read one key, as with SGLang's own backends.
        return 1

    # -- speculative decoding's hooks, as SGLang's wrapper backends pass them to the verifier -----

    @property
    def verify_mask(self):
        """The tree mask the draft stage fills, the delegate's (lean's chain verification reads none)."""
        return self.delegate.verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        """Lean's verify reads no mask or position buffers; a tree verification's are the delegate's
        (SGLang's Triton backend keeps none either; the torch-native one runs no verify graphs)."""
        if self.triton_delegate:
            self.delegate.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    # -- forward ----------------------------------------------------------------------------------

    def _check_layer(self, layer) -> None:
        if layer.layer_id in self._checked_layers:
            return
        problem = layer_problem(layer)
        if problem is not None:
            raise ValueError(f"layer {layer.layer_id}: {problem}")
        self._checked_layers.add(layer.layer_id)

    def _run_lean(self, q, k, v, layer, forward_batch, save_kv_cache: bool, sinks) -> torch.Tensor:
        """q (T, Hq * D) or (T, Hq, D), T = B * query_len; k, v (T, Hkv, D) new keys and values
        (MLA: k the latent rows (T, 1, D), v their first Dv columns). Returns (T, Hq * Dv)."""
        self._check_layer(layer)
        meta = self.forward_metadata
        mla = type(self.token_to_kv_pool) is MLATokenToKVPool
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc.for_batch(forward_batch)
            if mla:  # k is the latent row (T, 1, rank + rope), which holds v; stored as the delegate stores it
                scale = mla_scale(layer, self.triton_delegate)
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k if scale == 1.0 else k / scale, v)
            else:
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        batch = meta.seq_lens.shape[0]
        q = q.reshape(batch, meta.query_len, heads, dim) if meta.query_len > 1 else q.reshape(batch, heads, dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        pool_shape = (-1, self.page_size, layer.tp_k_head_num, dim)
        if mla:  # V is the latent rows' first v_head_dim columns: a view of K, read from K's tile
            k_cache = k_cache.view(pool_shape)
            v_cache = k_cache[..., : layer.v_head_dim]
        else:
            k_cache, v_cache = (
                k_cache.view(pool_shape),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id).view(pool_shape),
            )
        k_scale, v_scale, softmax_scale, out_scale = self._scales(layer, mla, k_cache.dtype in FP8_DTYPES)
        window = layer.sliding_window_size
        out = decode_attention(
            q,
            k_cache,
            v_cache,
            meta.seq_lens,
            block_table=meta.block_table,
            softmax_scale=softmax_scale,
            softcap=layer.logit_cap if layer.logit_cap > 0 else None,
            # SGLang's window counts the keys before the query (k >= q - w): w + 1 keys with the query's own.
            window=window + 1 if window is not None and window > -1 else None,
            sinks=None if sinks is None else sinks.float(),
            k_scale=k_scale,
            v_scale=v_scale,
            backend=self.op_backend,
            batch_invariant=self.batch_invariant,
        )
        if out_scale != 1.0:
            out = out * out_scale
        return out.view(-1, heads * layer.v_head_dim)

    def _scales(self, layer, mla: bool, fp8: bool) -> tuple[float | None, float | None, float, float]:
        """(k_scale, v_scale, softmax_scale, out_scale) of a layer's lean call. fp8 pools take the op's
        scales: an MHA pool's rows are k / k_scale and v / v_scale (SGLang scales only what it
        stores in fp8), an MLA pool's latent rows one ``mla_scale``. A 16-bit MLA pool under a KV
        scale s: softmax(q.(s k)) = softmax((s q).k), and the output is s times the stored rows'."""
        if not mla:
            fp8_scales = (_or_one(layer.k_scale_float), _or_one(layer.v_scale_float))
            return (*(fp8_scales if fp8 else (None, None)), layer.scaling, 1.0)
        row = mla_scale(layer, self.triton_delegate)
        return (row, row, layer.scaling, 1.0) if fp8 else (None, None, layer.scaling * row, row)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        if self.forward_metadata is None:
            raise RuntimeError(f"the {NAME} backend: init_forward_metadata must run before a decode forward")
        _check_lean_kwargs(kwargs)
        return self._run_lean(q, k, v, layer, forward_batch, save_kv_cache, sinks)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        if self.forward_metadata is not None:  # chain verification
            _check_lean_kwargs(kwargs)
            return self._run_lean(q, k, v, layer, forward_batch, save_kv_cache, sinks)
        if sinks is not None:
            if not self.triton_delegate:
                raise ValueError(
                    f"sinks: SGLang's torch-native prefill (the {NAME} backend's CPU delegate) has "
                    "no attention sinks; prefill with sinks runs on GPUs (Triton)"
                )
            kwargs["sinks"] = sinks
        return self.delegate.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def support_triton(self):
        return self.delegate.support_triton()
