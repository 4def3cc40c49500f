"""Process-group setup from the torchrun environment: NCCL on CUDA, gloo on CPU, nothing for one process.

Every rank validates the environment before it joins a collective, so a misconfiguration is
reported by every rank instead of leaving the healthy ones waiting. The process-group timeout bounds
every collective: a dead or stuck rank ends the job with an error, never a hang.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None  # None for a single process
    timeout_s: float = DEFAULT_TIMEOUT_S  # of every collective, in the subgroups too

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of a TP x CP job (``init_parallel_groups``)."""

    world: dist.ProcessGroup  # every rank: the MLP's all-reduce
    tp: dist.ProcessGroup  # the ranks that hold this rank's share of the sequence: o_proj's all-reduce
    cp: dist.ProcessGroup | None  # the ranks that hold this rank's heads: the attention merge


def _env_int(name: str, default: int | None, upper: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"{name}: expected it set by torchrun when WORLD_SIZE > 1, got it unset")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if value < 0 or (upper is not None and value >= upper):
        bound = f"[0, {upper})" if upper is not None else ">= 0"
        raise ValueError(f"{name}: expected an integer in {bound}, got {value}")
    return value


def torchrun_env() -> tuple[int, int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) from the environment; (0, 1, 0, 1) without torchrun.
    Reads no collective, so callers can validate a configuration before joining the job."""
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE: expected >= 1, got {world_size}")
    single = world_size == 1
    rank = _env_int("RANK", 0 if single else None, upper=world_size)
    local_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    local_rank = _env_int("LOCAL_RANK", 0 if single else None, upper=max(local_world, 1))
    return rank, world_size, local_rank, local_world


def resolve_device(device: str | None, local_rank: int, local_world_size: int) -> torch.device:
    """The rank's device: ``cuda:LOCAL_RANK`` for ``"cuda"`` (the default when CUDA is present), else CPU."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: expected 'cpu' on a machine without CUDA, got 'cuda'")
    count = torch.cuda.device_count()
    if local_world_size > count:
        raise ValueError(
            f"LOCAL_WORLD_SIZE: expected at most {count} ranks per node (one per visible GPU), got {local_world_size}"
        )
    return torch.device("cuda", local_rank)


def init_distributed(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the torchrun job described by WORLD_SIZE/RANK/LOCAL_RANK, or run alone without them.

    ``destroy_process_group()`` is registered to run at exit; calling ``shutdown()`` earlier is fine.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s}")
    rank, world_size, local_rank, local_world = torchrun_env()
    dev = resolve_device(device, local_rank, local_world)
    if world_size == 1:
        return DistContext(0, 1, 0, dev, None)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    atexit.register(shutdown)
    return DistContext(rank, world_size, local_rank, dev, dist.group.WORLD, timeout_s)


def init_parallel_groups(ctx: DistContext, cp: int) -> ParallelGroups | None:
    """The TP and CP subgroups of a world of TP x ``cp`` ranks, rank = cp_rank * tp + tp_rank (every
    rank must call it; None for one process). They keep the job's timeout: a dead rank ends a
    subgroup's collective with an error too."""
    if ctx.group is None:
        return None
    if cp < 1 or ctx.world_size % cp:
        raise ValueError(f"cp: expected a divisor of the world size {ctx.world_size}, got {cp}")
    tp, timeout = ctx.world_size // cp, timedelta(seconds=ctx.timeout_s)
    if cp == 1:
        return ParallelGroups(ctx.group, ctx.group, None)
    tp_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(c * tp, (c + 1) * tp)) for c in range(cp)], timeout=timeout
    )
    cp_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(t, ctx.world_size, tp)) for t in range(tp)], timeout=timeout
    )
    return ParallelGroups(ctx.group, tp_group, cp_group)


def shutdown() -> None:
    """Destroy the process group if one exists (gloo may abort at exit otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def gather_objects(ctx: DistContext, obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank (host-side; not for the decode loop)."""
    if ctx.group is None:
        return [obj]
    out: list[object] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def disagreement(ctx: DistContext, settings: dict[str, object]) -> str | None:
    """None if every rank was started with the same ``settings``, else a sentence naming the first
    that differs, the same on every rank (each compares all ranks' settings)."""
    everyone = gather_objects(ctx, settings)
    for name, value in settings.items():
        values = [s.get(name) for s in everyone]
        if any(v != values[0] for v in values):
            ranks = ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))
            return f"ranks were started with different settings: expected one {name}, got {ranks}"
    return None


def all_ranks_agree(ctx: DistContext, ok: bool) -> bool:
    """True only if ``ok`` holds on every rank, so all ranks can exit with the same status."""
    if ctx.group is None:
        return ok
    flag = torch.tensor([0 if ok else 1], device=ctx.device)
    dist.all_reduce(flag, group=ctx.group)
    return int(flag.item()) == 0
