"""The benchmark's FlashDecoding baseline (benchmarks/flash_decoding.py) is exact: interpreter runs
against float64 with NaN-filled outputs and workspace, and cubin builds for sm_80 and sm_90."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_matches_ref, make_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from flash_decoding import flash_decoding, num_splits_for  # noqa: E402

LENS = {"edges": [0, 1, 63, 64, 65], "ragged": [700, 3, 0, 129, 1500]}


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("lens", sorted(LENS))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_flash_decoding_matches_float64(dtype, hq, hkv, lens, splits):
    inputs = make_inputs(LENS[lens], hq, hkv, 64, dtype, seed=splits)
    del inputs["block_table"], inputs["cache_leftpad"]  # the baseline takes contiguous, unpadded caches
    batch = len(LENS[lens])
    out = torch.full((batch, hq, 64), float("nan"), dtype=dtype)
    lse = torch.full((batch, hq), float("nan"))
    ws = (torch.full((batch, hq, splits, 64), float("nan")), torch.full((batch, hq, splits, 2), float("nan")))
    flash_decoding(**inputs, num_splits=splits, out=out, lse=lse, workspace=ws)
    assert_matches_ref(
        out, lse, inputs | {"block_table": None, "cache_leftpad": None}, atol=2e-5 if dtype == torch.float32 else 2e-3
    )


def test_default_split_count_follows_fa2():
    q, k = torch.empty(1, 8, 128), torch.empty(1, 8, 65536, 128)
    assert num_splits_for(q, k) > 1  # one sequence on an H100-sized GPU: FA2 splits the capacity
    assert num_splits_for(torch.empty(64, 8, 128), torch.empty(64, 8, 1024, 128)) == 1  # enough CTAs already


COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flash_decoding import flash_decoding_split_kernel as split, flash_decoding_combine_kernel as combine
for cap in (80, 90):
    for ty in ("fp16", "bf16"):
        for group, block_g in ((1, 16), (8, 16), (32, 32)):
            sig = {n: ("*" + ty if n in ("q_ptr", "k_ptr", "v_ptr") else "*i32" if n == "seqlens_ptr" else
                       "*fp32" if n.startswith("ws_") else "fp32" if n == "scale_log2" else "i32") for n in split.arg_names}
            cx = dict(GROUP=group, BLOCK_G=block_g, HEAD_DIM=128, BLOCK_N=64)
            sig.update({n: "constexpr" for n in cx})
            k = triton.compile(ASTSource(fn=split, signature=sig, constexprs=cx), target=GPUTarget("cuda", cap, 32))
            assert k.asm.get("cubin"), (cap, ty, group)
        sig = {n: ("*fp32" if n.startswith("ws_") or n == "lse_ptr" else "*" + ty if n == "out_ptr" else "i32") for n in combine.arg_names}
        cx = dict(HEAD_DIM=128, BLOCK_S=16)
        sig.update({n: "constexpr" for n in cx})
        assert triton.compile(ASTSource(fn=combine, signature=sig, constexprs=cx), target=GPUTarget("cuda", cap, 32)).asm.get("cubin")
print("COMPILED")
"""


def test_flash_decoding_compiles_for_sm80_and_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE], cwd=bench_dir, env=env, capture_output=True, text=True, timeout=600
    )
    assert "COMPILED" in proc.stdout, proc.stderr[-3000:]


def test_flash_decoding_offsets_are_64_bit():
    """A cache whose batch stride is 2^30 elements (as at 256k tokens x 32 heads x D=128): batch
    index 2 lies 2^31 elements in, past int32. The cache is allocated but only the valid keys are
    touched, so the OS commits a few pages of its 12 GB of address space."""
    batch, capacity, head_dim = 3, 1 << 24, 64  # Hkv = 1: stride(0) = 2^24 * 64 = 2^30
    lens = torch.tensor([3, 0, 5], dtype=torch.int32)
    k, v = (torch.empty(batch, 1, capacity, head_dim, dtype=torch.float16) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    for b in range(batch):
        k[b, :, :8] = torch.randn(1, 8, head_dim, generator=g).half()
        v[b, :, :8] = torch.randn(1, 8, head_dim, generator=g).half()
    q = torch.randn(batch, 4, head_dim, generator=g).half()
    out, lse = flash_decoding(q, k, v, lens, num_splits=1, return_lse=True)
    small = dict(q=q, k_cache=k[:, :, :8].clone(), v_cache=v[:, :, :8].clone(), cache_seqlens=lens, block_table=None)
    assert_matches_ref(out, lse, small, atol=2e-3)
