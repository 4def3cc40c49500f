"""The architecture table (``lean_tp/ops/decode_attention/archs.py``): every compute capability
maps to an entry or is refused by name, the limits are the CUDA programming guide's, and every
architecture has a tuning entry for every head dim and dtype the kernel takes. What each entry
compiles to on each architecture is in tests/test_kernel_report.py."""

import dataclasses
import functools

import pytest
import torch

from lean_tp.ops.decode_attention import tuning
from lean_tp.ops.decode_attention.archs import ARCHS, KB, PARTS, REPORT_PART, arch_for_capability
from lean_tp.ops.decode_attention.grid import SM_LIMITS
from lean_tp.ops.decode_attention.plan import e4m3_as_bits
from lean_tp.ops.decode_attention.tuning import (
    B200_CONTRIBUTORS,
    TABLE_HEAD_DIMS,
    TUNING_TABLE,
    config_for,
    head_dim_pairs,
)

CAPABILITIES = {
    (8, 0): "sm80",  # A100
    (8, 6): "sm86",  # A10, RTX 3090
    (8, 7): "sm86",  # Jetson Orin: Ampere's closest entry
    (8, 9): "sm89",  # L4, L40S, RTX 4090
    (9, 0): "sm90",  # H100, H200
    (10, 0): "sm100",  # B200
    (10, 3): "sm100",  # B300
    (11, 0): "sm100",  # Jetson Thor
    (12, 0): "sm120",  # RTX 5090
    (12, 1): "sm120",  # GB10
    (13, 0): "sm120",  # a later part: the closest earlier entry
}


@pytest.mark.parametrize("capability,key", list(CAPABILITIES.items()), ids=[f"{a}.{b}" for a, b in CAPABILITIES])
def test_every_capability_maps_to_an_entry(capability, key):
    assert arch_for_capability(*capability).key == key


@pytest.mark.parametrize("capability,name", [((7, 5), "Tesla T4"), ((7, 0), "Tesla V100")])
def test_devices_before_ampere_are_refused_by_name(capability, name, monkeypatch):
    """At the first call (``arch_of`` plans every Triton launch): one line naming the device."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with pytest.raises(
        ValueError, match=rf"device: expected .* 8\.0 or later .* got {name} of {capability[0]}\.{capability[1]}"
    ):
        tuning.arch_of(torch.device("cuda", 0))


def test_a_compiled_caller_reads_the_architecture_as_a_constant(monkeypatch):
    """transformers' attention asks whether the kernel takes a call (``kernel_support``) inside the
    model torch.compile traces, and the device queries behind ``arch_of`` return a str, which
    Dynamo cannot put in a graph; a torch function returning a str stands in for the device name."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: torch.backends.cpu.get_cpu_capability())
    monkeypatch.setattr(tuning, "_arch_of_index", functools.cache(tuning._arch_of_index.__wrapped__))
    step = torch.compile(lambda x: x * len(tuning.arch_of(torch.device("cuda", 0))), fullgraph=True, backend="eager")
    assert step(torch.ones(1)).item() == len("sm90")


def test_limits_are_the_programming_guides():
    """Shared memory a block may opt into is the multiprocessor's less the driver's 1 KB; 99 KB on
    sm_86, sm_89 and sm_120, where threads are 1536 an SM. The report's limits take each
    architecture's with its named part's SM count."""
    for arch in ARCHS.values():
        assert arch.smem_per_block == arch.smem_per_sm - arch.smem_reserved_per_block == arch.smem_per_sm - KB
        assert arch.regs_per_sm == 65536 and arch.target == int(arch.key[2:])
    assert {a.key for a in ARCHS.values() if a.smem_per_block == 99 * KB} == {"sm86", "sm89", "sm120"}
    assert {a.key for a in ARCHS.values() if a.max_threads_per_sm == 1536} == {"sm86", "sm89", "sm120"}
    assert (ARCHS["sm80"].smem_per_block, ARCHS["sm90"].smem_per_block) == (163 * KB, 227 * KB)
    for key, part in REPORT_PART.items():
        limits = SM_LIMITS[key]
        assert PARTS[part].arch == key and limits.sm_count == PARTS[part].sms
        assert (limits.smem_per_sm, limits.max_threads_per_sm) == (
            ARCHS[key].smem_per_sm,
            ARCHS[key].max_threads_per_sm,
        )


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_has_an_entry_for_what_the_kernel_takes(arch):
    """Head dims 8 to 256 and MLA's pair, 16-bit and fp32 caches, and fp8 caches with a 16-bit q."""
    for head_dim in (8, 40, *TABLE_HEAD_DIMS, 192):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert config_for(arch, head_dim, dtype).reason
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert config_for(arch, head_dim, torch.bfloat16, fp8).reason
    for k, v in head_dim_pairs():
        for cache in (None, torch.float8_e4m3fn):
            assert config_for(arch, k, torch.bfloat16, cache, v).head_dim_v == v


def test_e4m3_is_converted_by_hand_before_sm89():
    """sm_80 and sm_86 have no e4m3 conversion instruction; sm_89 and later (and the interpreter) do."""
    by_hand = {key for key in ARCHS if e4m3_as_bits(torch.float8_e4m3fn, key)}
    assert by_hand == {"sm80", "sm86"} and not e4m3_as_bits(torch.float8_e4m3fn, "interp")
    assert not any(e4m3_as_bits(torch.float8_e5m2, key) for key in ARCHS)


def test_the_grid_reads_a_devices_limits_and_its_architectures(monkeypatch):
    """On a GPU the grid takes the device's SM count, registers, threads and shared memory, and its
    architecture entry's block limit (which torch does not report): an L40S's 1536 threads and 24
    blocks an SM, not an A100's 2048 and 32, so a 4-warp kernel of 100 registers and 30 KB fits 3."""
    from types import SimpleNamespace

    from lean_tp.ops.decode_attention.grid import SMLimits, programs_per_sm

    l40s = SimpleNamespace(
        major=8, minor=9, name="NVIDIA L40S", multi_processor_count=142, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=1536, shared_memory_per_multiprocessor=102400,
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: l40s)
    limits = SMLimits.of_device(0)
    assert (limits.sm_count, limits.max_threads_per_sm, limits.max_blocks_per_sm) == (142, 1536, 24)
    assert limits.smem_per_sm == 100 * KB and limits == SM_LIMITS["sm89"]
    assert programs_per_sm(100, 30 * KB, 4, limits) == 3  # shared memory: 3 x 31 KB of 100 KB
    assert programs_per_sm(32, 0, 4, limits) == 12  # threads: 1536 / 128


def test_a_contributor_cap_below_two_is_refused():
    """The schedule's cost rule gives each program cdiv(T - 1, max_contributors - 1) tiles: a cap of
    1 (or less) is refused when the entry is made, naming the field."""
    entry = TUNING_TABLE[("sm100", 128, 2)]
    assert entry.max_contributors == B200_CONTRIBUTORS
    with pytest.raises(ValueError, match=r"DecodeConfig.max_contributors: expected an int >= 2, got 1"):
        dataclasses.replace(entry, max_contributors=1)
    with pytest.raises(ValueError, match=r"DecodeConfig.one_sequence_max_contributors: expected an int >= 2, got 1"):
        dataclasses.replace(entry, one_sequence_max_contributors=1)


@pytest.mark.parametrize("polls", [-1, 2.0, True])
def test_merge_polls_other_than_a_count_is_refused(polls):
    """merge_polls is a kernel constexpr (reads of a merge's counter): a negative count, a float or
    a bool is refused when the entry is made, naming the field; 0 and up are taken."""
    entry = TUNING_TABLE[("sm90", 576, 2)]
    assert dataclasses.replace(entry, merge_polls=0).merge_polls == 0
    with pytest.raises(ValueError, match=rf"DecodeConfig.merge_polls: expected an int >= 0, got {polls!r}"):
        dataclasses.replace(entry, merge_polls=polls)


@pytest.mark.parametrize("arch,elem,one", [("sm90", 2, 128), ("sm90", 1, 128), ("sm100", 2, 64), ("sm100", 1, 64)])
def test_one_mla_sequence_of_one_token_is_split_over_its_entrys_cap(arch, elem, one):
    """The kernel's cap (``MAX_CONTRIB``) is the entry's one-sequence cap for one sequence of one
    token (sm_90's MLA entries: 128, measured there), and max_contributors otherwise: a second
    sequence, a draft token or the batch-invariant mode (sm_100: 64 for both, unmeasured)."""
    from lean_tp.ops.decode_attention.plan import Features, KernelVariant

    dtype, fp8 = (torch.bfloat16, None) if elem == 2 else (torch.bfloat16, torch.float8_e4m3fn)

    def cap(**features) -> int:
        f = Features(v_in_k=True, fp8=fp8, **features)
        return KernelVariant(arch, dtype, 576, 16, 64, f, head_dim_v=512).constexprs["MAX_CONTRIB"]

    assert cap(one_sequence=True) == one
    assert cap() == cap(num_tokens=2) == cap(batch_invariant=True) == tuning.MAX_CONTRIBUTORS


@pytest.mark.parametrize("field", ["scores_t_rows", "invariant_max_block_g", "narrow_block_n", "gluon_rows"])
def test_row_block_fields_are_refused_unless_powers_of_two(field):
    """The 64-row MLA fields (a row count, a row cap, the Gluon route's rows) are powers of two of
    at least 16, or None; anything else is refused when the entry is made, naming the field."""
    entry = TUNING_TABLE[("sm90", 576, 2)]
    assert getattr(entry, field) is not None
    with pytest.raises(ValueError, match=rf"DecodeConfig.{field}: expected a power of two >= 16, got 48"):
        dataclasses.replace(entry, **{field: 48})


def test_column_blocks_are_refused_where_v_cannot_be_halved():
    """``split_v_rows`` (sm_90's MLA column halves) is a power of two of at least 16 rows, on an entry
    whose V head dim is a power of two (its halves are whole blocks); else refused, naming the field."""
    with pytest.raises(ValueError, match=r"DecodeConfig.split_v_rows: expected a power of two >= 16, got 96"):
        dataclasses.replace(TUNING_TABLE[("sm90", 576, 2)], split_v_rows=96)
    with pytest.raises(
        ValueError, match=r"DecodeConfig.head_dim_v: expected a power of two with split_v_rows, got None"
    ):
        dataclasses.replace(TUNING_TABLE[("sm90", 128, 2)], split_v_rows=128)
    entry = TUNING_TABLE[("sm90", 576, 2)]
    assert [entry.v_col_blocks(rows) for rows in (16, 64, 128)] == [1, 1, 2] and entry.v_col_blocks(128, True) == 1
    assert entry.scores_t(64) and not entry.scores_t(128)  # split blocks compute q K^T


def test_narrow_blocks_take_their_own_keys_an_iteration():
    """``narrow_block_n`` sets BLOCK_N for blocks of at most 16 query rows (sm_90's MLA entries:
    64 keys at TP 8's 16 heads, 32 at DP attention's 128-row blocks); it must divide tile_n."""
    from lean_tp.ops.decode_attention import Features, KernelVariant

    entry = TUNING_TABLE[("sm90", 576, 2)]
    assert (entry.block_n_for(8), entry.block_n_for(16), entry.block_n_for(32), entry.block_n_for(64)) == (
        64,
        64,
        32,
        32,
    )
    assert dataclasses.replace(entry, narrow_block_n=None).block_n_for(16) == 32
    mla = Features(v_in_k=True)
    blocks = {
        group: KernelVariant("sm90", torch.bfloat16, 576, group, 64, mla, head_dim_v=512).constexprs
        for group in (16, 128)
    }
    assert [(cx["BLOCK_G"], cx["BLOCK_N"]) for cx in blocks.values()] == [(16, 64), (128, 32)]
    with pytest.raises(ValueError, match=r"DecodeConfig.tile_n: expected a multiple of narrow_block_n=128, got 64"):
        dataclasses.replace(entry, narrow_block_n=128)
