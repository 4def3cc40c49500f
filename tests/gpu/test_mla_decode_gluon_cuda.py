"""CUDA test of the Gluon MLA kernel (``lean_tp.ops.mla_gluon``) on sm_90, against float64: ragged
lengths around its 64-key tile (0 to 4099) in one launch, on shuffled 64-row pages whose rows no
sequence holds are NaN (the rest of a last page must be neither read into a score nor multiplied
into the output), with 64 and 128 heads and 1 to 4 query tokens, over grids that leave outputs
whole or split them over programs (the merge).

Skipped without an sm_90 device; ``python scripts/gpu_check.py`` runs it on a GPU.
"""

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm_90 device (the kernel is Hopper's: TMA and wgmma)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mla_decode_gluon  # noqa: E402

from lean_tp.ops.mla_gluon import mla_decode_gluon as decode  # noqa: E402


@pytest.mark.parametrize("heads,tq", [(64, 1), (128, 1), (128, 2), (64, 4)])
@pytest.mark.parametrize("num_programs", [2, 16, None])
def test_mla_decode_gluon_matches_float64(heads, tq, num_programs):
    """Every length in one launch: on 2 programs each holds many outputs, on 16 some outputs span
    several programs, on every SM most are split; with Tq query tokens (MTP), each token sees the
    keys up to its own position (none for the first tokens at length 1; 65 hides keys of two
    tiles from the first of 4). Nothing is prefilled: the kernel and the merge write every value
    (NaN pages would show in any row computed from them)."""
    lens = [0, 1, 63, 64, 65, 1000, 4099, 130]
    q, pool, seqlens, table = mla_decode_gluon.paged_problem(lens, heads=heads, seed=heads + tq, tq=tq)
    out, lse = decode(q, pool, seqlens, table, num_programs=num_programs)
    ref_out, ref_lse = mla_decode_gluon.reference(q, pool, seqlens, table)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)
