"""Decode-attention demo: one ragged batch through lean_tp.decode_attention, checked against float64.

    python examples/decode_attention_demo.py            # CUDA if present, else CPU
    python examples/decode_attention_demo.py --paged --batch 8 --max-len 32768
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import lean_tp
from lean_tp.ops.decode_attention import decode_attention_ref
from lean_tp.ops.decode_attention.launcher import grid_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["fp16", "bf16", "fp32"], help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--paged", action="store_true", help="use a paged cache with 16-token pages")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(0, args.max_len + 1, (args.batch,), generator=g, dtype=torch.int32)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g).to(device, dtype)
    block_table = None
    if args.paged:
        page, per_seq = 16, math.ceil(args.max_len / 16)
        shape = (args.batch * per_seq, page, args.kv_heads, args.head_dim)
        block_table = torch.randperm(args.batch * per_seq, generator=g).view(args.batch, per_seq).int().to(device)
    else:
        shape = (args.batch, args.kv_heads, args.max_len, args.head_dim)
    k = torch.randn(shape, generator=g).to(device, dtype)
    v = torch.randn(shape, generator=g).to(device, dtype)
    lens = lens.to(device)

    call = lambda: lean_tp.decode_attention(q, k, v, lens, block_table=block_table, return_lse=True)  # noqa: E731
    out, lse = call()
    times = []
    for _ in range(10):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    ref_out, ref_lse = decode_attention_ref(q, k, v, lens, block_table)
    err = (out.double().cpu() - ref_out).abs().max().item()
    backend = "triton" if device.type == "cuda" else "torch"
    print(f"device {device} ({backend} backend), dtype {dtype}, lengths {lens.tolist()}")
    if device.type == "cuda":
        print(f"stream-K grid: {grid_size(device, dtype, args.head_dim, args.heads // args.kv_heads)} programs")
    print(f"median latency {statistics.median(times) * 1e3:.3f} ms over 10 calls (eager, wall clock)")
    print(f"max |out - float64 reference| = {err:.2e}")
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    if not err <= tol:
        raise SystemExit(f"mismatch: {err:.2e} > {tol:.0e}")
    print("check: OK")


if __name__ == "__main__":
    main()
