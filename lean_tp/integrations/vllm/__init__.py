"""LeanAttention as a vLLM attention backend.

Installing lean_tp registers the backend with vLLM at start-up (the ``vllm.general_plugins``
entry point calls ``register``), so one option selects it::

    vllm serve meta-llama/Llama-3.1-8B-Instruct --attention-backend LEAN
    LLM(model=..., attention_config={"backend": "LEAN"})

Decode requests (1 to ``MAX_QUERY_TOKENS`` query tokens each, all of one length: speculative
decoding's verification included) run on ``lean_tp.decode_attention`` over vLLM's paged cache;
prefill and mixed chunks go to vLLM's own Triton attention, which reads and writes the same cache.
``backend.py`` has the classes, ``cpu.py`` the plain-torch stand-ins used where vLLM runs no
Triton (its CPU build). docs/vllm.md covers options, coverage and benchmarking.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

NAME = "LEAN"
BACKEND_CLASS = "lean_tp.integrations.vllm.backend.LeanAttentionBackend"


def register() -> str:
    """Register ``"LEAN"`` with vLLM's attention-backend registry (idempotent: vLLM calls plugins
    once per process, tests and users may call it again); returns ``"LEAN"``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, BACKEND_CLASS)
    return NAME


@contextmanager
def in_place_of(backend: str = "CPU_ATTN") -> Iterator[None]:
    """Run LEAN wherever vLLM picks ``backend``, for engines created in this process inside the
    block (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in-process). vLLM's CPU platform
    always picks ``CPU_ATTN`` and ignores ``--attention-backend``: this is how LEAN runs there."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum[backend]
    register_backend(member, BACKEND_CLASS)
    # vLLM caches each layer's backend choice for the process: forget it on entry and on exit.
    selector._cached_get_attn_backend.cache_clear()
    try:
        yield
    finally:
        member.clear_override()
        selector._cached_get_attn_backend.cache_clear()
