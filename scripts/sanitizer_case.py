"""A small decode case for compute-sanitizer: every output split over several programs, paged cache.

compute-sanitizer --tool memcheck python scripts/sanitizer_case.py   (scripts/gpu_check.py runs all four tools)
"""

import sys

import torch

import lean_tp
from lean_tp import cli


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="sanitizer_case.py", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=cli.integer(0), default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error(
            f"no CUDA device visible to torch {torch.__version__}; this case runs the kernel under compute-sanitizer on a GPU"
        )
    torch.manual_seed(args.seed)
    batch, num_q_heads, num_kv_heads, head_dim, page_size = 3, 8, 2, 128, 16
    lens = torch.tensor([700, 0, 129], dtype=torch.int32, device="cuda")
    pages = 3 * 48
    k = torch.randn(pages, page_size, num_kv_heads, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    block_table = torch.randperm(pages, device="cuda").view(3, 48).int()
    q = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=torch.float16)
    out = lean_tp.decode_attention(q, k, v, lens, block_table=block_table)
    ref = lean_tp.decode_attention(q, k, v, lens, block_table=block_table, backend="torch")
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    print(f"sanitizer case max abs err vs torch backend: {err:.2e}")
    return 0 if err < 5e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
