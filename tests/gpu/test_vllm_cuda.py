"""CUDA tests of the vLLM backend: a mixed batch with lean's Triton kernel on the decodes and vLLM's
Triton attention (the delegate) on the rest, against float64; and a decode batch captured in a CUDA
graph, as vLLM's UNIFORM_BATCH capture does, then replayed with new lengths.

Skipped without a CUDA device or without vLLM (the GPU machine of ``scripts/gpu_check.py`` has no
package index, so vLLM is there only if its image has it).
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (python scripts/gpu_check.py runs it on a GPU)", allow_module_level=True)
pytest.importorskip("vllm")

from test_integrations_vllm import GPU_TEST_MODEL, check, engine_config, forward, make_case  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """An engine's config for a Llama with the heads and head size below: the Triton delegate's
    builder reads them (test_gpu_classes_build_from_an_engines_config builds it on CPU)."""
    config = engine_config(str(tmp_path_factory.mktemp("llama")), LlamaConfig(**GPU_TEST_MODEL))
    with set_current_vllm_config(config):
        yield config


DECODES = [(c, 1) for c in (0, 1, 15, 16, 17, 3000)]


@pytest.mark.parametrize(
    "features", [dict(), dict(window=100, use_sinks=True), dict(softcap=20.0, kv_cache_dtype="fp8")]
)
def test_mixed_batch_on_the_kernel_and_the_delegate(vllm_config, features):
    case = make_case(
        vllm_config,
        DECODES + [(40, 70), (0, 300)],
        dtype=torch.bfloat16,
        heads=(32, 4),
        head_size=128,
        device="cuda",
        **features,
    )
    assert case.impl.delegate is not None and case.metadata.prefill is not None
    check(forward(case), case.ref, torch.bfloat16)


@torch.inference_mode()
def test_decode_batch_replays_from_a_cuda_graph(vllm_config):
    """Captured with every length 1 and another query (as vLLM captures), replayed with the real
    ones copied into the same buffers: the graph reads lengths and queries at replay."""
    case = make_case(vllm_config, DECODES, dtype=torch.bfloat16, heads=(32, 4), head_size=128, device="cuda")
    assert case.metadata.prefill is None
    query, seq_lens = case.query.clone(), case.metadata.seq_lens.clone()
    case.metadata.seq_lens.fill_(1)
    case.query.normal_()
    output = torch.full_like(case.query, float("nan"))

    def run():
        return case.impl.forward(case.layer, case.query, case.k_new, case.v_new, case.kv_cache, case.metadata, output)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    case.metadata.seq_lens.copy_(seq_lens)
    case.query.copy_(query)
    output.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(output, case.ref, torch.bfloat16)
