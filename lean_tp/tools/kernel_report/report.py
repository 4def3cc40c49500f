"""The kernel report's rows: one compiled kernel per job, its statistics, and the markdown table."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

import torch
import triton
from triton.backends.compiler import GPUTarget

from lean_tp.ops.decode_attention import Features, KernelVariant
from lean_tp.ops.decode_attention.archs import ARCHS, REPORT_PART
from lean_tp.ops.decode_attention.grid import SM_LIMITS, compile_variant, programs_per_sm
from lean_tp.ops.decode_attention.tuning import (
    FP_FUSION,
    TABLE_HEAD_DIMS,
    TUNING_TABLE,
    DecodeConfig,
    config_for,
    head_dim_pairs,
    paired_head_dim_v,
)
from lean_tp.tools.gpus import GPUS, GPUModel
from lean_tp.tools.kernel_report.sass import (
    dump,
    kv_buffers,
    kv_copy_bytes,
    kv_load_bytes,
    kv_loop_fp8_conversions,
    kv_loop_of_sass,
    kv_smem_read_bytes,
    merge_loop_of_sass,
    page_id_timing,
    resources,
)
from lean_tp.tools.processes import map_in_processes

LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# The architectures of the report's tables, with the simulator's GPUs (issue share, Little's law);
# the others are compiled against their limits (``arch_jobs``, ``arch_markdown``).
REPORT_ARCHS = ("sm80", "sm90")
OTHER_ARCHS = tuple(key for key in ARCHS if key not in REPORT_ARCHS)
REPORT_GROUP = 4  # Llama-3-8B and -70B's GQA group
MLA_GROUP = 16  # DeepSeek-V3's 128 query heads per latent head over TP 8
# MLA's ranks: DeepSeek-V3 at TP 8 (16 heads), Kimi-K2 under DP attention (64), DeepSeek-V3 (128).
MLA_GROUPS = (MLA_GROUP, 64, 128)
# The serving features compiled for MLA's entries (one latent head: fp8 and MTP drafts matter).
MLA_FEATURES = ("fp8_e4m3", "fp8_e5m2", "tq4", "invariant", "tq4_invariant", "all")
E4M3 = torch.float8_e4m3fn
# The serving-feature variants the report compiles, by name; "" is one-token decode.
FEATURES = {
    "": Features(),
    "fp8_e4m3": Features(fp8=E4M3),
    "fp8_e5m2": Features(fp8=torch.float8_e5m2),
    "tq4": Features(num_tokens=4),
    "tq16": Features(num_tokens=16),
    "softcap": Features(softcap=True),
    "window": Features(window=True),
    "sinks": Features(sinks=True),
    "tq4_window": Features(num_tokens=4, window=True),
    "all": Features(num_tokens=4, fp8=E4M3, softcap=True, window=True, sinks=True),
    "v_strides": Features(kv_strides_differ=True),  # V's strides not K's: addresses formed twice
    "invariant": Features(batch_invariant=True),
    # Speculative verification in the invariant mode: each query token decoded as a sequence of its own.
    "tq4_invariant": Features(num_tokens=4, batch_invariant=True),
    "tq16_invariant": Features(num_tokens=16, batch_invariant=True),
    "all_invariant": Features(num_tokens=4, fp8=E4M3, softcap=True, window=True, sinks=True, batch_invariant=True),
}
# Each batch-invariant variant's kernel in the default mode, which the tests hold it against.
INVARIANT_BASE = {"invariant": "", "tq4_invariant": "tq4", "tq16_invariant": "tq16", "all_invariant": "all"}
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
    merge_wave: int  # partials the merge loads per loop iteration (one wave; SLICE_WAVE's slices where set)
    merge_sass_per_wave: int  # SASS instructions of one merge iteration (one wave of partials)
    merge_loads_per_wave: int  # L2 loads (.cg, SASS instructions) in one merge-loop iteration
    page_id_loads: int = 0  # block-table loads per thread in one K/V-loop iteration (paged only)
    page_ids_read_same_iter: int = 0  # of them, read in the iteration that issues them
    kv_copy_bytes: int = 0  # K/V bytes one thread copies per K/V-loop iteration (``sass.kv_copy_bytes``)
    block_g: int = 0  # query rows of a row block (``BLOCK_G``)
    row_blocks: int = 0  # row blocks of a KV head (``NUM_GC``): reads of each key's row per query token
    smem_read_bytes: int = 0  # shared-memory bytes a K/V-loop iteration reads (``sass.kv_smem_read_bytes``)
    fp8_conversions: int = 0  # conversion-unit fp8 upcasts a thread an iteration (``sass.kv_loop_fp8_conversions``)

    @property
    def head_dim_v(self) -> int:
        return v_head_dim(self.head_dim)

    @property
    def bytes_per_key(self) -> float:
        """K/V bytes the compiled loop copies per key: 2 x D x elem for K and V apart, Dqk x elem
        when V is read from K's tile (MLA: 1152 at 16 bits)."""
        return self.kv_copy_bytes * self.num_warps * 32 / self.block_n

    @property
    def gpu(self) -> GPUModel | None:
        """The modelled GPU of this arch's report part (``tools.gpus.GPUS``), if it is modelled."""
        return GPUS.get(REPORT_PART[self.arch])

    @property
    def kv_tile_bytes(self) -> int:
        """K and V bytes one K/V-loop iteration reads (BLOCK_N keys of each)."""
        fp8 = FEATURES[self.features].fp8
        elem = fp8.itemsize if fp8 is not None else DTYPES[self.dtype].itemsize
        v_dims = 0 if self.head_dim_v < self.head_dim else self.head_dim  # MLA: V is in K's row
        return self.block_n * (self.head_dim + v_dims) * elem

    @property
    def issue_share(self) -> float:
        """Share of an SM's issue slots the K/V loop needs to keep up with the device's copy
        bandwidth: SASS per iteration x warps over 4 schedulers, against the cycles the iteration's
        bytes take at the SM's share of that bandwidth (constants: ``tools.gpus.GPUS``)."""
        gpu = self.gpu
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
        gpu = self.gpu
        return round(gpu.hbm_tbps * 1e12 / gpu.sms * gpu.hbm_latency_us * 1e-6)

    def as_json(self) -> dict:
        derived = ["kv_tile_bytes", "kv_bytes_buffered", "bytes_per_key"]
        if self.gpu is not None:
            derived += ["issue_share", "littles_law_bytes"]
        return dataclasses.asdict(self) | {name: getattr(self, name) for name in derived}


def compile_stats(
    arch: str,
    head_dim: int,
    dtype: str,
    layout: str,
    group: int = REPORT_GROUP,
    leftpad: bool = False,
    overrides: tuple[tuple[str, int], ...] = (),
    features: str = "",
) -> KernelStats:
    """Compile one kernel as launched for ``arch`` (a key of ``archs.ARCHS``) and read its statistics.

    ``overrides``: (field, value) pairs replacing tuning-table fields, for trials of other settings;
    ``features``: a key of ``FEATURES`` (``dtype`` stays q's dtype; fp8 variants change the cache's).
    """
    head_dim_v = paired_head_dim_v(head_dim)  # MLA's entries: V read from K's tile
    torch_dtype = DTYPES[dtype]
    wanted = dataclasses.replace(FEATURES[features], leftpad=leftpad, v_in_k=head_dim_v is not None)
    config = dataclasses.replace(_entry(arch, head_dim, dtype, features), **dict(overrides))
    variant = KernelVariant(arch, torch_dtype, head_dim, group, LAYOUTS[layout], wanted, config, head_dim_v)
    kernel = compile_variant(variant, GPUTarget("cuda", ARCHS[arch].target, 32))
    regs, stack, static_shared = resources(kernel.asm["cubin"])
    shared = kernel.metadata.shared + static_shared
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", kernel.asm["ptx"])]
    sass = dump(kernel.asm["cubin"], "-sass")
    return KernelStats(
        arch,
        head_dim,
        dtype,
        layout,
        group,
        leftpad,
        features,
        variant.constexprs["BLOCK_N"],
        variant.num_warps,
        regs,
        stack,
        shared,
        programs_per_sm(regs, shared, variant.num_warps, SM_LIMITS[arch]),
        *kv_load_bytes(kernel.asm["ptx"]),
        kv_buffers(kernel.asm["ttgir"], variant.constexprs["BLOCK_N"]),
        max(waits, default=0),
        *kv_loop_of_sass(sass),
        variant.constexprs["SLICE_WAVE"] or variant.constexprs["WAVE"],
        *merge_loop_of_sass(sass),
        *page_id_timing(sass),
        kv_copy_bytes(sass),
        variant.block_g,
        variant.row_blocks,
        kv_smem_read_bytes(sass, variant.num_warps),
        kv_loop_fp8_conversions(sass),
    )


def report_group(head_dim: int) -> int:
    """The GQA group the report compiles a head dim's entries for."""
    return MLA_GROUP if paired_head_dim_v(head_dim) else REPORT_GROUP


def _entry(arch: str, head_dim: int, dtype: str, features: str) -> DecodeConfig:
    """The tuning entry a job of ``arch`` compiles (its q dtype's, or its fp8 feature's cache's)."""
    return config_for(arch, head_dim, DTYPES[dtype], FEATURES[features].fp8, paired_head_dim_v(head_dim))


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
    jobs = []
    for (arch, head_dim, size), config in TUNING_TABLE.items():
        # fp8 entries are compiled as the fp8 features of the 16-bit entry of their head dim; the
        # other architectures' entries by ``arch_jobs``.
        if arch not in REPORT_ARCHS or size == 1 or not _valid(config, overrides):
            continue
        if config.head_dim_v is not None:  # MLA: its group, the features it serves, its other ranks' groups
            jobs += [(arch, head_dim, "fp16", layout, MLA_GROUP, False, overrides, "") for layout in LAYOUTS]
            jobs += [(arch, head_dim, "fp16", "paged16", MLA_GROUP, False, overrides, f) for f in MLA_FEATURES]
            jobs += [
                (arch, head_dim, "fp16", "paged16", g, False, overrides, f)
                for g in MLA_GROUPS[1:]
                for f in ("", "fp8_e4m3", "invariant")
            ]
            if variants:
                jobs.append((arch, head_dim, "bf16", "paged64", 128, False, overrides, ""))
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
                jobs += [
                    (arch, head_dim, "bf16", layout, REPORT_GROUP, False, overrides, f)
                    for layout in LAYOUTS
                    for f in ("fp8_e4m3", "fp8_e5m2")
                    if layout != "paged16"
                ]
    if variants:
        jobs += [
            (arch, d, "fp16", "paged16", REPORT_GROUP, True, overrides, "")
            for arch in REPORT_ARCHS
            for d in PADDED_HEAD_DIMS
        ]
    return jobs


# What ``arch_jobs`` compiles beside each entry's decode and e4m3 rows: the batch-invariant
# variant (its own register caps and stages) and every serving feature at once, paged16.
ARCH_FEATURES = ("invariant", "all")


# The head dim whose batch-invariant variant ``arch_jobs(sample=True)`` compiles for each
# architecture: its compile takes 15-48 s on 2 cores against a decode kernel's 2-5 s (D=64 the
# longest, its waves of 8 partials: 37 s at sm_80, 29 of them in Triton's coalescing pass over the
# folds' unrolled waves), so CI's check takes one a part, a different one on each, and sm_100's
# D=64, the entry that differs from the one it takes (tuning: its uncapped registers).
ARCH_SAMPLE_INVARIANT = {"sm86": 128, "sm89": 256, "sm100": 64, "sm120": 576}


def arch_jobs(
    archs: tuple[str, ...] = OTHER_ARCHS, sample: bool = False, overrides: tuple[tuple[str, int], ...] = ()
) -> list[tuple]:
    """Every architecture beyond the report's two, against its own limits: each head dim's entry
    (the architecture's own or the one it takes, ``Arch.tuning``) on the contiguous and paged16
    layouts, 16-bit and e4m3, fp32 on one layout, and ``ARCH_FEATURES`` on paged16. ``sample``
    (CI's check): paged16 alone, the layout that stages the most, beside fp32's one layout, and
    the batch-invariant variant on ``ARCH_SAMPLE_INVARIANT``'s head dim alone. ``overrides``: a
    trial's tuning-table fields (``report_jobs``), each job left out where they do not fit its entry."""
    jobs = []
    for arch in archs:
        for head_dim in (*TABLE_HEAD_DIMS, *(k for k, _ in head_dim_pairs())):
            group = report_group(head_dim)
            for layout in ("paged16",) if sample else ("contiguous", "paged16"):
                jobs += [(arch, head_dim, "fp16", layout, group, False, overrides, f) for f in ("", "fp8_e4m3")]
            if not paired_head_dim_v(head_dim):
                jobs.append((arch, head_dim, "fp32", "contiguous", group, False, overrides, ""))
            features = [
                f
                for f in ARCH_FEATURES
                if not sample or f != "invariant" or ARCH_SAMPLE_INVARIANT.get(arch) == head_dim
            ]
            jobs += [(arch, head_dim, "fp16", "paged16", group, False, overrides, f) for f in features]
    return [job for job in jobs if _valid(_entry(job[0], job[1], job[2], job[7]), overrides)]


# MLA's other ranks' rows the CPU tests compile: DP attention's 128 heads at 16 bits, and their
# batch-invariant variant (its wide blocks, one state in the K/V loop: ``chunks._attend_group_chunks``).
WIDE_SAMPLE = ((128, ""), (128, "invariant"))


def sample_jobs(jobs: list[tuple]) -> list[tuple]:
    """What the CPU tests compile, a third of ``--variants``: the one-token decode rows of every
    16-bit entry and layout (MLA's: two layouts, and e4m3) and of every fp32 entry on one layout;
    and each other kind of job (a feature or variant: the job without its arch and head dim) on one
    head dim, rotating over the head dims from kind to kind, for both archs where the arch changes
    the code it compiles (fp8: sm_80 converts e4m3 bytes by hand; MLA's 128 heads: 64- or 32-row
    blocks) and for one arch, alternating, where it does not; a batch-invariant variant beside its
    default-mode kernel, on D=256 (``_pick``)."""
    fp32_seen, base, kinds = 0, [], {}
    for job in jobs:
        # MLA's kernels take about 3x a D=128 kernel's compile: the sample keeps their 16-bit rows on
        # the contiguous and paged16 layouts and their e4m3 rows, the rest is the full report's.
        kept = job[7] in ("", "fp8_e4m3") or (job[4], job[7]) in WIDE_SAMPLE
        if paired_head_dim_v(job[1]) and (job[3] == "paged64" or not kept or job[2] == "bf16"):
            continue
        if paired_head_dim_v(job[1]) and job[4] != MLA_GROUP and (job[4], job[7]) not in WIDE_SAMPLE:
            continue  # of the other ranks' groups, 128 at 16 bits (sm_90: a 128-row block in column halves; sm_80: four of 32)
        if job[4] == report_group(job[1]) and not job[5] and job[2] != "bf16" and not job[7]:
            if job[2] == "fp32":  # an entry's jobs come in LAYOUTS order: keep one, rotating by entry
                entry, layout = divmod(fp32_seen, len(LAYOUTS))
                fp32_seen += 1
                if layout != entry % len(LAYOUTS):
                    continue
            base.append(job)
        else:
            kinds.setdefault(job[2:], []).append(job)
    sample, order = [], {kind: i for i, kind in enumerate(kinds)}
    for kind, same_kind in kinds.items():
        # A batch-invariant variant takes its default-mode kernel's pick, which the tests compare it with.
        i = order.get((*kind[:-1], INVARIANT_BASE.get(kind[-1])), order[kind])
        by_arch = "fp8" in kind[-1] or kind[-1] == "all" or kind[2] == 128  # 128: MLA's rows differ by arch
        for arch in REPORT_ARCHS if by_arch else (REPORT_ARCHS[i % 2],):
            of_arch = [j for j in same_kind if j[0] == arch]
            if of_arch:
                sample.append(_pick(kind[-1], of_arch, i))
    return base + sample


def _pick(features: str, of_arch: list[tuple], i: int) -> tuple:
    """``sample_jobs``' job of a kind on one arch: the i-th head dim, rotating; a batch-invariant
    variant and its default-mode kernel on the widest head dim below MLA's (256), where the
    variant compiles in 14-21 s on 2 cores against 27-60 s at 64 and 128 (Triton's coalescing pass
    over the folds' unrolled waves: ``ARCH_SAMPLE_INVARIANT``)."""
    if features in INVARIANT_BASE or features and features in INVARIANT_BASE.values():
        return max(of_arch, key=lambda j: (not paired_head_dim_v(j[1]), j[1]))
    return of_arch[i % len(of_arch)]


# A job is ``compile_stats``'s arguments in order; ``--only`` selects on these of them.
JOB_FIELDS = tuple(inspect.signature(compile_stats).parameters)
SELECTABLE = ("arch", "head_dim", "dtype", "layout", "group", "features")


def only_field(text: str) -> tuple[str, str]:
    """(field, value) of ``--only``'s ``FIELD=VALUE``, FIELD one of ``SELECTABLE``; ValueError
    giving what it expects."""
    field, eq, value = text.partition("=")
    if eq and field in SELECTABLE:
        return field, value
    raise ValueError(f"FIELD=VALUE with FIELD one of {', '.join(SELECTABLE)}")


def select_jobs(jobs: list[tuple], only: tuple[tuple[str, str], ...]) -> list[tuple]:
    """The jobs whose every field in ``only`` (``only_field``'s pairs) reads as its value: a few
    kernels compiled in seconds, to see whether a change to shared kernel code moves them before
    the whole report is regenerated."""
    return [job for job in jobs if all(str(job[JOB_FIELDS.index(f)]) == value for f, value in only)]


def run_report(jobs: list[tuple], workers: int | None = None, progress: bool = True) -> list[KernelStats]:
    """Compile ``jobs`` in parallel processes (each compile is single-threaded), with a progress bar."""
    env_interp = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # the workers must compile, not interpret
    try:
        return map_in_processes(compile_stats, jobs, "compiling kernels", "kernel", workers, progress)
    finally:
        if env_interp is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = env_interp


def arch_markdown(rows: list[KernelStats]) -> str:
    """The other architectures' rows: the report's columns, each row against its own per-block
    shared-memory limit."""
    header = _COLUMNS.replace("| smem KB |", "| smem KB | smem limit KB |").replace("| dtype |", "| dtype / feature |")
    lines = [header, "|---" * header.count(" | ") + "|---|"]
    for r in rows:
        lines.append(_row(r, _arch_label(r.dtype, r.features), limit=True))
    return "\n".join(lines) + "\n"


def _arch_label(dtype: str, features: str) -> str:
    """``arch_markdown``'s dtype / feature cell: the feature (fp8's without its prefix), else the dtype."""
    return features.removeprefix("fp8_") or dtype


def v_head_dim(head_dim: int) -> int:
    """V's head dim in a report row: the entry's (MLA: 512, read from K's tile), else K's."""
    return paired_head_dim_v(head_dim) or head_dim


def arch_row_start(job: tuple) -> str:
    """The first four cells (arch, D, dtype / feature, layout) of ``arch_markdown``'s row of an
    ``arch_jobs`` job, known without compiling it."""
    arch, head_dim, dtype, layout, *_, features = job
    dims = _dims(head_dim, v_head_dim(head_dim))
    return f"| {arch} | {dims} | {_arch_label(dtype, features)} | {layout} |"


_COLUMNS = (
    "| arch | D | dtype | layout | regs | spill B | loop spills | smem KB | programs/SM | K / V load B | K/V B per key "
    "| K/V buffers | wait_group | BLOCK_N | SASS/iter | issue share | K/V KB buffered / Little "
    "| page ids read in own iteration | merge: partials/iter | merge: SASS/contributor |"
)


def _row(r: KernelStats, dtype: str, limit: bool = False) -> str:
    """One kernel's cells in ``_COLUMNS`` (``limit``: with its architecture's per-block shared
    memory after its own); the issue share and Little's law need its part's time model
    (``tools.gpus.GPUS``), "-" without one."""
    budget = (
        "- | -"
        if r.gpu is None
        else f"{r.issue_share:.2f} | {r.kv_bytes_buffered / 1024:.0f} / {r.littles_law_bytes / 1024:.0f}"
    )
    smem = f"{r.shared_bytes / 1024:.1f}" + (f" | {ARCHS[r.arch].smem_per_block // 1024}" if limit else "")
    return (
        f"| {r.arch} | {_dims(r.head_dim, r.head_dim_v)} | {dtype} | {r.layout} | {r.regs} | {r.spill_bytes} | {r.loop_spills} | {smem} "
        f"| {r.programs_per_sm} ({REPORT_PART[r.arch]}) | {r.k_load_bytes} / {r.v_load_bytes} | {r.bytes_per_key:.0f} "
        f"| {r.kv_buffers} | {r.wait_group} | {r.block_n} | {r.sass_per_iter} | {budget} "
        f"| {f'{r.page_ids_read_same_iter} / {r.page_id_loads}' if r.page_id_loads else '-'} "
        f"| {r.merge_wave} | {r.merge_sass_per_wave / max(r.merge_wave, 1):.0f} |"
    )


def _dims(head_dim: int, head_dim_v: int) -> str:
    """A row's head dims: D, or Dqk/Dv (MLA)."""
    return f"{head_dim}/{head_dim_v}" if head_dim_v != head_dim else str(head_dim)


# The MLA table's rows by feature, and its cache column's label ({}: q's dtype).
MLA_ROW_FEATURES = {"": "{}", "fp8_e4m3": "e4m3", "invariant": "{}, invariant"}


def to_markdown(rows: list[KernelStats]) -> str:
    """The base kernels (one-token decode, every entry and layout), then the serving-feature variants."""
    gpu = REPORT_PART
    lines = [
        f"Compiled as launched with triton {triton.__version__}, FP fusion {'on' if FP_FUSION else 'off'} "
        f"(`tuning.FP_FUSION`), GQA group {REPORT_GROUP} ({MLA_GROUP} for MLA's "
        "576/512 rows, V read from K's tile) (`python -m lean_tp.tools.kernel_report`).",
        "",
        _COLUMNS,
        "|---" * _COLUMNS.count(" | ") + "|---|",
    ]
    for r in (r for r in rows if not r.features and r.group == report_group(r.head_dim)):
        lines.append(_row(r, r.dtype))
    lines += [
        "",
        "Serving features, paged16 (`FEATURES` in `lean_tp/tools/kernel_report/report.py`; fp8 variants read an fp8 cache "
        "with an fp16 q):",
        "",
        "| arch | D | features | regs | spill B | loop spills | smem KB | programs/SM | K / V load B | K/V B per key "
        "| BLOCK_N | SASS/iter | issue share | page ids read in own iteration |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r.features and r.group == report_group(r.head_dim)):
        lines.append(
            f"| {r.arch} | {_dims(r.head_dim, r.head_dim_v)} | {r.features} | {r.regs} | {r.spill_bytes} | {r.loop_spills} "
            f"| {r.shared_bytes / 1024:.1f} | {r.programs_per_sm} ({gpu[r.arch]}) | {r.k_load_bytes} / {r.v_load_bytes} "
            f"| {r.bytes_per_key:.0f} | {r.block_n} | {r.sass_per_iter} | {r.issue_share:.2f} | {r.page_ids_read_same_iter} / {r.page_id_loads} |"
        )
    mla = sorted(
        (r for r in rows if r.head_dim_v != r.head_dim and r.features in MLA_ROW_FEATURES and r.layout == "paged16"),
        key=lambda r: (r.arch, r.features, r.group),
    )
    lines += [
        "",
        "MLA's row blocks, paged16, one query token: a KV head's rows (its group) in row blocks, each reading "
        "every latent row (reads a latent row = row blocks); the batch-invariant variant's blocks too:",
        "",
        "| arch | group | cache | rows a block | reads a latent row | regs | spill B | loop spills | smem KB "
        "| K/V B per key | BLOCK_N | SASS/iter | SASS a key and head | issue share | smem B read a key |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in mla:
        lines.append(
            f"| {r.arch} | {r.group} | {MLA_ROW_FEATURES[r.features].format(r.dtype)} | {r.block_g} | {r.row_blocks} | {r.regs} "
            f"| {r.spill_bytes} | {r.loop_spills} | {r.shared_bytes / 1024:.1f} | {r.bytes_per_key:.0f} | {r.block_n} "
            f"| {r.sass_per_iter} | {r.sass_per_iter * r.row_blocks / (r.block_n * r.group):.2f} | {r.issue_share:.2f} "
            f"| {r.smem_read_bytes / r.block_n:.0f} |"
        )
    return "\n".join(lines) + "\n"
