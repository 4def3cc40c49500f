"""The methods one problem is simulated with (``simulate``): lean in both modes, and its peers,
FlashDecoding and Flex for standard attention, the MLA kernels (``mla.MLA_PEERS``) for MLA."""

from __future__ import annotations

from lean_tp.tools.gpus import GPUModel
from lean_tp.tools.simulate.mla import (
    flashinfer_mla_schedule,
    flashmla_schedule,
    mla_peer_takes,
    sglang_mla_schedule,
    triton_mla_schedule,
)
from lean_tp.tools.simulate.problems import Problem
from lean_tp.tools.simulate.schedules import (
    Schedule,
    fa2_splits,
    fixed_split_schedule,
    flex_splits,
    lean_sim_schedule,
)


def simulate(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> dict[str, Schedule | None]:
    """Lean (default and batch-invariant) and its peers on one problem on ``gpu``: FA2 and Flex, or
    for MLA (``Problem.latent``) FlashMLA, FlashInfer's MLA, and vLLM's and SGLang's Triton MLA,
    None for a peer whose code does not take the problem's cache there (``mla_peer_takes``)."""
    lean = {
        "lean": lean_sim_schedule(problem, gpu, programs_per_sm),
        "lean_invariant": lean_sim_schedule(problem, gpu, programs_per_sm, batch_invariant=True),
    }
    if problem.latent:
        schedules = {
            "flashmla": flashmla_schedule,
            "flashinfer_mla": flashinfer_mla_schedule,
            "triton_mla": triton_mla_schedule,
            "sglang_mla": sglang_mla_schedule,
        }
        return lean | {
            peer: schedule(problem, gpu, programs_per_sm) if mla_peer_takes(peer, problem, gpu) else None
            for peer, schedule in schedules.items()
        }
    fa2, block_n = fa2_splits(problem, gpu.sms)
    return lean | {
        "fa2": fixed_split_schedule("fa2", problem, gpu, fa2, block_n, programs_per_sm),
        "flex": fixed_split_schedule("flex", problem, gpu, flex_splits(problem, gpu.sms), 64, programs_per_sm),
    }
