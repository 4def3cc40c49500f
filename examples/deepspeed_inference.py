"""DeepSpeed inference (AutoTP) of a Hugging Face model with LeanAttention in every rank.

    torchrun --standalone --nproc_per_node=2 examples/deepspeed_inference.py --check   # tiny random Llama, CPU
    deepspeed --num_gpus 8 examples/deepspeed_inference.py --checkpoint /path/to/Llama-3-70B --dtype bfloat16

The two lines that matter:

    from lean_tp.distributed import DistContext, all_ranks_agree
from lean_tp.integrations.deepspeed import init_inference
    engine = init_inference(model, tp_size=world_size, dtype=torch.bfloat16)

With --check, rank 0 generates from the same prompts with the unsharded model (plain transformers,
SDPA) and every token must match; all ranks exit non-zero on a mismatch. On CPU each rank uses
its share of the cores (the deepspeed launcher, unlike torchrun, does not limit threads).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import types

import torch
from example_utils import (
    HF_DTYPES,
    MAX_GEN,
    TINY_HF_LLAMA,
    check_positions,
    hf_checkpoint,
    prompt_lens_flag,
    random_left_padded_batch,
)

from lean_tp import cli


def load(args) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        return AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).eval()
    torch.manual_seed(args.seed)  # every rank builds the same random weights
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY_HF_LLAMA), dtype=dtype).eval()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="deepspeed_inference.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=hf_checkpoint, help="Hugging Face model directory; default a tiny random Llama")
    p.add_argument("--batch", type=cli.integer(1, 4096), default=3)
    p.add_argument(
        "--prompt-len",
        type=cli.integer_list(1),
        default="5,17,40",
        help="one length, or a comma list of --batch lengths",
    )
    p.add_argument("--gen", type=cli.integer(1, MAX_GEN), default=16)
    p.add_argument(
        "--dtype", type=cli.choice(*HF_DTYPES), default="bfloat16" if torch.cuda.is_available() else "float32"
    )
    p.add_argument("--seed", type=cli.integer(0), default=0)
    p.add_argument("--check", action="store_true", help="compare every token with the unsharded model")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)
    args.lens = prompt_lens_flag(p, args.prompt_len, args.batch)
    if not args.checkpoint:
        check_positions(p, args.lens, args.gen, TINY_HF_LLAMA["max_position_embeddings"], "the tiny Llama")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = json.loads(open(os.path.join(args.checkpoint, "config.json")).read()) if args.checkpoint else TINY_HF_LLAMA
    try:
        from lean_tp.integrations.deepspeed import check_tp_heads

        check_tp_heads(types.SimpleNamespace(**config), world)
    except (ValueError, AttributeError) as exc:
        p.error(f"world size {world} (the launcher's --nproc_per_node or --num_gpus): {exc}")
    if args.dtype == "float16" and not torch.cuda.is_available():
        p.fail("--dtype", "bfloat16 or float32 on CPU (DeepSpeed rejects float16 there)", args.dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from lean_tp.distributed import DistContext, all_ranks_agree
    from lean_tp.integrations.deepspeed import init_inference

    lens = args.lens
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if not torch.cuda.is_available():
        # torchrun gives each CPU rank one thread; the deepspeed launcher leaves every rank on all
        # cores, and ranks that oversubscribe them run ~30x slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))

    model = load(args)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    engine = init_inference(model, tp_size=world, dtype=getattr(torch, args.dtype))
    device = next(engine.module.parameters()).device
    ids, mask = random_left_padded_batch(lens, model.config.vocab_size, args.seed, device)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=args.gen, do_sample=False, pad_token_id=model.config.pad_token_id or 0
    )
    start = time.perf_counter()
    out = engine.module.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    ok = True
    if rank == 0:
        print(
            f"deepspeed AutoTP, tp {world}, lean attention: batch {args.batch}, prompt lengths {','.join(map(str, lens))}, "
            f"{args.gen} tokens in {seconds:.2f} s ({args.batch * args.gen / seconds:.1f} tokens/s)"
        )
    if args.check:
        if rank == 0:
            expected = reference.to(device).generate(ids, **kwargs)
            ok = torch.equal(out.cpu(), expected.cpu())
            detail = f"{out[:, ids.shape[1] :].numel()} tokens identical to the unsharded model"
            if not ok:
                b, i = (int(x) for x in (out.cpu() != expected.cpu()).nonzero()[0])
                detail = f"first mismatch at sequence {b}, position {i}: {int(out[b, i])} vs {int(expected[b, i])}"
            print(f"check: {'OK' if ok else 'MISMATCH'} ({detail})")
        if dist.is_initialized():  # every rank exits with rank 0's verdict
            ctx = DistContext(rank, world, int(os.environ.get("LOCAL_RANK", "0")), device, dist.group.WORLD)
            ok = all_ranks_agree(ctx, ok)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
