"""The SGLang backend: SGLang's own attention test kit (sglang.test.kits.attention_unittest) run
against ``--attention-backend lean`` on the CPU, and the backend's decode against a float64
reference over SGLang's token-to-KV pool (shuffled slots, page sizes 1, 16 and one that is not a
power of two), with every feature the backend maps. Needs SGLang (CI's SGLang leg installs it).
"""

from __future__ import annotations

import importlib.metadata
import os
import unittest
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.attention_registry")

from helpers import engine_names  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import mla_attention as mla_kit  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as kit_graph  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes import (
    speculative_target_verify_runner as kit_verify,  # noqa: E402
)

import lean_tp.integrations.sglang as lean_sglang  # noqa: E402
from lean_tp.integrations.sglang import backend as lean_backend  # noqa: E402
from lean_tp.ops.decode_attention import decode_attention_ref  # noqa: E402
from lean_tp.ops.decode_attention.checks import MAX_QUERY_TOKENS  # noqa: E402

NAME = lean_sglang.register()
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class _Case(unittest.TestCase):
    """The kit's ``testcase``: a backend that fails to build fails the test (the kit would skip)."""

    def runTest(self):
        pass

    def skipTest(self, reason):
        raise AssertionError(reason)


@pytest.fixture(autouse=True)
def _no_grad():
    # The kit writes the pool in place from module outputs, as SGLang's inference mode does.
    with torch.no_grad():
        yield


@pytest.fixture
def lean_calls(monkeypatch):
    """Each call the backend makes of lean_tp.decode_attention, as (q shape, keyword arguments)."""
    calls = []
    real = lean_backend.decode_attention

    def counted(q, *args, **kwargs):
        calls.append((tuple(q.shape), kwargs))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(lean_backend, "decode_attention", counted)
    return calls


@pytest.fixture(params=["torch", "triton"])
def op_backend(request, monkeypatch):
    if request.param == "triton" and not INTERPRETED:
        pytest.skip("the Triton op backend runs on CPU under TRITON_INTERPRET=1 only")
    monkeypatch.setenv(lean_backend.BACKEND_ENV, request.param)
    return request.param


def test_registered_through_the_sglang_plugin_entry_point():
    points = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "lean_tp"]
    assert [ep.value for ep in points] == ["lean_tp.integrations.sglang:register"]
    assert points[0].load()() == NAME == "lean"
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, DETERMINISTIC_ATTENTION_BACKEND_CHOICES

    assert ATTENTION_BACKEND_CHOICES.count(NAME) == 1 and DETERMINISTIC_ATTENTION_BACKEND_CHOICES.count(NAME) == 1
    assert ATTENTION_BACKENDS[NAME] is lean_sglang.create_backend


# -- SGLang's attention test kit ---------------------------------------------------------------------

KIT_CASES = (
    kit.make_dense_cases(NAME)
    + kit.make_swa_no_prefix_input_config_cases(NAME)
    + kit.make_swa_prefix_input_config_cases(NAME)
)


DECODE_CASES = [c for c in KIT_CASES if c.forward_mode.is_decode()]


@pytest.mark.parametrize("case", KIT_CASES, ids=[c.name for c in KIT_CASES])
def test_sglang_kit_dense_case(case, lean_calls, monkeypatch):
    """Every dense case of the kit: decodes run on lean, extends on the torch-native delegate."""
    # The kit asks each backend which sliding-window rule its decode follows: lean's window holds
    # the query and the `sliding_window_size` keys before it, as torch_native's and FlashInfer's.
    monkeypatch.setattr(kit, "_SWA_DECODE_EXTEND_WINDOW", kit._SWA_DECODE_EXTEND_WINDOW | {NAME})
    kit.run_dense_attention_case(_Case(), case, device="cpu")
    assert len(lean_calls) == (1 if case.forward_mode.is_decode() else 0)


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_sglang_kit_decode_on_the_kernel(case, lean_calls, monkeypatch):
    """The kit's decode cases on the Triton kernel (the interpreter on CPU)."""
    if not INTERPRETED:
        pytest.skip("the Triton op backend runs on CPU under TRITON_INTERPRET=1 only")
    monkeypatch.setenv(lean_backend.BACKEND_ENV, "triton")
    kit.run_dense_attention_case(_Case(), case, device="cpu")
    assert lean_calls[0][1]["backend"] == "triton"


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_sglang_kit_cuda_graph_decode(case, op_backend, lean_calls):
    """The kit's graph runner: capture-time buffers, then a padded replay batch (fill length 1)."""
    kit_graph.run_dense_cuda_graph_decode_case(_Case(), case, device="cpu")
    assert lean_calls, "decode never reached lean"


def _verify_case(page_size: int, prefix_lens=(5, 17, 30), drafts: int = 3) -> kit.DenseAttentionCase:
    return kit.DenseAttentionCase(
        name=f"verify_p{page_size}",
        backend=NAME,
        forward_mode=ForwardMode.TARGET_VERIFY,
        num_heads=4,
        num_kv_heads=2,
        page_size=page_size,
        prefix_lens=prefix_lens,
        extend_lens=(drafts,) * len(prefix_lens),
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_kit_chain_verify(page_size, op_backend, lean_calls):
    """EAGLE chain verification (topk 1): every draft token attends causally, on lean in one call."""
    kit_verify.run_dense_eagle_verify_case(_Case(), _verify_case(page_size), topk=1, device="cpu")
    assert [shape for shape, _ in lean_calls] == [(3, 3, 4, kit.DEFAULT_HEAD_DIM)]


# -- against float64 -------------------------------------------------------------------------------


def _fixture(
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    prefix_lens,
    mode=ForwardMode.DECODE,
    drafts: int = 1,
    dtype=torch.float16,
):
    """The kit's runner, pool and forward batch for a batch (slots shuffled by page), with the
    backend built over them."""
    case = kit.DenseAttentionCase(
        name=f"lean_p{page_size}_h{num_heads}_{num_kv_heads}",
        backend=NAME,
        forward_mode=mode,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        prefix_lens=tuple(prefix_lens),
        extend_lens=(drafts,) * len(prefix_lens) if drafts > 1 else (),
    )
    fixture = kit.build_dense_attention_fixture(
        _Case(), case, head_dim=64, hidden_size=64, dtype=dtype, device="cpu", max_context_len=320
    )
    if drafts > 1:
        kit_verify._prepare_spec_verify_batch(case, fixture.forward_batch, topk=1, spec_kind="eagle", device="cpu")
    return fixture


def _reference(fixture, q, layer, drafts: int, **features):
    """float64 attention of q (T, Hq, D) against each request's keys gathered from the pool."""
    batch, pool = fixture.forward_batch, fixture.runner.token_to_kv_pool
    lens = (batch.seq_lens + (drafts if drafts > 1 else 0)).tolist()
    rows = fixture.runner.req_to_token_pool.req_to_token[batch.req_pool_indices.long()]
    k_all, v_all = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    cap = max(lens)
    # Slot 0 past a request's keys, whatever the row holds there: the reference reads none of them.
    slots = torch.where(torch.arange(cap) < torch.tensor(lens)[:, None], rows[:, :cap], 0).long()
    gather = lambda buf: buf[slots].transpose(1, 2)  # noqa: E731
    k, v = gather(k_all).float(), gather(v_all).float()
    if "k_scale" in features:
        k, v = k * features.pop("k_scale"), v * features.pop("v_scale")
    qq = q.view(len(lens), drafts, *q.shape[1:]) if drafts > 1 else q.view(len(lens), *q.shape[1:])
    out, _ = decode_attention_ref(
        qq.float(), k, v, torch.tensor(lens, dtype=torch.int32), softmax_scale=layer.scaling, **features
    )
    return out.reshape(q.shape[0], -1)


FEATURES = {
    "plain": {},
    "window": {"sliding_window_size": 6},
    "softcap": {"logit_cap": 3.0},
    "sinks": {"sinks": True},
}


@pytest.mark.parametrize("page_size", [1, 16, 12])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_sglang_decode_matches_float64(page_size, feature, op_backend, lean_calls):
    """Ragged lengths around the page (0 prefix, 1, page-1, page, page+1, long), GQA group 4."""
    prefix_lens = [0, 1, page_size - 1, page_size, page_size + 1, 200]
    fixture = _fixture(page_size, 8, 2, prefix_lens)
    options = dict(FEATURES[feature])
    gen = torch.Generator().manual_seed(page_size * 31 + len(feature))
    sinks = torch.randn(8, generator=gen) if options.pop("sinks", False) else None
    layer = RadixAttention(8, 64, 0.125, 2, layer_id=0, **options)
    tokens = len(prefix_lens)
    q, k, v = (torch.randn(tokens, h, 64, generator=gen).half() for h in (8, 2, 2))
    backend = fixture.backend
    backend.init_forward_metadata(fixture.forward_batch)
    out = backend.forward(q, k, v, layer, fixture.forward_batch, sinks=sinks)
    window = options.get("sliding_window_size")
    expected = _reference(
        fixture,
        q,
        layer,
        1,
        softcap=options.get("logit_cap"),
        sinks=sinks,
        window=None if window is None else window + 1,
    )
    torch.testing.assert_close(out.double(), expected, atol=TOL[torch.float16], rtol=0)
    assert len(lean_calls) == 1 and lean_calls[0][1]["window"] == (None if window is None else window + 1)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("padding", ["-1", "stale"])
def test_sglang_unused_table_entries_hold_any_padding(page_size, padding, op_backend, lean_calls):
    """``req_to_token`` past a request's keys holds what the pool leaves there (-1, or stale slots
    of other requests, some past the pool): the columns they become are never read."""
    prefix_lens = [0, 1, page_size + 1, 40]
    fixture = _fixture(page_size, 8, 2, prefix_lens)
    req_to_token = fixture.runner.req_to_token_pool.req_to_token
    slots = fixture.runner.token_to_kv_pool.k_buffer[0].shape[0]
    batch = fixture.forward_batch
    for r, n in zip(batch.req_pool_indices.tolist(), (batch.seq_lens).tolist()):
        tail = req_to_token[r, n:]
        if padding == "-1":
            tail.fill_(-1)
        else:  # slots other requests own, the last slot, and slots past the pool
            stale = torch.tensor([slots + page_size, 3, slots - 1, 2**31 - 1], dtype=torch.int32)
            tail.copy_(stale.repeat(-(-tail.numel() // 4))[: tail.numel()])
    gen = torch.Generator().manual_seed(page_size)
    layer = RadixAttention(8, 64, 0.125, 2, layer_id=0)
    q, k, v = (torch.randn(len(prefix_lens), h, 64, generator=gen).half() for h in (8, 2, 2))
    fixture.backend.init_forward_metadata(batch)
    out = fixture.backend.forward(q, k, v, layer, batch)
    torch.testing.assert_close(out.double(), _reference(fixture, q, layer, 1), atol=TOL[torch.float16], rtol=0)
    assert len(lean_calls) == 1


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_sglang_decode_fp8_pool(fp8, op_backend, lean_calls, monkeypatch):
    """An fp8 pool holds k / k_scale (SGLang's write); lean reads it back times the layer's scale."""
    fixture = _fixture(16, 4, 2, [3, 40, 17], dtype=torch.bfloat16)
    pool = fixture.runner.token_to_kv_pool
    # The same pool rebuilt in fp8: SGLang stores it as bytes and views it as `fp8` on reads.
    pool.dtype, pool.store_dtype = fp8, torch.uint8
    pool.k_buffer = [b.to(fp8).view(torch.uint8) for b in pool.k_buffer]
    pool.v_buffer = [b.to(fp8).view(torch.uint8) for b in pool.v_buffer]
    layer = RadixAttention(4, 64, 0.125, 2, layer_id=0)
    layer.k_scale, layer.v_scale = torch.tensor(0.5), torch.tensor(2.0)
    layer.k_scale_float, layer.v_scale_float = 0.5, 2.0
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, h, 64, generator=gen).bfloat16() for h in (4, 2, 2))
    fixture.backend.init_forward_metadata(fixture.forward_batch)
    out = fixture.backend.forward(q, k.clone(), v.clone(), layer, fixture.forward_batch)
    expected = _reference(fixture, q, layer, 1, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out.double(), expected, atol=TOL[torch.bfloat16], rtol=0)
    assert lean_calls[0][1]["k_scale"] == 0.5 and lean_calls[0][1]["v_scale"] == 2.0


@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_verify_graph_buffers_match_eager(page_size, op_backend, lean_calls):
    """Chain verification of 4 drafts against float64, built eagerly and through the CUDA-graph
    buffers (capture size 6 > batch 3): the same values, bit for bit."""
    fixture = _fixture(page_size, 8, 2, [2, 37, 100], mode=ForwardMode.TARGET_VERIFY, drafts=4)
    layer = RadixAttention(8, 64, 0.125, 2, layer_id=0, sliding_window_size=20, logit_cap=5.0)
    gen = torch.Generator().manual_seed(page_size)
    q, k, v = (torch.randn(12, h, 64, generator=gen).half() for h in (8, 2, 2))
    backend, batch = fixture.backend, fixture.forward_batch
    backend.init_forward_metadata(batch)
    eager = backend.forward(q, k, v, layer, batch)
    backend.init_cuda_graph_state(max_bs=6, max_num_tokens=24)
    backend.init_forward_metadata_out_graph(batch, in_capture=True)
    backend.init_forward_metadata_in_graph(batch)
    graphed = backend.forward(q, k, v, layer, batch, save_kv_cache=False)
    assert backend.forward_metadata.block_table.data_ptr() == backend.graph.block_table.data_ptr()
    expected = _reference(fixture, q, layer, 4, window=21, softcap=5.0)
    torch.testing.assert_close(eager.double(), expected, atol=TOL[torch.float16], rtol=0)
    assert torch.equal(eager, graphed)
    assert [shape for shape, _ in lean_calls] == [(3, 4, 8, 64)] * 2


def test_sglang_deterministic_inference_is_batch_invariant(op_backend):
    """Under --enable-deterministic-inference a request's decode bits do not depend on its batch."""
    lens = [150, 7, 64, 300]
    fixtures = [_fixture(1, 8, 1, lens), _fixture(1, 8, 1, lens[:1])]
    overrides = get_context().override_server_args(enable_deterministic_inference=True)
    overrides.install()
    try:
        backends = [lean_sglang.create_backend(f.runner) for f in fixtures]
    finally:
        overrides.restore()
    assert all(b.batch_invariant for b in backends) and not fixtures[0].backend.batch_invariant
    layer = RadixAttention(8, 64, 0.125, 1, layer_id=0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, h, 64, generator=gen).half() for h in (8, 1, 1))
    outs = []
    for fixture, backend, rows in zip(fixtures, backends, (slice(None), slice(0, 1))):
        backend.init_forward_metadata(fixture.forward_batch)
        outs.append(backend.forward(q[rows], k[rows], v[rows], layer, fixture.forward_batch))
    # Both pools hold request 0's keys from the same seed (checked), so its row must agree bit for bit.
    keys = [
        f.runner.token_to_kv_pool.k_buffer[0][f.runner.req_to_token_pool.req_to_token[0, :151].long()] for f in fixtures
    ]
    assert torch.equal(keys[0], keys[1])
    assert torch.equal(outs[0][0], outs[1][0])


@pytest.mark.parametrize("drafts", [3, 20])
def test_sglang_deterministic_verify_gives_each_draft_its_decode_bits(monkeypatch, lean_calls, drafts):
    """Under --enable-deterministic-inference chain verification runs the op's batch-invariant mode
    too: each draft token's rows are bitwise those of decoding it alone, with the keys up to its own
    position (the kernel, in the interpreter: the op's promise across query lengths), for any
    number of drafts (20: past the default mode's bound, which sends it to the delegate)."""
    if not INTERPRETED:
        pytest.skip("the Triton op backend runs on CPU under TRITON_INTERPRET=1 only")
    monkeypatch.setenv(lean_backend.BACKEND_ENV, "triton")
    prefix_lens = [5, 30]
    fixture = _fixture(16, 4, 2, prefix_lens, mode=ForwardMode.TARGET_VERIFY, drafts=drafts)
    overrides = get_context().override_server_args(enable_deterministic_inference=True)
    overrides.install()
    try:
        backend = lean_sglang.create_backend(fixture.runner)
    finally:
        overrides.restore()
    layer = RadixAttention(4, 64, 0.125, 2, layer_id=0, sliding_window_size=20)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(len(prefix_lens) * drafts, h, 64, generator=gen).half() for h in (4, 2, 2))
    batch = fixture.forward_batch
    backend.init_forward_metadata(batch)
    verified = backend.forward(q, k, v, layer, batch)  # writes the drafts' keys and values
    for b, prefix in enumerate(prefix_lens):
        for i in range(drafts):
            keys = torch.tensor([prefix + i + 1])
            one = SimpleNamespace(
                forward_mode=ForwardMode.DECODE,
                seq_lens=keys,
                seq_lens_cpu=keys,
                req_pool_indices=batch.req_pool_indices[b : b + 1],
                spec_info=None,
            )
            backend.init_forward_metadata(one)
            t = b * drafts + i
            alone = backend.forward(q[t : t + 1], k[t : t + 1], v[t : t + 1], layer, one, save_kv_cache=False)
            assert torch.equal(alone[0], verified[t]), f"request {b}, draft {i}"
    assert lean_calls[0][0] == (2, drafts, 4, 64) and all(kwargs["batch_invariant"] for _, kwargs in lean_calls)
    default = lean_sglang.create_backend(fixture.runner)
    assert default.query_len(batch) == (drafts if drafts <= MAX_QUERY_TOKENS else None)


# -- MLA (DeepSeek): the kit's MLA attention over SGLang's latent pool --------------------------------

MLA_CASES = mla_kit.make_mla_cases(NAME)
# The kit's tiny DeepSeek attention with DeepSeek's latent row, the pair lean's kernel takes.
MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64)


@pytest.fixture
def checked_calls(monkeypatch):
    """Each lean call the backend makes, checked against the op's float64 reference on the same
    arguments (the latent pool as K, its first 512 columns as V): the q shapes."""
    calls = []
    real = lean_backend.decode_attention

    def checked(q, k_cache, v_cache, seq_lens, **kwargs):
        out = real(q, k_cache, v_cache, seq_lens, **kwargs)
        assert v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[-1] == 512 < k_cache.shape[-1]
        ref_kwargs = {k: kwargs[k] for k in ("block_table", "softmax_scale", "k_scale", "v_scale")}
        ref, _ = decode_attention_ref(q, k_cache, v_cache, seq_lens, **ref_kwargs)
        torch.testing.assert_close(out.double(), ref, atol=TOL[q.dtype], rtol=0)
        calls.append(tuple(q.shape))
        return out

    monkeypatch.setattr(lean_backend, "decode_attention", checked)
    return calls


@pytest.mark.parametrize("case", MLA_CASES, ids=[c.name for c in MLA_CASES])
def test_sglang_kit_mla_case(case, checked_calls):
    """Every MLA case of the kit (page sizes 1, 16, 32; prefixes around the page): decodes run on
    lean over the latent pool, each call against float64; extends on the torch-native delegate."""
    mla_kit.run_mla_attention_case(_Case(), case, device="cpu", dtype=torch.float32, **MLA_DIMS)
    assert len(checked_calls) == (1 if case.forward_mode.is_decode() else 0)
    if checked_calls:
        assert checked_calls[0][-1] == 576


def test_sglang_kit_mla_decode_on_the_kernel(checked_calls, monkeypatch):
    """The kit's MLA decode on the Triton kernel (the interpreter), V read from K's tile."""
    if not INTERPRETED:
        pytest.skip("the Triton op backend runs on CPU under TRITON_INTERPRET=1 only")
    monkeypatch.setenv(lean_backend.BACKEND_ENV, "triton")
    case = next(c for c in MLA_CASES if c.name == "mla_decode_page_boundary")
    mla_kit.run_mla_attention_case(_Case(), case, device="cpu", dtype=torch.float16, **MLA_DIMS)
    assert len(checked_calls) == 1


# -- SGLang's engine on CPU ---------------------------------------------------------------------------


def test_sglang_engine_on_cpu_generates_torch_natives_tokens(tmp_path):
    """``sglang.Engine(device="cpu")`` on a small random Llama: greedy tokens with ``lean`` equal
    ``torch_native``'s, prompts sharing a 40-token prefix that the radix cache serves to the later
    ones (tests/sglang_engine_worker.py, in its own process: the engine starts its scheduler in
    processes of its own)."""
    import json
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "sglang_engine_worker.py")
    proc = subprocess.run(
        [sys.executable, worker, str(tmp_path / "llama")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    lean, native = result["lean"], result["torch_native"]
    assert lean["tokens"] == native["tokens"] and len({tuple(t) for t in lean["tokens"]}) == 4
    assert all(len(t) == 12 for t in lean["tokens"])
    assert lean["cached"] == native["cached"] == [0, 40, 40, 40]


# -- settings the backend cannot run ----------------------------------------------------------------


def _runner(**changes):
    fixture = _fixture(16, 4, 2, [3])
    runner = fixture.runner
    for name, value in changes.items():
        setattr(runner, name, value)
    return runner


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(use_mla_backend=True), "KV pool: expected SGLang's MLATokenToKVPool"),
        (dict(model_config=SimpleNamespace(is_encoder_decoder=True)), "encoder-decoder"),
    ],
)
def test_sglang_refuses_runners_it_cannot_serve(change, message):
    with pytest.raises(ValueError, match=message):
        lean_sglang.create_backend(_runner(**change))


def test_sglang_refuses_compact_ragged_verify(monkeypatch):
    """DSpark's compact ragged verification gives each request its own draft count in one verify
    batch: refused at start-up; its static and cap-accept modes keep one count per batch."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner = _runner(spec_algorithm=SpeculativeAlgorithm.DSPARK)
    for mode in ("static", "cap-accept"):
        monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
        assert lean_backend.runner_problem(runner) is None
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    with pytest.raises(ValueError, match="SGLANG_RAGGED_VERIFY_MODE: expected static or cap-accept"):
        lean_sglang.create_backend(runner)
    assert lean_backend.runner_problem(_runner(spec_algorithm=SpeculativeAlgorithm.EAGLE)) is None


@pytest.mark.parametrize(
    "layer,message",
    [
        (lambda: RadixAttention(4, 64, 0.125, 2, layer_id=0, is_cross_attention=True), "attn_type"),
        (lambda: RadixAttention(4, 64, 0.125, 2, layer_id=0, attn_type=AttentionType.ENCODER_ONLY), "attn_type"),
        (lambda: RadixAttention(4, 64, 0.125, 2, layer_id=0, v_head_dim=32), r"or an MLA pair in \[\(576, 512\)\]"),
        (lambda: RadixAttention(4, 12, 0.125, 2, layer_id=0), "head_dim: expected a multiple of 8"),
    ],
)
def test_sglang_refuses_layers_it_cannot_run(layer, message):
    fixture = _fixture(16, 4, 2, [3])
    fixture.backend.init_forward_metadata(fixture.forward_batch)
    q, kv = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 64).half()
    with pytest.raises(ValueError, match=message):
        fixture.backend.forward(q, kv, kv, layer(), fixture.forward_batch)


def test_sglang_refuses_sinks_in_cpu_prefill():
    """SGLang's torch-native prefill (the CPU delegate) has no sinks: refused, not dropped."""
    case = kit.DenseAttentionCase(
        name="extend_sinks",
        backend=NAME,
        forward_mode=ForwardMode.EXTEND,
        num_heads=4,
        num_kv_heads=2,
        page_size=16,
        prefix_lens=(3,),
        extend_lens=(2,),
    )
    fixture = kit.build_dense_attention_fixture(_Case(), case, head_dim=64, hidden_size=64, device="cpu")
    fixture.backend.init_forward_metadata(fixture.forward_batch)
    q, kv = torch.randn(2, 4, 64).half(), torch.randn(2, 2, 64).half()
    layer = RadixAttention(4, 64, 0.125, 2, layer_id=0)
    with pytest.raises(ValueError, match="sinks: SGLang's torch-native prefill"):
        fixture.backend.forward(q, kv, kv, layer, fixture.forward_batch, sinks=torch.zeros(4))


def test_sglang_op_backend_setting_is_checked(monkeypatch):
    fixture = _fixture(16, 4, 2, [3])
    monkeypatch.setenv(lean_backend.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="LEAN_TP_SGLANG_BACKEND: expected one of"):
        lean_sglang.create_backend(fixture.runner)


# -- what SGLang's GPU runners reach ----------------------------------------------------------------


def _triton_delegate(monkeypatch):
    """lean's delegate as on GPUs, SGLang's Triton backend, whose kernels run in the interpreter here."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    monkeypatch.setattr(lean_backend, "_delegate", lambda runner, on_gpu: TritonAttnBackend(runner))


def test_sglang_mla_kv_scale_is_stored_and_read_as_the_triton_delegate_does(monkeypatch):
    """A checkpoint KV scale of 2 on an MLA layer: SGLang's Triton backend, lean's prefill
    delegate on GPUs, writes the extend's latent rows as k / 2; lean's decode of each request's
    last token over the same pool reads rows times 2, against float64 and against the delegate's
    own extend output for that token."""
    if not INTERPRETED:
        pytest.skip("SGLang's Triton backend runs on CPU under TRITON_INTERPRET=1 only")
    _triton_delegate(monkeypatch)
    case = next(c for c in MLA_CASES if c.name == "mla_extend_page_size_1")  # prefixes 2, 4; extends 3, 1
    fixture = mla_kit.build_mla_attention_fixture(_Case(), case, device="cpu", dtype=torch.float32, **MLA_DIMS)
    backend, batch = fixture.backend, fixture.forward_batch
    layer = mla_kit.mla_attention_layers(fixture)[0]
    layer.k_scale = layer.v_scale = torch.tensor(2.0)
    layer.k_scale_float = layer.v_scale_float = 2.0
    gen = torch.Generator().manual_seed(5)
    tokens, heads = case.num_input_tokens, case.num_heads
    q = torch.randn(tokens, heads * 576, generator=gen)
    k = torch.randn(tokens, 1, 576, generator=gen)
    backend.init_forward_metadata(batch)
    extend_out = backend.forward_extend(q, k, k[..., :512], layer, batch)
    pool = fixture.runner.token_to_kv_pool
    torch.testing.assert_close(pool.get_key_buffer(0)[batch.out_cache_loc], k / 2, atol=0, rtol=0)
    # Each request's last token as a decode over the pool the delegate wrote (its row included).
    last = batch.extend_start_loc + batch.extend_seq_lens - 1
    decode = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, seq_lens=batch.seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
        req_pool_indices=batch.req_pool_indices, spec_info=None,
    )  # fmt: skip
    backend.init_forward_metadata(decode)
    out = backend.forward_decode(q[last], None, None, layer, decode, save_kv_cache=False)
    rows = fixture.runner.req_to_token_pool.req_to_token[batch.req_pool_indices.long()]
    lens = batch.seq_lens.tolist()
    latent = [pool.get_key_buffer(0)[rows[b, :n].long()].double().squeeze(1) * 2 for b, n in enumerate(lens)]
    for b, (n, t) in enumerate(zip(lens, last.tolist())):
        qb = q[t].view(heads, 576).double()
        p = torch.softmax(qb @ latent[b].transpose(0, 1) * layer.scaling, dim=-1)
        torch.testing.assert_close(out[b].view(heads, 512).double(), p @ latent[b][:, :512], atol=2e-5, rtol=0)
    torch.testing.assert_close(out, extend_out[last], atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "LlamaForCausalLM"])
def test_sglang_deterministic_inference_keeps_the_radix_cache(tmp_path, arch):
    """SGLang's start-up check of ``--enable-deterministic-inference`` with ``lean``: a DeepSeek
    (absorbed MLA) model is accepted, and the radix cache stays on, for it and for a Llama."""
    from sglang.srt.arg_groups.attention_hook import handle_deterministic_inference, resolved_view
    from sglang.srt.server_args import ServerArgs
    from transformers import DeepseekV2Config, LlamaConfig
    from vllm_generate import SMALL, SMALL_MLA

    config = DeepseekV2Config(**SMALL_MLA) if arch.startswith("Deepseek") else LlamaConfig(**SMALL)
    config.architectures = [arch]
    config.save_pretrained(tmp_path)
    args = ServerArgs(
        model_path=str(tmp_path), attention_backend=NAME, device="cpu", enable_deterministic_inference=True
    )
    handle_deterministic_inference(args)
    assert not resolved_view(args).disable_radix_cache


def test_sglang_speculative_hooks_answer_as_the_eagle_workers_call_them(monkeypatch):
    """What the EAGLE workers read from the target's backend: ``verify_mask`` (the delegate's:
    lean's chain verification reads none), ``max_context_len`` (sizing a mask when the batch's
    seq_lens_sum is unknown) and ``update_verify_buffers_to_fill_after_draft`` (the overlap plan
    stream), with the torch-native delegate and with the Triton one."""
    runner = _fixture(16, 8, 2, [3, 40]).runner
    native = lean_sglang.create_backend(runner)
    assert native.verify_mask is None and native.max_context_len == runner.model_config.context_len
    native.update_verify_buffers_to_fill_after_draft(None, None)
    _triton_delegate(monkeypatch)
    triton = lean_sglang.create_backend(runner)
    updates = []
    monkeypatch.setattr(triton.delegate, "update_verify_buffers_to_fill_after_draft", lambda *a: updates.append(a))
    assert triton.triton_delegate and triton.verify_mask is triton.delegate.verify_mask
    triton.update_verify_buffers_to_fill_after_draft("spec", 8)
    assert updates == [("spec", 8)]


@pytest.mark.parametrize("name", ["score_mod", "aux_tensors"])
def test_sglang_refuses_score_modifiers_on_lean_and_passes_them_to_prefill(name, lean_calls, monkeypatch):
    """A score modifier on a decode is refused, naming it (the op has none); on a prefill it goes to
    the delegate with the forward's other keywords."""
    fixture = _fixture(16, 8, 2, [3, 40])
    layer = RadixAttention(8, 64, 0.125, 2, layer_id=0)
    q, k, v = (torch.randn(2, h, 64).half() for h in (8, 2, 2))
    backend = fixture.backend
    backend.init_forward_metadata(fixture.forward_batch)
    with pytest.raises(ValueError, match=f"{name}: expected None for the lean backend's decode"):
        backend.forward_decode(q, k, v, layer, fixture.forward_batch, **{name: object()})
    backend.forward_metadata = None  # a prefill's forward: the delegate's
    passed = []
    monkeypatch.setattr(backend.delegate, "forward_extend", lambda *a, **kw: passed.append(kw))
    backend.forward_extend(q, k, v, layer, fixture.forward_batch, **{name: "modifier"})
    assert passed == [{name: "modifier"}] and not lean_calls


@pytest.mark.parametrize("glue", [False, True])
def test_sglang_graph_tables_under_the_metadata_glue_graph(glue, monkeypatch, lean_calls):
    """SGLANG_ENABLE_METADATA_GLUE_GRAPH=1 records init_forward_metadata_out_graph into a graph: the
    columns lean fills there are then the whole table (a width from host lengths would be frozen),
    and the decode still matches float64; without it they are the batch's longest request's."""
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1" if glue else "0")
    fixture = _fixture(16, 8, 2, [3, 40])
    fixture.forward_batch.seq_lens_cpu = fixture.forward_batch.seq_lens.cpu()  # as SGLang's scheduler keeps it
    backend = lean_sglang.create_backend(fixture.runner)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.graph.block_table.fill_(-7)
    backend.init_forward_metadata_out_graph(fixture.forward_batch, in_capture=True)
    filled = int((backend.graph.block_table[:2] != -7).all(0).sum())
    assert filled == (backend.max_pages if glue else 3) and backend.max_pages > 3
    layer = RadixAttention(8, 64, 0.125, 2, layer_id=0)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 64, generator=gen).half() for h in (8, 2, 2))
    out = backend.forward(q, k, v, layer, fixture.forward_batch)
    torch.testing.assert_close(out.double(), _reference(fixture, q, layer, 1), atol=TOL[torch.float16], rtol=0)


@pytest.mark.parametrize("topk,drafts,needed", [(None, None, False), (1, 4, False), (4, 8, True), (1, 40, True)])
def test_sglang_triton_delegate_graph_state_only_where_it_replays(topk, drafts, needed, monkeypatch):
    """The Triton delegate's CUDA-graph state (split-KV logits: gigabytes for MLA) is set up only
    when a captured forward can reach it: a tree verification or more drafts than lean takes. A
    captured mode lean did not foresee sets it up before its first capture."""
    from sglang.srt.runtime_context import get_spec

    runner = _fixture(16, 8, 2, [3, 40]).runner
    _triton_delegate(monkeypatch)
    backend = lean_sglang.create_backend(runner)
    algorithm = "EAGLE" if drafts else None
    with get_spec().override(
        speculative_algorithm=algorithm, speculative_eagle_topk=topk, speculative_num_draft_tokens=drafts
    ):
        assert backend.delegate_replays_graphs() is needed
        states = []
        monkeypatch.setattr(backend.delegate, "init_cuda_graph_state", lambda *a: states.append(a))
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
        assert states == ([(4, 4)] if needed else [])
        monkeypatch.setattr(backend.delegate, "init_forward_metadata_out_graph", lambda *a: None)
        backend.init_forward_metadata_out_graph(SimpleNamespace(forward_mode=ForwardMode.EXTEND), True)
        assert states == [(4, 4)]


def test_sglang_decode_under_torch_compile(op_backend, lean_calls):
    """``--enable-torch-compile`` traces the model's forward with dynamo: lean's decode, the KV
    write included, traces as one graph (the op is a torch.library op with a fake), so no
    ``torch.compiler.disable`` is needed, and gives the eager bits."""
    fixture = _fixture(16, 8, 2, [3, 40, 100])
    layer = RadixAttention(8, 64, 0.125, 2, layer_id=0)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, h, 64, generator=gen).half() for h in (8, 2, 2))
    backend, batch = fixture.backend, fixture.forward_batch
    backend.init_forward_metadata(batch)
    eager = backend.forward(q, k, v, layer, batch)
    compiled = torch.compile(lambda q, k, v: backend.forward(q, k, v, layer, batch), backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


# lean's own members of its SGLang backend: none overrides an SGLang method of the same name.
SGLANG_OWN = {
    "LeanAttnBackend.__init__", "LeanAttnBackend.query_len", "LeanAttnBackend.delegate_replays_graphs",
    "LeanAttnBackend._pages", "LeanAttnBackend._fill_table", "LeanAttnBackend._metadata",
    "LeanAttnBackend._init_delegate_graph_state", "LeanAttnBackend._check_layer", "LeanAttnBackend._run_lean",
    "LeanAttnBackend._scales",
}  # fmt: skip


def test_every_sglang_name_lean_uses_is_sglangs():
    """Every SGLang name lean_tp imports resolves in the installed SGLang's sources, and every
    member of lean's backend overrides one of SGLang's but lean's own, above
    (scripts/check_engine_names.py)."""
    rows = engine_names("sglang")
    assert [name for kind, name, _ in rows if kind == "missing"] == []
    assert {name for kind, name, _ in rows if kind == "own"} == SGLANG_OWN
