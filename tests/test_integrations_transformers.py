"""attn_implementation="lean" in transformers: same greedy tokens as "sdpa" (Llama, Mistral, Qwen2;
batch 1 and left-padded batches; DynamicCache and StaticCache), bf16 logits per step, the SDPA
fallback logged once, and torch.compile of the model (examples/compile_hf.py) with no graph break."""

import copy
import inspect
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

import lean_tp.integrations.transformers as lean_hf

SMALL = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=256,
    pad_token_id=0,
)
CONFIGS = {"llama": LlamaConfig(**SMALL), "mistral": MistralConfig(**SMALL), "qwen2": Qwen2Config(**SMALL)}


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts decode-op calls made by the integration, to prove decode steps do not silently fall back."""
    calls = []
    real = lean_hf.decode_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)  # (B, q_len, Hq, D)
        return real(*args, **kwargs)

    monkeypatch.setattr(lean_hf, "decode_attention", spy)
    return calls


def _pair(arch: str, dtype=torch.float32):
    torch.manual_seed(0)
    # Each model gets its own config: from_config records the attention implementation on it.
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[arch]), attn_implementation="sdpa", dtype=dtype)
    lean = AutoModelForCausalLM.from_config(
        copy.deepcopy(CONFIGS[arch]), attn_implementation=lean_hf.register(), dtype=dtype
    )
    assert sdpa.config._attn_implementation == "sdpa" and lean.config._attn_implementation == "lean"
    lean.load_state_dict(sdpa.state_dict())
    return sdpa.eval(), lean.eval()


def batch_of(case: str):
    g = torch.Generator().manual_seed(1)
    if case == "batch1":
        ids = torch.randint(3, 256, (1, 9), generator=g)
        return ids, torch.ones_like(ids)
    ids = torch.randint(3, 256, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5], mask[2, :1] = 0, 0  # left padding, as generate() expects for decoder-only models
    ids[mask == 0] = 0
    return ids, mask


def test_register_is_idempotent():
    from transformers import AttentionInterface

    assert lean_hf.register() == "lean" == lean_hf.register()
    assert AttentionInterface._global_mapping["lean"] is lean_hf.lean_attention_forward


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("case", ["batch1", "left-padded"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_generate_matches_sdpa(arch, case, cache, lean_calls):
    sdpa, lean = _pair(arch)
    ids, mask = batch_of(case)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, cache_implementation=cache)
    expected = sdpa.generate(ids, **kwargs)
    got = lean.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    decode_calls = [shape for shape in lean_calls if shape[1] == 1]
    assert len(decode_calls) == 9 * SMALL["num_hidden_layers"]  # every decode step of every layer ran the op


def test_bf16_logits_match_sdpa_every_step():
    """Teacher-forced with SDPA's tokens so both see the same inputs; each step's logits agree."""
    sdpa, lean = _pair("llama", torch.bfloat16)
    ids, mask = batch_of("left-padded")
    caches = [DynamicCache(config=sdpa.config), DynamicCache(config=lean.config)]
    # The cache's keyword: ``cache`` where the forward takes it (5.24 does, and warns that
    # ``past_key_values`` is removed in 5.40), ``past_key_values`` on earlier 5.x.
    forward_args = inspect.signature(LlamaForCausalLM.forward).parameters
    cache_kw = "cache" if "cache" in forward_args else "past_key_values"
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask, **{cache_kw: c}).logits[:, -1] for m, c in zip((sdpa, lean), caches)]
        for _ in range(8):
            torch.testing.assert_close(logits[1].float(), logits[0].float(), atol=4e-2, rtol=4e-2)
            token = logits[0].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = [
                m(token, attention_mask=mask, **{cache_kw: c}).logits[:, -1] for m, c in zip((sdpa, lean), caches)
            ]


def test_right_padding_falls_back_to_sdpa_logged_once(caplog, lean_calls):
    """Right padding leaves a gap between prompt and new tokens: not one run, so SDPA, said once."""
    sdpa, lean = _pair("llama")
    ids, mask = batch_of("left-padded")
    mask = mask.flip(1)
    lean_hf._logged.clear()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with caplog.at_level(logging.INFO, logger="lean_tp"):
        got = lean.generate(ids, **kwargs)
    assert torch.equal(got, sdpa.generate(ids, **kwargs))
    fallbacks = [r for r in caplog.records if "a mask the decode op does not imply" in r.getMessage()]
    assert len(fallbacks) == 1 and fallbacks[0].levelno == logging.WARNING
    assert lean_calls == []


@pytest.mark.parametrize(
    "rows,window,expect",
    [
        ([[0, 0, 1, 1, 1, 0]], None, ([2], [5], [True])),  # left padding + unfilled static tail
        ([[1, 1, 1, 1, 1, 1]], None, ([0], [6], [True])),
        ([[0, 0, 0, 1, 1, 0]], None, ([3], [5], [True])),  # sliding window cut
        ([[1, 1, 0, 0, 1, 0]], None, ([0], [5], [False])),  # right padding: a gap
        ([[0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], None, ([1], [5], [True])),  # 3 tokens, causal
        ([[1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0]], 2, ([0], [4], [True])),  # 3 tokens, window 2
        ([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], 2, ([0], [4], [False])),  # the mask has no window
        ([[0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], None, ([1], [5], [False])),  # not causal
    ],
)
def test_mask_bounds(rows, window, expect):
    mask = torch.tensor(rows, dtype=torch.bool)[None, None]
    leftpad, seqlens, matches = lean_hf.mask_bounds(mask, 1, mask.shape[2], mask.shape[-1], window, torch.device("cpu"))
    assert (leftpad.tolist(), seqlens.tolist(), matches.tolist()) == expect
    none = lean_hf.mask_bounds(None, 2, 1, 7, None, torch.device("cpu"))
    assert none[0].tolist() == [0, 0] and none[1].tolist() == [7, 7] and none[2].all()


def test_float_mask_falls_back(lean_calls):
    sdpa, lean = _pair("llama")
    attn = lean.model.layers[0].self_attn
    q, k = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 5, 16)
    mask = torch.zeros(2, 1, 1, 5)
    out, _ = lean_hf.lean_attention_forward(attn, q, k, k, mask, scaling=0.25)
    ref, _ = lean_hf.fallback(attn, q, k, k, mask, scaling=0.25)
    torch.testing.assert_close(out, ref)
    assert lean_calls == []


def test_compile_hf_example_compiles_the_op_without_graph_breaks(capsys, monkeypatch):
    """examples/compile_hf.py, in this process: torch.compile(fullgraph=True) of a tiny Llama with a
    static cache and a left-padded ragged batch (a graph break would be an error), the lean op in
    the compiled decode graph, and every token equal to an eager SDPA copy's. The example's
    torch.compile is given a backend that records each graph's ops, then runs it through AOTAutograd
    (functionalization, the op's fake implementation) without Inductor's CPU code generation, which
    tests/test_model.py's compiled decode loop runs (here it would be about 50 s of 70 on 2 cores)."""
    import compile_hf  # examples/ is on sys.path (conftest)
    from torch._dynamo.backends.debugging import aot_eager

    graphs, real_compile = [], torch.compile

    def recording(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, backend=recording, **kw))
    torch._dynamo.reset()
    assert compile_hf.main(["--check", "--gen", "8"]) == 0
    out = capsys.readouterr().out
    assert "0 graph breaks" in out and "check: OK (32 tokens identical to eager SDPA)" in out, out
    # Prefill (long prompts) falls back to SDPA; the one-token decode graph runs the op.
    assert any(any("lean_tp.decode_attention" in op for op in ops) for ops in graphs), graphs
