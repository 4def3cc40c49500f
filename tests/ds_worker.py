"""Worker for test_integrations_deepspeed.py, run under torchrun: AutoTP with lean attention, with a
spy proving every decode step of every layer ran lean_tp.decode_attention on the rank's own heads."""

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import lean_tp.integrations.transformers as lean_hf
from lean_tp.integrations.deepspeed import init_inference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from example_utils import random_left_padded_batch  # noqa: E402

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=256,
    pad_token_id=0,
)


def main() -> None:
    calls = []
    real = lean_hf.decode_attention
    lean_hf.decode_attention = lambda q, *a, **k: (calls.append(tuple(q.shape)), real(q, *a, **k))[1]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()
    engine = init_inference(model, tp_size=dist.get_world_size() if dist.is_initialized() else 2, dtype=torch.float32)
    ids, mask = random_left_padded_batch([4, 9], 256, 0)
    engine.module.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    print(
        f"rank {dist.get_rank()}: attn {engine.module.config._attn_implementation}, lean calls {len(calls)}, "
        f"q shapes {sorted(set(calls))}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
