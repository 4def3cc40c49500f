"""The decode-attention implementations the benchmark compares, behind one interface.

Every peer takes the same input set: q (B, Hq, D), k_cache/v_cache (B, Hkv, S_max, D) and
cache_seqlens (B,) int32; for a paged shape, k_cache/v_cache (num_pages, page_size, Hkv, D) and
block_table (B, pages per sequence) int32, pages in random order. An MLA shape (D = 576) has one
latent head of 576 dims and v_cache its first 512 (a view), so out is (B, Hq, 512). ``prepare(inputs)`` does
whatever the peer needs once per input set and outside the timed region (a layout copy, a block
mask, FlashInfer's host-side ``plan``) and returns a zero-argument callable that computes out
(B, Hq, D). A peer whose package is missing
reports why and is skipped, never failing the run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from flash_decoding import flash_decoding

import lean_tp
from lean_tp.ops.decode_attention.launch_args import token_lengths
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd
from lean_tp.ops.decode_attention.tuning import get_config
from lean_tp.tools.simulate import triton_mla_split_count

Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Peer:
    name: str
    prepare: Callable[[Inputs], Callable[[], torch.Tensor]]
    needs: str | None = None  # importable module the peer requires
    cuda_only: bool = False
    triton: bool = False  # a Triton kernel: on CPU it runs in the interpreter, so it is timed only against Triton peers
    features: frozenset[str] = (
        frozenset()
    )  # of "fp8", "window", "paged", "mla", "tq" (``Shape.features``): wired up here for this peer
    only: str | None = None  # a feature the shape must have for this peer to run (an ablation's)
    # Run only when named in --peers: its kernels compile apart from lean's, a compile for each
    # variant, which would take a --quick run past the GPU check's step.
    opt_in: bool = False

    def unavailable(self, device: torch.device) -> str | None:
        """Why this peer cannot run here, or None."""
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return "not installed"
        if self.cuda_only and device.type != "cuda":
            return "needs CUDA"
        return None


def _lean(s: Inputs, batch_invariant: bool = False):
    backend = "auto" if s["q"].is_cuda else "triton"  # the dry run interprets the kernel, like flash-decoding's
    return lambda: lean_tp.decode_attention(**s, backend=backend, batch_invariant=batch_invariant)


def _lean_invariant(s: Inputs):
    """lean in its batch-invariant mode: what a request's bits independent of its batch cost on
    each shape (modelled in BENCHMARKS.md and docs/mla.md)."""
    return _lean(s, batch_invariant=True)


# The shape features lean's calls take, in either mode.
_LEAN_FEATURES = frozenset({"fp8", "window", "paged", "mla", "tq"})


# MLA ablations: lean with its sm_90 entry changed, to tell the choices apart on a GPU. 16-row
# blocks (sm_80's) read each latent row once a 16-row block (128 heads: 8 times, not 2); 32-key
# blocks at 16 rows (the entry's block_n, not its narrow_block_n) are the loop the first H200
# record measured, against which 64-key blocks (660 SASS an iteration against 2 x 497: kernel
# report) are modelled; at most 64 programs an output for one sequence of one token (the
# entries' 128 give one long sequence at TP 8 every SM's loop, for a merge chain of 8 + 16
# partials: the H200 measured 48.6 against 54.2 us at B=1 32k, tuning.py, _MLA_CONTRIBUTORS);
# 64-row blocks at 128 heads (two row blocks of whole V rows, scores K q^T by mma.sync) are what
# the entry's 128-row blocks in column halves replaced (tuning.py, _MLA_COLS); a merge's column
# slices merged by its last arrivers alone, with no contributor waiting to share them (one read
# of the counter), are what the shared slices replaced (merge.finish_split). Two programs an SM
# of 4 warps and 32-key blocks at 16 rows are the candidate for TP 8's loop-bound e4m3 cache: the
# entry's one program of 8 warps takes 3.6x its issue time a 64-key iteration (2.73 us measured
# at 16 bits, docs/mla.md). Compiled for sm_90 (triton 3.7.1, paged64) two such programs fit an
# SM (255 registers and 91 KB e4m3, 168 and 92 KB at 16 bits; no K/V-loop spill), at 77 warp
# instructions and 5392 bytes of shared-memory reads a key against the entry's 71 and 5520
# (16-bit: 88 and 4768 against 83 and 4896): about the same work, in two loops whose latencies
# the SM may overlap.
MLA_ABLATIONS = {
    "lean-rows16": dict(max_block_g=16, scores_t_rows=None),
    "lean-keys32": dict(narrow_block_n=None),
    "lean-contributors64": dict(one_sequence_max_contributors=None),
    "lean-rows64": dict(max_block_g=64, split_v_rows=None),
    "lean-merge-alone": dict(merge_polls=1),
    "lean-programs2": dict(narrow_block_n=None, num_warps=4, max_programs_per_sm=2),
}


def _lean_with(overrides: dict, **options):
    """A peer running lean with its tuning entry's ``overrides`` (``MLA_ABLATIONS``), and the
    call's ``options`` (``batch_invariant``)."""

    def prepare(s: Inputs):
        q, k = s["q"], s["k_cache"]
        entry = get_config(q.device, k.shape[-1], q.dtype, k.dtype, s["v_cache"].shape[-1])
        config = dataclasses.replace(entry, **overrides)
        call = dict(s, softmax_scale=k.shape[-1] ** -0.5, block_table=s.get("block_table"), config=config)
        return lambda: decode_attention_fwd(**call, **options)[0]

    return prepare


# The batch-invariant mode in 16-row blocks of 64-key chunks under DP attention, against its wide
# blocks in 512-key chunks (tuning's _MLA_INVARIANT: modelled 0.44-0.59x of this from B=8).
INVARIANT_ROWS16 = dict(invariant_max_block_g=16, invariant_wide_tile_n=None)


def _lean_gluon(overlap: bool):
    """lean's sm_90 MLA kernel in Gluon (``lean_tp.ops.mla_gluon``, where sm_90's entry routes 64
    rows and more), with its serial loop or (``overlap``) its overlapped one: 16-bit latent pages of
    64 rows, heads in blocks of 64 (its checks name what it does not take). Its schedule is
    computed once a step, untimed, as FlashMLA's metadata is."""

    def prepare(s: Inputs):
        from lean_tp.ops.mla_gluon import mla_decode_gluon, mla_gluon_schedule
        from lean_tp.ops.mla_gluon.launcher import ROWS

        q, lens, table = s["q"], s["cache_seqlens"], s["block_table"]
        if q.shape[-2] % ROWS:
            raise NotImplementedError(f"takes heads in blocks of {ROWS}, got {q.shape[-2]}")
        pool = s["k_cache"][:, :, 0]  # (pages, 64, 576): the one latent head
        schedule = mla_gluon_schedule(lens, table, q.shape[-2], q.shape[1] if q.dim() == 4 else 1)
        return lambda: mla_decode_gluon(q, pool, lens, table, schedule=schedule, overlap=overlap)[0]

    return prepare


def _flash_decoding(s: Inputs):
    return lambda: flash_decoding(**s)


def _sdpa(s: Inputs):
    """What a user without a decode kernel writes: SDPA over the padded cache with a length mask."""
    q, k, v, lens = s["q"], s["k_cache"], s["v_cache"], s["cache_seqlens"]
    mask = (torch.arange(k.shape[2], device=q.device) < lens[:, None])[:, None, None]
    return lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]


_FLEX_COMPILED = {}
# Flex is compiled for static shapes, so every benchmark shape is one recompile of flex_attention.
# Past Dynamo's default limit of 8 it would silently run eager (unfused) Flex for the later rows.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)


def _flex(s: Inputs):
    """FlexAttention's decode kernel (Q_LEN = 1) under torch.compile, with a per-sequence length mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, lens = s["q"], s["k_cache"], s["v_cache"], s["cache_seqlens"]
    fn = _FLEX_COMPILED.setdefault("fn", torch.compile(flex_attention, fullgraph=True, dynamic=False))
    mask = create_block_mask(
        lambda b, h, q_idx, kv_idx: kv_idx < lens[b], q.shape[0], None, 1, k.shape[2], device=q.device
    )
    q4 = q[:, :, None]
    return lambda: fn(q4, k, v, block_mask=mask, enable_gqa=True)[:, :, 0]


def _flash_attn(s: Inputs):
    """FlashAttention-2's ``flash_attn_with_kvcache`` (FlashDecoding); its cache is (B, S, Hkv, D)."""
    from flash_attn import flash_attn_with_kvcache

    q, lens = s["q"][:, None], s["cache_seqlens"]
    k, v = s["k_cache"].transpose(1, 2).contiguous(), s["v_cache"].transpose(1, 2).contiguous()
    return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)[:, 0]


def varlen_args(s: Inputs) -> dict:
    """Arguments of ``torch.nn.attention.varlen.varlen_attn`` for one decode step over the cache.

    Where the installed torch has ``seqused_k`` (2.13), keys stay in a (B * S_max, Hkv, D) copy of the
    cache and ``seqused_k`` bounds each sequence, with ``enable_gqa``. Older torch (2.11) takes only
    packed keys: each sequence's valid keys are concatenated, and KV heads are repeated to Hq since
    it has no GQA, so that peer reads group-times more K/V bytes than the others.
    """
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    q, k, v, lens = s["q"], s["k_cache"], s["v_cache"], s["cache_seqlens"]
    batch, hkv, cap, d = k.shape
    step = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    args = dict(query=q, cu_seq_q=step, max_q=1, max_k=cap)
    if "seqused_k" in inspect.signature(varlen_attn).parameters:
        flat = lambda c: c.transpose(1, 2).reshape(batch * cap, hkv, d)  # noqa: E731
        return args | dict(key=flat(k), value=flat(v), cu_seq_k=step * cap, seqused_k=lens, enable_gqa=True)
    group = q.shape[1] // hkv

    def packed(c: torch.Tensor) -> torch.Tensor:
        rows = [c[b, :, :n].transpose(0, 1) for b, n in enumerate(lens.tolist())]
        return torch.cat(rows).repeat_interleave(group, 1)

    cu_k = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    return args | dict(key=packed(k), value=packed(v), cu_seq_k=cu_k)


def _varlen(s: Inputs):
    """PyTorch's own FlashAttention varlen entry point, ``varlen_attn``, with one query per sequence."""
    from torch.nn.attention.varlen import varlen_attn

    args = varlen_args(s)
    return lambda: varlen_attn(**args)


FLASHINFER_PAGE = 16


def flashinfer_pages(s: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(k pages, v pages, block table (B, pages per sequence), FlashInfer layout name): a paged
    input set's own pages (NHD), or a paged HND copy of a contiguous cache."""
    if "block_table" in s:
        return s["k_cache"], s["v_cache"], s["block_table"], "NHD"
    batch, hkv, cap, d = s["k_cache"].shape
    pages = -(-cap // FLASHINFER_PAGE)

    def paged(cache):
        pad = torch.nn.functional.pad(cache, (0, 0, 0, pages * FLASHINFER_PAGE - cap))
        return (
            pad.view(batch, hkv, pages, FLASHINFER_PAGE, d)
            .permute(0, 2, 1, 3, 4)
            .reshape(-1, hkv, FLASHINFER_PAGE, d)
            .contiguous()
        )

    table = torch.arange(batch * pages, device=s["q"].device, dtype=torch.int32).view(batch, pages)
    return paged(s["k_cache"]), paged(s["v_cache"]), table, "HND"


def _flashinfer(s: Inputs):
    """FlashInfer's batch decode over the paged input set's pages, or over a paged (HND) copy of a
    contiguous cache; ``plan`` runs here, untimed."""
    import flashinfer

    q, lens = s["q"], s["cache_seqlens"]
    k, v, table, layout = flashinfer_pages(s)
    page, hkv, d = (k.shape[1], k.shape[2], k.shape[3]) if layout == "NHD" else (k.shape[2], k.shape[1], k.shape[3])
    used = (lens + page - 1) // page
    indptr = torch.cat([used.new_zeros(1), used.cumsum(0)]).int()
    indices = torch.cat([table[b, : int(n)] for b, n in enumerate(used.tolist())]).int()
    last = (lens - (used - 1) * page).int()
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(indptr, indices, last, q.shape[1], hkv, d, page, q_data_type=q.dtype, kv_data_type=k.dtype)
    return lambda: wrapper.run(q, (k, v))


MLA_RANK = 512  # kv_lora_rank: V's width, the latent row's first 512 dims


def _flashmla(s: Inputs):
    """FlashMLA's dense decode (deepseek-ai/FlashMLA, sm_90a): pages of 64 latent rows, and a
    shape's query tokens as its causal s_q. Its ``get_mla_metadata`` takes the old interface's
    (cache_seqlens, rows per KV head, KV heads) and ignores them in the new one, whose scheduler
    runs inside the first call."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    tokens, lens = s["q"].dim() == 4, s["cache_seqlens"]
    q = s["q"] if tokens else s["q"][:, None]  # (B, Tq, H, 576): draft tokens see the keys before them
    meta, splits = get_mla_metadata(lens, q.shape[1] * q.shape[2], 1)
    args = (q, s["k_cache"], s["block_table"], lens, MLA_RANK, meta, splits)
    if tokens:
        return lambda: flash_mla_with_kvcache(*args, causal=True)[0]
    return lambda: flash_mla_with_kvcache(*args)[0][:, 0]


def _flashinfer_mla(s: Inputs):
    """FlashInfer's MLA (``BatchMLAPagedAttentionWrapper``; its Hopper kernel on sm_90) over copies of
    the latent pages as its two tensors, the 512 compressed and the 64 rope dims; ``plan`` untimed.
    A shape's query tokens are each request's rows of q, causal (the last sees every key). An e4m3
    cache takes the shape's per-tensor scale for both (FlashInfer takes e4m3 on sm_90 only)."""
    import flashinfer

    tq = s["q"].shape[1] if s["q"].dim() == 4 else 1
    q = s["q"].reshape(-1, *s["q"].shape[-2:])  # (B x Tq, H, 576)
    lens, table, cache = s["cache_seqlens"], s["block_table"], s["k_cache"][:, :, 0]
    fp8 = cache.dtype == torch.float8_e4m3fn
    run_args = inspect.signature(flashinfer.mla.BatchMLAPagedAttentionWrapper.run).parameters if fp8 else {}
    if fp8 and "ckv_scale" not in run_args:  # FlashInfer's e4m3 MLA cache came with its scales
        raise NotImplementedError(f"flashinfer {flashinfer.__version__} takes no e4m3 MLA cache (0.6.18 does)")
    page = cache.shape[1]
    used = (lens + page - 1) // page
    indptr = torch.cat([used.new_zeros(1), used.cumsum(0)]).int()
    indices = torch.cat([table[b, : int(n)] for b, n in enumerate(used.tolist())]).int()
    q_indptr = tq * torch.arange(len(lens) + 1, device=q.device, dtype=torch.int32)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    rope = cache.shape[-1] - MLA_RANK
    wrapper.plan(q_indptr, indptr, indices, lens, q.shape[1], MLA_RANK, rope, page, tq > 1, q.shape[-1] ** -0.5,
                 q.dtype, cache.dtype)  # fmt: skip
    q_nope, q_pe = q[..., :MLA_RANK].contiguous(), q[..., MLA_RANK:].contiguous()
    ckv, kpe = cache[..., :MLA_RANK].contiguous(), cache[..., MLA_RANK:].contiguous()
    scales = dict(ckv_scale=float(s["k_scale"]), kpe_scale=float(s["k_scale"])) if fp8 else {}
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe, **scales).view(*s["q"].shape[:-1], MLA_RANK)


def _vllm_triton_mla(s: Inputs):
    """vLLM's Triton MLA decode (``decode_attention_fwd`` with ``is_mla``), with the split count
    its backend picks (the simulator's ``triton_mla_split_count``) and its fp32 scratch allocated
    here, untimed. A shape's query tokens run as vLLM's backend runs drafts: each a row of its own,
    its length its keys (the request's, less the drafts after it) and its request's pages."""
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    q, lens, kv, table = s["q"], s["cache_seqlens"], s["k_cache"], s["block_table"]
    if q.dim() == 4:  # (B, Tq, H, 576): a row a token, its keys those it sees (token_lengths)
        tq = q.shape[1]
        q, table, lens = q.reshape(-1, *q.shape[2:]), table.repeat_interleave(tq, dim=0), token_lengths(lens, tq)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    splits = triton_mla_split_count(int(lens.max()), sms)
    out = q.new_empty(q.shape[0], q.shape[1], MLA_RANK)
    lse = q.new_empty(q.shape[0], q.shape[1])
    logits = torch.empty(q.shape[0], q.shape[1], splits, MLA_RANK + 1, dtype=torch.float32, device=q.device)
    v = kv[..., :MLA_RANK]

    def run() -> torch.Tensor:
        decode_attention_fwd(q, kv, v, out, lse, table, lens, logits, splits, q.shape[-1] ** -0.5,
                             kv.shape[1], is_mla=True)  # fmt: skip
        return out.view(*s["q"].shape[:-1], MLA_RANK)

    return run


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("lean", _lean, triton=True, features=_LEAN_FEATURES),
        Peer("lean-invariant", _lean_invariant, triton=True, features=_LEAN_FEATURES, opt_in=True),
        Peer(
            "lean-invariant-rows16",
            _lean_with(INVARIANT_ROWS16, batch_invariant=True),
            triton=True,
            features=frozenset({"fp8", "paged", "mla", "tq"}),
            only="mla",
            opt_in=True,
        ),
        *(
            Peer(
                name, _lean_with(overrides), triton=True, features=frozenset({"fp8", "paged", "mla", "tq"}), only="mla"
            )
            for name, overrides in MLA_ABLATIONS.items()
        ),
        *(
            Peer(name, _lean_gluon(overlap), cuda_only=True, features=frozenset({"paged", "mla", "tq"}), only="mla")
            for name, overlap in (("lean-gluon", False), ("lean-gluon-overlap", True))
        ),
        Peer("flash-decoding", _flash_decoding, triton=True),
        Peer("sdpa", _sdpa),
        Peer("flex", _flex),
        Peer("varlen", _varlen, needs="torch.nn.attention.varlen", cuda_only=True),
        Peer("flash-attn", _flash_attn, needs="flash_attn", cuda_only=True),
        Peer("flashinfer", _flashinfer, needs="flashinfer", cuda_only=True, features=frozenset({"paged"})),
        Peer("flashmla", _flashmla, needs="flash_mla", cuda_only=True, features=frozenset({"paged", "mla", "tq"})),
        Peer(
            "flashinfer-mla",
            _flashinfer_mla,
            needs="flashinfer",
            cuda_only=True,
            features=frozenset({"paged", "mla", "fp8", "tq"}),
        ),
        Peer(
            "vllm-triton-mla",
            _vllm_triton_mla,
            needs="vllm",
            cuda_only=True,  # vLLM's CPU build disables Triton
            triton=True,
            features=frozenset({"paged", "mla", "fp8", "tq"}),
        ),
    )
}
