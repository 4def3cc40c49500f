"""Tensor-parallel greedy decode with LeanAttention: the project's main job.

    torchrun --standalone --nproc_per_node=2 examples/decode_tp.py --check    # CPU: tiny model, gloo
    torchrun --nproc_per_node=8 examples/decode_tp.py --model llama-3-70b --batch 16 --prompt-len 4000 --compile
    python examples/decode_tp.py --checkpoint /path/to/Meta-Llama-3-8B --prompt-len 100,3000 --batch 2 --compile

Heads are sharded across the ranks; each rank runs ``lean_tp.decode_attention`` on its own heads
with a grid sized to its own GPU. Prompts are random token ids (seeded), so runs are repeatable.
With ``--check``, rank 0 reruns the same model and seed in one process, teacher-forced with this
run's tokens, and compares every token and the final logits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from example_utils import parse_prompt_lens

# --dtype's names, and the torch dtype each one means
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
               "float32": "float32"}


def make_parser(model_names: list[str] | None = None, timeout_default: float | None = None) -> argparse.ArgumentParser:
    """The CLI. Without ``model_names`` it needs no torch: the early check before the imports uses it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=model_names is not None)
    p.add_argument("--model", default="tiny", choices=model_names, help="built-in config, random weights")
    p.add_argument("--checkpoint", help="Hugging Face directory (config.json + *.safetensors); overrides --model")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", default="32,64,96,128",
                   help="one length for every sequence, or a comma list of --batch lengths (ragged batch)")
    p.add_argument("--gen", type=int, default=64, help="tokens to generate per sequence")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (fullgraph; CUDA graphs via reduce-overhead on CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention", choices=("lean", "sdpa"), default="lean", help="decode attention")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                   help="KV cache: the model's dtype, or fp8 e4m3 with per-KV-head scales (needs --dtype bf16/fp16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=timeout_default, help="seconds before a stuck collective fails the job")
    p.add_argument("--check", action="store_true", help="compare against the same model in one process")
    return p


def fail(p: argparse.ArgumentParser, message: str):
    """One argparse-style line from rank 0 and exit status 2 on every rank, never a traceback per rank."""
    if os.environ.get("RANK", "0") != "0":
        # torchrun stops every rank once one exits: give rank 0 the moment it needs to print first.
        import time

        time.sleep(1.0)
        sys.exit(2)
    p.error(message)


def check_values(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks that read only the flags; sets ``args.prompt_lens``."""
    try:
        args.prompt_lens = parse_prompt_lens(args.prompt_len, args.batch)
        if args.gen < 1:
            raise ValueError(f"--gen: expected >= 1 tokens to generate, got {args.gen}")
        if args.timeout is not None and not args.timeout > 0:
            raise ValueError(f"--timeout: expected seconds > 0, got {args.timeout}")
        if args.kv_dtype == "fp8" and DTYPE_NAMES.get(args.dtype) not in ("bfloat16", "float16"):
            raise ValueError(f"--dtype: expected bf16 or fp16 with --kv-dtype fp8 (q in 16 bits), got {args.dtype}")
    except ValueError as exc:
        fail(p, str(exc))


if __name__ == "__main__":  # before torch is imported: a bad value fails in a fraction of a second
    _early = make_parser()
    check_values(_early, _early.parse_known_args()[0])

import torch  # noqa: E402

from lean_tp.distributed import (  # noqa: E402
    DistContext,
    all_ranks_agree,
    apply_tp,
    check_shardable,
    describe_grid,
    gather_objects,
    init_distributed,
    shutdown,
    torchrun_env,
)
from lean_tp.distributed.env import DEFAULT_TIMEOUT_S  # noqa: E402
from lean_tp.generate import Generation, decode_one, generate  # noqa: E402
from lean_tp.model import CONFIGS, FP8_KV_DTYPE, ModelArgs, Transformer, build_model  # noqa: E402
from lean_tp.profiling import attention_fraction  # noqa: E402
from lean_tp.weights import init_random_weights, load_hf_checkpoint, read_hf_config  # noqa: E402
from example_utils import make_prompts  # noqa: E402

DTYPES = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}
# (atol, rtol) on logits for --check. fp32: TP only reorders the row-parallel sums (~1e-6).
# fp16/bf16: activations are rounded at every layer boundary, so a few ulps accumulate over layers.
CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 6e-2)}
# --kv-dtype fp8 is checked against the same model with a cache in --dtype: e4m3 keeps 3 mantissa
# bits, so each K/V value is off by up to 2^-4 relative, and the logits by more than rounding.
FP8_CHECK_TOLERANCE = (0.25, 0.1)
PROFILE_STEPS = 8
PROGRESS_MIN_STEPS = 100


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Every check that needs no device runs here, before the process group is joined."""
    p = make_parser(sorted(CONFIGS), DEFAULT_TIMEOUT_S)
    args = p.parse_args(argv)
    check_values(p, args)
    try:
        check_shardable(model_config(args), torchrun_env()[1])
    except ValueError as exc:
        fail(p, str(exc))
    return args


def model_config(args: argparse.Namespace) -> ModelArgs:
    return read_hf_config(args.checkpoint) if args.checkpoint else CONFIGS[args.model]


def build(args: argparse.Namespace, rank: int, world: int, device: torch.device, dtype: torch.dtype,
          max_batch: int, capacity: int, kv_dtype: str = "auto") -> Transformer:
    """Meta model -> shard for (rank, world) -> load this rank's weights -> caches."""
    model = build_model(model_config(args))
    apply_tp(model, rank, world)
    if args.checkpoint:
        load_hf_checkpoint(model, args.checkpoint, device, dtype)
    else:
        init_random_weights(model, args.seed, device, dtype)
    model.setup_caches(max_batch, capacity, FP8_KV_DTYPE if kv_dtype == "fp8" else None)
    model.set_attention(args.attention)
    return model.eval()


def compiled_step(device: torch.device):
    mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs only on CUDA
    return torch.compile(decode_one, mode=mode, fullgraph=True)


def run(args: argparse.Namespace, ctx: DistContext, dtype: torch.dtype, prompt_lens: list[int]) -> tuple[Generation, float | None, list]:
    capacity = max(prompt_lens) + args.gen
    model = build(args, ctx.rank, ctx.world_size, ctx.device, dtype, len(prompt_lens), capacity, args.kv_dtype)
    grids = gather_objects(ctx, describe_grid(model))
    prompt = make_prompts(prompt_lens, model.args.vocab_size, args.seed, ctx.device)
    step = compiled_step(ctx.device) if args.compile else decode_one
    if args.compile:  # compile, and record CUDA graphs, before timing
        if ctx.is_main:
            print("compiling the decode step (torch.compile fullgraph; ~45 s on CPU, minutes for big models) ...", flush=True)
        generate(model, prompt, prompt_lens, min(args.gen, 4), step=step)
    result = generate(model, prompt, prompt_lens, args.gen, step=step,
                      progress=ctx.is_main and args.gen >= PROGRESS_MIN_STEPS)
    share = attention_fraction(model, step, prompt_lens, min(PROFILE_STEPS, args.gen - 1), ctx.device)
    return result, share, grids


def check(args: argparse.Namespace, ctx: DistContext, dtype: torch.dtype, prompt_lens: list[int], result: Generation) -> tuple[bool, str]:
    """Rerun in this process, unsharded and eager, teacher-forced with ``result``'s tokens (with a
    cache in ``dtype``: an fp8 run is checked against the 16-bit cache, within FP8_CHECK_TOLERANCE)."""
    model = build(args, 0, 1, ctx.device, dtype, len(prompt_lens), max(prompt_lens) + args.gen)
    prompt = make_prompts(prompt_lens, model.args.vocab_size, args.seed, ctx.device)
    ref = generate(model, prompt, prompt_lens, args.gen, forced=result.tokens)
    atol, rtol = FP8_CHECK_TOLERANCE if args.kv_dtype == "fp8" else CHECK_TOLERANCE[dtype]
    tie = 2 * (atol + rtol * ref.logits.abs().max().item())
    differ = ref.tokens != result.tokens
    real = differ & (ref.margins > tie)
    if real.any():
        b, i = (int(x) for x in real.nonzero()[0])
        return False, (f"first mismatch at token {i} of sequence {b}: got {int(result.tokens[b, i])}, "
                       f"single process gives {int(ref.tokens[b, i])} (logit margin {float(ref.margins[b, i]):.3g} > {tie:.3g})")
    diff = (result.logits - ref.logits).abs().max().item()
    if not torch.allclose(result.logits, ref.logits, atol=atol, rtol=rtol):
        return False, f"final logits differ: max |diff| {diff:.3g} exceeds atol {atol:g} + rtol {rtol:g}"
    ties = int(differ.sum())
    note = f", {ties} near-tie token(s) within {tie:.2g}" if ties else ""
    return True, f"{result.tokens.numel()} tokens identical{note}; final logits max |diff| {diff:.2g}"


def report(args, ctx, dtype, prompt_lens, result: Generation, share: float | None, grids: list) -> None:
    source = args.checkpoint or args.model
    print(f"lean_tp decode: {source}, world {ctx.world_size}, {ctx.device.type}, {str(dtype).removeprefix('torch.')}, "
          f"attention {args.attention}, kv cache {args.kv_dtype}, compile {'on' if args.compile else 'off'}")
    for rank, grid in enumerate(grids):
        print(f"  rank {rank}: {grid}")
    print(f"prefill: {result.prefill_s * 1e3:.2f} ms (batch {len(prompt_lens)}, prompt lengths {','.join(map(str, prompt_lens))})")
    if result.step_s:
        median = statistics.median(result.step_s)
        print(f"decode: {len(result.step_s)} steps, median {median * 1e3:.3f} ms/step, "
              f"{len(prompt_lens) / median:.1f} tokens/s")
    print(f"attention: {'not measurable' if share is None else f'{share:.0%} of decode time (profiled over {min(PROFILE_STEPS, args.gen - 1)} steps)'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompt_lens = args.prompt_lens
    ctx = init_distributed(args.device, timeout_s=args.timeout)
    try:
        dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
        torch.manual_seed(args.seed)
        result, share, grids = run(args, ctx, dtype, prompt_lens)
        if ctx.is_main:
            report(args, ctx, dtype, prompt_lens, result, share, grids)
        ok = True
        if args.check:
            ok, message = check(args, ctx, dtype, prompt_lens, result) if ctx.is_main else (True, "")
            ok = all_ranks_agree(ctx, ok)
            if ctx.is_main:
                print(f"check: {'OK' if ok else 'MISMATCH'} ({message})")
        return 0 if ok else 1
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
