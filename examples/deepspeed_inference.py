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
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from lean_tp.distributed import DistContext, all_ranks_agree
from lean_tp.integrations.deepspeed import init_inference
from example_utils import TINY_HF_LLAMA, parse_prompt_lens, random_left_padded_batch



def load(args) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        return AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).eval()
    torch.manual_seed(args.seed)  # every rank builds the same random weights
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY_HF_LLAMA), dtype=dtype).eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="Hugging Face model directory; default a tiny random Llama")
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--prompt-len", default="5,17,40", help="one length, or a comma list of --batch lengths")
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare every token with the unsharded model")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)
    lens = parse_prompt_lens(args.prompt_len, args.batch)
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
    kwargs = dict(attention_mask=mask, max_new_tokens=args.gen, do_sample=False, pad_token_id=model.config.pad_token_id or 0)
    start = time.perf_counter()
    out = engine.module.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    ok = True
    if rank == 0:
        print(f"deepspeed AutoTP, tp {world}, lean attention: batch {args.batch}, prompt lengths {args.prompt_len}, "
              f"{args.gen} tokens in {seconds:.2f} s ({args.batch * args.gen / seconds:.1f} tokens/s)")
    if args.check:
        if rank == 0:
            expected = reference.to(device).generate(ids, **kwargs)
            ok = torch.equal(out.cpu(), expected.cpu())
            detail = f"{out[:, ids.shape[1]:].numel()} tokens identical to the unsharded model"
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
