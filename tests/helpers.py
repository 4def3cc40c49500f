"""Input builders shared by the decode-attention tests: fresh random data, every cache layout."""

from __future__ import annotations

import math

import torch

LAYOUTS = ("contiguous", "transposed", "paged16", "paged64")
# The documented tolerance (README, support matrix): max |out - float64 reference| for inputs drawn
# from N(0, 1), by q's dtype; fp8 caches are compared with the reference of their dequantized values.
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_inputs(
    lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layout: str = "contiguous",
    device: str = "cpu",
    capacity: int | None = None,
    seed: int = 0,
    leftpad: list[int] | None = None,
) -> dict:
    """q, k_cache, v_cache, cache_seqlens, block_table and cache_leftpad for a ragged batch.

    ``lens`` counts each sequence's valid keys. With ``leftpad``, they sit after that many padding
    positions (cache_seqlens = leftpad + lens), and the padding holds random keys that a kernel
    ignoring the left padding would attend to.

    "transposed" stores the cache as (B, S, Hkv, D) and views it as (B, Hkv, S, D); "pagedN" scatters
    each sequence over randomly permuted pages of N tokens, and fills unused block-table entries
    with an out-of-range index so that reading one would fail.
    """
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    if leftpad is not None:
        lens = [p + n for p, n in zip(leftpad, lens)]
    capacity = capacity or max(max(lens), 1) + 7
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    q = rand(batch, num_q_heads, head_dim)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    block_table = None
    if layout == "contiguous":
        k, v = rand(batch, num_kv_heads, capacity, head_dim), rand(batch, num_kv_heads, capacity, head_dim)
    elif layout == "transposed":
        k = rand(batch, capacity, num_kv_heads, head_dim).transpose(1, 2)
        v = rand(batch, capacity, num_kv_heads, head_dim).transpose(1, 2)
    else:
        page_size = int(layout.removeprefix("paged"))
        pages_per_seq = math.ceil(capacity / page_size)
        num_pages = batch * pages_per_seq + 3
        k, v = rand(num_pages, page_size, num_kv_heads, head_dim), rand(num_pages, page_size, num_kv_heads, head_dim)
        perm = torch.randperm(num_pages, generator=g)[: batch * pages_per_seq].view(batch, pages_per_seq)
        used = torch.arange(pages_per_seq) * page_size < seqlens[:, None]
        block_table = torch.where(used, perm, torch.full_like(perm, 1 << 30)).to(torch.int32)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    pads = torch.tensor(leftpad, dtype=torch.int32) if leftpad is not None else None
    return dict(
        q=to(q),
        k_cache=to(k),
        v_cache=to(v),
        cache_seqlens=to(seqlens),
        block_table=to(block_table),
        cache_leftpad=to(pads),
    )


def assert_matches_ref(out: torch.Tensor, lse: torch.Tensor, inputs: dict, atol: float, rtol: float = 0.0) -> None:
    """Compare against the float64 reference; empty sequences must give exactly 0 and -inf."""
    from lean_tp.ops.decode_attention import decode_attention_ref

    ref_out, ref_lse = decode_attention_ref(**{k: (v.cpu() if v is not None else None) for k, v in inputs.items()})
    out, lse = out.cpu().double(), lse.cpu().double()
    assert not out.isnan().any(), "out has NaN (an unwritten or poisoned element)"
    assert not lse.isnan().any(), "lse has NaN (an unwritten or poisoned element)"
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    pads = inputs.get("cache_leftpad")
    empty = (inputs["cache_seqlens"] - (pads if pads is not None else 0)).cpu() == 0
    assert (out[empty] == 0).all()
    assert torch.isneginf(lse[empty]).all()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=atol, rtol=rtol)


def launcher_form(inputs: dict) -> dict:
    """``inputs`` with float fp8 scales as (1,) float32 tensors, the form the launcher takes (the
    op takes both)."""
    call = dict(inputs)
    for name in ("k_scale", "v_scale"):
        if isinstance(call.get(name), float):
            call[name] = torch.tensor([call[name]])
    return call


def select(inputs: dict, idx: list[int]) -> dict:
    """The batch of requests ``idx`` (in that order) of a pool built by ``make_inputs`` (or
    ``make_feature_inputs``), in ``launcher_form``: their rows of q, lengths, left padding and block
    table; a paged pool's pages are shared."""
    paged = inputs["block_table"] is not None
    rows = torch.tensor(idx, dtype=torch.long)
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    call = dict(
        inputs,
        q=inputs["q"][rows],
        cache_seqlens=pick(inputs["cache_seqlens"]),
        cache_leftpad=pick(inputs["cache_leftpad"]),
        block_table=pick(inputs["block_table"]),
    )
    if not paged:
        call["k_cache"], call["v_cache"] = inputs["k_cache"][rows], inputs["v_cache"][rows]
    return launcher_form(call)


def run_kernel(inputs: dict, counters: torch.Tensor | None = None, **plan_options) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the launcher on ``inputs`` (in ``launcher_form``), planned with ``plan_options``
    (``plan_decode``'s: batch_invariant, config, num_programs, ...); out, lse and the merge
    workspace start as NaN, so an unwritten element or a merge reading an unwritten slot fails."""
    from lean_tp.ops.decode_attention.launch_args import plan_workspace
    from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, plan_decode

    call = launcher_form(inputs)
    q = call["q"]
    plan = plan_decode(**call, **plan_options)
    workspace = tuple(t.fill_(float("nan")) for t in plan_workspace(plan, q.device))
    out = torch.full((*q.shape[:-1], call["v_cache"].shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("nan"), device=q.device)
    return decode_attention_fwd(
        **call,
        softmax_scale=q.shape[-1] ** -0.5,
        plan=plan,
        counters=counters,
        out=out,
        lse=lse,
        workspace=workspace,
    )


def engine_names(engine: str) -> list[tuple[str, str, str]]:
    """``scripts/check_engine_names.py``'s report for the installed ``engine`` ("vllm", "sglang"):
    (kind, name, where) for each engine import and each member of a lean class with an engine base."""
    import importlib
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "check_engine_names.py"
    spec = importlib.util.spec_from_file_location("check_engine_names", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = Path(importlib.import_module(engine).__file__).resolve().parent.parent
    return module.report(engine, root)
