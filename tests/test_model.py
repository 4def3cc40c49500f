"""The Llama-family model: parity with transformers, KV cache and ragged decode, attention impls,
weight loading and its errors, and torch.compile of the decode step."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from example_utils import make_prompts
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM

from lean_tp.generate import decode_one, generate
from lean_tp.model import CONFIGS, ModelArgs, build_model, rope_inv_freq
from lean_tp.weights import init_random_weights, load_hf_checkpoint, read_hf_config

SMALL = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
HF_MODELS = {
    "llama3-rope": (LlamaForCausalLM, LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE)),
    "llama-tied": (LlamaForCausalLM, LlamaConfig(**SMALL, tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, MistralConfig(**SMALL)),
    "phi3-fused": (Phi3ForCausalLM, Phi3Config(**SMALL, pad_token_id=0, eos_token_id=1)),
}
# A small Llama with head_dim 64 so that the Triton kernel (D in {64, 128, 256}) can run it.
SMALL_ARGS = replace(CONFIGS["tiny"], vocab_size=128, dim=256, n_heads=4, n_kv_heads=2, intermediate_size=256)


pytestmark = pytest.mark.xdist_group("hf_checkpoints")  # one worker: each checkpoint is written once


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def hf_checkpoint(request, tmp_path_factory):
    cls, config = HF_MODELS[request.param]
    torch.manual_seed(0)
    hf = cls(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def test_logits_match_transformers(hf_checkpoint):
    """Prefill of a ragged batch, then decode steps, against transformers' full forward."""
    hf, path = hf_checkpoint
    model = build_model(read_hf_config(path))
    load_hf_checkpoint(model, path, "cpu", torch.float32)
    model.setup_caches(2, 64)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    lens = [9, 14]  # sequence 0 decodes from position 9, sequence 1 from 14
    with torch.no_grad():
        refs = [hf(tokens[b : b + 1]).logits[0] for b in range(2)]
        logits = model.prefill(tokens[:, :14], torch.tensor(lens))
        for b in range(2):
            torch.testing.assert_close(logits[b], refs[b][lens[b] - 1], atol=2e-5, rtol=1e-5)
        for step in range(8):
            pos = torch.tensor(lens, dtype=torch.int32) + step
            logits = model.decode_step(tokens[torch.arange(2), pos.long()], pos)
            for b in range(2):
                torch.testing.assert_close(logits[b], refs[b][pos[b]], atol=2e-5, rtol=1e-5)


def _random_model(args: ModelArgs, batch: int, capacity: int, seed: int = 0):
    model = build_model(args)
    init_random_weights(model, seed, "cpu", torch.float32, std=0.1)  # larger std: peaked attention
    model.setup_caches(batch, capacity)
    return model


def test_ragged_decode_equals_full_prefill():
    """Each sequence's generated tokens and last logits equal a prefill of that sequence alone."""
    lens, gen = [1, 7, 30], 6
    model = _random_model(SMALL_ARGS, len(lens), 64)
    prompt = make_prompts(lens, SMALL_ARGS.vocab_size, 3, torch.device("cpu"))
    out = generate(model, prompt, lens, gen)
    for b, n in enumerate(lens):
        seq = torch.cat([prompt[b, :n], out.tokens[b, :-1]])[None]
        with torch.no_grad():
            logits = model.prefill(seq, torch.tensor([seq.shape[1]]))
        torch.testing.assert_close(logits[0], out.logits[b], atol=1e-5, rtol=1e-5)
        assert int(logits[0].argmax()) == int(out.tokens[b, -1])


@pytest.mark.parametrize("impl,backend", [("lean", "triton"), ("sdpa", "auto")], ids=["lean-triton", "sdpa"])
def test_decode_attention_impls_agree(impl, backend):
    """The Triton kernel (interpreter on CPU) and SDPA give the torch backend's decode logits."""
    lens = [5, 64, 65]  # around one 64-token block
    model = _random_model(SMALL_ARGS, len(lens), 80)
    prompt = make_prompts(lens, SMALL_ARGS.vocab_size, 4, torch.device("cpu"))
    ref = generate(model, prompt, lens, 4)
    model.set_attention(impl, backend)
    out = generate(model, prompt, lens, 4)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl,backend", [("lean", "auto"), ("lean", "triton"), ("sdpa", "auto")])
def test_fp8_kv_cache_tracks_the_16bit_cache(impl, backend):
    """An e4m3 cache with per-KV-head scales (--kv-dtype fp8): each implementation reads the same
    fp8 values, and the logits stay within examples/decode_tp.py's FP8_CHECK_TOLERANCE of a
    16-bit cache's (fp16 here: the interpreter's bf16 arithmetic is wrong)."""
    from lean_tp.model import FP8_KV_DTYPE

    lens = [5, 64, 65]
    model = build_model(SMALL_ARGS)
    init_random_weights(model, 0, "cpu", torch.float16)  # the example's initialization
    prompt = make_prompts(lens, SMALL_ARGS.vocab_size, 4, torch.device("cpu"))
    model.setup_caches(len(lens), 80)
    ref = generate(model, prompt, lens, 4)
    model.setup_caches(len(lens), 80, FP8_KV_DTYPE)
    model.set_attention(impl, backend)
    out = generate(model, prompt, lens, 4, forced=ref.tokens)
    cache = model.attention_modules()[0].kv_cache
    assert cache.k.dtype == FP8_KV_DTYPE and cache.k_scale.shape == (SMALL_ARGS.n_kv_heads,)
    assert (cache.k_scale != 1).all()  # set from the prompt at prefill
    torch.testing.assert_close(out.logits.float(), ref.logits.float(), atol=0.25, rtol=0.1)
    assert (out.logits.float() - ref.logits.float()).abs().max() > 0  # the cache really is fp8


def test_compiled_decode_step_matches_eager_without_recompiles():
    """fullgraph=True: no graph break anywhere in the step; changing lengths must not recompile."""
    lens = [3, 20]
    model = _random_model(SMALL_ARGS, 2, 40)
    prompt = make_prompts(lens, SMALL_ARGS.vocab_size, 5, torch.device("cpu"))
    ref = generate(model, prompt, lens, 5)
    torch._dynamo.reset()
    step = torch.compile(decode_one, fullgraph=True)
    generate(model, prompt, lens, 2, step=step)  # compile once
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = generate(model, prompt, lens, 5, step=step)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)


def test_graph_holds_the_lean_op():
    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm.code)
        return gm.forward

    model = _random_model(SMALL_ARGS, 2, 16)
    torch._dynamo.reset()
    step = torch.compile(decode_one, backend=capture, fullgraph=True)
    with torch.inference_mode():
        step(model, torch.zeros(2, dtype=torch.long), torch.tensor([1, 4], dtype=torch.int32))
    assert len(graphs) == 1 and graphs[0].count("lean_tp.decode_attention") == SMALL_ARGS.n_layers


def test_llama3_rope_scaling_keeps_high_and_scales_low_frequencies():
    args = CONFIGS["llama-3.1-8b"]
    base = rope_inv_freq(replace(args, rope_scaling=None))
    scaled = rope_inv_freq(args)
    assert torch.equal(scaled[:8], base[:8])  # short wavelengths untouched
    torch.testing.assert_close(scaled[-4:], base[-4:] / 8)  # long ones divided by the factor


def _write_config(path, **changes):
    cfg = LlamaConfig(**SMALL).to_dict() | changes
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_read_hf_config_old_style_rope_and_sliding_window(tmp_path):
    old = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    args = read_hf_config(
        _write_config(tmp_path, rope_parameters=None, rope_theta=5e5, rope_scaling=old, sliding_window=128)
    )
    assert args.rope_theta == 5e5 and args.rope_scaling.factor == 8.0
    assert args.max_seq_len == 128  # within the window, windowed attention is full attention


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"attention_bias": True}, "biases"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary",
        ),
    ],
)
def test_read_hf_config_rejects_unsupported(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        read_hf_config(_write_config(tmp_path, **changes))


def test_load_hf_checkpoint_errors(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint
    args = read_hf_config(path)
    with pytest.raises(ValueError, match="expected tensor"):
        load_hf_checkpoint(build_model(replace(args, n_layers=3)), path, "cpu", torch.float32)
    with pytest.raises(ValueError, match="of shape"):
        load_hf_checkpoint(build_model(replace(args, intermediate_size=128)), path, "cpu", torch.float32)
    _write_config(tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        load_hf_checkpoint(build_model(args), tmp_path, "cpu", torch.float32)


def test_bad_model_args_and_lengths():
    with pytest.raises(ValueError, match="n_heads: expected a multiple of n_kv_heads"):
        replace(SMALL_ARGS, n_kv_heads=3)
    with pytest.raises(ValueError, match="model: expected one of"):
        build_model("llama-9")
    model = _random_model(SMALL_ARGS, 2, 16)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.setup_caches(2, SMALL_ARGS.max_seq_len + 1)
    with pytest.raises(ValueError, match="impl"):
        model.set_attention("flash")
    prompt = make_prompts([4, 4], SMALL_ARGS.vocab_size, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="cache capacity 16, got 17"):
        generate(model, prompt, [4, 10], 8)
    with pytest.raises(ValueError, match="prompt_lens"):
        generate(model, prompt, [0, 4], 2)


def test_sdpa_decode_mask_ignores_stale_cache():
    """Stale K/V beyond each length (from a longer earlier request) must not leak into SDPA decode."""
    model = _random_model(SMALL_ARGS, 1, 32)
    model.set_attention("sdpa")
    attn = model.attention_modules()[0]
    q = torch.randn(1, 4, 64)
    attn.kv_cache.k.normal_()
    attn.kv_cache.v.normal_()
    got = attn.decode(q, torch.tensor([5], dtype=torch.int32))
    k, v = attn.kv_cache.k[:, :, :5], attn.kv_cache.v[:, :, :5]
    ref = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(got, ref)
