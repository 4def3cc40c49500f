"""The plan of one decode call: what its shapes, dtypes, device and scalar arguments decide.

``launcher.plan_decode`` builds a ``DecodePlan`` once per call, from tensor metadata alone (never
values): the cache layout, the call's ``Features``, the backend and, for the Triton backend, the
``KernelVariant`` (tuning entry and compile-time arguments) and the grid. The launcher, the torch
backend, the kernel report, the simulator and the tensor-parallel grid report all read it instead
of deriving those facts again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from lean_tp.ops.decode_attention.archs import ARCHS
from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.tuning import (
    INTERPRETER_MERGE_POLLS,
    INVARIANT_GROUP_CHUNKS,
    INVARIANT_SUPER_GROUPS,
    MERGE_FANIN,
    MERGE_SLICE_WAVE_ELEMS,
    MIN_TILES_PER_PROGRAM,
    NARROW_ROWS,
    SCHEDULE_BLOCK_B,
    DecodeConfig,
    block_g_for,
    config_for,
    padded_head_dim,
)

# More keys than any cache holds: without a window every valid key is tiled.
NO_SPAN_LIMIT = 2**30


@dataclasses.dataclass(frozen=True)
class Features:
    """What a call uses beyond one-token decode of a 16/32-bit cache; each field selects a kernel
    variant, and the torch backend implements them all."""

    num_tokens: int = 1  # Tq, query tokens per sequence
    fp8: torch.dtype | None = None  # the cache's fp8 dtype, None when the cache has q's dtype
    softcap: bool = False
    window: bool = False
    sinks: bool = False
    leftpad: bool = False
    # V's (row, token, head) strides differ from K's; otherwise a paged kernel forms each key's
    # address once for K and V (``DecodeConfig.share_kv_addresses``).
    kv_strides_differ: bool = False
    # Each output's bits depend on its own inputs alone (``invariant.py``), not on the batch.
    batch_invariant: bool = False
    # V is K's first columns (``cache.is_prefix_view``): the kernel takes V from K's tile.
    v_in_k: bool = False
    # The call holds one sequence of one query token (or of drafts in one narrow row block:
    # ``is_one_sequence``): an entry may split it over more programs
    # (``DecodeConfig.one_sequence_max_contributors``, in both modes) and compute it in narrower row
    # blocks (``one_sequence_max_block_g``, the default mode's column halves only).
    one_sequence: bool = False


def is_one_sequence(batch: int, num_tokens: int, group: int) -> bool:
    """``Features.one_sequence`` of a call of ``batch`` sequences of ``num_tokens`` query tokens
    and ``group`` query heads a KV head: one sequence of one token, or of drafts whose Tq x group
    rows fit one narrow row block (NARROW_ROWS: Kimi-K2's 8 heads at Tq 2), whose partials are as
    narrow as one token's of the widest group that fits. The batch-invariant mode's too: its bits
    do not depend on how many programs share an output (invariant.py), so a request alone may be
    split over more of them than in a batch."""
    return batch == 1 and (num_tokens == 1 or num_tokens * group <= NARROW_ROWS)


def e4m3_as_bits(fp8: torch.dtype | None, arch: str) -> bool:
    """Whether an fp8 cache is read as bytes and converted by hand: float8_e4m3fn before sm_89,
    where Triton has no e4m3 type (sm_80 and sm_86 compile e5m2; sm_89 on and the interpreter both)."""
    return fp8 == torch.float8_e4m3fn and arch in ARCHS and not ARCHS[arch].native_e4m3


def merge_wave(rows: int, block_d: int, elems: int) -> int:
    """Partials a merge loads at once: as many as ``elems`` fp32 elements hold (the tuning entry's
    ``merge_wave_elems``; a power of two, for ``tl.arange``), at least 1, at most the fan-in."""
    fit = max(1, elems // (rows * block_d))
    return min(MERGE_FANIN, 1 << (fit.bit_length() - 1))


def merge_cols(rows: int, block_d: int, wave_elems: int) -> int:
    """Columns of a merge's slice (``merge.finish_split``): all ``block_d`` when one wave of
    ``wave_elems`` fp32 elements (the tuning entry's ``merge_wave_elems``) holds two partials or
    more; wider partials (MLA's) in MERGE_FANIN slices, one for each member of a group to take,
    of at least 16 columns (64 bytes of a row)."""
    if 2 * rows * block_d <= wave_elems:
        return block_d
    return max(16, block_d // MERGE_FANIN)


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: the part of a plan that does not depend on batch, heads or strides.
    ``arch`` is the tuning-table key of the target, ``dtype`` q's dtype."""

    arch: str
    dtype: torch.dtype
    head_dim: int
    group: int
    page_size: int | None  # None for a contiguous cache
    features: Features = Features()
    config: DecodeConfig | None = None  # None: the tuning-table entry
    head_dim_v: int | None = None  # V's head dim when below K's ``head_dim``

    def __post_init__(self) -> None:
        if self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)
        if self.config is None:
            entry = config_for(self.arch, self.head_dim, self.dtype, self.features.fp8, self.head_dim_v)
            object.__setattr__(self, "config", entry)

    @property
    def seq_tokens(self) -> int:
        """Query tokens the schedule makes a sequence of their own (``SEQ_TOKENS``): in the
        batch-invariant mode each of a call's Tq tokens is decoded as a one-token sequence over the
        keys up to its own, so that its bits are those of its one-token decode (docs/design.md); 1
        otherwise."""
        return self.features.num_tokens if self.features.batch_invariant else 1

    @property
    def unit_tokens(self) -> int:
        """Query tokens in the rows of a schedule sequence's head unit: Tq, or 1 when each token is a
        sequence of its own (``seq_tokens``)."""
        return self.features.num_tokens // self.seq_tokens

    @functools.cached_property
    def constexprs(self) -> dict[str, Any]:
        """The kernel's compile-time arguments."""
        config, f = self.config, self.features
        rows = self.unit_tokens * self.group
        block_g = block_g_for(rows, config, f.batch_invariant, f.one_sequence)
        col_blocks = config.v_col_blocks(block_g, f.batch_invariant)
        units = math.ceil(rows / block_g) * col_blocks
        head_dim_v = self.head_dim_v or self.head_dim
        block_d = padded_head_dim(head_dim_v) // col_blocks
        tail = self.head_dim - head_dim_v  # K's columns past V's
        paged = self.page_size is not None
        cols = merge_cols(block_g, block_d, config.merge_wave_elems)
        # The batch-invariant mode's chunk is its schedule's tile (invariant.py); the default mode
        # ignores IGROUP.
        tile_n, igroup = (
            config.invariant_chunks(block_g) if f.batch_invariant else (config.tile_n, INVARIANT_GROUP_CHUNKS)
        )
        return {
            "GROUP": self.group,
            "TQ": f.num_tokens,
            "HEAD_DIM": head_dim_v,
            "BLOCK_D": block_d,
            "HEAD_DIM_T": tail,
            "BLOCK_DT": padded_head_dim(tail) if tail else 0,
            "V_IN_K": f.v_in_k,
            "SCORES_T": config.scores_t(block_g, f.batch_invariant),
            "BLOCK_G": block_g,
            "NUM_GC": units,
            "NUM_VC": col_blocks,
            # The schedule's lanes (schedule.py): a KV head's head units read each key together. The
            # batch-invariant mode's folds (folds.py) address one lane.
            "LANES": 1 if f.batch_invariant else units,
            "BLOCK_N": config.block_n_for(block_g),
            "TILE_N": tile_n,
            "PAGED": paged,
            "PAGE_SIZE": self.page_size or 1,
            "MIN_TILES": MIN_TILES_PER_PROGRAM,
            "MAX_CONTRIB": config.contributors_for(f.one_sequence),
            "FANIN": MERGE_FANIN,
            # Partials a merge loads at once (their slices, in the default mode; the batch-invariant
            # mode's folds load them whole).
            "WAVE": merge_wave(block_g, block_d, config.merge_wave_elems)
            if f.batch_invariant or cols == block_d
            else merge_wave(block_g, cols, MERGE_SLICE_WAVE_ELEMS),
            "MERGE_COLS": cols,
            # The batch-invariant mode folds a split group's chunks and an output's supergroups in
            # column slices where its partials are merged in slices (``folds.finish_group``,
            # ``output_fold.finish_output``), this many slices' values at once (a wave of the
            # entry's size, as its whole folds load); 0: whole, or no such fold.
            "SLICE_WAVE": merge_wave(block_g, cols, config.merge_wave_elems)
            if f.batch_invariant and cols < block_d
            else 0,
            "MERGE_POLLS": INTERPRETER_MERGE_POLLS if self.arch == "interp" else config.merge_polls,
            "BLOCK_B": SCHEDULE_BLOCK_B,
            "DOT_PRECISION": "ieee" if self.dtype == torch.float32 else "tf32",
            "HAS_LEFTPAD": f.leftpad,
            "HAS_WINDOW": f.window,
            "SOFTCAP": f.softcap,
            "HAS_SINKS": f.sinks,
            "HAS_SCALES": f.fp8 is not None,
            "E4M3_BITS": e4m3_as_bits(f.fp8, self.arch),
            "SAME_KV_STRIDES": paged and config.share_kv_addresses and not f.kv_strides_differ,
            "INVARIANT": f.batch_invariant,
            "IGROUP": igroup,
            "ISUPER": INVARIANT_SUPER_GROUPS,
            "SEQ_TOKENS": self.seq_tokens,
        }

    @property
    def block_g(self) -> int:
        return self.constexprs["BLOCK_G"]

    @property
    def lanes(self) -> int:
        """Lanes of the schedule (``LANES``, schedule.py): a KV head's row blocks, read in step; 1 in
        the batch-invariant mode. The grid has at least one program a lane."""
        return self.constexprs["LANES"]

    @property
    def row_blocks(self) -> int:
        """Head units per KV head (``NUM_GC``): its row blocks, each in ``NUM_VC`` column blocks.
        Each reads every key of the KV head."""
        return self.constexprs["NUM_GC"]

    def compile_options(self) -> dict[str, int | bool]:
        """Triton launch options (warps, stages, register cap) of this variant."""
        return self.config.compile_options(self.page_size is not None, self.block_g, self.features.batch_invariant)

    @property
    def num_warps(self) -> int:
        return self.compile_options()["num_warps"]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Everything a call's metadata decides. ``kernel`` is None when the torch backend runs it."""

    batch: int
    num_q_heads: int
    head_dim: int  # q's and K's; V's and out's is ``layout.head_dim_v``
    dtype: torch.dtype  # q's
    device: torch.device
    layout: CacheLayout
    features: Features
    window: int | None
    kernel: KernelVariant | None = None
    num_programs: int = 0  # the persistent grid; 0 on the torch backend
    num_sms: int = 0  # SMs the grid is spread over (a divisor of num_programs)
    gluon: bool = False  # the Gluon MLA kernel runs it (``mla_gluon.gluon_takes``), not ``kernel``

    @property
    def group(self) -> int:
        return self.num_q_heads // self.layout.num_kv_heads

    @property
    def head_units(self) -> int:
        """Units of the schedule per schedule sequence: KV heads x head units per KV head."""
        return self.layout.num_kv_heads * self.kernel.row_blocks

    @property
    def schedule_batch(self) -> int:
        """Sequences of the schedule: the batch's, or each of their query tokens (``KernelVariant.seq_tokens``)."""
        return self.batch * self.kernel.seq_tokens

    @property
    def max_span(self) -> int:
        """Keys of a schedule sequence that any of its queries sees: ``window + Tq - 1`` with a
        window (Tq its query tokens), else all of them (``NO_SPAN_LIMIT``)."""
        tokens = self.kernel.unit_tokens if self.kernel else self.features.num_tokens
        return span_limit(self.window, tokens)

    @property
    def max_groups(self) -> int:
        """Most chunk groups one output has in the batch-invariant mode."""
        cx = self.kernel.constexprs
        return invariant_groups(self.layout.capacity, self.max_span, cx["TILE_N"], cx["IGROUP"])

    @property
    def group_slots(self) -> int | None:
        """Workspace slots of group and supergroup values in the batch-invariant mode (one per
        group and per supergroup of each output: ``invariant_slots``), None otherwise; sized from
        shapes, never from lengths."""
        if not self.features.batch_invariant:
            return None
        return self.schedule_batch * self.head_units * invariant_slots(self.max_groups)


def span_limit(window: int | None, num_tokens: int) -> int:
    """Keys of a sequence that any of its ``num_tokens`` queries sees (``DecodePlan.max_span``)."""
    return window + num_tokens - 1 if window is not None else NO_SPAN_LIMIT


def invariant_slots(max_groups: int) -> int:
    """Workspace slots of one output in the batch-invariant mode: its groups' values, then its
    supergroups' (the kernel's ``invariant.out_slots``)."""
    return max_groups + -(-max_groups // INVARIANT_SUPER_GROUPS)


def invariant_groups(capacity: int, max_span: int, tile_n: int, group_chunks: int) -> int:
    """Most chunk groups one output has in the batch-invariant mode (every length is clamped to
    the capacity, and at most ``max_span`` keys are tiled), for chunks of ``tile_n`` keys in
    groups of ``group_chunks`` (``DecodeConfig.invariant_chunks``)."""
    tiles = -(-min(capacity, max_span) // tile_n)
    return -(-tiles // group_chunks)


def check_tile_count(batch: int, head_units: int, capacity: int, tile_n: int) -> None:
    """``ValueError`` unless the schedule's int32 tile arithmetic holds for any lengths: each length
    is clamped to the capacity, so the most tiles a batch can have is what must fit."""
    if capacity > NO_SPAN_LIMIT or batch * head_units * -(-capacity // tile_n) >= 2**31:
        raise ValueError(
            f"k_cache: expected a capacity of at most {NO_SPAN_LIMIT} keys per sequence and fewer than 2**31 "
            f"LeanTiles of {tile_n} keys for the batch at full capacity, got capacity {capacity}, batch {batch}, "
            f"{head_units} head units"
        )
