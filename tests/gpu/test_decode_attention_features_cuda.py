"""CUDA tests of the serving features on the Triton kernel: bf16 and fp8 caches, Tq > 1, windows,
softcap, sinks, padded head dims, alone and together, and CUDA-graph replay with new lengths.

Skipped without a CUDA device; ``python scripts/gpu_check.py`` runs them on a GPU.
"""

import dataclasses

import pytest
import torch
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

import lean_tp
from lean_tp.ops.decode_attention import decode_attention_ref

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (python scripts/gpu_check.py runs it on a GPU)", allow_module_level=True)

ATOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
LENS = [0, 1, 63, 64, 65, 129, 5000]
FEATURES = {
    "tq4": dict(tq=4),
    "window": dict(window=100, leftpad=[3] * len(LENS)),
    "tq3_window": dict(tq=3, window=17),
    "softcap": dict(softcap=5.0),
    "sinks": dict(sinks=True),
    "fp8_e4m3": dict(cache_dtype=torch.float8_e4m3fn, per_head_scale=True),
    "fp8_e5m2": dict(cache_dtype=torch.float8_e5m2),
    "all": dict(tq=4, cache_dtype=torch.float8_e4m3fn, softcap=10.0, window=300, sinks=True, leftpad=[1] * len(LENS)),
}


def _cuda(inputs: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _check(inputs: dict, atol: float) -> None:
    out, lse = lean_tp.decode_attention(**_cuda(inputs), return_lse=True)
    assert_matches_feature_ref(out, lse, inputs, atol, lse_atol=1e-3, lse_rtol=1e-4)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_feature_cuda(dtype, feature, head_dim, layout):
    inputs = make_feature_inputs(LENS, 16, 4, head_dim, dtype, layout, seed=head_dim, **FEATURES[feature])
    _check(inputs, ATOL[dtype])


def test_graph_replay_with_every_feature():
    inputs = _cuda(
        make_feature_inputs(
            [4000, 300, 0, 1],
            16,
            4,
            128,
            torch.bfloat16,
            "contiguous",
            tq=4,
            cache_dtype=torch.float8_e4m3fn,
            softcap=10.0,
            window=700,
            sinks=True,
            per_head_scale=True,
            seed=1,
        )
    )
    inputs["k_cache"] = torch.cat([inputs["k_cache"].float()] * 2, 2).to(torch.float8_e4m3fn)  # room to grow
    inputs["v_cache"] = torch.cat([inputs["v_cache"].float()] * 2, 2).to(torch.float8_e4m3fn)
    lean_tp.decode_attention(**inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = lean_tp.decode_attention(**inputs, return_lse=True)
    for new in ([1, 8000, 77, 0], [0, 0, 0, 0], [4, 4096, 5000, 3]):
        inputs["cache_seqlens"].copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, _ = decode_attention_ref(
            **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        )
        torch.testing.assert_close(out.cpu().double(), ref_out, atol=ATOL[torch.bfloat16], rtol=0)


def test_compile_fullgraph_with_every_feature_cuda():
    """Inductor sees the Triton kernel with every feature on, and new lengths do not recompile."""
    inputs = _cuda(
        make_feature_inputs(
            [3000, 0, 33],
            16,
            4,
            128,
            torch.bfloat16,
            "paged16",
            tq=2,
            cache_dtype=torch.float8_e5m2,
            softcap=10.0,
            window=256,
            sinks=True,
            seed=5,
        )
    )

    def step(**kw):
        return lean_tp.decode_attention(**kw) * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(**inputs), step(**inputs), atol=0, rtol=0)
    inputs["cache_seqlens"] = torch.tensor([5, 2000, 1], dtype=torch.int32, device="cuda")
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(**inputs), step(**inputs), atol=0, rtol=0)


def test_fp8_e4m3_as_bytes_compiled_matches_the_native_conversion():
    """sm_80's e4m3 path (bytes, integer moves to fp16, scales x 2^8), compiled for this GPU, gives
    bitwise the result of the native fp8 conversion; the CPU test runs both in the interpreter,
    which does not run the staging of the compiled kernel (``attend._opaque``)."""
    from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
    from lean_tp.ops.decode_attention.launch_args import counters_size, launch_args, plan_workspace
    from lean_tp.ops.decode_attention.launcher import plan_decode

    inputs = _cuda(
        make_feature_inputs(
            LENS,
            16,
            4,
            128,
            torch.float16,
            "paged16",
            tq=2,
            cache_dtype=torch.float8_e4m3fn,
            per_head_scale=True,
            seed=3,
        )
    )
    spread = (
        inputs["k_cache"].float()
        * torch.logspace(-3, 1.5, inputs["k_cache"].shape[1], device="cuda")[None, :, None, None]
    )
    inputs["k_cache"] = spread.clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = [
        torch.tensor([x], dtype=torch.float32, device="cuda") if isinstance(x, float) else x
        for x in (inputs["k_scale"], inputs["v_scale"])
    ]
    results = []
    plan = plan_decode(
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["cache_seqlens"],
        inputs["block_table"],
        k_scale=scales[0],
        v_scale=scales[1],
        num_programs=64,
    )
    for arch in ("sm80", plan.kernel.arch):
        arch_plan = dataclasses.replace(plan, kernel=dataclasses.replace(plan.kernel, arch=arch))
        out = torch.full_like(inputs["q"], float("nan"))
        lse = torch.full(inputs["q"].shape[:-1], float("nan"), device="cuda")
        counters = torch.zeros(counters_size(64), dtype=torch.int32, device="cuda")
        args = launch_args(
            arch_plan,
            inputs["q"],
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["cache_seqlens"],
            None,
            inputs["block_table"],
            out,
            lse,
            plan_workspace(plan, "cuda"),
            counters,
            128**-0.5,
            *scales,
        )
        assert args["E4M3_BITS"] == (arch == "sm80")
        decode_attention_fwd_kernel[(64,)](**args, **arch_plan.kernel.compile_options())
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    ref_out, _ = decode_attention_ref(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    torch.testing.assert_close(results[0][0].cpu().double(), ref_out, atol=ATOL[torch.float16], rtol=0)
