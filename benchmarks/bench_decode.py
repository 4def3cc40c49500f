"""Decode-attention benchmark: lean_tp.decode_attention against its peers, side by side, in one run.

    python benchmarks/bench_decode.py --quick --out out/bench     # under 8 minutes on one H100
    python benchmarks/bench_decode.py --out out/bench             # the full sweeps, fp16 and bf16
    python benchmarks/bench_decode.py --dry --out out/dry         # CPU: tiny shapes, the plumbing only

Peers (benchmarks/peers.py): lean, the FlashDecoding baseline (benchmarks/flash_decoding.py), SDPA
with a length mask, FlexAttention's decode kernel under torch.compile, torch's ``varlen_attn``, and
flash-attn's ``flash_attn_with_kvcache`` and FlashInfer's batch decode when installed ("not
installed" otherwise). Results: bench_decode.csv, results.json (benchmarks/results.py) and plots.

Method: the device-to-device copy bandwidth is measured first, in the same run. Every peer's output
is checked against lean's before it is timed. Each peer is captured in one CUDA graph per input
set, and the sets rotate so that at least 4x the L2 size is touched between two replays of one set
(cold L2). Times are medians of CUDA-event measurements. Bandwidth counts the bytes a
ragged-aware kernel must move (K/V of every sequence's length, plus q and out) and is reported as a
fraction of the measured copy bandwidth. The dry mode times on the CPU with a wall clock instead.
"""

from __future__ import annotations

import sys

if "--dry" in sys.argv:  # the dry run executes Triton kernels in the interpreter; set before they are defined
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

import csv
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peers import PEERS

from lean_tp import cli
from lean_tp.model import CONFIGS
from lean_tp.ops.decode_attention.tuning import arch_of
from lean_tp.tools.simulate.problems import MLA_DIMS

L2_ROTATION_FACTOR = 4  # bytes touched between two replays of one input set >= 4 x L2: the L2 is cold
MEMORY_FRACTION = 0.6  # rows whose input sets need more of the free GPU memory are skipped
CHECK_ATOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# The "models" sweep: head counts of these lean_tp.model configs (their head_dim is 128).
MODELS = {
    name: (CONFIGS[name].n_heads, CONFIGS[name].n_kv_heads)
    for name in ("llama-3-8b", "llama-3-70b", "mistral-7b", "phi-3-medium")
}


@dataclass(frozen=True)
class Shape:
    sweep: str
    x: str  # the swept value, for tables and plots
    lens: tuple[int, ...]
    hq: int
    hkv: int
    d: int = 128
    layout: str = "contiguous"  # the cache layout every peer is given: "contiguous" or "paged<page size>"
    kv: str = "same"  # "same": the cache in the run's dtype; "fp8": float8_e4m3fn with scales
    window: int | None = None  # sliding window, in keys
    tq: int = 1  # query tokens a sequence (MTP's verification: the last tq keys are its drafts)

    @property
    def mla(self) -> bool:
        """MLA decode: one latent head of ``MLA_DIMS[0]`` dims, V its first ``MLA_DIMS[1]``."""
        return self.d == MLA_DIMS[0]

    @property
    def features(self) -> frozenset[str]:
        """What a peer must take to run this shape (``Peer.features``)."""
        wanted = {
            "fp8": self.kv == "fp8",
            "window": bool(self.window),
            "paged": self.layout != "contiguous",
            "mla": self.mla,
            "tq": self.tq > 1,
        }
        return frozenset(name for name, on in wanted.items() if on)


def ragged_lens(batch: int, max_len: int, ratio: float) -> tuple[int, ...]:
    """One sequence at max_len, the others equal, so that mean / max == ratio (as near as integers
    allow; the smallest reachable ratio is 1 / batch)."""
    rest = max(1, round((ratio * batch * max_len - max_len) / (batch - 1)))
    return (max_len,) + (min(rest, max_len),) * (batch - 1)


# Timed calls per peer in a dry run: CPU timings check the plumbing, not speed, and each interpreted
# Triton call takes a few tenths of a second.
DRY_REPS = 3
# Every sweep's name, as --sweeps takes it and the shapes' ``sweep`` field holds it.
SWEEPS = ("context", "heads", "batch", "ragged", "models", "gqa", "kv", "window", "layouts", "mla")


def sweeps(quick: bool, dry: bool) -> list[Shape]:
    if dry:
        return [Shape("context", str(n), (n,) * 2, 4, 2, 64) for n in (64, 300)] + [
            Shape("ragged", "0.3", ragged_lens(3, 200, 0.3), 4, 2, 64),
            Shape("gqa", "4", (150,) * 2, 8, 2, 64),
            Shape("kv", "fp8", (150,) * 2, 8, 2, 64, kv="fp8"),
            Shape("window", "32", (300,) * 2, 8, 2, 64, window=32),
            Shape("layouts", "paged16", (150,) * 2, 8, 2, 64, layout="paged16"),
            Shape("mla", "TP 8", (150, 70), 16, 1, MLA_DIMS[0], layout="paged64"),
            Shape("mla", "TP 8 Tq 2", (150, 70), 16, 1, MLA_DIMS[0], layout="paged64", tq=2),
        ]
    pick = (lambda full, few: few) if quick else (lambda full, few: full)
    contexts = pick([1 << k for k in range(10, 20)], [1024, 8192, 32768, 131072])  # 1k-512k
    shapes = [Shape("context", str(n), (n,) * 4, 32, 32) for n in contexts]
    shapes += [Shape("heads", str(h), (262144,), h, h) for h in pick([8, 16, 32, 64, 128], [8, 32, 128])]
    shapes += [Shape("batch", str(b), (16384,) * b, 32, 32) for b in pick([1, 2, 4, 8, 16, 32], [1, 8, 32])]
    shapes += [
        Shape("ragged", str(r), ragged_lens(16, 32768, r), 32, 8)
        for r in pick([0.1, 0.2, 0.4, 0.6, 0.8, 1.0], [0.1, 0.5, 1.0])
    ]
    shapes += [Shape("models", name, (8192,) * 8, hq, hkv) for name, (hq, hkv) in MODELS.items()]
    shapes += [Shape("gqa", str(g), (16384,) * 8, 8 * g, 8) for g in pick([1, 2, 4, 8, 16], [1, 4, 16])]
    # fp8 against the 16-bit cache of the same shape (half the bytes), and windows over a long cache
    # (a window should cost its own length, not the cache's).
    shapes += [Shape("kv", kv, (32768,) * 8, 32, 8, kv=kv) for kv in ("same", "fp8")]
    shapes += [
        Shape("window", str(w), (131072,) * 4, 32, 8, window=w) for w in pick([None, 32768, 4096, 1024], [None, 4096])
    ]
    # The load paths: contiguous and 16-token pages, 16-bit and fp8, against FlashInfer's paged
    # decode (Llama-3-8B heads; 8k-128k keys, B in {1, 8, 64}).
    shapes += [
        Shape("layouts", f"{layout} {kv} B={b} {n >> 10}k", (n,) * b, 32, 8, layout=layout, kv=kv)
        for layout in ("contiguous", "paged16")
        for kv in ("same", "fp8")
        for b in pick([1, 8, 64], [1, 64])
        for n in pick([8192, 32768, 131072], [32768])
    ]
    # DeepSeek-V3's MLA rank at TP 8 (16 heads) and under DP attention (128), 16-bit and fp8 latent
    # pages of 64 rows (FlashMLA's page size), and Kimi-K2's under DP attention (64) at 16 bits,
    # against FlashMLA, FlashInfer's MLA and vLLM's Triton MLA.
    shapes += [
        mla_shape(heads, kv, b, n)
        for heads in (16, 64, 128)
        for kv in ("same", "fp8")
        for b in pick([1, 8, 32, 128], [1, 32])
        for n in pick([4096, 32768], [4096, 32768])
        if heads != 64 or kv == "same"  # Kimi-K2's 64 heads: the Gluon route, 16-bit caches
    ]
    # MTP's verification (one draft: Tq 2) of DeepSeek-V3's ranks at 32k keys: each peer given the
    # query tokens as its API takes them (peers.py).
    shapes += [
        mla_shape(heads, kv, b, 32768, tq=2)
        for heads in (16, 128)
        for kv in ("same", "fp8")
        for b in pick([1, 8, 32], [32])
    ]
    return shapes


def mla_shape(heads: int, kv: str, batch: int, keys: int, tq: int = 1) -> Shape:
    """An MLA sweep shape: ``batch`` sequences of ``keys`` keys in one latent head's 64-row pages,
    ``heads`` query heads, ``tq`` query tokens each."""
    cache = "fp8" if kv == "fp8" else "16-bit"
    tokens = f" Tq {tq}" if tq > 1 else ""
    label = f"{heads} heads {cache}{tokens} B={batch} {keys >> 10}k"
    return Shape("mla", label, (keys,) * batch, heads, 1, MLA_DIMS[0], layout="paged64", kv=kv, tq=tq)


def make_set(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    b, cap = len(shape.lens), max(shape.lens)
    cache_dtype = torch.float8_e4m3fn if shape.kv == "fp8" else dtype
    if shape.layout == "contiguous":
        kv_shape = (b, shape.hkv, cap, shape.d)
    else:  # pages in random order, as a serving engine's allocator leaves them
        page = int(shape.layout.removeprefix("paged"))
        kv_shape = (b * -(-cap // page), page, shape.hkv, shape.d)
    s = dict(
        q=torch.randn(b, *((shape.tq,) if shape.tq > 1 else ()), shape.hq, shape.d, device=device, dtype=dtype),
        k_cache=torch.randn(kv_shape, device=device, dtype=dtype).to(cache_dtype),
        cache_seqlens=torch.tensor(shape.lens, dtype=torch.int32, device=device),
    )
    # MLA: V is the latent rows' first 512 dims, read with K's.
    v = s["k_cache"][..., : MLA_DIMS[1]] if shape.mla else torch.randn(kv_shape, device=device, dtype=dtype)
    s["v_cache"] = v.to(cache_dtype)
    if shape.layout != "contiguous":
        s["block_table"] = torch.randperm(kv_shape[0], device=device, dtype=torch.int32).view(b, -1)
    if shape.kv == "fp8":
        s["k_scale"] = s["v_scale"] = torch.ones(1, device=device)
    if shape.window:
        s["window"] = shape.window
    return s


def moved_bytes(shape: Shape, dtype: torch.dtype) -> int:
    """Bytes a kernel must move: the K/V each query can see (a window's keys only), q and out."""
    keys = sum(min(n, shape.window or n) for n in shape.lens)
    kv_size = 1 if shape.kv == "fp8" else dtype.itemsize
    rows = len(shape.lens) * shape.tq * shape.hq  # q's and out's
    if shape.mla:  # one latent row a key; out is V's width
        return keys * shape.d * kv_size + rows * (shape.d + MLA_DIMS[1]) * dtype.itemsize
    return 2 * keys * shape.hkv * shape.d * kv_size + 2 * rows * shape.d * dtype.itemsize


class Timer:
    """Median seconds per call: CUDA-graph replays timed with events on a GPU, wall clock on CPU."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.cuda, self.reps = device.type == "cuda", reps

    def __call__(self, fns: list[Callable[[], torch.Tensor]]) -> tuple[float, str]:
        if not self.cuda:
            for fn in fns:  # warm every input set before timing any
                fn()
            samples = []
            for _ in range(self.reps):
                for fn in fns:
                    start = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - start)
            return statistics.median(samples), ""
        try:
            runs, how = [self._graph(fn) for fn in fns], ""
        except Exception:  # a peer that cannot be captured is timed eagerly, and the row says so
            torch.cuda.synchronize()
            runs, how = fns, "eager (graph capture failed)"
        events = []
        for _ in range(max(self.reps // len(runs), 3)):
            for run in runs:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in events), how

    @staticmethod
    def _graph(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


def copy_bandwidth(device: torch.device) -> float:
    """Copy bandwidth in bytes/s (read + written) of 1 GiB (64 MiB on CPU): the faster of a copy
    (which a CUDA graph may hand to a copy engine) and an elementwise kernel that reads and writes
    16-byte vectors on the SMs, as the kernels measured against it do; medians of 20."""
    n = ((1 << 30) if device.type == "cuda" else (64 << 20)) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timer = Timer(device, 20)
    seconds = min(timer([lambda: dst.copy_(src)])[0], timer([lambda: torch.neg(src, out=dst)])[0])
    return 2 * 4 * n / seconds


def input_sets(shape: Shape, dtype: torch.dtype, device: torch.device, l2_bytes: int) -> list[dict] | None:
    """Enough sets to keep the L2 cold between replays of one set; None if one set does not fit."""
    batch = len(shape.lens)
    set_bytes = (2 * batch * shape.hkv * max(shape.lens) + batch * shape.tq * shape.hq) * shape.d * dtype.itemsize
    count = max(1, min(64, math.ceil(L2_ROTATION_FACTOR * l2_bytes / set_bytes)))
    if device.type != "cuda":
        count = 1  # the dry run checks the plumbing; there is no L2 to keep cold
    else:
        budget = MEMORY_FRACTION * torch.cuda.mem_get_info(device)[0]
        if set_bytes > budget:
            return None
        count = max(1, min(count, int(budget // set_bytes)))
    return [make_set(shape, dtype, device) for _ in range(count)]


def bench_shape(
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    peers: list[str],
    timer: Timer,
    copy_bw: float,
    l2_bytes: int,
) -> dict:
    row = dict(
        sweep=shape.sweep,
        x=shape.x,
        dtype=str(dtype).removeprefix("torch."),
        kv=shape.kv,
        window=shape.window or "",
        batch=len(shape.lens),
        hq=shape.hq,
        hkv=shape.hkv,
        d=shape.d,
        layout=shape.layout,
        max_len=max(shape.lens),
        mean_len=sum(shape.lens) // len(shape.lens),
    )
    notes, times = [], {}
    if (shape.kv == "fp8" or shape.mla) and dtype == torch.float32:
        row["notes"] = f"skipped: {'MLA' if shape.mla else 'fp8 caches'} take a 16-bit q"
        return row
    sets = input_sets(shape, dtype, device, l2_bytes)
    if sets is None:
        row["notes"] = "skipped: inputs do not fit in GPU memory"
        return row
    ref = PEERS["lean"].prepare(sets[0])().float()
    for name in peers:
        if PEERS[name].only and PEERS[name].only not in shape.features:
            continue
        why = PEERS[name].unavailable(device)
        lacking = shape.features - PEERS[name].features
        if lacking:
            why = f"not benchmarked with {', '.join(sorted(lacking))}"
        if why:
            notes.append(f"{name}: {why}")
            continue
        try:
            fns = [PEERS[name].prepare(s) for s in sets]
            err = (fns[0]().float() - ref).abs().max().item()
            if not err <= CHECK_ATOL[dtype]:
                notes.append(f"{name}: differs from lean by {err:.2e}, not timed")
                continue
            times[name], how = timer(fns)
            if name != "lean":
                row[f"{name}_err"] = float(f"{err:.3g}")
            if how:
                notes.append(f"{name}: {how}")
        except Exception as exc:  # a peer's failure is reported in the row, never fatal
            notes.append(f"{name}: error {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
        finally:
            fns = None
    moved = moved_bytes(shape, dtype)
    for name, seconds in times.items():
        row[f"{name}_us"] = round(seconds * 1e6, 2)
        row[f"{name}_gbps"] = float(f"{moved / seconds / 1e9:.4g}")
        row[f"{name}_pct_copy"] = float(f"{100 * moved / seconds / copy_bw:.3g}")
    for name, seconds in times.items():
        # Off the GPU, Triton kernels run in the interpreter: compare them only with each other.
        like = device.type == "cuda" or PEERS[name].triton == PEERS["lean"].triton
        if name != "lean" and "lean" in times and like:
            row[f"speedup_vs_{name}"] = float(f"{seconds / times['lean']:.3g}")
    row["notes"] = "; ".join(notes)
    return row


def environment(device: torch.device, copy_bw: float) -> dict:
    """The environment keys of a results record (benchmarks/results.py ENV_KEYS), plus CUDA's version."""
    import datetime
    import shutil
    import subprocess

    import triton

    def output(cmd: list[str]) -> str:
        return subprocess.run(
            cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__))
        ).stdout.strip()

    # A checkout copied without .git (a lent GPU machine) names its commit in LEAN_TP_COMMIT.
    commit = os.environ.get("LEAN_TP_COMMIT") or output(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    env = dict(
        device="cpu (dry run)",
        sm_count=0,
        driver="none",
        torch=torch.__version__,
        triton=triton.__version__,
        commit=commit,
        date=datetime.date.today().isoformat(),
        copy_bandwidth_gbps=round(copy_bw / 1e9, 1),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        smi = shutil.which("nvidia-smi")
        driver = output([smi, "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines() if smi else []
        env |= dict(
            device=props.name,
            sm_count=props.multi_processor_count,
            driver=driver[0] if driver else "unknown",
            cuda=torch.version.cuda,
            arch=arch_of(device),  # the architecture entry (limits, tuning) the kernel ran with
        )
    return env


def main(argv: list[str] | None = None) -> list[dict]:
    p = cli.ArgumentParser(prog="bench_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short sweep: under 8 minutes on one H100")
    p.add_argument("--dry", action="store_true", help="CPU, tiny shapes, torch backend: check the plumbing")
    p.add_argument(
        "--dtypes",
        nargs="+",
        type=cli.choice("fp16", "bf16"),
        help="default: bf16 with --quick, else both; fp32 with --dry (fp16 there runs the fp8 rows)",
    )
    p.add_argument("--sweeps", nargs="+", type=cli.choice(*SWEEPS), help=f"only these sweeps ({' '.join(SWEEPS)})")
    opt_in = [name for name, peer in PEERS.items() if peer.opt_in]
    p.add_argument(
        "--peers",
        nargs="+",
        default=[name for name in PEERS if name not in opt_in],
        type=cli.choice(*PEERS),
        help=f"default: all but {', '.join(opt_in)}",
    )
    p.add_argument("--reps", type=cli.integer(1, 100_000), default=60)
    p.add_argument("--out", type=cli.output_dir, default="out/bench")
    args = p.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        p.fail("--dry", "--dry on a machine without a CUDA device (timings need one)", "no --dry")
    device = torch.device("cpu" if args.dry else "cuda")
    names = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    default = ["fp32"] if args.dry else ["bf16"] if args.quick else ["fp16", "bf16"]
    dtypes = [names[d] for d in (args.dtypes or default)]
    peers = ["lean"] + [n for n in args.peers if n != "lean"]
    copy_bw = copy_bandwidth(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 32 << 20
    env = environment(device, copy_bw)
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if args.dry:
        print(
            "dry run: CPU timings say nothing about GPU speed; Triton kernels (lean, flash-decoding) run in the "
            "interpreter and are compared only with each other",
            flush=True,
        )
    shapes = [s for s in sweeps(args.quick, args.dry) if not args.sweeps or s.sweep in args.sweeps]
    timer = Timer(device, DRY_REPS if args.dry else args.reps)
    rows = []
    for dt, s in cli.progress([(dt, s) for dt in dtypes for s in shapes], desc="bench", unit="shape"):
        rows.append(bench_shape(s, dt, device, peers, timer, copy_bw, l2))
        write_tables(rows, env, args.out)
    write_plots(rows, env, args.out)
    return rows


def record(rows: list[dict], env: dict) -> dict:
    """The results record (format in benchmarks/results.py) of the benchmark's wide rows: one row per
    (shape, implementation) timed, and every note (a peer not timed and why, or timed eagerly)."""
    from results import validate

    timed, notes = [], []
    for row in rows:
        shape = dict(
            sweep=row["sweep"],
            x=row["x"],
            batch=row["batch"],
            q_heads=row["hq"],
            kv_heads=row["hkv"],
            head_dim=row["d"],
            dtype=row["dtype"],
            layout=row["layout"],
            context=row["max_len"],
            mean_context=row["mean_len"],
        )
        for impl in (k.removesuffix("_us") for k in row if k.endswith("_us")):
            timed.append(
                shape
                | dict(
                    impl=impl,
                    time_us=row[f"{impl}_us"],
                    gbps=row[f"{impl}_gbps"],
                    fraction_of_copy=float(f"{row[f'{impl}_pct_copy'] / 100:.3g}"),
                    max_abs_err_vs_lean=row.get(f"{impl}_err"),
                )
            )
        notes += [
            dict(sweep=row["sweep"], x=row["x"], dtype=row["dtype"], note=n) for n in row["notes"].split("; ") if n
        ]
    return validate(env | dict(rows=timed, notes=notes))


def write_tables(rows: list[dict], env: dict, out_dir: str) -> None:
    """The wide CSV and the results record of the rows so far. Written after every shape, so a run
    cut short (a GPU check step's timeout kills it) leaves the shapes it finished."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    fields.append(fields.pop(fields.index("notes")))
    with open(os.path.join(out_dir, "bench_decode.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(record(rows, env), f, indent=1)


def write_plots(rows: list[dict], env: dict, out_dir: str) -> None:
    """The plots and a line a row, once every shape's row is in the tables (``write_tables``)."""
    from plots import plot_all

    plot_all(rows, env, out_dir)
    for row in rows:
        speedups = ", ".join(
            f"{v}x vs {k.removeprefix('speedup_vs_')}" for k, v in row.items() if k.startswith("speedup_vs_")
        )
        speedups = f"lean's speedup (peer time / lean time): {speedups}" if speedups else "no like-for-like peer timed"
        lean = f"lean {row['lean_us']} us ({row['lean_pct_copy']}% of copy BW)" if "lean_us" in row else "lean: -"
        print(f"{row['sweep']:>8} {row['x']:>12} {row['dtype']:>8}: {lean}; {speedups}  {row['notes']}")


if __name__ == "__main__":
    main()
