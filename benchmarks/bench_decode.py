"""Decode-attention benchmark: lean vs the peers installed here, on one GPU, in one run.

Method: the device-to-device copy bandwidth is measured first, in the same process. Each op is
captured in one CUDA graph per input set; input sets rotate so that the bytes touched between two
replays of the same set exceed the L2 cache several times (cold L2). Times are medians of CUDA-event
measurements. Bandwidth counts the K/V bytes a ragged-aware kernel must read (sum of lengths) plus
q and out; "%copy" is that over the measured copy bandwidth. Every peer's output is checked
against lean's before it is timed.

    python benchmarks/bench_decode.py --quick --out out/bench
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F

import lean_tp

L2_ROTATION_FACTOR = 4  # bytes between two replays of one input set >= 4 x L2: the L2 is cold


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of reps."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = _time(lambda: dst.copy_(src), reps)
    return 2 * nbytes / statistics.median(times)


def _time(fn: Callable[[], object], reps: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def make_set(lens, hq, hkv, d, dtype, capacity):
    b = len(lens)
    return dict(
        q=torch.randn(b, hq, d, device="cuda", dtype=dtype),
        k_cache=torch.randn(b, hkv, capacity, d, device="cuda", dtype=dtype),
        v_cache=torch.randn(b, hkv, capacity, d, device="cuda", dtype=dtype),
        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
    )


def sdpa(q, k_cache, v_cache, cache_seqlens):
    """What a user without a decode kernel writes: SDPA over the padded cache with a length mask."""
    mask = torch.arange(k_cache.shape[2], device=q.device) < cache_seqlens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k_cache, v_cache, attn_mask=mask[:, None, None], enable_gqa=True
    )
    return out[:, :, 0]


PEERS: dict[str, Callable] = {
    "lean": lambda s: lean_tp.decode_attention(**s),
    "sdpa": lambda s: sdpa(**s),
    "torch-backend": lambda s: lean_tp.decode_attention(**s, backend="torch"),
}


def bench_row(lens, hq, hkv, d, dtype, reps, l2_bytes):
    capacity = max(lens)
    one = make_set(lens, hq, hkv, d, dtype, capacity)
    set_bytes = sum(t.numel() * t.element_size() for t in one.values())
    sets = [one] + [make_set(lens, hq, hkv, d, dtype, capacity) for _ in range(max(1, L2_ROTATION_FACTOR * l2_bytes // set_bytes))]
    ref = PEERS["lean"](one)
    row = {}
    for name, fn in PEERS.items():
        err = (fn(one).float() - ref.float()).abs().max().item()
        if err > 2e-2:
            row[name] = float("nan")
            print(f"  {name}: output differs from lean by {err:.3e}; not timed", file=sys.stderr)
            continue
        graphs = []
        for s in sets:
            fn(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(s)
            graphs.append(g)
        times = []
        for _ in range(max(1, reps // len(graphs))):
            for g in graphs:
                times += _time(g.replay, 1)
        row[name] = statistics.median(times)
        del graphs
    elem = torch.empty((), dtype=dtype).element_size()
    moved = (2 * sum(lens) * hkv * d + 2 * len(lens) * hq * d) * elem
    return row, moved


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short sweep (a few minutes)")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default="out/bench")
    args = parser.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bw = copy_bandwidth()
    print(f"device: {props.name}, SMs {props.multi_processor_count}, copy bandwidth {bw / 1e12:.2f} TB/s")
    contexts = [1024, 8192, 32768, 131072] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
    shapes = [([n] * 8, 32, 8, 128) for n in contexts]  # Llama-3-8B attention, batch 8
    shapes += [([n] * 1, 32, 8, 128) for n in contexts]
    shapes += [([32768, 512, 4096, 1024, 100, 16000, 8000, 2000], 32, 8, 128)]  # ragged batch
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for lens, hq, hkv, d in shapes:
        times, moved = bench_row(lens, hq, hkv, d, dtype, args.reps, l2)
        row = dict(batch=len(lens), max_len=max(lens), mean_len=sum(lens) // len(lens), hq=hq, hkv=hkv, d=d, dtype=args.dtype)
        for name, t in times.items():
            row[f"{name}_us"] = round(t * 1e6, 2)
        row["lean_GBps"] = round(moved / times["lean"] / 1e9, 1)
        row["lean_pct_copy"] = round(100 * moved / times["lean"] / bw, 1)
        for name in PEERS:
            if name != "lean":
                row[f"speedup_vs_{name}"] = round(times[name] / times["lean"], 2)
        rows.append(row)
        print(row, flush=True)
    with open(os.path.join(args.out, "bench_decode.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
