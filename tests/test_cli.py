"""Every entry point answers a user's mistake with one line and exit status 2, before any work.

Each case calls the entry point's ``main(argv)`` in this process (validation only, so the whole
table runs in seconds) and asserts: ``SystemExit(2)``, exactly one line on stderr, that line names
the flag with "expected ..., got ...", and nothing on stdout. A few cases also run as a script and
as a module, as a user would, to see that no traceback escapes there either.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lean_tp import cli

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "scripts")]  # examples/ is on it already (conftest)
ENTRY_POINTS = {
    "demo": "examples/decode_attention_demo.py",
    "decode_tp": "examples/decode_tp.py",
    "compile_hf": "examples/compile_hf.py",
    "deepspeed": "examples/deepspeed_inference.py",
    "vllm": "examples/vllm_generate.py",
    "bench": "benchmarks/bench_decode.py",
    "results": "benchmarks/results.py",
    "gpu_check": "scripts/gpu_check.py",
    "sanitizer": "scripts/sanitizer_case.py",
    "profile_case": "scripts/profile_case.py",
    "simulate": "lean_tp/tools/simulate/cli.py",
    "kernel_report": "lean_tp/tools/kernel_report/cli.py",
}


def entry_point(name: str):
    """The entry point's module: scripts import by file name (examples/, benchmarks/ and scripts/
    are on sys.path), the package's by module path."""
    path = ENTRY_POINTS[name].removesuffix(".py")
    return importlib.import_module(path.replace("/", ".") if path.startswith("lean_tp/") else Path(path).name)


NOT_DIR, NOT_FILE = "/nonexistent/dir", "/nonexistent/file.json"
# (entry point, argv, flag the one line must name). Zero, negative, non-numeric, too large and
# missing-path variants of every numeric and path flag, and the rules across flags.
FLAG_CASES = [
    *[
        ("demo", [f, v], f)
        for f in ("--batch", "--heads", "--kv-heads", "--head-dim", "--max-len")
        for v in ("0", "-1", "x", "99999999")
    ],
    ("demo", ["--seed", "-1"], "--seed"),
    ("demo", ["--device", "tpu"], "--device"),
    ("demo", ["--device", "cuda:7"], "--device"),
    ("demo", ["--dtype", "fp64"], "--dtype"),
    ("demo", ["--heads", "5", "--kv-heads", "2"], "--heads"),
    ("demo", ["--batch", "64", "--max-len", "16000000"], "--max-len"),
    *[("decode_tp", [f, v], f) for f in ("--batch", "--gen") for v in ("0", "-1", "x", "99999999999")],
    ("decode_tp", ["--prompt-len", "0"], "--prompt-len"),
    ("decode_tp", ["--prompt-len", "x,4"], "--prompt-len"),
    ("decode_tp", ["--prompt-len", "5000"], "--prompt-len"),
    ("decode_tp", ["--prompt-len", "4,5", "--batch", "3"], "--prompt-len"),
    ("decode_tp", ["--checkpoint", NOT_DIR], "--checkpoint"),
    ("decode_tp", ["--checkpoint", str(ROOT / "docs")], "--checkpoint"),  # a directory without config.json
    *[("decode_tp", ["--timeout", v], "--timeout") for v in ("0", "-1", "x", "nan", "inf")],
    ("decode_tp", ["--seed", "-3"], "--seed"),
    ("decode_tp", ["--model", "gpt-5"], "--model"),
    ("decode_tp", ["--device", "tpu"], "--device"),
    *([("decode_tp", ["--device", "cuda"], "--device")] if not torch.cuda.is_available() else []),
    ("decode_tp", ["--dtype", "float64x"], "--dtype"),
    ("decode_tp", ["--kv-dtype", "fp8"], "--dtype"),
    ("decode_tp", ["--kv-dtype", "int4"], "--kv-dtype"),
    ("decode_tp", ["--attention", "flash"], "--attention"),
    *[("decode_tp", ["--cp", v], "--cp") for v in ("0", "2", "1,x", "2048")],  # one process: only --cp 1 divides it
    *[("compile_hf", [f, v], f) for f in ("--batch", "--gen") for v in ("0", "-1", "x", "99999999999")],
    ("compile_hf", ["--prompt-len", "5000"], "--prompt-len"),
    ("compile_hf", ["--prompt-len", "1,2", "--batch", "3"], "--prompt-len"),
    ("compile_hf", ["--checkpoint", NOT_DIR], "--checkpoint"),
    ("compile_hf", ["--dtype", "float64x"], "--dtype"),
    ("compile_hf", ["--device", "tpu"], "--device"),
    ("compile_hf", ["--config", "nope"], "--config"),
    ("compile_hf", ["--seed", "x"], "--seed"),
    *[("deepspeed", [f, v], f) for f in ("--batch", "--gen") for v in ("0", "-1", "x", "99999999999")],
    ("deepspeed", ["--prompt-len", "-4"], "--prompt-len"),
    ("deepspeed", ["--prompt-len", "5000"], "--prompt-len"),
    ("deepspeed", ["--checkpoint", NOT_DIR], "--checkpoint"),
    ("deepspeed", ["--dtype", "notatype"], "--dtype"),
    *[("vllm", [f, v], f) for f in ("--batch", "--gen", "--prompt-len") for v in ("0", "-1", "x", "99999999999")],
    ("vllm", ["--dtype", "float64"], "--dtype"),
    *[("bench", ["--dry", "--reps", v], "--reps") for v in ("0", "-1", "x", "99999999")],
    ("bench", ["--dry", "--sweeps", "nope"], "--sweeps"),
    ("bench", ["--dry", "--dtypes", "fp32"], "--dtypes"),
    ("bench", ["--dry", "--peers", "vllm"], "--peers"),
    ("bench", ["--dry", "--out", "/proc/lean_tp_out"], "--out"),
    ("results", ["--results", NOT_DIR], "--results"),
    ("results", ["--markdown", NOT_FILE], "--markdown"),
    *[("gpu_check", ["--budget", v], "--budget") for v in ("0", "-1", "x", "1e9")],
    ("gpu_check", ["--groups", "nope"], "--groups"),
    ("gpu_check", ["--out", "/proc/lean_tp_out"], "--out"),
    ("sanitizer", ["--seed", "-1"], "--seed"),
    *[("profile_case", [f, "0"], f) for f in ("--heads", "--batch", "--context", "--tokens", "--page", "--reps")],
    ("profile_case", ["--cache", "fp16"], "--cache"),
    *[
        ("profile_case", ["--override", v], "--override")
        for v in ("nope=3", "block_n", "block_n=x", "reason=3", "block_n=None")
    ],
    *[
        ("simulate", [f, v], f)
        for f in ("--batch", "--heads", "--kv-heads", "--tp", "--head-dim", "--programs-per-sm")
        for v in ("0", "-1", "x", "99999999")
    ],
    *[("simulate", ["--lens", v], "--lens") for v in ("100,-5", "x", "99999999999", "")],
    *[("simulate", ["--capacity", v], "--capacity") for v in ("-1", "x", "99999999999")],
    ("simulate", ["--capacity", "5", "--lens", "100"], "--capacity"),
    ("simulate", ["--tp", "3", "--heads", "64"], "--tp"),
    ("simulate", ["--heads", "6", "--kv-heads", "4"], "--heads"),
    ("simulate", ["--head-dim", "12"], "--head-dim"),
    ("simulate", ["--gpu", "B300"], "--gpu"),
    ("simulate", ["--model", "gpt-5"], "--model"),
    ("simulate", ["--plot", "/nonexistent/x.png"], "--plot"),
    ("simulate", ["--plot", "-"], "--plot"),
    ("simulate", ["--json", NOT_FILE], "--json"),
    ("simulate", ["--plot", "/proc/lean_tp.png"], "--plot"),  # a directory no one can write, root included
    ("simulate", ["--json", "/proc/lean_tp.json"], "--json"),
    ("simulate", ["--batch", "3", "--lens", "10,20"], "--batch"),
    ("simulate", ["--tp-sweep", "--cp-sweep"], "--cp-sweep"),
    ("simulate", ["--paper", "--lens", "100"], "--lens"),
    ("simulate", ["--cp-sweep", "--tp", "4"], "--tp"),
    ("simulate", ["--model", "llama-3-8b", "--heads", "8"], "--model"),
    *[("kernel_report", ["--workers", v], "--workers") for v in ("0", "-1", "x", "99999")],
    ("kernel_report", ["--set", "nope=1"], "--set"),
    ("kernel_report", ["--set", "block_n=x"], "--set"),
    ("kernel_report", ["--only", "nope=1"], "--only"),
    ("kernel_report", ["--only", "arch"], "--only"),
]


def _one_line_error(name: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        entry_point(name).main(argv)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and not out, (exit_info.value.code, out, err)
    return lines[0]


@pytest.mark.parametrize("name,argv,flag", FLAG_CASES, ids=[f"{n}-{' '.join(a)}" for n, a, _ in FLAG_CASES])
def test_a_bad_flag_gives_one_line_naming_it(name, argv, flag, capsys, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    line = _one_line_error(name, argv, capsys)
    assert f"error: argument {flag}: expected " in line and ", got " in line, line


@pytest.mark.parametrize(
    "name,argv,world,message",
    [
        ("decode_tp", [], "3", "argument --model: cannot shard attention: expected n_heads divisible by world_size"),
        ("decode_tp", ["--model", "phi-3-medium"], "4", "argument --model: cannot shard attention"),
        ("decode_tp", ["--cp", "1,3"], "4", "argument --cp: expected divisors of the world size 4, got '1,3'"),
        ("decode_tp", ["--cp", "2", "--attention", "sdpa"], "4", "argument --attention: expected lean with --cp > 1"),
        (
            "decode_tp",
            ["--cp", "4", "--model", "llama-3-8b"],
            "12",
            "argument --model: cannot shard attention: "
            "expected n_heads divisible by world_size, got n_heads=32, n_kv_heads=8, world_size=3",
        ),
        (
            "deepspeed",
            [],
            "4",
            "world size 4 (the launcher's --nproc_per_node or --num_gpus): tp_size: expected at most",
        ),
    ],
)
def test_a_world_size_the_model_cannot_use_gives_one_line(name, argv, world, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert message in _one_line_error(name, argv, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tools run on a GPU; here they must say they need one")
@pytest.mark.parametrize("name", ["gpu_check", "sanitizer", "profile_case"])
def test_gpu_tools_without_a_gpu_say_so_in_one_line(name, capsys):
    assert "no CUDA device visible" in _one_line_error(name, [], capsys)


def test_bench_without_a_gpu_needs_dry(capsys):
    if torch.cuda.is_available():
        pytest.skip("with a GPU the benchmark runs")
    assert "argument --dry: expected --dry on a machine without a CUDA device" in _one_line_error("bench", [], capsys)


def test_other_ranks_exit_2_without_printing(capsys, monkeypatch):
    """Under torchrun every rank parses the same flags: only rank 0 prints the line."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    with pytest.raises(SystemExit) as exit_info:
        entry_point("decode_tp").main(["--gen", "0"])
    assert exit_info.value.code == 2 and capsys.readouterr() == ("", "")


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_help_lists_the_flags(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        entry_point(name).main(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "path,argv",
    [
        ("examples/decode_attention_demo.py", ["--batch", "0"]),
        ("benchmarks/bench_decode.py", ["--dry", "--sweeps", "nope"]),  # sets TRITON_INTERPRET before its imports
    ],
)
def test_as_a_script_no_traceback_escapes(path, argv):
    proc = subprocess.run(
        [sys.executable, str(ROOT / path), *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "expected" in proc.stderr, proc.stderr


def test_module_entry_points_fail_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "lean_tp.tools.simulate", "--lens", "100,-5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "argument --lens" in proc.stderr, proc.stderr


def test_progress_in_a_log_is_plain_lines(capsys):
    import io

    log = io.StringIO()
    for _ in cli.progress(range(3), desc="work", unit="step", stream=log):
        pass
    lines = log.getvalue().splitlines()
    assert (
        "\r" not in log.getvalue() and lines[0].startswith("work: 0/3 step") and lines[-1].startswith("work: 3/3 step")
    )


@pytest.mark.parametrize(
    "make,text,ok",
    [
        (lambda: cli.integer(1, 8), "8", True),
        (lambda: cli.integer(1, 8), "9", False),
        (lambda: cli.integer(1), "1.5", False),
        (lambda: cli.number(0, strict_lo=True), "0", False),
        (lambda: cli.number(0, strict_lo=True), "1e-9", True),
        (lambda: cli.number(), "nan", False),
        (lambda: cli.integer_list(0), "0,3,5", True),
        (lambda: cli.integer_list(0), "3,,5", False),
        (lambda: cli.choice("a", "b"), "b", True),
        (lambda: cli.choice("a", "b"), "B", False),
    ],
)
def test_flag_types(make, text, ok):
    import argparse

    if ok:
        make()(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected .*, got {text!r}"):
            make()(text)


def test_a_checkpoint_without_weights_gives_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "config.json").write_text("{}")
    line = _one_line_error("decode_tp", ["--checkpoint", str(tmp_path)], capsys)
    assert "argument --checkpoint: expected a Hugging Face model directory with a config.json and *.safetensors" in line


def test_a_model_larger_than_memory_gives_one_line_before_building(capsys, monkeypatch):
    """Weights and KV caches of every rank sharing the host, checked against its memory at parse time."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(cli, "memory_bytes", lambda dev: 23 << 30)
    line = _one_line_error("decode_tp", ["--model", "phi-3-medium", "--device", "cpu"], capsys)
    assert "argument --model: expected weights and KV caches within 85% of the cpu memory (23.0 GiB), got " in line
    assert "for 2 ranks on cpu" in line
    decode_tp = entry_point("decode_tp")
    # tiny fits anywhere: the estimate is the model's real size, within its small extras (norms, RoPE tables)
    tiny = decode_tp.CONFIGS["tiny"]
    params = sum(p.numel() for p in decode_tp.build_model(tiny).parameters())
    assert (
        abs(decode_tp.rank_bytes(tiny, 1, 1, 1, 1, 1, 1) - 2 * tiny.n_layers * tiny.n_kv_heads * tiny.head_dim - params)
        < 0.01 * params
    )


def test_vllm_generate_without_vllm_gives_one_line(capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert "vLLM: expected it installed beside lean_tp" in _one_line_error("vllm", [], capsys)
