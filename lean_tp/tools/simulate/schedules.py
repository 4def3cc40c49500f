"""Each method's schedule of one decode step on a modelled GPU, in modelled time.

- **lean**: the kernel's own schedule and merge tree (``lean_schedule``/``merge_plan`` run the
  kernel's schedule code), a grid of ``SMs x programs per SM``, program p on SM ``p mod SMs``.
- **fa2**: FlashAttention-2's ``num_splits_heuristic``, the FlashDecoding rule, with its splits sized
  from the cache capacity; CTAs go, in launch order, to the least-loaded SM (ideal dynamic
  dispatch), and a split output costs a combine kernel.
- **flex**: FlexAttention's decode rule, ``max(SMs // (B * Hkv) * 2, 1)`` splits of the capacity,
  then its combine kernel.
- MLA problems (``Problem.latent``) against **flashmla** (FlashMLA's split scheduler) and
  **triton_mla** (vLLM's Triton MLA splits), constants with their sources beside each.

Time model (``tools.gpus.GPUS`` holds every constant with its source): an SM streams K/V at
``min(L2 port, bytes in flight / HBM latency)``, all SMs together at most the measured copy
bandwidth; a merge costs L2 round trips (one per atomic, one per wave of partial loads) plus its
partial bytes over the merging SM's L2 port; a second kernel costs a launch gap. Every method
gets the same memory model, so the comparison isolates schedules and merges.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from lean_tp.ops.decode_attention import Features, KernelVariant, lean_schedule
from lean_tp.ops.decode_attention.launch_args import token_lengths
from lean_tp.ops.decode_attention.launcher import merge_plan
from lean_tp.ops.decode_attention.tuning import INVARIANT_GROUP_CHUNKS, INVARIANT_SUPER_GROUPS
from lean_tp.tools.gpus import GPUModel
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
    query tokens."""
    group = problem.n_heads // problem.n_kv_heads
    dtype, fp8 = problem.dtypes
    features = Features(num_tokens=problem.num_tokens, fp8=fp8, batch_invariant=batch_invariant, v_in_k=problem.latent)
    return KernelVariant(
        gpu.arch, dtype, problem.head_dim, group, None, features, head_dim_v=problem.head_dim_v or None
    )


def schedule_lens(problem: Problem, variant: KernelVariant) -> list[int]:
    """Lengths of the schedule's sequences: the problem's, or, when the variant schedules each query
    token as a sequence of its own (``KernelVariant.seq_tokens``), each token's keys up to its own,
    as the launch computes them (``launch_args.token_lengths``)."""
    return token_lengths(torch.tensor(problem.lens, dtype=torch.int32), variant.seq_tokens).tolist()


def _stream_rates(n_on_sm: list[int], problem: Problem, gpu: GPUModel, programs_per_sm: int) -> list[float]:
    """Bytes per microsecond each SM streams K/V at with n_on_sm[sm] programs (or CTAs) resident at
    most ``programs_per_sm``: Little's law per SM, capped by its L2 port, all SMs sharing the
    copy bandwidth in proportion. Every method gets this model."""
    config = lean_variant(problem, gpu).config
    in_flight = max(1, config.num_stages - 1) * config.block_n * problem.bytes_per_token
    want = [min(gpu.l2_port_gbps * 1e3, min(n, programs_per_sm) * in_flight / gpu.hbm_latency_us) for n in n_on_sm]
    share = min(1.0, gpu.hbm_tbps * 1e6 / max(sum(want), 1e-9))
    return [w * share for w in want]


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


def _merge_level_us(members: int, wave: int, partial_bytes: int, gpu: GPUModel, counted: bool = True) -> float:
    """One level of the tree: the arrival atomic (when ``counted``), one L2 round trip per wave of
    partial loads, and the partials through the merger's L2 port."""
    trips = int(counted) + math.ceil(members / wave)
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
    ``max_contributors``, a trial: the schedule's cap instead of the tuning entry's)."""
    variant = lean_variant(problem, gpu, batch_invariant)
    config, cx = variant.config, variant.constexprs
    per_sm = programs_per_sm or config.max_programs_per_sm
    head_units, tile = problem.n_kv_heads * cx["NUM_GC"], config.tile_n
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = schedule_lens(problem, variant)
    programs = lean_schedule(
        torch.tensor(lens, dtype=torch.int32, device=device),
        head_units,
        tile,
        gpu.sms * per_sm,
        num_sms=gpu.sms,
        max_contributors=max_contributors or config.max_contributors,
    )
    sms = gpu.sms
    n_on_sm = [len(range(sm, len(programs), sms)) for sm in range(sms)]
    rates = _stream_rates(n_on_sm, problem, gpu, per_sm)
    bytes_per_token = problem.bytes_per_token
    work, clock, bars, seg_end = [0] * sms, [0] * sms, [], {}
    seg_bytes = [
        [(min(lens[s.b], (s.first_tile + s.n_tiles) * tile) - s.first_tile * tile) * bytes_per_token for s in segments]
        for segments in programs
    ]
    clocks = [
        _shared_clock([sum(seg_bytes[p]) for p in range(sm, len(programs), sms)], rates[sm] or 1.0) for sm in range(sms)
    ]
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
    if batch_invariant:
        end, chain = _invariant_merges(programs, seg_end, kv_end, partial, cx["WAVE"], gpu)
    else:
        end, chain = _tree_merges(plan, seg_end, kv_end, partial, cx["WAVE"], gpu)
    return Schedule(
        "lean",
        sms,
        units=len(programs),
        splits=len(plan),
        sm_work=work,
        time_us=end,
        merge_us=end - kv_end,
        chain=chain,
        merge_bytes=chain * partial,
        bars=bars,
    )


def _tree_merges(plan: dict, seg_end: dict, kv_end: float, partial: int, wave: int, gpu: GPUModel) -> tuple[float, int]:
    """(end, longest chain of partials) of the default mode's merge tree (``merge_plan``): each
    group once its members' segments end, then the output's second level."""
    end, chain = kv_end, 0
    for groups in plan.values():
        done = [max(seg_end[m] for m in g) + _merge_level_us(len(g), wave, partial, gpu) for g in groups]
        finish = max(done)
        if len(groups) > 1:
            finish += gpu.l2_latency_us + _merge_level_us(len(groups), wave, partial, gpu)
        end = max(end, finish)
        chain = max(chain, max(map(len, groups)) + (len(groups) if len(groups) > 1 else 0))
    return end, chain


def _invariant_merges(
    programs, seg_end: dict, kv_end: float, partial: int, wave: int, gpu: GPUModel
) -> tuple[float, int]:
    """(end, longest chain of partials) of the batch-invariant mode's folds (``invariant.py``),
    each a left-to-right fold of ``wave`` partials loaded at once: one L2 round trip per wave, plus
    the arrival atomic where several programs count in. A group of ``INVARIANT_GROUP_CHUNKS`` chunks
    is ready when its holders' segments end (one holder: in registers; several: its last holder
    folds the first holder's fold and each later chunk); a supergroup of
    ``INVARIANT_SUPER_GROUPS`` groups when its groups are, then folded from the workspace; an output
    of several supergroups folds their values. A one-program output of one supergroup keeps its
    last group in registers and, after its K/V loop, folds the others from the workspace, where
    its loop stored them; a supergroup of one split group is the value its last holder folded."""
    pieces: dict[tuple[int, int], list[tuple[int, int, int, float]]] = {}
    for p, segments in enumerate(programs):
        for s in segments:
            pieces.setdefault((s.b, s.head_unit), []).append((s.first_tile, s.n_tiles, p, seg_end[(p, s.slot)]))
    end, chain = kv_end, 0
    for held in pieces.values():
        n = max(first + n_tiles for first, n_tiles, _, _ in held)
        if len(held) == 1 and n <= INVARIANT_GROUP_CHUNKS * INVARIANT_SUPER_GROUPS:
            stored = math.ceil(n / INVARIANT_GROUP_CHUNKS) - 1
            if stored:  # the stored groups' round trip, then their loads
                finish = held[0][3] + gpu.l2_latency_us + _merge_level_us(stored, wave, partial, gpu, False)
                end, chain = max(end, finish), max(chain, stored + 1)
            continue
        groups = [
            _group_ready(held, g0, min(g0 + INVARIANT_GROUP_CHUNKS, n), partial, wave, gpu)
            for g0 in range(0, n, INVARIANT_GROUP_CHUNKS)
        ]
        supers = []
        for k0 in range(0, len(groups), INVARIANT_SUPER_GROUPS):
            members = groups[k0 : k0 + INVARIANT_SUPER_GROUPS]
            t0, t1 = k0 * INVARIANT_GROUP_CHUNKS, min((k0 + len(members)) * INVARIANT_GROUP_CHUNKS, n)
            counted = len({p for first, n_tiles, p, _ in held if first < t1 and first + n_tiles > t0}) > 1
            ready = max(r for r, _ in members)
            if len(members) > 1 or not members[0][1]:  # one split group: its finisher holds the value
                # The groups' values are stored, then loaded: one more L2 trip, as the default
                # tree's second level pays (``_tree_merges``).
                ready += gpu.l2_latency_us + _merge_level_us(
                    len(members), wave, partial, gpu, counted and len(members) > 1
                )
            supers.append((ready, max(c for _, c in members) + len(members)))
        finish, longest = max(supers)
        if len(held) == 1:  # one program folds its supergroups one after another, then them
            finish = held[0][3] + sum(r - held[0][3] for r, _ in supers)
        if len(supers) > 1:
            finish = max(finish, *(r for r, _ in supers)) + gpu.l2_latency_us
            finish += _merge_level_us(len(supers), wave, partial, gpu, len(held) > 1)
            longest = max(c for _, c in supers) + len(supers)
        end, chain = max(end, finish), max(chain, longest)
    return end, chain


def _group_ready(held: list, g0: int, g1: int, partial: int, wave: int, gpu: GPUModel) -> tuple[float, int]:
    """(time, chain of partials) at which the value of the group of chunks [g0, g1) is known:
    its holders' segments end; with several holders, its last holder then folds the first
    holder's fold and each later chunk."""
    own = sorted(x for x in held if x[0] < g1 and x[0] + x[1] > g0)
    ready = max(t for _, _, _, t in own)
    loads = 1 + (g1 - (own[0][0] + own[0][1])) if len(own) > 1 else 0
    if loads:
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
    ctas: list[tuple[int, int]],
    splits: int,
    partials: int,
    programs_per_sm: int | None = None,
) -> Schedule:
    """CTAs, each (tokens, output) in launch order, dispatched to the least-loaded SM (an empty one
    exits at once); then, with ``partials`` (partials of V's width, of every sequence) above 0, a
    combine kernel: a launch gap, two dependent L2 reads, the partials over every SM's port."""
    sms = gpu.sms
    load = [(0, sm) for sm in range(sms)]
    work, bars, on_sm = [0] * sms, [], [0] * sms
    for tokens, output in ctas:
        if tokens == 0:
            continue
        start, sm = heapq.heappop(load)
        heapq.heappush(load, (start + tokens, sm))
        work[sm] += tokens
        on_sm[sm] += 1
        bars.append((sm, start, tokens, output))
    per_sm = programs_per_sm or lean_variant(problem, gpu).config.max_programs_per_sm
    rates = _stream_rates(on_sm, problem, gpu, per_sm)
    bytes_per_token = problem.bytes_per_token
    kernel = max((gpu.hbm_latency_us + w * bytes_per_token / r for w, r in zip(work, rates) if w), default=0.0)
    combine = 0.0
    if partials and any(work):  # no CTA wrote a partial: nothing to combine
        nbytes = partials * ((problem.head_dim_v or problem.head_dim) + 1) * 4
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


# FlashMLA's decode scheduler (deepseek-ai/FlashMLA, csrc/api/dense_decode.h and
# csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu): 64 query rows and 64 keys
# a block, 5 blocks of fixed overhead for each request or piece of one a part takes.
FLASHMLA_BLOCK_M, FLASHMLA_BLOCK_N, FLASHMLA_OVERHEAD = 64, 64, 5


def flashmla_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """FlashMLA's split-KV plan: ``num_sm_parts = SMs / Hkv / ceil(rows / 64)`` parts, each given
    ``ceil(total / parts) + 5`` blocks of the requests in order (a request's blocks plus 5 each),
    cutting a request where a part's budget ends; a CTA per (64-row block, KV head, part), so each
    row block reads the latent rows; a split request is combined by a second kernel."""
    rows = problem.n_heads // problem.n_kv_heads
    m_blocks = math.ceil(rows / FLASHMLA_BLOCK_M)
    parts = max(gpu.sms // problem.n_kv_heads // m_blocks, 1)
    blocks = [max(1, math.ceil(n / FLASHMLA_BLOCK_N)) for n in problem.lens]
    payload = math.ceil(sum(b + FLASHMLA_OVERHEAD for b in blocks) / parts) + FLASHMLA_OVERHEAD
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]  # per part: (request, first, end block)
    part, budget, req, first = 0, payload, 0, 0
    while req < len(blocks) and part < parts:
        left = blocks[req] - first
        if budget >= left + FLASHMLA_OVERHEAD:
            pieces[part].append((req, first, blocks[req]))
            budget -= left + FLASHMLA_OVERHEAD
            req, first = req + 1, 0
            continue
        if budget - FLASHMLA_OVERHEAD > 0:
            pieces[part].append((req, first, first + budget - FLASHMLA_OVERHEAD))
            first += budget - FLASHMLA_OVERHEAD
        part, budget = part + 1, payload
    split = [0] * len(blocks)
    for own in pieces:
        for r, _, _ in own:
            split[r] += 1
    tokens = lambda r, b0, b1: max(0, min(problem.lens[r], b1 * FLASHMLA_BLOCK_N) - b0 * FLASHMLA_BLOCK_N)  # noqa: E731
    ctas = [
        (sum(tokens(r, b0, b1) for r, b0, b1 in pieces[p]), h)
        for p in range(parts)
        for h in range(problem.n_kv_heads)
        for _ in range(m_blocks)
    ]
    partials = sum(n for n in split if n > 1) * rows * problem.n_kv_heads  # the combine reads split requests' only
    return _cta_schedule("flashmla", problem, gpu, ctas, max(split, default=1), partials, programs_per_sm)


# vLLM's Triton MLA decode (vllm/v1/attention/backends/mla/triton_mla.py and
# vllm/v1/attention/ops/triton_decode_attention.py, vLLM 0.33): 16 query heads a CTA; the batch's
# longest length over 512 tokens a split, rounded up to a power of two, at most 2 per SM; one split
# in vLLM's batch-invariant mode.
TRITON_MLA_BLOCK_H, TRITON_MLA_MIN_SPLIT, TRITON_MLA_SPLITS_PER_SM = 16, 512, 2


def triton_mla_splits(problem: Problem, gpu: GPUModel) -> int:
    """vLLM's Triton MLA split count: one for the whole batch, from its longest sequence."""
    ideal = 1 << (max(1, max(problem.lens) // TRITON_MLA_MIN_SPLIT) - 1).bit_length()
    return min(ideal, gpu.sms * TRITON_MLA_SPLITS_PER_SM)


def triton_mla_schedule(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> Schedule:
    """vLLM's Triton MLA plan: CTAs (b, 16-head block, split), split s of sequence b reading its
    keys ``[s, s + 1) x ceil(len_b / splits)``, so each head block reads the latent rows; the
    reduce kernel always follows (it runs with one split too)."""
    splits = triton_mla_splits(problem, gpu)
    group = problem.n_heads // problem.n_kv_heads
    head_blocks = math.ceil(problem.n_heads / min(TRITON_MLA_BLOCK_H, group))
    ctas = [
        (max(0, min(n, (s + 1) * per) - s * per), b)
        for s in range(splits)
        for _ in range(head_blocks)
        for b, n in enumerate(problem.lens)
        for per in (math.ceil(n / splits),)
    ]
    partials = len(problem.lens) * splits * problem.n_heads
    return _cta_schedule("triton_mla", problem, gpu, ctas, splits, partials, programs_per_sm)


def simulate(problem: Problem, gpu: GPUModel, programs_per_sm: int | None = None) -> dict[str, Schedule]:
    """Lean (default and batch-invariant) and its peers on one problem on ``gpu``: FA2 and Flex, or
    for MLA (``Problem.latent``) FlashMLA and vLLM's Triton MLA."""
    lean = {
        "lean": lean_sim_schedule(problem, gpu, programs_per_sm),
        "lean_invariant": lean_sim_schedule(problem, gpu, programs_per_sm, batch_invariant=True),
    }
    if problem.latent:
        return lean | {
            "flashmla": flashmla_schedule(problem, gpu, programs_per_sm),
            "triton_mla": triton_mla_schedule(problem, gpu, programs_per_sm),
        }
    fa2, block_n = fa2_splits(problem, gpu.sms)
    return lean | {
        "fa2": fixed_split_schedule("fa2", problem, gpu, fa2, block_n, programs_per_sm),
        "flex": fixed_split_schedule("flex", problem, gpu, flex_splits(problem, gpu.sms), 64, programs_per_sm),
    }
