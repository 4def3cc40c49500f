"""CUDA test of the Gluon MLA loop experiment (benchmarks/mla_loop_gluon.py) on sm_90: against
float64, ragged lengths around its 64-key block (0 to 4099) in one launch, two 64-row blocks a
sequence, whole or split over programs, on shuffled 64-row pages whose rows no sequence holds
are NaN (the rest of a last page must be neither read into a score nor multiplied into the
output).

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


@pytest.mark.parametrize("splits", [1, 3])
def test_gluon_mla_loop_matches_float64(splits):
    """Every length in one launch, whole or each sequence's blocks split over 3 programs (some
    splits of the short ones empty) and combined: out and lse start as NaN, so a row no program
    stores fails."""
    lens = [0, 1, 63, 64, 65, 1000, 4099]
    q, pool, seqlens, table = mla_loop_gluon.paged_problem(lens, blocks_per_seq=2, seed=splits)
    out, lse = mla_loop_gluon.mla_loop(q, pool, seqlens, table, blocks_per_seq=2, splits=splits)
    ref_out, ref_lse = mla_loop_gluon.reference(q, pool, seqlens, table, blocks_per_seq=2)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)
