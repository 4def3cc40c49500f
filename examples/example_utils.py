"""What the examples share and the library does not need: CLI parsing and random prompts.

The examples run as scripts (``python examples/x.py``), so this directory is on ``sys.path`` and
they import it as ``example_utils``; the tests put it on the path too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: decode_tp checks its flags before importing it
    import torch

# A Llama small enough for CPU runs of the Hugging Face examples (transformers.LlamaConfig kwargs).
TINY_HF_LLAMA = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=512, max_position_embeddings=4096, pad_token_id=0)  # fmt: skip


def parse_prompt_lens(text: str, batch: int) -> list[int]:
    """``--prompt-len``: one length for every sequence, or one per sequence. ``ValueError`` names the flag."""
    try:
        lens = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-len: expected an integer or a comma list of integers, got {text!r}") from None
    if batch < 1:
        raise ValueError(f"--batch: expected >= 1, got {batch}")
    if len(lens) == 1:
        lens = lens * batch
    if len(lens) != batch or min(lens) < 1:
        raise ValueError(f"--prompt-len: expected 1 or --batch ({batch}) lengths, each >= 1, got {text!r}")
    return lens


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
        from tqdm import tqdm

        self.bar, self.prompt_seen = tqdm(total=steps, desc=desc, unit="token", leave=False), False

    def put(self, _tokens) -> None:
        if self.prompt_seen:
            self.bar.update()
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()
