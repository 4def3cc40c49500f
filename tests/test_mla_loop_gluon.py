"""The Gluon MLA loop experiment (benchmarks/mla_loop_gluon.py) compiled for sm_90 on CPU: the
properties its docstring states, read from the compiled code. Its exactness and time need an sm_90
GPU (tests/gpu/test_mla_loop_gluon_cuda.py, and the script under scripts/gpu_check.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from lean_tp.ops.decode_attention.archs import ARCHS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mla_loop_gluon.py"


def test_the_gluon_mla_loop_compiles_for_sm90_within_its_budget():
    """No local memory anywhere, shared memory within an H100 block's, and a 64-key iteration that
    reads under 5000 bytes of shared memory a key (lean's 64-row loop: 13120, kernel report) with
    both products on wgmma (each warp group's half: 64 x 32 of the score, 64 x 256 of P.V), in
    fewer SASS than lean's 64-row loop takes for 32 keys (670). Compiled in a process of its own:
    after an interpreted launch in the same process, triton 3.7.1 fails to compile a Gluon kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    assert stats["stack_bytes"] == 0 and stats["loop_local"] == 0 and stats["registers"] <= 255, stats
    assert stats["shared_bytes"] <= ARCHS["sm90"].smem_per_block, stats  # the most a block may opt into
    assert 0 < stats["smem_read_per_key"] < 5000, stats
    assert stats["hgmma"] == ["HGMMA.64x256x16.F32.BF16", "HGMMA.64x32x16.F32.BF16"], stats
    assert 0 < stats["loop_sass"] < 670, stats


def _script():
    """The script as a module (its Gluon kernel is not compiled by importing it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mla_loop_gluon", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_lean_is_timed_on_the_gluon_loops_problem():
    """The script times ``lean_tp.decode_attention`` on ``lean_inputs``: the same rows, pages,
    lengths and scale as the Gluon loop, so lean's output matches the loop's float64 reference
    (torch backend: the argument checks are the kernel's; the numbers are the problem's). The pool's
    rows no sequence holds are NaN, as ``paged_problem`` builds it for the GPU test."""
    import torch

    import lean_tp

    script = _script()
    problem = script.paged_problem([0, 37, 64, 130], blocks_per_seq=2, device="cpu")
    assert problem[1].isnan().any()  # the rest of a last page, and the page past every table's end
    ref_out, ref_lse = script.reference(*problem, blocks_per_seq=2)
    out, lse = lean_tp.decode_attention(
        **script.lean_inputs(*problem, blocks_per_seq=2), return_lse=True, backend="torch"
    )
    assert out.shape == (4, 2 * script.ROWS, script.DV)
    torch.testing.assert_close(out.double().reshape(ref_out.shape), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double().reshape(ref_lse.shape), ref_lse, atol=1e-3, rtol=1e-3)


def test_split_partials_combine_into_the_whole_softmax():
    """``combine`` (a Triton kernel: the interpreter runs it here) merges a row block's split
    partials, laid out as the Gluon loop writes them, into attention over all the keys: three
    splits of one sequence's keys, one of them empty (out 0, lse -inf), against float64."""
    import torch

    script = _script()
    torch.manual_seed(0)
    rows, splits, dv = 2 * script.ROWS, 3, script.DV
    q, k, v = torch.randn(rows, 16).double(), torch.randn(150, 16).double(), torch.randn(150, dv).double()
    runs = [(0, 64), (64, 150), (150, 150)]
    part_out = torch.full((rows * splits, dv), float("nan"))
    part_lse = torch.full((rows * splits,), float("nan"))
    for s, (a, b) in enumerate(runs):
        scores = q @ k[a:b].T
        at = (torch.arange(rows) // script.ROWS * splits + s) * script.ROWS + torch.arange(rows) % script.ROWS
        part_out[at] = (scores.softmax(-1) @ v[a:b]).float() if b > a else 0.0
        part_lse[at] = scores.logsumexp(-1).float() if b > a else float("-inf")
    out, lse = torch.full((rows, dv), float("nan")), torch.full((rows,), float("nan"))
    script.combine(part_out, part_lse, splits, out, lse)
    scores = q @ k.T
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
