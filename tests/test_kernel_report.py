"""What the decode kernel compiles to for sm_80 and sm_90, and within its limits for every other
architecture of ``archs.ARCHS``, read on CPU (``lean_tp.tools.kernel_report``).

The interpreter accepts code the GPU compiler rejects (dot dims < 16, non-constexpr globals,
``break``), and it says nothing about registers or loads. These tests compile every kernel the
tuning table can select, as a launch specializes it, and hold the compiled code to what makes the
kernel fast. This process interprets kernels (TRITON_INTERPRET=1 is set at collection), so the
compiles run in subprocesses with the interpreter off. One xdist worker runs the module, so the
compiles happen once.

The tests that read compiled kernels (``COMPILES``: about 15 minutes of CPU, 8 on 2 idle cores)
are CI's step of their own, ``pytest -m kernel_report``; the README's test command runs the rest.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from lean_tp.ops.decode_attention.archs import ARCHS
from lean_tp.ops.decode_attention.tuning import TUNING_TABLE
from lean_tp.tools.kernel_report import (
    FEATURES,
    INVARIANT_BASE,
    LAYOUTS,
    REPORT_ARCHS,
    KernelStats,
    report_group,
    to_markdown,
)

pytestmark = pytest.mark.xdist_group("kernel_report")
COMPILES = pytest.mark.kernel_report

ROOT = os.path.join(os.path.dirname(__file__), "..")
SMEM_LIMIT = {key: arch.smem_per_block for key, arch in ARCHS.items()}  # opt-in shared memory per block


def _run(args: list[str]) -> str:
    """``python ARGS`` at a lower CPU priority: its compiles yield the cores to the other xdist
    workers' tests, whose multi-rank jobs wait on each other (DeepSpeed's CPU all-reduce spins)
    and stretch when a rank is descheduled; on idle cores the compiles run as fast."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = ["nice", "-n", "10", sys.executable, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def stats() -> list[KernelStats]:
    """``kernel_report.sample_jobs``: every entry, and every feature and variant, in a third of the
    compiles of ``--variants``."""
    rows = json.loads(_run(["-m", "lean_tp.tools.kernel_report", "--json", "--variants", "--sample"]))
    fields = {f.name for f in dataclasses.fields(KernelStats)}
    return [KernelStats(**{k: v for k, v in row.items() if k in fields}) for row in rows]


def _report_rows(stats):
    """The rows docs/kernel_report.md shows: each entry's report group, and MLA's other ranks' groups."""
    shown = lambda s: s.group == report_group(s.head_dim) or s.head_dim_v != s.head_dim  # noqa: E731
    return [s for s in stats if shown(s) and not s.leftpad and s.dtype != "bf16"]


@COMPILES
def test_every_table_entry_compiles_for_every_layout(stats):
    """Every 16-bit entry on every layout; every fp32 entry on one, and every layout for fp32;
    every fp8 entry, as the fp8 features of its head dim."""
    built = {(s.arch, s.head_dim, s.dtype, s.layout) for s in _report_rows(stats)}
    fp8 = {(s.arch, s.head_dim) for s in stats if s.features.startswith("fp8")}
    for arch, head_dim, size in TUNING_TABLE:
        if arch not in REPORT_ARCHS:  # the other architectures: test_every_architecture_compiles_within_its_limits
            continue
        if size == 2:
            layouts = ("contiguous", "paged16") if head_dim == 576 else LAYOUTS  # MLA: sample_jobs
            assert {(arch, head_dim, "fp16", layout) for layout in layouts} <= built
        elif size == 1:
            assert (arch, head_dim) in fp8
        else:
            assert any((arch, head_dim, "fp32", layout) in built for layout in LAYOUTS)
    for arch in REPORT_ARCHS:
        assert {layout for a, _, dtype, layout in built if a == arch and dtype == "fp32"} == set(LAYOUTS)
    assert any(s.dtype == "bf16" for s in stats) and any(s.leftpad for s in stats)
    assert {s.group for s in stats} >= {1, 24, 64}
    for s in stats:
        assert s.shared_bytes <= SMEM_LIMIT[s.arch], s
        assert s.programs_per_sm >= 1, s


@COMPILES
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", REPORT_ARCHS)
def test_16bit_kernels_are_fast_by_construction(stats, arch, layout):
    """No spills in the K/V loop, 16-byte K/V loads, K/V multi-buffered (paged too), and 2+ programs
    per SM for D <= 128. ptxas may spill a few cold values (once per segment or per program) to reach
    the next occupancy step (sm_80 D=128 paged: 12 words, to stay at 168 registers); more than a few
    words would mean the loop's live state does not fit. MLA's 64-row blocks, and 128-row blocks in
    column halves, hold 128 accumulator registers a thread of their 255, and spill up to 64 cold
    words outside the loop (the merge's counters and slice bookkeeping among them). sm_90's
    128-row MLA blocks in column halves copy each K/V block one iteration ahead (wait_group 0:
    q's 144 KB leave room for 2 buffers only so; H200-measured faster than 64-row blocks)."""
    rows = [
        s for s in _report_rows(stats) if s.arch == arch and s.dtype == "fp16" and s.layout == layout and not s.features
    ]
    assert rows
    for s in rows:
        assert s.loop_spills == 0 and s.spill_bytes <= (256 if s.block_g >= 64 else 64), s
        assert s.sass_per_iter > 0, s
        assert s.k_load_bytes == 16 and s.v_load_bytes == 16, s
        assert s.kv_buffers >= 2 and s.wait_group >= (0 if s.block_g == 128 else 1), s
        if s.head_dim <= 128:
            assert s.programs_per_sm >= 2, s


@COMPILES
def test_page_ids_are_read_ahead(stats):
    """Every paged 16-bit and fp8 kernel (both archs, every head dim and feature) reads none of its
    block-table loads in the iteration that issues them: the pipeliner copies the page ids a stage
    ahead (``paged_stages``), and keeps 2 K/V buffers. fp32 entries (2 stages, one buffer; not a
    serving dtype) are not held to it. Contiguous kernels load no page ids."""
    ahead = 0
    for s in stats:
        if s.layout == "contiguous":
            assert s.page_id_loads == 0, s
        elif s.dtype != "fp32":
            assert s.page_id_loads >= 1 and s.page_ids_read_same_iter == 0 and s.kv_buffers >= 2, s
            ahead += 1
    assert ahead >= 30, ahead


def test_register_caps_apply_on_the_triton_they_were_read_on(monkeypatch):
    """``maxnreg`` for blocks of up to 16 query rows, from triton 3.7 on: triton 3.6 spills in the
    K/V loop under the caps (tuning.REGISTER_CAPS_SINCE), so there ptxas chooses."""
    from lean_tp.ops.decode_attention import tuning

    config = TUNING_TABLE[("sm90", 128, 2)]
    monkeypatch.setattr(tuning.triton, "__version__", "3.7.1")
    assert config.compile_options(True, 16) == {
        "num_warps": 4,
        "num_stages": 5,
        "enable_fp_fusion": True,
        "maxnreg": 168,
    }
    assert config.compile_options(False, 32) == {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": True}
    monkeypatch.setattr(tuning.triton, "__version__", "3.6.0")
    assert config.compile_options(True, 16) == {"num_warps": 4, "num_stages": 5, "enable_fp_fusion": True}


def test_page_id_timing_reads_registers_through_the_loop():
    """A load read before the loop's end counts as read in its iteration; one only overwritten, or
    read after the back-edge (the next pass), does not; a 64-bit pair covers both registers."""
    from lean_tp.tools.kernel_report import page_id_timing

    def sass(*body):
        lines = [f"        /*{0x100 + 16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(body)]
        lines.append(f"        /*{0x100 + 16 * len(body):04x}*/                   HMMA.16816.F32 R0, R4, R8, R0 ;")
        lines.append(f"        /*{0x100 + 16 * (len(body) + 1):04x}*/                   @P0 BRA 0x100 ;")
        return "\n".join(lines)

    assert page_id_timing(sass("LDG.E R10, desc[UR4][R2.64]", "IMAD.WIDE R20, R10, UR6, R22")) == (1, 1)
    assert page_id_timing(sass("LDG.E R10, desc[UR4][R2.64]", "MOV R10, R11", "IADD3 R12, R10, R1, RZ")) == (1, 0)
    assert page_id_timing(sass("LDG.E R11, desc[UR4][R2.64]", "LDGSTS.E.BYPASS.128 [R5], desc[UR4][R10.64]")) == (1, 1)
    assert page_id_timing(sass("IADD3 R12, R10, R1, RZ", "@P1 LDG.E R10, desc[UR4][R2.64]")) == (1, 0)
    assert page_id_timing(sass("LDG.E.128 R8, desc[UR4][R2.64]", "FADD R1, R8, R9")) == (0, 0)
    assert page_id_timing(sass("@!P6 LDGSTS.E [R7+0x1180], desc[UR4][R2.64], P4", "LDS R8, [R7+0x1180]")) == (1, 0)


@COMPILES
def test_paged_kernels_cost_little_more_than_contiguous(stats):
    """paged16 SASS per K/V iteration within 1.15x the contiguous kernel's, for every 16-bit entry
    (triton 3.7.1: 0.96-1.04x): the page lookup (a shift and a mask per key, page ids a stage
    ahead) and the key addresses, formed once for K and V (``DecodeConfig.share_kv_addresses``),
    stay a small part of the loop. Signed // and % for page and slot took sm_90 D=128 to 1.16x."""
    rows = {
        (s.arch, s.head_dim, s.layout): s
        for s in _report_rows(stats)
        if s.dtype == "fp16" and not s.features and s.group == report_group(s.head_dim)
    }
    pairs = [
        (rows[(a, d, "paged16")].sass_per_iter, s.sass_per_iter)
        for (a, d, layout), s in rows.items()
        if layout == "contiguous"
    ]
    assert len(pairs) == 8 and all(paged <= 1.15 * contiguous for paged, contiguous in pairs), pairs
    # Where a 64-key page holds whole blocks (block_n <= 64: D=128, D=256), one page id per block
    # (BLOCK_IN_PAGE) leaves no per-key lookup: 0.87-1.01x contiguous; looked up per key, 1.01-1.10x.
    # MLA's 576/512 (1.05-1.06x) forms the rope columns' addresses apart from the latent ones'.
    whole = [
        (rows[(a, d, "paged64")].sass_per_iter, s.sass_per_iter)
        for (a, d, layout), s in rows.items()
        if layout == "contiguous" and s.block_n <= 64 and d <= 256
    ]
    assert len(whole) == 4 and all(paged <= 1.02 * contiguous for paged, contiguous in whole), whole


@COMPILES
@pytest.mark.parametrize("arch", REPORT_ARCHS)
def test_fp8_kernels_keep_the_16bit_pipeline(stats, arch):
    """Every fp8 entry (both formats, every head dim): no spills in the K/V loop, 16-byte K and V
    loads, K/V double-buffered, 2+ programs per SM for D <= 128. V's 16-byte copies are the sign
    that the tile is converted after a row-wise read from shared memory (``attend._opaque``):
    converted inside the dot operand's load, V is copied 8 bytes at a time and read byte by byte,
    and the issue share of the fp16-q rows rose to 0.58-0.78 (docs/kernel_report.md). sm_80 e4m3
    is read as words (0.37-0.42; read as bytes, 0.47-0.49). On sm_90 a bf16 q's fp8 tile is
    upcast without the conversion unit (e4m3 by ``attend.e4m3_to_bf16``, e5m2 by Triton's own bit
    moves): no ``F2F`` or fp8 ``F2FP`` in the loop, where Triton's e4m3 route through fp16 takes
    1.5 a value."""
    rows = [s for s in stats if s.arch == arch and s.features in ("fp8_e4m3", "fp8_e5m2") and s.head_dim <= 256]
    assert {s.head_dim for s in rows} >= {64, 128, 256} and len({s.features for s in rows}) == 2, rows
    assert {s.features for s in rows if s.dtype == "bf16"} == {"fp8_e4m3", "fp8_e5m2"}, rows
    for s in rows:
        # Cold spills (the stack frame, touched outside the K/V loop): sm_90 D=64 with a bf16 q,
        # paged64, keeps 96 bytes at 255 registers.
        assert s.loop_spills == 0 and s.spill_bytes <= 128, s
        assert s.k_load_bytes == 16 and s.v_load_bytes == 16, s
        assert s.kv_buffers >= 2 and s.wait_group >= (0 if s.block_g == 128 else 1), s
        if s.head_dim <= 128:
            assert s.programs_per_sm >= 2, s
        if s.head_dim <= 128 and s.dtype == "fp16":
            assert s.issue_share <= 0.45, s
        if arch == "sm90" and s.dtype == "bf16":
            assert s.fp8_conversions == 0, s


@COMPILES
def test_invariant_kernels_keep_their_default_kernels_occupancy(stats):
    """The batch-invariant variants (one K/V loop per segment, whose chunk ends fold or store
    states; a verification's tokens each a sequence of its own) have no K/V-loop spill, at least
    the programs per SM of the same kernel in the default mode, its load widths, at least 2 K/V
    buffers and no more shared memory (no chunk is stored through shared memory)."""
    key = lambda s: (s.arch, s.head_dim, s.dtype, s.layout, s.group, s.leftpad)  # noqa: E731
    default = {(key(s), s.features): s for s in stats}
    pairs = [
        (s, default[key(s), INVARIANT_BASE[s.features]])
        for s in stats
        if s.features in INVARIANT_BASE and (key(s), INVARIANT_BASE[s.features]) in default
    ]
    assert {s.features for s, _ in pairs} == set(INVARIANT_BASE), "the sample lacks an invariant kernel's pair"
    for s, d in pairs:
        assert s.loop_spills == 0 and s.programs_per_sm >= d.programs_per_sm, (s, d)
        assert s.kv_buffers >= 2, (s, d)
        assert (s.k_load_bytes, s.v_load_bytes) == (d.k_load_bytes, d.v_load_bytes), (s, d)
        assert s.shared_bytes <= d.shared_bytes, (s, d)


@COMPILES
@pytest.mark.parametrize("arch", REPORT_ARCHS)
def test_mla_kernels_read_each_latent_row_once(stats, arch):
    """MLA's 576/512 entries, V read from K's tile (``V_IN_K``): the K/V loop copies 576 x elem
    bytes per key (1152 at 16 bits, 576 fp8), not (576 + 512) x elem; every layout and feature
    (fp8, Tq 4, the invariant mode, all of them) keeps its K/V loop free of spills, copies the
    latent columns 16 bytes at a time and holds 2 K/V buffers, at least twice what Little's law asks
    of an SM (32-key fp8 blocks: 2.3x). sm_90's 16-row blocks take 64 keys (``narrow_block_n``),
    reading under 6000 bytes of shared memory a key (32-key blocks: 8512, paged64). The second
    load width is the rope columns': 64 x elem bytes a key over the 256 threads, at most 16 (fp8,
    32 keys: 8). The tests compile the contiguous and paged16 rows and e4m3's (``sample_jobs``),
    and DP attention's 128 heads at 16 bits: one 128-row block in two column halves on sm_90 (two
    reads of each latent row), four of 32 rows on sm_80, and their batch-invariant variant (two
    whole 64-row blocks on sm_90, four of 32 on sm_80); docs/kernel_report.md has every layout and
    feature, and groups 64 and 128 on both archs (sm_90's 128-head e4m3 row reloads a few
    loop-invariant words an iteration there)."""
    rows = [s for s in stats if s.arch == arch and s.head_dim == 576]
    assert {s.layout for s in rows if not s.features} == {"contiguous", "paged16"}, rows
    assert "fp8_e4m3" in {s.features for s in rows}, rows
    wide = {(s.features, s.block_g, s.row_blocks) for s in rows if s.group == 128}
    invariant = ("invariant", 64, 2) if arch == "sm90" else ("invariant", 32, 4)
    assert wide == ({("", 128, 2), invariant} if arch == "sm90" else {("", 32, 4), invariant}), wide
    for s in rows:
        fp8 = FEATURES[s.features].fp8 is not None
        assert s.head_dim_v == 512 and s.bytes_per_key == 576 * (1 if fp8 else 2), s
        assert s.loop_spills == 0 and s.k_load_bytes == 16 and s.kv_buffers >= 2, s
        assert s.wait_group >= (0 if s.block_g == 128 else 1), s  # column halves: a block ahead
        assert s.v_load_bytes == min(16, s.block_n * 64 * (1 if fp8 else 2) // (s.num_warps * 32)), s
        assert s.programs_per_sm >= 1 and s.kv_bytes_buffered >= 2 * s.littles_law_bytes, s
        if arch == "sm90" and s.block_g == 16:  # 64-key blocks: q's reads from shared memory, a key
            assert s.block_n == 64 and 0 < s.smem_read_bytes / s.block_n < 6000, s


@COMPILES
def test_every_architecture_compiles_within_its_limits():
    """Every entry of sm_86, sm_89, sm_100 and sm_120 (``OTHER_ARCHS``), on paged16 (the layout
    that stages the most; ``--archs --sample``): 16-bit, e4m3, fp32 (contiguous), the
    all-features variant, and the batch-invariant variant on one head dim a part
    (``ARCH_SAMPLE_INVARIANT``), each against its own limits (99 KB a block on sm_86/89/120): it
    fits a block, keeps the K/V loop free of spills, copies K 16 bytes at a time and holds 2 K/V
    buffers (fp32: at least 1, as on sm_80/90); docs/kernel_report.md has every row as compiled,
    and exactly the paged16 and fp32 rows the full ``--archs`` compiles."""
    from lean_tp.ops.decode_attention.archs import ARCHS
    from lean_tp.tools.kernel_report import OTHER_ARCHS, arch_jobs, arch_markdown, arch_row_start

    rows = json.loads(_run(["-m", "lean_tp.tools.kernel_report", "--archs", "--sample", "--json"]))
    fields = {f.name for f in dataclasses.fields(KernelStats)}
    stats = [KernelStats(**{k: v for k, v in row.items() if k in fields}) for row in rows]
    assert {s.arch for s in stats} == set(OTHER_ARCHS) == {"sm86", "sm89", "sm100", "sm120"}
    for s in stats:
        assert s.shared_bytes <= ARCHS[s.arch].smem_per_block and s.programs_per_sm >= 1, s
        assert s.loop_spills == 0 and s.k_load_bytes == 16, s
        assert s.kv_buffers >= (1 if s.dtype == "fp32" else 2), s
    with open(os.path.join(ROOT, "docs", "kernel_report.md")) as f:
        doc = f.read()
    table = arch_markdown(stats).splitlines()
    missing = [line for line in table if line not in doc]
    assert not missing, f"regenerate: python -m lean_tp.tools.kernel_report --archs; stale: {missing[:3]}"
    documented = [
        "|".join(line.split("|")[:5]) + "|"
        for line in doc.splitlines()
        if line.startswith(tuple(f"| {a} |" for a in OTHER_ARCHS)) and ("| paged16 |" in line or "| fp32 |" in line)
    ]
    full = [arch_row_start(job) for job in arch_jobs() if job[3] == "paged16" or job[2] == "fp32"]
    assert sorted(documented) == sorted(full), "docs/kernel_report.md's rows are not those --archs compiles"


@COMPILES
def test_docs_kernel_report_is_current(stats):
    import triton

    with open(os.path.join(ROOT, "docs", "kernel_report.md")) as f:
        doc = f.read()
    recorded = re.search(r"triton (\S+),", doc).group(1)
    if recorded != triton.__version__:
        pytest.skip(f"docs/kernel_report.md was generated with triton {recorded}, this is {triton.__version__}")
    rows = [line for line in to_markdown(_report_rows(stats)).splitlines() if line.startswith("|")]
    missing = [line for line in rows if line not in doc]
    assert len(rows) >= 30 and not missing, f"regenerate: python -m lean_tp.tools.kernel_report; stale: {missing[:3]}"


SPECIALIZATION = """
import json, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel as fn
from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.launch_args import launch_args, plan_workspace
from lean_tp.ops.decode_attention.plan import DecodePlan, Features, KernelVariant

binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
keys = []
for batch, hkv, programs, capacity, pages in [(1, 1, 1, 48, 3), (16, 8, 132, 64, 4), (17, 2, 264, 72, 9)]:
    e = lambda *shape, dtype=torch.float16: torch.empty(*shape, dtype=dtype, device="meta")
    q = e(batch, 1, 4 * hkv, 128)
    lens = e(batch, dtype=torch.int32)
    for paged, window in [(False, None), (True, None), (True, 8 + batch)]:
        cache = e(batch * pages, 16, hkv, 128) if paged else e(batch, capacity, hkv, 128).transpose(1, 2)
        table = e(batch, pages, dtype=torch.int32) if paged else None
        features = Features(window=window is not None)
        variant = KernelVariant("sm90", torch.float16, 128, 4, 16 if paged else None, features)
        plan = DecodePlan(batch, 4 * hkv, 128, torch.float16, torch.device("meta"), CacheLayout.of(cache, cache, table),
                          features, window, variant, programs, programs)
        args = launch_args(plan, q, cache, cache, lens, None, table, torch.empty_like(q),
                           e(batch, 1, 4 * hkv, dtype=torch.float32), plan_workspace(plan, "meta"), lens, 0.1)
        keys.append([f"{paged}-{window is not None}", str(binder(**args)[1])])
print(json.dumps(keys))
"""


def test_no_recompilation_for_batch_heads_grid_strides_or_window():
    """The JIT's specialization (its cache key) is the same for any batch, KV heads, grid, cache
    strides and window size."""
    keys = json.loads(_run(["-c", SPECIALIZATION]))
    for family in ("False-False", "True-False", "True-True"):
        assert len({key for p, key in keys if p == family}) == 1, keys


TRACED_COMPILE = """
import json, torch, warnings
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from lean_tp.ops.decode_attention import Features, KernelVariant
from lean_tp.ops.decode_attention.grid import compile_variant, example_args
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel as fn
from lean_tp.ops.decode_attention.launch_args import check_launch_args
from triton.runtime.jit import create_function_from_signature

variant, target = KernelVariant("sm90", torch.float16, 64, 4, None, Features()), GPUTarget("cuda", 90, 32)
# As when torch.compile traces the op before the grid size is cached; reading a fake tensor's data
# pointer is an error on some torch versions, a warning on others.
with FakeTensorMode(), warnings.catch_warnings():
    warnings.simplefilter("error")
    compile_variant(variant, target)
backend = make_backend(target)
options = {**variant.compile_options(), "debug": False}
bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(
    **check_launch_args(fn, example_args(variant)), **options
)
opts, signature, constexprs, attrs = fn._pack_args(backend, options, bound, spec, opts)
signature |= {"qk_scale": "fp64", "cap_log2": "fp64"}  # how Inductor types a user kernel's floats
kernel = __import__("triton").compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)
print(json.dumps(kernel.metadata.shared > 0))
"""


def test_kernel_compiles_as_torch_compile_launches_it():
    """What only a GPU run under torch.compile reaches: the grid's compile of the call's variant
    while fake tensors are in force, and a kernel whose float arguments Inductor types fp64."""
    assert json.loads(_run(["-c", TRACED_COMPILE])) is True


def test_launch_args_must_name_every_kernel_parameter():
    from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
    from lean_tp.ops.decode_attention.launch_args import check_launch_args

    args = {name: 0 for name in decode_attention_fwd_kernel.arg_names}
    assert check_launch_args(decode_attention_fwd_kernel, dict(args)) == args
    with pytest.raises(TypeError, match=r"missing \['stride_bt'\], unknown \['stride_table'\]"):
        check_launch_args(
            decode_attention_fwd_kernel, {**{k: v for k, v in args.items() if k != "stride_bt"}, "stride_table": 0}
        )


def test_programs_per_sm_follows_the_occupancy_rules():
    from lean_tp.ops.decode_attention.grid import SM_LIMITS, programs_per_sm

    h100 = SM_LIMITS["sm90"]
    # 156 registers round to 160 per thread: 3 warps per sub-partition, 12 per SM, three 4-warp programs.
    assert programs_per_sm(156, 71680, 4, h100) == 3
    # 208 registers: 2 warps per sub-partition; shared memory would allow 3.
    assert programs_per_sm(206, 71680, 4, h100) == 2
    # Shared memory bound, with the driver's 1 KB per block: two blocks of 113 KB + 1 KB fit in
    # 228 KB, two of 114 KB + 1 KB do not.
    assert programs_per_sm(64, 113 * 1024, 4, h100) == 2
    assert programs_per_sm(64, 114 * 1024, 4, h100) == 1
    assert programs_per_sm(32, 0, 4, h100) == 16  # threads: 2048 / 128


def test_kv_loop_is_the_innermost_loop_with_the_most_multiply_accumulates():
    from lean_tp.tools.kernel_report import kv_loop_of_sass

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R2, R3, R4, RZ ;
        /*0020*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64] ;
        /*0030*/                   HMMA.16816.F32 R8, R12, R14, R8 ;
        /*0040*/                   LDL R51, [R1] ;
        /*0050*/              @!P1 BRA 0x20 ;
        /*0060*/                   FFMA R7, R7, R8, R9 ;
        /*0070*/               @P2 BRA 0x60 ;
        /*0080*/              @!P3 BRA 0x10 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0xa0;
    """
    # Loops: 0x20-0x50 (HMMA), 0x60-0x70 (one FFMA), 0x10-0x80 (outer, holds both), 0xa0 (the trap).
    assert kv_loop_of_sass(sass) == (4, 1)


def test_kv_loop_shared_memory_reads_count_every_warp_and_warp_group():
    """``kv_smem_read_bytes``: an LDSM of four 8 x 8 16-bit matrices reads 512 bytes a warp, an
    LDS.64 256, a wgmma its B operand (N x K) from a descriptor, and A (64 x K) too when A is a
    descriptor, 16-bit with or without a type suffix (fp16's wgmma has none); every warp's LDS,
    every warp group's wgmma. Outside the K/V loop nothing counts."""
    from lean_tp.tools.kernel_report.sass import kv_smem_read_bytes

    sass = """
        /*0000*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0010*/                   LDSM.16.MT88.2 R8, [R2+0x100] ;
        /*0020*/                   LDS.64 R10, [R3] ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
        /*0040*/                   HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR20].tnspB, R24 ;
        /*0050*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0058*/                   HGMMA.64x32x16.F32 R24, gdesc[UR4], R24 ;
        /*0060*/              @!P1 BRA 0x0 ;
        /*0070*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0080*/                   EXIT ;
    """
    warp = 512 + 256 + 256
    group = 256 * 16 * 2 + 2 * (64 * 16 + 32 * 16) * 2
    assert kv_smem_read_bytes(sass, 8) == 8 * warp + 2 * group


def test_merge_loop_is_the_innermost_loop_with_l2_coherent_loads():
    from lean_tp.tools.kernel_report import merge_loop_of_sass

    sass = """
        /*0000*/                   HMMA.16816.F32 R8, R12, R14, R8 ;
        /*0010*/              @!P1 BRA 0x0 ;
        /*0020*/                   LDG.E.128.STRONG.GPU R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E.STRONG.GPU R5, desc[UR4][R6.64] ;
        /*0040*/                   FFMA R7, R7, R8, R9 ;
        /*0050*/               @P2 BRA 0x20 ;
        /*0060*/                   EXIT ;
    """
    assert merge_loop_of_sass(sass) == (4, 2)
    assert merge_loop_of_sass(sass.replace("STRONG.GPU", "CONSTANT")) == (0, 0)


@COMPILES
def test_every_kernel_merges_in_waves_of_l2_loads(stats):
    """The merge loop exists in every compiled kernel, loads its partials through L2 (``.cg``), a
    wave of ``merge_wave`` partials per iteration."""
    for s in stats:
        assert s.merge_wave >= 1 and s.merge_loads_per_wave >= 1 and s.merge_sass_per_wave > 0, s


def _constexprs(args: dict) -> dict:
    """The constexpr arguments of a launch: what selects the compiled variant."""
    import inspect

    from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel

    fn = getattr(decode_attention_fwd_kernel, "fn", decode_attention_fwd_kernel)
    names = [n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)]
    return {n: args[n] for n in names}


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
@pytest.mark.parametrize("feature", list(FEATURES), ids=[f or "decode" for f in FEATURES])
def test_a_calls_plan_has_the_variant_the_report_compiles(page_size, leftpad, feature):
    """``plan_decode`` of a call using a feature gives the ``Features`` the report compiles under
    that name, and its launch arguments are the constexprs of ``example_args`` of its variant: the
    kernel the grid is sized from (its registers, shared memory) is the one the call launches."""
    from lean_tp.ops.decode_attention.grid import example_args
    from lean_tp.ops.decode_attention.launch_args import launch_args, plan_workspace
    from lean_tp.ops.decode_attention.launcher import plan_decode

    want = dataclasses.replace(FEATURES[feature], leftpad=leftpad)
    batch, hkv, group = 3, 2, 4
    q = torch.randn(batch, want.num_tokens, group * hkv, 128).half()
    cache_dtype = want.fp8 or torch.float16
    shape = (batch, hkv, 96, 128) if page_size is None else (40, page_size, hkv, 128)
    cache = torch.randn(shape).to(cache_dtype)
    v_cache = torch.randn(*shape[:-1], 256).to(cache_dtype)[..., 128:] if want.kv_strides_differ else cache
    lens = torch.full((batch,), 5, dtype=torch.int32)
    table = torch.zeros(batch, 8, dtype=torch.int32) if page_size else None
    scale = torch.ones(hkv) if want.fp8 else None
    call = dict(
        cache_leftpad=lens if leftpad else None,
        k_scale=scale,
        v_scale=scale,
        softcap=50.0 if want.softcap else None,
        window=77 if want.window else None,
        sinks=torch.zeros(group * hkv) if want.sinks else None,
    )
    plan = plan_decode(q, cache, v_cache, lens, table, batch_invariant=want.batch_invariant, **call)
    assert plan.features == want and plan.kernel.features == want
    launched = launch_args(
        plan,
        q,
        cache,
        v_cache,
        lens,
        call["cache_leftpad"],
        table,
        torch.empty_like(q),
        torch.empty(q.shape[:-1]),
        plan_workspace(plan, "cpu"),
        lens,
        0.1,
        scale,
        scale,
        call["softcap"],
        call["sinks"],
    )
    assert _constexprs(example_args(plan.kernel)) == _constexprs(launched)


def test_an_mla_calls_plan_has_the_variant_the_report_compiles():
    """A latent cache passed as ``kv, kv[..., :512]`` plans the V-in-K variant the report compiles
    for the 576/512 entries, with the same constexprs; V a tensor of its own plans V loaded apart."""
    from lean_tp.ops.decode_attention.grid import example_args
    from lean_tp.ops.decode_attention.launch_args import launch_args, plan_workspace
    from lean_tp.ops.decode_attention.launcher import plan_decode
    from lean_tp.ops.decode_attention.plan import Features

    q = torch.randn(2, 16, 576).half()
    kv = torch.randn(8, 16, 1, 576).half()
    lens = torch.tensor([5, 40], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    plan = plan_decode(q, kv, kv[..., :512], lens, table)
    assert plan.kernel.features == Features(v_in_k=True) and plan.kernel.head_dim_v == 512
    out = torch.empty(2, 1, 16, 512).half()
    launched = launch_args(
        plan, q[:, None], kv, kv[..., :512], lens, None, table, out, torch.empty(2, 1, 16), plan_workspace(plan, "cpu"),
        lens, 0.1,
    )  # fmt: skip
    assert _constexprs(example_args(plan.kernel)) == _constexprs(launched)
    assert not plan_decode(q, kv, kv[..., :512].clone(), lens, table).kernel.features.v_in_k


def test_plan_sizes_the_grid_for_the_calls_variant(monkeypatch):
    """The grid is asked for the call's variant (left padding and features included, which can
    cost registers), once per call."""
    from lean_tp.ops.decode_attention import launcher

    asked = []
    monkeypatch.setattr(launcher, "grid_size", lambda device, variant: asked.append(variant) or 264)
    q = torch.randn(2, 4, 8, 128).half()
    cache = torch.randn(2, 2, 64, 128).half()
    lens = torch.tensor([40, 64], dtype=torch.int32)
    plan = launcher.plan_decode(q, cache, cache, lens, cache_leftpad=lens - 30, window=20)
    assert asked == [plan.kernel] and plan.num_programs == 264
    assert plan.kernel.features == launcher.Features(num_tokens=4, window=True, leftpad=True)


def test_only_selects_the_kernels_whose_fields_read_as_given():
    """``--only``: the jobs of every field given, by its value as printed; a field it does not
    select on, or an item without a value, is refused."""
    from lean_tp.tools.kernel_report import only_field, report_jobs, select_jobs

    jobs = report_jobs()
    only = lambda *items: tuple(map(only_field, items))  # noqa: E731
    picked = select_jobs(jobs, only("arch=sm90", "head_dim=576", "features=tq4"))
    assert picked == [("sm90", 576, "fp16", "paged16", 16, False, (), "tq4")]
    mla_sm80 = select_jobs(jobs, only("arch=sm80", "head_dim=576"))
    assert mla_sm80 and {(j[0], j[1]) for j in mla_sm80} == {("sm80", 576)}
    assert len(mla_sm80) == sum(1 for j in jobs if j[:2] == ("sm80", 576))
    assert select_jobs(jobs, ()) == jobs and select_jobs(jobs, only("arch=sm70")) == []
    for bad in ("leftpad=True", "arch", "=sm90"):
        with pytest.raises(ValueError, match=r"FIELD=VALUE with FIELD one of arch, head_dim, "):
            only_field(bad)


def test_a_trial_setting_reaches_the_other_architectures_jobs():
    """``--set`` with ``--archs``: every job of the other architectures carries the trial's
    fields, and the jobs whose entry they do not fit are left out, as ``report_jobs`` does."""
    from lean_tp.tools.kernel_report import arch_jobs

    plain = arch_jobs(("sm86",))
    trial = arch_jobs(("sm86",), overrides=(("num_stages", 3),))
    assert trial and {job[6] for job in trial} == {(("num_stages", 3),)}
    assert [job[:6] + job[7:] for job in trial] == [job[:6] + job[7:] for job in plain]
    # block_n 128 divides no 64-key tile: those entries drop out, the others stay.
    wide = arch_jobs(("sm86",), overrides=(("block_n", 128),))
    assert len(wide) < len(plain) and all(job[6] == (("block_n", 128),) for job in wide)


def test_issue_share_and_bytes_in_flight_follow_their_definitions():
    """sm_90 D=128 fp16, 64 keys per iteration: 32 KB of K and V take 32768 / (3.0 TB/s / 132 SMs)
    = 1.44 us = 2530 cycles at 1.755 GHz; 632 SASS x 4 warps / 4 schedulers = 632 issue cycles."""
    row = KernelStats(
        "sm90", 128, "fp16", "paged16", 4, False, "", 64, 4, 168, 0, 71680, 3, 16, 16, 3, 1, 632, 0, 4, 222, 10
    )
    assert row.kv_tile_bytes == 32768
    assert row.issue_share == pytest.approx(632 / (32768 / (3.0e12 / 132) * 1.755e9))
    assert 0.24 < row.issue_share < 0.26
    assert row.kv_bytes_buffered == 3 * 3 * 32768 and row.littles_law_bytes == round(3.0e12 / 132 * 0.7e-6)
    fp8 = dataclasses.replace(row, features="fp8_e4m3")
    assert fp8.kv_tile_bytes == 16384 and fp8.issue_share == pytest.approx(2 * row.issue_share)
    assert set(row.as_json()) >= {"issue_share", "kv_bytes_buffered", "littles_law_bytes"}
