"""Decode-attention demo: one ragged batch through lean_tp.decode_attention, checked against float64.

python examples/decode_attention_demo.py            # CUDA if present, else CPU
python examples/decode_attention_demo.py --paged --batch 8 --max-len 32768
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

import lean_tp
from lean_tp import cli
from lean_tp.ops.decode_attention import decode_attention_ref, plan_decode

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PAGE_SIZE = 16
TIMED_CALLS = 10


def parse_args(argv: list[str] | None) -> cli.argparse.Namespace:
    p = cli.ArgumentParser(prog="decode_attention_demo.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", type=cli.device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", type=cli.choice(*DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=cli.integer(1, 4096), default=4)
    p.add_argument("--heads", type=cli.integer(1, 1024), default=32, help="query heads")
    p.add_argument("--kv-heads", type=cli.integer(1, 1024), default=8)
    p.add_argument("--head-dim", type=cli.integer(1, 1024), default=128)
    p.add_argument(
        "--max-len",
        type=cli.integer(1, 1 << 24),
        default=4096,
        help="cache capacity; lengths are drawn in [0, max-len]",
    )
    p.add_argument("--paged", action="store_true", help=f"use a paged cache with {PAGE_SIZE}-token pages")
    p.add_argument("--seed", type=cli.integer(0), default=0)
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.fail("--heads", f"a multiple of --kv-heads ({args.kv_heads})", args.heads)
    args.dtype = DTYPES[args.dtype or ("bf16" if torch.device(args.device).type == "cuda" else "fp32")]
    # K, V and the float64 reference's copies of them
    need, have = (
        2 * args.batch * args.kv_heads * args.max_len * args.head_dim * (args.dtype.itemsize + 8),
        cli.memory_bytes(args.device),
    )
    if need > have // 2:
        p.fail(
            "--max-len",
            f"a cache that fits in half of the {args.device} memory (half of {have / 2**30:.0f} GiB)",
            f"{need / 2**30:.1f} GiB for --batch {args.batch} x --kv-heads {args.kv_heads} x --max-len {args.max_len}",
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), args.dtype
    print(
        f"building a {'paged' if args.paged else 'contiguous'} cache: batch {args.batch}, {args.kv_heads} KV heads, "
        f"capacity {args.max_len} ...",
        flush=True,
    )
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(0, args.max_len + 1, (args.batch,), generator=g, dtype=torch.int32)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g).to(device, dtype)
    block_table = None
    if args.paged:
        per_seq = math.ceil(args.max_len / PAGE_SIZE)
        shape = (args.batch * per_seq, PAGE_SIZE, args.kv_heads, args.head_dim)
        block_table = torch.randperm(args.batch * per_seq, generator=g).view(args.batch, per_seq).int().to(device)
    else:
        shape = (args.batch, args.kv_heads, args.max_len, args.head_dim)
    k = torch.randn(shape, generator=g).to(device, dtype)
    v = torch.randn(shape, generator=g).to(device, dtype)
    lens = lens.to(device)

    call = lambda: lean_tp.decode_attention(q, k, v, lens, block_table=block_table, return_lse=True)  # noqa: E731
    out, lse = call()
    times = []
    for _ in cli.progress(range(TIMED_CALLS), desc="timing", unit="call", leave=False):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    print("float64 reference ...", flush=True)
    ref_out, ref_lse = decode_attention_ref(q, k, v, lens, block_table)
    err = (out.double().cpu() - ref_out).abs().max().item()
    backend = "triton" if device.type == "cuda" else "torch"
    print(f"device {device} ({backend} backend), dtype {dtype}, lengths {lens.tolist()}")
    if device.type == "cuda":
        plan = plan_decode(q, k, v, lens, block_table)
        print(f"stream-K grid: {plan.num_programs} programs")
    print(f"median latency {statistics.median(times) * 1e3:.3f} ms over {TIMED_CALLS} calls (eager, wall clock)")
    print(f"max |out - float64 reference| = {err:.2e}")
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    if not err <= tol:
        print(f"check: MISMATCH (max |out - float64 reference| {err:.2e} > {tol:.0e})")
        return 1
    print(f"check: OK (max |out - float64 reference| {err:.2e} <= {tol:.0e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
