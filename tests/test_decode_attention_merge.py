"""The merge tree of split outputs (interpreter on CPU): exact with many contributors, two levels,
every serving feature, and bitwise independent of the order in which programs arrive.

Small LeanTiles (16 keys) make a ~2k-token sequence span a whole grid of 64 programs, so the
interpreter runs the same trees a 128k context builds on a GPU. Outputs, lse and the workspace are
NaN-filled before each launch: a partial read before it was written, or an output never stored,
fails the comparison.
"""

import dataclasses
import importlib
import random

import pytest
import torch
import triton.runtime.interpreter as interpreter
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

from lean_tp.ops.decode_attention.cache import CacheLayout
from lean_tp.ops.decode_attention.folds import GROUP_CLAIMED, GROUP_MERGED, OUT_CLAIMED, SUPER_CLAIMED, SUPER_MERGED
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launch_args import counters_size, plan_workspace
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, lean_schedule, merge_plan, plan_decode
from lean_tp.ops.decode_attention.merge import _CLAIMED, _CLAIMED_OUT
from lean_tp.ops.decode_attention.naive import decode_attention_ref
from lean_tp.ops.decode_attention.tuning import MERGE_FANIN, DecodeConfig
from lean_tp.ops.utils import interpreted

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not interpreted(decode_attention_fwd_kernel),
    reason="interpreter tests; CUDA runs tests/gpu",
)

TILE = 16
# 4096-element merge waves: 4 partials per merge-loop iteration at D=64, so waves are full, partial (groups of 7)
# and single (the second level of 2 groups).
CONFIG = DecodeConfig(
    tile_n=TILE,
    block_n=16,
    max_block_g=64,
    num_warps=4,
    num_stages=1,
    max_programs_per_sm=1,
    merge_wave_elems=4096,
    reason="test: 16-key tiles split short sequences over many programs",
)
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}
WHOLE_GRID = 126 * TILE  # 126 tiles: the cost rule gives 2 tiles to each of 63 programs


def run(
    inputs: dict,
    num_programs: int,
    batch_invariant: bool = False,
    config: DecodeConfig = CONFIG,
    counters: torch.Tensor | None = None,
):
    """(out, lse, counters) of one launch with NaN-filled out, lse and workspace (and zeroed
    counters unless given)."""
    q = inputs["q"]
    scales = {
        k: torch.tensor([v]) if isinstance(v, float) else v
        for k in ("k_scale", "v_scale")
        if (v := inputs.get(k)) is not None
    }
    call = {**inputs, **scales, "softmax_scale": q.shape[-1] ** -0.5}
    plan = plan_decode(**call, num_programs=num_programs, config=config, batch_invariant=batch_invariant)
    workspace = tuple(t.fill_(float("nan")) for t in plan_workspace(plan, "cpu"))
    if counters is None:
        counters = torch.zeros(counters_size(num_programs), dtype=torch.int32)
    out, lse = decode_attention_fwd(
        **call,
        plan=plan,
        counters=counters,
        out=torch.full_like(q, float("nan")),
        lse=torch.full(q.shape[:-1], float("nan")),
        workspace=workspace,
    )
    return out, lse, counters


def plan_of(inputs: dict, num_programs: int, config: DecodeConfig = CONFIG) -> dict:
    """The merge plan the schedule code writes for this call (window: its tiled span)."""
    q = inputs["q"]
    hkv = CacheLayout.of(inputs["k_cache"], inputs["v_cache"], inputs["block_table"]).num_kv_heads
    tq = q.shape[1] if q.dim() == 4 else 1
    span = {"max_span": inputs["window"] + tq - 1} if inputs.get("window") else {}
    lens = inputs["cache_seqlens"] - (inputs["cache_leftpad"] if inputs.get("cache_leftpad") is not None else 0)
    return merge_plan(
        lean_schedule(lens.to(torch.int32), hkv, TILE, num_programs, max_contributors=config.max_contributors, **span)
    )


@pytest.mark.parametrize("tq,group", [(1, 1), (4, 2)])
def test_one_output_split_over_the_whole_grid(tq, group):
    """B=1 with one KV head, the tensor-parallel shape: 63 programs of a 64-program grid share the
    output, merged by 8 groups and a second level (a chain of 8 + 8 partials). Every group up to 16
    rows fills the same 16-row block (masked rows differ); ragged and feature cases follow below."""
    inputs = make_feature_inputs([WHOLE_GRID], group, 1, 64, torch.float32, "paged16", tq=tq, seed=10 * tq + group)
    out, lse, counters = run(inputs, 64)
    assert_matches_feature_ref(out, lse, inputs, ATOL[torch.float32])
    assert (counters == 0).all(), "the merge must leave its counters at zero"
    (groups,) = plan_of(inputs, 64).values()
    assert [len(g) for g in groups] == [MERGE_FANIN] * 7 + [7]


def test_more_contributors_than_the_cap():
    """The tree is exact for any contributor count; the cap (``DecodeConfig.max_contributors``,
    sm_100's 96) only bounds its chain. 72 contributors: 9 groups, so the second level takes
    three waves of 4 loads."""
    config = dataclasses.replace(CONFIG, max_contributors=96)
    inputs = make_feature_inputs([72 * TILE - 3], 8, 1, 64, torch.float32, "contiguous", seed=3)
    out, lse, counters = run(inputs, 72, config=config)
    assert_matches_feature_ref(out, lse, inputs, ATOL[torch.float32])
    assert (counters == 0).all()
    (groups,) = plan_of(inputs, 72, config).values()
    assert len(groups) == 9 and sum(map(len, groups)) == 72


RAGGED = [WHOLE_GRID // 2, 0, 1, TILE - 1, TILE, TILE + 1, 300]  # split and whole outputs, an empty one


@pytest.mark.parametrize(
    "features",
    [
        {"window": 40, "tq": 4, "leftpad": [3, 0, 1, 0, 2, 0, 5]},
        {"cache_dtype": torch.float8_e4m3fn, "per_head_scale": True, "sinks": True},
        {"cache_dtype": torch.float8_e5m2, "softcap": 5.0, "tq": 4},
    ],
    ids=["window_tq4_leftpad", "fp8_e4m3_sinks", "fp8_e5m2_softcap_tq4"],
)
def test_ragged_batch_with_features(features):
    dtype = torch.float16 if "cache_dtype" in features else torch.float32
    inputs = make_feature_inputs(RAGGED, 8, 2, 64, dtype, "paged16", seed=len(features), **features)
    out, lse, counters = run(inputs, 32)
    assert_matches_feature_ref(out, lse, inputs, ATOL[dtype])
    assert (counters == 0).all()
    plan = plan_of(inputs, 32)
    assert any(len(groups) > 1 for groups in plan.values()) or "window" in features
    assert len(plan) < len(RAGGED) * 2  # some outputs are whole, not merged


@pytest.fixture
def arrival_order(monkeypatch):
    """Run the interpreter's programs in a chosen order: the interpreter runs each program to its
    end before the next, so this order is the order in which programs arrive at every merge."""
    order: list[int] = []
    set_grid_idx = interpreter.interpreter_builder.set_grid_idx
    monkeypatch.setattr(
        interpreter.interpreter_builder, "set_grid_idx", lambda x, y, z: set_grid_idx(order[x] if order else x, y, z)
    )
    return order


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
def test_result_does_not_depend_on_arrival_order(arrival_order, batch_invariant):
    """The same launch with programs arriving in grid order, reversed, and shuffled: every
    merge (every fold, in the batch-invariant mode) is done by a different program each time,
    and out and lse are bitwise equal."""
    # Two query tokens in the default mode (the merge of multi-token rows); the invariant mode folds
    # each token's output alone, so one token shows its folds, and in 1024-element waves its
    # outputs' supergroups are folded in 4 column slices (``output_fold.finish_output``).
    tq = 1 if batch_invariant else 2
    config = dataclasses.replace(CONFIG, merge_wave_elems=1024) if batch_invariant else CONFIG
    inputs = make_feature_inputs(
        [WHOLE_GRID // 2 - 5, 40, 0, 300], 8, 2, 64, torch.float32, "contiguous", tq=tq, seed=5
    )
    num_programs = 32
    results = []
    for perm in (
        list(range(num_programs)),
        list(range(num_programs))[::-1],
        random.Random(0).sample(range(num_programs), num_programs),
    ):
        arrival_order[:] = perm
        out, lse, counters = run(inputs, num_programs, batch_invariant, config)
        assert (counters == 0).all()
        results.append((out, lse))
    assert_matches_feature_ref(*results[0], inputs, ATOL[torch.float32])
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_merge_in_column_slices(arrival_order, monkeypatch):
    """Partials wider than the merge wave are merged in column slices (``plan.merge_cols``; MLA's
    16 x 512 partials): here 4 slices of 16 columns, over the two-level tree of a whole grid, with
    sinks (each slice normalized alike, the lse stored once) and two query tokens, exact and bitwise
    the same whatever order the programs arrive in. Idle contributors read their merge's counter 4
    times before they leave it (a GPU's wait, cut short: in the interpreter no read can succeed)."""
    monkeypatch.setattr(importlib.import_module("lean_tp.ops.decode_attention.plan"), "INTERPRETER_MERGE_POLLS", 4)
    config = dataclasses.replace(CONFIG, merge_wave_elems=512)
    inputs = make_feature_inputs([WHOLE_GRID - 9, 33], 8, 1, 64, torch.float32, "paged16", tq=2, sinks=True, seed=8)
    plan = plan_decode(**inputs, softmax_scale=0.125, num_programs=64, config=config)
    assert plan.kernel.constexprs["MERGE_COLS"] == 16 and plan.kernel.constexprs["BLOCK_D"] == 64
    assert plan.kernel.constexprs["MERGE_POLLS"] == 4
    out, lse, counters = run(inputs, 64, config=config)
    assert_matches_feature_ref(out, lse, inputs, ATOL[torch.float32])
    assert (counters == 0).all()
    assert max(len(groups) for groups in plan_of(inputs, 64, config).values()) > 1  # two levels
    arrival_order[:] = list(range(64))[::-1]
    again, again_lse, _ = run(inputs, 64, config=config)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.parametrize(
    "num_programs,region,first,claimed,unwritten",
    [(8, _CLAIMED, 0, 2, 32), (64, _CLAIMED_OUT, 0, 1, 16), (64, _CLAIMED, 24, 1, 64)],
    ids=["one-group", "second-level", "group-unfinished"],
)
def test_slices_claimed_elsewhere_are_left_to_their_claimer(num_programs, region, first, claimed, unwritten):
    """A merge's column slices are claimed at a counter, so that on a GPU a contributor with no
    tiles left takes slices beside the last arriver. Claims made before the launch stand for such
    a contributor: the last arriver merges every other slice and leaves the claimed ones (NaN), a
    second level waits for every slice of every group (a group short of one slice: nothing is
    stored), and the counters end at zero. The claims go in the kernel's own counter regions
    (``merge.py``): a group's or the second level's, at the slot of the group's first member
    (``first``, slot 0)."""
    config = dataclasses.replace(CONFIG, merge_wave_elems=512)
    lens = [WHOLE_GRID if num_programs == 64 else 16 * TILE - 3]
    inputs = make_feature_inputs(lens, 8, 1, 64, torch.float32, "paged16", seed=12)
    plan = plan_decode(**inputs, softmax_scale=0.125, num_programs=num_programs, config=config)
    assert plan.kernel.constexprs["MERGE_COLS"] == 16  # 4 slices
    (groups,) = plan_of(inputs, num_programs, config).values()
    assert len(groups) == (1 if num_programs == 8 else 8) and len(groups[0]) > 1
    counters = torch.zeros(counters_size(num_programs), dtype=torch.int32)
    counters[region.value * 2 * num_programs + 2 * first] = claimed
    out, lse, counters = run(inputs, num_programs, config=config, counters=counters)
    assert (counters == 0).all()
    # Slice 0, which stores the lse, is among the claimed ones.
    assert out[..., :unwritten].isnan().all() and lse.isnan().all()
    ref_out, _ = decode_attention_ref(**inputs)
    assert not out[..., unwritten:].isnan().any()
    torch.testing.assert_close(
        out[..., unwritten:].double(), ref_out[..., unwritten:], atol=ATOL[torch.float32], rtol=0
    )


@pytest.mark.parametrize("level", ["group", "super", "output"])
def test_group_and_output_fold_slices_claimed_elsewhere_are_left_to_their_claimer(level):
    """The batch-invariant mode folds a split group's chunks, a split supergroup's groups and an
    output of several supergroups in column slices (``folds.finish_group``,
    ``output_fold.finish_super``, ``output_fold.finish_output``; 1024-element waves: 4 slices of 16
    columns), which on a GPU the holders with no tiles left claim beside the program that made the
    last member known. A claim made before the launch stands for such a holder:
    - at the output, slice 0 (which stores the lse) claimed at its first holder (program 0): the
      owner folds every other slice and leaves slice 0's columns and the lse unwritten;
    - at every split group or supergroup (counters at each holder but the last), slice 0 claimed
      and counted as folded: every other slice and the value's m and l are stored, the value is
      known, and the claimed columns, never written in the NaN-filled workspace, reach the output
      as NaN while the lse is exact.
    The rest match the reference, and every counter ends at zero. Unclaimed, those folds are the
    batch-invariant tests' (bitwise, every arrival order: above)."""
    config = dataclasses.replace(CONFIG, merge_wave_elems=1024)
    # 68 chunks of 16 keys over 24 programs: each group's 8 chunks are held by 3 or 4 programs and
    # each whole supergroup's 32 by 11 or 12 (``tuning.INVARIANT_SLICE_HOLDERS``).
    P = 24
    inputs = make_feature_inputs([1084], 4, 1, 64, torch.float32, "paged16", seed=31)  # 3 supergroups of 512 keys
    plan = plan_decode(**inputs, softmax_scale=0.125, num_programs=P, config=config, batch_invariant=True)
    assert plan.kernel.constexprs["MERGE_COLS"] == 16 and plan.kernel.constexprs["SLICE_WAVE"] > 0
    counters = torch.zeros(counters_size(P), dtype=torch.int32)
    # A split group's or supergroup's counters are at its first holder: at every holder but the last.
    last = sum(bool(segments) for segments in lean_schedule(inputs["cache_seqlens"], 1, TILE, P)) - 1
    if level == "output":
        counters[OUT_CLAIMED.value * P] = 1
    else:
        for region in (GROUP_CLAIMED, GROUP_MERGED) if level == "group" else (SUPER_CLAIMED, SUPER_MERGED):
            counters[region.value * P : region.value * P + last] = 1
    out, lse, counters = run(inputs, P, True, config, counters)
    assert (counters == 0).all(), "a fold left a counter set"
    assert out[..., :16].isnan().all()
    ref_out, ref_lse = decode_attention_ref(**inputs)
    torch.testing.assert_close(out[..., 16:].double(), ref_out[..., 16:], atol=ATOL[torch.float32], rtol=0)
    if level == "output":
        assert lse.isnan().all()
    else:
        torch.testing.assert_close(lse.double(), ref_lse, atol=ATOL[torch.float32], rtol=0)
