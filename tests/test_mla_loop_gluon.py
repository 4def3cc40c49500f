"""The Gluon MLA loop experiment (benchmarks/mla_loop_gluon.py) compiled for sm_90 on CPU: the
properties its docstring states, read from the compiled code. Its exactness and time need an sm_90
GPU (tests/gpu/test_mla_loop_gluon_cuda.py, and the script under scripts/gpu_check.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mla_loop_gluon  # noqa: E402

from lean_tp.tools.kernel_report.sass import dump, kv_loop_of_sass, kv_smem_read_bytes, resources  # noqa: E402

H100_SHARED_BYTES = 232448  # the most dynamic shared memory a block may take on sm_90


def test_the_gluon_mla_loop_compiles_for_sm90_within_its_budget():
    """No local memory anywhere, shared memory within an H100 block's, and a 64-key iteration that
    reads under 5000 bytes of shared memory a key (lean's 64-row loop: 13120, kernel report) with
    the score and P.V products on wgmma (two HGMMA shapes: 64 x 32 for the score, 64 x 256 for P.V,
    each warp group's half)."""
    kernel = mla_loop_gluon.compile_sm90()
    regs, stack, _ = resources(kernel.asm["cubin"])
    sass = dump(kernel.asm["cubin"], "-sass")
    instructions, local = kv_loop_of_sass(sass)
    assert stack == 0 and local == 0 and regs <= 255, (regs, stack, local)
    assert kernel.metadata.shared <= H100_SHARED_BYTES, kernel.metadata.shared
    assert 0 < kv_smem_read_bytes(sass, 8) / mla_loop_gluon.BLOCK_N < 5000
    assert {"HGMMA.64x32x16.F32.BF16", "HGMMA.64x256x16.F32.BF16"} <= set(sass.split())
    assert 0 < instructions < 670, instructions  # lean's 64-row loop: 670 SASS for half the keys
