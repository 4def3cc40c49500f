"""The project's GPU check: CUDA tests, compute-sanitizer, a short benchmark and the decode loops, in one call.

    python scripts/gpu_check.py --out DIR [--groups tests bench profile sanitizer loops] [--budget 480]

Runs from a bare checkout (no install step: the checkout is put on the path of every step) on a
machine that has torch, triton and transformers. Optional packages (DeepSpeed, flash-attn,
FlashInfer) are reported as "not installed" when absent. Every step shares one time budget, so
one call ends within --budget seconds; steps that no longer fit are reported as skipped, and
--groups runs the rest in another call. DIR receives each step's log, the benchmark's CSV and
plots, and ``<date>-<device>.json``: the results record (benchmarks/results.py) with every
step's status, ready to commit as docs/results/. See docs/gpu.md.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

# Single-GPU decode loop: llama-3-8b (random weights, bf16), a ragged batch.
DECODE_TP = [
    "examples/decode_tp.py",
    "--model",
    "llama-3-8b",
    "--batch",
    "8",
    "--gen",
    "128",
    "--prompt-len",
    "256,512,1024,2048,4096,6144,7000,7900",
]
COMPILE_HF = [
    "examples/compile_hf.py",
    "--config",
    "llama-3-8b",
    "--batch",
    "8",
    "--prompt-len",
    "4000",
    "--gen",
    "128",
]
DECODE_TP_VARIANTS = {
    "eager lean": [],
    "eager sdpa": ["--attention", "sdpa"],
    "compiled lean": ["--compile"],
    "compiled sdpa": ["--compile", "--attention", "sdpa"],
}
GROUPS = ("tests", "bench", "profile", "sanitizer", "loops")  # in order of value: a short budget runs the first
TEST_WORKERS = 4  # pytest-xdist workers of the CUDA tests, where it is installed
TEST_TIMEOUT = 120  # seconds a CUDA test case may take, where pytest-timeout is installed
GLUON_TEST = "tests/gpu/test_mla_decode_gluon_cuda.py"  # the bench group's step of its own
MIN_STEP_SECONDS = 30  # a step with less left than this is skipped rather than started and killed
# module name -> distribution name, for the versions reported in the record
PACKAGES = {
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "numpy": "numpy",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "matplotlib": "matplotlib",
    "deepspeed": "deepspeed",
    "flash_attn": "flash-attn",
    "flashinfer": "flashinfer-python",
}


def packages() -> dict[str, str]:
    """Version of each package the steps may use, or "not installed"."""
    found = {}
    for module, dist in PACKAGES.items():
        if importlib.util.find_spec(module) is None:
            found[module] = "not installed"
            continue
        try:
            found[module] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[module] = "installed (version unknown)"
    return found


def planned_steps(groups: list[str], py: str, out: str) -> list[tuple[str, list[str], int]]:
    """(name, command, timeout in seconds) of each step of the chosen groups, in GROUPS order."""
    steps = []
    if "tests" in groups:
        steps.append(
            (
                "pytest tests/gpu",
                [
                    py,
                    "-m",
                    "pytest",
                    "tests/gpu",
                    "-q",
                    "--maxfail=10",
                    "-o",
                    "addopts=-ra",
                    f"--junitxml={out}/gpu.xml",
                    "--durations=20",
                    # The cases are bound by Triton's compiles and float64 references on the host's
                    # cores, not by the GPU; a case that hangs is named by its timeout, not by the step's.
                    *(["-n", str(TEST_WORKERS)] if importlib.util.find_spec("xdist") else []),
                    *(["--timeout", str(TEST_TIMEOUT)] if importlib.util.find_spec("pytest_timeout") else []),
                    # The bench group runs the Gluon kernel's file as a step of its own.
                    *(["--ignore", GLUON_TEST] if "bench" in groups else []),
                ],
                # The whole budget when run alone: the step took over 290 s on 4 and on 8 workers.
                300 if len(groups) > 1 else 600,
            )
        )
    if "bench" in groups:
        # The Gluon MLA kernel (lean_tp.ops.mla_gluon): its CUDA test (ragged lengths, splits, NaN
        # pages, 16-bit and e4m3 pools, and decode_attention's route to it, compiled and in a CUDA
        # graph: 6 kernel compiles and 3 torch.compile), then exact against float64 and timed
        # beside lean (benchmarks/mla_decode_gluon.py).
        gluon_test = [py, "-m", "pytest", "-q", "-o", "addopts=-ra", GLUON_TEST]
        steps.append(("mla decode gluon tests", gluon_test, 180))
        steps.append(("mla decode gluon", [py, "benchmarks/mla_decode_gluon.py"], 180))
        # FlashMLA's seesaw schedule as a probe, not yet run on a GPU: a hang of its barriers costs
        # this step's timeout, not the steps after it.
        steps.append(("mla decode seesaw", [py, "benchmarks/mla_decode_seesaw.py"], 60))
        steps.append(("bench_decode --quick", [py, "benchmarks/bench_decode.py", "--quick", "--out", out], 360))
    if "profile" in groups:
        # The MLA loop's stall reasons by SASS line (docs/gpu.md): one launch under Nsight Compute,
        # then its source page as CSV, which is that step's log.
        ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
        rep = os.path.join(out, "mla_dp128")
        kernel = ["--kernel-name", "decode_attention_fwd_kernel", "--launch-skip", "3", "--launch-count", "1"]
        case = [py, "scripts/profile_case.py", "--reps", "3"]
        steps.append(
            ("ncu mla dp128", [ncu, *kernel, "--set", "full", "--import-source", "yes", "-f", "-o", rep, *case], 180)
        )
        steps.append(
            (
                "ncu mla dp128 sass",
                [ncu, "--import", rep + ".ncu-rep", "--page", "source", "--print-source", "sass", "--csv"],
                120,
            )
        )
    if "sanitizer" in groups:
        sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        for tool in ("memcheck", "racecheck", "synccheck"):
            cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", py, "scripts/sanitizer_case.py"]
            steps.append((f"compute-sanitizer {tool}", cmd, 120))
    if "loops" in groups:
        for label, extra in DECODE_TP_VARIANTS.items():
            steps.append((f"decode_tp 8b {label}", [py, *DECODE_TP, *extra], 180))
        for attention in ("lean", "sdpa"):  # transformers generate(), compiled, static cache, random 8B weights
            steps.append((f"compile_hf 8b {attention}", [py, *COMPILE_HF, "--attention", attention], 240))
    return steps


def run(name: str, cmd: list[str], out_dir: str, timeout: float) -> dict:
    """Run one step with its log in out_dir/<name>.log; returns {name, status, seconds}."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    start = time.time()
    with open(os.path.join(out_dir, name.replace("/", "_") + ".log"), "w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
            status = "PASS" if rc == 0 else f"FAIL (rc={rc})"
        except subprocess.TimeoutExpired:
            status = f"TIMEOUT ({timeout:.0f}s)"
        except OSError as exc:  # a tool the image lacks (ncu, compute-sanitizer)
            log.write(f"{exc}\n")
            status = f"ERROR ({type(exc).__name__})"
    return dict(name=name, status=status, seconds=round(time.time() - start, 1))


def loop_results(out: str) -> dict[str, str]:
    """The figures each decode-loop log printed, by step name."""
    found = {}
    for label in DECODE_TP_VARIANTS:
        log = os.path.join(out, f"decode_tp 8b {label}.log")
        if os.path.exists(log):
            lines = [line.strip() for line in open(log) if line.startswith(("decode:", "attention:"))]
            found[f"decode_tp llama-3-8b {label}"] = " | ".join(lines) or "no result"
    for attention in ("lean", "sdpa"):
        log = os.path.join(out, f"compile_hf 8b {attention}.log")
        if os.path.exists(log):
            lines = [line.strip() for line in open(log) if "tokens/s" in line]
            found[f"transformers generate llama-3-8b {attention}"] = " | ".join(lines) or "no result"
    for step in ("mla decode gluon", "mla decode seesaw"):
        log = os.path.join(out, f"{step}.log")
        if os.path.exists(log):
            found[step] = " | ".join(line.strip() for line in open(log) if _mla_probe_line(line)) or "no result"
    return found


def _mla_probe_line(line: str) -> bool:
    """A line the record keeps of an MLA kernel's script: its compiled statistics, its checks
    against float64, its times a 64-key iteration, and its calls' time by kernel."""
    keep = ("float64", "-key iteration", "device time a call")
    return line.startswith(("sm_90", "no sm_90")) or any(k in line for k in keep)


def write_record(out: str, env: dict, steps: list[dict], found_packages: dict[str, str]) -> str:
    """Merge the benchmark's record (if it ran) with the steps; returns the path written."""
    from results import file_name, validate

    bench = os.path.join(out, "results.json")
    record = json.load(open(bench)) if os.path.exists(bench) else env | dict(rows=[], notes=[])
    record |= dict(packages=found_packages, steps=steps, loops=loop_results(out))
    path = os.path.join(out, file_name(validate(record)))
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def main(argv: list[str] | None = None) -> int:
    from lean_tp import cli

    parser = cli.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=cli.output_dir, default=os.environ.get("OUT", os.path.join(ROOT, "out", "gpu_check"))
    )
    parser.add_argument(
        "--groups",
        nargs="+",
        type=cli.choice(*GROUPS),
        default=list(GROUPS),
        help="run only these groups, e.g. one group per time-limited device call",
    )
    parser.add_argument(
        "--budget",
        type=cli.number(MIN_STEP_SECONDS, 24 * 3600),
        default=480,
        help="seconds for all steps together (480)",
    )
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error(f"no CUDA device visible to torch {torch.__version__}; nothing to check (run it on a GPU machine)")
    from bench_decode import copy_bandwidth, environment

    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    env = environment(device, copy_bandwidth(device))  # the record of a run without the benchmark has it too
    found = packages()
    print(
        f"device: {env['device']} ({env['sm_count']} SMs, entry {env['arch']}), driver {env['driver']}; "
        + ", ".join(f"{k} {v}" for k, v in found.items()),
        flush=True,
    )
    deadline, steps = time.time() + args.budget, []
    for name, cmd, timeout in planned_steps(args.groups, sys.executable, args.out):
        left = deadline - time.time()
        if left < MIN_STEP_SECONDS:
            steps.append(dict(name=name, status="SKIPPED (budget)", seconds=0.0))
        else:
            steps.append(run(name, cmd, args.out, min(timeout, left)))
        print(f"{name:<28} {steps[-1]['status']:<18} {steps[-1]['seconds']:7.1f}s", flush=True)
    path = write_record(args.out, env, steps, found)
    print(f"\nrecord: {path} (commit it as docs/results/{os.path.basename(path)})")
    for name, text in loop_results(args.out).items():
        print(f"{name}: {text}")
    return 0 if all(s["status"] == "PASS" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
