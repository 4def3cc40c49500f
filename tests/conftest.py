"""Test setup: kernels run through the Triton interpreter unless a CUDA device is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before lean_tp is
imported, which is why it happens here at collection time.
"""

import os
import sys

# One thread a process: xdist already runs one worker a core, and torch's OpenMP threads and
# numpy's OpenBLAS threads, two a worker on top, spin while they wait for a core (about a third
# of the CPU of the torch-backend tests on 2 cores). Set before torch and numpy load, and inherited
# by the xdist workers and the processes the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".inductor-cache"))
# Inductor compiles in a pool of worker processes, one per core; on the 2-core CI machine the xdist
# workers already use every core, and each pool costs its workers' imports (~4 s of CPU per
# compiling process). Inherited by the subprocesses the tests start.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
# The examples' helpers (prompt builders, --prompt-len parsing) live beside the examples.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
