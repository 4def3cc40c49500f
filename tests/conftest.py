"""Test setup: kernels run through the Triton interpreter unless a CUDA device is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before lean_tp is
imported, which is why it happens here at collection time.
"""

import os
import sys

import torch

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
