"""The project's GPU check: CUDA tests, compute-sanitizer, a short benchmark, one summary table.

Run it whenever a CUDA GPU is available and record the table in docs/BENCHMARKS.md:

    python scripts/gpu_check.py [--out DIR] [--groups tests sanitizer bench loops]

Results (logs, JUnit XML, benchmark CSV) go to DIR (default: $OUT or ./out/gpu_check).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Single-GPU decode loop for docs/BENCHMARKS.md: llama-3-8b (random weights, bf16), a ragged batch.
DECODE_TP = ["examples/decode_tp.py", "--model", "llama-3-8b", "--batch", "8", "--gen", "128",
             "--prompt-len", "256,512,1024,2048,4096,6144,7000,7900"]
COMPILE_HF = ["examples/compile_hf.py", "--config", "llama-3-8b", "--batch", "8", "--prompt-len", "4000", "--gen", "128"]
DECODE_TP_VARIANTS = {"eager lean": [], "eager sdpa": ["--attention", "sdpa"],
                      "compiled lean": ["--compile"], "compiled sdpa": ["--compile", "--attention", "sdpa"]}


def run(name: str, cmd: list[str], out_dir: str, timeout: int) -> tuple[str, str, float]:
    """Run one step, log it to out_dir/name.log, and return (name, status, seconds)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    start = time.time()
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            status = "PASS" if rc == 0 else f"FAIL (rc={rc})"
        except subprocess.TimeoutExpired:
            status = f"TIMEOUT ({timeout}s)"
    seconds = time.time() - start
    print(f"{name:<28} {status:<16} {seconds:7.1f}s", flush=True)
    return name, status, seconds


GROUPS = ("tests", "sanitizer", "bench", "loops")


def planned_steps(groups: list[str], py: str, out: str) -> list[tuple[str, list[str], int]]:
    """(name, command, timeout) of each step of the chosen groups, in order."""
    steps = []
    if "tests" in groups:
        steps.append(("pytest tests/gpu", [py, "-m", "pytest", "tests/gpu", "-q", "-x", "-o", "addopts=-ra", f"--junitxml={out}/gpu.xml"], 900))
    if "sanitizer" in groups:
        sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        for tool in ("memcheck", "racecheck", "synccheck"):
            cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", py, "scripts/sanitizer_case.py"]
            steps.append((f"compute-sanitizer {tool}", cmd, 600))
    if "bench" in groups:
        steps.append(("bench_decode --quick", [py, "benchmarks/bench_decode.py", "--quick", "--out", out], 900))
    if "loops" in groups:
        for label, extra in DECODE_TP_VARIANTS.items():
            steps.append((f"decode_tp 8b {label}", [py, *DECODE_TP, *extra], 600))
        for attention in ("lean", "sdpa"):  # transformers generate(), compiled, static cache, random 8B weights
            steps.append((f"compile_hf 8b {attention}", [py, *COMPILE_HF, "--attention", attention], 600))
    return steps


def summarize(steps: list[tuple[str, str, float]], out: str) -> None:
    print("\n| step | status | seconds |\n|---|---|---|")
    for name, status, seconds in steps:
        print(f"| {name} | {status} | {seconds:.1f} |")
    for label in DECODE_TP_VARIANTS:
        log = os.path.join(out, f"decode_tp 8b {label}.log")
        if os.path.exists(log):
            lines = [line.strip() for line in open(log) if line.startswith(("decode:", "attention:"))]
            print(f"llama-3-8b {label}: {' | '.join(lines) or 'no result'}")
    for attention in ("lean", "sdpa"):
        log = os.path.join(out, f"compile_hf 8b {attention}.log")
        if os.path.exists(log):
            lines = [line.strip() for line in open(log) if "tokens/s" in line]
            print(f"transformers generate llama-3-8b {attention}: {' | '.join(lines) or 'no result'}")
    csv_path = os.path.join(out, "bench_decode.csv")
    if os.path.exists(csv_path):
        print("\n" + open(csv_path).read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "out", "gpu_check")))
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS),
                        help="run only these groups, e.g. one group per time-limited device call")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; triton {triton.__version__}")
    results = []
    for name, cmd, timeout in planned_steps(args.groups, sys.executable, args.out):
        if not (shutil.which(cmd[0]) or os.path.exists(cmd[0])):
            print(f"{name:<28} NOT FOUND")
            results.append((name, "NOT FOUND", 0.0))
            continue
        results.append(run(name, cmd, args.out, timeout))
    summarize(results, args.out)
    return 0 if all(s == "PASS" for _, s, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
