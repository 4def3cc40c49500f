"""Every configuration the tuning table can select compiles to cubin for sm_80 and sm_90, on CPU.

The interpreter accepts code the GPU compiler rejects (dot dims < 16, non-constexpr globals,
``break``); compiling for real targets catches that without a GPU.
"""

import pytest
import torch
from triton.backends.compiler import GPUTarget

from lean_tp.ops.decode_attention.launcher import compile_for_target, kernel_constexprs
from lean_tp.ops.tuning import TUNING_TABLE

DTYPES = {2: torch.float16, 4: torch.float32}
GPU_ENTRIES = [key for key in TUNING_TABLE if key[0] != "interp"]
# Groups 1, 32 and 64 give every row block (16, 32, 64) an entry can select; 24 gives NUM_GC > 1 where
# max_block_g is 16; page sizes None and 16 give both layouts.
GROUPS = (1, 24, 32, 64)


@pytest.mark.parametrize("key", GPU_ENTRIES, ids=lambda k: f"{k[0]}-D{k[1]}-{DTYPES[k[2]]}".replace("torch.", ""))
def test_tuning_table_entry_compiles(key):
    arch, head_dim, size = key
    config = TUNING_TABLE[key]
    capability = 80 if arch == "sm80" else 90
    dtypes = [torch.float16, torch.bfloat16] if size == 2 else [torch.float32]
    seen = set()
    for dtype in dtypes:
        for group in GROUPS:
            for page_size in (None, 16):
                cx = kernel_constexprs(config, head_dim, group, dtype, page_size)
                variant = (dtype, cx["BLOCK_G"], cx["NUM_GC"] > 1, page_size)
                if variant in seen:
                    continue
                seen.add(variant)
                kernel = compile_for_target(GPUTarget("cuda", capability, 32), dtype, cx, config)
                assert kernel.asm["cubin"], f"no cubin for {variant}"
                assert kernel.metadata.shared <= 227 * 1024, f"{variant} needs {kernel.metadata.shared} B smem"
