"""CUDA test of the Gluon MLA kernel (``lean_tp.ops.mla_gluon``) on sm_90, against float64: ragged
lengths around its 64-key tile (0 to 4099) in one launch, on shuffled 64-row pages whose rows no
sequence holds are NaN (the rest of a last page must be neither read into a score nor multiplied
into the output), with 64 and 128 heads and 1 to 4 query tokens, over grids that leave outputs
whole or split them over programs (the merge), from 16-bit and e4m3 pools; and
``lean_tp.decode_attention`` routing DP attention's calls there (``gluon_takes``), eager, compiled
and replayed from a CUDA graph, and its e4m3 calls where the e4m3 entry is set to route them.

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
@pytest.mark.parametrize("overlap", [False, True])
def test_mla_decode_gluon_matches_float64(heads, tq, num_programs, overlap):
    """Every length in one launch: on 2 programs each holds many outputs, on 16 some outputs span
    several programs, on every SM most are split; with Tq query tokens (MTP), each token sees the
    keys up to its own position (none for the first tokens at length 1; 65 hides keys of two
    tiles from the first of 4). Nothing is prefilled: the kernel and the merge write every value
    (NaN pages would show in any row computed from them). Both 16-bit loops: the serial one and
    the overlapped one (``launcher.OVERLAP``)."""
    lens = [0, 1, 63, 64, 65, 1000, 4099, 130]
    q, pool, seqlens, table = mla_decode_gluon.paged_problem(lens, heads=heads, seed=heads + tq, tq=tq)
    out, lse = decode(q, pool, seqlens, table, num_programs=num_programs, overlap=overlap)
    ref_out, ref_lse = mla_decode_gluon.reference(q, pool, seqlens, table)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("heads,tq", [(128, 1), (64, 2)])
@pytest.mark.parametrize("num_programs", [2, None])
def test_mla_decode_gluon_reads_an_e4m3_pool(heads, tq, num_programs):
    """The same lengths from an e4m3 pool (NaN past every sequence's end, as above), its blocks
    converted to bf16 in shared memory: k_scale in the score and v_scale in the output (two values,
    so a scale on the wrong product fails), whole and split outputs."""
    lens = [0, 1, 63, 64, 65, 1000, 4099, 130]
    problem = mla_decode_gluon.paged_problem(lens, heads=heads, seed=heads + tq, tq=tq, fp8=True)
    assert problem[1].dtype == torch.float8_e4m3fn
    out, lse = decode(*problem, num_programs=num_programs, **mla_decode_gluon.fp8_scales(problem[1]))
    ref_out, ref_lse = mla_decode_gluon.reference(*problem)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("heads,tq,fp8", [(128, 1, False), (64, 1, False), (64, 2, False), (128, 1, True)])
def test_decode_attention_runs_routed_calls_on_the_gluon_kernel(heads, tq, fp8, monkeypatch):
    """A call sm_90's entry routes (64 rows or more: 128 heads, or Kimi-K2's 64 of 1 or 2 tokens)
    matches float64; compiled with ``fullgraph=True`` and replayed from a CUDA graph it gives the
    same bits; ``opcheck`` passes on the kernel itself. An e4m3 call with the e4m3 entry set to
    route 128 rows (the table leaves it unset until this kernel is timed) does the same at the
    problem's k and v scales (``opcheck`` without its schema test, which perturbs the inputs
    arithmetically: torch has no e4m3 kernels for it; the 16-bit cases check the schema)."""
    from dataclasses import replace

    import lean_tp
    from lean_tp.ops.decode_attention.launcher import plan_decode
    from lean_tp.ops.decode_attention.tuning import TUNING_TABLE

    if fp8:
        entry = ("sm90", 576, 1)
        monkeypatch.setitem(TUNING_TABLE, entry, replace(TUNING_TABLE[entry], gluon_rows=128))
    lens = [0, 1, 63, 64, 65, 1000, 4099, 130]
    problem = mla_decode_gluon.paged_problem(lens, heads=heads, seed=7, tq=tq, fp8=fp8)
    inputs = mla_decode_gluon.lean_inputs(*problem)
    assert plan_decode(**inputs, softmax_scale=576**-0.5).gluon

    def call():
        return lean_tp.decode_attention(**inputs, return_lse=True)

    out, lse = call()
    ref_out, ref_lse = mla_decode_gluon.reference(*problem)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)
    compiled = torch.compile(call, fullgraph=True, dynamic=False)()
    assert torch.equal(compiled[0], out) and torch.equal(compiled[1], lse)
    captured = _replayed(call)
    assert torch.equal(captured[0], out) and torch.equal(captured[1], lse)
    q, _, seqlens, table = problem
    scales = mla_decode_gluon.fp8_scales(problem[1])
    args = (q, inputs["k_cache"], seqlens, table, 576**-0.5, *scales.values())
    skip_schema = dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.lean_tp.mla_decode_gluon, args, **(skip_schema if fp8 else {}))


def _replayed(call):
    """What ``call`` returns captured in a CUDA graph (warmed up outside it) and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    return captured
