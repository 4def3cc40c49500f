"""Weights for ``lean_tp.model``: seeded random ones, or a Hugging Face checkpoint directory.

Both work on a meta model that may already be sharded: each parameter is produced whole (random)
or read as a slice (safetensors), then narrowed to the rank's ``Shard``. Random weights depend only
on the seed and the parameter's name, so a sharded model holds exactly the slices of the
single-process one, which is what lets ``--check`` compare tensor parallelism against one process.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from lean_tp.model import ModelArgs, RopeScaling, Transformer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3")


def materialize(model: Transformer, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give a meta model uninitialised storage of ``dtype`` on ``device`` (no fp32 detour)."""
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()


def init_random_weights(
    model: Transformer, seed: int, device: torch.device | str, dtype: torch.dtype, std: float = 0.02
) -> None:
    """Normal(0, std) matrices and unit norm weights, generated on ``device`` from (seed, name)."""
    materialize(model, device, dtype)
    shards = getattr(model, "tp_shards", {})
    for name, param in model.named_parameters():
        shard = shards.get(name)
        shape = shard.full_shape if shard else tuple(param.shape)
        if param.ndim == 1:
            full = torch.ones(shape, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen, device=device) * std
        with torch.no_grad():
            param.copy_(shard.take(full) if shard else full)


def _rope_from_hf(cfg: dict) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters; older config.json files have rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("config.json: expected partial_rotary_factor 1.0, got a partial rotary embedding")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json: expected rope_type 'default' or 'llama3', got {kind!r}")
    return theta, RopeScaling(
        float(params["factor"]),
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        int(params["original_max_position_embeddings"]),
    )


def read_hf_config(path: str | Path) -> ModelArgs:
    """``ModelArgs`` from ``path/config.json`` of a Llama, Mistral or Phi-3 checkpoint."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json: expected model_type in {SUPPORTED_MODEL_TYPES}, got {cfg.get('model_type')!r}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("hidden_act", "silu") != "silu":
        raise ValueError("config.json: expected no attention/MLP biases and hidden_act 'silu'")
    theta, scaling = _rope_from_hf(cfg)
    max_seq = int(cfg.get("max_position_embeddings", 8192))
    # Within the sliding window, windowed attention is full attention: cap the length there.
    if cfg.get("sliding_window"):
        max_seq = min(max_seq, int(cfg["sliding_window"]))
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or 0,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=max_seq,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _sources(args: ModelArgs, name: str, fused: bool) -> tuple[str, int]:
    """(checkpoint key, first row) holding our parameter ``name``; Phi-3 fuses qkv and gate/up."""
    if not fused:
        return name, 0
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    offsets = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", args.intermediate_size),
    }
    for ours, (theirs, row) in offsets.items():
        if f".{ours}." in name:
            return name.replace(ours, theirs), row
    return name, 0


def load_hf_checkpoint(model: Transformer, path: str | Path, device: torch.device | str, dtype: torch.dtype) -> None:
    """Fill ``model`` (meta or real, sharded or not) from ``path/*.safetensors``, reading only each
    rank's slice of every tensor."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint: expected *.safetensors files in {path}, got none")
    fused = json.loads((path / "config.json").read_text()).get("model_type") == "phi3"
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {key: h for h in handles for key in h.keys()}
    materialize(model, device, dtype)
    shards = getattr(model, "tp_shards", {})
    for name, param in model.named_parameters():
        key, row = _sources(model.args, name, fused)
        if key not in where:
            raise ValueError(f"checkpoint: expected tensor {key!r} in {path}, got no such tensor")
        full_shape = shards[name].full_shape if name in shards else tuple(param.shape)
        index = [slice(row, row + full_shape[0])] + [slice(None)] * (len(full_shape) - 1)
        if name in shards:
            s, base = shards[name], row if shards[name].dim == 0 else 0
            index[s.dim] = slice(base + s.start, base + s.stop)
        tensor = where[key].get_slice(key)[tuple(index)]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint: expected {key!r} of shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(device=device, dtype=dtype))
