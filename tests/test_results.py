"""Results records (benchmarks/results.py) and scripts/gpu_check.py, on CPU: the record format, the
tables generated from records, and the GPU check's no-GPU mode and record writer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "scripts")]
import gpu_check  # noqa: E402
import results  # noqa: E402

# Recorded by `python benchmarks/bench_decode.py --dry --sweeps context gqa` (CPU, interpreter).
SAMPLE = ROOT / "tests" / "data" / "results-sample.json"


@pytest.fixture
def sample() -> dict:
    return json.loads(SAMPLE.read_text())


def test_sample_is_a_valid_record(sample):
    assert results.validate(sample) is sample
    assert {r["impl"] for r in sample["rows"]} == {"lean", "flash-decoding", "sdpa", "flex"}


@pytest.mark.parametrize("key", ["device", "copy_bandwidth_gbps", "rows"])
def test_record_without_a_key_is_rejected_naming_it(sample, key):
    del sample[key]
    with pytest.raises(ValueError, match=f"missing \\['{key}'\\]"):
        results.validate(sample)


def test_row_without_a_key_is_rejected_naming_it(sample):
    del sample["rows"][3]["max_abs_err_vs_lean"]
    with pytest.raises(ValueError, match=r"rows\[3\].*missing \['max_abs_err_vs_lean'\]"):
        results.validate(sample)


def test_file_name_is_date_and_device_slug(sample):
    sample |= dict(device="NVIDIA H100 80GB HBM3", date="2026-11-22")
    assert results.file_name(sample) == "2026-11-22-nvidia-h100-80gb-hbm3.json"


def test_table_has_one_line_per_shape_with_every_implementation(sample):
    text = results.table(sample)
    shapes = {(r["sweep"], r["x"]) for r in sample["rows"]}
    body = [line for line in text.splitlines() if line.startswith(("| context", "| gqa"))]
    assert len(body) == len(shapes) == 3
    for r in sample["rows"]:
        assert f"{r['time_us']:.1f}, {100 * r['fraction_of_copy']:.0f}%" in text
    assert not re.search(
        r"\d\.\d\dx", text
    )  # a CPU dry run gets no speedups: interpreter and native times do not compare


def test_gpu_record_shows_lean_speedup(sample):
    sample |= dict(device="NVIDIA H100 80GB HBM3", sm_count=132)
    lean = next(r for r in sample["rows"] if r["impl"] == "lean")
    peer = next(r for r in sample["rows"] if r["impl"] == "sdpa" and r["x"] == lean["x"])
    assert f"{peer['time_us'] / lean['time_us']:.2f}x" in results.table(sample)


def test_update_replaces_only_the_generated_section(sample, tmp_path):
    before, after = "# Title\n\nkept\n\n", "\n\nalso kept\n"
    md = before + results.generated_section([]) + after
    new = results.update(md, [sample])
    assert new.startswith(before) and new.endswith(after) and results.table(sample) in new
    assert results.update(new, [sample]) == new
    with pytest.raises(ValueError, match="expected a section"):
        results.update("no markers", [sample])


def test_docs_benchmarks_tables_are_current():
    assert results.main(["--check"]) == 0, "run python benchmarks/results.py"


def test_gpu_check_without_gpu_says_so_and_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env | {"CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_check_steps_see_the_checkout_without_an_install(tmp_path):
    step = gpu_check.run(
        "probe", [sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"], str(tmp_path), 60
    )
    assert step["status"] == "PASS"
    assert str(ROOT) in (tmp_path / "probe.log").read_text().split(os.pathsep)[0]


def test_missing_optional_packages_are_reported_not_installed(monkeypatch):
    monkeypatch.setitem(gpu_check.PACKAGES, "no_such_package_here", "no-such-package-here")
    found = gpu_check.packages()
    assert found["no_such_package_here"] == "not installed" and found["pytest"] != "not installed"


def test_gpu_check_record_merges_benchmark_and_steps(sample, tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(sample))
    (tmp_path / "decode_tp 8b eager lean.log").write_text("noise\ndecode: 12.3 ms/step\n")
    (tmp_path / "mla decode gluon.log").write_text(
        "noise\nsm_90, bf16 pool: 193 registers\nsm_90, e4m3 pool: 200 registers\n"
        "1 sequence x 128 heads x 4096 keys, mla_decode_gluon: device time a call 20.0 us (k 20.0 us)\n"
    )
    (tmp_path / "mla decode seesaw.log").write_text(
        "noise\nragged lengths: max |out - float64| 4.0e-03\n66 x 128: seesaw 900.0 us (1.76 us a 64-key iteration)\n"
    )
    steps = [dict(name="pytest tests/gpu", status="PASS", seconds=61.0)]
    path = gpu_check.write_record(str(tmp_path), {}, steps, {"flashinfer": "not installed"})
    record = results.validate(json.loads(Path(path).read_text()))
    assert Path(path).name == results.file_name(sample)
    assert record["rows"] == sample["rows"] and record["steps"] == steps
    assert record["loops"] == {
        "decode_tp llama-3-8b eager lean": "decode: 12.3 ms/step",
        "mla decode gluon": "sm_90, bf16 pool: 193 registers | sm_90, e4m3 pool: 200 registers | 1 sequence x 128 "
        "heads x 4096 keys, mla_decode_gluon: device time a call 20.0 us (k 20.0 us)",
        "mla decode seesaw": "ragged lengths: max |out - float64| 4.0e-03 | 66 x 128: seesaw 900.0 us (1.76 us a 64-key iteration)",
    }
    assert "| pytest tests/gpu | PASS | 61 |" in results.table(record)


def test_planned_steps_run_in_order_of_value():
    names = [name for name, _, _ in gpu_check.planned_steps(list(gpu_check.GROUPS), "python", "out")]
    assert names[0] == "pytest tests/gpu"
    assert names[1:5] == ["mla decode gluon tests", "mla decode gluon", "mla decode seesaw", "bench_decode --quick"]
    commands = {name: cmd for name, cmd, _ in gpu_check.planned_steps(list(gpu_check.GROUPS), "python", "out")}
    assert gpu_check.GLUON_TEST in commands["mla decode gluon tests"]  # once: the tests step leaves it out
    assert commands["pytest tests/gpu"][-2:] == ["--ignore", gpu_check.GLUON_TEST]
    alone = gpu_check.planned_steps(["tests"], "python", "out")[0][1]
    assert "--ignore" not in alone
    assert names[5:7] == ["ncu mla dp128", "ncu mla dp128 sass"]  # the MLA loop's stall reasons
    assert [n for n, _, _ in gpu_check.planned_steps(["sanitizer"], "python", "out")] == [
        f"compute-sanitizer {t}" for t in ("memcheck", "racecheck", "synccheck")
    ]
    # The CUDA tests leave the other groups time, or take the whole budget when run alone.
    (tests,) = gpu_check.planned_steps(["tests"], "python", "out")
    assert gpu_check.planned_steps(["tests", "bench"], "python", "out")[0][2] == 300 < tests[2]


def test_a_step_whose_tool_is_missing_is_an_error_not_a_crash(tmp_path):
    step = gpu_check.run("ncu mla dp128", ["/nonexistent/ncu", "--version"], str(tmp_path), 10)
    assert step["status"] == "ERROR (FileNotFoundError)"
    assert "/nonexistent/ncu" in (tmp_path / "ncu mla dp128.log").read_text()
