"""DeepSpeed inference (AutoTP tensor parallelism) with LeanAttention inside each rank.

    from lean_tp.integrations.deepspeed import init_inference
    engine = init_inference(model, tp_size=int(os.environ["WORLD_SIZE"]), dtype=torch.bfloat16)

AutoTP shards each decoder layer's linear layers by the injection policy; every rank's attention
then sees only its own heads, and transformers' "lean" attention runs ``lean_tp.decode_attention``
on them (the kernel reads head counts from tensor shapes, never from the config, which still holds
the global counts). Kernel injection is not used: it would replace the whole layer, attention
included, and does not exist on CPU.

On CPU, DeepSpeed's pitfalls are handled here: ``LOCAL_SIZE`` is set from
torchrun's ``LOCAL_WORLD_SIZE`` before DeepSpeed's shared-memory all-reduce starts (it segfaults
without it), fp16 is rejected with a clear error, and the ``/dev/shm`` buffers that all-reduce
leaves behind are removed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import io
import os
from typing import Any

import torch
from torch import nn

from lean_tp.integrations.transformers import register

# Row-parallel linears (their outputs are all-reduced) that AutoTP needs named, per sub-module.
ATTENTION_OUTPUTS = ("self_attn.o_proj", "self_attn.dense", "attn.o_proj")
MLP_OUTPUTS = ("mlp.down_proj", "mlp.fc2", "mlp.dense_4h_to_h")
SHM_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"


def _decoder_layer(model: nn.Module) -> tuple[type, nn.Module]:
    """The decoder-layer class, from transformers' ``_no_split_modules``, and one instance of it."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module), module
    raise ValueError(
        f"model: expected a transformers model whose _no_split_modules names its decoder layer, got "
        f"{type(model).__name__} with _no_split_modules={sorted(names) or None}"
    )


def injection_policy(model: nn.Module) -> dict[type, tuple[str, ...]]:
    """DeepSpeed AutoTP policy ``{DecoderLayer: (attention output, MLP output)}``, found on the model,
    e.g. ``{LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}``."""
    layer_cls, layer = _decoder_layer(model)
    linears = {name for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    found = tuple(next((n for n in options if n in linears), None) for options in (ATTENTION_OUTPUTS, MLP_OUTPUTS))
    if None in found:
        raise ValueError(
            f"model: cannot map {layer_cls.__name__} to an AutoTP policy: expected an attention output in "
            f"{ATTENTION_OUTPUTS} and an MLP output in {MLP_OUTPUTS}, got linear layers {sorted(linears)}"
        )
    return {layer_cls: found}


def check_tp_heads(config: Any, tp_size: int) -> None:
    """Reject tensor-parallel sizes that would leave a rank without KV heads (AutoTP splits by KV head)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size: expected a positive integer, got {tp_size!r}")
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    if n_kv < tp_size:
        raise ValueError(
            f"tp_size: expected at most num_key_value_heads={n_kv} ranks (num_attention_heads={n_heads}), "
            f"got tp_size={tp_size}: AutoTP splits attention by KV head, so some ranks would hold none"
        )


def _model_dtype(model: nn.Module, kwargs: dict) -> torch.dtype:
    dtype = kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def _remove_shm_buffers() -> None:
    """Remove this rank's DeepSpeed CPU all-reduce buffer (named by uid, MASTER_ADDR, port and rank)."""
    addr, port, rank = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    for path in glob.glob(f"{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def init_inference(model: nn.Module, tp_size: int, **kwargs: Any):
    """Switch ``model`` to lean attention, apply the CPU pitfalls, and return
    ``deepspeed.init_inference(model, tensor_parallel={"tp_size": tp_size}, injection_policy=...)``.

    Other keyword arguments go to ``deepspeed.init_inference`` (``dtype`` among them).
    """
    check_tp_heads(model.config, tp_size)
    policy = injection_policy(model)
    on_cpu = not torch.cuda.is_available()
    dtype = _model_dtype(model, kwargs)
    if on_cpu and dtype == torch.float16:
        raise ValueError(
            "dtype: expected torch.float32 or torch.bfloat16 on CPU (DeepSpeed rejects fp16 there), got torch.float16"
        )
    if on_cpu:
        # Must precede DeepSpeed's first all-reduce, which sizes its shared memory from it.
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(tp_size)))
        # Named, DeepSpeed does not guess it and warn once per rank that it guessed.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        atexit.register(_remove_shm_buffers)
    import deepspeed

    model.set_attn_implementation(register())
    kwargs.setdefault("dtype", dtype)
    # DeepSpeed prints its op-build banners on stdout once per rank: rank 0's copy is enough.
    quiet = os.environ.get("RANK", "0") != "0"
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return deepspeed.init_inference(
            model,
            tensor_parallel={"tp_size": tp_size},
            replace_with_kernel_inject=False,
            injection_policy=policy,
            **kwargs,
        )
