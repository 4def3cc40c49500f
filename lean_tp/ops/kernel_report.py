"""What ``decode_attention_fwd_kernel`` compiles to for every tuning-table entry, read on CPU.

    python -m lean_tp.ops.kernel_report            # markdown table (docs/kernel_report.md)
    python -m lean_tp.ops.kernel_report --json     # one object per kernel, for machines
    python -m lean_tp.ops.kernel_report --set block_n=128   # a trial: every entry with a field changed

Each kernel is compiled for sm_80 or sm_90 exactly as a launch would specialize it
(``launcher.compile_as_launched``), with a GQA group of 4. Read from the cubin and PTX:

- ``regs``, ``spill_bytes`` (the stack frame; Triton kernels make no calls, so it holds spills),
  ``shared_bytes`` (dynamic + static); ``loop_spills``: local-memory loads and stores (``LDL``,
  ``STL``) inside the K/V loop. ptxas spills a few cold values (read once per segment or once per
  program) when that reaches the next occupancy step (e.g. 128 registers: 2 programs of 8 warps);
  a spill inside the loop would cost on every K/V block;
- ``programs_per_sm`` on an A100 (sm_80) or H100 (sm_90), from ``launcher.programs_per_sm``;
- ``k_load_bytes``, ``v_load_bytes``: width of the K and of the V global loads, the most frequent
  width among the ``cp.async`` copies of K's and of V's commit groups (the kernel loads each block's
  K, then its V: the groups alternate; 4-byte copies are page ids), or among ``ld.global`` data
  loads for both when nothing is copied asynchronously;
- ``kv_buffers``: K/V tiles the shared memory holds per operand (2 or more: multi-buffered; the
  pipeliner's (buffers, BLOCK_N, BLOCK_D) allocations in the TTGIR, which an fp8 kernel's staged
  16-bit tiles do not change), and
  ``wait_group``: the most ``cp.async`` groups left in flight while computing (0: none);
- ``sass_per_iter``: SASS instructions in one iteration of the K/V loop (BLOCK_N keys), read from
  ``cuobjdump -sass``: the innermost loop holding the most multiply-accumulates (``HMMA``, or
  ``FFMA`` for fp32's "ieee" dots);
- ``page_id_loads``, ``page_ids_read_same_iter``: block-table loads (32-bit ``LDG.E``, or 4-byte
  ``LDGSTS.E`` copies a stage ahead) of one thread in one K/V-loop iteration, and how many of them
  the same iteration reads (each such read waits for a global load; ``page_id_timing``);
- ``merge_wave``: partials the merge loads per loop iteration (``WAVE``), ``merge_sass_per_wave`` and
  ``merge_loads_per_wave``: SASS instructions and L2 (``.cg``) loads of one iteration of the merge
  loop, which merges one wave; SASS per contributor is their ratio to ``merge_wave``.

No GPU is needed: ``ptxas`` and ``cuobjdump`` come with Triton.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from lean_tp import cli

LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
REPORT_GROUP = 4  # Llama-3-8B and -70B's GQA group
# Serving-feature variants (``launcher.KernelFeatures`` fields), by name; "" is one-token decode.
FEATURES = {
    "": {},
    "fp8_e4m3": {"fp8": torch.float8_e4m3fn},
    "fp8_e5m2": {"fp8": torch.float8_e5m2},
    "tq4": {"num_tokens": 4},
    "softcap": {"softcap": True},
    "window": {"window": True},
    "sinks": {"sinks": True},
    "tq4_window": {"num_tokens": 4, "window": True},
    "all": {"num_tokens": 4, "fp8": torch.float8_e4m3fn, "softcap": True, "window": True, "sinks": True},
    "v_strides": {"kv_strides_differ": True},  # V's strides not K's: addresses formed twice
    "invariant": {"batch_invariant": True},
    "all_invariant": {"num_tokens": 4, "fp8": torch.float8_e4m3fn, "softcap": True, "window": True, "sinks": True,
                      "batch_invariant": True},
}
# Head dims that are not a power of two (Phi-3's 96, and others models use), padded by the kernel.
PADDED_HEAD_DIMS = (40, 80, 96, 112, 160, 192)


@dataclasses.dataclass(frozen=True)
class KernelStats:
    arch: str
    head_dim: int
    dtype: str
    layout: str
    group: int
    leftpad: bool
    features: str
    block_n: int
    num_warps: int
    regs: int
    spill_bytes: int
    shared_bytes: int
    programs_per_sm: int
    k_load_bytes: int
    v_load_bytes: int
    kv_buffers: int
    wait_group: int
    sass_per_iter: int
    loop_spills: int
    merge_wave: int  # partials the merge loads per loop iteration (one wave)
    merge_sass_per_wave: int  # SASS instructions of one merge iteration (one wave of partials)
    merge_loads_per_wave: int  # L2 loads (.cg, SASS instructions) in one merge-loop iteration
    page_id_loads: int = 0  # block-table loads per thread in one K/V-loop iteration (paged only)
    page_ids_read_same_iter: int = 0  # of them, read in the iteration that issues them

    @property
    def _gpu(self):
        from lean_tp.simulate import GPUS

        return next(g for g in GPUS.values() if g.arch == self.arch)

    @property
    def kv_tile_bytes(self) -> int:
        """K and V bytes one K/V-loop iteration reads (BLOCK_N keys of each)."""
        fp8 = FEATURES[self.features].get("fp8")
        elem = fp8.itemsize if fp8 is not None else DTYPES[self.dtype].itemsize
        return 2 * self.block_n * self.head_dim * elem

    @property
    def issue_share(self) -> float:
        """Share of an SM's issue slots the K/V loop needs to keep up with the device's copy
        bandwidth: SASS per iteration x warps over 4 schedulers, against the cycles the iteration's
        bytes take at the SM's share of that bandwidth (constants: ``lean_tp.simulate.GPUS``)."""
        gpu = self._gpu
        cycles = self.kv_tile_bytes / (gpu.hbm_tbps * 1e12 / gpu.sms) * gpu.clock_ghz * 1e9
        return self.sass_per_iter * self.num_warps / 4 / cycles

    @property
    def kv_bytes_buffered(self) -> int:
        """K/V bytes an SM's programs hold in their shared-memory buffers (programs x buffers x K and
        V tile bytes): the most they can have in flight."""
        return self.programs_per_sm * max(self.kv_buffers, 1) * self.kv_tile_bytes

    @property
    def littles_law_bytes(self) -> int:
        """Bytes an SM must keep in flight to read at its share of copy bandwidth, at the loaded
        memory latency of ``GPUS``."""
        gpu = self._gpu
        return round(gpu.hbm_tbps * 1e12 / gpu.sms * gpu.hbm_latency_us * 1e-6)

    def as_json(self) -> dict:
        derived = ("kv_tile_bytes", "issue_share", "kv_bytes_buffered", "littles_law_bytes")
        return dataclasses.asdict(self) | {name: getattr(self, name) for name in derived}


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _dump(cubin: bytes, flag: str) -> str:
    """``cuobjdump FLAG`` of a cubin held in memory."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), flag, f.name], capture_output=True, text=True, check=True).stdout


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, static shared bytes) of the cubin's one kernel."""
    text = _dump(cubin, "--dump-resource-usage")
    regs, stack, shared = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text).groups()
    return int(regs), int(stack), int(shared)


def _sass_loops(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """(address, opcode) of every instruction, and the innermost loops (backward branches with no
    other loop inside) as (first, last) addresses, of ``cuobjdump -sass`` output."""
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)]
    loops = [(int(target, 16), int(addr, 16)) for addr, target in re.findall(r"/\*([0-9a-f]+)\*/[^;]*?\bBRA\b[^;]*?0x([0-9a-f]+)\s*;", text)
             if int(target, 16) < int(addr, 16)]  # fmt: skip
    return code, [(lo, hi) for lo, hi in loops if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]


def _count(code: list[tuple[int, str]], loop: tuple[int, int], matches) -> int:
    """Instructions of ``loop`` whose opcode ``matches``."""
    return sum(matches(op) for a, op in code if loop[0] <= a <= loop[1])


def _kv_loop(code: list[tuple[int, str]], innermost: list[tuple[int, int]]) -> tuple[int, int]:
    """(first, last) address of the K/V loop among ``_sass_loops``'s innermost loops: the one
    holding the most tensor-core multiply-accumulates (HMMA/HGMMA), or the most FFMA when no loop
    has any (fp32's "ieee" dots). The merge's loop has FFMA but no HMMA."""
    tensor_core = lambda op: op.split(".")[0] in ("HMMA", "HGMMA")  # noqa: E731
    macs = tensor_core if any(_count(code, loop, tensor_core) for loop in innermost) else (lambda op: op.split(".")[0] == "FFMA")
    return max(innermost, key=lambda loop: _count(code, loop, macs), default=(0, -1))


def kv_loop_of_sass(text: str) -> tuple[int, int]:
    """(instructions, LDL/STL) of the K/V loop (``_kv_loop``) in ``cuobjdump -sass`` output."""
    code, innermost = _sass_loops(text)
    lo, hi = _kv_loop(code, innermost)
    body = [op.split(".")[0] for a, op in code if lo <= a <= hi]
    return len(body), sum(op in ("LDL", "STL") for op in body)


def _registers(operands: str) -> set[int]:
    """General registers an operand list names (``R7``, a pair ``R6.64``; not ``UR``/``RZ``)."""
    regs = set()
    for n, pair in re.findall(r"(?<![A-Z])R(\d+)(\.64)?", operands):
        regs |= {int(n), int(n) + 1} if pair else {int(n)}
    return regs


def page_id_timing(text: str) -> tuple[int, int]:
    """(block-table loads, of them read in the iteration that issues them) in the K/V loop.

    A block-table load is a 32-bit ``LDG.E`` into a register, or a 4-byte ``LDGSTS.E`` into shared
    memory: the pipeliner's copy a stage ahead (``DecodeConfig.paged_stages``), read after a wait
    on a later pass (K/V data arrive by 16-byte ``LDGSTS`` or wider loads, the merge's partials by
    ``.STRONG.GPU`` loads, outside the loop). A register load is read in its own iteration when a
    later instruction of the loop body reads its register before any writes it; otherwise the
    value is carried to the next iteration, which is what hides its latency.
    """
    lo, hi = _kv_loop(*_sass_loops(text))
    body = [(op, rest) for a, op, rest in
            ((int(a, 16), op, rest) for a, op, rest in
             re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", text))
            if lo <= a <= hi]  # fmt: skip
    loads = same = 0
    for i, (op, rest) in enumerate(body):
        loads += op == "LDGSTS.E"
        if not re.fullmatch(r"LDG\.E(\.CONSTANT)?", op):
            continue
        loads += 1
        reg = min(_registers(rest.split(",")[0]))
        for later_op, later in body[i + 1 :]:
            first, _, sources = later.partition(",")
            # A first operand that is a bare register is written (a pair by .WIDE); any other
            # (an address, a predicate) is read.
            writes = _registers(first) if re.fullmatch(r"\s*R\d+\S*\s*", first) else set()
            if "WIDE" in later_op and writes:
                writes |= {min(writes) + 1}
            if reg in _registers(sources) | (_registers(first) - writes):
                same += 1
                break
            if reg in writes:
                break
    return loads, same


def merge_loop_of_sass(text: str) -> tuple[int, int]:
    """(instructions, partial loads) of one iteration of the merge's loop: the innermost loop with
    the most L2-coherent loads (``ld.global.cg``, ``LDG.E*.STRONG.GPU`` in SASS), one wave of
    partials per iteration; (0, 0) when there is none."""
    code, innermost = _sass_loops(text)
    coherent = lambda op: op.startswith("LDG") and op.endswith("STRONG.GPU")  # noqa: E731
    best = max(innermost, key=lambda loop: _count(code, loop, coherent), default=None)
    if best is None or not _count(code, best, coherent):
        return 0, 0
    return _count(code, best, lambda op: True), _count(code, best, coherent)


def _kv_load_bytes(ptx: str) -> tuple[int, int]:
    """(K, V) global load widths in bytes; see the module docstring."""
    copy = r"cp\.async\.c[ag]\.shared\.global[^;]*?, (0x[0-9a-f]+)"
    groups = [[int(w, 16) for w in re.findall(copy, g)] for g in ptx.split("cp.async.commit_group")]
    # Page ids copied a stage ahead (paged_stages) are 4-byte copies of their own, or joined to a
    # K/V group: K/V tiles are copied 8 or 16 bytes at a time.
    groups = [wide for g in groups if (wide := [w for w in g if w > 4])]
    if groups:
        k, v = (collections.Counter(w for g in groups[i::2] for w in g) for i in (0, 1))
        return k.most_common(1)[0][0], (v or k).most_common(1)[0][0]
    # No async copies: data loads into registers (.cg loads are the merge's partials).
    widths = [int(vec or 1) * int(bits) // 8 for vec, bits in re.findall(r"ld\.global(?:\.L1::\w+)?(?:\.v(\d))?\.b(\d+)", ptx)]
    width = collections.Counter(widths).most_common(1)[0][0] if widths else 0
    return width, width


def _kv_buffers(ttgir: str, block_n: int) -> int:
    """K/V tiles per operand that the pipeliner allocates ((buffers, BLOCK_N, columns) shared
    allocations: BLOCK_D columns, a quarter of them for fp8 read as int32 words), 1 when it
    allocates none (the tile is staged once, in the loop)."""
    shapes = re.findall(rf"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x{block_n}x\d+x", ttgir)
    return max((int(n) for n in shapes), default=1)


def compile_stats(arch: str, head_dim: int, dtype: str, layout: str, group: int = REPORT_GROUP,
                  leftpad: bool = False, overrides: tuple[tuple[str, int], ...] = (), features: str = "") -> KernelStats:  # fmt: skip
    """Compile one kernel as launched for ``arch`` ("sm80" or "sm90") and read its statistics.

    ``overrides``: (field, value) pairs replacing tuning-table fields, for trials of other settings;
    ``features``: a key of ``FEATURES`` (``dtype`` stays q's dtype; fp8 variants change the cache's).
    """
    from triton.backends.compiler import GPUTarget

    from lean_tp.ops.decode_attention.launcher import (
        SM_LIMITS,
        KernelFeatures,
        compile_as_launched,
        example_args,
        programs_per_sm,
    )
    from lean_tp.ops.decode_attention.tuning import config_for

    torch_dtype = DTYPES[dtype]
    variant = KernelFeatures(**FEATURES[features])
    config = dataclasses.replace(config_for(arch, head_dim, torch_dtype, variant.fp8), **dict(overrides))
    args = example_args(torch_dtype, head_dim, group, LAYOUTS[layout], leftpad, config, features=variant, arch=arch)
    kernel = compile_as_launched(args, config, GPUTarget("cuda", int(arch[2:]), 32))
    regs, stack, static_shared = _resources(kernel.asm["cubin"])
    shared = kernel.metadata.shared + static_shared
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", kernel.asm["ptx"])]
    sass = _dump(kernel.asm["cubin"], "-sass")
    return KernelStats(
        arch, head_dim, dtype, layout, group, leftpad, features, config.block_n, config.num_warps, regs, stack, shared,
        programs_per_sm(regs, shared, config.num_warps, SM_LIMITS[arch]),
        *_kv_load_bytes(kernel.asm["ptx"]), _kv_buffers(kernel.asm["ttgir"], config.block_n),
        max(waits, default=0),
        *kv_loop_of_sass(sass), args["WAVE"], *merge_loop_of_sass(sass), *page_id_timing(sass),
    )  # fmt: skip


def _valid(config, overrides: tuple[tuple[str, int], ...]) -> bool:
    """Whether a trial's overrides make a valid configuration of this entry (block_n=128 does not
    divide a 64-token tile, for example); entries they do not fit are left out of the trial."""
    try:
        dataclasses.replace(config, **dict(overrides))
    except ValueError:
        return False
    return True


def report_jobs(variants: bool = False, overrides: tuple[tuple[str, int], ...] = ()) -> list[tuple]:
    """(arch, head_dim, dtype, layout, group, leftpad, overrides, features) of every kernel to report.

    The report proper: each GPU tuning-table entry x layout, group 4, and each serving feature on
    the paged16 16-bit entries. ``variants`` adds what else a call can select: bf16, groups 1 and
    64 (every row block), a group of 24 where it splits into row chunks, left padding, both fp8
    formats on every 16-bit entry and layout, and padded head dims, so a CPU test proves they all
    compile.
    """
    from lean_tp.ops.decode_attention.tuning import TUNING_TABLE

    jobs = []
    for (arch, head_dim, size), config in TUNING_TABLE.items():
        # fp8 entries are compiled as the fp8 features of the 16-bit entry of their head dim.
        if arch == "interp" or size == 1 or not _valid(config, overrides):
            continue
        dtype = "fp16" if size == 2 else "fp32"
        jobs += [(arch, head_dim, dtype, layout, REPORT_GROUP, False, overrides, "") for layout in LAYOUTS]
        if size == 2:
            jobs += [(arch, head_dim, dtype, "paged16", REPORT_GROUP, False, overrides, f) for f in FEATURES if f]
        if variants:
            groups = (1, 64) + ((24,) if config.max_block_g < 24 else ())
            jobs += [(arch, head_dim, dtype, "paged16", g, False, overrides, "") for g in groups]
            jobs.append((arch, head_dim, dtype, "contiguous", REPORT_GROUP, True, overrides, ""))
            if size == 2:
                jobs.append((arch, head_dim, "bf16", "paged16", REPORT_GROUP, True, overrides, "all"))
                jobs += [(arch, head_dim, "bf16", layout, REPORT_GROUP, False, overrides, f)
                         for layout in LAYOUTS for f in ("fp8_e4m3", "fp8_e5m2") if layout != "paged16"]  # fmt: skip
    if variants:
        jobs += [(arch, d, "fp16", "paged16", REPORT_GROUP, True, overrides, "") for arch in ("sm80", "sm90")
                 for d in PADDED_HEAD_DIMS]  # fmt: skip
    return jobs


def sample_jobs(jobs: list[tuple]) -> list[tuple]:
    """What the CPU tests compile, a third of ``--variants``: the one-token decode rows of every
    16-bit entry and layout and of every fp32 entry on one layout; and each other kind of job (a
    feature or variant: the job without its arch and head dim) on one head dim, rotating over the
    head dims from kind to kind, for both archs where the arch changes the code it compiles (fp8:
    sm_80 converts e4m3 bytes by hand) and for one arch, alternating, where it does not."""
    fp32_seen, base, kinds = 0, [], {}
    for job in jobs:
        if job[4] == REPORT_GROUP and not job[5] and job[2] != "bf16" and not job[7]:
            if job[2] == "fp32":  # an entry's jobs come in LAYOUTS order: keep one, rotating by entry
                entry, layout = divmod(fp32_seen, len(LAYOUTS))
                fp32_seen += 1
                if layout != entry % len(LAYOUTS):
                    continue
            base.append(job)
        else:
            kinds.setdefault(job[2:], []).append(job)
    sample = []
    for i, (kind, same_kind) in enumerate(kinds.items()):
        by_arch = "fp8" in kind[-1] or kind[-1] == "all"
        for arch in ("sm80", "sm90") if by_arch else (("sm80", "sm90")[i % 2],):
            of_arch = [j for j in same_kind if j[0] == arch]
            if of_arch:
                sample.append(of_arch[i % len(of_arch)])
    return base + sample


def run_report(jobs: list[tuple], workers: int | None = None, progress: bool = True) -> list[KernelStats]:
    """Compile ``jobs`` in parallel processes (each compile is single-threaded), with a progress bar."""
    from lean_tp.ops.utils import map_in_processes

    env_interp = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # the workers must compile, not interpret
    try:
        return map_in_processes(compile_stats, jobs, "compiling kernels", "kernel", workers, progress)
    finally:
        if env_interp is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = env_interp


def to_markdown(rows: list[KernelStats]) -> str:
    """The base kernels (one-token decode, every entry and layout), then the serving-feature variants."""
    import triton

    gpu = {"sm80": "A100", "sm90": "H100"}
    lines = [
        f"Compiled as launched with triton {triton.__version__}, GQA group {REPORT_GROUP} "
        "(`python -m lean_tp.ops.kernel_report`).",
        "",
        "| arch | D | dtype | layout | regs | spill B | loop spills | smem KB | programs/SM | K / V load B | K/V buffers | wait_group "
        "| BLOCK_N | SASS/iter | issue share | K/V KB buffered / Little | page ids read in own iteration "
        "| merge: partials/iter | merge: SASS/contributor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if not r.features):
        lines.append(
            f"| {r.arch} | {r.head_dim} | {r.dtype} | {r.layout} | {r.regs} | {r.spill_bytes} | {r.loop_spills} "
            f"| {r.shared_bytes / 1024:.1f} "
            f"| {r.programs_per_sm} ({gpu[r.arch]}) | {r.k_load_bytes} / {r.v_load_bytes} | {r.kv_buffers} | {r.wait_group} "
            f"| {r.block_n} | {r.sass_per_iter} | {r.issue_share:.2f} "
            f"| {r.kv_bytes_buffered / 1024:.0f} / {r.littles_law_bytes / 1024:.0f} "
            f"| {f'{r.page_ids_read_same_iter} / {r.page_id_loads}' if r.page_id_loads else '-'} "
            f"| {r.merge_wave} | {r.merge_sass_per_wave / max(r.merge_wave, 1):.0f} |"
        )
    lines += [
        "",
        "Serving features, paged16 (`FEATURES` in `lean_tp/ops/kernel_report.py`; fp8 variants read an fp8 cache "
        "with an fp16 q):",
        "",
        "| arch | D | features | regs | spill B | loop spills | smem KB | programs/SM | K / V load B | BLOCK_N | SASS/iter "
        "| issue share | page ids read in own iteration |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r.features):
        lines.append(
            f"| {r.arch} | {r.head_dim} | {r.features} | {r.regs} | {r.spill_bytes} | {r.loop_spills} "
            f"| {r.shared_bytes / 1024:.1f} | {r.programs_per_sm} ({gpu[r.arch]}) | {r.k_load_bytes} / {r.v_load_bytes} "
            f"| {r.block_n} | {r.sass_per_iter} | {r.issue_share:.2f} | {r.page_ids_read_same_iter} / {r.page_id_loads} |"
        )
    return "\n".join(lines) + "\n"


def _parse_overrides(p: cli.ArgumentParser, items: list[str]) -> tuple[tuple[str, int], ...]:
    from lean_tp.ops.decode_attention.tuning import DecodeConfig

    fields = [f.name for f in dataclasses.fields(DecodeConfig) if f.type in (int, "int")]
    overrides = []
    for item in items:
        name, _, value = item.partition("=")
        if name not in fields or not value.isdigit():
            p.fail("--set", f"FIELD=INTEGER with FIELD one of {', '.join(fields)}", item)
        overrides.append((name, int(value)))
    return tuple(overrides)


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m lean_tp.ops.kernel_report", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object per kernel instead of markdown")
    p.add_argument("--variants", action="store_true", help="also compile bf16, other groups and left padding")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="trial: replace a tuning-table field (e.g. block_n=128) in every entry")
    p.add_argument("--sample", action="store_true",
                   help="each feature and variant on one head dim per arch, not on every entry (the CPU tests)")
    p.add_argument("--workers", type=cli.integer(1, 256), default=None, help="parallel compiles (default: one per core)")
    args = p.parse_args(argv)
    jobs = report_jobs(args.variants, _parse_overrides(p, args.set))
    rows = run_report(sample_jobs(jobs) if args.sample else jobs, args.workers)
    if args.json:
        print(json.dumps([r.as_json() for r in rows], indent=1))
    else:
        print(to_markdown([r for r in rows if r.group == REPORT_GROUP and not r.leftpad and r.dtype != "bf16"]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
