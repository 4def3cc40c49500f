"""Tensor- and context-parallel decode: process groups from torchrun, head and sequence sharding of the model.

See docs/design.md ("Tensor parallelism") for the sharding rules and per-rank grid sizing.
"""

from lean_tp.distributed.cp import ContextShard, context_parallel_attention
from lean_tp.distributed.env import (
    DistContext,
    ParallelGroups,
    all_ranks_agree,
    disagreement,
    gather_objects,
    init_distributed,
    init_parallel_groups,
    shutdown,
    torchrun_env,
)
from lean_tp.distributed.tp import HeadPlan, Shard, apply_tp, check_shardable, describe_grid, plan_heads

__all__ = [
    "ContextShard",
    "DistContext",
    "HeadPlan",
    "ParallelGroups",
    "Shard",
    "all_ranks_agree",
    "apply_tp",
    "check_shardable",
    "context_parallel_attention",
    "describe_grid",
    "disagreement",
    "gather_objects",
    "init_distributed",
    "init_parallel_groups",
    "plan_heads",
    "shutdown",
    "torchrun_env",
]
