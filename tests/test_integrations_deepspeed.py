"""DeepSpeed inference with lean attention: the AutoTP policy found on the model, up-front errors,
and tp 2 on CPU (gloo) giving the unsharded model's tokens, with /dev/shm left clean."""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

from lean_tp.integrations.deepspeed import check_tp_heads, init_inference, injection_policy

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    pad_token_id=0,
)
SHM = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.mark.parametrize(
    "config,layer",
    [
        (LlamaConfig(**SMALL), "LlamaDecoderLayer"),
        (MistralConfig(**SMALL), "MistralDecoderLayer"),
        (Qwen2Config(**SMALL), "Qwen2DecoderLayer"),
        (Phi3Config(**SMALL), "Phi3DecoderLayer"),
    ],
    ids=lambda x: x if isinstance(x, str) else type(x).__name__,
)
def test_injection_policy_found_on_the_model(config, layer):
    policy = injection_policy(AutoModelForCausalLM.from_config(config))
    ((cls, names),) = policy.items()
    assert cls.__name__ == layer and names == ("self_attn.o_proj", "mlp.down_proj")


def test_injection_policy_errors():
    with pytest.raises(ValueError, match="_no_split_modules"):
        injection_policy(torch.nn.Linear(2, 2))
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="cannot map GPT2Block to an AutoTP policy"):
        injection_policy(gpt2)


def test_zero_kv_heads_rejected_before_deepspeed():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL))
    with pytest.raises(
        ValueError,
        match=r"tp_size: expected at most num_key_value_heads=2 ranks \(num_attention_heads=4\), got tp_size=4",
    ):
        init_inference(model, tp_size=4)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="tp_size: expected a positive integer"):
            check_tp_heads(model.config, bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fp16 rule is CPU-only")
def test_fp16_rejected_on_cpu():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="dtype: expected torch.float32 or torch.bfloat16 on CPU"):
        init_inference(model, tp_size=1, dtype=torch.float16)
    with pytest.raises(ValueError, match="got torch.float16"):
        init_inference(model.half(), tp_size=1)


def _torchrun(script: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=os.environ.copy())


@pytest.mark.xdist_group("ranks")  # test_decode_tp.py says why
def test_tp2_decode_runs_on_the_lean_op_with_local_heads():
    before = set(glob.glob(SHM))
    proc = _torchrun(ROOT / "tests" / "ds_worker.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        # 5 decode steps x 2 layers (the left-padded prefill falls back); each rank holds 4 of the 8
        # query heads (head_dim 16), as q (B, 1, 4, 16).
        assert f"rank {rank}: attn lean, lean calls 10, q shapes [(2, 1, 4, 16)]" in proc.stdout, proc.stdout
    assert set(glob.glob(SHM)) <= before


@pytest.mark.xdist_group("ranks")
def test_deepspeed_launcher_runs_the_example():
    """The example under DeepSpeed's own launcher (which passes --local_rank), checked against the
    unsharded model; torchrun's environment is test_tp2_decode_runs_on_the_lean_op_with_local_heads's."""
    before = set(glob.glob(SHM))
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "examples/deepspeed_inference.py",
        "--check",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "tp 2, lean attention" in proc.stdout and "check: OK" in proc.stdout
    assert set(glob.glob(SHM)) <= before, "DeepSpeed's all-reduce buffers were left in /dev/shm"
