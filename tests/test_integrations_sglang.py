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
