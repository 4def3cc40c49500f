"""The decode simulator: split rules, conservation of work, merges counted for every method, the
tensor-parallel presets, and the command line. Each (problem, GPU) is simulated once per session
(the schedule code runs in the interpreter on CPU: seconds per call)."""

import dataclasses
import functools
import json
import math

import pytest

from lean_tp.ops.decode_attention.tuning import (
    B200_CONTRIBUTORS,
    INVARIANT_SLICE_HOLDERS,
    INVARIANT_SUPER_SLICE_HOLDERS,
    INVARIANT_WIDE_TILE_N,
    MAX_CONTRIBUTORS,
    MERGE_FANIN,
    TUNING_TABLE,
)
from lean_tp.tools.gpus import LOOP_US
from lean_tp.tools.simulate import (
    GPUS,
    LINKS,
    MLA_PEER_CONSTANTS,
    MLA_PEERS,
    MODEL_PRESETS,
    Problem,
    cp_layouts,
    cp_merge_us,
    cp_row,
    cp_sweep_cases,
    deterministic_sweep_cases,
    deterministic_table_rows,
    fa2_num_splits,
    fa2_splits,
    flashinfer_mla_schedule,
    flashmla_schedule,
    flex_splits,
    link_of,
    main,
    mla_peer_takes,
    mla_sweep_problems,
    rank_heads,
    sglang_flashinfer_schedule,
    sglang_mla_splits,
    sglang_triton_schedule,
    sglang_triton_splits,
    table_rows,
    table_rows_parallel,
    triton_mla_schedule,
    triton_mla_splits,
    verification_sweep_cases,
    verification_table_rows,
    vllm_invariant_schedule,
)
from lean_tp.tools.simulate import simulate as _simulate
from lean_tp.tools.simulate.gluon import GLUON_LOOP_US
from lean_tp.tools.simulate.l2 import Read, chunk_reads, hbm_share, residency_us
from lean_tp.tools.simulate.schedules import compute_roof, lean_sim_schedule, lean_variant, schedule_lens

H100 = GPUS["H100"]


@functools.lru_cache(maxsize=None)
def simulate(problem: Problem, gpu_name: str = "H100"):
    """With one program per SM: a third of the interpreter's work, and nothing tested here depends
    on programs per SM (the sweeps in docs/ use the tuning table's full grid)."""
    return _simulate(problem, GPUS[gpu_name], programs_per_sm=1)


def test_fa2_heuristic_examples():
    # FlashAttention-2's own example: 48 (batch x heads) on 108 SMs -> 2 splits (0.89 beats 0.67).
    assert fa2_num_splits(48, 108, 1024) == 2
    assert fa2_num_splits(87, 108, 1024) == 1  # >= 0.8 x SMs: one split
    assert fa2_num_splits(1, 108, 4) == 4  # never more splits than key blocks
    # 64 key blocks: 12 splits gives the same blocks per split as 11, so it is never chosen.
    assert fa2_num_splits(9, 108, 64) != 12


def test_fa2_splits_from_capacity_and_gqa_packing():
    # GQA decode packs a group's query heads into one CTA per (batch, KV head); the heuristic sees 2 x SMs.
    short, roomy = Problem((1000,) * 2, 32, 8), Problem((1000,) * 2, 32, 8, capacity=131072)
    assert fa2_splits(short, 132) == (fa2_num_splits(16, 264, 8), 128)
    assert fa2_splits(roomy, 132)[0] == fa2_num_splits(16, 264, 1024)  # capacity, not length, sizes splits


def test_flex_splits():
    assert flex_splits(Problem((10,) * 4, 32, 8), 132) == 132 // 32 * 2
    assert flex_splits(Problem((10,) * 40, 32, 8), 132) == 1


def test_every_method_reads_every_token_once_and_counts_its_merge():
    problem = Problem((0, 1, 127, 128, 129, 5000, 70000), 32, 8)
    result = simulate(problem)
    for sched in result.values():
        assert sum(sched.sm_work) == problem.n_kv_heads * sum(problem.lens), sched.method
        assert len(sched.sm_work) == H100.sms
        # Never faster than reading the bytes at copy bandwidth.
        assert sched.time_us >= problem.kv_bytes / (H100.hbm_tbps * 1e6)
    lean, fa2 = result["lean"], result["fa2"]
    assert lean.splits > 0 and lean.merge_us > 0 and 2 <= lean.chain <= 2 * MERGE_FANIN
    assert fa2.splits > 1 and fa2.merge_us >= H100.launch_gap_us  # the combine kernel's launch


def test_fixed_split_drops_just_above_a_multiple_of_the_sms():
    """batch x heads = 2 x SMs + 1: fixed-split kernels keep one split and run a third, nearly
    empty wave, while Lean stays balanced, and no merge is needed."""
    over = Problem((16384,), 2 * H100.sms + 1, 2 * H100.sms + 1)
    result = simulate(over)
    assert result["fa2"].splits == 1 and result["fa2"].efficiency < 0.7
    assert result["lean"].efficiency >= 0.99 and result["lean"].merge_us < 0.1 * result["lean"].time_us
    assert result["fa2"].time_us / result["lean"].time_us > 1.2


def test_lean_beats_fixed_split_on_a_ragged_gqa_batch():
    result = simulate(Problem((65536, 4096, 1024, 30000, 500, 12000, 64000, 2000), 32, 8))
    assert result["lean"].time_us < min(result["fa2"].time_us, result["flex"].time_us)


@pytest.mark.xdist_group("tp8_rank_64k")  # shares its simulation with the deterministic rows' test
def test_tensor_parallel_rank_keeps_the_merge_chain_bounded():
    """Llama-3-70B on 8 ranks, B=1, 64k: one KV head per rank, the output split over the cost
    rule's programs, merged in two levels of <= MERGE_FANIN partials."""
    hq, hkv = rank_heads(*MODEL_PRESETS["llama-3-70b"][:2], 8)
    assert (hq, hkv) == (8, 1)
    lean = simulate(Problem((65536,), hq, hkv))["lean"]
    assert lean.splits == 1 and 2 * MERGE_FANIN >= lean.chain > MERGE_FANIN
    assert MERGE_FANIN < lean.units <= MAX_CONTRIBUTORS
    assert 0 < lean.merge_us < 0.2 * lean.time_us


def test_b200_splits_one_output_over_more_programs():
    """On a B200 an output's 64 contributors keep 4 MB in flight, under Little's law's 5.5 MB
    (tools.gpus), so sm_100's entries let 96 programs share one (``B200_CONTRIBUTORS``): the
    TP-8 rank at B=1 and 1M keys spreads over more than MAX_CONTRIBUTORS programs, still merged
    in two levels, and reads at least as fast as with 64."""
    lean = simulate(Problem((1 << 20,), 8, 1), "B200")["lean"]
    assert MAX_CONTRIBUTORS < lean.units <= B200_CONTRIBUTORS
    assert lean.chain <= MERGE_FANIN + B200_CONTRIBUTORS // MERGE_FANIN
    with_64 = lean_sim_schedule(Problem((1 << 20,), 8, 1), GPUS["B200"], 1, max_contributors=MAX_CONTRIBUTORS)
    assert with_64.units <= MAX_CONTRIBUTORS and lean.time_us < with_64.time_us


def test_rank_heads_replicates_kv_heads_and_rejects_bad_tp():
    assert rank_heads(32, 8, 16) == (2, 1)
    with pytest.raises(ValueError, match="--tp: expected a divisor of the 64 query heads, got 3"):
        rank_heads(64, 8, 3)


def test_problem_validation():
    with pytest.raises(ValueError, match="lens"):
        Problem((), 8, 8)
    with pytest.raises(ValueError, match="n_heads"):
        Problem((10,), 6, 4)
    with pytest.raises(ValueError, match="capacity"):
        Problem((100,), 8, 8, capacity=50)


def test_cli_tp_preset_json_and_gantt(tmp_path, capsys):
    png, out_json = tmp_path / "gantt.png", tmp_path / "rows.json"
    assert (
        main(
            [
                "--gpu",
                "H100",
                "--model",
                "llama-3-8b",
                "--tp",
                "8",
                "--batch",
                "2",
                "--lens",
                "3000,900",
                "--programs-per-sm",
                "1",
                "--json",
                str(out_json),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| H100 | B=2 Hq=4 Hkv=1 D=128" in out and "lean merge us" in out
    data = json.loads(out_json.read_text())
    assert data["model"]["H100"]["sms"] == 132 and set(data["sources"]) <= set(data["model"]["H100"])
    (row,) = data["rows"]
    assert math.isfinite(row["speedup_vs_fa2"]) and row["lean_chain"] <= 2 * MERGE_FANIN
    assert png.stat().st_size > 10_000


def test_parallel_rows_match_sequential_rows_in_order():
    problems = [Problem((300, 40), 4, 2, 64), Problem((700,), 2, 2, 64), Problem((300, 40), 4, 2, 64)]
    got = table_rows_parallel(problems, ["A100"], programs_per_sm=1, workers=2, progress=False)
    want = [row for prob in problems for row in table_rows(prob, ["A100"], programs_per_sm=1)]
    assert got == want and len(got) == 3


def test_cp_layouts_compare_tp_alone_with_tp_over_the_kv_heads():
    assert cp_layouts(64, 8, 16) == [(16, 1), (8, 2)]  # TP 16 replicates each KV head on 2 ranks
    assert cp_layouts(64, 8, 8) == [(8, 1), (4, 2)]  # no more ranks than KV heads: CP only adds an exchange
    assert cp_layouts(32, 4, 16) == [(16, 1), (4, 4)]


def test_cp_exchange_model_and_rows():
    """The exchange: a link's fixed cost plus (cp - 1) partials over it (NVLink inside a node, the
    network when the ranks span nodes), then a merge launch; rows put the KV memory of every layer
    beside the kernel and exchange time of one."""
    nvlink, network = LINKS["H100"]
    assert link_of(H100, 8) == nvlink and link_of(H100, 16) == network
    partial = 8 * 8 * 129 * 4
    assert cp_merge_us(8, 8, 128, 4, 1, H100) == 0.0
    assert cp_merge_us(8, 8, 128, 4, 2, H100) == pytest.approx(nvlink.latency_us + partial / 450e3 + 1.0)
    assert cp_merge_us(8, 8, 128, 8, 2, H100) == pytest.approx(network.latency_us + partial / 50e3 + 1.0)
    cases = {(c[0], c[1], c[2], c[4], c[5]): c for c in cp_sweep_cases()}
    tp_only, cp = cases[("llama-3-70b", 16, 16, 8, 1048576)], cases[("llama-3-70b", 16, 8, 8, 1048576)]
    assert tp_only[-1] == Problem((1048576,) * 8, 4, 1) and cp[-1] == Problem((524288,) * 8, 8, 1)
    rows = [cp_row(c, {"lean_us": 100.0}, H100) for c in (tp_only, cp)]
    assert rows[0]["kv_gb_per_rank"] == pytest.approx(80 * 8 * 1048576 * 512 / 1e9)  # 80 layers, 512 B a token
    assert rows[1]["kv_gb_per_rank"] == pytest.approx(rows[0]["kv_gb_per_rank"] / 2)
    assert rows[1]["attention_us"] == pytest.approx(100.0 + cp_merge_us(8, 8, 128, 8, 2, H100))


def test_tp_table_merges_presets_of_one_rank_shape():
    """``--tp-sweep``'s table: presets whose ranks have the same (Hq, Hkv, D) share a row, per GPU."""
    from lean_tp.tools.simulate.tables import format_tp_table

    base = dict(batch=1, context=4096, lean_us=2.5, lean_merge_us=1.1, lean_chain=12, lean_merge_kb=24.0)
    base |= dict(
        lean_programs=32, fa2_splits=32, fa2_us=2.7, fa2_merge_us=1.3, speedup_vs_fa2=1.08, speedup_vs_flex=None
    )
    base |= dict(speedup_vs_lean_invariant=1.04)
    shapes = {"llama-3-8b": "Hq=4 Hkv=1", "mixtral-8x7b": "Hq=4 Hkv=1", "llama-3-70b": "Hq=8 Hkv=1"}
    rows = [
        base | dict(model=m, gpu=g, problem=f"B=1 {shape} D=128 len 4096")
        for m, shape in shapes.items()
        for g in ("A100", "H100")
    ]
    lines = format_tp_table(rows).splitlines()[2:]
    assert len(lines) == 4
    assert lines[0] == (
        "| A100 | llama-3-8b / mixtral-8x7b (Hq=4 Hkv=1 D=128) | 1 | 4096 | 2.5 | 1.10 | 12 | 24 | 32 | 32 | 2.7 | 1.30 "
        "| 1.08x | n/a | 1.04x |"
    )
    assert lines[3].startswith("| H100 | llama-3-70b (Hq=8 Hkv=1 D=128) |")


def test_cli_cp_sweep_json_table_and_plot(tmp_path, capsys, monkeypatch):
    """The sweep's wiring, with each rank problem's kernel time stubbed (the full sweep runs the
    schedule for 52 problems: docs/simulator/cp.md)."""
    import lean_tp.tools.simulate.cli as sim_cli

    stub = lambda problems, gpus, *_: [{"gpu": g, "lean_us": p.kv_bytes / 3e6} for p in problems for g in gpus]  # noqa: E731
    monkeypatch.setattr(sim_cli, "table_rows_parallel", stub)
    png, out_json = tmp_path / "cp.png", tmp_path / "cp.json"
    assert main(["--cp-sweep", "--gpu", "H100", "--json", str(out_json), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| H100 | llama-3-70b | 16 | 8 x 2 | 8 | 1048576 | B=8 Hq=8 Hkv=1 D=128 len 524288 |" in out
    data = json.loads(out_json.read_text())
    assert data["links"]["H100"][1]["gbps"] == 50.0 and "latency_us" in data["link_sources"]
    assert len(data["rows"]) == len(cp_sweep_cases()) and png.stat().st_size > 10_000


def test_gantt_draws_every_methods_bars(tmp_path, monkeypatch):
    """Each panel draws one bar per piece of work of its method, and the pieces add up to the
    method's work per SM (FlashDecoding's panel was once empty: its bars were passed by position)."""
    import matplotlib.axes

    from lean_tp.tools.simulate.plots import plot_gantt

    problem = Problem((3000, 900), 8, 2)
    result = simulate(problem)
    for sched in result.values():
        per_sm = [0] * H100.sms
        for sm, _, tokens, _ in sched.bars:
            per_sm[sm] += tokens
        assert sched.bars and per_sm == sched.sm_work, sched.method
    drawn = []
    real = matplotlib.axes.Axes.barh
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", lambda ax, *a, **k: drawn.append(ax) or real(ax, *a, **k))
    plot_gantt(problem, H100, result, str(tmp_path / "gantt.png"))
    panels = list(dict.fromkeys(drawn))
    assert [drawn.count(ax) for ax in panels] == [len(result["lean"].bars), len(result["fa2"].bars)]
    assert "over the" in panels[0].get_title() and "SMs with work" in panels[1].get_title()


def test_empty_problem_reports_no_speedup(capsys):
    """All lengths 0: every method costs nothing, and no ratio is printed as if it were measured."""
    (row,) = table_rows(Problem((0, 0), 8, 2), ["H100"], programs_per_sm=1)
    assert row["lean_us"] == row["fa2_us"] == row["flex_us"] == 0.0
    assert row["speedup_vs_fa2"] is None and row["speedup_vs_flex"] is None
    assert main(["--gpu", "H100", "--lens", "0", "--programs-per-sm", "1"]) == 0
    assert "| n/a | n/a |" in capsys.readouterr().out


def test_load_balance_counts_the_sms_with_work():
    """Lean's grid shrinks for a short context: the SMs it leaves idle do not count against its balance."""
    result = simulate(Problem((2048,), 8, 2))
    lean = result["lean"]
    assert sum(1 for w in lean.sm_work if w) < H100.sms and lean.efficiency > 0.9


def _mla(lens, heads=16, elem_size=2):
    return Problem(tuple(lens), heads, 1, 576, elem_size=elem_size, head_dim_v=512)


def test_mla_problem_reads_each_latent_row_once():
    """An MLA problem's token is its 576-dim latent row, once (V is read with K's row); fp8 halves it."""
    assert _mla([10]).bytes_per_token == 1152 and _mla([10], elem_size=1).bytes_per_token == 576
    assert Problem((10,), 8, 2, 128).bytes_per_token == 512
    assert "D=576/512 fp8" in _mla([10], elem_size=1).describe()
    with pytest.raises(ValueError, match=r"v_cache: expected \(K, V\) head dims"):
        Problem((10,), 16, 1, 576, head_dim_v=448)
    ranks = {(model, parallel, p.n_heads) for model, parallel, _, _, p in mla_sweep_problems()}
    assert ranks == {
        ("deepseek-v3", "TP 8", 16),
        ("deepseek-v3", "DP", 128),
        ("kimi-k2", "TP 8", 8),
        ("kimi-k2", "DP", 64),
    }
    assert {(p.elem_size, p.num_tokens) for *_, p in mla_sweep_problems()} == {(2, 1), (2, 2), (1, 1), (1, 2)}


def test_flashmla_schedule_follows_its_scheduler():
    """FlashMLA on an H100: 132 parts at 16 heads, 66 per 64-row block at 128; each part's budget is
    ceil(total / parts) + 5 blocks of 64 keys, a request costing 5 blocks more per piece; every
    token read once per row block."""
    one = flashmla_schedule(_mla([131072]), H100)
    # 2048 + 5 blocks over 132 parts: 16 + 5 a part, 16 of the request each (the last part gets the rest).
    assert one.units == 128 and one.splits == 128 and sum(one.sm_work) == 131072
    # Its combine: a warp a head loads every split's lse, then one split at a time.
    assert one.merge_us >= (1 + 128) * H100.l2_latency_us
    wide = flashmla_schedule(_mla([4096] * 8, heads=128), H100)
    assert sum(wide.sm_work) == 2 * 8 * 4096  # two 64-row blocks each read the latent rows
    many = flashmla_schedule(_mla([64] * 400), H100)
    assert many.splits == 1 and many.merge_us == 0.0  # short requests fit whole: nothing to combine
    assert flashmla_schedule(_mla([0, 0]), H100).time_us == 0.0


def test_triton_mla_splits_and_head_blocks():
    """vLLM's split count: the batch's longest length over 512, rounded up to a power of two, at
    most 2 per SM; 16-head CTAs, each reading the latent rows; the reduce kernel always runs."""
    assert triton_mla_splits(_mla([4096]), H100) == 8
    assert triton_mla_splits(_mla([5000, 10]), H100) == 16  # one count for the batch, from its longest
    assert triton_mla_splits(_mla([100]), H100) == 1
    assert triton_mla_splits(_mla([1 << 20]), H100) == 2 * H100.sms
    sched = triton_mla_schedule(_mla([4096, 100], heads=128), H100)
    assert sum(sched.sm_work) == 8 * (4096 + 100) and sched.merge_us >= H100.launch_gap_us
    assert triton_mla_schedule(_mla([100]), H100).merge_us > 0  # one split: the reduce still runs


def test_mla_simulation_rows_and_sweep_wiring(tmp_path, capsys, monkeypatch):
    """An MLA problem is simulated against FlashMLA and Triton MLA (not FA2 and Flex), lean reading
    each latent row once per 16-row block; the sweep's CLI wiring with the rows stubbed."""
    problem = _mla([3000, 70])
    result = simulate(problem)
    assert set(result) == {"lean", "lean_invariant", *MLA_PEERS}
    assert sum(result["lean"].sm_work) == sum(problem.lens)
    import lean_tp.tools.simulate.cli as sim_cli

    row = sim_cli.row_of(problem, H100, result)
    assert row["speedup_vs_flashmla"] == pytest.approx(row["flashmla_us"] / row["lean_us"])

    stub = lambda problems, gpus, *_: [dict(row, gpu=g) for _ in problems for g in gpus]  # noqa: E731
    monkeypatch.setattr(sim_cli, "table_rows_parallel", stub)
    png, out_json = tmp_path / "mla.png", tmp_path / "mla.json"
    assert main(["--mla-sweep", "--gpu", "H100", "--plot", str(png), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out_json.read_text())["mla_peer_constants"] == [list(c) for c in MLA_PEER_CONSTANTS]
    assert "| H100 | deepseek-v3 | DP (128) | fp8 | 2 | 128 | 131072 |" in out and png.stat().st_size > 10_000


def test_an_mla_peer_is_modelled_only_on_the_caches_its_code_takes():
    """An e4m3 latent cache: FlashMLA's dense decode never, FlashInfer's MLA on sm_90 only, the
    Triton peers from sm_89 (Triton's fp8e4nv); a 16-bit cache every peer. A peer that does not
    take the cache has no time and no ratio, "-" and "n/a" in the table, and is left out of the
    summary, which counts lean ahead of every peer only where some peer runs."""
    import lean_tp.tools.simulate.cli as sim_cli

    fp8, bf16 = _mla([3000, 70], elem_size=1), _mla([3000, 70])
    assert {p for p in MLA_PEERS if mla_peer_takes(p, fp8, H100)} == {"flashinfer_mla", "triton_mla", "sglang_mla"}
    assert {p for p in MLA_PEERS if mla_peer_takes(p, fp8, GPUS["B200"])} == {"triton_mla", "sglang_mla"}
    assert not any(mla_peer_takes(p, fp8, GPUS["A100"]) for p in MLA_PEERS)
    assert all(mla_peer_takes(p, bf16, GPUS[g]) for p in MLA_PEERS for g in ("A100", "H100", "B200"))
    rank = dict(model="deepseek-v3", parallel="TP 8", heads=16, tq=1, batch=2, context=3000)
    rows = []
    for problem, gpu, cache in ((fp8, "H100", "fp8"), (fp8, "A100", "fp8"), (bf16, "A100", "bf16")):
        result = simulate(problem, gpu)
        assert (result["flashmla"] is None) == (cache == "fp8")
        rows.append(sim_cli.row_of(problem, GPUS[gpu], result) | rank | dict(cache=cache))
    assert rows[0]["flashmla_us"] is None and rows[0]["speedup_vs_flashmla"] is None
    assert rows[0]["speedup_vs_triton_mla"] == pytest.approx(rows[0]["triton_mla_us"] / rows[0]["lean_us"])
    table = sim_cli.format_mla_table(rows).splitlines()
    assert table[2].count("| - |") == 1 and table[2].count("n/a") == 1
    assert table[3].count("n/a") == len(MLA_PEERS) and "n/a" not in table[4]
    summary = sim_cli.format_mla_summary(rows)
    a100 = next(line for line in summary.splitlines() if line.startswith("| A100"))
    assert a100.count("/1)") == len(MLA_PEERS) and a100.endswith(
        f" | {int(min(rows[2][f'speedup_vs_{p}'] for p in MLA_PEERS) >= 1)}/1 |"
    )
    assert "| H100 | deepseek-v3 TP 8 (16) | - |" in summary


def test_l2_serves_a_chunk_read_again_while_it_is_resident():
    """A chunk's bytes come from HBM until its reads add up to it (disjoint pieces read once each);
    a read past that within the residency window (half the L2 at the copy bandwidth: 8.3 us on an
    H100) is an L2 hit, one after a longer gap a miss again."""
    window = residency_us(H100)
    assert window == pytest.approx(0.5 * 50e6 / 3.0e6)
    chunk = (0, 0, 0)
    reads = [Read(0.0, chunk, 100, 100), Read(0.5 * window, chunk, 100, 100), Read(2.6 * window, chunk, 100, 100)]
    assert hbm_share(reads, H100) == pytest.approx(2 / 3)
    halves = [Read(0.0, chunk, 50, 100), Read(0.1, chunk, 50, 100)]  # two splits, one chunk: no re-read
    assert hbm_share(halves, H100) == 1.0
    assert hbm_share([*halves, Read(0.2, chunk, 100, 100)], H100) == pytest.approx(0.5)
    # keys [100, 900) of a 1000-key sequence: chunks of 32 keys, stamped at their middles
    reads = chunk_reads(3, 0, 1000, 100, 900, 2, lambda keys: keys)
    assert sum(r.nbytes for r in reads) == 1600 and reads[0].chunk == (3, 0, 3) and reads[0].time_us == 14.0
    assert (
        reads[0].nbytes == 56
        and reads[0].chunk_bytes == 64
        and chunk_reads(0, 0, 1000, 992, 1000, 2, abs)[0].chunk_bytes == 16
    )


def test_row_blocks_reading_keys_together_stream_from_hbm_once():
    """FlashMLA at 128 heads runs two 64-row CTAs over each part's keys at the same time: the second
    read is an L2 hit, so the pair streams at the copy bandwidth, not half of it; standard decode
    (one reader a key) is charged as before."""
    wide = flashmla_schedule(_mla([32768] * 8, heads=128), H100)
    kernel = wide.time_us - wide.merge_us
    assert kernel == pytest.approx(2 * 8 * 32768 * 1152 / 3.0e6 / 2, rel=0.15)
    reads_once = simulate(Problem((65536,), 8, 1))["fa2"]
    assert reads_once.time_us - reads_once.merge_us >= 65536 * 512 / 3.0e6


def test_no_sm_computes_faster_than_its_tensor_cores():
    """``compute_roof``: 2 x rows x (576 + 512) FLOP a latent key, at the tensor peak. Under DP
    attention's 128 heads FlashMLA's 64-row CTAs are bound by its published 660 TFLOP/s, not the
    copy bandwidth, and FlashInfer's e4m3 CTAs (bf16 products on half the bytes) by the H100's
    989.4; lean's measured loops run below the roof, so it changes none of the rows they model,
    and a GQA head's few rows leave it above what an SM's L2 port gives."""
    dp, flops = _mla([32768] * 128, heads=128), 128 * 128 * 32768 * 2 * (576 + 512)
    assert compute_roof(dp, H100, 64) == pytest.approx(989.4e6 / 132 / (2 * 64 * 1088) * 1152)
    flashmla = flashmla_schedule(dp, H100)
    assert flashmla.time_us - flashmla.merge_us == pytest.approx(flops / 660e6, rel=0.02)
    fp8 = flashinfer_mla_schedule(_mla([32768] * 128, heads=128, elem_size=1), H100)
    assert fp8.time_us == pytest.approx(flops / 989.4e6, rel=0.05)
    for (_, _, elem, block_g, block_n), us in LOOP_US.items():
        problem = _mla([1], heads=128, elem_size=elem)
        assert block_n * problem.bytes_per_token / us < compute_roof(problem, H100, block_g) / 2, (block_g, block_n)
    assert 64 * dp.bytes_per_token / GLUON_LOOP_US["sm90"] < compute_roof(dp, H100, 64) / 2
    gqa = Problem((4096,), 32, 8, 128)
    assert compute_roof(gqa, H100, 16) > 4 * H100.l2_port_gbps * 1e3


def test_flashinfer_mla_plan_clusters_and_merges_in_kernel():
    """FlashInfer's Hopper MLA: CTA pairs at 128 heads (a cluster per 2 SMs) reading the same chunks,
    chunks of kv_len_limit keys (32k keys over 66 clusters: 512), the split rows merged after a grid
    barrier with no second launch; 16 heads: one CTA a cluster."""
    wide = flashinfer_mla_schedule(_mla([32768], heads=128), H100)
    assert wide.units == 2 * 64 and wide.splits == 64 and sum(wide.sm_work) == 2 * 32768
    assert 2 * H100.l2_latency_us < wide.merge_us < H100.launch_gap_us + 64 * H100.l2_latency_us
    narrow = flashinfer_mla_schedule(_mla([4096]), H100)
    assert narrow.units == 32 and sum(narrow.sm_work) == 4096  # 128-key chunks, one CTA each
    assert flashinfer_mla_schedule(_mla([32] * 4), H100).merge_us == 0.0  # 32-key chunks: nothing split


def test_sglang_mla_splits_follow_its_two_rules():
    """SGLang's Triton MLA: splits capped at next_pow2(SMs) (256 on an H100); a lone long request
    gets SMs x log2(len / 64) / 8 head blocks' worth; in a ragged batch each request gets the
    larger of its share of the longest one's chunks by the two rules."""
    assert sglang_mla_splits(_mla([131072], heads=128), H100) == [math.ceil(int(132 * 11) / 8)]
    assert sglang_mla_splits(_mla([131072]), H100) == [256]  # 16 heads: one head block, the cap
    long_short = sglang_mla_splits(_mla([32768, 1024]), H100)
    assert long_short == [256, 8]  # chunks of 128 keys: 132 x log2(512) over 2 head blocks, capped


def test_vllm_invariant_reads_each_sequence_once_with_no_combine():
    """vLLM's batch-invariant decode: one CTA per (sequence, KV head) over the whole sequence."""
    problem = Problem((3000, 0, 70000), 32, 8)
    sched = vllm_invariant_schedule(problem, H100)
    assert sched.units == 2 * 8 and sched.splits == 1 and sched.merge_us == 0.0
    assert sorted({tokens for _, _, tokens, _ in sched.bars}) == [3000, 70000]
    assert sum(sched.sm_work) == 8 * sum(problem.lens)


def test_sglang_triton_splits_are_fixed_tiles_per_request_and_stage_2_always_runs():
    """ceil(len / 256) splits per request, each ceil(len / splits) rounded up to 32 tokens; a CTA per
    (request, head tile, split), a head tile being up to 16 query heads of one KV head."""
    assert [sglang_triton_splits(n) for n in (0, 1, 256, 257, 1000, 1 << 20)] == [
        (0, 0), (1, 32), (1, 256), (2, 160), (4, 256), (4096, 256)
    ]  # fmt: skip
    sched = sglang_triton_schedule(Problem((257, 1000, 5), 8, 1), H100)
    assert sched.units == 2 + 4 + 1 and sched.splits == 4
    assert sorted(t for _, _, t, _ in sched.bars) == [5, 97, 160, 232, 256, 256, 256]
    one_split = sglang_triton_schedule(Problem((100, 200), 8, 1), H100)
    assert one_split.splits == 1 and one_split.merge_us >= H100.launch_gap_us  # the reduce runs anyway
    wide = sglang_triton_schedule(Problem((512,), 64, 2), H100)  # 32 heads a KV head: 2 tiles each
    assert wide.units == 2 * 2 * 2 and sum(wide.sm_work) == 2 * 2 * 512


def test_sglang_flashinfer_splits_every_2048_tokens_and_merges_only_when_split():
    fits = sglang_flashinfer_schedule(Problem((2048,) * 3, 8, 1), H100)
    assert fits.units == 3 and fits.splits == 1 and fits.merge_us == 0.0
    split = sglang_flashinfer_schedule(Problem((2049, 100), 8, 1), H100)
    assert split.splits == 2 and sorted(t for _, _, t, _ in split.bars) == [1, 100, 2048]
    assert split.merge_us >= H100.launch_gap_us


def test_long_folds_cost_their_chain_of_loads():
    """At 1M tokens SGLang's Triton reduce folds 4096 partials two at a time, one L2 round trip
    each pair; FlashInfer's merge folds 512, 32 at a time; many short folds keep the plain combine."""
    long = Problem((1 << 20,), 8, 1)
    triton, flashinfer = sglang_triton_schedule(long, H100), sglang_flashinfer_schedule(long, H100)
    assert triton.merge_us > H100.launch_gap_us + 4096 // 2 * H100.l2_latency_us
    assert H100.launch_gap_us + 512 // 32 * H100.l2_latency_us < flashinfer.merge_us < triton.merge_us / 10
    # 64 x 32 outputs of 2 chunks: the partials over every SM's port outweigh one 2-partial fold.
    short = sglang_flashinfer_schedule(Problem((4096,) * 64, 32, 32), H100)
    partials = 64 * 32 * 2 * 129 * 4
    assert short.merge_us == pytest.approx(
        H100.launch_gap_us + 2 * H100.l2_latency_us + partials / (H100.sms * H100.l2_port_gbps * 1e3)
    )


@pytest.mark.xdist_group("tp8_rank_64k")
def test_deterministic_rows_table_and_sweep_wiring(tmp_path, capsys, monkeypatch):
    """A TP-8 rank at B=1, 64k: the engines' modes beside lean's (its schedules from the session's
    simulation of that problem), ratios over lean invariant; then the sweep's CLI wiring with that
    row stubbed in for every case."""
    import lean_tp.tools.simulate.cli as sim_cli
    import lean_tp.tools.simulate.deterministic as det

    problem, lean_calls = Problem((65536,), 8, 1), []

    def lean(p, gpu, programs_per_sm=None, batch_invariant=False):
        lean_calls.append((p, gpu.name, programs_per_sm, batch_invariant))
        return simulate(p)["lean_invariant" if batch_invariant else "lean"]

    monkeypatch.setattr(det, "lean_sim_schedule", lean)
    (row,) = deterministic_table_rows(problem, ["H100"], programs_per_sm=1)
    assert lean_calls == [(problem, "H100", 1, False), (problem, "H100", 1, True)]
    assert row["lean_invariant_us"] == simulate(problem)["lean_invariant"].time_us
    assert row["vllm_over_invariant"] == pytest.approx(row["vllm_us"] / row["lean_invariant_us"])
    assert row["vllm_over_invariant"] > 10  # one CTA streams 64k tokens on one SM
    assert row["sglang_flashinfer_splits"] == 32 and row["sglang_triton_splits"] == 256
    calls = []

    def stub(problems, gpus, *_, **kw):
        calls.append(kw)
        return [dict(row, gpu=g) for _ in problems for g in gpus]

    monkeypatch.setattr(sim_cli, "table_rows_parallel", stub)
    png, out_json = tmp_path / "det.png", tmp_path / "det.json"
    assert main(["--deterministic-sweep", "--gpu", "H100", "--json", str(out_json), "--plot", str(png)]) == 0
    assert calls == [{"rows_of": deterministic_table_rows}, {"rows_of": verification_table_rows}]
    out = capsys.readouterr().out
    table = out[out.index("| GPU | shapes |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(deterministic_sweep_cases()) and "| Triton / inv |" in table[0]
    verify = out[out.index("| GPU | shape | Tq |") :].split("\n\n")[0].splitlines()
    assert len(verify) == 2 + len({(c[0], c[1]) for c in verification_sweep_cases()})
    assert table[2].startswith("| H100 | TP-8 llama-3-70b / qwen2.5-72b | B=1 Hq=8 Hkv=1 D=128 len 65536 |")
    assert "| SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE (tokens) | 256 |" in out  # the constants, with sources
    n, ratio = len(deterministic_sweep_cases()), row["vllm_over_invariant"]
    assert f"| H100 | vLLM batch-invariant | {ratio:.2f}-{ratio:.2f}x | {n} of {n} | 0 of {n} | 0 of {n} |" in out
    data = json.loads(out_json.read_text())
    assert data["engine_versions"]["sglang"] == "0.5.23" and len(data["engine_constants"]) >= 5
    assert sum(r["table"] == "verification" for r in data["rows"]) == len(verification_sweep_cases())
    assert png.stat().st_size > 10_000


def test_verification_in_the_invariant_mode_reads_the_keys_once_per_token():
    """Tq = 3 on a TP-8 rank: the invariant mode schedules each token as a sequence over its keys
    (598, 599, 600), so it reads the keys three times where the default mode's one row block reads
    them once, and its row of the verification table says what that costs."""
    problem = Problem((600,), 8, 1, num_tokens=3)
    invariant = lean_variant(problem, GPUS["H100"], batch_invariant=True)
    assert schedule_lens(problem, invariant) == [598, 599, 600]
    assert schedule_lens(problem, lean_variant(problem, GPUS["H100"])) == [600]
    default, inv = (lean_sim_schedule(problem, GPUS["H100"], 1, batch_invariant=i) for i in (False, True))
    assert (sum(default.sm_work), sum(inv.sm_work)) == (600, 598 + 599 + 600)
    (row,) = verification_table_rows(problem, ["H100"], programs_per_sm=1)
    assert row["problem"] == "B=1 Tq=3 Hq=8 Hkv=1 D=128 len 600"
    assert (row["lean_us"], row["lean_invariant_us"]) == (default.time_us, inv.time_us)
    assert row["invariant_over_lean"] == pytest.approx(inv.time_us / default.time_us)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--paper", "--deterministic-sweep"], "--deterministic-sweep"),
        (["--deterministic-sweep", "--lens", "100"], "--lens"),
        (["--deterministic-sweep", "--tp", "4"], "--tp"),
        (["--deterministic-sweep", "--plot", "-"], "--plot"),
    ],
)
def test_deterministic_sweep_rejects_flags_it_does_not_use(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and f"argument {flag}: expected" in err[0]


def test_the_invariant_variant_streams_at_its_own_blocks_rate():
    """The batch-invariant variant decodes each of Tq tokens as a 16-row block of its own, whose
    keys an iteration (sm_90's MLA ``narrow_block_n``: 64) differ from the default variant's at
    Tq x 16 rows (32): its rate is its own blocks' (``gpus.LOOP_US``), so verifying 2 tokens
    costs twice a one-token decode where the loop is the time (B=32, 32k)."""
    mla = dict(n_heads=16, n_kv_heads=1, head_dim=576, elem_size=2, head_dim_v=512)
    one = lean_sim_schedule(Problem((32768,) * 32, **mla), GPUS["H100"]).time_us
    two = lean_sim_schedule(Problem((32768,) * 32, **mla, num_tokens=2), GPUS["H100"], batch_invariant=True)
    assert 1.9 <= two.time_us / one <= 2.1, (one, two.time_us)


def test_the_invariant_variant_of_dp_attention_reads_each_latent_row_twice(monkeypatch):
    """DP attention's 128 heads (H100, B=32, 32k, 16 bits) in the invariant mode: two 64-row blocks
    in 512-key chunks, each its own group (``DecodeConfig.invariant_chunks``), against eight
    16-row blocks: under 0.6x of their time, about 2.1x the default's (the Gluon kernel)."""
    from lean_tp.ops.decode_attention import tuning

    problem = Problem((32768,) * 32, 128, 1, 576, elem_size=2, head_dim_v=512)
    cx = lean_variant(problem, H100, batch_invariant=True).constexprs
    assert (cx["BLOCK_G"], cx["NUM_GC"], cx["TILE_N"], cx["IGROUP"]) == (64, 2, INVARIANT_WIDE_TILE_N, 1)
    wide = lean_sim_schedule(problem, H100, batch_invariant=True).time_us
    entry = tuning.TUNING_TABLE[("sm90", 576, 2)]
    narrow = dataclasses.replace(entry, invariant_max_block_g=16, invariant_wide_tile_n=None)
    monkeypatch.setitem(tuning.TUNING_TABLE, ("sm90", 576, 2), narrow)
    assert lean_variant(problem, H100, batch_invariant=True).constexprs["BLOCK_G"] == 16
    rows16 = lean_sim_schedule(problem, H100, batch_invariant=True).time_us
    default = lean_sim_schedule(problem, H100).time_us
    assert wide < 0.6 * rows16 and 1.9 < wide / default < 2.4, (wide, rows16, default)


def test_the_invariant_output_fold_is_shared_in_column_slices(monkeypatch):
    """MLA's 16 x 512 partials on a TP-8 rank, B=1 at 128k keys: the invariant mode's output of 64
    supergroups is folded in 8 column slices by the program that makes the last known and the
    contributors waiting beside it (``output_fold.finish_output``), against all 64 partials through
    one SM's L2 port when one program folds them whole: under a third of that merge."""
    from lean_tp.tools.simulate import schedules

    problem = Problem((131072,), 16, 1, 576, elem_size=2, head_dim_v=512)
    sliced = lean_sim_schedule(problem, H100, batch_invariant=True)
    fold = schedules._invariant_merges
    monkeypatch.setattr(schedules, "_invariant_merges", lambda *args: fold(*args[:6]))  # whole, by one program
    whole = lean_sim_schedule(problem, H100, batch_invariant=True)
    assert sliced.merge_us * 3 < whole.merge_us, (sliced.merge_us, whole.merge_us)
    assert sliced.time_us - sliced.merge_us == pytest.approx(whole.time_us - whole.merge_us)


def test_invariant_groups_of_three_holders_or_more_are_folded_in_column_slices(monkeypatch):
    """MLA on a TP-8 rank, B=1: at 4k each of the 64 chunks lies in a program of its own, so a
    group of 8 chunks has 8 holders, and its last holder folds it in 8 column slices beside the 7
    waiting (``folds.finish_group``): the merge takes under two thirds of its time with every group
    folded whole. At 32k a group spans 2 programs, whose one possible helper would share 8 slices:
    it stays whole (``tuning.INVARIANT_SLICE_HOLDERS``), the same time either way."""
    from lean_tp.tools.simulate import schedules

    def merges(context: int, holders: int) -> float:
        monkeypatch.setattr(schedules, "INVARIANT_SLICE_HOLDERS", holders)
        problem = Problem((context,), 16, 1, 576, elem_size=2, head_dim_v=512)
        return lean_sim_schedule(problem, H100, batch_invariant=True).merge_us

    assert merges(4096, INVARIANT_SLICE_HOLDERS) < 0.65 * merges(4096, 10**9)
    assert merges(32768, INVARIANT_SLICE_HOLDERS) == merges(32768, 10**9)


def test_invariant_supergroups_of_five_holders_or_more_are_folded_in_column_slices(monkeypatch):
    """The same rank at 4k: the output's 2 supergroups of 4 groups have 32 holders each, so the
    program that makes a supergroup's last group known folds it in 8 column slices beside the
    holders waiting (``output_fold.finish_super``): the merge takes under three quarters of its time
    with every supergroup folded whole."""
    from lean_tp.tools.simulate import schedules

    def merges(holders: int) -> float:
        monkeypatch.setattr(schedules, "INVARIANT_SUPER_SLICE_HOLDERS", holders)
        problem = Problem((4096,), 16, 1, 576, elem_size=2, head_dim_v=512)
        return lean_sim_schedule(problem, H100, batch_invariant=True).merge_us

    assert merges(INVARIANT_SUPER_SLICE_HOLDERS) < 0.75 * merges(10**9)


def test_lean_mla_model_against_the_h200_record(monkeypatch):
    """Where MLA's K/V loop bounds lean (B=32: every SM busy), the model with the loop times of
    ``gpus.LOOP_US`` and ``gluon.GLUON_LOOP_US`` gives the H200 records' times of what runs within
    0.9-1.2x (16 heads in 16-row blocks of 64 keys; 128 heads at 16 bits on the Gluon kernel, the
    sixth record's ``lean-gluon``; 128 heads of e4m3 in 128-row blocks of two head units, the
    third record's ``lean-cols128``, whose loop converted e4m3 on the conversion unit: modelled
    here without ``gpus.E4M3_CONVERSION_CHANGE``); these are 1.19x (16 heads, 16 bits, 32k) to 13x
    (128 heads, e4m3, 4k) the time of their bytes at the copy bandwidth."""
    from pathlib import Path

    from lean_tp.tools import gpus

    monkeypatch.setattr(gpus, "E4M3_CONVERSION_CHANGE", {})

    rows = {}
    for name in ("2026-11-27-nvidia-h200.json", "2026-11-27-nvidia-h200-5.json"):
        record = json.loads((Path(__file__).parents[1] / "docs/results" / name).read_text())
        rows[name] = {(r["x"], r["impl"]): r["time_us"] for r in record["rows"] if r["sweep"] == "mla"}
    for name, label, impl, heads, context, elem in (
        ("2026-11-27-nvidia-h200.json", "16 heads 16-bit B=32 32k", "lean", 16, 32768, 2),
        ("2026-11-27-nvidia-h200-5.json", "128 heads 16-bit B=32 32k", "lean-gluon", 128, 32768, 2),
        ("2026-11-27-nvidia-h200.json", "128 heads fp8 B=32 4k", "lean-cols128", 128, 4096, 1),
    ):
        problem = Problem((context,) * 32, heads, 1, 576, elem_size=elem, head_dim_v=512)
        modelled = lean_sim_schedule(problem, GPUS["H200"]).time_us
        time = rows[name][(label, impl)]
        assert 0.9 <= time / modelled <= 1.2, (label, time, modelled)
        assert time > 1.15 * 32 * context * 576 * elem / GPUS["H200"].hbm_tbps / 1e6


def test_e4m3_loops_are_their_measurements_less_the_conversion_units_issue_time():
    """sm_90's e4m3 loops were measured converting on the conversion unit; they convert with
    integer and bf16x2 instructions (``attend.e4m3_to_bf16``), so each is modelled as its
    measurement less the issue time that saves at the CUDA guide's rates (16, 64 and 128 a clock
    an SM, 256 threads, 1.755 GHz), no less than the 16-bit loop: TP 8's 16-row blocks of 64 keys
    4.55 -> 3.16 us (216 conversions a thread an iteration for 216 integer and 72 bf16x2
    instructions), 128 heads' head units at the 16-bit loop's 2.58. 16-bit loops are measured."""
    from lean_tp.tools.gpus import E4M3_CONVERSION_CHANGE, loop_us

    h100 = GPUS["H100"]
    saved = 256 * (216 / 16 - 216 / 64 - 72 / 128) / (h100.clock_ghz * 1e3)
    assert abs(loop_us(h100, 576, 1, 16, 64) - (LOOP_US["sm90", 576, 1, 16, 64] - saved)) < 1e-9
    assert (
        3.1 < loop_us(h100, 576, 1, 16, 64) < 3.2 and loop_us(h100, 576, 1, 128, 32) == LOOP_US["sm90", 576, 2, 128, 32]
    )
    assert {key for key in LOOP_US if key[2] == 1} == set(E4M3_CONVERSION_CHANGE)
    for key, us in LOOP_US.items():
        if key[2] == 2:
            assert loop_us(h100, *key[1:]) == us
        else:
            assert LOOP_US[key[:2] + (2,) + key[3:]] <= loop_us(h100, *key[1:]) < us, key


def test_a_routed_e4m3_call_is_modelled_with_its_conversion(monkeypatch):
    """Where an e4m3 entry routes DP attention to the Gluon kernel (none does yet; set here), the
    call is modelled as that kernel with each 64-key iteration its conversion's issue time longer:
    2.7 + 256 x (288 / 64 + 72 / 128) clocks at 1.755 GHz = 3.44 us, about 1.27x the 16-bit call
    where the loop is the time (B=32, 32k), and faster than the Triton kernel's e4m3 head units
    (two 32-key iterations of 2.58 us for the same share)."""
    import dataclasses

    from lean_tp.ops.decode_attention.tuning import TUNING_TABLE
    from lean_tp.tools.simulate.gluon import gluon_loop_us, routes_to_gluon

    h100 = GPUS["H100"]
    dp16 = Problem((32768,) * 32, 128, 1, 576, head_dim_v=512)
    dp8 = dataclasses.replace(dp16, elem_size=1)
    on_triton = lean_sim_schedule(dp8, h100).time_us
    entry = ("sm90", 576, 1)
    monkeypatch.setitem(TUNING_TABLE, entry, dataclasses.replace(TUNING_TABLE[entry], gluon_rows=128))
    assert routes_to_gluon(dp8, lean_variant(dp8, h100))
    assert abs(gluon_loop_us(h100, 1) - (2.7 + 256 * (288 / 64 + 72 / 128) / 1755)) < 1e-9
    t16, t8 = lean_sim_schedule(dp16, h100).time_us, lean_sim_schedule(dp8, h100).time_us
    assert 1.2 < t8 / t16 < 1.32 and t8 < on_triton / 1.3, (t16, t8, on_triton)


def test_the_gluon_route_is_modelled_as_its_kernel():
    """DP attention's 128 heads at 16 bits on sm_90 (and Kimi-K2's 64, of 1 or 2 tokens) run on the
    Gluon kernel (``gluon_takes``, the cache in 64-row pages) and are modelled as it: one program an
    SM in whole lanes, the merge a launch of its own, one sequence's output split over at most
    MAX_CONTRIBUTORS programs. e4m3, 16 heads of 4 tokens (64 rows, heads not in blocks of 64), the
    A100 and the B200 keep the Triton kernel's model."""
    import dataclasses

    from lean_tp.tools.simulate.gluon import routes_to_gluon

    dp = Problem((32768,) * 32, 128, 1, 576, head_dim_v=512)
    for problem, gpu, routed in (
        (dp, "H100", True),
        (dataclasses.replace(dp, lens=(65536,) * 32, n_heads=64, num_tokens=2), "H200", True),
        (dataclasses.replace(dp, elem_size=1), "H100", False),
        (dataclasses.replace(dp, n_heads=64), "H100", True),
        (dataclasses.replace(dp, n_heads=16, num_tokens=4), "H100", False),
        (dp, "A100", False),
        (dp, "B200", False),
    ):
        assert routes_to_gluon(problem, lean_variant(problem, GPUS[gpu])) is routed, (problem, gpu)
    busy, one = (
        lean_sim_schedule(dp, GPUS["H100"]),
        lean_sim_schedule(dataclasses.replace(dp, lens=(4096,)), GPUS["H100"]),
    )
    assert busy.units == 132 and busy.merge_us >= GPUS["H100"].launch_gap_us and busy.chain <= 4
    assert one.splits == 2 and one.chain == MAX_CONTRIBUTORS and one.merge_us > busy.merge_us


def test_mla_merge_slices_are_shared_by_the_waiting_contributors(monkeypatch):
    """DeepSeek-V3's TP-8 rank (16 heads) at B=1, 4k: one output over the grid, its 16 x 512
    partials merged in 8 column slices. The contributors with no tiles left wait for their group's
    merge and take slices beside its last arriver, so each level costs about one slice's round
    trips, not one program's chain of them; with no wait (``merge_polls`` 0, the benchmark's
    ``lean-merge-alone`` reads once) the last arrivers merge every slice alone, several times as
    long."""
    problem = Problem((4096,), 16, 1, 576, head_dim_v=512)
    shared = lean_sim_schedule(problem, H100)
    entry = TUNING_TABLE[("sm90", 576, 2)]
    monkeypatch.setitem(TUNING_TABLE, ("sm90", 576, 2), dataclasses.replace(entry, merge_polls=0))
    alone = lean_sim_schedule(problem, H100)
    assert shared.splits == alone.splits == 1 and shared.chain == alone.chain > MERGE_FANIN
    assert 0 < shared.merge_us < 0.4 * alone.merge_us and shared.merge_us < 3.0
    assert shared.merge_bytes < alone.merge_bytes / 4
