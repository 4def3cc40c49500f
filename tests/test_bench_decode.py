"""The benchmark's plumbing, on CPU: the dry run (tiny shapes, Triton interpreter)
writes the CSV, the environment record and the plots, and reports missing peers instead of failing."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.xdist_group("bench_dry_run")  # one worker: the module's dry run runs once
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_decode  # noqa: E402
import results  # noqa: E402
from peers import MLA_ABLATIONS, PEERS, Peer, varlen_args  # noqa: E402

from lean_tp.ops.decode_attention.naive import decode_attention_ref  # noqa: E402


def _dry_bench(out: Path, *args: str) -> str:
    """``bench_decode.py --dry --out OUT ARGS`` in a process of its own; its stdout."""
    argv = [sys.executable, str(BENCH / "bench_decode.py"), "--dry", "--out", str(out), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dry")
    return out, _dry_bench(out, "--sweeps", "gqa")


def test_dry_run_times_every_available_peer(dry_run):
    out, stdout = dry_run
    rows = list(csv.DictReader(open(out / "bench_decode.csv")))
    assert [(r["sweep"], r["x"]) for r in rows] == [("gqa", "4")]  # one shape: each one compiles flex anew
    for row in rows:
        for peer in ("lean", "flash-decoding", "sdpa", "flex"):
            assert float(row[f"{peer}_us"]) > 0 and float(row[f"{peer}_pct_copy"]) > 0, (peer, row)
        # Like with like: both Triton kernels run in the interpreter; the native CPU peers are not compared.
        assert float(row["speedup_vs_flash-decoding"]) > 0
        assert "speedup_vs_sdpa" not in row or row["speedup_vs_sdpa"] == ""
        assert "speedup_vs_flex" not in row or row["speedup_vs_flex"] == ""
        for peer in ("flash-attn", "flashinfer"):
            assert f"{peer}: not installed" in row["notes"] or f"{peer}: needs CUDA" in row["notes"]
    assert "say nothing about GPU speed" in stdout
    assert "lean's speedup (peer time / lean time):" in stdout and "x vs flash-decoding" in stdout


def test_lean_invariant_runs_when_named(tmp_path, dry_run):
    """``lean-invariant`` (lean's batch-invariant mode) is opt-in: the default run leaves it out,
    and named in --peers it is timed beside lean, its output within the check of lean's."""
    default_row = next(csv.DictReader(open(dry_run[0] / "bench_decode.csv")))
    assert PEERS["lean-invariant"].opt_in and "lean-invariant_us" not in default_row
    _dry_bench(tmp_path, "--sweeps", "gqa", "--peers", "lean", "lean-invariant")
    (row,) = list(csv.DictReader(open(tmp_path / "bench_decode.csv")))
    assert float(row["lean-invariant_us"]) > 0 and float(row["speedup_vs_lean-invariant"]) > 0, row
    assert "lean-invariant" not in row["notes"], row["notes"]


def test_lean_invariant_in_16_row_blocks_runs_when_named(tmp_path, dry_run):
    """``lean-invariant-rows16`` (the invariant mode with its entry's 16-row blocks, against which
    DP attention's wide blocks are modelled) is opt-in and MLA's: timed when named, its output
    within the check of lean's."""
    default_row = next(csv.DictReader(open(dry_run[0] / "bench_decode.csv")))
    assert PEERS["lean-invariant-rows16"].opt_in and "lean-invariant-rows16_us" not in default_row
    _dry_bench(tmp_path, "--sweeps", "mla", "--dtypes", "fp16", "--peers", "lean", "lean-invariant-rows16")
    for row in csv.DictReader(open(tmp_path / "bench_decode.csv")):
        assert float(row["lean-invariant-rows16_us"]) > 0 and "lean-invariant-rows16" not in row["notes"], row


def test_dry_run_times_mla_against_the_mla_peers_it_has(tmp_path):
    """The MLA sweep's plumbing (fp16: the MLA kernel takes a 16-bit q): lean decodes a latent cache
    of 64-row pages with V its first 512 dims, for one query token and for two (MTP's verification,
    q (B, 2, H, 576)); the standard-attention peers do not take MLA, and the MLA peers are skipped,
    each with why (all three need CUDA; vLLM disables Triton off the GPU)."""
    _dry_bench(tmp_path, "--sweeps", "mla", "--dtypes", "fp16")
    one, two = list(csv.DictReader(open(tmp_path / "bench_decode.csv")))
    assert [(row["sweep"], row["x"], row["d"]) for row in (one, two)] == [
        ("mla", "TP 8", "576"),
        ("mla", "TP 8 Tq 2", "576"),
    ]
    for row in (one, two):
        assert float(row["lean_us"]) > 0 and float(row["lean_pct_copy"]) > 0
        for peer in ("flash-decoding", "sdpa", "flex"):
            assert f"{peer}: not benchmarked with mla" in row["notes"]
        for peer in ("flashmla", "flashinfer-mla", "vllm-triton-mla"):
            assert f"{peer}: not installed" in row["notes"] or f"{peer}: needs CUDA" in row["notes"]
        for ablation in MLA_ABLATIONS:  # lean with its entry changed: timed, and within the check of lean's output
            assert float(row[f"{ablation}_us"]) > 0 and ablation not in row["notes"]
    # q and out of two tokens move twice one token's rows, beside the same keys.
    assert float(two["lean_gbps"]) * float(two["lean_us"]) > float(one["lean_gbps"]) * float(one["lean_us"])


def test_dry_run_records_results_and_plots(dry_run):
    out, _ = dry_run
    record = results.validate(json.load(open(out / "results.json")))
    assert record["device"] == "cpu (dry run)" and record["copy_bandwidth_gbps"] > 0
    rows = list(csv.DictReader(open(out / "bench_decode.csv")))
    # One record row per (CSV row, implementation timed), with the CSV's time and the shape's metadata.
    assert len(record["rows"]) == sum(1 for row in rows for k in row if k.endswith("_us") and row[k])
    for r in record["rows"]:
        assert r["layout"] == "contiguous" and r["time_us"] > 0 and 0 < r["fraction_of_copy"]
        assert r["gbps"] == pytest.approx(r["fraction_of_copy"] * record["copy_bandwidth_gbps"], rel=0.02)
        assert (r["max_abs_err_vs_lean"] is None) == (r["impl"] == "lean")
        if r["impl"] != "lean":
            assert 0 <= r["max_abs_err_vs_lean"] <= bench_decode.CHECK_ATOL[torch.float32]
    assert {"flash-attn: not installed", "flash-attn: needs CUDA"} & {n["note"] for n in record["notes"]}
    for name in ("speedup.png", "bandwidth.png"):
        assert (out / name).stat().st_size > 10_000


def test_ragged_lengths_hit_the_ratio():
    for ratio in (0.1, 0.2, 0.4, 0.6, 0.8, 1.0):
        lens = bench_decode.ragged_lens(16, 32768, ratio)
        assert max(lens) == 32768 and len(lens) == 16
        assert sum(lens) / len(lens) / max(lens) == pytest.approx(ratio, abs=0.01)


def test_quick_preset_covers_every_sweep():
    quick, full = bench_decode.sweeps(quick=True, dry=False), bench_decode.sweeps(quick=False, dry=False)
    names = set(bench_decode.SWEEPS)  # the names --sweeps takes
    assert {s.sweep for s in quick} == names == {s.sweep for s in full}
    assert len(quick) < len(full)
    assert max(max(s.lens) for s in full) == 1 << 19  # 512k where memory allows
    assert {s.x for s in full if s.sweep == "models"} == {"llama-3-8b", "llama-3-70b", "mistral-7b", "phi-3-medium"}
    assert {s.features for s in full if s.sweep in ("kv", "window")} == {
        frozenset(),
        frozenset({"fp8"}),
        frozenset({"window"}),
    }


def test_missing_or_failing_peer_is_reported_not_fatal(monkeypatch):
    def broken(_inputs):
        raise RuntimeError("boom")

    monkeypatch.setitem(PEERS, "ghost", Peer("ghost", broken, needs="no_such_module_here"))
    monkeypatch.setitem(PEERS, "broken", Peer("broken", broken))
    shape = bench_decode.Shape("context", "32", (32,), 2, 2, 64)
    timer = bench_decode.Timer(torch.device("cpu"), 2)
    row = bench_decode.bench_shape(
        shape, torch.float32, torch.device("cpu"), ["lean", "ghost", "broken"], timer, 1e10, 0
    )
    assert "ghost: not installed" in row["notes"] and "broken: error RuntimeError: boom" in row["notes"]
    assert row["lean_us"] > 0 and "speedup_vs_broken" not in row


def test_a_run_cut_short_keeps_the_shapes_it_finished(monkeypatch, tmp_path):
    """The CSV and the results record are written after every shape: a run killed during its second
    shape (a GPU check step's timeout) leaves the first one's row in both."""
    finished = []

    def bench_shape(shape, *args):
        if finished:
            raise KeyboardInterrupt  # stands in for the kill: nothing after this runs
        finished.append(shape)
        return dict(sweep=shape.sweep, x=shape.x, dtype="float32", batch=1, hq=4, hkv=2, d=64,
                    layout="contiguous", max_len=64, mean_len=64, lean_us=1.0, lean_gbps=1.0,
                    lean_pct_copy=10.0, notes="")  # fmt: skip

    monkeypatch.setattr(bench_decode, "bench_shape", bench_shape)
    with pytest.raises(KeyboardInterrupt):
        bench_decode.main(["--dry", "--sweeps", "context", "--out", str(tmp_path)])
    (row,) = list(csv.DictReader(open(tmp_path / "bench_decode.csv")))
    assert (row["x"], row["lean_us"]) == (finished[0].x, "1.0")
    (timed,) = results.validate(json.load(open(tmp_path / "results.json")))["rows"]
    assert (timed["x"], timed["impl"], timed["time_us"]) == (finished[0].x, "lean", 1.0)


def test_moved_bytes_counts_lengths_not_capacity():
    shape = bench_decode.Shape("ragged", "x", (100, 10), 8, 2, 64)
    assert bench_decode.moved_bytes(shape, torch.bfloat16) == (2 * 110 * 2 * 64 + 2 * 2 * 8 * 64) * 2


def _varlen_ref(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=None, enable_gqa=False):
    """float64 meaning of varlen_attn's arguments for one query per sequence: sequence b's keys are
    ``key[cu_seq_k[b] : cu_seq_k[b] + n_b]``, n_b from ``seqused_k`` or the next offset."""
    assert max_q == 1 and torch.equal(cu_seq_q, torch.arange(len(cu_seq_k), dtype=torch.int32))
    outs = []
    for b in range(len(cu_seq_k) - 1):
        start = int(cu_seq_k[b])
        n = int(seqused_k[b]) if seqused_k is not None else int(cu_seq_k[b + 1]) - start
        assert n <= max_k
        k, v = key[start : start + n].double(), value[start : start + n].double()  # (n, H, D)
        group = query.shape[1] // k.shape[1]
        assert group == 1 or enable_gqa
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", query[b].double(), k) * query.shape[-1] ** -0.5, -1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


@pytest.mark.parametrize("torch_has_seqused_k", [True, False])
def test_varlen_peer_arguments_mean_decode_attention(monkeypatch, torch_has_seqused_k):
    import torch.nn.attention.varlen as varlen

    def torch_2_11(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        """Packed keys, no GQA."""

    def torch_2_13(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        """Adds seqused_k, block_table and enable_gqa."""

    monkeypatch.setattr(varlen, "varlen_attn", torch_2_13 if torch_has_seqused_k else torch_2_11)
    torch.manual_seed(0)
    s = bench_decode.make_set(
        bench_decode.Shape("ragged", "x", (37, 1, 64), 8, 2, 64), torch.float32, torch.device("cpu")
    )
    args = varlen_args(s)
    assert ("seqused_k" in args) == torch_has_seqused_k and args["key"].shape[1] == (2 if torch_has_seqused_k else 8)
    ref, _ = decode_attention_ref(**s)
    torch.testing.assert_close(_varlen_ref(**args), ref, atol=1e-5, rtol=1e-5)


def test_paged_shape_runs_lean_on_shuffled_pages_and_skips_unwired_peers():
    """A paged16 shape's input set is lean's paged layout, pages in random order; lean over it
    matches the float64 reference, and peers without paged inputs wired are reported, not run."""
    shape = bench_decode.Shape("layouts", "paged16", (150, 37), 8, 2, 64, layout="paged16")
    s = bench_decode.make_set(shape, torch.float32, torch.device("cpu"))
    assert s["k_cache"].shape == (2 * 10, 16, 2, 64) and s["block_table"].shape == (2, 10)
    assert sorted(s["block_table"].flatten().tolist()) == list(range(20))
    out = PEERS["lean"].prepare(s)()
    ref, _ = decode_attention_ref(**s)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
    timer = bench_decode.Timer(torch.device("cpu"), 1)
    row = bench_decode.bench_shape(shape, torch.float32, torch.device("cpu"), ["lean", "sdpa"], timer, 1e10, 0)
    assert row["lean_us"] > 0 and row["layout"] == "paged16" and "sdpa: not benchmarked with paged" in row["notes"]


def test_flashinfer_pages_hold_each_sequences_keys_in_table_order():
    """What the FlashInfer peer plans over: a paged input set's own pages and table (NHD), or an HND
    copy of a contiguous cache where page p of sequence b, table[b, p], holds keys 16 p .. 16 p + 15."""
    from peers import flashinfer_pages

    paged = bench_decode.make_set(
        bench_decode.Shape("layouts", "p", (40, 33), 4, 2, 64, layout="paged16"), torch.float32, torch.device("cpu")
    )
    k, v, table, kv_layout = flashinfer_pages(paged)
    assert (k, v, table, kv_layout) == (paged["k_cache"], paged["v_cache"], paged["block_table"], "NHD")
    shape = bench_decode.Shape("layouts", "c", (40, 33), 4, 2, 64)
    s = bench_decode.make_set(shape, torch.float32, torch.device("cpu"))
    k, _, table, kv_layout = flashinfer_pages(s)
    assert kv_layout == "HND" and k.shape == (2 * 3, 2, 16, 64)
    for b, n in enumerate(shape.lens):
        keys = torch.cat([k[table[b, p]] for p in range(-(-n // 16))], dim=1)[:, :n]  # (Hkv, n, D)
        torch.testing.assert_close(keys, s["k_cache"][b, :, :n], atol=0, rtol=0)


@pytest.mark.parametrize("tq", [1, 2])
def test_mla_peers_are_given_query_tokens_as_their_apis_take_them(monkeypatch, tq):
    """The MLA peers' wrappers over stand-in modules that record their calls (the packages need
    CUDA): FlashMLA gets q as (B, Tq, H, 576) with ``causal`` for draft tokens and its metadata
    sized Tq x heads; FlashInfer's plan gets Tq rows a request (qo_indptr) and ``causal``, its run
    q as (B x Tq, H, 512 + 64); vLLM's Triton MLA gets each token as a row of its own, its length
    its keys and its request's pages. Each returns out shaped as lean's: (B, [Tq,] H, 512)."""
    import types

    from peers import MLA_RANK

    calls = {}

    def flash_mla_with_kvcache(q, k_cache, table, lens, dv, meta, splits, causal=False):
        calls["flashmla"] = (tuple(q.shape), causal, meta)
        return torch.zeros(*q.shape[:-1], dv), None

    class Wrapper:
        def __init__(self, workspace):
            pass

        def plan(self, qo_indptr, kv_indptr, kv_indices, kv_lens, heads, ckv, kpe, page, causal, scale, *dtypes):
            calls["plan"] = (qo_indptr.tolist(), heads, causal)

        def run(self, q_nope, q_pe, ckv, kpe):
            calls["run"] = (tuple(q_nope.shape), tuple(q_pe.shape))
            return torch.zeros(*q_nope.shape[:-1], MLA_RANK)

    def decode_attention_fwd(q, kv, v, out, lse, table, lens, logits, splits, scale, page, is_mla):
        calls["vllm"] = (tuple(q.shape), lens.tolist(), table.tolist(), tuple(out.shape), is_mla)

    modules = {
        "flash_mla": types.SimpleNamespace(
            flash_mla_with_kvcache=flash_mla_with_kvcache, get_mla_metadata=lambda *a: (a, None)
        ),
        "flashinfer": types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=Wrapper)),
        **{name: types.ModuleType(name) for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops")},
        "vllm.v1.attention.ops.triton_decode_attention": types.SimpleNamespace(
            decode_attention_fwd=decode_attention_fwd
        ),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    lens = (150, 70, 5)
    shape = bench_decode.Shape("mla", "x", lens, 16, 1, 576, layout="paged64", tq=tq)
    s = bench_decode.make_set(shape, torch.bfloat16, torch.device("cpu"))
    lean_shape = (3, *((tq,) if tq > 1 else ()), 16, MLA_RANK)
    assert PEERS["flashmla"].prepare(s)().shape == lean_shape
    (q_shape, causal, meta) = calls["flashmla"]
    assert q_shape == (3, tq, 16, 576) and causal == (tq > 1) and meta[1:] == (tq * 16, 1)
    assert PEERS["flashinfer-mla"].prepare(s)().shape == lean_shape
    assert calls["plan"] == ([0, tq, 2 * tq, 3 * tq], 16, tq > 1)
    assert calls["run"] == ((3 * tq, 16, MLA_RANK), (3 * tq, 16, 64))
    assert PEERS["vllm-triton-mla"].prepare(s)().shape == lean_shape
    q_shape, token_lens, table, out_shape, is_mla = calls["vllm"]
    assert q_shape == (3 * tq, 16, 576) and out_shape == (3 * tq, 16, MLA_RANK) and is_mla
    assert token_lens == [n - tq + 1 + t for n in lens for t in range(tq)]
    assert table == [row for row in s["block_table"].tolist() for _ in range(tq)]
