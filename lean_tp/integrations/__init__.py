"""Drop-in integrations: Hugging Face transformers (``transformers.py``), DeepSpeed inference
(``deepspeed.py``) and the vLLM and SGLang attention backends (``vllm/``, ``sglang/``). Each is
imported on demand, so lean_tp needs none of those packages installed."""

from __future__ import annotations

import os

from lean_tp.ops.decode_attention.checks import BACKENDS


def op_backend_from_env(env: str) -> str:
    """The op backend a serving engine's decode runs on, from the environment variable ``env``:
    "auto" (the default: Triton on CUDA, torch on CPU), "triton" or "torch"."""
    value = os.environ.get(env, "auto")
    if value not in BACKENDS:
        raise ValueError(f"{env}: expected one of {BACKENDS}, got {value!r}")
    return value
