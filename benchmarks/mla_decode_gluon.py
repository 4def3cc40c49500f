"""The Gluon MLA kernel (``lean_tp.ops.mla_gluon``) on sm_90: its compiled statistics on any
machine, and on an sm_90 GPU its result against float64 and its time beside lean's Triton kernel
(``decode_attention_fwd``, which ``lean_tp.decode_attention`` runs where the entry does not route
to this one) on DP attention's shapes, 64-row pages.

Compiled for sm_90 (triton 3.7.1): 255 registers, no local memory, 225 KB of shared memory, 495
SASS a 64-key iteration and 4832 bytes of shared-memory reads a key, against lean's 64-row loop's
670 SASS a 32-key iteration and 13120 bytes a key (kernel report). For an e4m3 pool: the same
shared memory and 512 bytes more (the row max's exchange), 900 SASS an iteration, 360 of them the
conversion (``tiles.e4m3_to_bf16``: 72 PRMT, 144 LOP3, 72 SHF and 72 bf16x2 multiplies a thread),
no local memory. The overlapped 16-bit loop (``launcher.OVERLAP``: each
block's score issued behind the P.V before it, the row sums added once a segment, the row max
exchanged with one barrier, q's rope columns in registers): 488 SASS and 4 CTA barriers an
iteration against 495 and 9, 4544 bytes of shared-memory reads a key, no local memory.

Measured on an H200 (triton 3.6, with the stream-K schedule and the merge as they are): exact
against float64, 1328 us for 66 sequences of 128 heads and 32k keys against the Triton kernel's
2549, 2.59 us a 64-key iteration of an SM (docs/mla.md). On a GPU it also checks and times the
kernel on an e4m3 pool and the overlapped loop on 16-bit ones (neither yet run on a GPU: no call
takes them), and prints one sequence's call by kernel (``breakdown_on_gpu``)."""

from __future__ import annotations

import argparse
import json
import re

import torch

from lean_tp.ops.mla_gluon.launcher import BLOCK_N, DR, DV, compile_sm90, mla_decode_gluon, mla_gluon_schedule

# An e4m3 pool's scales (k_scale, v_scale): its bytes are the bf16 problem's values over K_SCALE
# (randn / 0.05 stays inside e4m3's 448), and V reads them at another scale, so a scale applied to
# the wrong product fails the reference.
K_SCALE, V_SCALE = 0.05, 0.03


def paged_problem(
    lens: list[int], heads: int = 128, device: str = "cuda", seed: int = 0, tq: int = 1, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [S, heads, 576] (tq 1) or [S, tq, heads, 576], a pool [pages, 64, 576] whose pages are
    shuffled and whose rows no sequence holds are NaN (the rest of a last page, and a page of its
    own), seqlens [S] and block_table [S, max pages] (its entries past a sequence's pages point at
    the NaN page). ``fp8``: the pool in float8_e4m3fn, read at ``fp8_scales``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-n // BLOCK_N) for n in lens]
    order = torch.randperm(sum(pages) + 1, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((len(lens), max(max(pages), 1)), int(order[-1]), dtype=torch.int32)
    held = torch.zeros((sum(pages) + 1) * BLOCK_N, dtype=torch.bool)
    first = 0
    for s, n in enumerate(lens):
        table[s, : pages[s]] = order[first : first + pages[s]]
        held[(table[s, : pages[s]].long()[:, None] * BLOCK_N + torch.arange(BLOCK_N)).reshape(-1)[:n]] = True
        first += pages[s]
    pool = torch.randn(held.numel(), DR + DV, generator=gen, device=device).bfloat16()
    pool[~held.to(device)] = float("nan")
    q = torch.randn(len(lens), tq, heads, DR + DV, generator=gen, device=device).bfloat16()
    q = q[:, 0] if tq == 1 else q
    pool = (pool.float() / K_SCALE).to(torch.float8_e4m3fn) if fp8 else pool
    return q, pool.view(-1, BLOCK_N, DR + DV), torch.tensor(lens, dtype=torch.int32, device=device), table.to(device)


def fp8_scales(pool: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scales an e4m3 pool is read at, as (1,) float32 tensors on its device; none for 16 bits."""
    if pool.dtype != torch.float8_e4m3fn:
        return {}
    return {name: torch.full((1,), v, device=pool.device) for name, v in (("k_scale", K_SCALE), ("v_scale", V_SCALE))}


def reference(
    q: torch.Tensor, pool: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode_gluon`` in float64 (out in q's shape with last dim 512, lse q's shape without
    it) for q's sequences: query token t of Tq sees keys [0, seqlens - Tq + t]; an e4m3 pool's
    rows at ``fp8_scales``' (K_SCALE in the score, V_SCALE in the output)."""
    fp8 = pool.dtype == torch.float8_e4m3fn
    k_scale, v_scale = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
    # An e4m3 pool's rows are gathered as bytes, which every torch indexes on every device.
    rows = pool.view(-1, pool.shape[-1]).view(torch.uint8 if fp8 else pool.dtype)
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    tq = q4.shape[1]
    out = torch.zeros(*q4.shape[:-1], DV, dtype=torch.float64, device=q.device)
    lse = torch.full(q4.shape[:-1], float("-inf"), dtype=torch.float64, device=q.device)
    for s in range(q4.shape[0]):
        n = int(seqlens[s])
        at = block_table[s, : -(-n // BLOCK_N)].long()[:, None] * BLOCK_N + torch.arange(BLOCK_N, device=q.device)
        kv = rows[at.reshape(-1)[:n]].view(pool.dtype).double()
        for t in range(tq):
            seen = kv[: max(n - tq + 1 + t, 0)]
            if len(seen):  # else out 0, lse -inf
                scores = q4[s, t].double() @ seen.T * (k_scale * q.shape[-1] ** -0.5)
                out[s, t], lse[s, t] = scores.softmax(-1) @ seen[:, :DV] * v_scale, scores.logsumexp(-1)
    return out.view(*q.shape[:-1], DV), lse.view(q.shape[:-1])


def lean_inputs(
    q: torch.Tensor, pool: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The same problem as ``lean_tp.decode_attention``'s arguments: q as it is, the pool as
    K [pages, 64, 1, 576] and V its first 512 columns, cache_seqlens and block_table (and an e4m3
    pool's scales)."""
    kv = pool.unsqueeze(2)
    args = dict(q=q, k_cache=kv, v_cache=kv[..., :DV], cache_seqlens=seqlens, block_table=block_table)
    return args | fp8_scales(pool)


def compiled_stats(fp8: bool = False, overlap: bool = False) -> dict[str, int]:
    """The sm_90 kernel's registers, stack bytes, shared memory bytes, and its K/V loop's SASS,
    local loads/stores, CTA barriers and shared-memory bytes read a key
    (``lean_tp.tools.kernel_report.sass``), with the HGMMA shapes of the loop (``fp8``: for an e4m3
    pool, with the loop's conversions; ``overlap``: the overlapped 16-bit loop)."""
    from lean_tp.tools.kernel_report.sass import (
        _kv_loop_instructions,
        dump,
        kv_loop_fp8_conversions,
        kv_loop_of_sass,
        kv_smem_read_bytes,
        resources,
    )

    kernel = compile_sm90(fp8=fp8, overlap=overlap)
    regs, stack, _ = resources(kernel.asm["cubin"])
    sass = dump(kernel.asm["cubin"], "-sass")
    local_anywhere = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    instructions, local = kv_loop_of_sass(sass)
    loop = _kv_loop_instructions(sass)
    # The opcode reads "HGMMA.64" and its operands "x32x16.F32.BF16 ...": the shape is both.
    hgmma = sorted({(op + operands.split()[0]).rstrip(",") for op, operands in loop if op == "HGMMA.64"})
    return dict(
        registers=regs,
        stack_bytes=stack,
        shared_bytes=kernel.metadata.shared,
        loop_sass=instructions,
        loop_local=local,
        local_anywhere=local_anywhere,
        loop_barriers=sum(op.startswith("BAR.SYNC") for op, _ in loop),
        # How many products each wait on the tensor cores leaves in flight ("DEPBAR.LE gsb0, 0x2").
        mma_waits=sorted(int(operands.split(",")[-1], 16) for op, operands in loop if op == "WARPGROUP.DEPBAR.LE"),
        smem_read_per_key=kv_smem_read_bytes(sass, 8) // BLOCK_N,
        hgmma=hgmma,
        # The e4m3 conversion's: on the conversion unit (Triton's own, through fp16), or bf16x2
        # multiplies (``tiles.e4m3_to_bf16``).
        conversions=kv_loop_fp8_conversions(sass),
        bf16x2_multiplies=sum(op.startswith("HMUL2.BF16") for op, _ in loop),
    )


def stats_line(stats: dict, kernel: str = "bf16 pool") -> str:
    return (
        f"sm_90, {kernel}: {stats['registers']} registers, {stats['stack_bytes']} bytes of stack, {stats['loop_local']} local "
        f"loads/stores in the loop, {stats['shared_bytes']} bytes of shared memory, {stats['loop_sass']} SASS and "
        f"{stats['loop_barriers']} CTA barriers a {BLOCK_N}-key iteration, {stats['smem_read_per_key']} bytes of shared-memory reads a key, {stats['conversions']} conversions, "
        f"{stats['hgmma']}"
    )


def run_on_gpu(n_keys: int) -> list[str]:
    """Exactness against float64, then the kernel's time beside lean's Triton kernel, ``n_keys``
    keys a sequence: DeepSeek-V3's 128 heads on a sequence per 2 SMs and at the benchmark's B=32,
    and Kimi-K2's 64 heads at B=32 (whose one-token calls the entry keeps on Triton until this
    line says otherwise), with a 16-bit pool; DeepSeek-V3's two with an e4m3 one (which the entry
    keeps on Triton until this line says otherwise)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(sms // 2, 128, False), (32, 128, False), (32, 64, False), (sms // 2, 128, True), (32, 128, True)]
    return [_gpu_line(n_keys, sequences, heads, fp8, sms) for sequences, heads, fp8 in shapes]


def _gpu_line(n_keys: int, sequences: int, heads: int, fp8: bool, sms: int) -> str:
    """``run_on_gpu``'s line of one shape on ``sms`` SMs; a 16-bit pool's with the overlapped loop
    (``launcher.OVERLAP``) checked and timed beside the serial one."""
    from bench_decode import Timer

    from lean_tp.ops.decode_attention.launcher import decode_attention_fwd

    def median_us(fn) -> float:
        return Timer(torch.device("cuda"), 20)([fn])[0] * 1e6

    problem = paged_problem([n_keys] * sequences, heads=heads, fp8=fp8)
    q, pool, seqlens, table = problem
    scales = fp8_scales(pool)
    ref_out, ref_lse = reference(q[:2], pool, seqlens[:2], table[:2])
    step = mla_gluon_schedule(seqlens, table, heads)  # once a step, as FlashMLA's metadata
    iterations = sequences * heads // 64 * -(-n_keys // BLOCK_N) / sms
    loops = []
    for overlap in (False,) if fp8 else (False, True):
        out, lse = mla_decode_gluon(*problem, **scales, overlap=overlap)
        nonfinite = int((~out.isfinite()).sum()) + int((~lse.isfinite()).sum())  # every length > 0
        out_err = (out[:2].double() - ref_out).abs().max().item()  # 2 sequences: float64's cost
        lse_err = (lse[:2].double() - ref_lse).abs().max().item()
        us = median_us(lambda: mla_decode_gluon(*problem, schedule=step, **scales, overlap=overlap))
        loops.append(
            f"gluon{', overlapped' if overlap else ''}: {nonfinite} values not finite, max |out - float64| "
            f"{out_err:.2e}, |lse - float64| {lse_err:.2e}, {us:.1f} us ({us / iterations:.2f} us a {BLOCK_N}-key "
            "iteration of an SM)"
        )
    lean_args = dict(lean_inputs(*problem), softmax_scale=(DV + DR) ** -0.5)
    triton_us = median_us(lambda: decode_attention_fwd(**lean_args)[0])
    return (
        f"{sequences} sequences x {heads} heads x {n_keys} keys, 64-row pages, {pool.dtype} pool: "
        f"{'; '.join(loops)}; lean's Triton kernel {triton_us:.1f} us"
    )


def kernel_times_us(fn, calls: int = 10) -> dict[str, float]:
    """Device microseconds a call of ``fn`` spends in each kernel it launches (torch.profiler over
    ``calls`` calls, after one that compiles and warms)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def breakdown_line(label: str, times: dict[str, float]) -> str:
    """One line of ``kernel_times_us``: each kernel's time a call, the longest first, and their sum."""
    kernels = ", ".join(
        f"{name.split('(')[0][:48]} {us:.1f} us" for name, us in sorted(times.items(), key=lambda t: -t[1])
    )
    return f"{label}: device time a call {sum(times.values()):.1f} us ({kernels})"


def breakdown_on_gpu(n_keys: int) -> list[str]:
    """Where one sequence's call goes, kernel by kernel (DeepSeek-V3's 128 heads, 4k and ``n_keys``
    keys): the Gluon kernel with its schedule computed once a step, and ``lean_tp.decode_attention``
    routing the call to it (its schedule a launch of the call). Graph replays of these calls took
    38.6 us at 4k and 60.3 at 32k on the H200, where the simulator gives 8.2 and 32.0 (docs/mla.md)."""
    import lean_tp

    lines = []
    for keys in (4096, n_keys):
        problem = paged_problem([keys], heads=128)
        step = mla_gluon_schedule(problem[2], problem[3], 128)
        args = dict(lean_inputs(*problem), softmax_scale=(DV + DR) ** -0.5)
        for label, fn in (
            ("mla_decode_gluon", lambda: mla_decode_gluon(*problem, schedule=step)),
            ("lean_tp.decode_attention", lambda: lean_tp.decode_attention(**args)),
        ):
            lines.append(breakdown_line(f"1 sequence x 128 heads x {keys} keys, {label}", kernel_times_us(fn)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=32768, help="keys a sequence, on a GPU (32768)")
    parser.add_argument("--json", action="store_true", help="print the compiled statistics as JSON, nothing else")
    parser.add_argument("--fp8", action="store_true", help="with --json: the kernel for an e4m3 pool")
    parser.add_argument("--overlap", action="store_true", help="with --json: the overlapped 16-bit loop")
    args = parser.parse_args(argv)
    for flag in ("fp8", "overlap"):
        if getattr(args, flag) and not args.json:
            parser.error(f"--{flag}: expected with --json (without it every kernel's statistics are printed)")
    if args.fp8 and args.overlap:
        parser.error("--overlap: expected without --fp8 (an e4m3 pool's loop is not overlapped)")
    if args.json:
        print(json.dumps(compiled_stats(args.fp8, args.overlap)))
        return 0
    print(stats_line(compiled_stats()))
    print(stats_line(compiled_stats(overlap=True), "bf16 pool, overlapped loop"))
    print(stats_line(compiled_stats(fp8=True), "e4m3 pool"))
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        print("\n".join(run_on_gpu(args.keys) + breakdown_on_gpu(args.keys)))
    else:
        print("no sm_90 GPU: compiled statistics only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
