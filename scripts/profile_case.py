"""One decode shape to profile with Nsight Compute: DeepSeek-V3's MLA rank under DP attention by
default (128 heads on one 576-dim latent head, 64-token pages), warmed up, then timed.

    python scripts/profile_case.py --heads 128 --batch 32                 # the median time of the call
    ncu --kernel-name decode_attention_fwd_kernel --launch-skip 3 --launch-count 1 --set full \\
        --import-source yes -o OUT/mla python scripts/profile_case.py --heads 128 --batch 32
    ncu --import OUT/mla.ncu-rep --page source --print-source sass --csv > OUT/mla_sass.csv

``--override KEY=VALUE`` changes the tuning entry (``DecodeConfig`` fields, e.g. ``block_n=64``,
``max_block_g=16``), as the benchmark's MLA ablations do.
"""

import argparse
import dataclasses
import statistics
import sys

import torch

from lean_tp import cli
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd
from lean_tp.ops.decode_attention.tuning import config_override, get_config

MLA_DQK, MLA_DV = 576, 512


def _override(text: str) -> tuple[str, int | None]:
    try:
        return config_override(text, optional=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected {exc}, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="profile_case.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=cli.integer(1), default=128, help="query heads on the one latent head")
    p.add_argument("--batch", type=cli.integer(1), default=32)
    p.add_argument("--context", type=cli.integer(1), default=32768, help="keys of every sequence")
    p.add_argument("--tokens", type=cli.integer(1, 16), default=1, help="query tokens a sequence (MTP: 2)")
    p.add_argument("--cache", type=cli.choice("bf16", "e4m3"), default="bf16")
    p.add_argument("--page", type=cli.integer(1), default=64, help="tokens a page")
    p.add_argument("--override", type=_override, action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--reps", type=cli.integer(1), default=20, help="timed CUDA-graph replays after 3 warm-up calls")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error(f"no CUDA device visible to torch {torch.__version__}; this case profiles the kernel on a GPU")
    pages_per_seq = -(-args.context // args.page)
    cache = torch.randn(args.batch * pages_per_seq, args.page, 1, MLA_DQK, device="cuda", dtype=torch.bfloat16)
    scale = None
    if args.cache == "e4m3":
        cache, scale = cache.to(torch.float8_e4m3fn), torch.ones(1, device="cuda")
    q = torch.randn(args.batch, args.tokens, args.heads, MLA_DQK, device="cuda", dtype=torch.bfloat16)
    call = dict(
        q=q,
        k_cache=cache,
        v_cache=cache[..., :MLA_DV],
        cache_seqlens=torch.full((args.batch,), args.context, device="cuda", dtype=torch.int32),
        block_table=torch.randperm(cache.shape[0], device="cuda", dtype=torch.int32).view(args.batch, -1),
        softmax_scale=MLA_DQK**-0.5,
        k_scale=scale,
        v_scale=scale,
        config=dataclasses.replace(get_config(q.device, MLA_DQK, q.dtype, cache.dtype, MLA_DV), **dict(args.override)),
    )
    for _ in range(3):  # compile and warm up; the fourth kernel launch is the first replay below
        decode_attention_fwd(**call)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # replays time the kernel, not the host's planning of a call
    with torch.cuda.graph(graph):
        decode_attention_fwd(**call)
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    print(f"B={args.batch} Tq={args.tokens} heads={args.heads} context={args.context} {args.cache} "
          f"overrides={dict(args.override)}: median {statistics.median(times):.1f} us over {args.reps} calls")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
