"""Share of decode time spent in attention, from ``torch.profiler`` (an estimate: profiling adds overhead)."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lean_tp.model import Transformer

# Op names (CPU) and kernel-name fragments (CUDA) that count as decode attention.
_CPU_OPS = (
    "lean_tp::decode_attention",
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
)
_KERNEL_MARKS = ("attention", "fmha", "flash")


@contextlib.contextmanager
def _quiet_kineto(cpu: bool):
    """On CPU, Kineto prints "USDT: ... profiler_start/profiler_stop" to stderr from C++, on every
    rank, whatever KINETO_LOG_LEVEL says; silence file descriptor 2 while the profiler runs."""
    if not cpu:
        yield
        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@torch.inference_mode()
def attention_fraction(
    model: Transformer, step, prompt_lens: list[int], steps: int, device: torch.device
) -> float | None:
    """Run ``steps`` decode steps after the prompts (the cache must have room: capacity >=
    max(prompt_lens) + steps) and return attention time / decode time, or None if not measurable."""
    if steps < 1:
        return None
    lens = torch.tensor(prompt_lens, dtype=torch.int32, device=device)
    tokens = torch.zeros(len(prompt_lens), dtype=torch.int64, device=device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _quiet_kineto(not cuda), profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            step(model, tokens, lens)
            lens = lens + 1
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in kernels)
        attn = sum(e.self_device_time_total for e in kernels if any(m in e.key.lower() for m in _KERNEL_MARKS))
        return attn / total if total and attn else None
    # Nested ops include their children, so the outermost matching op is the attention time.
    attn = max((e.cpu_time_total for e in events if e.key in _CPU_OPS), default=0.0) / 1e6
    return min(attn / wall, 1.0) if attn else None
