"""The Gluon MLA kernel (``lean_tp.ops.mla_gluon``) on CPU: its schedule's ranges, its merge and its
compiled code. The kernel itself needs an sm_90 GPU (tests/gpu/test_mla_decode_gluon_cuda.py, and
benchmarks/mla_decode_gluon.py under scripts/gpu_check.py); here the interpreter runs the two
Triton kernels around it, and the kernel's walk is modelled by the segments ``lean_schedule``
writes with the same helpers."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lean_tp.ops.decode_attention.archs import ARCHS
from lean_tp.ops.decode_attention.launcher import lean_schedule
from lean_tp.ops.decode_attention.tuning import FP_FUSION, TUNING_TABLE
from lean_tp.ops.mla_gluon import launcher
from lean_tp.ops.mla_gluon.launcher import (
    BLOCK_N,
    DR,
    DV,
    ROWS,
    check_schedule,
    combine,
    mla_gluon_schedule,
    program_ranges,
)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mla_decode_gluon.py"
LENS = [0, 1, 63, 64, 65, 130, 0, 700, 64 * 20 + 3]


def _script():
    """The benchmark script as a module (for its problem and float64 reference)."""
    spec = importlib.util.spec_from_file_location("mla_decode_gluon", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _compiled_stats(script: Path, *flags: str) -> dict:
    """A benchmark script's compiled statistics (``--json``), compiled in a process of its own with
    the interpreter off: after an interpreted launch in the same process, triton 3.7.1 fails to
    compile a Gluon kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(script), "--json", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_gluon_mla_kernel_compiles_for_sm90_within_its_budget():
    """No local memory in the K/V loop (one value saved once and reloaded once a segment outside
    it), shared memory within an H100 block's, and a 64-key iteration that reads under 5000 bytes
    of shared memory a key (lean's 64-row loop: 13120, kernel report) with both products on wgmma
    (each warp group's half: 64 x 32 of the score, 64 x 256 of P.V), in fewer SASS than lean's
    64-row loop takes for 32 keys (670)."""
    stats = _compiled_stats(SCRIPT)
    assert stats["loop_local"] == 0 and stats["local_anywhere"] <= 2 and stats["registers"] <= 255, stats
    assert stats["mma_waits"] == [0, 0] and stats["loop_barriers"] <= 9, stats  # each product waited for
    assert stats["shared_bytes"] <= ARCHS["sm90"].smem_per_block, stats  # the most a block may opt into
    assert 0 < stats["smem_read_per_key"] < 5000, stats
    assert stats["hgmma"] == ["HGMMA.64x256x16.F32.BF16", "HGMMA.64x32x16.F32.BF16"], stats
    assert 0 < stats["loop_sass"] < 670, stats


def test_the_overlapped_loop_compiles_for_sm90_with_fewer_barriers():
    """The 16-bit loop that issues each block's score behind the P.V before it
    (``launcher.OVERLAP``): the P.V's wait leaves the score's two products in flight; the row sums
    added once a segment (3 barriers) and the row max exchanged by hand (1) take 5 of the serial
    loop's 9 CTA barriers away; q's rope columns in registers take 256 bytes a key off the serial
    loop's 4832 of shared-memory reads; and the loop keeps the serial one's budget: no local
    memory, both HGMMA shapes, fewer SASS than lean's 64-row loop takes for 32 keys (670)."""
    stats = _compiled_stats(SCRIPT, "--overlap")
    assert stats["mma_waits"] == [0, 2] and stats["loop_barriers"] <= 4, stats
    assert stats["loop_local"] == 0 and stats["local_anywhere"] <= 2 and stats["registers"] <= 255, stats
    assert stats["shared_bytes"] <= ARCHS["sm90"].smem_per_block, stats
    assert 0 < stats["smem_read_per_key"] <= 4832 - 256, stats
    assert stats["hgmma"] == ["HGMMA.64x256x16.F32.BF16", "HGMMA.64x32x16.F32.BF16"], stats
    assert 0 < stats["loop_sass"] < 670, stats


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fp8"], "--fp8: expected with --json"),
        (["--overlap"], "--overlap: expected with --json"),
        (["--json", "--fp8", "--overlap"], "--overlap: expected without --fp8"),
    ],
)
def test_the_benchmarks_kernel_flags_are_refused_where_they_pick_nothing(argv, message, capsys):
    """``--fp8`` and ``--overlap`` pick which kernel ``--json`` prints; alone, or together (an
    e4m3 pool's loop is not overlapped), they are a mistake, named in one line."""
    with pytest.raises(SystemExit):
        _script().main(argv)
    assert message in capsys.readouterr().err


def test_a_calls_kernel_breakdown_reads_longest_first():
    """The benchmark's line of a call's device time by kernel (``breakdown_on_gpu``, GPU only):
    kernels by name without their arguments, the longest first, and their sum; gpu_check keeps it."""
    line = _script().breakdown_line("B=1", {"combine(float*)": 2.0, "mla_decode_gluon_kernel": 5.0})
    assert line == "B=1: device time a call 7.0 us (mla_decode_gluon_kernel 5.0 us, combine 2.0 us)"


def test_the_gluon_mla_kernel_for_an_e4m3_pool_compiles_for_sm90():
    """With an e4m3 pool (``FP8``) each block is copied in bytes, converted to bf16 in shared memory
    by all 8 warps and multiplied as the 16-bit kernel multiplies it: within a block's shared memory
    (the two fp8 buffers and the bf16 copy take what two bf16 buffers took), the same HGMMA
    shapes, and a conversion with no conversion-unit instruction (``e4m3_to_bf16``: one bf16x2
    multiply for two of a block's 64 x 576 values, over 256 threads), and no local memory in the
    kernel: the copy and q are indexed at a runtime 0 (``loops._fixed_index``), so the products'
    operand descriptors are formed in the loop, not hoisted and spilled (triton 3.6, CI's oldest
    stack, and 3.7.1)."""
    stats = _compiled_stats(SCRIPT, "--fp8")
    assert stats["registers"] <= 255 and stats["loop_local"] == 0 and stats["local_anywhere"] == 0, stats
    assert stats["shared_bytes"] <= ARCHS["sm90"].smem_per_block, stats
    assert stats["hgmma"] == ["HGMMA.64x256x16.F32.BF16", "HGMMA.64x32x16.F32.BF16"], stats
    assert stats["conversions"] == 0 and stats["bf16x2_multiplies"] == 64 * 576 // 256 // 2, stats


def _run_e4m3_asm(word: int) -> tuple[int, int]:
    """``attend.E4M3_TO_BF16_ASM`` (both kernels' e4m3 conversion) executed on one 32-bit word of
    four e4m3 bytes: its own instructions read from the string (prmt, and, shr, lop3, mov,
    fma.rn.bf16x2) by their PTX definitions, so a wrong selector, mask, shift or constant there
    fails below."""
    from lean_tp.ops.decode_attention.attend import E4M3_TO_BF16_ASM

    regs = {"$2": word}

    def val(x: str) -> int:
        return regs[x] if x in regs else int(x, 0)

    def bf16_fma(a: int, b: int, c: int) -> int:  # a x b + c a 16-bit lane, rounded once
        lanes = torch.tensor([[(w >> s) & 0xFFFF for w in (a, b, c)] for s in (0, 16)], dtype=torch.int32)
        x, y, z = lanes.to(torch.int16).view(torch.bfloat16).double().unbind(1)
        out = (x * y + z).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(out[0]) | int(out[1]) << 16

    for line in filter(None, map(str.strip, E4M3_TO_BF16_ASM.value.strip("{}").splitlines())):
        op, _, rest = line.strip().rstrip(";").partition(" ")
        args = [a.strip() for a in rest.split(",")] if rest else []
        if op == "prmt.b32":
            d, a, b, sel = args
            pool = val(a).to_bytes(4, "little") + val(b).to_bytes(4, "little")
            regs[d] = int.from_bytes(bytes(pool[(int(sel, 0) >> 4 * i) & 7] for i in range(4)), "little")
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "shr.b32":
            regs[args[0]] = val(args[1]) >> val(args[2])
        elif op == "lop3.b32":
            d, a, b, c, lut = args
            x, y, z, t = val(a), val(b), val(c), int(lut, 0)
            regs[d] = sum(((t >> (4 * (x >> i & 1) + 2 * (y >> i & 1) + (z >> i & 1))) & 1) << i for i in range(32))
        elif op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "fma.rn.bf16x2":
            regs[args[0]] = bf16_fma(val(args[1]), val(args[2]), val(args[3]))
        elif op != ".reg":
            raise AssertionError(f"an instruction the test does not execute: {line!r}")
    return regs["$0"], regs["$1"]


def test_the_e4m3_conversion_is_exact_for_every_code():
    """All 256 e4m3 codes through the kernel's conversion, four a word as the kernel packs them
    (the first in the low byte; the first two out in the first register, low half first): every
    code's bf16 is torch's (zeros, subnormals, normals, both signs), but the two NaN codes, which
    become +-480 (a KV cache holds none; the kernel zeroes the rows past a sequence's end)."""
    codes = torch.arange(256, dtype=torch.uint8)
    got = []
    for w in range(64):
        lo, hi = _run_e4m3_asm(int.from_bytes(bytes(range(4 * w, 4 * w + 4)), "little"))
        got += [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16]
    got = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    nan = want.isnan()
    assert nan.sum() == 2 and torch.equal(got[nan].float(), torch.tensor([480.0, -480.0]))
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert (want[~nan].float() != 0).sum() == 252 and want[1].float() == 2.0**-9  # subnormals among them


def test_the_seesaw_probe_compiles_for_sm90():
    """benchmarks/mla_decode_seesaw.py (FlashMLA's schedule in two warp-specialized groups; not
    run on a GPU yet) compiles for sm_90 within an H100 block's shared memory, both groups at 256
    registers, with the scores' and P.V's HGMMA shapes, and without local memory: each group's K/V
    loop (a pair of blocks) indexes its buffers at a runtime 0, so their operand descriptors are
    formed in the loop (at constant indices the worker partition spills them: 74 local accesses)."""
    stats = _compiled_stats(SCRIPT.with_name("mla_decode_seesaw.py"))
    assert stats["shared_bytes"] <= ARCHS["sm90"].smem_per_block, stats
    assert set(stats["setmaxnreg"]) == {"256"}, stats
    assert stats["hgmma"] == ["HGMMA.64x256x16.F32.BF16", "HGMMA.64x64x16.F32.BF16"], stats
    assert stats["local"] == 0 and len(stats["loops"]) == 2 and all(local == 0 for _, local in stats["loops"]), stats


@pytest.mark.parametrize("head_units,num_programs", [(1, 3), (2, 2), (2, 8), (2, 24)])
def test_program_ranges_are_where_the_schedules_segments_start(head_units, num_programs):
    """Each program's range starts at its first segment of ``lean_schedule`` (same helpers, a lane
    a row block) and spans its tiles; the program that merges an output is its first contributor,
    with the output's contributors and its own slot, and no other program merges it."""
    seqlens = torch.tensor(LENS, dtype=torch.int32)
    ranges = program_ranges(seqlens, head_units, num_programs).tolist()
    programs = lean_schedule(seqlens, head_units, BLOCK_N, num_programs, num_sms=num_programs, lanes=head_units)
    merged = set()
    for p, row in enumerate(ranges):
        t0, t1, b, hu, tile, _, total, _, out_block, n_contrib, slot = row
        segs = programs[p] if p < len(programs) else []
        assert t1 - t0 == sum(s.n_tiles for s in segs), (p, row, segs)
        if not segs:
            assert n_contrib == 0
            continue
        assert (b, hu, tile) == (segs[0].b, segs[0].head_unit, segs[0].first_tile), (p, row, segs)
        last = segs[-1]
        if last.contributors > 1 and last.index == 0:
            assert (out_block, n_contrib, slot) == (last.b * head_units + last.head_unit, last.contributors, last.slot)
            merged.add(out_block)
        else:
            assert n_contrib == 0, (p, row, segs)
    split = {s.b * head_units + s.head_unit for segs in programs for s in segs if s.contributors > 1}
    assert merged == split and total == sum(-(-n // BLOCK_N) for n in LENS) * head_units


def test_a_steps_schedule_is_the_ranges_of_its_clamped_lengths_on_whole_lanes():
    """``mla_gluon_schedule`` (computed once a step, taken by every layer's call): the ranges of
    the lengths clamped to the block table's capacity as the launch clamps them (a negative length
    is 0, one past the table its capacity), on a grid rounded down to whole lanes (Tq 2 x 128
    heads: 4 units, 10 programs -> 8); a schedule of another shape, dtype or lane count is refused
    by name."""
    table = torch.zeros(4, 3, dtype=torch.int32)  # capacity 192 keys
    seqlens = torch.tensor([-5, 64, 1000, 130], dtype=torch.int32)
    schedule = mla_gluon_schedule(seqlens, table, heads=128, tq=2, num_programs=10)
    clamped = torch.tensor([0, 64, 192, 130], dtype=torch.int32)
    assert torch.equal(schedule, program_ranges(clamped, 4, 8))
    check_schedule(schedule, 4, schedule.device)
    for bad, units in ((schedule, 3), (schedule.long(), 4), (schedule[:, :5], 4)):
        with pytest.raises(ValueError, match="schedule: expected mla_gluon_schedule's int32"):
            check_schedule(bad, units, schedule.device)


def test_every_launch_of_the_route_pins_fp_fusion(monkeypatch):
    """The route's three launches (the schedule's ranges, the kernel, the merge) set contraction
    to ``tuning.FP_FUSION``, as lean's Triton kernel does: triton 3.9 warns that its default turns
    it off in 3.10, which would change the measured kernel without a line of ours changing. The
    call runs on CPU past its device check (the ranges and the merge interpreted); the kernel's
    launch, which needs an sm_90 GPU, is recorded."""
    from lean_tp.ops.mla_gluon import kernel as gluon_kernel

    launches = {}

    class Recorder:
        def __init__(self, name, kernel=None):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[self.name] = kwargs
                if self.kernel is not None:
                    self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(launcher, "program_ranges_kernel", Recorder("ranges", launcher.program_ranges_kernel))
    monkeypatch.setattr(launcher, "mla_combine_kernel", Recorder("combine", launcher.mla_combine_kernel))
    monkeypatch.setattr(gluon_kernel, "mla_decode_gluon_kernel", Recorder("kernel"))
    monkeypatch.setattr(launcher, "check_gluon_inputs", lambda *args: None)
    q, pool, seqlens, table = _script().paged_problem([0, 70, 130], heads=64, device="cpu")
    launcher.mla_decode_gluon(q, pool, seqlens, table, num_programs=4)
    assert sorted(launches) == ["combine", "kernel", "ranges"]
    assert all(kwargs["enable_fp_fusion"] is FP_FUSION for kwargs in launches.values()), launches


@pytest.mark.parametrize(
    "heads,tq,num_programs,many",
    [(64, 1, 3, None), (128, 1, 8, None), (128, 1, 24, None), (64, 3, 8, True), (64, 1, 40, True), (64, 1, 40, False)],
)
def test_partials_written_as_the_kernel_walks_merge_into_float64(heads, tq, num_programs, many, monkeypatch):
    """The kernel's walk modelled in float64 from ``lean_schedule``'s segments: each unit's rows
    against the keys its token sees in the segment's tiles (none: out 0, lse -inf), a whole output
    stored at its rows, a split one's normalized partial and lse in the program's slot (0 for its
    first segment, 1 for its last); ``combine`` (interpreted) merges the split ones and writes the
    empty sequences', so out and lse, NaN before, match the float64 reference everywhere. With 3
    query tokens, a length of 1 leaves the first token no key, and 65 hides keys of two tiles from
    it. On 40 programs the longest output has 21 contributors: two steps of the merge's form for
    many contributors, 21 of its form for few (``many`` forces a form)."""
    if many is not None:
        monkeypatch.setattr(launcher, "COMBINE_MANY", 0 if many else 1 << 20)
    script = _script()
    q, pool, seqlens, table = script.paged_problem(LENS, heads=heads, device="cpu", seed=heads + tq, tq=tq)
    ref_out, ref_lse = script.reference(q, pool, seqlens, table)
    units = tq * heads // ROWS
    q_rows = q.reshape(len(LENS), units, ROWS, q.shape[-1]).double()
    out, lse = (
        torch.full((q_rows.numel() // q.shape[-1], DV), float("nan")),
        torch.full((len(LENS) * units * ROWS,), float("nan")),
    )
    part_out = torch.full((num_programs, 2, ROWS, DV), float("nan"))
    part_lse = torch.full((num_programs, 2, ROWS), float("nan"))
    keys = pool.view(-1, pool.shape[-1]).double()
    for p, segs in enumerate(lean_schedule(seqlens, units, BLOCK_N, num_programs, lanes=units)):
        for s in segs:
            seen = int(seqlens[s.b]) - tq + 1 + s.head_unit // (units // tq)
            first, end = s.first_tile * BLOCK_N, min(max(seen, 0), (s.first_tile + s.n_tiles) * BLOCK_N)
            at = table[s.b].long().repeat_interleave(BLOCK_N) * BLOCK_N + torch.arange(BLOCK_N).repeat(table.shape[1])
            kv = keys[at[first : max(end, first)]]
            scores = q_rows[s.b, s.head_unit] @ kv.T * q.shape[-1] ** -0.5
            o = scores.softmax(-1) @ kv[:, :DV] if len(kv) else torch.zeros(ROWS, DV, dtype=torch.float64)
            l = scores.logsumexp(-1)
            if s.contributors == 1:
                rows = slice((s.b * units + s.head_unit) * ROWS, (s.b * units + s.head_unit + 1) * ROWS)
                out[rows], lse[rows] = o.float(), l.float()
            else:
                part_out[p, s.slot], part_lse[p, s.slot] = o.float(), l.float()
    out16 = out.bfloat16()
    combine(program_ranges(seqlens, units, num_programs), seqlens, part_out, part_lse, out16, lse, units)
    torch.testing.assert_close(out16.double().view_as(ref_out), ref_out, atol=1e-2, rtol=0)
    torch.testing.assert_close(lse.double().view_as(ref_lse), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_lean_is_timed_on_the_gluon_kernels_problem(fp8):
    """The script times lean's Triton kernel (``decode_attention_fwd``, interpreted here) on
    ``lean_inputs``: the same rows, pages, lengths, scale and (for an e4m3 pool) fp8 scales as the
    Gluon kernel, so its output matches the kernel's float64 reference. The pool's rows no sequence
    holds are NaN, as ``paged_problem`` builds it for the GPU test."""
    from lean_tp.ops.decode_attention.launcher import decode_attention_fwd

    script = _script()
    problem = script.paged_problem([0, 37, 64, 130], heads=64, device="cpu", fp8=fp8)
    assert problem[1].float().isnan().any()  # the rest of a last page, and the page past every table's end
    ref_out, ref_lse = script.reference(*problem)
    out, lse = decode_attention_fwd(**script.lean_inputs(*problem), softmax_scale=(DV + DR) ** -0.5)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "change,error,name",
    [
        (dict(), ValueError, "q: expected a tensor on an sm_90"),
        (dict(q=torch.zeros(2, 128, 576)), TypeError, "q, pool: expected bfloat16"),
        (dict(overlap=1), TypeError, "overlap: expected a bool, got int"),
        (dict(q=torch.zeros(2, 96, 576, dtype=torch.bfloat16)), ValueError, "q: expected a contiguous"),
        (dict(pool=torch.zeros(4, 32, 576, dtype=torch.bfloat16)), ValueError, "pool: expected"),
        (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError, "cache_seqlens: expected int32"),
        (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "block_table: expected int32"),
        (dict(cache_seqlens=torch.zeros(2, 2, dtype=torch.int32)[:, 0]), ValueError, "cache_seqlens: expected contig"),
        (dict(block_table=torch.zeros(4, 2, dtype=torch.int32).t()), ValueError, "block_table: expected rows contig"),
        (dict(pool=torch.zeros(4, 64, 576, dtype=torch.float8_e5m2)), TypeError, "q, pool: expected bfloat16 and"),
        (dict(pool=torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn)), ValueError, "k_scale: expected a .1,. float32"),
        (dict(k_scale=torch.ones(1)), ValueError, "k_scale: expected None with a torch.bfloat16 pool"),
        (dict(pool=torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn), k_scale=torch.ones(1)), ValueError, "v_scale"),
        (dict(pool=torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn), k_scale=0.5), ValueError, "k_scale: .*got 0.5"),
        (
            dict(pool=torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn), k_scale=torch.ones(2), v_scale=torch.ones(1)),
            ValueError,
            r"k_scale: .*got torch.float32 \(2,\)",
        ),
        (
            dict(pool=torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn), k_scale=torch.ones(1), v_scale=torch.ones(1)),
            ValueError,
            "q: expected a tensor on an sm_90",
        ),
    ],
)
def test_bad_input_is_refused_by_name(change, error, name):
    """Every argument the kernel cannot take is named; the device is checked last, so that here
    the inputs it takes are refused for being on the CPU."""
    args = dict(
        q=torch.zeros(2, 128, 576, dtype=torch.bfloat16),
        pool=torch.zeros(4, 64, 576, dtype=torch.bfloat16),
        cache_seqlens=torch.zeros(2, dtype=torch.int32),
        block_table=torch.zeros(2, 4, dtype=torch.int32),
    )
    with pytest.raises(error, match=name):
        launcher.check_gluon_inputs(**(args | change))


@pytest.mark.parametrize("heads,tq", [(16, 1), (0, 1), (96, 1), (64, 0), (64, 17)])
def test_a_schedule_for_heads_the_kernel_cannot_take_is_refused(heads, tq):
    """The schedule names heads and Tq outside the kernel's (heads in blocks of 64, 1 <= Tq <= 16)
    before it divides by them."""
    with pytest.raises(ValueError, match="heads, tq: expected heads a multiple of 64"):
        mla_gluon_schedule(torch.zeros(2, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), heads, tq)


def _routed_plan(plan_change: dict, **call):
    """An MLA call planned on CPU, then placed on an sm_90 device with its 16-bit MLA entry's
    ``gluon_rows`` (what ``plan_decode`` gives there, but for the device), with
    ``plan_change``'s fields of the plan, its layout, features, kernel or tuning entry replaced."""
    from dataclasses import replace

    from lean_tp.ops.decode_attention.launcher import plan_decode

    script = _script()
    lens, heads, tq = call.pop("lens", [0, 70, 130]), call.pop("heads", 128), call.pop("tq", 1)
    q, pool, seqlens, table = script.paged_problem(lens, heads=heads, device="cpu", tq=tq)
    dtype = call.pop("dtype", torch.bfloat16)
    args = script.lean_inputs(q.to(dtype), pool.to(dtype), seqlens, table) | call
    plan = plan_decode(**args, softmax_scale=576**-0.5)
    parts = dict(layout=plan.layout, features=plan.features, kernel=plan.kernel)
    sm90 = TUNING_TABLE[("sm90", 576, 2)]
    config = replace(plan.kernel.config, **{"gluon_rows": sm90.gluon_rows} | plan_change.get("config", {}))
    parts = {name: replace(part, **plan_change.get(name, {})) for name, part in parts.items()}
    parts["kernel"] = replace(parts["kernel"], arch=plan_change.get("arch", "sm90"), config=config)
    return replace(plan, **parts, **{"device": torch.device("cuda", 0)} | plan_change.get("plan", {}))


@pytest.mark.parametrize(
    "plan_change,call,routed",
    [
        ({}, dict(), True),  # DP attention's 128 heads
        ({}, dict(heads=64, tq=2), True),  # Kimi-K2's 64 heads, MTP: 128 rows
        ({}, dict(heads=64, tq=4), True),
        ({}, dict(heads=64), True),  # Kimi-K2's 64 heads under DP: 64 rows, the kernel's block
        ({"config": dict(gluon_rows=128)}, dict(heads=64), False),  # rows below an entry's gluon_rows
        ({}, dict(heads=64, tq=16), True),
        ({"config": dict(gluon_rows=None)}, dict(), False),  # no entry routes
        ({"config": dict(gluon_rows=256)}, dict(), False),
        ({"plan": dict(device=torch.device("cpu"))}, dict(), False),
        ({"arch": "sm100"}, dict(), False),
        ({"layout": dict(page_size=32)}, dict(), False),
        ({"layout": dict(k_strides=(2 * 64 * 576, 576, 576))}, dict(), False),  # pages not contiguous
        ({"features": dict(fp8=torch.float8_e4m3fn)}, dict(), True),  # where an entry routes e4m3
        ({"features": dict(fp8=torch.float8_e5m2)}, dict(), False),
        ({}, dict(heads=16, tq=4), False),  # 64 rows, heads not in blocks of 64
        ({}, dict(heads=96), False),  # heads not in blocks of 64
        ({}, dict(dtype=torch.float16), False),
        ({}, dict(softcap=30.0), False),
        ({}, dict(window=64), False),
        ({}, dict(sinks=torch.zeros(128)), False),
        ({}, dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), False),
        ({}, dict(batch_invariant=True), False),
    ],
)
def test_gluon_takes_the_planned_calls_its_kernel_takes(plan_change, call, routed):
    """The route's rule (``gluon_takes``): an sm_90 CUDA device whose entry sets ``gluon_rows``,
    a bf16 q and a bf16 or e4m3 cache, contiguous 64-row pages of one latent head with V their
    first 512 columns, Tq x heads of at least ``gluon_rows`` in blocks of 64, Tq <= 16, no feature
    the kernel lacks. Each case changes one thing from a routed call: the plan's fields, or the
    call the plan is made from."""
    from lean_tp.ops.mla_gluon.launcher import gluon_takes

    assert gluon_takes(_routed_plan(plan_change, **call)) is routed


def test_e4m3_calls_follow_the_e4m3_entry():
    """The tuning entries are the cache's: an e4m3 call on sm_90 is planned with the e4m3 entry,
    which sets no ``gluon_rows`` (the kernel's e4m3 path has not run on a GPU), so it stays on the
    Triton kernel however many rows it has; the 16-bit call beside it routes."""
    from dataclasses import replace

    from lean_tp.ops.decode_attention.launcher import plan_decode
    from lean_tp.ops.mla_gluon.launcher import gluon_takes

    script = _script()
    for fp8, routed in ((False, True), (True, False)):
        args = script.lean_inputs(*script.paged_problem([0, 70, 130], heads=128, device="cpu", fp8=fp8))
        plan = plan_decode(**args, softmax_scale=576**-0.5)
        config = TUNING_TABLE[("sm90", 576, 1 if fp8 else 2)]
        kernel = replace(plan.kernel, arch="sm90", config=config)
        assert gluon_takes(replace(plan, kernel=kernel, device=torch.device("cuda", 0))) is routed, fp8


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_runs_a_routed_call_on_the_gluon_op(monkeypatch, fp8):
    """A call the plan routes (``gluon_takes``, forced here: the kernel needs an sm_90 GPU) returns
    ``lean_tp::mla_decode_gluon``'s out and lse, the op given lean's paged cache as the kernel's
    pool (a view: no copy), the lengths, the block table, the scale and an e4m3 cache's k_scale
    and v_scale (the float scales of the call, as (1,) tensors). The kernel is replaced by its
    float64 reference, so the values are exact; ``opcheck`` checks the op's registration (its
    schema, fake and dispatch) over the same stand-in."""
    import lean_tp
    from lean_tp.ops.decode_attention import launcher as lean_launcher

    script, seen = _script(), []
    problem = script.paged_problem([0, 1, 64, 65, 700], heads=128, device="cpu", tq=2, fp8=fp8)
    q, pool, seqlens, table = problem

    def kernel(q, pool, cache_seqlens, block_table, softmax_scale=None, **scales):
        seen.append((pool, softmax_scale, scales))
        out, lse = script.reference(q, pool, cache_seqlens, block_table)
        return out.to(q.dtype), lse.float()

    monkeypatch.setattr(launcher, "mla_decode_gluon", kernel)
    monkeypatch.setattr(lean_launcher, "gluon_takes", lambda plan: True)
    inputs = script.lean_inputs(*problem)
    if fp8:  # as floats: the op makes them tensors
        inputs |= dict(k_scale=script.K_SCALE, v_scale=script.V_SCALE)
    # The stand-in computes at the reference's own scale; the scale the op is given is checked apart.
    out, lse = lean_tp.decode_attention(**inputs, return_lse=True, backend="triton", softmax_scale=0.05)
    ref_out, ref_lse = script.reference(*problem)
    assert torch.equal(out, ref_out.bfloat16()) and torch.equal(lse, ref_lse.float())
    assert seen[0][0].shape == pool.shape and seen[0][0].data_ptr() == pool.data_ptr() and seen[0][1] == 0.05
    scales = {name: torch.tensor([value]) for name, value in (("k_scale", script.K_SCALE), ("v_scale", script.V_SCALE))}
    assert seen[0][2] == {} if not fp8 else all(torch.equal(seen[0][2][n], t) for n, t in scales.items())
    args = (q, inputs["k_cache"], seqlens, table, 576**-0.5, *(scales.values() if fp8 else ()))
    # The schema test perturbs inputs arithmetically, which CPU torch has no e4m3 kernel for; the
    # 16-bit case checks the same schema.
    skip_schema = dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.lean_tp.mla_decode_gluon, args, **(skip_schema if fp8 else {}))
