"""The decode loop: prefill once, then one ``decode_step`` per token, greedy.

Nothing in the loop reads a device value on the host: the next token stays on the device, lengths
are advanced on the device, and capacity is checked once up front from host-side prompt lengths.
Step latencies come from CUDA events read after the loop (wall clock on CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lean_tp.cli import progress as progress_bar
from lean_tp.model import Transformer

StepFn = Callable[[Transformer, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def decode_one(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy step: tokens (B,) at positions input_pos (B,) int32 -> next tokens (B,), logits (B, vocab).
    This is the function ``--compile`` hands to ``torch.compile``."""
    logits = model.decode_step(tokens, input_pos)
    return logits.argmax(dim=-1), logits


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, gen) int64, CPU
    logits: torch.Tensor  # (B, vocab) float32, CPU: the logits that chose the last token
    prefill_s: float
    step_s: list[float]  # one per decode step (gen - 1 of them)
    margins: torch.Tensor | None = None  # (B, gen) float32, CPU, when forced: max logit - forced token's logit


class _Clock:
    """Per-interval timing: CUDA events on a GPU (read once at the end), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def check_lengths(model: Transformer, prompt_lens: list[int], gen: int) -> None:
    """Host-side validation, so the loop never needs to read lengths back from the device."""
    if not prompt_lens or min(prompt_lens) < 1:
        raise ValueError(f"prompt_lens: expected one length >= 1 per sequence, got {prompt_lens}")
    if gen < 1:
        raise ValueError(f"gen: expected >= 1 tokens to generate, got {gen}")
    need, capacity = max(prompt_lens) + gen - 1, model.cache_capacity()
    if need > capacity:
        raise ValueError(f"prompt_lens/gen: expected max prompt + gen - 1 <= cache capacity {capacity}, got {need}")


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    prompt_lens: list[int],
    gen: int,
    *,
    step: StepFn = decode_one,
    forced: torch.Tensor | None = None,
    progress: bool = False,
) -> Generation:
    """Greedy decode of ``gen`` tokens after ``prompt`` (B, T) with per-sequence ``prompt_lens``.

    ``forced`` (B, gen) teacher-forces the inputs (``--check`` feeds the run under test's tokens to
    the reference, so both see the same inputs even where a near-tie could flip a token).
    """
    check_lengths(model, prompt_lens, gen)
    device = prompt.device
    lens = torch.tensor(prompt_lens, dtype=torch.int32, device=device)
    tokens = torch.empty(len(prompt_lens), gen, dtype=torch.int64, device=device)
    margins = torch.zeros(tokens.shape, dtype=torch.float32, device=device) if forced is not None else None
    forced = forced.to(device) if forced is not None else None

    clock = _Clock(device)
    clock.mark()
    logits = model.prefill(prompt, lens)
    clock.mark()
    prefill_s = clock.intervals()[0]

    def record(i: int, next_tok: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tokens[:, i] = next_tok
        if forced is None:
            return next_tok.clone()  # outlives the next CUDA-graph replay
        margins[:, i] = logits.max(-1).values.float() - logits.gather(-1, forced[:, i, None])[:, 0].float()
        return forced[:, i]

    next_tok = record(0, logits.argmax(-1), logits)
    clock = _Clock(device)
    clock.mark()
    for i in progress_bar(range(1, gen), disable=not progress, desc="decode", unit="tok"):
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        out_tok, logits = step(model, next_tok, lens)
        next_tok = record(i, out_tok, logits)
        lens = lens + 1
        clock.mark()
    return Generation(
        tokens=tokens.cpu(),
        logits=logits.float().cpu(),
        prefill_s=prefill_s,
        step_s=clock.intervals(),
        margins=margins.cpu() if margins is not None else None,
    )
