"""Tensor-parallel greedy decode with LeanAttention: the project's main job.

    torchrun --standalone --nproc_per_node=2 examples/decode_tp.py --check    # CPU: tiny model, gloo
    torchrun --nproc_per_node=8 examples/decode_tp.py --model llama-3-70b --batch 16 --prompt-len 4000 --compile
    python examples/decode_tp.py --checkpoint /path/to/Meta-Llama-3-8B --prompt-len 100,3000 --batch 2 --compile
    torchrun --standalone --nproc_per_node=4 examples/decode_tp.py --cp 2 --check    # TP 2 x CP 2
    torchrun --standalone --nproc_per_node=8 examples/decode_tp.py --cp 1,2,8       # 3 layouts, one launch

Heads are sharded across the ranks; each rank runs ``lean_tp.decode_attention`` on its own heads
with a grid sized to its own GPU. With ``--cp C`` the world is TP x C: each head's sequence is
also sharded over C ranks, whose attention partials are merged exactly by lse; a list of sizes runs
each layout in turn on the same ranks, to compare them. Prompts are random token ids (seeded), so runs are repeatable.
With ``--check``, rank 0 reruns the same model and seed in one process, teacher-forced with this
run's tokens, and compares every token and the final logits.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys

import torch
from example_utils import MAX_GEN, check_positions, hf_checkpoint, make_prompts, prompt_lens_flag

from lean_tp import cli
from lean_tp.distributed import (
    DistContext,
    ParallelGroups,
    all_ranks_agree,
    apply_tp,
    check_shardable,
    describe_grid,
    disagreement,
    gather_objects,
    init_distributed,
    init_parallel_groups,
    plan_heads,
    shutdown,
    torchrun_env,
)
from lean_tp.distributed.env import DEFAULT_TIMEOUT_S
from lean_tp.generate import Generation, decode_one, generate
from lean_tp.model import CONFIGS, FP8_KV_DTYPE, ModelArgs, Transformer, build_model
from lean_tp.profiling import attention_fraction
from lean_tp.weights import init_random_weights, load_hf_checkpoint, read_hf_config

# --dtype's names, and the torch dtype each one means
DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
DTYPES = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}
# (atol, rtol) on logits for --check. fp32: TP only reorders the row-parallel sums (~1e-6).
# fp16/bf16: activations are rounded at every layer boundary, so a few ulps accumulate over layers.
CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 6e-2)}
# --kv-dtype fp8 is checked against the same model with a cache in --dtype: e4m3 keeps 3 mantissa
# bits, so each K/V value is off by up to 2^-4 relative, and the logits by more than rounding.
FP8_CHECK_TOLERANCE = (0.25, 0.1)
# The attention share is profiled over this many extra steps, only after runs of more than twice
# as many tokens: a shorter run (a --check in the tests, say) would profile little but warm-up.
PROFILE_STEPS = 8
PROGRESS_MIN_STEPS = 100


def make_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="decode_tp.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", type=cli.choice(*sorted(CONFIGS)), help="built-in config, random weights")
    p.add_argument(
        "--checkpoint",
        type=hf_checkpoint,
        help="Hugging Face directory (config.json + *.safetensors); overrides --model",
    )
    p.add_argument("--batch", type=cli.integer(1, 4096), default=4)
    p.add_argument(
        "--prompt-len",
        type=cli.integer_list(1),
        default="32,64,96,128",
        help="one length for every sequence, or a comma list of --batch lengths (ragged batch)",
    )
    p.add_argument("--gen", type=cli.integer(1, MAX_GEN), default=64, help="tokens to generate per sequence")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step (fullgraph; CUDA graphs via reduce-overhead on CUDA)",
    )
    p.add_argument("--device", type=cli.choice("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--dtype", type=cli.choice(*sorted(DTYPE_NAMES)), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument(
        "--cp",
        type=cli.integer_list(1, 1024),
        default="1",
        help="context-parallel size C: the world is TP x C, each head's sequence sharded over C ranks; "
        "a comma list runs each layout in turn",
    )
    p.add_argument("--attention", type=cli.choice("lean", "sdpa"), default="lean", help="decode attention")
    p.add_argument(
        "--kv-dtype",
        type=cli.choice("auto", "fp8"),
        default="auto",
        help="KV cache: the model's dtype, or fp8 e4m3 with per-KV-head scales (needs --dtype bf16/fp16)",
    )
    p.add_argument("--seed", type=cli.integer(0), default=0)
    p.add_argument(
        "--timeout",
        type=cli.number(0, strict_lo=True),
        default=DEFAULT_TIMEOUT_S,
        help="seconds before a stuck collective fails the job",
    )
    p.add_argument("--check", action="store_true", help="compare against the same model in one process")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Every check that needs no device runs here, before the process group is joined: a mistake
    ends every rank with one line from rank 0 (``cli.ArgumentParser``)."""
    p = make_parser()
    args = p.parse_args(argv)
    args.prompt_lens = prompt_lens_flag(p, args.prompt_len, args.batch)
    if args.kv_dtype == "fp8" and DTYPE_NAMES.get(args.dtype) not in ("bfloat16", "float16"):
        p.fail("--dtype", "bf16 or fp16 with --kv-dtype fp8 (q in 16 bits)", args.dtype)
    try:
        config = model_config(args)
    except ValueError as exc:
        p.fail("--checkpoint", f"a supported model ({exc})", args.checkpoint)
    check_positions(p, args.prompt_lens, args.gen, config.max_seq_len, args.checkpoint or args.model)
    try:
        _, world_size, _, local_world = torchrun_env()
    except ValueError as exc:  # a launcher's environment, not a flag
        p.error(str(exc))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.fail("--device", "cpu on a machine without CUDA (or no --device)", args.device)
    if any(world_size % cp for cp in args.cp):
        p.fail("--cp", f"divisors of the world size {world_size}", ",".join(map(str, args.cp)))
    if max(args.cp) > 1 and args.attention != "lean":
        p.fail("--attention", "lean with --cp > 1 (the ranks' shares merge by their lse)", args.attention)
    try:
        for cp in args.cp:
            check_shardable(config, world_size, cp)
    except ValueError as exc:
        p.error(f"argument {'--checkpoint' if args.checkpoint else '--model'}: {exc}")
    check_memory(p, args, config, world_size, local_world)
    return args


# Share of a device's memory the weights and KV caches may take: the rest is activations, the
# framework's own buffers and, on CPU, everything else the machine runs.
MEMORY_SHARE = 0.85


def rank_bytes(
    config: ModelArgs, world: int, cp: int, batch: int, capacity: int, dtype_bytes: int, kv_bytes: int
) -> int:
    """Weights and KV cache of one rank (TP = world / cp): attention projections sharded by heads
    over TP (KV heads replicated where TP exceeds them), the MLP over every rank, embedding and LM
    head replicated; each KV head's sequence split over cp ranks. The head counts must be
    shardable (``check_shardable``)."""
    heads, hd = plan_heads(config.n_heads, config.n_kv_heads, world // cp, 0), config.head_dim
    kv_heads = heads.n_kv
    attn = config.dim * hd * (2 * heads.n_q + 2 * kv_heads)
    # A token's K and V elements, per layer and sequence (MLA: one latent row, on every TP rank).
    kv_row = config.kv_lora_rank + config.qk_rope_head_dim if config.kv_lora_rank else 2 * kv_heads * hd
    if config.kv_lora_rank:  # the latent and q down-projections, replicated; heads' q, W_UK, W_UV, o_proj
        rank, q_lora = config.kv_lora_rank, config.q_lora_rank
        q_in = q_lora or config.dim
        attn = config.dim * (kv_row + q_lora) + heads.n_q * (
            q_in * hd + rank * (config.qk_nope_head_dim + config.v_head_dim) + config.v_head_dim * config.dim
        )
    mlp = 3 * config.dim * config.intermediate_size // world
    embed = config.vocab_size * config.dim * (1 if config.tie_word_embeddings else 2)
    kv = config.n_layers * batch * -(-capacity // cp) * kv_row * kv_bytes
    return (config.n_layers * (attn + mlp) + embed) * dtype_bytes + kv


def check_memory(
    p: cli.ArgumentParser, args: argparse.Namespace, config: ModelArgs, world: int, local_world: int
) -> None:
    """Refuse, before any rank builds anything, a run whose weights and KV caches exceed the
    device's memory: a GPU's per rank, or the host's for all the ranks that share it on CPU (and,
    with --check, one more unsharded copy on rank 0's device)."""
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = run_dtype(args, dev)
    kv_bytes = 1 if args.kv_dtype == "fp8" else dtype.itemsize
    batch, capacity = len(args.prompt_lens), max(args.prompt_lens) + args.gen
    sharers = local_world if dev == "cpu" else 1
    need = max(sharers * rank_bytes(config, world, cp, batch, capacity, dtype.itemsize, kv_bytes) for cp in args.cp)
    if args.check:
        need += rank_bytes(config, 1, 1, batch, capacity, dtype.itemsize, dtype.itemsize)
    have = cli.memory_bytes(dev)
    if need > MEMORY_SHARE * have:
        where = f"{sharers} rank{'s' if sharers > 1 else ''} on {dev}" + (
            " and --check's unsharded copy" if args.check else ""
        )
        p.fail(
            "--checkpoint" if args.checkpoint else "--model",
            f"weights and KV caches within {MEMORY_SHARE:.0%} of the {dev} memory ({have / 2**30:.1f} GiB)",
            f"{args.checkpoint or args.model}: {need / 2**30:.1f} GiB for {where}",
        )


def run_dtype(args: argparse.Namespace, device_type: str) -> torch.dtype:
    """--dtype, or its default: bf16 on CUDA, fp32 on CPU."""
    return DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device_type == "cuda" else torch.float32)


def model_config(args: argparse.Namespace) -> ModelArgs:
    return read_hf_config(args.checkpoint) if args.checkpoint else CONFIGS[args.model]


def build(
    args: argparse.Namespace,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    max_batch: int,
    capacity: int,
    kv_dtype: str = "auto",
    cp: int = 1,
    groups: ParallelGroups | None = None,
) -> Transformer:
    """Meta model -> shard for (rank, world = TP x cp) -> load this rank's weights -> caches."""
    model = build_model(model_config(args))
    apply_tp(model, rank, world, cp, groups)
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


def run(
    args: argparse.Namespace, ctx: DistContext, dtype: torch.dtype, prompt_lens: list[int], cp: int
) -> tuple[Generation, float | None, list]:
    capacity = max(prompt_lens) + args.gen
    groups = init_parallel_groups(ctx, cp)
    model = build(
        args, ctx.rank, ctx.world_size, ctx.device, dtype, len(prompt_lens), capacity, args.kv_dtype, cp, groups
    )
    grids = gather_objects(ctx, f"{describe_grid(model)}; KV cache {model.kv_cache_bytes() / 2**20:.2f} MiB")
    prompt = make_prompts(prompt_lens, model.args.vocab_size, args.seed, ctx.device)
    step = compiled_step(ctx.device) if args.compile else decode_one
    if args.compile:  # compile, and record CUDA graphs, before timing
        if ctx.is_main:
            print(
                "compiling the decode step (torch.compile fullgraph; ~45 s on CPU, minutes for big models) ...",
                flush=True,
            )
        generate(model, prompt, prompt_lens, min(args.gen, 4), step=step)
    result = generate(
        model, prompt, prompt_lens, args.gen, step=step, progress=ctx.is_main and args.gen >= PROGRESS_MIN_STEPS
    )
    share = attention_fraction(model, step, prompt_lens, profiled_steps(args.gen), ctx.device)
    return result, share, grids


def check(
    args: argparse.Namespace, ctx: DistContext, dtype: torch.dtype, prompt_lens: list[int], result: Generation
) -> tuple[bool, str]:
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
        return False, (
            f"first mismatch at token {i} of sequence {b}: got {int(result.tokens[b, i])}, "
            f"single process gives {int(ref.tokens[b, i])} (logit margin {float(ref.margins[b, i]):.3g} > {tie:.3g})"
        )
    diff = (result.logits - ref.logits).abs().max().item()
    if not torch.allclose(result.logits, ref.logits, atol=atol, rtol=rtol):
        return False, f"final logits differ: max |diff| {diff:.3g} exceeds atol {atol:g} + rtol {rtol:g}"
    ties, total = int(differ.sum()), result.tokens.numel()
    tokens = f"{total - ties} of {total} tokens identical"
    if ties:
        tokens += f", {ties} differ at near-ties (the single process scores the sharded run's token within {tie:.2g} of its own)"
    return True, f"{tokens}; final logits max |diff| {diff:.2g}"


def _digest(result: Generation) -> str:
    """The run's tokens and final logits, bit for bit: every rank must hold the same."""
    return hashlib.sha256(result.tokens.numpy().tobytes() + result.logits.numpy().tobytes()).hexdigest()


def profiled_steps(gen: int) -> int:
    return PROFILE_STEPS if gen > 2 * PROFILE_STEPS else 0


def report(args, ctx, dtype, prompt_lens, cp: int, result: Generation, share: float | None, grids: list) -> None:
    source = args.checkpoint or args.model
    layout = f" (tp {ctx.world_size // cp} x cp {cp})" if cp > 1 else ""
    print(
        f"lean_tp decode: {source}, world {ctx.world_size}{layout}, {ctx.device.type}, {str(dtype).removeprefix('torch.')}, "
        f"attention {args.attention}, kv cache {args.kv_dtype}, compile {'on' if args.compile else 'off'}"
    )
    for rank, grid in enumerate(grids):
        print(f"  rank {rank}: {grid}")
    print(
        f"prefill: {result.prefill_s * 1e3:.2f} ms (batch {len(prompt_lens)}, prompt lengths {','.join(map(str, prompt_lens))})"
    )
    if result.step_s:
        median = statistics.median(result.step_s)
        print(
            f"decode: {len(result.step_s)} steps, median {median * 1e3:.3f} ms/step, "
            f"{len(prompt_lens) / median:.1f} tokens/s"
        )
    if not profiled_steps(args.gen):
        print(f"attention: not profiled (runs of more than {2 * PROFILE_STEPS} tokens profile {PROFILE_STEPS} steps)")
    else:
        print(
            f"attention: {'not measurable' if share is None else f'{share:.0%} of decode time (profiled over {PROFILE_STEPS} steps)'}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompt_lens = args.prompt_lens
    ctx = init_distributed(args.device, timeout_s=args.timeout)
    try:
        flags = {"--" + name.replace("_", "-"): value for name, value in vars(args).items() if name != "prompt_lens"}
        mismatch = disagreement(ctx, flags)
        if mismatch:  # ranks started by hand with different flags: every rank stops, rank 0 says why
            if ctx.is_main:
                print(f"decode_tp.py: error: {mismatch}", file=sys.stderr, flush=True)
            return 2
        dtype = run_dtype(args, ctx.device.type)
        all_ok = True
        for cp in args.cp:
            torch.manual_seed(args.seed)
            result, share, grids = run(args, ctx, dtype, prompt_lens, cp)
            if ctx.is_main:
                report(args, ctx, dtype, prompt_lens, cp, result, share, grids)
            if args.check:
                ok, message = check(args, ctx, dtype, prompt_lens, result) if ctx.is_main else (True, "")
                same = len(set(gather_objects(ctx, _digest(result)))) == 1
                ok, message = (
                    ok and same,
                    f"{message}; every rank's tokens and logits {'bitwise identical' if same else 'DIFFER'}",
                )
                ok = all_ranks_agree(ctx, ok)
                all_ok &= ok
                if ctx.is_main:
                    print(f"check: {'OK' if ok else 'MISMATCH'} ({message})")
        return 0 if all_ok else 1
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
