"""CUDA test of the Gluon MLA loop experiment (benchmarks/mla_loop_gluon.py) on sm_90: against
float64, for lengths around its 64-key block and two sequences of two 64-row blocks each, so a
block that reads past its sequence's end masks the next sequence's rows and the last one TMA's
zero fill.

Skipped without an sm_90 device; ``python scripts/gpu_check.py`` runs it on a GPU.
"""

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm_90 device (the kernel is Hopper's: TMA and wgmma)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mla_loop_gluon  # noqa: E402


def test_gluon_mla_loop_matches_float64():
    """Every length in one case, shortest first: the kernel has never run, and a launch that hangs
    then costs one case's timeout, not one per length."""
    for n_keys in (1, 63, 64, 65, 1000, 4099):
        torch.manual_seed(n_keys)
        q = torch.randn(4 * 64, 576, device="cuda").bfloat16()
        cache = torch.randn(2 * n_keys, 576, device="cuda").bfloat16()
        out, lse = mla_loop_gluon.mla_loop(q, cache, n_keys, blocks_per_seq=2)
        ref_out, ref_lse = mla_loop_gluon.reference(q, cache, n_keys, blocks_per_seq=2)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0, msg=lambda m: f"{n_keys} keys: {m}")
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4, msg=lambda m: f"{n_keys} keys: {m}")
