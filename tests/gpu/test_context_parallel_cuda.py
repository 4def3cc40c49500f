"""CUDA tests of context parallelism's per-rank partials on the Triton kernel: C simulated ranks
merged against the float64 reference, and one rank's partial plus the merge captured in a CUDA graph
and replayed with new lengths (no host sync on the CP decode path). The collective itself runs
under gloo in tests/test_decode_tp.py; NCCL needs one GPU per rank.

Skipped without a CUDA device; ``python scripts/gpu_check.py`` runs them.
"""

import pytest
import torch
from test_context_parallel import shard_cache, simulate_cp
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

from lean_tp.distributed.cp import ContextShard, local_partial
from lean_tp.ops.merge_attention import merge_attention

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (python scripts/gpu_check.py runs it on a GPU)", allow_module_level=True)

LENS = [0, 1, 17, 300, 5000]
CASES = {
    "C8-Tq1": (8, dict()),
    "C4-Tq4-window100-sinks": (4, dict(tq=4, window=100, sinks=True)),
    "C2-Tq3-fp8-softcap": (2, dict(tq=3, cache_dtype=torch.float8_e4m3fn, per_head_scale=True, softcap=10.0)),
}


def _cuda(inputs: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_partials_on_the_kernel_merge_to_the_unsharded_result(case):
    size, features = CASES[case]
    inputs = make_feature_inputs(LENS, 32, 8, 128, torch.bfloat16, seed=len(case), **features)
    out, lse = simulate_cp(_cuda(inputs), size, 16, backend="auto")
    assert_matches_feature_ref(out, lse, inputs, 2e-2, lse_atol=1e-3, lse_rtol=1e-4)


@torch.inference_mode()
def test_rank_partial_and_merge_replay_in_a_cuda_graph():
    inputs = _cuda(make_feature_inputs([5, 700, 3000], 16, 4, 128, torch.bfloat16, tq=2, window=500, seed=2))
    shards = [ContextShard(2, r) for r in range(2)]
    caches = [(shard_cache(inputs["k_cache"], s), shard_cache(inputs["v_cache"], s)) for s in shards]
    seqlens = inputs["cache_seqlens"].clone()

    def step():
        parts = [local_partial(inputs["q"], k, v, seqlens, s, window=500) for s, (k, v) in zip(shards, caches)]
        return merge_attention(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = step()
    for new in ([5, 700, 3000], [2, 64, 1000], [0, 700, 3004]):
        seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        want = step()
        torch.testing.assert_close(static_out, want[0], atol=0, rtol=0)
        torch.testing.assert_close(static_lse, want[1], atol=0, rtol=0)
