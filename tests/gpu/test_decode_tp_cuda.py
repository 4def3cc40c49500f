"""CUDA tests of the decode loop: a decode step captured in a CUDA graph and replayed over growing
lengths matches eager, and the compiled (reduce-overhead, fullgraph) loop matches eager.

Skipped without a CUDA device; ``python scripts/gpu_check.py`` runs them.
"""

from dataclasses import replace

import pytest
import torch
from example_utils import make_prompts

from lean_tp.generate import decode_one, generate
from lean_tp.model import CONFIGS, build_model
from lean_tp.weights import init_random_weights

if not torch.cuda.is_available():  # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device (python scripts/gpu_check.py runs it on a GPU)", allow_module_level=True)

ARGS = replace(CONFIGS["tiny"], n_heads=16, n_kv_heads=4, dim=2048, head_dim=128, max_seq_len=8192)  # group 4


def _model(dtype, batch, capacity):
    model = build_model(ARGS)
    init_random_weights(model, 0, "cuda", dtype, std=0.05)
    model.setup_caches(batch, capacity)
    return model.eval()


@torch.inference_mode()
def test_cuda_graph_replay_over_growing_lengths_matches_eager():
    lens, steps = [1, 255, 3000], 300  # crosses many tile boundaries and grid re-splits
    graphed, eager = _model(torch.bfloat16, 3, 3400), _model(torch.bfloat16, 3, 3400)
    prompt = make_prompts(lens, ARGS.vocab_size, 0, torch.device("cuda"))
    pos = torch.tensor(lens, dtype=torch.int32, device="cuda")
    tokens = eager.prefill(prompt, pos).argmax(-1)
    graphed.prefill(prompt, pos)
    static_tokens, static_pos = tokens.clone(), pos.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compile, autotune caches) off the capture stream
        graphed.decode_step(static_tokens, static_pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = graphed.decode_step(static_tokens, static_pos)
    for _ in range(steps):
        static_tokens.copy_(tokens)
        static_pos.copy_(pos)
        graph.replay()
        ref = eager.decode_step(tokens, pos)
        torch.testing.assert_close(static_logits.float(), ref.float(), atol=3e-2, rtol=3e-2)
        tokens, pos = ref.argmax(-1), pos + 1


@torch.inference_mode()
def test_compiled_reduce_overhead_loop_matches_eager():
    lens = [7, 700, 1500, 64]
    model = _model(torch.float32, 4, 1700)
    prompt = make_prompts(lens, ARGS.vocab_size, 1, torch.device("cuda"))
    ref = generate(model, prompt, lens, 64)
    torch._dynamo.reset()
    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    generate(model, prompt, lens, 4, step=step)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = generate(model, prompt, lens, 64, step=step)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
