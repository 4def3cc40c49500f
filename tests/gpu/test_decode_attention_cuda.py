"""CUDA tests of the decode kernel: correctness incl. bf16 and D=256, CUDA graphs, determinism, compile.

Skipped without a CUDA device; ``python scripts/gpu_check.py`` runs them with the sanitizers and
the benchmark whenever a GPU is available.
"""

import pytest
import torch
from helpers import LAYOUTS, assert_matches_ref, make_inputs

import lean_tp
from lean_tp.ops.decode_attention.launch_args import counters_size
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, plan_decode
from lean_tp.ops.decode_attention.tuning import get_config

if not torch.cuda.is_available():  # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device (python scripts/gpu_check.py runs it on a GPU)", allow_module_level=True)

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float16, torch.bfloat16]


def _lens(tile):
    return {
        "edges": [0, 1, tile - 1, tile, tile + 1],
        "ragged": [2000, 3, 0, 2 * tile + 1, 777],
        "long": [32768, 100, 16000],
    }


@pytest.mark.parametrize("lens_name", ["edges", "ragged", "long"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2), (8, 1), (32, 8), (64, 1)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_decode_attention_cuda(dtype, head_dim, hq, hkv, layout, lens_name):
    tile = get_config(torch.device("cuda"), head_dim, dtype).tile_n
    inputs = make_inputs(_lens(tile)[lens_name], hq, hkv, head_dim, dtype, layout, device="cuda", seed=hq + head_dim)
    out = torch.full_like(inputs["q"], float("nan"))
    lse = torch.full(inputs["q"].shape[:2], float("nan"), device="cuda")
    out, lse = decode_attention_fwd(**inputs, softmax_scale=head_dim**-0.5, out=out, lse=lse)
    assert_matches_ref(out, lse, inputs, atol=ATOL[dtype])


@pytest.mark.parametrize("num_programs", [1, 3, 7, 1000])
def test_decode_attention_cuda_forced_grids(num_programs):
    inputs = make_inputs([5000, 0, 129, 1], 32, 8, 128, torch.float16, "paged16", device="cuda", seed=num_programs)
    out, lse = decode_attention_fwd(**inputs, softmax_scale=128**-0.5, num_programs=num_programs)
    assert_matches_ref(out, lse, inputs, atol=ATOL[torch.float16])


def test_grid_is_sm_count_times_occupancy():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs = make_inputs([100], 32, 8, 128, torch.float16, "paged16", device="cuda", seed=0)
    grid = plan_decode(**inputs).num_programs
    assert grid % sms == 0 and grid >= sms


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_cuda_graph_replay_with_new_lengths(layout):
    inputs = make_inputs([4000, 300, 0, 1], 32, 8, 128, torch.bfloat16, layout, device="cuda", capacity=8192, seed=1)
    if layout == "paged16":  # map every page so any new length is valid
        pages = inputs["k_cache"].shape[0]
        inputs["block_table"] = torch.randperm(pages, device="cuda")[: 4 * 512].view(4, 512).int()
    static = dict(inputs)
    lean_tp.decode_attention(**static)  # warm up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = lean_tp.decode_attention(**static, return_lse=True)
    for new in ([1, 8192, 77, 0], [0, 0, 0, 0], [129, 4096, 5000, 3]):
        static["cache_seqlens"].copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_ref(out.clone(), lse.clone(), static, atol=ATOL[torch.bfloat16])


def test_bitwise_deterministic():
    inputs = make_inputs([30000, 77, 4096, 129], 32, 8, 128, torch.float16, "paged16", device="cuda", seed=2)
    first = lean_tp.decode_attention(**inputs, return_lse=True)
    for _ in range(20):
        again = lean_tp.decode_attention(**inputs, return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_counters_left_at_zero():
    inputs = make_inputs([3000, 2000], 8, 2, 128, torch.float16, device="cuda", seed=3)
    counters = torch.zeros(counters_size(17), dtype=torch.int32, device="cuda")
    for _ in range(3):
        out, lse = decode_attention_fwd(**inputs, softmax_scale=128**-0.5, num_programs=17, counters=counters)
        assert (counters == 0).all()
    assert_matches_ref(out, lse, inputs, atol=ATOL[torch.float16])


def test_compile_fullgraph_cuda_sees_triton_kernel():
    inputs = make_inputs([3000, 0, 33], 32, 8, 128, torch.float16, "paged16", device="cuda", seed=4)

    def step(q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad):
        out = lean_tp.decode_attention(
            q, k_cache, v_cache, cache_seqlens, block_table=block_table, cache_leftpad=cache_leftpad
        )
        return out * 2

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(**inputs), step(**inputs), atol=0, rtol=0)
    from torch._inductor.utils import run_and_get_code

    _, code = run_and_get_code(compiled, **inputs)
    assert any("decode_attention_fwd_kernel" in c for c in code), "Inductor did not see the Triton kernel"
