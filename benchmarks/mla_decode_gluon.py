"""The Gluon MLA kernel (``lean_tp.ops.mla_gluon``) on sm_90: its compiled statistics on any
machine, and on an sm_90 GPU its result against float64 and its time beside lean's Triton kernel
(``decode_attention_fwd``, which ``lean_tp.decode_attention`` runs where the entry does not route
to this one) on DP attention's shapes, 64-row pages.

Compiled for sm_90 (triton 3.7.1): 255 registers, no local memory, 225 KB of shared memory, 497
SASS a 64-key iteration and 4832 bytes of shared-memory reads a key, against lean's 64-row loop's
670 SASS a 32-key iteration and 13120 bytes a key (kernel report).

Measured on an H200 (triton 3.6, with the stream-K schedule and the merge as they are): exact
against float64, 1328 us for 66 sequences of 128 heads and 32k keys against the Triton kernel's
2549, 2.59 us a 64-key iteration of an SM (docs/mla.md). On a GPU it also prints one sequence's
call by kernel (``breakdown_on_gpu``)."""

from __future__ import annotations

import argparse
import json
import re

import torch

from lean_tp.ops.mla_gluon.launcher import BLOCK_N, DR, DV, compile_sm90, mla_decode_gluon, mla_gluon_schedule


def paged_problem(
    lens: list[int], heads: int = 128, device: str = "cuda", seed: int = 0, tq: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [S, heads, 576] (tq 1) or [S, tq, heads, 576], a pool [pages, 64, 576] whose pages are
    shuffled and whose rows no sequence holds are NaN (the rest of a last page, and a page of its
    own), seqlens [S] and block_table [S, max pages] (its entries past a sequence's pages point at
    the NaN page)."""
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
    return q, pool.view(-1, BLOCK_N, DR + DV), torch.tensor(lens, dtype=torch.int32, device=device), table.to(device)


def reference(
    q: torch.Tensor, pool: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode_gluon`` in float64 (out in q's shape with last dim 512, lse q's shape without
    it) for q's sequences: query token t of Tq sees keys [0, seqlens - Tq + t]."""
    rows = pool.view(-1, pool.shape[-1])
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    tq = q4.shape[1]
    out = torch.zeros(*q4.shape[:-1], DV, dtype=torch.float64, device=q.device)
    lse = torch.full(q4.shape[:-1], float("-inf"), dtype=torch.float64, device=q.device)
    for s in range(q4.shape[0]):
        n = int(seqlens[s])
        at = block_table[s, : -(-n // BLOCK_N)].long()[:, None] * BLOCK_N + torch.arange(BLOCK_N, device=q.device)
        kv = rows[at.reshape(-1)[:n]].double()
        for t in range(tq):
            seen = kv[: max(n - tq + 1 + t, 0)]
            if len(seen):  # else out 0, lse -inf
                scores = q4[s, t].double() @ seen.T * q.shape[-1] ** -0.5
                out[s, t], lse[s, t] = scores.softmax(-1) @ seen[:, :DV], scores.logsumexp(-1)
    return out.view(*q.shape[:-1], DV), lse.view(q.shape[:-1])


def lean_inputs(
    q: torch.Tensor, pool: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The same problem as ``lean_tp.decode_attention``'s arguments: q as it is, the pool as
    K [pages, 64, 1, 576] and V its first 512 columns, cache_seqlens and block_table."""
    kv = pool.unsqueeze(2)
    return dict(q=q, k_cache=kv, v_cache=kv[..., :DV], cache_seqlens=seqlens, block_table=block_table)


def compiled_stats() -> dict[str, int]:
    """The sm_90 kernel's registers, stack bytes, shared memory bytes, and its K/V loop's SASS,
    local loads/stores and shared-memory bytes read a key (``lean_tp.tools.kernel_report.sass``),
    with the HGMMA shapes of the loop."""
    from lean_tp.tools.kernel_report.sass import (
        _kv_loop_instructions,
        dump,
        kv_loop_of_sass,
        kv_smem_read_bytes,
        resources,
    )

    kernel = compile_sm90()
    regs, stack, _ = resources(kernel.asm["cubin"])
    local_anywhere = len(re.findall(r"\b(?:LDL|STL)\b", dump(kernel.asm["cubin"], "-sass")))
    sass = dump(kernel.asm["cubin"], "-sass")
    instructions, local = kv_loop_of_sass(sass)
    # The opcode reads "HGMMA.64" and its operands "x32x16.F32.BF16 ...": the shape is both.
    hgmma = sorted(
        {(op + operands.split()[0]).rstrip(",") for op, operands in _kv_loop_instructions(sass) if op == "HGMMA.64"}
    )
    return dict(
        registers=regs,
        stack_bytes=stack,
        shared_bytes=kernel.metadata.shared,
        loop_sass=instructions,
        loop_local=local,
        local_anywhere=local_anywhere,
        smem_read_per_key=kv_smem_read_bytes(sass, 8) // BLOCK_N,
        hgmma=hgmma,
    )


def stats_line(stats: dict) -> str:
    return (
        f"sm_90: {stats['registers']} registers, {stats['stack_bytes']} bytes of stack, {stats['loop_local']} local "
        f"loads/stores in the loop, {stats['shared_bytes']} bytes of shared memory, {stats['loop_sass']} SASS a "
        f"{BLOCK_N}-key iteration, {stats['smem_read_per_key']} bytes of shared-memory reads a key, {stats['hgmma']}"
    )


def run_on_gpu(n_keys: int) -> list[str]:
    """Exactness against float64, then the kernel's time beside lean's Triton kernel, ``n_keys``
    keys a sequence: DeepSeek-V3's 128 heads on a sequence per 2 SMs and at the benchmark's B=32,
    and Kimi-K2's 64 heads at B=32 (whose one-token calls the entry keeps on Triton until this
    line says otherwise)."""
    from bench_decode import Timer

    from lean_tp.ops.decode_attention.launcher import decode_attention_fwd

    def median_us(fn) -> float:
        return Timer(torch.device("cuda"), 20)([fn])[0] * 1e6

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = []
    for sequences, heads in ((sms // 2, 128), (32, 128), (32, 64)):
        problem = paged_problem([n_keys] * sequences, heads=heads)
        out, lse = mla_decode_gluon(*problem)
        q, pool, seqlens, table = problem
        ref_out, ref_lse = reference(q[:2], pool, seqlens[:2], table[:2])
        nonfinite = int((~out.isfinite()).sum()) + int((~lse.isfinite()).sum())  # every length > 0
        out_err = (out[:2].double() - ref_out).abs().max().item()  # 2 sequences: float64's cost
        lse_err = (lse[:2].double() - ref_lse).abs().max().item()
        step = mla_gluon_schedule(seqlens, table, heads)  # once a step, as FlashMLA's metadata
        gluon_us = median_us(lambda: mla_decode_gluon(*problem, schedule=step))
        lean_args = dict(lean_inputs(*problem), softmax_scale=(DV + DR) ** -0.5)
        triton_us = median_us(lambda: decode_attention_fwd(**lean_args)[0])
        iterations = sequences * heads // 64 * -(-n_keys // BLOCK_N) / sms
        lines.append(
            f"{sequences} sequences x {heads} heads x {n_keys} keys, 64-row pages: {nonfinite} values not finite, "
            f"max |out - float64| {out_err:.2e}, |lse - float64| {lse_err:.2e}; gluon {gluon_us:.1f} us "
            f"({gluon_us / iterations:.2f} us a {BLOCK_N}-key iteration of an SM), lean's Triton kernel "
            f"{triton_us:.1f} us"
        )
    return lines


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
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(compiled_stats()))
        return 0
    print(stats_line(compiled_stats()))
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        print("\n".join(run_on_gpu(args.keys) + breakdown_on_gpu(args.keys)))
    else:
        print("no sm_90 GPU: compiled statistics only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
