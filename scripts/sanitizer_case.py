"""A small decode case for compute-sanitizer: every output split over several programs, paged cache."""

import torch

import lean_tp


def main() -> None:
    torch.manual_seed(0)
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
    assert err < 5e-3


if __name__ == "__main__":
    main()
