"""A Hugging Face model with LeanAttention, compiled with torch.compile and a static cache.

    python examples/compile_hf.py --check                          # tiny random Llama on CPU
    python examples/compile_hf.py --checkpoint /path/to/Llama-3-8B --batch 8 --prompt-len 100,2000 --gen 128
    python examples/compile_hf.py --config llama-3-8b --batch 8 --prompt-len 4000 --gen 128 [--attention sdpa]

The two lines that matter:

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=lean_tp.integrations.transformers.register())
    model.forward = torch.compile(model.forward, fullgraph=True)   # mode="reduce-overhead" on CUDA

The prompts are a left-padded batch of random token ids. With --check, an eager SDPA copy of the
model generates from the same prompts, and every token must match.
"""

from __future__ import annotations

import sys
import time

import torch
from example_utils import (
    HF_DTYPES,
    MAX_GEN,
    TINY_HF_LLAMA,
    TokenProgress,
    check_positions,
    hf_checkpoint,
    prompt_lens_flag,
    random_left_padded_batch,
)

from lean_tp import cli
from lean_tp.model import CONFIGS


def hf_config(name: str):
    """A ``LlamaConfig`` of one of lean_tp's built-in shapes ("tiny" here is smaller still)."""
    from transformers import LlamaConfig

    if name == "tiny":
        return LlamaConfig(**TINY_HF_LLAMA)
    a = CONFIGS[name]
    return LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        intermediate_size=a.intermediate_size,
        head_dim=a.head_dim,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_seq_len,
        pad_token_id=0,
    )


def load(args, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        model = AutoModelForCausalLM.from_pretrained(
            args.checkpoint, attn_implementation=attn_implementation, dtype=dtype
        )
    else:
        torch.manual_seed(args.seed)  # the same random weights for the lean and the SDPA copy
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(
                hf_config(args.config), attn_implementation=attn_implementation, dtype=dtype
            )
    return model.to(args.device).eval()


def parse_args(argv: list[str] | None):
    p = cli.ArgumentParser(prog="compile_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=hf_checkpoint, help="Hugging Face model directory (real weights)")
    p.add_argument(
        "--config",
        default="tiny",
        type=cli.choice(*sorted(CONFIGS)),
        help="random weights of this shape when no --checkpoint (e.g. llama-3-8b for speed runs)",
    )
    p.add_argument(
        "--attention", default="lean", type=cli.choice("lean", "sdpa"), help="sdpa: the same run without lean"
    )
    p.add_argument("--batch", type=cli.integer(1, 4096), default=4)
    p.add_argument(
        "--prompt-len",
        type=cli.integer_list(1),
        default="9,33,64,100",
        help="one length, or a comma list of --batch lengths",
    )
    p.add_argument("--gen", type=cli.integer(1, MAX_GEN), default=32)
    p.add_argument("--device", type=cli.device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", type=cli.choice(*HF_DTYPES), default="bfloat16" if torch.cuda.is_available() else "float32"
    )
    p.add_argument("--seed", type=cli.integer(0), default=0)
    p.add_argument("--check", action="store_true", help="compare every token with an eager SDPA copy")
    args = p.parse_args(argv)
    args.lens = prompt_lens_flag(p, args.prompt_len, args.batch)
    max_len = TINY_HF_LLAMA["max_position_embeddings"] if args.config == "tiny" else CONFIGS[args.config].max_seq_len
    if not args.checkpoint:
        check_positions(p, args.lens, args.gen, max_len, args.config)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import lean_tp.integrations.transformers as lean_hf

    lens = args.lens
    print(
        "building the model, compiling it and generating (first call: torch.compile, ~30-60 s on CPU) ...", flush=True
    )
    model = load(args, lean_hf.register() if args.attention == "lean" else "sdpa")
    mode = "reduce-overhead" if args.device.startswith("cuda") else None  # CUDA graphs on CUDA
    model.forward = torch.compile(model.forward, mode=mode, fullgraph=True)
    ids, mask = random_left_padded_batch(lens, model.config.vocab_size, args.seed, args.device)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=args.gen,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=model.config.pad_token_id or 0,
    )
    torch._dynamo.utils.counters.clear()
    model.generate(
        ids, **kwargs, streamer=TokenProgress(args.gen, "compile run")
    )  # compile (and record CUDA graphs) before timing
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    print(
        f"{args.attention} attention, compiled with fullgraph=True: {breaks} graph breaks; batch {args.batch}, prompt lengths "
        f"{','.join(map(str, lens))}; {args.gen} tokens in {seconds:.2f} s ({args.batch * args.gen / seconds:.1f} tokens/s, with prefill)"
    )
    if not args.check:
        return 0
    print("check: generating the same tokens with an eager SDPA copy ...", flush=True)
    expected = load(args, "sdpa").generate(ids, **kwargs, streamer=TokenProgress(args.gen, "eager SDPA"))
    if torch.equal(out, expected):
        print(f"check: OK ({out[:, ids.shape[1] :].numel()} tokens identical to eager SDPA)")
        return 0
    b, i = (int(x) for x in (out != expected).nonzero()[0])
    print(f"check: MISMATCH at sequence {b}, position {i}: lean {int(out[b, i])}, sdpa {int(expected[b, i])}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
