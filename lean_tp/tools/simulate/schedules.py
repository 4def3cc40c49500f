"""Each method's schedule of one decode step on a modelled GPU, in modelled time.

- **lean**: the kernel's own schedule and merge tree (``lean_schedule``/``merge_plan`` run the
  kernel's schedule code), a grid of ``SMs x programs per SM``, program p on SM ``p mod SMs``.
- **fa2**: FlashAttention-2's ``num_splits_heuristic``, the FlashDecoding rule, with its splits sized
  from the cache capacity; CTAs go, in launch order, to the least-loaded SM (ideal dynamic
  dispatch), and a split output costs a combine kernel.
- **flex**: FlexAttention's decode rule, ``max(SMs // (B * Hkv) * 2, 1)`` splits of the capacity,
  then its combine kernel.
- MLA problems (``Problem.latent``) run against MLA's own kernels (``mla.py``); a call a tuning
  entry routes to lean's Gluon MLA kernel is modelled as that kernel (``gluon.py``).

Time model (``tools.gpus.GPUS`` holds every constant with its source): an SM streams K/V at
``min(L2 port, bytes in flight / HBM latency)``, all SMs together at most the measured copy
bandwidth over the share of bytes that come from HBM (a row re-read while it is still in L2 is
a hit: ``l2.py``), and at most the L2's read bandwidth; a merge costs L2 round trips (one per
atomic, one per wave of partial loads) plus its partial bytes over the merging SM's L2 port; a
second kernel costs a launch gap. Every method gets the same memory model, so the comparison
isolates schedules and merges. One exception is measured: where a lean entry's K/V-loop
iteration time is known (``gpus.LOOP_US``: sm_90's MLA entries on an H200), a lean program
streams at most one block an iteration, which is slower than its bytes; the peers keep the
memory model, so there the comparison also holds lean's loop against peers assumed memory-bound
(the Gluon kernel's loop is measured too: ``gluon.GLUON_LOOP_US``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

import torch

from lean_tp.ops.decode_attention import Features, KernelVariant, lean_schedule
from lean_tp.ops.decode_attention.launch_args import token_lengths
from lean_tp.ops.decode_attention.launcher import merge_plan
from lean_tp.ops.decode_attention.plan import is_one_sequence
from lean_tp.ops.decode_attention.tuning import (
    INVARIANT_GROUP_CHUNKS,
    INVARIANT_SLICE_HOLDERS,
    INVARIANT_SUPER_GROUPS,
    INVARIANT_SUPER_SLICE_HOLDERS,
    MERGE_POLLS,
)
from lean_tp.tools.gpus import GPUModel, loop_us
from lean_tp.tools.simulate.l2 import Read, chunk_reads, hbm_share
from lean_tp.tools.simulate.problems import Problem

METHODS = ("lean", "fa2", "flex")


@dataclass
class Schedule:
    """One method's plan for one problem, with its modelled time."""

    method: str
    sms: int
    units: int  # programs (lean) or CTAs (fixed split) that do work
    splits: int  # lean: outputs split across programs; fixed split: splits per output
    sm_work: list[int]  # K/V tokens per SM
    time_us: float = 0.0  # modelled kernel time (+ the combine kernel for fixed splits)
    merge_us: float = 0.0  # what merging adds: lean's tree past its last K/V byte, or the combine kernel
    chain: int = (
        0  # lean: the longest serial merge chain, in partials (a final merger reads its group's and the groups')
    )
    merge_bytes: int = 0  # lean: the most partial bytes one program reads in merges
    bars: list[tuple[int, int, int, int]] = field(default_factory=list)  # (sm, start, tokens, output)

    @property
    def makespan(self) -> int:
        return max(self.sm_work)

    @property
    def busy_sms(self) -> int:
        """SMs that stream any K/V."""
        return sum(1 for w in self.sm_work if w)

    @property
    def efficiency(self) -> float:
        """Load balance over the SMs that stream K/V: their mean work over the busiest one's (1.0:
        all finish together). SMs a method leaves idle on purpose (lean's grid shrinks for short
        contexts, since SMs streaming together share the bandwidth) do not count against it; the
        modelled time is what compares methods."""
        return sum(self.sm_work) / (self.busy_sms * self.makespan) if self.busy_sms else 1.0


def fa2_num_splits(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's ``num_splits_heuristic``: the fewest splits whose wave efficiency is within
    85% of the best, or 1 when the (batch, head, m-block) CTAs already nearly fill the GPU."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eligible = [
        s == 1 or math.ceil(num_n_blocks / s) != math.ceil(num_n_blocks / (s - 1)) for s in range(1, max_splits + 1)
    ]
    efficiency = []
    for s in range(1, max_splits + 1):
        waves = batch_nheads_mblocks * s / num_sms
        efficiency.append(waves / math.ceil(waves) if eligible[s - 1] else 0.0)
    best = max(efficiency, default=0.0)
    return next((s for s in range(1, max_splits + 1) if eligible[s - 1] and efficiency[s - 1] >= 0.85 * best), 1)


def fa2_splits(problem: Problem, sms: int) -> tuple[int, int]:
    """(splits, key block) FlashAttention-2 picks for ``flash_attn_with_kvcache`` on ``sms`` SMs.

    Decode with GQA packs each group's queries as the rows of one KV head (``seqlenq_ngroups_swapped``),
    so its CTAs are (batch, KV head, 64-row block); the heuristic is given twice the SM count."""
    block_n = 256 if problem.head_dim <= 64 else (128 if problem.head_dim <= 128 else 64)
    m_blocks = math.ceil(problem.n_heads // problem.n_kv_heads / 64)
    ctas = len(problem.lens) * problem.n_kv_heads * m_blocks
    return fa2_num_splits(ctas, sms * 2, math.ceil(problem.kv_len / block_n)), block_n


def flex_splits(problem: Problem, sms: int) -> int:
    """FlexAttention decode's split count: two per SM over the (batch, KV head) pairs."""
    return max(sms // max(len(problem.lens) * problem.n_kv_heads, 1) * 2, 1)


def lean_variant(problem: Problem, gpu: GPUModel, batch_invariant: bool = False) -> KernelVariant:
    """The kernel variant ``problem`` launches on ``gpu``: a contiguous cache, ``problem.num_tokens``
    query tokens, and a one-sequence call's rows (``Features.one_sequence``) where it has one."""
    group = problem.n_heads // problem.n_kv_heads
    dtype, fp8 = problem.dtypes
    features = Features(
        num_tokens=problem.num_tokens,
        fp8=fp8,
        batch_invariant=batch_invariant,
        v_in_k=problem.latent,
        one_sequence=is_one_sequence(len(problem.lens), problem.num_tokens, group),
    )
    return KernelVariant(
        gpu.arch, dtype, problem.head_dim, group, None, features, head_dim_v=problem.head_dim_v or None
    )


def schedule_lens(problem: Problem, variant: KernelVariant) -> list[int]:
    """Lengths of the schedule's sequences: the problem's, or, when the variant schedules each query
    token as a sequence of its own (``KernelVariant.seq_tokens``), each token's keys up to its own,
    as the launch computes them (``launch_args.token_lengths``)."""
    return token_lengths(torch.tensor(problem.lens, dtype=torch.int32), variant.seq_tokens).tolist()


def _stream_rates(
    n_on_sm: list[int],
    problem: Problem,
    gpu: GPUModel,
    programs_per_sm: int,
    from_hbm: float = 1.0,
    loop: float | None = None,
    variant: KernelVariant | None = None,
    blocks: tuple[int, int] | None = None,
    roof: float = float("inf"),
) -> list[float]:
    """Bytes per microsecond each SM streams K/V at with n_on_sm[sm] programs (or CTAs) resident at
    most ``programs_per_sm``: Little's law per SM, capped by its L2 port, all SMs sharing in
    proportion what the device streams: the copy bandwidth over the share ``from_hbm`` of bytes
    that come from HBM (``l2.hbm_share``), at most the L2's read bandwidth. Every method gets
    this model, with the blocks and stages of ``variant`` (lean's that runs), else of lean's
    default variant; ``loop`` (µs an iteration of such a block, ``gpus.LOOP_US``) caps each
    program at a block an iteration where the kernel's loop is measured to be slower than its
    bytes. ``blocks``: (a block's bytes, bytes in flight) of a kernel that is not a variant (the
    Gluon MLA kernel's: ``gluon.py``). ``roof``: the most an SM streams at, its tensor cores'
    (``compute_roof``)."""
    if blocks:
        block, in_flight = blocks
    else:
        variant = variant or lean_variant(problem, gpu)
        block = variant.constexprs["BLOCK_N"] * problem.bytes_per_token
        in_flight = max(1, variant.config.num_stages - 1) * block
    per_program = min(in_flight / gpu.hbm_latency_us, block / loop if loop else float("inf"))
    want = [min(gpu.l2_port_gbps * 1e3, roof, min(n, programs_per_sm) * per_program) for n in n_on_sm]
    device = min(gpu.l2_read_tbps, gpu.hbm_tbps / from_hbm) * 1e6
    share = min(1.0, device / max(sum(want), 1e-9))
    return [w * share for w in want]


def compute_roof(problem: Problem, gpu: GPUModel, rows: int, tflops: float | None = None) -> float:
    """Bytes per microsecond of K/V an SM streams at most when its programs compute ``rows`` query
    rows (their tile, padding included) for each key, both products on the tensor cores at
    ``tflops`` (the GPU's dense 16-bit peak unless given: ``GPUModel.tensor_tflops``): 2 x rows x
    (head_dim + V's width) FLOP a key. Binds where a program computes many rows a key: MLA's wide
    blocks (at 128 heads a key costs 278 KFLOP for its 1152 bytes) and long verifications' blocks
    of Tq x group rows (the A100's 64-row blocks at D=128, Tq 16); one-token GQA decode's few rows
    leave it far above what memory gives. sm_90's 128-row MLA blocks in column halves compute half
    of V's width a unit, so this counts their products high; their loop is measured, and runs below
    it."""
    flops_per_key = 2 * rows * (problem.head_dim + (problem.head_dim_v or problem.head_dim))
    sm_flops_per_us = (tflops or gpu.tensor_tflops) * 1e6 / gpu.sms
    return sm_flops_per_us / flops_per_key * problem.bytes_per_token


def _shared_clock(works: list[float], rate: float):
    """Time at which programs sharing one SM's ``rate`` (processor sharing: the unfinished ones split
    it evenly, so one that finishes early hands its share to the rest) have each done ``x`` bytes;
    the SM finishes at sum(works) / rate."""
    levels = sorted(works)

    def clock(x: float) -> float:
        t, done, left = 0.0, 0.0, len(levels)
        for level in levels:
            step = min(x, level) - done
            if step > 0:
                t += step * left / rate
                done += step
            if x <= level:
                break
            left -= 1
        return t

    return clock


def partial_bytes(problem: Problem, elem: int) -> int:
    """One query head's partial of a split output: V's width at ``elem`` bytes, and its lse."""
    return (problem.head_dim_v or problem.head_dim) * elem + 4


def _merge_level_us(
    members: int, wave: int, partial_bytes: int, gpu: GPUModel, counted: bool = True, slices: int = 1
) -> float:
    """One level of the tree: the arrival atomic (when ``counted``), one L2 round trip per wave of
    partial loads in each of ``slices`` column slices (``merge.finish_split``), and the partials
    through the merger's L2 port."""
    trips = int(counted) + slices * math.ceil(members / wave)
    return gpu.l2_latency_us * trips + members * partial_bytes / (gpu.l2_port_gbps * 1e3)


def lean_sim_schedule(
    problem: Problem,
    gpu: GPUModel,
    programs_per_sm: int | None = None,
    batch_invariant: bool = False,
    max_contributors: int | None = None,
) -> Schedule:
    """The kernel's stream-K schedule and merge tree on ``gpu``, in modelled time (with
    ``batch_invariant``, the same schedule and the invariant mode's merges: ``_invariant_merges``;
    ``max_contributors``, a trial: the schedule's cap instead of the tuning entry's). A call the
    entry routes to the Gluon MLA kernel is modelled as that kernel (``gluon.py``)."""
    from lean_tp.tools.simulate.gluon import gluon_sim_schedule, routes_to_gluon

    variant = lean_variant(problem, gpu, batch_invariant)
    if max_contributors is None and routes_to_gluon(problem, variant):
        return gluon_sim_schedule(problem, gpu)
    config, cx = variant.config, variant.constexprs
    per_sm = programs_per_sm or config.max_programs_per_sm
    head_units, tile = problem.n_kv_heads * cx["NUM_GC"], cx["TILE_N"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = schedule_lens(problem, variant)
    programs = lean_schedule(
        torch.tensor(lens, dtype=torch.int32, device=device),
        head_units,
        tile,
        gpu.sms * per_sm,
        num_sms=gpu.sms,
        max_contributors=max_contributors or cx["MAX_CONTRIB"],
        lanes=cx["LANES"],
    )
    sms = gpu.sms
    n_on_sm = [len(range(sm, len(programs), sms)) for sm in range(sms)]
    bytes_per_token = problem.bytes_per_token
    work, clock, bars, seg_end = [0] * sms, [0] * sms, [], {}
    seg_bytes = segment_bytes(programs, lens, tile, bytes_per_token)

    loop = loop_us(gpu, problem.head_dim, problem.elem_size, cx["BLOCK_G"], cx["BLOCK_N"])
    roof = compute_roof(problem, gpu, cx["BLOCK_G"])

    def clocks_at(from_hbm: float) -> list:
        rates = _stream_rates(n_on_sm, problem, gpu, per_sm, from_hbm, loop, variant, roof=roof)
        return [
            _shared_clock([sum(seg_bytes[p]) for p in range(sm, len(programs), sms)], rates[sm] or 1.0)
            for sm in range(sms)
        ]

    clocks = clocks_at(1.0)
    reads = lean_reads(problem, programs, seg_bytes, clocks, sms, tile, cx["NUM_GC"], variant.seq_tokens)
    from_hbm = hbm_share(reads, gpu)
    if from_hbm < 1.0:  # rows re-read while in L2: the device streams them faster
        clocks = clocks_at(from_hbm)
    for p, segments in enumerate(programs):
        sm, done = p % sms, 0
        for s, nbytes in zip(segments, seg_bytes[p]):
            tokens = nbytes // bytes_per_token
            bars.append((sm, clock[sm], tokens, s.b * problem.n_kv_heads + s.head_unit // cx["NUM_GC"]))
            clock[sm] += tokens
            work[sm] += tokens
            done += nbytes
            seg_end[(p, s.slot)] = gpu.hbm_latency_us + clocks[sm](done)
    kv_end = max(seg_end.values(), default=0.0)
    # A partial's real rows (masked padding rows move no bytes): fp32 acc, m and l.
    rows = variant.unit_tokens * (problem.n_heads // problem.n_kv_heads)
    partial = min(rows, cx["BLOCK_G"]) * (cx["BLOCK_D"] + 2) * 4
    plan = merge_plan(programs)
    slices = cx["BLOCK_D"] // cx["MERGE_COLS"]
    idle = {(p, segments[-1].slot) for p, segments in enumerate(programs) if segments}
    if batch_invariant:
        end, chain = _invariant_merges(
            programs,
            seg_end,
            kv_end,
            partial,
            cx["WAVE"],
            gpu,
            idle,
            slices,
            cx["SLICE_WAVE"],
            config.merge_polls,
            cx["IGROUP"],
        )
        merge_bytes = chain * partial
    else:
        end, chain, merge_bytes = _tree_merges(
            plan, idle, seg_end, kv_end, partial, cx["WAVE"], gpu, slices, config.merge_polls
        )
    return Schedule(
        "lean",
        sms,
        units=len(programs),
        splits=len(plan),
        sm_work=work,
        time_us=end,
        merge_us=end - kv_end,
        chain=chain,
        merge_bytes=merge_bytes,
        bars=bars,
    )


def segment_bytes(programs: list, lens: list[int], tile: int, bytes_per_token: int) -> list[list[int]]:
    """K/V bytes of each program's segments: its tiles of ``tile`` keys, the last cut at its
    schedule sequence's length (``lens``)."""
    return [
        [(min(lens[s.b], (s.first_tile + s.n_tiles) * tile) - s.first_tile * tile) * bytes_per_token for s in segments]
        for segments in programs
    ]


def lean_reads(
    problem: Problem, programs, seg_bytes, clocks, sms: int, tile: int, units: int, seq_tokens: int = 1
) -> list[Read]:
    """Every program's K/V reads, chunk by chunk (``l2.chunk_reads``), stamped with the time its SM's
    clock reaches them: tiles of ``tile`` keys, ``units`` head units a KV head. A schedule sequence
    is a request's, or one of its query tokens' (its keys a prefix of the request's) where the
    kernel schedules tokens apart (``seq_tokens``: ``KernelVariant.seq_tokens``)."""
    bpt = problem.bytes_per_token
    reads = []
    for p, segments in enumerate(programs):
        done, clock = 0, clocks[p % sms]
        for s, nbytes in zip(segments, seg_bytes[p]):
            request, k0 = s.b // seq_tokens, s.first_tile * tile
            at = lambda keys, done=done: clock(done + keys * bpt)  # noqa: E731
            reads += chunk_reads(request, s.head_unit // units, problem.lens[request], k0, k0 + nbytes // bpt, bpt, at)
            done += nbytes
    return reads


def _tree_merges(
    plan: dict,
    idle: set,
    seg_end: dict,
    kv_end: float,
    partial: int,
    wave: int,
    gpu: GPUModel,
    slices: int = 1,
    polls: int = MERGE_POLLS,
) -> tuple[float, int, int]:
    """(end, longest chain of partials, most partial bytes one program reads) of the default mode's
    merge tree (``merge_plan``, ``merge.finish_split``): each group once its last member arrives,
    then the output's second level once every group is merged, each merge in ``slices`` column
    slices shared by its last arriver and the contributors in ``idle`` (their segment is their
    program's last) that are still waiting for it (``polls`` reads of its counter, the tuning
    entry's ``merge_polls``, an L2 round trip each); a merge in one slice is its last arriver's
    alone."""
    end, chain, most = kv_end, 0, 0
    wait = polls * gpu.l2_latency_us
    for groups in plan.values():
        output = len(groups) == 1
        free, done, read = {}, [], 0.0
        for g in groups:
            ready = max(seg_end[m] for m in g) + gpu.l2_latency_us  # the last arrival
            owner = max(g, key=lambda m: seg_end[m])
            waiting = [m for m in g if m != owner and m in idle] if slices > 1 else []
            helpers = [m for m in waiting if ready - seg_end[m] <= wait]
            us, nbytes = _sliced_merge(len(g), wave, partial, gpu, slices, 1 + len(helpers), bool(waiting), output)
            done.append(ready + us)
            read = max(read, nbytes)
            for m in waiting:  # when each is free to wait for the second level
                free[m] = ready + us if m in helpers else seg_end[m] + wait
        finish = max(done)
        if not output:
            ready = finish + 2 * gpu.l2_latency_us  # the last group's m and l stored, then its count
            helpers = [m for m, f in free.items() if ready - f <= wait]
            us, nbytes = _sliced_merge(len(groups), wave, partial, gpu, slices, 1 + len(helpers), slices > 1, True)
            finish = ready + us
            read += nbytes
        end = max(end, finish)
        chain = max(chain, max(map(len, groups)) + (0 if output else len(groups)))
        most = max(most, int(read))
    return end, chain, most


def _sliced_merge(
    members: int, wave: int, partial: int, gpu: GPUModel, slices: int, mergers: int, claims: bool, output: bool
) -> tuple[float, float]:
    """(time, partial bytes the busiest merger reads) of one merge of ``members`` partials in
    ``slices`` column slices over ``mergers`` programs: each slice one L2 round trip per wave of
    loads, its claim's (``claims``) and, in a group that is not the output, its count (then one more
    claim, which finds none left, before the second level); its share of the partials through the
    merger's L2 port."""
    counted = claims and not output
    trips = math.ceil(members / wave) + claims + counted
    rounds = math.ceil(slices / mergers)
    nbytes = rounds * members * partial / slices
    return gpu.l2_latency_us * (rounds * trips + counted) + nbytes / (gpu.l2_port_gbps * 1e3), nbytes


def _invariant_merges(
    programs,
    seg_end: dict,
    kv_end: float,
    partial: int,
    wave: int,
    gpu: GPUModel,
    idle: set = frozenset(),
    slices: int = 1,
    slice_wave: int = 0,
    polls: int = MERGE_POLLS,
    group_chunks: int = INVARIANT_GROUP_CHUNKS,
) -> tuple[float, int]:
    """(end, longest chain of partials) of the batch-invariant mode's folds (``invariant.py``),
    each a left-to-right fold of ``wave`` partials loaded at once: one L2 round trip per wave, plus
    the arrival atomic where several programs count in. Wide row blocks (``group_chunks`` 1) fold
    each supergroup into its slot in column slices by one program, and every output from its
    supergroups' slots in column slices. A group of ``group_chunks`` chunks (the
    plan's IGROUP)
    is ready when its holders' segments end (one holder: in registers; several: its last holder
    folds the first holder's fold and each later chunk); a supergroup of
    ``INVARIANT_SUPER_GROUPS`` groups when its groups are, then folded from the workspace; an output
    of several supergroups folds their values. A one-program output of one supergroup keeps its
    last group in registers and, after its K/V loop, folds the others from the workspace, where
    its loop stored them; a supergroup of one split group is the value its last holder folded.
    Where ``slice_wave`` (the plan's SLICE_WAVE) is set, an output's supergroups are folded in
    ``slices`` column slices (``output_fold.finish_output``) as the default tree's second level is
    merged (``_sliced_merge``, ``slice_wave`` slices loaded at once): by the program that makes the last
    known (taken as the holder that finishes last) and the holders in ``idle`` (their segment is
    their program's last) still waiting for it (``polls`` reads of its count); a split group's
    chunks and a split supergroup's groups the same way (``_group_ready``, ``_super_slices``)."""
    pieces: dict[tuple[int, int], list[tuple[int, int, int, float, bool]]] = {}
    waits: dict[tuple[int, int], list[float]] = {}
    for p, segments in enumerate(programs):
        for s in segments:
            last = (p, s.slot) in idle
            pieces.setdefault((s.b, s.head_unit), []).append((s.first_tile, s.n_tiles, p, seg_end[(p, s.slot)], last))
            if last:
                waits.setdefault((s.b, s.head_unit), []).append(seg_end[(p, s.slot)])
    end, chain = kv_end, 0
    for unit, held in pieces.items():
        n = max(first + n_tiles for first, n_tiles, *_ in held)
        wide = group_chunks == 1  # wide row blocks: every fold in column slices, from the workspace
        if len(held) == 1 and n <= group_chunks * INVARIANT_SUPER_GROUPS and not wide:
            stored = math.ceil(n / group_chunks) - 1
            if stored:  # the stored groups' round trip, then their loads
                finish = held[0][3] + gpu.l2_latency_us + _merge_level_us(stored, wave, partial, gpu, False)
                end, chain = max(end, finish), max(chain, stored + 1)
            continue
        groups = [
            _group_ready(held, g0, min(g0 + group_chunks, n), partial, wave, gpu, slices, slice_wave, polls)
            for g0 in range(0, n, group_chunks)
        ]
        supers = []
        for k0 in range(0, len(groups), INVARIANT_SUPER_GROUPS):
            members = groups[k0 : k0 + INVARIANT_SUPER_GROUPS]
            t0, t1 = k0 * group_chunks, min((k0 + len(members)) * group_chunks, n)
            own = [x for x in held if x[0] < t1 and x[0] + x[1] > t0]
            ready = max(r for r, _ in members)
            if slice_wave and len(members) > 1 and len(own) >= INVARIANT_SUPER_SLICE_HOLDERS:
                ready += gpu.l2_latency_us + _super_slices(
                    own,
                    t1,
                    ready,
                    len(members),
                    len(groups) <= INVARIANT_SUPER_GROUPS,
                    partial,
                    gpu,
                    slices,
                    slice_wave,
                    polls,
                )
            elif wide:  # stored, then folded in slices into the supergroup's slot by one program
                ready += (
                    gpu.l2_latency_us
                    + _sliced_merge(len(members), slice_wave, partial, gpu, slices, 1, False, False)[0]
                )
            elif len(members) > 1 or not members[0][1]:  # one split group: its finisher holds the value
                # The groups' values are stored, then loaded: one more L2 trip, as the default
                # tree's second level pays (``_tree_merges``).
                ready += gpu.l2_latency_us + _merge_level_us(
                    len(members), wave, partial, gpu, len(own) > 1 and len(members) > 1
                )
            supers.append((ready, max(c for _, c in members) + len(members)))
        finish, longest = max(supers)
        if len(held) == 1:  # one program folds its supergroups one after another, then them
            finish = held[0][3] + sum(r - held[0][3] for r, _ in supers)
        if len(supers) > 1 or wide:
            finish = max(finish, *(r for r, _ in supers)) + gpu.l2_latency_us
            if slice_wave:
                shared, waiters = len(held) > 1, waits.get(unit, [])
                finish += gpu.l2_latency_us * shared  # the last count
                waiting = [t for t in waiters if finish - t <= polls * gpu.l2_latency_us] if shared else []
                owner_idle = max(t for _, _, _, t, _ in held) in waiters
                mergers = max(1, len(waiting) + (not owner_idle))
                finish += _sliced_merge(len(supers), slice_wave, partial, gpu, slices, mergers, shared, True)[0]
            else:
                finish += _merge_level_us(len(supers), wave, partial, gpu, len(held) > 1)
            longest = max(c for _, c in supers) + len(supers)
        end, chain = max(end, finish), max(chain, longest)
    return end, chain


def _super_slices(
    own: list,
    t1: int,
    ready: float,
    members: int,
    output: bool,
    partial: int,
    gpu: GPUModel,
    slices: int,
    slice_wave: int,
    polls: int,
) -> float:
    """Time of a split supergroup's fold in column slices (``output_fold.finish_super``), once its
    last group is known at ``ready``: by the program that made it known (taken as the holder that
    finishes last) and its holders whose segment is their program's last and ends in it, still
    waiting (``polls`` reads of its count). An ``output`` of one supergroup is stored slice by
    slice; a supergroup of a larger one is counted in."""
    mergers = _sharers(own, t1, ready, polls * gpu.l2_latency_us)
    return _sliced_merge(members, slice_wave, partial, gpu, slices, mergers, True, output)[0]


def _sharers(own: list, end: int, ready: float, wait: float) -> int:
    """Programs that share a split group's or supergroup's fold in column slices, once its last
    member is known at ``ready``: the holder that finishes last (taken as the owner) and the holders
    in ``own`` whose segment is their program's last and ends by chunk ``end``, still waiting
    (``wait``: their polls)."""
    owner = max(own, key=lambda x: x[3])
    waiting = [x for x in own if x[4] and x[0] + x[1] <= end and ready - x[3] <= wait]
    return len(waiting) + (owner not in waiting)


def _group_ready(
    held: list,
    g0: int,
    g1: int,
    partial: int,
    wave: int,
    gpu: GPUModel,
    slices: int = 1,
    slice_wave: int = 0,
    polls: int = MERGE_POLLS,
) -> tuple[float, int]:
    """(time, chain of partials) at which the value of the group of chunks [g0, g1) is known:
    its holders' segments end; with several holders, its last holder then folds the first
    holder's fold and each later chunk: whole, or, where ``slice_wave`` (the plan's SLICE_WAVE) is
    set, in ``slices`` column slices (``folds.finish_group``) shared with the holders whose segment
    is their program's last and ends in the group, still waiting (``polls`` reads of its count),
    after its arrival's count."""
    own = sorted(x for x in held if x[0] < g1 and x[0] + x[1] > g0)
    ready = max(x[3] for x in own)
    loads = 1 + (g1 - (own[0][0] + own[0][1])) if len(own) > 1 else 0
    if loads and slice_wave and len(own) >= INVARIANT_SLICE_HOLDERS:  # a holder a segment
        mergers = _sharers(own, g1, ready, polls * gpu.l2_latency_us)
        ready += gpu.l2_latency_us + _sliced_merge(loads, slice_wave, partial, gpu, slices, mergers, True, False)[0]
    elif loads:
        ready += _merge_level_us(loads, wave, partial, gpu)
    return ready, loads


def fixed_split_schedule(
    method: str, problem: Problem, gpu: GPUModel, splits: int, block_n: int, programs_per_sm: int | None = None
) -> Schedule:
    """CTAs (b, KV head, split) over equal ranges of the capacity, each reading only its sequence's
    tokens in that range; with splits > 1 a combine kernel follows (``_cta_schedule``)."""
    per_split = math.ceil(math.ceil(problem.kv_len / block_n) / splits) * block_n
    ctas = [
        (max(0, min(length, (s + 1) * per_split) - s * per_split), b * problem.n_kv_heads + h)
        for b, length in enumerate(problem.lens)
        for h in range(problem.n_kv_heads)
        for s in range(splits)
    ]
    partials = len(problem.lens) * problem.n_heads * splits if splits > 1 else 0
    return _cta_schedule(method, problem, gpu, ctas, splits, partials, programs_per_sm)


def _cta_schedule(
    method: str,
    problem: Problem,
    gpu: GPUModel,
    ctas: list[tuple],
    splits: int,
    partials: int,
    programs_per_sm: int | None = None,
    roof: float = float("inf"),
) -> Schedule:
    """CTAs, each (tokens, output) in launch order, or (tokens, output, pieces) where several CTAs
    read the same keys, pieces being the (request, KV head, first key, keys) ranges it reads in
    order (``l2.hbm_share`` then credits re-reads), dispatched to the least-loaded SM (an empty
    one exits at once); then, with ``partials`` (partials of V's width, of every sequence) above
    0, a combine kernel: a launch gap, two dependent L2 reads, the partials over every SM's port.
    ``roof``: the most an SM streams at, its tensor cores' (``compute_roof``)."""
    sms = gpu.sms
    load = [(0, sm) for sm in range(sms)]
    work, bars, on_sm, placed = [0] * sms, [], [0] * sms, []
    for tokens, output, *where in ctas:
        if tokens == 0:
            continue
        start, sm = heapq.heappop(load)
        heapq.heappush(load, (start + tokens, sm))
        work[sm] += tokens
        on_sm[sm] += 1
        bars.append((sm, start, tokens, output))
        for request, kv_head, k0, keys in where[0] if where else ():
            placed.append((sm, start, request, kv_head, k0, keys))
            start += keys
    per_sm = programs_per_sm or lean_variant(problem, gpu).config.max_programs_per_sm
    rates = _stream_rates(on_sm, problem, gpu, per_sm, roof=roof)
    bytes_per_token = problem.bytes_per_token
    if placed:
        reads = [
            read
            for sm, start, request, kv_head, k0, keys in placed
            for read in chunk_reads(
                request, kv_head, problem.lens[request], k0, k0 + keys, bytes_per_token,
                lambda keys, sm=sm, start=start: (start + keys) * bytes_per_token / (rates[sm] or 1.0),
            )
        ]  # fmt: skip
        rates = _stream_rates(on_sm, problem, gpu, per_sm, hbm_share(reads, gpu), roof=roof)
    kernel = max((gpu.hbm_latency_us + w * bytes_per_token / r for w, r in zip(work, rates) if w), default=0.0)
    combine = 0.0
    if partials and any(work):  # no CTA wrote a partial: nothing to combine
        nbytes = partials * partial_bytes(problem, 4)
        combine = gpu.launch_gap_us + 2 * gpu.l2_latency_us + nbytes / (sms * gpu.l2_port_gbps * 1e3)
    return Schedule(
        method,
        sms,
        units=sum(on_sm),
        splits=splits,
        sm_work=work,
        time_us=kernel + combine,
        merge_us=combine,
        bars=bars,
    )


def _serial_reduce(
    sched: Schedule, splits: int, in_flight: int, partial_bytes: int, gpu: GPUModel, gap_us: float | None = None
) -> Schedule:
    """A reduce kernel's CTA folds one output's ``splits`` partials in order, ``in_flight`` loads at
    a time: its launch gap (``gap_us``, default the GPU's) and that chain of L2 round trips and
    bytes through one SM's port. The combine kernel costs the larger of this and
    ``_cta_schedule``'s bound (the partials over every SM's port), so only a reduce that runs
    (``merge_us`` > 0) is charged."""
    if not sched.merge_us:
        return sched
    gap = gpu.launch_gap_us if gap_us is None else gap_us
    chain = gap + _merge_level_us(splits, in_flight, partial_bytes, gpu)
    if chain <= sched.merge_us:
        return sched
    return dataclasses.replace(sched, time_us=sched.time_us - sched.merge_us + chain, merge_us=chain)
