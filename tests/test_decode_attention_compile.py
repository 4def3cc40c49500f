"""Every configuration the tuning table can select compiles to cubin for sm_80 and sm_90, on CPU.

The interpreter accepts code the GPU compiler rejects (dot dims < 16, non-constexpr globals,
``break``); compiling for real targets catches that without a GPU. The kernel objects of this
process are interpreter functions (TRITON_INTERPRET=1 is set at collection), so the compiles run
once in a subprocess with the interpreter off, and each test reads its entry's result.
"""

import json
import os
import subprocess
import sys

import pytest

from lean_tp.ops.decode_attention.tuning import TUNING_TABLE

DTYPES = {2: ("float16", "bfloat16"), 4: ("float32",)}
GPU_ENTRIES = [key for key in TUNING_TABLE if key[0] != "interp"]
# Groups 1, 32 and 64 reach every row block (16, 32, 64) an entry can select; 24 gives NUM_GC > 1
# where max_block_g is 16. Page sizes None and 16 give both layouts.
GROUPS = (1, 24, 32, 64)
SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block on sm_90 (A100: 163 KB, checked below)


def entry_id(key) -> str:
    return f"{key[0]}-D{key[1]}-{key[2]}B"


def compile_all() -> dict:
    """Compile every variant of every GPU entry; returns {entry id: [problems]} (empty = all built)."""
    import torch
    from triton.backends.compiler import GPUTarget

    from lean_tp.ops.decode_attention.launcher import compile_for_target, kernel_constexprs

    results = {}
    for key in GPU_ENTRIES:
        arch, head_dim, size = key
        config, problems, seen = TUNING_TABLE[key], [], set()
        capability = 80 if arch == "sm80" else 90
        for dtype_name in DTYPES[size]:
            dtype = getattr(torch, dtype_name)
            for group in GROUPS:
                for page_size, leftpad in ((None, False), (16, False), (None, True), (16, True)):
                    if leftpad and group != GROUPS[0]:
                        continue  # left padding changes only the key addressing, not the row blocks
                    cx = kernel_constexprs(config, head_dim, group, dtype, page_size, leftpad)
                    variant = (dtype_name, cx["BLOCK_G"], cx["NUM_GC"] > 1, page_size, leftpad)
                    if variant in seen:
                        continue
                    seen.add(variant)
                    try:
                        kernel = compile_for_target(GPUTarget("cuda", capability, 32), dtype, cx, config)
                    except Exception as exc:  # reported per entry by the test
                        problems.append(f"{variant}: {type(exc).__name__}: {str(exc)[-400:]}")
                        continue
                    limit = SMEM_LIMIT if capability == 90 else 163 * 1024
                    if not kernel.asm.get("cubin"):
                        problems.append(f"{variant}: no cubin")
                    elif kernel.metadata.shared > limit:
                        problems.append(f"{variant}: {kernel.metadata.shared} B shared memory > {limit}")
        results[entry_id(key)] = problems
    return results


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = "import json, test_decode_attention_compile as t; print('RESULT' + json.dumps(t.compile_all()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tests_dir, env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, f"compile subprocess failed:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT") :])


@pytest.mark.parametrize("key", GPU_ENTRIES, ids=entry_id)
def test_tuning_table_entry_compiles(compiled, key):
    assert compiled[entry_id(key)] == [], "\n".join(compiled[entry_id(key)])
