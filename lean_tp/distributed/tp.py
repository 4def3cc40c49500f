"""Tensor (and context) parallelism for ``lean_tp.model.Transformer``, applied to a built model in place.

Attention is sharded by heads: q/k/v projections are column-parallel (each rank keeps the rows of
its heads) and o_proj is row-parallel (the matching columns), so attention itself needs no
communication (MLA: q's and kv_b_proj's rows of the rank's query heads; the latent row of each
token, shared by all heads, is computed and cached whole on every rank) and each rank runs ``decode_attention`` on its own heads with a grid sized to its own
GPU. The MLP is sharded the same way (gate/up column-parallel, down row-parallel). The two
row-parallel outputs per layer are summed with a functional-collective all-reduce, which
``torch.compile(fullgraph=True)`` traces into the graph. Embedding, norms and LM head are replicated.

When ``Hkv`` is not a multiple of the world size but each rank's query heads fall in one KV group,
that KV head is replicated on the ranks that need it. Context parallelism (``cp`` > 1) puts those
ranks to use instead: the world is TP x CP, heads are sharded over TP, and each head's sequence
over the CP ranks that hold it (``lean_tp.distributed.cp``), which merge their attention partials
with one all-gather per layer; the MLP is sharded over the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from lean_tp.distributed.cp import ContextShard, context_parallel_decode
from lean_tp.distributed.env import ParallelGroups
from lean_tp.model import ModelArgs, Transformer
from lean_tp.ops.decode_attention import plan_decode


@dataclass(frozen=True)
class Shard:
    """The part of a full tensor one rank keeps: ``full.narrow(dim, start, stop - start)``."""

    dim: int
    start: int
    stop: int
    full_shape: tuple[int, ...]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.stop - self.start)


@dataclass(frozen=True)
class HeadPlan:
    """Heads of one rank: query heads [q_start, q_start + n_q), KV heads [kv_start, kv_start + n_kv)."""

    q_start: int
    n_q: int
    kv_start: int
    n_kv: int


def plan_heads(n_heads: int, n_kv_heads: int, world_size: int, rank: int) -> HeadPlan:
    """Which heads ``rank`` holds; ``ValueError`` naming the head counts when they cannot be sharded."""
    what = f"n_heads={n_heads}, n_kv_heads={n_kv_heads}, world_size={world_size}"
    if n_heads % world_size:
        raise ValueError(f"cannot shard attention: expected n_heads divisible by world_size, got {what}")
    n_q = n_heads // world_size
    group = n_heads // n_kv_heads
    if n_kv_heads % world_size == 0:
        n_kv = n_kv_heads // world_size
        return HeadPlan(rank * n_q, n_q, rank * n_kv, n_kv)
    if group % n_q == 0:
        # Each rank's query heads lie in one KV group: replicate that KV head on group // n_q ranks.
        return HeadPlan(rank * n_q, n_q, rank * n_q // group, 1)
    raise ValueError(
        "cannot shard attention: expected n_kv_heads divisible by world_size, or world_size a multiple "
        f"of n_kv_heads so that each KV head can be replicated, got {what}"
    )


def check_shardable(args: ModelArgs, world_size: int, cp: int = 1) -> None:
    """Raise ``ValueError`` if ``args`` cannot run on ``world_size`` ranks, ``cp`` of them context
    parallel. Reads only the config, so every rank raises the same error before any collective."""
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if cp < 1 or world_size % cp:
        raise ValueError(
            f"cannot shard the context: expected a cp size that divides world_size, got cp={cp}, "
            f"world_size={world_size}"
        )
    plan_heads(args.n_heads, args.n_kv_heads, world_size // cp, 0)
    if args.intermediate_size % world_size:
        raise ValueError(
            "cannot shard the MLP: expected intermediate_size divisible by world_size, "
            f"got intermediate_size={args.intermediate_size}, world_size={world_size}"
        )


def _shard_linear(linear: nn.Linear, dim: int, start: int, stop: int) -> Shard:
    """Keep rows (dim 0, column-parallel) or columns (dim 1, row-parallel) [start, stop) of the weight."""
    shard = Shard(dim, start, stop, tuple(linear.weight.shape))
    linear.weight = nn.Parameter(shard.take(linear.weight.detach()).clone(), requires_grad=False)
    if dim == 0:
        linear.out_features = stop - start
    else:
        linear.in_features = stop - start
    return shard


def _all_reduce_output(group: dist.ProcessGroup):
    def hook(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(output, "sum", group)

    return hook


def apply_tp(model: Transformer, rank: int, world_size: int, cp: int = 1, groups: ParallelGroups | None = None) -> None:
    """Shard ``model`` in place for ``rank`` of ``world_size`` = TP x ``cp`` ranks (works on a meta model too).

    Rank ``r`` is TP rank ``r % tp`` of CP rank ``r // tp``: the ranks of a TP group are consecutive
    (one node), and the CP ranks of a head are ``tp`` apart. Attention is sharded by heads over TP
    and, with ``cp`` > 1, each head's sequence over its CP ranks (``ContextShard``); the attention
    projections are replicated across CP ranks, the MLP is sharded over all ranks. ``groups``
    defaults to the world for TP alone. Records ``model.tp_shards``: parameter name -> ``Shard``,
    which weight loaders use to read only this rank's part of each full tensor. Call before
    ``setup_caches`` so caches hold local heads and shares.
    """
    args = model.args
    check_shardable(args, world_size, cp)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected in [0, {world_size}), got {rank}")
    model.tp_shards = {}
    if world_size == 1:
        return
    if groups is None:
        if cp > 1:
            raise ValueError("groups: expected the ParallelGroups of the job with cp > 1, got None")
        groups = ParallelGroups(dist.group.WORLD, dist.group.WORLD, None)
    tp = world_size // cp
    plan = plan_heads(args.n_heads, args.n_kv_heads, tp, rank % tp)
    d, inter = args.head_dim, args.intermediate_size // world_size
    q_rows = (plan.q_start * d, (plan.q_start + plan.n_q) * d)
    kv_rows = (plan.kv_start * d, (plan.kv_start + plan.n_kv) * d)
    mlp_rows = (rank * inter, (rank + 1) * inter)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = _mla_parts(attn, args, plan) if args.kv_lora_rank else {
            "self_attn.q_proj": (attn.q_proj, 0, q_rows),
            "self_attn.k_proj": (attn.k_proj, 0, kv_rows),
            "self_attn.v_proj": (attn.v_proj, 0, kv_rows),
            "self_attn.o_proj": (attn.o_proj, 1, q_rows),
        }  # fmt: skip
        parts |= {
            "mlp.gate_proj": (mlp.gate_proj, 0, mlp_rows),
            "mlp.up_proj": (mlp.up_proj, 0, mlp_rows),
            "mlp.down_proj": (mlp.down_proj, 1, mlp_rows),
        }
        for name, (linear, dim, (start, stop)) in parts.items():
            model.tp_shards[f"model.layers.{i}.{name}.weight"] = _shard_linear(linear, dim, start, stop)
        attn.n_heads = plan.n_q
        if not args.kv_lora_rank:  # MLA's one latent head is every rank's
            attn.n_kv_heads = plan.n_kv
        if cp > 1:
            attn.shard = ContextShard(cp, rank // tp)
            attn.attend = context_parallel_decode(attn.shard, groups.cp)
        if tp > 1:
            attn.o_proj.register_forward_hook(_all_reduce_output(groups.tp))
        mlp.down_proj.register_forward_hook(_all_reduce_output(groups.world))


def _mla_parts(attn: nn.Module, args: ModelArgs, plan: HeadPlan) -> dict[str, tuple[nn.Linear, int, tuple[int, int]]]:
    """MLA's head-sharded projections: q's rows (``q_b_proj``, or ``q_proj`` without a q LoRA),
    ``kv_b_proj``'s rows (each head's W_UK and W_UV) and o_proj's columns of this rank's query
    heads. The down-projections to the latent row (and q's) are replicated: every rank computes
    and caches the whole latent row of each token."""
    heads = (plan.q_start, plan.q_start + plan.n_q)
    rows = lambda width: (heads[0] * width, heads[1] * width)  # noqa: E731
    q_name = "q_b_proj" if args.q_lora_rank else "q_proj"
    return {
        f"self_attn.{q_name}": (getattr(attn, q_name), 0, rows(args.head_dim)),
        "self_attn.kv_b_proj": (attn.kv_b_proj, 0, rows(args.qk_nope_head_dim + args.v_head_dim)),
        "self_attn.o_proj": (attn.o_proj, 1, rows(args.v_head_dim)),
    }


def describe_grid(model: Transformer) -> str:
    """This rank's LeanAttention grid: the plan of one decode call on its cache (``plan_decode``),
    sized from its own device's SM count and the kernel's occupancy (so ranks on different GPU
    models get different sizes)."""
    attn, weight = model.attention_modules()[0], model.lm_head.weight
    device = weight.device
    if attn.impl != "lean":
        return f"{attn.impl} attention on {device} (no Lean grid)"
    if attn.kv_cache is None:
        return f"no caches on {device} yet (setup_caches sizes the grid)"
    cache = attn.kv_cache
    q = torch.empty(1, attn.n_heads, attn.head_dim, dtype=weight.dtype, device=device)
    plan = plan_decode(
        q,
        cache.k[:1],
        cache.v[:1],
        torch.zeros(1, dtype=torch.int32, device=device),
        backend=attn.backend,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    )
    if plan.kernel is None:
        return f"torch backend on {device} (no kernel grid)"
    if device.type != "cuda":
        return f"Triton interpreter on {device}: {plan.num_programs} programs"
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    return f"{props.name} on {device}, {sms} SMs: {plan.num_programs} programs ({plan.num_programs / sms:g} per SM)"
