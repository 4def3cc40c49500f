"""LeanAttention as a vLLM attention backend.

Installing lean_tp registers the backend with vLLM at start-up (the ``vllm.general_plugins``
entry point calls ``register``), so one option selects it::

    vllm serve meta-llama/Llama-3.1-8B-Instruct --attention-backend LEAN
    LLM(model=..., attention_config={"backend": "LEAN"})

MLA models select ``--attention-backend LEAN_MLA`` (``mla.py``: decode on lean over vLLM's latent
cache, prefill on vLLM's MLA path). Decode requests (1 to ``MAX_QUERY_TOKENS`` query tokens each,
all of one length: speculative decoding's verification included; under ``VLLM_BATCH_INVARIANT=1``
of any mix of lengths up to vLLM's reorder threshold, one lean call per length, each verified
token with the bits of its one-token decode) run on ``lean_tp.decode_attention`` over vLLM's
paged cache; prefill and mixed chunks go to vLLM's own Triton attention, which reads and writes
the same cache.
``backend.py`` has the classes, ``cpu.py`` the plain-torch stand-ins used where vLLM runs no
Triton (its CPU build). docs/vllm.md covers options, coverage and benchmarking.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

NAME = "LEAN"
BACKEND_CLASS = "lean_tp.integrations.vllm.backend.LeanAttentionBackend"
# MLA models (DeepSeek-V2/V3, Kimi-K2): decode on lean in vLLM's MLA common backend (mla.py).
MLA_NAME = "LEAN_MLA"
MLA_BACKEND_CLASS = "lean_tp.integrations.vllm.mla.LeanMLABackend"
# A backend that LEAN replaces in every vLLM process (engine core, tensor-parallel workers), for
# platforms that ignore --attention-backend: vLLM's CPU platform always picks CPU_ATTN.
IN_PLACE_OF_ENV = "LEAN_TP_VLLM_IN_PLACE_OF"


def register() -> str:
    """Register ``"LEAN"`` and ``"LEAN_MLA"`` with vLLM's attention-backend registry, and put the
    one of the same kind (MLA or not) in place of the backend ``LEAN_TP_VLLM_IN_PLACE_OF`` names,
    if set. Idempotent (vLLM calls plugins once per process; tests and users may call it again).
    Returns ``"LEAN"``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, cls in ((NAME, BACKEND_CLASS), (MLA_NAME, MLA_BACKEND_CLASS)):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, cls)
    replaced = os.environ.get(IN_PLACE_OF_ENV)
    if replaced:
        if replaced not in AttentionBackendEnum.__members__ or replaced in (NAME, MLA_NAME):
            raise ValueError(
                f"{IN_PLACE_OF_ENV}: expected a vLLM attention backend such as CPU_ATTN or CPU_MLA, got {replaced!r}"
            )
        mla = AttentionBackendEnum[replaced].get_class().is_mla()
        register_backend(AttentionBackendEnum[replaced], MLA_BACKEND_CLASS if mla else BACKEND_CLASS)
    return NAME


@contextmanager
def in_place_of(backend: str = "CPU_ATTN") -> Iterator[None]:
    """Run LEAN (LEAN_MLA for an MLA backend such as CPU_MLA) wherever vLLM picks ``backend``, for
    engines created inside the block, in this process and in the processes it starts (which
    inherit ``LEAN_TP_VLLM_IN_PLACE_OF``)."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    previous = os.environ.get(IN_PLACE_OF_ENV)
    os.environ[IN_PLACE_OF_ENV] = backend
    try:
        register()
        # vLLM caches each layer's backend choice for the process: forget it on entry and on exit.
        selector._cached_get_attn_backend.cache_clear()
        yield
    finally:
        AttentionBackendEnum[backend].clear_override()
        if previous is None:
            os.environ.pop(IN_PLACE_OF_ENV, None)
        else:
            os.environ[IN_PLACE_OF_ENV] = previous
            register()
        selector._cached_get_attn_backend.cache_clear()
