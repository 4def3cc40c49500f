"""LeanAttention as an SGLang attention backend.

Installing lean_tp registers the backend with SGLang in every SGLang process (the
``sglang.srt.plugins`` entry point calls ``register``), so one option selects it::

    python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct --attention-backend lean
    sglang.Engine(model_path=..., attention_backend="lean")

Decode batches and speculative decoding's chain verification (1 to ``MAX_QUERY_TOKENS`` tokens
per request; any number under deterministic inference, each verified token with the bits of its
one-token decode) run on ``lean_tp.decode_attention`` over SGLang's token-to-KV pool; prefill, tree
verification and every other mode go to SGLang's own Triton backend on GPUs and its torch-native
backend on CPU, which read and write the same pool. ``backend.py`` has the class; docs/sglang.md
covers options, coverage and benchmarking.
"""

from __future__ import annotations

NAME = "lean"


def register() -> str:
    """Register ``"lean"`` with SGLang's attention-backend registry and its ``--attention-backend``
    choices, deterministic inference included (decode then runs the op's batch-invariant mode),
    with the radix cache: a decode's bits depend only on the cache's rows and the request's
    length, and prefill runs on SGLang's Triton backend, which SGLang lists as radix-safe.
    Idempotent. Returns ``"lean"``."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND,
        add_attention_backend_choices,
        add_deterministic_attention_backend_choices,
        add_radix_supported_deterministic_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if NAME not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        add_deterministic_attention_backend_choices([NAME])
    if NAME not in RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        add_radix_supported_deterministic_attention_backend_choices([NAME])
    return NAME


def create_backend(model_runner):
    """The backend for one SGLang model runner (SGLang calls this for ``--attention-backend lean``)."""
    from lean_tp.integrations.sglang.backend import LeanAttnBackend

    return LeanAttnBackend(model_runner)
