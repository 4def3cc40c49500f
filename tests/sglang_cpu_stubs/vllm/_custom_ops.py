"""``rotary_embedding`` in plain torch, for SGLang's engine on a CPU machine without sglang-kernel's
CPU build or vLLM (the one non-attention op SGLang's CPU path imports from vLLM)."""

import torch


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate query and key (T, H * head_size) or (T, H, head_size) in place, as vLLM's op does:
    the first ``cos_sin_cache.shape[-1]`` dims of each head, with cos_sin_cache (max_pos, rot) =
    [cos | sin]; halves rotated (NeoX) or interleaved pairs (GPT-J)."""
    cos, sin = cos_sin_cache.index_select(0, positions.flatten().long()).float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    rot = 2 * cos.shape[-1]
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(x.shape[0], -1, head_size)
        part = heads[..., :rot].float()
        if is_neox:
            x1, x2 = part.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        heads[..., :rot] = rotated.to(heads.dtype)
