"""Worker for test_decode_tp.py: a tensor-parallel decode loop in which rank 1 misbehaves at step 2.

    python tests/tp_worker.py {raise|exit|hang|none} TIMEOUT_S [CP]     (with the torchrun env variables set)

raise: rank 1 raises; exit: rank 1 dies without cleanup; hang: rank 1 stops joining collectives.
The healthy ranks must end with an error within the process-group timeout, never hang.
"""

import os
import sys
import time

import torch

from lean_tp.distributed import apply_tp, init_distributed, init_parallel_groups, shutdown
from lean_tp.generate import decode_one
from lean_tp.model import build_model
from lean_tp.weights import init_random_weights


def main(mode: str, timeout_s: float, cp: int) -> None:
    ctx = init_distributed("cpu", timeout_s=timeout_s)
    model = build_model("tiny")
    apply_tp(model, ctx.rank, ctx.world_size, cp, init_parallel_groups(ctx, cp))
    init_random_weights(model, 0, "cpu", torch.float32)
    model.setup_caches(2, 32)
    tokens, lens = torch.zeros(2, dtype=torch.long), torch.tensor([3, 5], dtype=torch.int32)
    with torch.inference_mode():
        for step in range(6):
            if ctx.rank == 1 and step == 2:
                if mode == "raise":
                    raise RuntimeError("injected failure on rank 1")
                if mode == "exit":
                    os._exit(3)
                if mode == "hang":
                    time.sleep(3600)
            tokens, _ = decode_one(model, tokens, lens)
            lens = lens + 1
        tokens = tokens.clone()  # wait for the last all-reduce
    print(f"rank {ctx.rank}: finished", flush=True)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
