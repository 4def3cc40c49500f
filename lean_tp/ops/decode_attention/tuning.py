"""The one table of tuning constants for the decode kernel, each with the reason it holds.

A configuration is chosen by (architecture, padded head_dim, element size of the cache: 1 for
fp8, 2 for fp16/bf16, 4 for fp32; an fp8 cache always comes with a 16-bit q). A V head dim below
K's (MLA) has its own entries, keyed by K's head dim and naming V's (``DecodeConfig.head_dim_v``).
``arch`` is a key of ``archs.ARCHS`` ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120"), whose
entry names the architecture whose tuning it takes where the table has no entry of its own key
(sm_86, sm_89 and sm_120 take sm_80's, sm_100 sm_90's), or ``"interp"`` for the Triton
interpreter on CPU, where nothing is timed and only correctness matters.

The GPU values come from the LeanAttention paper's findings (A100, fp16), register and
shared-memory arithmetic, and the compiled code read on CPU (``python -m
lean_tp.tools.kernel_report``, docs/kernel_report.md); none is timed on a GPU
(``benchmarks/bench_decode.py`` times them, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from lean_tp.ops.decode_attention.archs import ARCHS, arch_for_capability, cuda_index
from lean_tp.ops.utils import major_minor

# The merge tree of a split output (docs/design.md, "The merge tree"). Contributors are grouped by
# program index into groups of MERGE_FANIN; the last arriver of each group merges it, and the last
# group merger merges the groups. The serial chain is then at most MERGE_FANIN + ceil(C / MERGE_FANIN)
# partials for C contributors. At 8, a group's partials of the TP shape (8 rows x D=128, fp32: 4 KB
# each, 32 KB a group) take ~0.3 us of the merger's L2 port on an H100, and 8 x 8 covers
# MAX_CONTRIBUTORS.
MERGE_FANIN = 8
# Most programs that share one output: MERGE_FANIN ** 2 keeps the chain within 2 x MERGE_FANIN = 16
# partials. The schedule's cost rule gives each program at least cdiv(T - 1, 63) of an output's T
# tiles instead of splitting it further. In the simulator's model (``lean_tp.tools.simulate``) 64 programs
# on 64 SMs keep 64 x 64 KB in flight, above Little's law's 3.0 TB/s x 0.7 us = 2.1 MB on an H100,
# so one output still streams at HBM bandwidth, while a third level would add L2 round trips.
MAX_CONTRIBUTORS = MERGE_FANIN**2
# Reads of a merge's counter that a contributor with no tiles left makes before it leaves the merge
# to its last arriver (``merge.finish_split``): each is an L2 atomic round trip, about 0.15 us on an
# H100 (``gpus.GPUModel.l2_latency_cycles``), so 64 wait about 10 us, longer than a group's merge by
# one program (a 16 x 512 partial's group of 8: 3.7 us modelled) and short beside a decode step.
MERGE_POLLS = 64
# fp32 elements of the partials' slices a merge in slices loads at once (``plan.merge_cols``): 2 of
# MLA's 16 x 64 slices. A group's 8 at once make triton 3.6's 16-row MLA K/V loop spill on sm_90 (9
# local accesses an iteration at 16 bits, 32 e4m3) and 4 lengthen it (674 and 913 SASS an
# iteration), where 2 compile to 633 and 857 against 647 and 866 for one whole 16 x 512 partial a
# wave (triton 3.7.1, which spills in none of them: 660 and 856 against 644 and 864).
MERGE_SLICE_WAVE_ELEMS = 2048


# Query rows of a block that the narrow-block settings (DecodeConfig.max_registers,
# narrow_block_n) apply to: one GQA group of up to 16 heads, or 16 MLA heads at TP 8.
NARROW_ROWS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Launch settings of ``decode_attention_fwd_kernel`` for one (arch, head_dim, cache element size)."""

    tile_n: int  # T_n: tokens in one LeanTile, the unit of stream-K work
    block_n: int  # keys loaded per inner iteration; divides tile_n
    max_block_g: int  # most query rows (one GQA group, padded) computed together
    num_warps: int
    num_stages: int
    max_programs_per_sm: int  # cap on the occupancy-derived programs per SM
    reason: str
    # fp32 elements of partials the merge loads per loop iteration ([members, BLOCK_G, BLOCK_D]),
    # and the batch-invariant folds per wave (invariant.py): fewer L2 round trips per merge level
    # or fold, at the price of registers (see _WAVE80, _WAVE90).
    merge_wave_elems: int = 1024
    # Paged caches: V's key addresses are K's (when V's strides equal K's) instead of formed a
    # second time from the same page ids (see _NO_SHARE). Contiguous caches never share: there a
    # key's address is one multiply-add, sharing saved 0-9 SASS per iteration and cost sm_80
    # D=256 and sm_90 D=64 a program per SM (kernel report, compiled as launched).
    share_kv_addresses: bool = True
    # Paged caches: pipeline stages when set, else num_stages. The kernel looks each block's page
    # ids up in the K/V loop; the pipeliner copies them to shared memory a stage ahead of the K/V
    # copies they address, and keeps 2 K/V buffers with 5 stages (with 3 or 4 that loop compiles
    # to one K/V buffer and wait_group 0). See _AHEAD.
    paged_stages: int = 0
    # Registers per thread ptxas may use (Triton's ``maxnreg``) for blocks of at most 16 query rows
    # (decode with GQA groups up to 16), where its own choice costs a program per SM; None leaves
    # it to ptxas. Larger row blocks hold 2-4x the accumulators and would spill in the K/V loop
    # under the cap. See _REGS.
    max_registers: int | None = None
    # Keys per inner iteration of blocks of at most NARROW_ROWS query rows when set, else block_n:
    # such a block's score product is as long a chain whatever its keys, so more keys an iteration
    # cut the loop's instructions and shared-memory reads per key where registers and shared
    # memory allow. See _MLA_KEYS64.
    narrow_block_n: int | None = None
    # The same cap for the batch-invariant variant alone, where the default needs none: its
    # chunk-end block in the K/V loop (chunks.attend_chunks) raises ptxas's choice past an
    # occupancy step that the default stays under. See _REGS_INVARIANT.
    invariant_max_registers: int | None = None
    # Warps of the batch-invariant variant when not num_warps: its loop holds a chunk's and a
    # group's state, and fewer threads spend fewer registers on addresses. See _WARPS_INVARIANT.
    invariant_num_warps: int | None = None
    # V's head dim when it is below K's (MLA: a 576-dim latent + rope row as K, its first 512 dims
    # as V); None for equal head dims. The table's key names K's head dim.
    head_dim_v: int | None = None
    # Most programs that share one output (the schedule's cost rule): MAX_CONTRIBUTORS unless an
    # architecture needs more programs to keep an output's reads at copy bandwidth (see _B200).
    max_contributors: int = MAX_CONTRIBUTORS
    # Row blocks of at least this many query rows compute their scores keys-major (K q^T,
    # ``attend._qk``); None: never. See _MLA_ROWS.
    scores_t_rows: int | None = None
    # Reads of a merge's counter a contributor with no tiles left makes before it leaves the merge
    # to its last arriver: MERGE_POLLS.
    merge_polls: int = MERGE_POLLS
    # max_block_g of the batch-invariant variant when not max_block_g: its K/V loop holds two
    # states (a chunk's and a group's), which at 64 rows spill, unless its wide blocks take
    # invariant_wide_tile_n. See _MLA_ROWS.
    invariant_max_block_g: int | None = None
    # Keys a chunk of the batch-invariant variant's blocks of more than NARROW_ROWS rows when set,
    # each chunk its own group (``invariant_chunks``): its K/V loop holds one state. None: their
    # chunks are tile_n keys, folded in groups of INVARIANT_GROUP_CHUNKS. See _MLA_INVARIANT.
    invariant_wide_tile_n: int | None = None
    # Row blocks of at least this many query rows are computed in two head units, each holding
    # half of V's columns (``rows.unit_cols``) and computing the whole score; None: never. See
    # _MLA_COLS.
    split_v_rows: int | None = None
    # Pipeline stages fewer than num_stages (paged: paged_stages) in kernels whose row blocks are
    # split by columns: their q block takes most of the shared memory. See _MLA_COLS.
    split_v_fewer_stages: int = 0
    # max_block_g of a call of one sequence and one query token in the default mode
    # (``Features.one_sequence``) whose rows the entry computes in column halves (split_v_rows):
    # more, narrower row blocks give its few tiles more programs and merge narrower partials.
    # See _MLA_ONE_SEQUENCE.
    one_sequence_max_block_g: int | None = None
    # max_contributors of a call of one sequence and one query token (``Features.one_sequence``),
    # whose one output per KV head leaves SMs idle at max_contributors; None: max_contributors.
    # See _MLA_CONTRIBUTORS.
    one_sequence_max_contributors: int | None = None
    # Calls whose query rows on a KV head (Tq x heads) number at least this run on the Gluon MLA
    # kernel (``lean_tp.ops.mla_gluon``) where it takes them (``mla_gluon.gluon_takes``); None:
    # never. See _MLA_GLUON.
    gluon_rows: int | None = None

    def compile_options(self, paged: bool, block_g: int, invariant: bool = False) -> dict[str, int | bool]:
        """Triton launch options of a kernel with ``block_g`` query rows per block: warps,
        pipeline stages (``paged_stages`` for a paged cache when set, fewer by
        ``split_v_fewer_stages`` for blocks split by columns), FP fusion (``FP_FUSION``),
        and ``maxnreg`` where the entry caps registers (``invariant``: the batch-invariant
        variant's warps and cap, when set) and the installed Triton is one the caps were read on."""
        stages = self.paged_stages if paged and self.paged_stages else self.num_stages
        if self.v_col_blocks(block_g, invariant) > 1:
            stages -= self.split_v_fewer_stages
        warps = (invariant and self.invariant_num_warps) or self.num_warps
        options = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": FP_FUSION}
        cap = (invariant and self.invariant_max_registers) or self.max_registers
        capped = cap and block_g <= NARROW_ROWS and major_minor(triton.__version__) >= REGISTER_CAPS_SINCE
        return options | ({"maxnreg": cap} if capped else {})

    def v_col_blocks(self, block_g: int, invariant: bool = False) -> int:
        """Head units a row block of ``block_g`` query rows is computed in (``split_v_rows``): 2, each
        with half of V's columns, or 1. The batch-invariant variant keeps whole rows."""
        return 2 if self.split_v_rows and block_g >= self.split_v_rows and not invariant else 1

    def scores_t(self, block_g: int, invariant: bool = False) -> bool:
        """Whether a row block of ``block_g`` query rows computes its scores keys-major (K q^T,
        ``scores_t_rows``): not in blocks split by columns, whose q K^T is a wgmma that reads q
        once a warp group."""
        rows_t = self.scores_t_rows is not None and block_g >= self.scores_t_rows
        return rows_t and self.v_col_blocks(block_g, invariant) == 1

    def invariant_chunks(self, block_g: int) -> tuple[int, int]:
        """(keys a chunk, chunks a group) of the batch-invariant variant with blocks of ``block_g``
        query rows: (invariant_wide_tile_n, 1) for blocks wider than NARROW_ROWS where it is set,
        else (tile_n, INVARIANT_GROUP_CHUNKS). A chunk is the schedule's tile (invariant.py)."""
        if self.invariant_wide_tile_n and block_g > NARROW_ROWS:
            return self.invariant_wide_tile_n, 1
        return self.tile_n, INVARIANT_GROUP_CHUNKS

    def block_n_for(self, block_g: int) -> int:
        """Keys per inner iteration of a block of ``block_g`` query rows (``narrow_block_n``)."""
        return self.narrow_block_n if self.narrow_block_n and block_g <= NARROW_ROWS else self.block_n

    def __post_init__(self) -> None:
        for name in (
            "tile_n",
            "block_n",
            "narrow_block_n",
            "max_block_g",
            "invariant_max_block_g",
            "one_sequence_max_block_g",
            "scores_t_rows",
            "split_v_rows",
            "gluon_rows",
            "invariant_wide_tile_n",
        ):
            value = getattr(self, name) or 16
            if value < 16 or value & (value - 1):
                raise ValueError(f"DecodeConfig.{name}: expected a power of two >= 16, got {value}")
        for name in ("block_n", "narrow_block_n"):
            keys = getattr(self, name)
            if keys and self.tile_n % keys:
                raise ValueError(f"DecodeConfig.tile_n: expected a multiple of {name}={keys}, got {self.tile_n}")
        if self.invariant_wide_tile_n and self.invariant_wide_tile_n % self.block_n:
            raise ValueError(
                f"DecodeConfig.invariant_wide_tile_n: expected a multiple of block_n={self.block_n}, "
                f"got {self.invariant_wide_tile_n}"
            )
        if self.split_v_rows and (not self.head_dim_v or self.head_dim_v & (self.head_dim_v - 1)):
            # halves of V's columns are whole blocks: BLOCK_D = head_dim_v / 2 with no padding
            raise ValueError(
                f"DecodeConfig.head_dim_v: expected a power of two with split_v_rows, got {self.head_dim_v}"
            )
        for name in ("max_contributors", "one_sequence_max_contributors"):
            value = getattr(self, name)
            if value is not None and value < 2:  # the schedule's cost rule divides by value - 1
                raise ValueError(f"DecodeConfig.{name}: expected an int >= 2, got {value}")
        # A kernel constexpr: any other type would compile a kernel of its own.
        if type(self.merge_polls) is not int or self.merge_polls < 0:
            raise ValueError(f"DecodeConfig.merge_polls: expected an int >= 0, got {self.merge_polls!r}")

    def contributors_for(self, one_sequence: bool) -> int:
        """Most programs that share one output, for a call of one sequence
        (``Features.one_sequence``) or not."""
        return (one_sequence and self.one_sequence_max_contributors) or self.max_contributors


# Least LeanTiles per active program. The paper shrank the grid to 2 tiles per program to bound
# merges; the cost rule (schedule.num_active) now launches the fewest programs that reach the least
# possible busiest-program load, which already avoids a merge that buys no time. With 2, the
# simulator's model gives the tensor-parallel shape at 4k (B=1, one KV head, H100) 16 programs and
# 3.4 us; with 1, 32 programs and 2.7 us (FlashDecoding: 2.7 us).
MIN_TILES_PER_PROGRAM = 1


# Batch-invariant mode (invariant.py): an output's chunks are folded in fixed groups of
# INVARIANT_GROUP_CHUNKS, the groups' values in supergroups of INVARIANT_SUPER_GROUPS, and the
# supergroups' values into the output, each level left to right. Groups of 8 mirror the default
# merge tree's fan-in (MERGE_FANIN): at the TP-8 rank shape at 4k (32 chunks, one per program) a
# group's last holder loads 8 partials and the supergroup 4 values, as the default's two levels
# do. Supergroups of 4 keep the middle level short where groups span two programs (16k: 4 chunks
# a program), at the price of a longer last level at long context; in the simulator, the TP-8
# rank shape (B=1, H100) takes 1.10x the default's time at 16k, 256k and 1M with 4, against
# 1.15x, 1.06x and 1.05x with 8. Workspace: one BLOCK_G x BLOCK_D fp32 value per group and per
# supergroup of each sequence's capacity and head unit (D=128 fp16: 8 KB per 1024 keys, which
# hold 512 KB of K and V, and 8 KB per 4096): 2.0% of the cache it covers.
INVARIANT_GROUP_CHUNKS = 8
INVARIANT_SUPER_GROUPS = 4
# Keys a chunk of the batch-invariant variant's MLA blocks of more than NARROW_ROWS rows
# (``DecodeConfig.invariant_wide_tile_n``), each chunk its own group. Two states of a 64-row block
# (its chunk's and its group's, 64 x 512 fp32 each) are the whole 256 KB register file of an SM, so
# such a block holds one, and writes each chunk's value at its end: a chunk of the group's 512 keys
# writes the bytes per key that the 16-row blocks' groups do (8 row blocks of 16 x 512 a group of
# 512 keys, against 2 of 64 x 512), and its K/V loop fills its pipeline once a chunk (16 blocks of
# 32 keys). See _MLA_INVARIANT.
INVARIANT_WIDE_TILE_N = 512
# Holders a split group needs for its fold to go in column slices (where the plan folds in
# slices: ``folds.finish_group``); fewer fold it whole, by its last holder. Each slice round costs
# a claim, a wave of loads and a count (3 L2 round trips), so slices pay only where holders share
# them; a group of 2 holders (long context: several chunks a program) has at most one helper, and
# its 8 slices take 4 rounds. In the simulator (``_group_ready``), over DeepSeek-V3's MLA shapes
# (A100 and H100, 16 and 128 heads, B 1-16, 4k-32k keys, Tq 1 and 2, 16-bit cache), slicing from
# 3 holders gives 0.985x the time of whole folds (geomean), from 4 0.987x, from 5 0.992x, none
# slower; from 2, the merge of H100 16 heads takes 1.4x at B=1 32k and 1.6x at B=4 128k.
INVARIANT_SLICE_HOLDERS = 3
# The same for a split supergroup (``output_fold.finish_super``), whose fold loads at most
# INVARIANT_SUPER_GROUPS values, so its slices save less than a group's. In the simulator
# (``_super_slices``), over the same shapes at 4k and 32k keys, slicing from 5 holders gives 0.978x
# the time of whole supergroup folds (geomean; A100 16 heads B=1 4k 0.78x), none slower; from 3 or
# 4, 0.976x, but a supergroup of 3 holders (2 helpers at most) or one whose holders stop waiting
# before its last group is known takes up to 1.05x (A100 16 heads at 4k: B=8 Tq 2, B=16 Tq 1).
INVARIANT_SUPER_SLICE_HOLDERS = 5

# The interpreter runs programs one after another; a handful of programs still exercises every
# straddling case the tests need, and keeps CPU test time down.
INTERPRETER_PROGRAMS = 4
# ...and so a read of a merge's counter after the first sees no count the first did not: a
# contributor with no tiles left reads it once (MERGE_POLLS on a GPU).
INTERPRETER_MERGE_POLLS = 1

# Sequences scanned per step of the on-device cumulative-tile search. Fixed (not derived from the
# batch size) so that a new batch size never recompiles; 128 covers typical decode batches in one step.
SCHEDULE_BLOCK_B = 128

_PAPER_D64 = "LeanAttention paper: 256-token LeanTiles best for D=64 (fp16, A100)"
_PAPER_D128 = "LeanAttention paper: 128-token LeanTiles best for D=128 (fp16, A100)"
_D256 = "D=256 doubles bytes per token over D=128; halving the tile keeps bytes per tile equal"
_STAGES = "; 3 stages: H100 has 228 KB smem/SM"
# On sm_80, 2 stages compile to one K/V buffer (cp.async.wait_group 0: no load overlaps compute
# inside a program); 3 give 2 buffers and 2 programs/SM for D <= 128 on every layout and feature
# (72 KB smem a program, A100 164 KB/SM). D=64 contiguous fits 2 programs instead of 3: 4 x 32 KB
# of K/V tiles per SM, 15x what Little's law asks of an A100 SM (8 KB).
_STAGES80 = "; 3 stages: 2 K/V buffers at 2 programs/SM (kernel report)"
# 128-key blocks take fewer SASS instructions per key than 64-key ones (3.8 against 4.6; paged16
# 3.4 against 5.9) and keep 1.5x the K/V bytes in flight per SM (3 programs x 32 KB blocks
# against 4 x 16 KB): kernel report, ``--set block_n=128``.
_BN128 = "; 128-key blocks: fewer SASS per key, more bytes in flight (kernel report)"
_BN64 = "; 64-key blocks: 128 would need 137 KB smem (1 program/SM on H100, 249 registers on A100)"
# Merge waves of 8192 fp32 elements: 4 partials per merge-loop iteration at D=128 (8 at D=64, 2
# at D=256), so a level of the merge tree takes 2 iterations instead of 8. sm_90 keeps 3
# programs/SM for D <= 128. On sm_80 the paged16 kernels fit 2 programs/SM (D=128: 208
# registers); 2 programs x 32 KB in flight still exceed what Little's law asks of an A100 SM
# (1.5 TB/s / 108 x 0.6 us = 8 KB), and the simulator's TP shape (B=1, one KV head, 4k-256k)
# merges 1.3-1.7 us sooner than with one partial per iteration.
_WAVE90 = "; merge: 8192-element waves, 3 programs/SM (kernel report)"
_WAVE80 = "; merge: 8192-element waves, 2 programs/SM on paged16 (enough in flight; kernel report, simulator)"
# One address per key for K and V (paged caches, V's strides equal to K's): paged16 SASS per
# iteration at sm_90 D=128 508 against 632 when V's are formed apart, sm_80 D=128 511 against
# 610, sm_90 D=256 323 against 377 with 2 programs/SM instead of 1. At sm_90 D=64 sharing saves
# 16 of 453 but takes 205 registers instead of 168 (2 programs/SM instead of 3), so that entry
# forms them apart.
_NO_SHARE = "; paged V addresses formed apart from K's: sharing them costs a program/SM here (kernel report)"
# fp8 tiles are half the bytes of 16-bit ones, so a loop iteration's fixed work (the softmax
# update, the row reductions) is spread over half the bytes; twice the keys per block restore
# bytes per iteration. Issue share (paged16, fp16 q) with doubled blocks against 16-bit ones:
# sm_90 D=64 0.32 against 0.37, D=128 0.27 against 0.36 (2 programs/SM instead of 3: 128 KB of
# K/V buffered against Little's 16 KB), D=256 0.33 against 0.47; sm_80 D=256 0.47 against 0.57
# (e4m3), 1 program/SM either way.
_FP8_BLOCKS = "; fp8: twice the 16-bit entry's keys per block (issue share, kernel report)"
# sm_80 D <= 128 with doubled blocks fit 1 program/SM (208-255 registers), not 2.
_FP8_SM80 = "; fp8: 16-bit blocks kept (doubled ones fit 1 program/SM on A100)"
# Paged caches copy each block's page ids to shared memory a stage ahead of the K/V copies they
# address (paged_stages=5), which takes the block-table load off the loop's critical path. SASS
# per iteration, ahead against carried in registers: sm_90 D=128 441 against 472, sm_80 D=128 411
# against 444, D=256 289 against 297 (sm_90) and 290 against 298 (sm_80). At D=64 ahead costs
# more instructions (sm_90 493 against 429, sm_80 475 against 437, sm_90 fp8 838 against 788),
# all within 1.15x their contiguous loops or an issue share of 0.35.
_AHEAD = "; paged: page ids copied a stage ahead (5 stages; kernel report)"
# Register caps, for blocks of at most 16 query rows (DecodeConfig.max_registers). Left to ptxas,
# D=256 takes 174-178 registers at 8 warps (1 program/SM); capped at 128 every layout and feature
# keeps 2 programs/SM with no spill in the K/V loop (sm_90 paged16: 121 registers, 293 SASS).
# Left to ptxas, sm_90 D=128 paged64, tq4 and window take 222-254 registers (2 programs/SM);
# capped at 168 every layout and feature fits 3, with at most 24 bytes of cold spills and none in
# the K/V loop. sm_90 D=64 keeps ptxas's choice: under 168 its paged loop spills.
# triton 3.6 (the oldest pin) takes 227-254 registers for the same kernels uncapped and spills in
# the K/V loop under the caps (D=256: 12-16 local loads/stores per iteration, every layout, both
# archs; sm_90 D=128 paged: 2-5), so the caps apply from triton 3.7 on: on 3.6, D=256 runs 1
# program/SM and sm_90 D=128 2, with no spills.
REGISTER_CAPS_SINCE = (3, 7)
# Floating-point contraction (a*b+c as one FMA) in every compiled kernel, set explicitly: the
# kernel report's registers, SASS and bits are read with it, triton 3.6-3.9 default to it, and
# triton 3.9 warns that its default becomes off in 3.10, which would change the compiled code and
# the output bits without a line of ours changing.
FP_FUSION = True
# The cap on programs per SM is the most that fits any layout's launched kernel (kernel report);
# the launcher lowers it to what the launched kernel fits (paged kernels use more registers).
_FITS = "; programs/SM cap: what fits (kernel report), not timed"
_FP8 = "fp8: the 16-bit entry"
_REGS = "; at most 128 registers: 2 programs/SM (kernel report)"
_REGS90 = "; at most 168 registers: 3 programs/SM for every layout and feature (kernel report)"
# sm_90 D=64: the batch-invariant variant takes 255 registers left to ptxas (2 programs/SM, the
# default 158-195 and 3); capped at 168 it fits 3 with no spill in the K/V loop. The default keeps
# ptxas's choice (under the cap its paged loop spills, see the caps above).
_REGS_INVARIANT = "; invariant variant at most 168 registers: 3 programs/SM (kernel report)"
# D=256: the batch-invariant variant's chunk and group states take 32 of the 128 registers a
# thread has at 8 warps (2 programs/SM), and its loop spilled (sm_90: 12 local accesses an
# iteration, sm_80: 6). At 4 warps and up to 255 registers a program has the same register file
# (2 programs/SM) with half the threads' address and index registers: no loop spill, and fewer
# SASS issued an iteration (sm_90 paged16: 774 x 4 warps against 553 x 8).
_WARPS_INVARIANT = "; invariant variant 4 warps, 255 registers: 2 programs/SM, no loop spill (kernel report)"

# MLA decode (DeepSeek-V2/V3, Kimi-K2): one latent KV head of 576 dims (512 latent + 64 rope) read
# by 16 (TP 8) to 128 (TP 1) query heads, V its first 512 dims, read from K's tile (V_IN_K): 1152
# bytes a key at 16 bits (kernel report: 144 bytes copied per thread per 32-key iteration at 8
# warps; 2176 when V is a tensor of its own). 64-key tiles hold 72 KB of latent rows, the bytes of
# a D=128 fp16 tile of 128 keys (see _PAPER_D128).
_MLA = "MLA 576/512: V read from K's tile; 64-key tiles = 72 KB, as a D=128 128-key tile"
# At 8 warps 16-row blocks (q 16 x 576, every warp's dot operand) take 172-219 registers and no
# K/V-loop spill: 1 program/SM with 2 K/V buffers of 36 KB, 4x what Little's law asks of an SM.
# A row block reads every latent row, so 128 heads (DP attention) in 16-row blocks read each row
# 8 times. On sm_90 64-row blocks read it twice: with the scores computed keys-major (K q^T,
# ``attend._qk``: a 32-key block's scores are one mma.sync product no warp group repeats, and the
# P.V product is a wgmma split over the two warp groups; q^T is copied to shared memory once a
# segment) and the merge's partials read in column slices (``plan.merge_cols``: the merger holds no
# 64 x 512 state, whose registers otherwise spill in the K/V loop), 64-row blocks take
# 150 KB of smem, 2 K/V buffers, 16-byte loads, 716 SASS a 32-key iteration against 4 x 521 for
# 16-row blocks, and no K/V-loop spill at 16 bits and one token (at 255 registers, an e4m3 cache at
# 64 and 128 heads and Tq 4 reload 1-10 loop-invariant words an iteration; kernel report). The
# batch-invariant variant takes whole 64-row blocks with one state in its loop (_MLA_INVARIANT).
# sm_80 runs blocks of up to 32 rows: 64-row blocks there spill 2-6 local
# accesses an iteration (mma.sync for both products; 16- and 32-key blocks, 3-5 stages, 16 warps
# tried). 32-row blocks (scores keys-major, merged in column
# slices) take 222-251 registers, no K/V-loop spill, 2 K/V buffers and 108-111 KB, at 572 SASS a
# 32-key iteration against 2 x 459 for two 16-row blocks (e4m3 649 against 2 x 565; paged16), and
# read 13.6 KB of shared memory a key against 2 x 8.8 KB: 128 heads read each latent row 4 times,
# not 8. Its batch-invariant variant takes them too (_MLA_INVARIANT). The cost is the
# merge of wider partials where an output is split (64 KB a contributor): the simulator's A100
# gives DeepSeek-V3 DP at B >= 32 0.50-1.01x FlashMLA against 0.25-0.53x, and B=1 at 4k 21.8 us
# against 14.5 (sm_90's 64-row blocks measured the same trade on an H200: BENCHMARKS.md).
_MLA_ROWS = "; 8 warps, 16-row blocks: no K/V-loop spills, 1 program/SM (kernel report)"
_MLA_ROWS32 = "; 8 warps, 32-row blocks (scores K q^T, merged in column slices): no K/V-loop spill, 1 program/SM"
_MLA_ROWS64 = (
    "; 8 warps, 64-row blocks (32 rows up: scores K q^T, merged in column slices): no K/V-loop spill at "
    "16 bits, 1 program/SM"
)
# A 16-row block's score product (q K^T, mma.sync: 16 x 8 tiles over warpsPerCTA [1, 8]) is a chain of
# 36 dependent multiply-adds a warp (576 columns / 16) however many keys a block holds. At 32-key
# blocks warps 4-7 repeat warps 0-3's tiles, and each of the 8 warps reads all of q (16 x 576, 18 KB)
# from shared memory every iteration. 64-key blocks give each warp 8 keys of its own: on sm_90 at 16
# rows 660 SASS and 306 KB of shared-memory reads an iteration (222 registers, no K/V-loop spill, 2
# K/V buffers, 165 KB of shared memory) against 2 x 497 and 2 x 266 KB for two 32-key iterations
# (e4m3: 571 against 2 x 449; kernel report). The simulator's loop time for it is the measured
# 32-key loop scaled by SASS an iteration (``gpus.LOOP_US``). 64 rows keep 32-key blocks: 64-key
# blocks of 64 rows take 304 KB of shared memory.
_MLA_KEYS64 = "; 16-row blocks of 64 keys: 660 SASS an iteration against 2 x 497 at 32 (kernel report)"
# DP attention's 128 heads on sm_90 run as one 128-row block in two head units that each hold
# half of V's columns (``split_v_rows``, ``rows.unit_cols``) and compute the whole score: q K^T as a
# wgmma over the two warp groups (64 rows each) with q in shared memory, P.V (128 x 256 fp32: 128
# registers a thread) a second. Where a 64-row block's mma.sync score has every warp read the whole
# K tile, each warp group reads q's rows and the K tile once a block: 259 KB of shared-memory reads
# a 32-key iteration against 410 KB, 571 SASS against 670 (e4m3: 289 against 431 KB, 749 SASS
# against 748), for the same 2 reads of each latent row and no K/V-loop spill at 16 bits (paged64;
# the score costs 13.6 MFLOP a 32-key block of 128 heads against 8.9). q takes 144 KB of shared
# memory, and with every product on wgmma the pipeliner holds a K/V buffer a stage longer (the P.V
# product still reads it), so 2 K/V buffers fit (a stage fewer at 16 bits:
# ``split_v_fewer_stages``, 217 KB) only with each block's copy issued in the iteration before it
# (cp.async.wait_group 0), and 3 take 252 KB; e4m3 keeps its stages (2 buffers, 213 KB). Measured on
# an H200 (docs/results/2026-11-27-nvidia-h200.json, DeepSeek-V3 paged64, against 64-row blocks,
# the benchmark's ``lean-rows64``): B=32 1280 against 1408 us at 32k and 195 against 209 at 4k
# (e4m3: 1563 against 1959, 233 against 281); B=1 within 2% either way. 64 heads and fewer keep
# whole 64-row blocks; the batch-invariant variant keeps whole rows.
_MLA_COLS = "; 128-row blocks in column halves (split_v_rows): a stage fewer at 16 bits (H200 measured)"
# One sequence of DP attention's 128 heads has few tiles for the SMs: in two 128-row head units,
# 2 x 64 tiles at 4k keys, each program's partial 128 x 256 fp32, merged through few SMs. In 16-row
# blocks of 64 keys (8 row blocks) it has 4x the tiles and partials of 16 x 512. Measured on an
# H200 (docs/results/2026-11-27-nvidia-h200.json, DeepSeek-V3 paged64, the benchmark's
# ``lean-rows16`` against the entry): B=1 42 against 97 us at 4k and 104 against 140 at 32k; at
# B=32 1.6-2.3x slower, so only a call of one sequence (and one query token: Tq 2 is unmeasured)
# takes them, and only where its rows would take column halves (64 heads are unmeasured). e4m3
# keeps its blocks: 43 against 103 at 4k but 166 against 151 at 32k. At 128k the loop of 8 row
# blocks is the time: the model puts one sequence there at 355 us against 214 in column halves
# (H100, docs/simulator/mla.md; unmeasured), a cost no shape can tell apart from 4k's gain
# (lengths are values: choosing by them would sync).
_MLA_ONE_SEQUENCE = "; one sequence (B=1, Tq 1): 16-row blocks, 2.3x at 4k and 1.3x at 32k (H200 measured)"
# DP attention's heads at 16 bits run on the Gluon kernel (``lean_tp.ops.mla_gluon``: 64-row
# blocks with q and K/V in shared memory by TMA, both products on wgmma, a merge kernel of its
# own). Measured on an H200 (docs/results/2026-11-27-nvidia-h200-5.json, DeepSeek-V3's 128 heads,
# paged64, the benchmark's ``lean-gluon`` against this entry's Triton kernel): 1.72-1.95x from B=1
# at 32k to B=128 (B=32 32k 669 against 1276 us, B=128 32k 2721 against 4891), 0.95x at B=1 4k
# (38.6 against 36.8 us). Kimi-K2's 64 heads a token (64 rows, the kernel's block) route too: the
# call is untimed, but both kernels' 64-row iterations are measured there (the Gluon kernel's 2.7
# us for 64 keys, ``simulate.gluon.GLUON_LOOP_US``, against the Triton kernel's 64-row block at
# 2.84 us for 32 keys, ``gpus.LOOP_US``) and the Gluon kernel's CUDA test runs 64 heads against
# float64; the simulator gives Kimi-K2 under DP 1.6-1.8x from B=8 and 1.1-1.5x at B=1 (H100:
# 0.96-1.05x FlashMLA from B=8, against 0.56-0.64x on the Triton kernel). fp16 stays on Triton
# (the kernel takes a bf16 q). The kernel reads e4m3 caches too (each block converted to bf16 in
# shared memory), untimed on a GPU: the e4m3 entry sets no gluon_rows until
# benchmarks/mla_decode_gluon.py's e4m3 lines say it is faster.
_MLA_GLUON = "; 64+ rows of a bf16 cache on the Gluon kernel (gluon_rows): 1.72-1.95x but 0.95x at B=1 4k (H200)"
# One long sequence of one token at TP 8 (16 heads, one row block) is split over at most
# max_contributors programs: 64 leave half an H100's or H200's SMs idle. Measured on an H200
# (docs/results/2026-11-27-nvidia-h200-4.json, the benchmark's ``lean-contributors128``, 128 for
# every call, against 64): B=1 32k 48.6 against 54.2 us (16-bit) and 58.1 against 70.8 (e4m3),
# B=1 4k and B=32 within 1%; at 128 heads within 1% everywhere. Only such a call takes 128
# (one_sequence_max_contributors; the batch-invariant mode's too, unmeasured, whose bits do not
# depend on the cap: the simulator puts one token at TP 8 from 32k at 1.05-1.10x the default's
# time against 1.59-1.92x at 64), and one sequence of drafts whose rows fit one 16-row block, the
# same rows and partials (``plan.is_one_sequence``: Kimi-K2's 8 heads at Tq 2; unmeasured, the
# simulator puts it on an H100 at 0.68x the time of 64 at 32k and 0.57x at 128k). DeepSeek-V3's
# Tq 2 merges 32-row partials, and the simulator puts 128 there at 0.87x of 64 at 32k
# (docs/simulator/mla.md; unmeasured). The merge tree's chain grows to 8 + 16 partials.
_MLA_CONTRIBUTORS = "; one sequence of one token: 128 contributors, B=1 32k 1.11x (16-bit), 1.22x (e4m3) (H200)"
# The batch-invariant variant of DP attention's rows: 64-row blocks on sm_90, 32 on sm_80 (16-row
# blocks read each latent row 8 times at 128 heads). Such a block's K/V loop cannot hold the two
# states the 16-row blocks fold chunks in (a chunk's and its group's: two 64 x 512 fp32 states are
# an SM's whole 256 KB register file; 32-row blocks spilled 28 local accesses an iteration on
# sm_90, 30 on sm_80), so its chunks are INVARIANT_WIDE_TILE_N = 512 keys, each its own group,
# attended in a K/V loop of their own from a fresh state (``chunks._attend_group_chunks``).
# Compiled as launched (paged64, 128 heads; kernel report): sm_90 676 SASS a 32-key iteration
# (the default's 64-row block: 652), 2 K/V buffers, 16-byte loads, 243 registers and no spill (Tq
# 4, e4m3 and every feature too: 242-254 registers); its folds go in column slices
# (``folds._fold_in_slices``), for a 64 x 512 value folded whole holds two such states, and with
# them ptxas reloaded 6-15 words an iteration inside the K/V loop and spilled 1.2 KB; sm_80's
# 32-row blocks 569 SASS, no spill (Tq 4 and e4m3 too). The schedule deals 512-key tiles, so a
# short sequence has few: modelled on an
# H100 (simulator, unmeasured), DP attention at 16 bits takes 2.11-2.22x the default's time from B=8
# (DeepSeek-V3, Tq 1 and 2; Kimi-K2 1.77-1.85x from 32k) against 3.56-4.85x in 16-row blocks, 82
# of the 96 DP shapes are faster (0.44-0.99x the 16-row blocks' time), and B=1 slower at 4k (54.2
# us against 9.4-15.5: 16 tiles for 132 SMs) and for Kimi-K2 at 32k-128k (1.10-1.20x); the A100
# (32-row blocks) 80 of 96 faster, B=1 at 4k up to 2.38x slower.
_MLA_INVARIANT = (
    "; invariant variant the same wide blocks, one state, 512-key chunks, folds in column slices: no spill "
    "(kernel report, simulator)"
)
_MLA_FP8_SM80 = "; fp8 on sm_80: 16-bit blocks kept (64-key blocks take 163 KB of smem, the A100's limit)"
_MLA_FP8 = "MLA 576/512 fp8: 32-key blocks, as 16-bit (64-key blocks of 64 rows take 280 KB of smem)"


TUNING_TABLE: dict[tuple[str, int, int], DecodeConfig] = {
    # 16-bit caches (fp16, bf16): 2 bytes per element.
    ("sm80", 64, 2): DecodeConfig(
        tile_n=256,
        block_n=128,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_PAPER_D64 + _BN128 + _STAGES80 + _FITS + _WAVE80 + _AHEAD,
    ),
    ("sm80", 128, 2): DecodeConfig(
        tile_n=128,
        block_n=64,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_PAPER_D128 + _BN64 + _STAGES80 + _FITS + _WAVE80 + _AHEAD,
    ),
    ("sm80", 256, 2): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=32,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=2,
        merge_wave_elems=8192,
        paged_stages=5,
        max_registers=128,
        invariant_num_warps=4,
        invariant_max_registers=255,
        reason=_D256 + _STAGES80 + _FITS + _WAVE80 + _AHEAD + _REGS + _WARPS_INVARIANT,
    ),
    ("sm90", 64, 2): DecodeConfig(
        tile_n=256,
        block_n=128,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        share_kv_addresses=False,
        paged_stages=5,
        invariant_max_registers=168,
        reason=_PAPER_D64 + _STAGES + _BN128 + _FITS + _WAVE90 + _NO_SHARE + _AHEAD + _REGS_INVARIANT,
    ),
    ("sm90", 128, 2): DecodeConfig(
        tile_n=128,
        block_n=64,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        paged_stages=5,
        max_registers=168,
        reason=_PAPER_D128 + _STAGES + _BN64 + _FITS + _WAVE90 + _AHEAD + _REGS90,
    ),
    ("sm90", 256, 2): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=32,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=2,
        merge_wave_elems=8192,
        paged_stages=5,
        max_registers=128,
        invariant_num_warps=4,
        invariant_max_registers=255,
        reason=_D256 + _STAGES + _FITS + _WAVE90 + _AHEAD + _REGS + _WARPS_INVARIANT,
    ),
    # fp8 caches, converted to q's 16-bit dtype: the 16-bit entries' tiles, warps and stages, with
    # key blocks doubled where that fits (see _FP8_BLOCKS).
    ("sm80", 64, 1): DecodeConfig(
        tile_n=256,
        block_n=128,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_FP8 + _FP8_SM80 + _FITS + _WAVE80 + _AHEAD,
    ),
    ("sm80", 128, 1): DecodeConfig(
        tile_n=128,
        block_n=64,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_FP8 + _FP8_SM80 + _FITS + _WAVE80 + _AHEAD,
    ),
    ("sm80", 256, 1): DecodeConfig(
        tile_n=64,
        block_n=64,
        max_block_g=32,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=2,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_FP8 + _FP8_BLOCKS + _FITS + _WAVE80 + _AHEAD,
    ),
    ("sm90", 64, 1): DecodeConfig(
        tile_n=256,
        block_n=256,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_FP8 + _FP8_BLOCKS + _FITS + _WAVE90 + _AHEAD,
    ),
    ("sm90", 128, 1): DecodeConfig(
        tile_n=128,
        block_n=128,
        max_block_g=64,
        num_warps=4,
        num_stages=3,
        max_programs_per_sm=3,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_FP8 + _FP8_BLOCKS + _FITS + _WAVE90 + _AHEAD,
    ),
    ("sm90", 256, 1): DecodeConfig(
        tile_n=64,
        block_n=64,
        max_block_g=32,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=2,
        merge_wave_elems=8192,
        paged_stages=5,
        reason=_FP8 + _FP8_BLOCKS + _FITS + _WAVE90 + _AHEAD,
    ),
    # fp32 caches: twice the bytes per key, so half the keys per block keeps registers in bounds.
    ("sm80", 64, 4): DecodeConfig(
        tile_n=128,
        block_n=32,
        max_block_g=64,
        num_warps=4,
        num_stages=2,
        max_programs_per_sm=7,
        reason="fp32: same bytes per tile as the fp16 D=64 entry" + _FITS,
    ),
    ("sm80", 128, 4): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=64,
        num_warps=4,
        num_stages=2,
        max_programs_per_sm=3,
        reason="fp32: same bytes per tile as the fp16 D=128 entry" + _FITS,
    ),
    ("sm80", 256, 4): DecodeConfig(
        tile_n=32,
        block_n=16,
        max_block_g=16,
        num_warps=8,
        num_stages=2,
        max_programs_per_sm=3,
        reason="fp32: same bytes per tile as the fp16 D=256 entry" + _FITS,
    ),
    ("sm90", 64, 4): DecodeConfig(
        tile_n=128,
        block_n=32,
        max_block_g=64,
        num_warps=4,
        num_stages=2,
        max_programs_per_sm=7,
        reason="fp32: same bytes per tile as the fp16 D=64 entry" + _FITS,
    ),
    ("sm90", 128, 4): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=64,
        num_warps=4,
        num_stages=2,
        max_programs_per_sm=5,
        reason="fp32: same bytes per tile as the fp16 D=128 entry" + _FITS,
    ),
    ("sm90", 256, 4): DecodeConfig(
        tile_n=32,
        block_n=16,
        max_block_g=16,
        num_warps=8,
        num_stages=2,
        max_programs_per_sm=4,
        reason="fp32: same bytes per tile as the fp16 D=256 entry" + _FITS,
    ),
    # Interpreter: tile and block sizes as on the GPU so the tests' T_n-1, T_n, T_n+1 lengths and
    # block boundaries mean the same thing.
    ("interp", 64, 2): DecodeConfig(
        tile_n=256,
        block_n=128,
        max_block_g=64,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        reason="interpreter: mirrors the sm90 D=64 entry, untimed",
    ),
    ("interp", 128, 2): DecodeConfig(
        tile_n=128,
        block_n=64,
        max_block_g=64,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        reason="interpreter: mirrors the sm90 D=128 entry, untimed",
    ),
    ("interp", 256, 2): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=32,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        reason="interpreter: mirrors the sm90 D=256 entry",
    ),
    ("interp", 64, 1): DecodeConfig(
        tile_n=256,
        block_n=256,
        max_block_g=64,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        reason="interpreter: mirrors the sm90 fp8 D=64 entry",
    ),
    ("interp", 128, 1): DecodeConfig(
        tile_n=128,
        block_n=128,
        max_block_g=64,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        reason="interpreter: mirrors the sm90 fp8 D=128 entry",
    ),
    ("interp", 256, 1): DecodeConfig(
        tile_n=64,
        block_n=64,
        max_block_g=32,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        reason="interpreter: mirrors the sm90 fp8 D=256 entry",
    ),
    ("interp", 64, 4): DecodeConfig(
        tile_n=256,
        block_n=64,
        max_block_g=64,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="interpreter: paper tile, untimed",
    ),
    ("interp", 128, 4): DecodeConfig(
        tile_n=128,
        block_n=64,
        max_block_g=64,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="interpreter: paper tile, untimed",
    ),
    ("interp", 256, 4): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=32,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        reason="interpreter: mirrors the GPU D=256 entry",
    ),
    # MLA: K the 576-dim latent + rope row, V its first 512 dims (see _MLA).
    ("sm80", 576, 2): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=32,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        paged_stages=5,
        head_dim_v=512,
        scores_t_rows=32,
        invariant_max_block_g=32,
        invariant_wide_tile_n=INVARIANT_WIDE_TILE_N,
        reason=_MLA + _MLA_ROWS32 + _MLA_INVARIANT + _AHEAD,
    ),
    ("sm90", 576, 2): DecodeConfig(
        tile_n=64,
        block_n=32,
        narrow_block_n=64,
        max_block_g=128,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        paged_stages=5,
        head_dim_v=512,
        scores_t_rows=32,
        invariant_max_block_g=64,
        invariant_wide_tile_n=INVARIANT_WIDE_TILE_N,
        split_v_rows=128,
        split_v_fewer_stages=1,
        one_sequence_max_block_g=16,
        one_sequence_max_contributors=2 * MAX_CONTRIBUTORS,
        gluon_rows=64,
        reason=_MLA
        + _MLA_ROWS64
        + _MLA_INVARIANT
        + _MLA_KEYS64
        + _STAGES
        + _AHEAD
        + _MLA_COLS
        + _MLA_ONE_SEQUENCE
        + _MLA_GLUON
        + _MLA_CONTRIBUTORS,
    ),
    ("sm80", 576, 1): DecodeConfig(
        tile_n=64,
        block_n=32,
        max_block_g=32,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        paged_stages=5,
        head_dim_v=512,
        scores_t_rows=32,
        invariant_max_block_g=32,
        invariant_wide_tile_n=INVARIANT_WIDE_TILE_N,
        reason=_MLA + _MLA_ROWS32 + _MLA_INVARIANT + _MLA_FP8_SM80 + _AHEAD,
    ),
    ("sm90", 576, 1): DecodeConfig(
        tile_n=64,
        block_n=32,
        narrow_block_n=64,
        max_block_g=128,
        num_warps=8,
        num_stages=3,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        paged_stages=5,
        head_dim_v=512,
        scores_t_rows=32,
        invariant_max_block_g=64,
        invariant_wide_tile_n=INVARIANT_WIDE_TILE_N,
        split_v_rows=128,
        one_sequence_max_contributors=2 * MAX_CONTRIBUTORS,
        reason=_MLA_FP8 + _MLA_ROWS64 + _MLA_INVARIANT + _MLA_KEYS64 + _AHEAD + _MLA_COLS + _MLA_CONTRIBUTORS,
    ),
    ("interp", 576, 2): DecodeConfig(
        tile_n=64,
        block_n=32,
        narrow_block_n=64,
        max_block_g=128,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        head_dim_v=512,
        scores_t_rows=32,
        invariant_max_block_g=64,
        invariant_wide_tile_n=INVARIANT_WIDE_TILE_N,
        split_v_rows=128,
        one_sequence_max_block_g=16,
        reason="interpreter: mirrors the sm90 MLA entry, untimed",
    ),
    ("interp", 576, 1): DecodeConfig(
        tile_n=64,
        block_n=32,
        narrow_block_n=64,
        max_block_g=128,
        num_warps=4,
        num_stages=1,
        max_programs_per_sm=1,
        merge_wave_elems=8192,
        head_dim_v=512,
        scores_t_rows=32,
        invariant_max_block_g=64,
        invariant_wide_tile_n=INVARIANT_WIDE_TILE_N,
        split_v_rows=128,
        reason="interpreter: mirrors the sm90 MLA fp8 entry, untimed",
    ),
}

# 99 KB a block (sm_86, sm_89, sm_120, which take sm_80's entries; archs.ARCHS): D=256 fp8's
# 64-key blocks stage 108-110 KB, so they take 32-key blocks, the 16-bit entry's: 58-60 KB, no
# spill in the K/V loop, 2 K/V buffers, 16-byte K loads (compiled for each, kernel report).
_SMEM99 = "; 99 KB a block: 32-key blocks (64-key blocks stage 108-110 KB; kernel report)"
TUNING_TABLE |= {
    (arch, 256, 1): dataclasses.replace(
        TUNING_TABLE[("sm80", 256, 1)], block_n=32, reason=_FP8 + _SMEM99 + _FITS + _AHEAD
    )
    for arch in ("sm86", "sm89", "sm120")
}


def _drop(reason: str, *parts: str) -> str:
    """``reason`` without the given parts of it."""
    for part in parts:
        reason = reason.replace(part, "")
    return reason


# MLA on the 99 KB parts: sm_80's 32-row blocks stage 108-111 KB, so they keep 16-row blocks
# (90-92 KB, no K/V-loop spill; kernel report --archs).
TUNING_TABLE |= {
    (arch, 576, elem): dataclasses.replace(
        TUNING_TABLE[("sm80", 576, elem)],
        max_block_g=16,
        scores_t_rows=None,
        invariant_max_block_g=None,
        invariant_wide_tile_n=None,
        reason=_drop(TUNING_TABLE[("sm80", 576, elem)].reason, _MLA_INVARIANT).replace(_MLA_ROWS32, _MLA_ROWS)
        + "; 99 KB a block: 16-row blocks (32-row blocks stage 108-111 KB; kernel report)",
    )
    for arch in ("sm86", "sm89", "sm120")
    for elem in (1, 2)
}

# fp32 D=128 on sm_86 and sm_89: sm_80's 32-key blocks take 255 registers there and spill in the
# K/V loop (152 local accesses an iteration; sm_80: 106 registers); 16-key blocks take 80, no
# spill, 3 programs/SM (kernel report).
TUNING_TABLE |= {
    (arch, 128, 4): dataclasses.replace(
        TUNING_TABLE[("sm80", 128, 4)],
        block_n=16,
        reason="fp32: 16-key blocks (32-key blocks spill in the K/V loop here; kernel report)" + _FITS,
    )
    for arch in ("sm86", "sm89")
}

# sm_100 takes sm_90's entries, whose D=64 batch-invariant cap of 168 registers spills in its K/V
# loop there (6 local accesses an iteration, paged16); left to ptxas it takes 255 registers, 16
# bytes of cold spills and no loop spill, 2 programs/SM (184 or 200: 2 programs too, more SASS).
TUNING_TABLE[("sm100", 64, 2)] = dataclasses.replace(
    TUNING_TABLE[("sm90", 64, 2)],
    invariant_max_registers=None,
    reason=TUNING_TABLE[("sm90", 64, 2)].reason.replace(_REGS_INVARIANT, "")
    + "; sm_100: invariant variant uncapped, no K/V-loop spill, 2 programs/SM (kernel report)",
)

# The kernel takes any head_dim that is a multiple of 8 up to 256 (a 16-byte row of 16-bit values),
# padded to a power of two >= 16 for ``tl.dot`` with the padding masked. The table has one entry per
# padded size that has its own registers and shared-memory budget; smaller ones use the 64 entry.
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
TABLE_HEAD_DIMS = (64, 128, 256)

# B200 (sm_100: 148 SMs, 6.9 TB/s modelled copy bandwidth, 0.8 us loaded latency; tools/gpus.py):
# an output split over MAX_CONTRIBUTORS programs keeps 64 x 64 KB = 4 MB in flight, under Little's
# law's 6.9 TB/s x 0.8 us = 5.5 MB, so one long sequence on one KV head (a TP-8 rank at B=1)
# streams below copy bandwidth: the simulator's Llama-3-70B rank at B=1 takes 0.63-0.74x
# FlashDecoding's time from 16k to 1M keys. 96 contributors (12 merge groups: a chain of at most
# 8 + 12 partials) give 0.84x at 16k, 0.85x at 64k and 0.99x at 1M; 128 give 0.80x, 0.93x and
# 0.99x but spread B=4 at 16k over every program (1.04x -> 0.85x: its merges outweigh the read).
# MLA keeps 64: its partials are 4-8x wider, so each link of the chain costs more.
_B200 = "; sm_100: 96 contributors an output (Little's law at 6.9 TB/s; simulator)"
B200_CONTRIBUTORS = 12 * MERGE_FANIN
TUNING_TABLE |= {
    ("sm100", d, elem): dataclasses.replace(entry, max_contributors=B200_CONTRIBUTORS, reason=entry.reason + _B200)
    for d in TABLE_HEAD_DIMS
    for elem in (1, 2)
    # sm_100's own entry where it has one, else the one it takes (archs.ARCHS: sm_90's)
    for entry in (TUNING_TABLE.get(("sm100", d, elem)) or TUNING_TABLE[(ARCHS["sm100"].tuning, d, elem)],)
}


# sm_100 keeps 64-row blocks at 128 heads, one sequence's too, and 64 contributors an output: the
# column halves' wgmma schedule and stages, the Gluon kernel (Hopper's wgmma) and the wider merge
# are sm_90's and measured there only (see _MLA_COLS, _MLA_ONE_SEQUENCE, _MLA_GLUON,
# _MLA_CONTRIBUTORS).
TUNING_TABLE[("sm100", 576, 2)] = dataclasses.replace(
    TUNING_TABLE[("sm90", 576, 2)],
    max_block_g=64,
    split_v_rows=None,
    one_sequence_max_block_g=None,
    one_sequence_max_contributors=None,
    gluon_rows=None,
    reason=_drop(TUNING_TABLE[("sm90", 576, 2)].reason, _MLA_COLS, _MLA_ONE_SEQUENCE, _MLA_GLUON, _MLA_CONTRIBUTORS)
    + "; sm_100: 64-row blocks at 128 heads, 64 contributors (column halves, one sequence's rows and"
    " contributors, and the Gluon kernel measured on sm_90 only)",
)


# sm_100 takes sm_90's MLA entries but for fp8: 32-key blocks buffer 1x Little's law there (36 KB
# against 6.9 TB/s x 0.8 us / 148 SMs = 36 KB), and the all-features 64-row block (Tq 4, e4m3)
# spills 6 times an iteration; 16-row blocks of 64 keys buffer 2x, no loop spill (kernel report).
TUNING_TABLE[("sm100", 576, 1)] = dataclasses.replace(
    TUNING_TABLE[("sm90", 576, 1)],
    tile_n=128,
    block_n=64,
    max_block_g=16,
    scores_t_rows=None,
    invariant_max_block_g=None,
    split_v_rows=None,
    one_sequence_max_contributors=None,
    reason="MLA 576/512 fp8: 128-key tiles = 72 KB"
    + _MLA_ROWS
    + _FP8_BLOCKS
    + _AHEAD
    + "; sm_100: 16-row blocks of 64 keys (32-key blocks buffer 1x Little's law; kernel report)",
)


def padded_head_dim(head_dim: int) -> int:
    """BLOCK_D: head_dim rounded up to a power of two >= 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def arch_of(device: torch.device) -> str:
    """Architecture key of ``device`` (``archs.ARCHS``; "interp" off CUDA); ``ValueError`` naming
    a device the kernel cannot run on."""
    if device.type != "cuda":
        return "interp"
    return _cuda_arch(device)


@torch.compiler.assume_constant_result
def _cuda_arch(device: torch.device) -> str:
    """``arch_of`` a CUDA device, a constant to torch.compile: the device queries return a str and
    a tuple, which a traced caller (a transformers model's attention, checking the kernel takes
    its call) cannot put in its graph."""
    return _arch_of_index(cuda_index(device))


@functools.cache
def _arch_of_index(index: int) -> str:
    """``arch_of`` of CUDA device ``index``, once per device: every call plans with it."""
    major, minor = torch.cuda.get_device_capability(index)
    return arch_for_capability(major, minor, torch.cuda.get_device_name(index)).key


def table_entry(arch: str, head_dim: int, elem_bytes: int) -> DecodeConfig | None:
    """The table's entry for an architecture: its own key's, else that of the architecture whose
    entries it takes (``Arch.tuning``)."""
    entry = TUNING_TABLE.get((arch, head_dim, elem_bytes))
    if entry is None and arch in ARCHS:
        entry = TUNING_TABLE.get((ARCHS[arch].tuning, head_dim, elem_bytes))
    return entry


def config_override(text: str, optional: bool = False) -> tuple[str, int | None]:
    """(field, value) of a trial's ``FIELD=VALUE`` replacing a ``DecodeConfig`` integer field (the
    kernel report's ``--set``, scripts/profile_case.py's ``--override``); with ``optional``, also
    the fields that may be None, which ``None`` clears. ValueError giving what it expects."""
    types = {f.name: f.type for f in dataclasses.fields(DecodeConfig)}
    fields = [name for name, kind in types.items() if kind == "int" or (optional and kind == "int | None")]
    name, _, value = text.partition("=")
    if name in fields and (value.isdigit() or (value == "None" and types[name] == "int | None")):
        return name, None if value == "None" else int(value)
    clears = " (None clears an optional one)" if optional else ""
    raise ValueError(f"FIELD=INTEGER with FIELD one of {', '.join(fields)}{clears}")


def get_config(
    device: torch.device,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    head_dim_v: int | None = None,
) -> DecodeConfig:
    """The tuning-table entry for a problem on ``device`` (``dtype``: q's; ``cache_dtype``: the
    cache's, when not q's; ``head_dim_v``: V's, when not K's ``head_dim``); ``ValueError`` for
    head dims the kernel does not take."""
    return config_for(arch_of(device), head_dim, dtype, cache_dtype, head_dim_v)


def kernel_takes_head_dim(head_dim: int) -> bool:
    """Whether the Triton kernel takes a head dim: a multiple of ``HEAD_DIM_MULTIPLE`` up to ``MAX_HEAD_DIM``."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0


def head_dim_pairs() -> list[tuple[int, int]]:
    """The (K, V) head dim pairs with V's below K's that the table has entries for."""
    return sorted({(key[1], c.head_dim_v) for key, c in TUNING_TABLE.items() if c.head_dim_v is not None})


def paired_head_dim_v(head_dim: int) -> int | None:
    """V's head dim of the table's entries for K head dim ``head_dim`` when it is below it (576:
    512), else None."""
    return next((v for k, v in head_dim_pairs() if k == head_dim), None)


def config_for(
    arch: str,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    head_dim_v: int | None = None,
) -> DecodeConfig:
    """The tuning-table entry for an architecture key (the simulator asks for GPUs it does not have).

    ``dtype`` is q's dtype, ``cache_dtype`` the cache's when it is not q's (fp8: converted to q's
    16-bit dtype after loading, so its kernel has the 16-bit dots, and half the bytes per key).
    ``head_dim`` is K's (and q's), ``head_dim_v`` V's when it differs: such a pair needs its own entry.
    """
    if head_dim_v is not None and head_dim_v != head_dim:
        return _pair_config(arch, head_dim, head_dim_v, dtype, cache_dtype)
    if not kernel_takes_head_dim(head_dim):
        raise ValueError(
            f"head_dim: expected a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM} for the Triton backend, "
            f"got head_dim={head_dim}"
        )
    if dtype.itemsize != 2 and cache_dtype not in (None, dtype):
        raise ValueError(f"q: expected dtype float16 or bfloat16 with a {cache_dtype} cache, got {dtype}")
    entry = table_entry(arch, max(TABLE_HEAD_DIMS[0], padded_head_dim(head_dim)), (cache_dtype or dtype).itemsize)
    if entry is None:
        raise ValueError(f"q: expected dtype float16, bfloat16 or float32 for the Triton backend, got {dtype}")
    return entry


def block_g_for(rows: int, config: DecodeConfig, invariant: bool = False, one_sequence: bool = False) -> int:
    """Query rows computed together: a KV head's Tq x group rows padded to a power of two >= 16 for
    ``tl.dot``, at most ``max_block_g`` (``invariant``: the batch-invariant variant's, and
    ``one_sequence``: a call of one sequence's (``Features.one_sequence``) whose rows would take
    column halves, when the entry sets them; more rows take more row blocks)."""
    padded = max(16, 1 << (rows - 1).bit_length())
    halves = config.v_col_blocks(min(padded, config.max_block_g), invariant) > 1
    cap = (invariant and config.invariant_max_block_g) or (one_sequence and halves and config.one_sequence_max_block_g)
    return min(padded, cap or config.max_block_g)


def _pair_config(
    arch: str, head_dim: int, head_dim_v: int, dtype: torch.dtype, cache_dtype: torch.dtype | None
) -> DecodeConfig:
    """The entry for K head dim ``head_dim`` and a smaller V head dim ``head_dim_v``."""
    config = table_entry(arch, head_dim, (cache_dtype or dtype).itemsize)
    if config is None or config.head_dim_v != head_dim_v or dtype.itemsize != 2:
        raise ValueError(
            f"v_cache: expected (K, V) head dims in {head_dim_pairs()} with a float16 or bfloat16 q for the Triton "
            f"backend, got ({head_dim}, {head_dim_v}) with {dtype} q and {cache_dtype or dtype} caches "
            "(the torch backend takes any)"
        )
    return config
