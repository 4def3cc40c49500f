"""The vLLM MLA backend (``LEAN_MLA``) at the level of its decode: ``forward_mqa`` of the impl vLLM
builds for an MLA layer, over a paged latent cache with shuffled pages, against the float64
reference of the op (V the first 512 columns of each latent row). Needs vLLM (CI's vLLM leg)."""

from __future__ import annotations

import itertools
import math
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from test_integrations_vllm import engine_config  # noqa: E402
from transformers import DeepseekV2Config  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    MLAAttention,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402
from vllm_generate import SMALL_MLA  # noqa: E402

import lean_tp.integrations.vllm as lean_vllm  # noqa: E402
from lean_tp.integrations.vllm import mla as lean_mla  # noqa: E402
from lean_tp.integrations.vllm.mla import (  # noqa: E402
    LeanCPUMLAImpl,
    LeanMLABackend,
    LeanMLAImpl,
    LeanMLAMetadataBuilder,
)
from lean_tp.ops.decode_attention import decode_attention_ref  # noqa: E402

RANK, ROPE, HEADS, BLOCK = 512, 64, 16, 16
SCALE = 192**-0.5  # DeepSeek's q.k scale: qk_nope 128 + rope 64
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _impl() -> LeanCPUMLAImpl:
    return LeanCPUMLAImpl(
        HEADS, RANK + ROPE, SCALE, 1, None, None, "auto", None, AttentionType.DECODER, None,
        q_lora_rank=None, kv_lora_rank=RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE, qk_head_dim=192,
        v_head_dim=128, kv_b_proj=None,
    )  # fmt: skip


def _decode_batch(lens: list[int], rows_per_request: int, dtype: torch.dtype, seed: int):
    """q (rows, H, 576), the paged latent cache (num_blocks, BLOCK, 576) with shuffled pages (page 0
    unused, as vLLM's null page), and the metadata forward_mqa reads."""
    g = torch.Generator().manual_seed(seed)
    needed = [max(1, math.ceil(n / BLOCK)) for n in lens]
    pages = (torch.randperm(sum(needed), generator=g) + 1).int().split(needed)
    table = torch.zeros(len(lens), max(needed), dtype=torch.int32)
    for b, row in enumerate(pages):
        table[b, : len(row)] = row
    cache = torch.randn(sum(needed) + 1, BLOCK, RANK + ROPE, generator=g).to(dtype)
    q = torch.randn(len(lens) * rows_per_request, HEADS, RANK + ROPE, generator=g).to(dtype)
    decode = SimpleNamespace(block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32))
    return q, cache, decode


def _reference(q, cache, decode, tq: int, causal: bool = True, k_scale=None):
    """float64 out (rows, H, 512) and lse (rows, H): the op's reference, causal drafts as one query
    of tq tokens, non-causal ones as rows that each see the whole sequence."""
    kv = cache.unsqueeze(2)
    table, lens = decode.block_table, decode.seq_lens
    if tq > 1 and not causal:
        table, lens, tq = table.repeat_interleave(tq, 0), lens.repeat_interleave(tq), 1
    q4 = q.view(-1, tq, *q.shape[1:]) if tq > 1 else q
    scales = dict(k_scale=k_scale, v_scale=k_scale) if k_scale is not None else {}
    out, lse = decode_attention_ref(q4, kv, kv[..., :RANK], lens, block_table=table, softmax_scale=SCALE, **scales)
    return out.reshape(q.shape[0], HEADS, RANK), lse.reshape(q.shape[0], HEADS)


@pytest.mark.parametrize(
    "tq,causal,dtype",
    [(1, True, torch.float32), (1, True, torch.bfloat16), (3, True, torch.float32), (2, False, torch.float32),
     (20, True, torch.float32)],
    ids=["decode", "decode-bf16", "mtp3", "non-causal2", "drafts20"],
)  # fmt: skip
def test_forward_mqa_matches_float64(tq, causal, dtype):
    """Decode and uniform draft blocks: up to 16 causal drafts as one query of Tq tokens, longer or
    non-causal blocks as rows; lengths around the 16-key pages."""
    lens = [1, 15, 16, 17, 100]
    q, cache, decode = _decode_batch(lens, tq, dtype, seed=tq)
    meta = SimpleNamespace(decode=decode, causal=causal)
    out, lse = _impl().forward_mqa(q, cache, meta, SimpleNamespace(_k_scale=torch.ones(1)))
    ref_out, ref_lse = _reference(q, cache, decode, tq, causal)
    assert out.shape == (q.shape[0], HEADS, RANK) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, atol=TOL[dtype], rtol=0)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)


def test_forward_mqa_fp8_latent_cache_and_split_q():
    """An e4m3 latent cache with vLLM's per-tensor ``_k_scale``, and q handed as (q_nope, q_pe)."""
    lens = [3, 40, 77]
    q, cache, decode = _decode_batch(lens, 1, torch.bfloat16, seed=7)
    fp8 = (cache.float() * 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.25])
    out, _ = _impl().forward_mqa((q[..., :RANK], q[..., RANK:]), fp8, SimpleNamespace(decode=decode), _layer(scale))
    ref_out, _ = _reference(q, fp8, decode, 1, k_scale=scale)
    torch.testing.assert_close(out.double(), ref_out, atol=TOL[torch.bfloat16], rtol=0)


def _layer(k_scale):
    return SimpleNamespace(_k_scale=k_scale)


def _rank_shard(cache, decode, dcp: int, rank: int, interleave: int):
    """DCP rank ``rank``'s latent cache and block table: of every sequence, the keys vLLM's
    interleave gives it (``interleave`` consecutive keys a rank, rank after rank), in order, on
    pages of its own."""
    local_lens = get_dcp_local_seq_lens(decode.seq_lens, dcp, rank, interleave).tolist()
    needed = [max(1, math.ceil(n / BLOCK)) for n in local_lens]
    shard = torch.randn(sum(needed) + 1, BLOCK, cache.shape[-1]).to(cache.dtype)  # keys past a length: noise
    table = torch.zeros(len(needed), max(needed), dtype=torch.int32)
    page = 1
    for b, n in enumerate(local_lens):
        table[b, : needed[b]] = torch.arange(page, page + needed[b])
        page += needed[b]
        i = torch.arange(n)
        j = i // interleave * interleave * dcp + rank * interleave + i % interleave  # the keys' global places
        src = cache[decode.block_table[b, j // BLOCK].long(), j % BLOCK]
        shard[table[b, i // BLOCK].long(), i % BLOCK] = src
    return shard, table, torch.tensor(local_lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "dcp,interleave,tq,causal",
    [(2, 1, 1, True), (4, 16, 1, True), (2, 1, 3, True), (4, 1, 20, True), (2, 16, 2, False)],
    ids=["dcp2", "dcp4-interleave16", "dcp2-mtp3", "dcp4-drafts20", "dcp2-interleave16-noncausal2"],
)
def test_decode_context_parallel_ranks_merge_to_float64(dcp, interleave, tq, causal):
    """Decode context parallelism (``LeanMLAImpl.supports_dcp``): each rank holds its interleaved
    share of every sequence's latent rows and runs forward_mqa over it with the metadata vLLM's
    builder gives it (its keys in ``seq_lens``, the whole sequences' in ``dcp_tot_seq_lens``).
    vLLM's DCP combine weights each rank's out by exp(its lse - the logsumexp of every rank's) and
    sums over ranks (``correct_attn_out`` and the reduce-scatter of ``cp_lse_ag_out_rs``, natural
    log: ``lse_base_on_e``); done here in float64, it equals float64 attention over the whole
    sequences. Lengths leave some ranks no key of a sequence (out 0, lse -inf: weight 0); draft
    blocks run one row per token, each mapped to the keys its rank holds. (vLLM's Triton
    correction kernel does not run in the interpreter.)"""
    assert LeanMLAImpl.supports_dcp and LeanMLAImpl.can_return_lse_for_decode
    lens = [1, 3, 15, 16, 17, 100]
    q, cache, decode = _decode_batch(lens, tq, torch.float32, seed=dcp + interleave + tq)
    ref_out, ref_lse = _reference(q, cache, decode, tq, causal)
    outs, lses = [], []
    for rank in range(dcp):
        shard, table, local_lens = _rank_shard(cache, decode, dcp, rank, interleave)
        impl = _impl()
        impl.dcp_world_size, impl.dcp_rank, impl.dcp_interleave = dcp, rank, interleave
        local = SimpleNamespace(block_table=table, seq_lens=local_lens, dcp_tot_seq_lens=decode.seq_lens)
        out, lse = impl.forward_mqa(q, shard, SimpleNamespace(decode=local, causal=causal), _layer(torch.ones(1)))
        outs.append(out)
        lses.append(lse)
    every_lse = torch.stack(lses).double()
    total_lse = torch.logsumexp(every_lse, 0)
    weights = torch.exp(every_lse - total_lse).nan_to_num(0.0)  # a sequence with no key anywhere: 0
    merged = sum(w[..., None] * out.double() for w, out in zip(weights, outs))
    torch.testing.assert_close(merged, ref_out, atol=TOL[torch.float32], rtol=0)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(total_lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
    empty = torch.isneginf(every_lse)
    assert empty.any() and (torch.stack(outs)[empty] == 0).all()


def test_forward_mqa_on_the_kernel_and_batch_invariant_mode(monkeypatch):
    """LEAN_TP_VLLM_BACKEND=triton runs the kernel (the interpreter here) with V read from K's tile;
    VLLM_BATCH_INVARIANT=1 runs the op's batch-invariant mode: a request's bits alone and in a batch."""
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", "triton")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    impl = _impl()
    assert impl.op_backend == "triton" and impl.batch_invariant
    lens = [70, 5, 130]
    q, cache, decode = _decode_batch(lens, 1, torch.bfloat16, seed=9)
    out, _ = impl.forward_mqa(q, cache, SimpleNamespace(decode=decode), _layer(torch.ones(1)))
    torch.testing.assert_close(out.double(), _reference(q, cache, decode, 1)[0], atol=TOL[torch.bfloat16], rtol=0)
    alone = SimpleNamespace(block_table=decode.block_table[:1], seq_lens=decode.seq_lens[:1])
    first, _ = impl.forward_mqa(q[:1], cache, SimpleNamespace(decode=alone), _layer(torch.ones(1)))
    assert torch.equal(first[0], out[0])


def test_batch_invariant_mode_verifies_20_drafts_as_one_query(monkeypatch):
    """VLLM_BATCH_INVARIANT=1: 20 causal drafts (past the default mode's bound) run as one lean
    call of Tq = 20, each token's rows bitwise those of decoding it alone (the kernel, in the
    interpreter), against float64."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", "triton")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    calls, real = [], lean_mla.decode_attention
    monkeypatch.setattr(lean_mla, "decode_attention", lambda q, *a, **k: calls.append(q.shape) or real(q, *a, **k))
    impl, tq, lens = _impl(), 20, [21, 40]
    q, cache, decode = _decode_batch(lens, tq, torch.bfloat16, seed=11)
    out, lse = impl.forward_mqa(q, cache, SimpleNamespace(decode=decode, causal=True), _layer(torch.ones(1)))
    assert calls == [(len(lens), tq, HEADS, RANK + ROPE)]
    torch.testing.assert_close(out.double(), _reference(q, cache, decode, tq)[0], atol=TOL[torch.bfloat16], rtol=0)
    for t in (0, 9, tq - 1):
        rows = torch.arange(len(lens)) * tq + t
        alone = SimpleNamespace(block_table=decode.block_table, seq_lens=decode.seq_lens - (tq - 1 - t))
        one, one_lse = impl.forward_mqa(q[rows], cache, SimpleNamespace(decode=alone), _layer(torch.ones(1)))
        assert torch.equal(one, out[rows]) and torch.equal(one_lse, lse[rows]), f"token {t}"


def test_registration_in_place_of_cpu_mla(monkeypatch):
    """register() adds LEAN_MLA beside LEAN; in place of CPU_MLA (vLLM's CPU platform always picks
    it) the MLA class goes in, in place of CPU_ATTN the other."""
    lean_vllm.register()
    assert AttentionBackendEnum["LEAN_MLA"].get_class() is LeanMLABackend
    assert LeanMLABackend.is_mla() and LeanMLABackend.supports_batch_invariance()
    assert LeanMLABackend.get_supported_head_sizes() == [576] and LeanMLABackend.supports_block_size(64)
    assert not LeanMLABackend.supports_block_size(48)
    with lean_vllm.in_place_of("CPU_MLA"):
        assert AttentionBackendEnum["CPU_MLA"].get_class() is LeanMLABackend
    assert AttentionBackendEnum["CPU_MLA"].get_class() is not LeanMLABackend
    with pytest.raises(ValueError, match="logits_soft_cap: expected None for the LEAN_MLA backend"):
        lean_mla._check_layer(None, None, 30.0, AttentionType.DECODER, "auto")


@pytest.fixture(scope="module")
def deepseek_config(tmp_path_factory):
    """vLLM's config for a small DeepSeek-V2 (16 heads, rank 512 + rope 64), as an engine builds it."""
    return engine_config(str(tmp_path_factory.mktemp("deepseek_v2")), DeepseekV2Config(**SMALL_MLA))


_LAYER_IDS = itertools.count()  # vLLM refuses a second layer of one name in a config


def _mla_layer(config, monkeypatch, kv_cache_dtype: str = "auto") -> MLAAttention:
    """vLLM's MLA layer of ``config``'s model with LEAN_MLA's GPU impl (``LeanMLAImpl``), as a GPU
    engine builds it (on CPU vLLM would pick the CPU impl)."""
    monkeypatch.setattr(LeanMLABackend, "get_impl_cls", staticmethod(lambda: LeanMLAImpl))
    config.cache_config.cache_dtype = kv_cache_dtype
    kv_b_proj = torch.nn.Linear(RANK, HEADS * (SMALL_MLA["qk_nope_head_dim"] + SMALL_MLA["v_head_dim"]), bias=False)
    with set_current_vllm_config(config):
        return MLAAttention(
            HEADS, SCALE, SMALL_MLA["qk_nope_head_dim"], ROPE, SMALL_MLA["v_head_dim"], None, RANK, kv_b_proj,
            cache_config=config.cache_config, prefix=f"model.layers.{next(_LAYER_IDS)}.self_attn.attn", attn_backend=LeanMLABackend,
        )  # fmt: skip


def test_gpu_impl_serves_the_profile_run_and_decodes(deepseek_config, monkeypatch):
    """The GPU impl in vLLM's MLA layer, built from an engine's config: it takes its attributes from
    MLACommonImpl alone (not Triton MLA's ``__init__``); the profile run (no metadata; vLLM 0.33
    calls ``impl.reserve_workspace()`` there) writes zeros and claims no scratch; forward_mqa
    decodes against float64."""
    monkeypatch.setattr(deepseek_config.cache_config, "cache_dtype", "auto")
    layer = _mla_layer(deepseek_config, monkeypatch)
    impl = layer.impl
    assert type(impl) is LeanMLAImpl and TritonMLAImpl not in type(impl).__mro__ and isinstance(impl, MLACommonImpl)
    q = torch.randn(3, HEADS, SMALL_MLA["qk_nope_head_dim"] + ROPE)
    output = torch.full((3, HEADS * SMALL_MLA["v_head_dim"]), float("nan"))
    with set_current_vllm_config(deepseek_config):
        layer.forward_impl(q, torch.randn(3, RANK), torch.randn(3, 1, ROPE), torch.empty(0), None, output)
    assert torch.equal(output, torch.zeros_like(output))
    assert impl.reserve_workspace() is None
    lens = [1, 16, 33]
    q, cache, decode = _decode_batch(lens, 1, torch.bfloat16, seed=21)
    out, _ = impl.forward_mqa(q, cache, SimpleNamespace(decode=decode), layer)
    torch.testing.assert_close(out.double(), _reference(q, cache, decode, 1)[0], atol=TOL[torch.bfloat16], rtol=0)


def test_e5m2_latent_caches_are_refused(deepseek_config, monkeypatch):
    """vLLM's MLA forward views every fp8 cache as e4m3: an e5m2 latent cache is refused when the
    layer is built, and the GPU backend does not list it."""
    monkeypatch.setattr(deepseek_config.cache_config, "cache_dtype", "auto")
    assert "fp8_e5m2" not in lean_mla.MLA_CACHE_DTYPES and "fp8_e4m3" in lean_mla.MLA_CACHE_DTYPES
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of .* for the LEAN_MLA backend, got 'fp8_e5m2'"):
        _mla_layer(deepseek_config, monkeypatch, "fp8_e5m2")


@pytest.mark.parametrize("invariant", [False, True])
def test_prefix_caching_goes_off_in_the_batch_invariant_mode(deepseek_config, monkeypatch, invariant):
    """Under VLLM_BATCH_INVARIANT=1 building a LEAN_MLA layer turns prefix caching off, as vLLM
    does for Triton MLA, whose prefill path it shares; otherwise it stays on."""
    monkeypatch.setattr(deepseek_config.cache_config, "cache_dtype", "auto")
    monkeypatch.setattr(deepseek_config.cache_config, "enable_prefix_caching", True)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if invariant else "0")
    _mla_layer(deepseek_config, monkeypatch)
    assert deepseek_config.cache_config.enable_prefix_caching is not invariant


def _builder(monkeypatch, threshold: int) -> LeanMLAMetadataBuilder:
    """LEAN_MLA's metadata builder, with vLLM's MLA builder set-up (which needs a model's MLA
    layers) replaced by the attributes ``build`` reads for decodes and fresh prefills on CPU."""

    def setup(self, *args, **kwargs):
        self.__dict__.update(
            reorder_batch_threshold=threshold, use_pcp=False, device=torch.device("cpu"), page_size=BLOCK,
            metadata_cls=MLACommonMetadata, model_config=SimpleNamespace(dtype=torch.bfloat16, get_head_size=lambda: 576),
            q_data_type=torch.bfloat16, dcp_world_size=1, dcp_local_block_size=1, dcp_virtual_block_size=1,
            dcp_manager=None, chunked_prefill_workspace=None, chunked_prefill_workspace_size=4096,
            _prefill_backend=SimpleNamespace(prepare_metadata=lambda metadata: None),
        )  # fmt: skip

    monkeypatch.setattr(MLACommonMetadataBuilder, "__init__", setup)
    return LeanMLAMetadataBuilder(None, ["layer.0"], None, torch.device("cpu"))


# Decodes of 1, 3, 1 and 2 query tokens (MTP with per-request draft lengths), then a prefill.
MIXED_LENGTHS = [(40, 1), (17, 3), (5, 1), (30, 2), (0, 12)]


def _mixed_step(monkeypatch):
    """The builder's metadata of MIXED_LENGTHS (threshold 4: 3 drafts) over a shuffled paged latent
    cache, and q (decode tokens, H, 576), the cache and the table."""
    seq_lens = [c + n for c, n in MIXED_LENGTHS]
    _, cache, decode = _decode_batch(seq_lens, 1, torch.bfloat16, seed=13)
    starts = torch.tensor([0] + [n for _, n in MIXED_LENGTHS]).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=lens, num_reqs=len(seq_lens),
        num_actual_tokens=int(starts[-1]), max_query_len=12, max_seq_len=max(seq_lens),
        block_table_tensor=decode.block_table, slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.long),
        seq_lens_cpu_upper_bound=lens.clone(),
    )  # fmt: skip
    metadata = _builder(monkeypatch, 4).build(0, common)
    q = torch.randn(int(starts[4]), HEADS, RANK + ROPE, generator=torch.Generator().manual_seed(14)).bfloat16()
    return metadata, q, cache, decode.block_table


@pytest.mark.parametrize("op_backend", ["auto", "triton"])
def test_batch_invariant_mode_runs_every_decode_length_on_lean(monkeypatch, op_backend):
    """VLLM_BATCH_INVARIANT=1, a step with decodes of 1, 3, 1 and 2 query tokens and a prefill:
    vLLM's split keeps all four as decodes (the prefill goes to vLLM's MLA prefill path), and
    forward_mqa runs them on lean, one call per length, against float64. On the kernel each
    verified token's out and lse are bitwise those of decoding it alone (Tq = 1)."""
    if op_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", op_backend)
    calls = []
    real = lean_mla.decode_attention
    monkeypatch.setattr(
        lean_mla, "decode_attention", lambda q, *a, **k: calls.append(tuple(q.shape)) or real(q, *a, **k)
    )
    metadata, q, cache, table = _mixed_step(monkeypatch)
    assert (metadata.num_decodes, metadata.num_decode_tokens, metadata.num_prefills) == (4, 7, 1)
    impl, layer = _impl(), _layer(torch.ones(1))
    out, lse = impl.forward_mqa(q, cache, metadata, layer)
    assert calls == [(2, HEADS, RANK + ROPE), (1, 2, HEADS, RANK + ROPE), (1, 3, HEADS, RANK + ROPE)]
    # Token i of a request with context c attends causally: keys up to c + i, as a decode would.
    tokens = [(r, c + i + 1) for r, (c, n) in enumerate(MIXED_LENGTHS[:4]) for i in range(n)]
    alone = [
        SimpleNamespace(block_table=table[r : r + 1], seq_lens=torch.tensor([k], dtype=torch.int32)) for r, k in tokens
    ]
    rows = SimpleNamespace(
        block_table=torch.cat([a.block_table for a in alone]), seq_lens=torch.cat([a.seq_lens for a in alone])
    )
    ref_out, ref_lse = _reference(q, cache, rows, 1)
    torch.testing.assert_close(out.double(), ref_out, atol=TOL[torch.bfloat16], rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    if op_backend == "triton":
        for t, decode in enumerate(alone):
            one_out, one_lse = impl.forward_mqa(q[t : t + 1], cache, SimpleNamespace(decode=decode), layer)
            assert torch.equal(one_out[0], out[t]) and torch.equal(one_lse[0], lse[t]), f"token {t}"


def test_default_mode_keeps_the_leading_query_length_as_decodes(monkeypatch):
    """Without VLLM_BATCH_INVARIANT vLLM's split keeps the decode region uniform: the leading
    1-token request is the only decode, and the rest go to vLLM's MLA prefill path."""
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    metadata, *_ = _mixed_step(monkeypatch)
    assert (metadata.num_decodes, metadata.num_decode_tokens, metadata.decode.groups) == (1, 1, [])
