"""The vLLM backend at the level of one attention layer, modeled on vLLM's own backend tests
(tests/v1/attention/test_attention_backends.py there): a batch of decode and prefill requests over
a paged cache with shuffled pages, written through the backend's cache update, then one forward,
against a float64 reference computed from the unpaged K/V. Needs vLLM (CI's vLLM leg installs it).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from helpers import engine_names  # noqa: E402
from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import lean_tp.integrations.vllm as lean_vllm  # noqa: E402
from lean_tp.integrations.vllm import backend as lean_backend  # noqa: E402
from lean_tp.integrations.vllm.backend import (  # noqa: E402
    FP8_CACHE_DTYPES,
    LeanAttentionBackend,
    LeanAttentionImpl,
    LeanAttentionMetadataBuilder,
)
from lean_tp.ops.decode_attention import decode_attention_ref  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig()


def engine_config(path: str, config) -> VllmConfig:
    """vLLM's config as an engine builds it for a model whose Hugging Face ``config`` is saved
    under ``path`` (no weights, no tokenizer): what the GPU delegates' builders read (heads, head
    size, dtype), which a bare ``VllmConfig()`` lacks."""
    config.save_pretrained(path)
    return VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16"))


def test_gpu_classes_build_from_an_engines_config(tmp_path, monkeypatch):
    """The Triton delegates lean builds on GPUs (forced here) construct from the config
    tests/gpu/test_vllm_cuda.py uses, a 32-head, 4-KV-head, 128-dim Llama's, so a GPU run reaches
    lean's code rather than stopping in the delegate's set-up."""
    from transformers import LlamaConfig
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder

    config = engine_config(str(tmp_path), LlamaConfig(**GPU_TEST_MODEL))
    monkeypatch.setattr(lean_backend, "_triton_delegate", lambda: True)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    with set_current_vllm_config(config):
        builder = LeanAttentionMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
        impl = LeanAttentionImpl(32, 128, 128**-0.5, 4, None, None, "auto", None)
    assert type(builder.delegate) is TritonAttentionMetadataBuilder and type(impl.delegate) is TritonAttentionImpl


# The model tests/gpu/test_vllm_cuda.py configures: the heads and head size its batches use.
GPU_TEST_MODEL = dict(
    vocab_size=512, hidden_size=512, intermediate_size=256, num_hidden_layers=1, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128,
)  # fmt: skip


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts the backend's calls of lean_tp.decode_attention, and the rows each took."""
    calls = []
    real = lean_backend.decode_attention

    def counted(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(lean_backend, "decode_attention", counted)
    return calls


def _batch(requests, block_size, num_kv_heads, head_size, gen):
    """Pages and metadata of a batch: requests as (context_len, query_len), in batch order."""
    seq_lens = [c + q for c, q in requests]
    needed = [math.ceil(s / block_size) for s in seq_lens]
    # Pages in shuffled order; page 0 is vLLM's null page, which fills the rest of each row.
    pages = (torch.randperm(sum(needed), generator=gen) + 1).int().split(needed)
    block_table = torch.zeros(len(requests), max(1, *needed), dtype=torch.int32)
    for b, row in enumerate(pages):
        block_table[b, : len(row)] = row
    starts = torch.tensor([0] + [q for _, q in requests]).cumsum(0).int()
    slots = [
        block_table[b, n // block_size] * block_size + n % block_size for b, s in enumerate(seq_lens) for n in range(s)
    ]
    new_slots = torch.cat(
        [torch.stack(slots[sum(seq_lens[:b]) + c : sum(seq_lens[: b + 1])]) for b, (c, q) in enumerate(requests) if q]
        or [torch.zeros(0, dtype=torch.int32)]
    )
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(requests),
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(q for _, q in requests),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=new_slots.long(),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
    )
    return common, torch.stack(slots).long() if slots else torch.zeros(0, dtype=torch.long), sum(needed) + 1


def make_case(
    vllm_config,
    requests,
    *,
    block_size=16,
    heads=(8, 2),
    head_size=64,
    dtype=torch.float32,
    kv_cache_dtype="auto",
    window=None,
    softcap=None,
    use_sinks=False,
    spec_tokens=0,
    pad_tokens=0,
    seed=0,
    device="cpu",
):
    """One layer's batch, built as vLLM builds it: every request's earlier K/V written through the
    backend's cache update, the new tokens' slots NaN until the update before forward.
    ``pad_tokens``: tokens appended with slot -1, as CUDA-graph padding adds. Returns a namespace
    with impl, layer, kv_cache, common (metadata), query, k_new, v_new, metadata and ref (float64,
    the real tokens' rows)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    vllm_config.speculative_config = (
        SpeculativeConfig(num_speculative_tokens=spec_tokens, method="ngram") if spec_tokens else None
    )
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    builder = LeanAttentionMetadataBuilder(spec, ["layer.0"], vllm_config, torch.device(device))
    sinks = torch.randn(num_heads, generator=gen) * 2 if use_sinks else None
    scale = head_size**-0.5
    impl = LeanAttentionImpl(
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        None,
        window,
        kv_cache_dtype,
        softcap,
        sinks=sinks.to(device) if use_sinks else None,
    )
    fp8 = FP8_CACHE_DTYPES.get(kv_cache_dtype)
    layer = SimpleNamespace(_k_scale=torch.tensor(0.7, device=device), _v_scale=torch.tensor(1.3, device=device))
    common, all_slots, num_blocks = _batch(requests, block_size, num_kv_heads, head_size, gen)
    # LBNHC: physical (pages, slot, head, K|V), seen as the logical (pages, head, slot, K|V).
    cache = torch.zeros(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=torch.uint8 if fp8 else dtype)
    common.num_actual_tokens += pad_tokens
    common.slot_mapping = torch.cat([common.slot_mapping, torch.full((pad_tokens,), -1)])
    seqs = [
        (
            torch.randn(c + q, num_kv_heads, head_size, generator=gen).to(dtype),
            torch.randn(c + q, num_kv_heads, head_size, generator=gen).to(dtype),
        )
        for c, q in requests
    ]
    new = [n for n, (c, q) in enumerate(requests) for _ in range(q)]
    new_tok = torch.cat([torch.arange(c, c + q) for c, q in requests])
    pad = torch.randn(pad_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    k_new = torch.cat([torch.stack([seqs[b][0][t] for b, t in zip(new, new_tok)]), pad])
    v_new = torch.cat([torch.stack([seqs[b][1][t] for b, t in zip(new, new_tok)]), pad])
    query = torch.randn(common.num_actual_tokens, num_heads, head_size, generator=gen).to(dtype)
    ref = torch.empty(len(new), num_heads, head_size, dtype=torch.float64)
    for b, (c, q) in enumerate(requests):
        k, v = seqs[b]
        scales = {}
        if fp8:  # what vLLM's cache holds: x / scale in fp8 (the test inputs are far from saturating)
            k, v, scales = (k.float() / 0.7).to(fp8), (v.float() / 1.3).to(fp8), dict(k_scale=0.7, v_scale=1.3)
        lo = int(common.query_start_loc_cpu[b])
        # The request's K/V unpaged, as a one-sequence contiguous cache (1, Hkv, S, D).
        out, _ = decode_attention_ref(
            query[None, lo : lo + q],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            torch.tensor([c + q], dtype=torch.int32),
            softmax_scale=scale,
            softcap=softcap,
            window=window,
            sinks=sinks,
            **scales,
        )
        ref[lo : lo + q] = out[0]
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        setattr(common, name, getattr(common, name).to(device))
    cache, query, k_new, v_new = (x.to(device) for x in (cache, query, k_new, v_new))
    kv_cache = cache.permute(0, 2, 1, 3)
    k_all, v_all = torch.cat([k for k, _ in seqs]).to(device), torch.cat([v for _, v in seqs]).to(device)
    impl.do_kv_cache_update(layer, k_all, v_all, kv_cache, all_slots.to(device))
    # NaN in the new tokens' slots (0x7f is NaN in both fp8 formats): the update before forward must write them.
    new_slots = common.slot_mapping[common.slot_mapping >= 0]
    cache.view(-1, num_kv_heads, 2 * head_size)[new_slots] = 127 if fp8 else float("nan")
    impl.do_kv_cache_update(layer, k_new, v_new, kv_cache, common.slot_mapping)
    return SimpleNamespace(
        impl=impl,
        layer=layer,
        kv_cache=kv_cache,
        common=common,
        query=query,
        k_new=k_new,
        v_new=v_new,
        metadata=builder.build(0, common),
        ref=ref,
    )


def forward(case):
    """The layer's forward into a NaN-filled output."""
    output = torch.full_like(case.query, float("nan"))
    case.impl.forward(case.layer, case.query, case.k_new, case.v_new, case.kv_cache, case.metadata, output)
    return output


def _run(vllm_config, requests, **options):
    """(output, float64 reference, metadata) of one forward."""
    case = make_case(vllm_config, requests, **options)
    return forward(case), case.ref, case.metadata


def check(output, ref, dtype):
    """Every row written, and within dtype's tolerance of the float64 reference."""
    output = output[: len(ref)].cpu()
    assert not output.isnan().any(), "an output row was not written"
    torch.testing.assert_close(output.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# Ragged lengths around the page size (0, 1, page-1, page, page+1, long), decodes first as vLLM's
# reorder leaves them, then a chunked prefill, a fresh prefill and a decode-sized straggler.
def _mixed(block_size):
    decodes = [(c, 1) for c in (0, 1, block_size - 1, block_size, block_size + 1, 300)]
    return decodes + [(block_size + 5, 37), (0, 70), (9, 1)]


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
def test_mixed_batch_matches_float64(vllm_config, lean_calls, block_size, heads):
    output, ref, metadata = _run(vllm_config, _mixed(block_size), block_size=block_size, heads=heads)
    check(output, ref, torch.float32)
    # The six leading decodes ran on lean in one call, the rest on the prefill path.
    assert (metadata.num_decodes, metadata.decode_query_len) == (6, 1)
    assert lean_calls == [(6, heads[0], 64)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [40, 128, 256])
def test_dtypes_and_head_sizes(vllm_config, dtype, head_size):
    output, ref, _ = _run(vllm_config, _mixed(16), dtype=dtype, head_size=head_size, seed=1)
    check(output, ref, dtype)


@pytest.mark.parametrize(
    "features",
    [
        dict(window=7),
        dict(window=64),
        dict(softcap=4.0),
        dict(use_sinks=True),
        dict(window=20, softcap=3.0, use_sinks=True),
    ],
    ids=["window7", "window64", "softcap", "sinks", "all"],
)
def test_serving_features(vllm_config, features):
    output, ref, _ = _run(vllm_config, _mixed(16), seed=2, **features)
    check(output, ref, torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache_with_vllm_scales(vllm_config, kv_cache_dtype, dtype):
    output, ref, _ = _run(vllm_config, _mixed(32), block_size=32, dtype=dtype, kv_cache_dtype=kv_cache_dtype, seed=3)
    check(output, ref, dtype)


@pytest.mark.parametrize("spec_tokens", [2, 7, 15])
def test_speculative_decoding_verification_runs_on_lean(vllm_config, lean_calls, spec_tokens):
    tq = spec_tokens + 1
    requests = [(c, tq) for c in (0, 5, 16, 100)] + [(3, 2), (0, 40)]
    output, ref, metadata = _run(vllm_config, requests, spec_tokens=spec_tokens, window=30, use_sinks=True, seed=4)
    check(output, ref, torch.float32)
    assert (metadata.num_decodes, metadata.decode_query_len) == (4, tq)
    assert lean_calls == [(4, tq, 8, 64)]


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("spec_tokens", [0, 3])
def test_padded_uniform_batch(vllm_config, lean_calls, monkeypatch, spec_tokens, invariant):
    """A CUDA-graph-padded decode batch: padding requests have no query tokens and no keys, and sit
    on padding tokens (slot -1, never written); lean takes the whole (B, Tq) view in one call, in
    the batch-invariant mode too (the captured graph's path: no per-length groups)."""
    if invariant:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    tq = spec_tokens + 1
    requests = [(20, tq), (7, tq), (0, 0), (0, 0)]
    output, ref, metadata = _run(vllm_config, requests, spec_tokens=spec_tokens, pad_tokens=2 * tq, seed=5)
    check(output[: 2 * tq], ref, torch.float32)
    assert metadata.prefill is None and metadata.groups == []
    assert lean_calls == [(4, tq, 8, 64) if tq > 1 else (4, 8, 64)]


def test_only_prefills_and_empty_batches(vllm_config, lean_calls):
    output, ref, metadata = _run(vllm_config, [(0, 50), (17, 33)], seed=6)
    check(output, ref, torch.float32)
    assert metadata.num_decodes == 0 and lean_calls == []


def test_profiling_run_fills_zeros():
    impl = LeanAttentionImpl(4, 64, 0.125, 2, None, None, "auto")
    out = torch.full((3, 4, 64), float("nan"))
    impl.forward(None, out, out, out, torch.empty(0), None, out)
    assert torch.equal(out, torch.zeros_like(out))


def test_triton_kernel_in_the_interpreter(vllm_config, lean_calls, monkeypatch):
    """The decode part on lean's Triton kernel (the interpreter on CPU), with window and sinks."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", "triton")
    output, ref, _ = _run(
        vllm_config,
        [(0, 2), (15, 2), (33, 2), (5, 9)],
        spec_tokens=1,
        window=20,
        use_sinks=True,
        dtype=torch.float16,
        seed=7,
    )
    check(output, ref, torch.float16)
    assert lean_calls == [(3, 2, 8, 64)]


def test_registration_and_selection():
    assert lean_vllm.register() == "LEAN" and lean_vllm.register() == "LEAN"  # idempotent
    assert AttentionBackendEnum["LEAN"].get_class() is LeanAttentionBackend
    from vllm.config.attention import AttentionConfig

    assert AttentionConfig(backend="lean").backend is AttentionBackendEnum.LEAN  # --attention-backend lean
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["lean_tp"] == "lean_tp.integrations.vllm:register"


def _reasons(**overrides):
    args = dict(
        head_size=64,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type=AttentionType.DECODER,
    )
    args.update(overrides)
    return LeanAttentionBackend.validate_configuration(**args)


def test_vllm_sees_what_the_backend_takes():
    assert _reasons() == []
    assert _reasons(has_sink=True, has_sliding_window=True, kv_cache_dtype="fp8_e5m2", block_size=256) == []
    assert _reasons(head_size=24) == ["head_size not supported"]
    assert _reasons(block_size=48) == []  # vLLM splits a 48-slot block into 16-slot pages for the kernel
    assert _reasons(block_size=24) == ["block_size not supported"]
    assert _reasons(kv_cache_dtype="int8_per_token_head") == ["kv_cache_dtype not supported"]
    assert _reasons(attn_type="encoder_decoder") == ["attention type encoder_decoder not supported"]
    assert _reasons(kv_cache_dtype="fp8", dtype=torch.float32) == [
        "an fp8 KV cache needs a float16 or bfloat16 model, got torch.float32"
    ]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(head_size=24), "head_size: expected a multiple of 8 in \\[32, 256\\]"),
        (dict(head_size=512), "head_size: expected"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "attn_type: expected 'decoder'"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "attn_type: expected 'decoder'"),
        (dict(alibi_slopes=[0.5, 0.25]), "alibi_slopes: expected None"),
        (dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype: expected one of"),
        (dict(use_alibi_sqrt=True), "use_alibi_sqrt: expected it unset"),
        (dict(chunk_lookback=128), "chunk_lookback: expected it unset"),
    ],
)
def test_layer_the_backend_cannot_run_is_named(overrides, match):
    args = (
        dict(
            num_heads=4,
            head_size=64,
            scale=0.125,
            num_kv_heads=2,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
        )
        | overrides
    )
    with pytest.raises(ValueError, match=match):
        LeanAttentionImpl(**args)


def test_op_backend_setting_is_checked(monkeypatch):
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LEAN_TP_VLLM_BACKEND: expected one of"):
        LeanAttentionImpl(4, 64, 0.125, 2, None, None, "auto")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_cache_write_saturates_fp8_and_skips_padding(fp8):
    """The CPU stand-in for vLLM's cache write: x / scale, saturated to the format's largest finite
    value (as vLLM's GPU writes are), and slot -1 writes nothing."""
    from lean_tp.integrations.vllm.cpu import write_kv_cache

    key_cache = torch.zeros(2, 16, 1, 8, dtype=fp8)
    value_cache = torch.zeros(2, 16, 1, 8, dtype=fp8)
    key = torch.tensor([1.0, -1e6, 1e6, 0.5]).repeat(3, 1, 2)  # (3 tokens, 1 head, 8)
    write_kv_cache(
        key, key * 2, key_cache, value_cache, torch.tensor([17, -1, 3]), torch.tensor([0.5]), torch.tensor([4.0])
    )
    big = torch.finfo(fp8).max
    expected = torch.tensor([2.0, -big, big, 1.0]).repeat(2)
    torch.testing.assert_close(key_cache[1, 1, 0].float(), expected)
    torch.testing.assert_close(key_cache[0, 3, 0].float(), expected)
    torch.testing.assert_close(value_cache[1, 1, 0].float(), torch.tensor([0.5, -big, big, 0.25]).repeat(2))
    assert int((key_cache.float() != 0).any(-1).sum()) == 2  # the padding token wrote nowhere


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_gpu_impl_reads_fp8_as_vllms_triton_write_stores_it(kv_cache_dtype, monkeypatch):
    """On GPUs vLLM's Triton attention writes the cache and takes prefill; it stores every fp8
    cache in its platform's fp8 type (e4m3), so lean reads that, whatever the cache's name."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    monkeypatch.setattr(lean_backend, "_triton_delegate", lambda: True)
    impl = LeanAttentionImpl(8, 64, 0.125, 2, None, 16, kv_cache_dtype, 5.0)
    assert isinstance(impl.delegate, TritonAttentionImpl) and impl.delegate.sliding_window == (15, 0)
    assert impl.fp8_dtype == current_platform.fp8_dtype() == torch.float8_e4m3fn


def test_cpu_metadata_keeps_the_pages_in_use(vllm_config):
    """On CPU the decodes' block table is cut to the longest request's pages, so the torch backend's
    work follows the lengths and not the table vLLM sizes for its longest allowed request."""
    case = make_case(vllm_config, [(40, 1), (3, 1)], block_size=16)
    common = case.common
    wide = torch.zeros(common.block_table_tensor.shape[0], 512, dtype=torch.int32)
    wide[:, : common.block_table_tensor.shape[1]] = common.block_table_tensor
    common.block_table_tensor = wide
    builder = LeanAttentionMetadataBuilder(
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32),
        ["layer.0"],
        vllm_config,
        torch.device("cpu"),
    )
    case.metadata = builder.build(0, common)
    assert case.metadata.block_table.shape == (2, 3)  # 41 keys: 3 pages of 16
    check(forward(case), case.ref, torch.float32)


@pytest.mark.parametrize("padding", ["-1", "stale"])
@pytest.mark.parametrize("op_backend", ["auto", "triton"])
def test_unused_block_table_columns_hold_any_padding(vllm_config, monkeypatch, padding, op_backend):
    """Columns past a request's pages hold what an engine leaves there (-1, or stale ids of pages
    other requests own, some past the pool): never read, on the torch path and on the kernel."""
    if op_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", op_backend)
    case = make_case(vllm_config, [(40, 1), (3, 1), (0, 1), (17, 1)], block_size=16, seed=3)
    table, num_pages = case.common.block_table_tensor, case.kv_cache.shape[0]
    used = torch.arange(table.shape[1]) * 16 < case.common.seq_lens[:, None]
    stale = torch.tensor([num_pages + 5, 1, num_pages - 1, 2**31 - 1], dtype=torch.int32)[:, None].expand_as(table)
    table[~used] = (torch.full_like(table, -1) if padding == "-1" else stale)[~used]
    case.metadata = LeanAttentionMetadataBuilder(
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32),
        ["layer.0"],
        vllm_config,
        torch.device("cpu"),
    ).build(0, case.common)
    check(forward(case), case.ref, torch.float32)


def _sub_batch(vllm_config, case, parts, spec):
    """Metadata of a batch of ``parts`` over a case's cache, each (request, first token row, query
    tokens, keys), in that order: the same requests, or a request's first tokens, in another batch.
    Returns (metadata, the parts' token rows in the case's query)."""
    c = case.common
    lens = [n for _, _, n, _ in parts]
    starts = torch.tensor([0, *lens]).cumsum(0).int()
    seq_lens = torch.tensor([keys for *_, keys in parts], dtype=torch.int32)
    rows = [first + i for _, first, n, _ in parts for i in range(n)]
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq_lens,
        num_reqs=len(parts),
        num_actual_tokens=len(rows),
        max_query_len=max(lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=c.block_table_tensor[[r for r, *_ in parts]],
        slot_mapping=c.slot_mapping[rows],
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    builder = LeanAttentionMetadataBuilder(spec, ["layer.0"], vllm_config, torch.device("cpu"))
    return builder.build(0, common), rows


def _forward_rows(case, metadata, rows):
    """The layer's forward on the case's query ``rows`` alone, into a NaN-filled output."""
    output = torch.full((len(rows), *case.query.shape[1:]), float("nan"), dtype=case.query.dtype)
    case.impl.forward(case.layer, case.query[rows], case.k_new[rows], case.v_new[rows], case.kv_cache, metadata, output)
    return output


@pytest.mark.parametrize("op_backend", ["auto", "triton"])
def test_batch_invariant_mode_gives_a_request_the_same_bits_in_any_batch(
    vllm_config, lean_calls, monkeypatch, op_backend
):
    """VLLM_BATCH_INVARIANT=1: vLLM accepts the backend, and a decode request's output rows are
    bitwise the same alone and inside batches of other decodes (on CPU's torch path and on the
    Triton kernel in the interpreter)."""
    if op_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", op_backend)
    assert _reasons(use_batch_invariant=True) == []
    requests = [(300, 1), (0, 1), (15, 1), (17, 1), (700, 1)]
    case = make_case(vllm_config, requests, dtype=torch.float16, heads=(8, 2), window=500, use_sinks=True, seed=11)
    assert case.impl.batch_invariant
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    rows_of = {}
    keys = case.common.seq_lens.tolist()
    for rows in ([0], [4], [0, 1, 2, 3, 4], [3, 0, 4], [4, 2, 1, 0]):
        meta, _ = _sub_batch(vllm_config, case, [(r, r, 1, keys[r]) for r in rows], spec)
        output = _forward_rows(case, meta, rows)
        check(output, case.ref[rows], torch.float16)
        for j, r in enumerate(rows):
            want = rows_of.setdefault(r, output[j])
            assert torch.equal(output[j].view(torch.int16), want.view(torch.int16)), f"request {r} in batch {rows}"
    assert len(lean_calls) == 5


# Decodes of 1, 3, 1 and 2 query tokens (speculative decoding with per-request draft lengths), a
# prefill, then a 2-token request behind it (vLLM puts fresh prompts last, whatever their length).
MIXED_LENGTHS = [(40, 1), (17, 3), (5, 1), (30, 2), (9, 12), (3, 2)]


@pytest.mark.parametrize("op_backend", ["auto", "triton"])
def test_batch_invariant_mode_runs_every_decode_length_on_lean(vllm_config, lean_calls, monkeypatch, op_backend):
    """VLLM_BATCH_INVARIANT=1, a step whose requests of 1 to 4 (the threshold) query tokens have
    several lengths: every one of them runs on lean, one call per length, and only the prefill's
    tokens (and those behind it, which lean then overwrites) reach the delegate. Each request's rows
    are bitwise those of the request alone; on the kernel, each verified token's rows are bitwise
    those of decoding it alone (Tq = 1, its keys up to its own position)."""
    if op_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", op_backend)
    delegated = []
    real_prefill = lean_backend.cpu.prefill_attention
    monkeypatch.setattr(
        lean_backend.cpu,
        "prefill_attention",
        lambda q, *args, **kwargs: delegated.append(q.shape[0]) or real_prefill(q, *args, **kwargs),
    )
    options = dict(heads=(4, 2), head_size=32, dtype=torch.float16, window=30, use_sinks=True)
    case = make_case(vllm_config, MIXED_LENGTHS, spec_tokens=3, seed=12, **options)
    output = forward(case)
    check(output, case.ref, torch.float16)
    assert delegated == [14] and [g.query_len for g in case.metadata.groups] == [1, 2, 3]
    assert case.metadata.num_decodes == 0 and lean_calls == [(2, 4, 32), (2, 2, 4, 32), (1, 3, 4, 32)]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
    starts = case.common.query_start_loc_cpu.tolist()
    for r, (context, n) in enumerate(MIXED_LENGTHS):
        if n > 4:
            continue
        if op_backend == "auto":  # the request alone, at its own query length
            parts = [[(r, starts[r], n, context + n)]]
        else:  # each of its tokens decoded alone
            parts = [[(r, starts[r] + i, 1, context + i + 1)] for i in range(n)]
        for part in parts:
            meta, rows = _sub_batch(vllm_config, case, part, spec)
            alone = _forward_rows(case, meta, rows)
            assert torch.equal(alone.view(torch.int16), output[rows].view(torch.int16)), f"request {r}, {part}"


def test_batch_invariant_mode_takes_every_verification_length(vllm_config, lean_calls, monkeypatch):
    """19 speculative tokens: under VLLM_BATCH_INVARIANT=1 lean takes query lengths up to vLLM's
    threshold (20) whatever their batch-mates, a 20-token verification beside decodes included;
    without it the threshold stays at the default mode's bound, and that request is delegated."""
    requests = [(40, 20), (7, 1), (60, 13)]
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    case = make_case(vllm_config, requests, spec_tokens=19, heads=(4, 2), head_size=32, seed=14)
    check(forward(case), case.ref, torch.float32)
    assert [g.query_len for g in case.metadata.groups] == [1, 13, 20] and case.metadata.prefill is None
    assert sorted(lean_calls) == sorted([(1, 4, 32), (1, 13, 4, 32), (1, 20, 4, 32)])
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    lean_calls.clear()
    case = make_case(vllm_config, requests, spec_tokens=19, heads=(4, 2), head_size=32, seed=14)
    check(forward(case), case.ref, torch.float32)
    assert case.metadata.num_decodes == 0 and case.metadata.prefill_start == 0 and lean_calls == []


def test_default_mode_keeps_the_leading_query_length_on_lean(vllm_config, lean_calls):
    """Without VLLM_BATCH_INVARIANT the same step runs the leading length on lean and the rest of
    the batch on the delegate, in one call each."""
    case = make_case(vllm_config, MIXED_LENGTHS, spec_tokens=3, heads=(4, 2), head_size=32, seed=12)
    check(forward(case), case.ref, torch.float32)
    assert (case.metadata.num_decodes, case.metadata.groups, case.metadata.prefill_start) == (1, [], 1)
    assert lean_calls == [(1, 4, 32)]


# lean's own members of its vLLM classes: none overrides a vLLM method of the same name (vLLM's
# layers call ``do_kv_cache_update`` on their impl; 0.33 adds ``reserve_workspace`` to the MLA base).
VLLM_OWN = {
    "LeanAttentionMetadataBuilder._decode_split", "LeanAttentionMetadataBuilder._invariant_split",
    "LeanAttentionImpl._kv_views", "LeanAttentionImpl._scales", "LeanAttentionImpl._features",
    "LeanAttentionImpl.do_kv_cache_update", "LeanAttentionImpl._decode", "LeanMLADecodeMetadata.groups",
}  # fmt: skip


def test_every_vllm_name_lean_uses_is_vllms():
    """Every vLLM name lean_tp imports resolves in the installed vLLM's sources, and every member
    of lean's vLLM classes overrides one of vLLM's but lean's own, above: a method vLLM renamed
    would show up among them (scripts/check_engine_names.py; docs/vllm.md records 0.33)."""
    rows = engine_names("vllm")
    assert [name for kind, name, _ in rows if kind == "missing"] == []
    own = {name for kind, name, _ in rows if kind == "own"} - {
        "LeanMLAImpl.reserve_workspace", "LeanCPUMLAImpl.reserve_workspace"
    }  # fmt: skip
    assert own == VLLM_OWN
