"""attn_implementation="lean" on the model families that need the op's serving features: Gemma 2
(softcap + sliding window), Gemma 3 (sliding window), Mistral and Qwen2 with a window that bites,
gpt-oss (sinks + sliding window), Phi-3 (head_dim 96), and assisted generation (several query
tokens per step). Greedy tokens equal those of the reference implementation ("eager" where SDPA
lacks softcap or sinks), with and without left padding, and a spy proves the op ran.
"""

import copy

import pytest
import torch
import transformers
from test_integrations_transformers import batch_of

import lean_tp.integrations.transformers as lean_hf

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
)
WINDOW = 5  # shorter than the prompts, so every decode step's window cuts keys off


def _configs():
    t = transformers
    return {
        # family: (config, reference implementation)
        "gemma2": (
            t.Gemma2Config(
                **TINY,
                head_dim=32,
                sliding_window=WINDOW,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=None,
                query_pre_attn_scalar=24,
            ),
            "eager",
        ),
        "gemma3": (
            t.Gemma3TextConfig(
                **TINY,
                head_dim=32,
                sliding_window=WINDOW,
                query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"],
            ),
            "sdpa",
        ),
        "mistral": (t.MistralConfig(**TINY, sliding_window=WINDOW), "sdpa"),
        "qwen2": (
            t.Qwen2Config(
                **TINY,
                use_sliding_window=True,
                sliding_window=WINDOW,
                max_window_layers=0,
                layer_types=["sliding_attention", "sliding_attention"],
            ),
            "sdpa",
        ),
        "gpt_oss": (
            t.GptOssConfig(
                **{**TINY, "num_attention_heads": 4},
                head_dim=16,
                sliding_window=WINDOW,
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"],
            ),
            "eager",
        ),
        "phi3": (
            t.Phi3Config(**{**TINY, "hidden_size": 192, "num_attention_heads": 2, "num_key_value_heads": 1}),
            "sdpa",
        ),  # head_dim 96
    }


@pytest.fixture
def lean_calls(monkeypatch):
    calls = []
    real = lean_hf.decode_attention

    def spy(*args, **kwargs):
        calls.append((args[0].shape, kwargs.get("window"), kwargs.get("softcap"), kwargs.get("sinks") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(lean_hf, "decode_attention", spy)
    return calls


def _pair(family: str):
    config, reference = _configs()[family]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    lean = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=lean_hf.register())
    with torch.no_grad():  # random sinks: zero-initialized ones would make gpt-oss's sinks a no-op
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1)
    lean.load_state_dict(ref.state_dict())
    return ref.eval(), lean.eval()


@pytest.mark.parametrize("case", ["batch1", "left-padded"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "qwen2", "gpt_oss", "phi3"])
def test_generate_matches_reference(family, case, lean_calls):
    ref, lean = _pair(family)
    ids, mask = batch_of(case)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(lean.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    decode = [c for c in lean_calls if c[0][1] == 1]
    assert len(decode) == 7 * TINY["num_hidden_layers"], lean_calls  # every decode step, every layer
    if family == "gemma2":
        assert all(c[2] == 2.0 for c in decode)
    if family == "gpt_oss":
        assert all(c[3] for c in decode)


@pytest.mark.parametrize("case", ["batch1", "left-padded"])
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_assisted_generation_verifies_several_tokens_on_the_op(family, case, lean_calls):
    """The assistant proposes 4 tokens; the target checks them in one step of 5 query tokens, on
    the op, with each query row's own window. Greedy assisted decoding equals plain greedy."""
    ref, lean = _pair(family)
    _, assistant = _pair(family)
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    ids, mask = batch_of(case)
    ids, mask = ids[:1], mask[:1]  # transformers' assisted generation takes one sequence (row 0: 5 pads)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, **kwargs)
    lean_calls.clear()
    assert torch.equal(lean.generate(ids, assistant_model=assistant, **kwargs), expected)
    multi = [c for c in lean_calls if 1 < c[0][1] <= 5]
    assert multi, lean_calls
    assert any(c[1] == WINDOW for c in multi)  # the sliding layers passed their window
