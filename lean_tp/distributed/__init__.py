"""Tensor-parallel decode: process-group setup from torchrun and head sharding of the model.

See docs/design.md ("Tensor parallelism") for the sharding rules and per-rank grid sizing.
"""

from lean_tp.distributed.env import (
    DistContext,
    all_ranks_agree,
    gather_objects,
    init_distributed,
    shutdown,
    torchrun_env,
)
from lean_tp.distributed.tp import HeadPlan, Shard, apply_tp, check_shardable, describe_grid, plan_heads

__all__ = [
    "DistContext",
    "HeadPlan",
    "Shard",
    "all_ranks_agree",
    "apply_tp",
    "check_shardable",
    "describe_grid",
    "gather_objects",
    "init_distributed",
    "plan_heads",
    "shutdown",
    "torchrun_env",
]
