"""DeepSeek-V2's multi-head latent attention in ``lean_tp.model`` (tiny-mla): absorbed decode
against the expanded prefill, the kernel (interpreter) and SDPA against the torch backend, an fp8
latent cache, and the config's checks. TP and CP runs: tests/test_decode_tp.py (world4-mla)."""

from dataclasses import replace

import pytest
import torch
from example_utils import make_prompts

from lean_tp.generate import generate
from lean_tp.model import CONFIGS, FP8_KV_DTYPE, LatentCache, ModelArgs, build_model
from lean_tp.weights import init_random_weights

ARGS = replace(CONFIGS["tiny-mla"], vocab_size=128)
LENS = [1, 30, 65]  # around the kernel's 64-key tile


def _model(dtype: torch.dtype, args: ModelArgs = ARGS, capacity: int = 80):
    model = build_model(args)
    init_random_weights(model, 0, "cpu", dtype)
    model.setup_caches(len(LENS), capacity)
    return model


def test_absorbed_decode_equals_the_expanded_prefill():
    """Each generated token's logits equal a prefill of the sequence so far, which expands the
    latent rows into per-head K and V (``kv_b_proj``); decode multiplies q into the latent space
    instead. The cache holds one latent row of 576 per token, V a view of its first 512."""
    model = _model(torch.float32)
    prompt = make_prompts(LENS, ARGS.vocab_size, 3, torch.device("cpu"))
    out = generate(model, prompt, LENS, 4)
    cache = model.attention_modules()[0].kv_cache
    assert isinstance(cache, LatentCache) and cache.k.shape == (len(LENS), 1, 80, 576)
    assert cache.v.shape[-1] == 512 and cache.v.data_ptr() == cache.k.data_ptr()
    for b, n in enumerate(LENS):
        seq = torch.cat([prompt[b, :n], out.tokens[b, :-1]])[None]
        with torch.no_grad():
            logits = model.prefill(seq, torch.tensor([seq.shape[1]]))
        torch.testing.assert_close(logits[0], out.logits[b], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl,backend", [("lean", "triton"), ("sdpa", "auto")], ids=["lean-triton", "sdpa"])
def test_mla_decode_impls_agree(impl, backend):
    """The Triton kernel (interpreter; V read from K's tile) and SDPA give the torch backend's
    logits, fp16 (the kernel's MLA entries take a 16-bit q)."""
    model = _model(torch.float16)
    prompt = make_prompts(LENS, ARGS.vocab_size, 4, torch.device("cpu"))
    ref = generate(model, prompt, LENS, 3)
    model.set_attention(impl, backend)
    out = generate(model, prompt, LENS, 3, forced=ref.tokens)
    torch.testing.assert_close(out.logits.float(), ref.logits.float(), atol=2e-2, rtol=1e-2)


def test_fp8_latent_cache_tracks_the_16bit_cache():
    """An e4m3 latent cache with one scale (k_scale, which v_scale is), set from the prompt."""
    model = _model(torch.float16)
    prompt = make_prompts(LENS, ARGS.vocab_size, 5, torch.device("cpu"))
    ref = generate(model, prompt, LENS, 3)
    model.setup_caches(len(LENS), 80, FP8_KV_DTYPE)
    out = generate(model, prompt, LENS, 3, forced=ref.tokens)
    cache = model.attention_modules()[0].kv_cache
    assert cache.k.dtype == FP8_KV_DTYPE and cache.k_scale.shape == (1,) and cache.v_scale is cache.k_scale
    assert (cache.k_scale != 1).all()
    torch.testing.assert_close(out.logits.float(), ref.logits.float(), atol=0.25, rtol=0.1)
    assert (out.logits.float() - ref.logits.float()).abs().max() > 0


def test_mla_model_args_and_q_projection():
    """MLA's head_dim is q's and K's per-head width; its rotary dims are the decoupled ones; a model
    without a q LoRA projects q directly."""
    assert ARGS.head_dim == 96 and ARGS.rope_dim == 64
    with pytest.raises(ValueError, match="v_head_dim: expected a positive integer with kv_lora_rank"):
        replace(ARGS, v_head_dim=0)
    with pytest.raises(ValueError, match="head_dim: expected an even number of rotary dims, got 7"):
        replace(ARGS, qk_rope_head_dim=7)
    plain = _model(torch.float32, replace(ARGS, q_lora_rank=0))
    attn = plain.attention_modules()[0]
    assert hasattr(attn, "q_proj") and not hasattr(attn, "q_a_proj")
    prompt = make_prompts(LENS, ARGS.vocab_size, 6, torch.device("cpu"))
    assert generate(plain, prompt, LENS, 2).tokens.shape == (len(LENS), 2)
