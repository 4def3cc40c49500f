"""Worker for test_decode_tp.py: ``context_parallel_attention`` under a real process group (gloo),
each rank holding its share of the cache, for serving features the model's decode loop does not
use (several query tokens, windows, sinks, softcap, fp8). Every rank checks its result against the
float64 reference of the unsharded call and that all ranks hold the same bits.

    torchrun --nproc_per_node=C tests/cp_worker.py
"""

import torch
import torch.distributed as dist
from test_context_parallel import shard_cache
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

from lean_tp.distributed import ContextShard, context_parallel_attention, init_distributed, shutdown
from lean_tp.distributed.env import gather_objects

CASES = {
    "Tq1-window5-sinks": dict(window=5, sinks=True),
    "Tq4-window9-softcap": dict(tq=4, window=9, softcap=15.0),
    "Tq3-fp8-sinks": dict(tq=3, sinks=True, cache_dtype=torch.float8_e4m3fn, per_head_scale=True),
}


def main() -> None:
    ctx = init_distributed("cpu", timeout_s=60)
    shard = ContextShard(ctx.world_size, ctx.rank)
    try:
        for name, features in CASES.items():
            dtype = torch.bfloat16 if "cache_dtype" in features else torch.float32
            inputs = make_feature_inputs([0, 1, 17, 40, 150], 8, 2, 32, dtype, seed=len(name), **features)
            call = {k: v for k, v in inputs.items() if k not in ("block_table", "cache_leftpad")}
            call["k_cache"], call["v_cache"] = (
                shard_cache(inputs["k_cache"], shard),
                shard_cache(inputs["v_cache"], shard),
            )
            out, lse = context_parallel_attention(shard=shard, group=dist.group.WORLD, return_lse=True, **call)
            assert_matches_feature_ref(out, lse, inputs, 2e-2 if dtype == torch.bfloat16 else 2e-5)
            bits = gather_objects(ctx, (out.float().numpy().tobytes(), lse.numpy().tobytes()))
            assert all(b == bits[0] for b in bits), f"{name}: ranks hold different results"
        print(f"rank {ctx.rank}: {len(CASES)} cases match float64, identical on all {ctx.world_size} ranks", flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
