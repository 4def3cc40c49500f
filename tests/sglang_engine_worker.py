"""SGLang's engine on CPU: greedy tokens of a small random Llama (``examples/vllm_generate.py``'s)
with ``--attention-backend lean`` and with ``torch_native``, printed as JSON (``test_integrations_sglang.py`` runs this in a
subprocess; the engine starts its scheduler in processes of its own, so it needs a __main__).

Four prompts share a 40-token prefix, so SGLang's radix cache (on by default) serves the later
ones' prefix from the first's pages. SGLang's CPU model path imports ``vllm._custom_ops
.rotary_embedding``; ``sglang_cpu_stubs`` has it in plain torch.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "sglang_cpu_stubs"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from vllm_generate import save_random_model  # noqa: E402  (the vLLM tests' small random Llama)

PREFIX = [(3 * n) % 500 + 1 for n in range(40)]
PROMPTS = [PREFIX + [(7 * i + n) % 500 + 1 for n in range(5 + 9 * i)] for i in range(4)]


def generate(path: str, backend: str) -> dict:
    import sglang

    engine = sglang.Engine(
        model_path=path,
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        disable_overlap_schedule=True,
        mem_fraction_static=0.05,
        log_level="error",
    )
    try:
        # One request first, so that the radix cache holds the shared prefix for the rest.
        params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        outs = [engine.generate(input_ids=PROMPTS[0], sampling_params=params)]
        outs += engine.generate(input_ids=PROMPTS[1:], sampling_params=params)
    finally:
        engine.shutdown()
    return {
        "tokens": [o["output_ids"] for o in outs],
        "cached": [o["meta_info"].get("cached_tokens", 0) for o in outs],
    }


if __name__ == "__main__":
    model = save_random_model(sys.argv[1], "llama")
    print(json.dumps({backend: generate(model, backend) for backend in ("torch_native", "lean")}))
