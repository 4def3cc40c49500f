"""What the examples share and the library does not need: prompt flags, random prompts, progress.

The examples run as scripts (``python examples/x.py``), so this directory is on ``sys.path`` and
they import it as ``example_utils``; the tests put it on the path too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lean_tp import cli

if TYPE_CHECKING:
    import torch

# A Llama small enough for CPU runs of the Hugging Face examples (transformers.LlamaConfig kwargs).
TINY_HF_LLAMA = dict(
    vocab_size=1024,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    max_position_embeddings=4096,
    pad_token_id=0,
)


# --dtype names of the Hugging Face examples (torch attribute names, as transformers takes them).
HF_DTYPES = ("bfloat16", "float16", "float32")
# Tokens one run may generate per sequence: far beyond any model's context, so that a typo fails
# as a flag error rather than as an allocation.
MAX_GEN = 1 << 20


def hf_checkpoint(text: str) -> str:
    """An argparse ``type`` for ``--checkpoint``: a Hugging Face model directory, with its config.json
    and safetensors weights."""
    import argparse
    import os

    if not os.path.isfile(os.path.join(text, "config.json")) or not any(
        f.endswith(".safetensors") for f in os.listdir(text)
    ):
        raise argparse.ArgumentTypeError(
            f"expected a Hugging Face model directory with a config.json and *.safetensors weights, got {text!r}"
        )
    return text


def prompt_lens_flag(p: cli.ArgumentParser, lens: list[int], batch: int) -> list[int]:
    """``--prompt-len`` (a list of lengths >= 1, by its ``cli.integer_list`` type) for ``batch``
    sequences: one length for every sequence, or one per sequence."""
    if len(lens) == 1:
        return lens * batch
    if len(lens) != batch:
        p.fail("--prompt-len", f"1 or --batch ({batch}) lengths", ",".join(map(str, lens)))
    return lens


def check_positions(p: cli.ArgumentParser, prompt_lens: list[int], gen: int, positions: int, model: str) -> None:
    """The longest prompt and the tokens generated after it must fit in the model's positions."""
    if max(prompt_lens) + 1 > positions:
        p.fail("--prompt-len", f"prompts shorter than {model}'s {positions} positions", ",".join(map(str, prompt_lens)))
    if max(prompt_lens) + gen > positions:
        p.fail(
            "--gen",
            f"<= {positions - max(prompt_lens)} tokens after a {max(prompt_lens)}-token prompt "
            f"({model} has {positions} positions)",
            str(gen),
        )


def make_prompts(prompt_lens: list[int], vocab_size: int, seed: int, device: torch.device) -> torch.Tensor:
    """(B, max(prompt_lens)) int64 random token ids, right-padded with 0 (lean_tp.model's prefill)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (len(prompt_lens), max(prompt_lens)), generator=gen)
    for b, n in enumerate(prompt_lens):
        tokens[b, n:] = 0
    return tokens.to(device)


def random_left_padded_batch(lens: list[int], vocab_size: int, seed: int, device: str | torch.device = "cpu"):
    """Random prompts of the given lengths, left-padded as ``generate()`` expects for decoder-only
    models: input_ids and attention_mask, both (B, max(lens)) int64."""
    import torch

    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(3, vocab_size, (len(lens), width), generator=g)
    mask = (torch.arange(width) >= width - torch.tensor(lens)[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


class TokenProgress:
    """A ``generate(streamer=...)`` progress bar over decode steps, for untimed runs.

    transformers hands the streamer the prompt first, then each step's new tokens (after a device
    to host copy, so never pass it to a timed run).
    """

    def __init__(self, steps: int, desc: str) -> None:
        # No remaining-time estimate: a compile run spends its first step compiling.
        self.bar = cli.progress(total=steps, desc=desc, unit="token", leave=False, eta=False)
        self.prompt_seen = False

    def put(self, _tokens) -> None:
        if self.prompt_seen:
            self.bar.update()
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()
