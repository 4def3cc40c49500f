"""End to end: ``vllm.LLM`` greedy generation on small random-weight models saved locally (a Llama,
and a Gemma 2 with sliding windows and soft-capping; ``examples/vllm_generate.py`` makes them) gives
the same tokens with the LEAN backend as with vLLM's default (its CPU attention here).

vLLM's CPU platform always picks its own backend, so these tests put LEAN in its place
(``lean_tp.integrations.vllm.in_place_of``), with the engine in-process. A small batch-token
budget makes vLLM chunk the long prompt while the others decode, so mixed batches reach the
backend. Needs vLLM (CI's vLLM leg installs it).
"""

from __future__ import annotations

import contextlib
import gc
import os

import pytest
import torch

pytest.importorskip("vllm")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm_generate import save_random_model  # noqa: E402

from lean_tp.integrations.vllm import backend as lean_backend  # noqa: E402
from lean_tp.integrations.vllm import in_place_of  # noqa: E402

# Four prompts, one longer than the batch-token budget and the sliding window.
PROMPTS = [[(7 * i + 3 * n) % 500 + 1 for n in range(length)] for i, length in enumerate((9, 23, 150, 40))]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {arch: save_random_model(str(root / arch), arch) for arch in ("llama", "gemma2", "deepseek_v2")}


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _attention_impls(worker) -> list[str]:
    """On a vLLM worker: each attention layer's impl class, query heads and KV heads."""
    model = worker.model_runner.model
    return sorted(
        {
            f"{type(m.impl).__name__}/{m.impl.num_heads}/{m.impl.num_kv_heads}"
            for m in model.modules()
            if hasattr(m, "impl")
        }
    )


def _generate(
    model: str,
    lean: bool,
    dtype: str,
    tp: int = 1,
    impls: list | None = None,
    max_tokens: int = MAX_TOKENS,
    replaced: str = "CPU_ATTN",
    top: list | None = None,
) -> list[list[int]]:
    """Greedy tokens of PROMPTS, LEAN (LEAN_MLA for ``replaced="CPU_MLA"``) in place of vLLM's CPU
    backend when ``lean``; ``impls`` receives every worker's ``_attention_impls``, ``top`` each
    sequence's 5 most likely tokens at each step. MLA models get vLLM's CPU MLA page size (16),
    which it requires."""
    with in_place_of(replaced) if lean else contextlib.nullcontext():
        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=512,
            enforce_eager=True,
            max_num_seqs=4,
            block_size=16 if replaced == "CPU_MLA" else 32,
            max_num_batched_tokens=64,
            kv_cache_memory_bytes=32 << 20,
            tensor_parallel_size=tp,
        )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            detokenize=False,
            ignore_eos=True,
            logprobs=5 if top is not None else None,
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        if impls is not None:
            impls.extend(llm.collective_rpc(_attention_impls))
        del llm
        gc.collect()
    if top is not None:
        top.extend([set(step) for step in o.outputs[0].logprobs] for o in outputs)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _assert_greedy_close(got, expected, got_top, expected_top) -> None:
    """LEAN's greedy tokens against the default backend's at 16 bits, where two attention kernels
    round differently and a random model's near-tie can flip a token (as vLLM's own
    ``check_logprobs_close`` allows): each pair of sequences agrees up to its first difference,
    where each one's token is among the other's 5 most likely (``_generate``'s ``top``); the tokens
    after it follow from different contexts. At most one sequence differs."""
    for g, e, g_top, e_top in zip(got, expected, got_top, expected_top):
        step = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None)
        if step is not None:
            assert g[step] in e_top[step] and e[step] in g_top[step], (step, g, e)
    assert sum(g != e for g, e in zip(got, expected)) <= 1, (got, expected)


@pytest.fixture
def batches(monkeypatch):
    """What the LEAN builder saw: (decode requests on lean, whether other requests were delegated)."""
    seen = []
    build = lean_backend.LeanAttentionMetadataBuilder.build

    def recorded(self, *args, **kwargs):
        metadata = build(self, *args, **kwargs)
        seen.append((metadata.num_decodes, metadata.prefill is not None))
        return metadata

    monkeypatch.setattr(lean_backend.LeanAttentionMetadataBuilder, "build", recorded)
    return seen


@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_lean_generates_the_default_backends_tokens(models, in_process, batches, model):
    expected = _generate(models[model], lean=False, dtype="float32")
    assert batches == []  # the default backend ran first, without LEAN
    got = _generate(models[model], lean=True, dtype="float32")
    assert got == expected
    assert all(len(t) == MAX_TOKENS for t in got) and len({tuple(t) for t in got}) == len(PROMPTS)
    assert any(n and not delegated for n, delegated in batches), "no decode-only batch reached lean"
    assert any(n and delegated for n, delegated in batches), "no mixed batch (decodes + a prefill chunk)"


def test_lean_triton_kernel_in_the_interpreter(models, in_process, batches, monkeypatch):
    """The same, with decode on lean's Triton kernel (the interpreter), bf16 model and cache: the
    tokens are the default backend's up to a near-tie (``_assert_greedy_close``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", "triton")
    # Fewer tokens: every decode step runs the interpreted kernel once per layer.
    expected_top, got_top = [], []
    expected = _generate(models["gemma2"], lean=False, dtype="bfloat16", max_tokens=8, top=expected_top)
    got = _generate(models["gemma2"], lean=True, dtype="bfloat16", max_tokens=8, top=got_top)
    _assert_greedy_close(got, expected, got_top, expected_top)
    assert any(n for n, _ in batches)


def test_example_checks_lean_against_the_default_backend(in_process, batches, capsys):
    """examples/vllm_generate.py --check: its own random Llama, LEAN swapped in on CPU, exit 0."""
    import vllm_generate

    assert vllm_generate.main(["--check", "--batch", "2", "--prompt-len", "40", "--gen", "6"]) == 0
    assert "check: 2 of 2 sequences identical" in capsys.readouterr().out and any(n for n, _ in batches)


def test_tensor_parallel_workers_run_lean(models, in_process, monkeypatch):
    """Tensor parallel 2: each worker is its own process, which loads the plugin and puts LEAN in
    place of CPU_ATTN (the environment ``in_place_of`` sets); each rank's layers hold their share
    of the heads (2 query heads, 1 KV head), and the tokens are those of one process."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one NUMA node here: one core per worker
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a test function
    expected = _generate(models["gemma2"], lean=False, dtype="float32")
    impls = []
    assert _generate(models["gemma2"], lean=True, dtype="float32", tp=2, impls=impls) == expected
    assert impls == [["LeanAttentionImpl/2/1"], ["LeanAttentionImpl/2/1"]]


@pytest.fixture
def mla_decodes(monkeypatch):
    """The query rows of each LEAN_MLA decode call."""
    from lean_tp.integrations.vllm import mla as lean_mla

    calls = []
    real = lean_mla.decode_attention
    monkeypatch.setattr(lean_mla, "decode_attention", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))
    return calls


@pytest.mark.parametrize("dtype,op_backend", [("float32", "auto"), ("bfloat16", "triton")], ids=["torch", "kernel"])
def test_lean_mla_generates_cpu_mlas_tokens(models, in_process, mla_decodes, monkeypatch, dtype, op_backend):
    """A random DeepSeek-V2 (MLA) model: LEAN_MLA in place of vLLM's CPU MLA gives its tokens, on
    the torch backend (float32) and on the kernel in the interpreter (bf16, fewer tokens, up to a
    near-tie: ``_assert_greedy_close``). vLLM's CPU platform turns chunked prefill and prefix
    caching off for MLA models, so on CPU every prompt is prefilled whole."""
    if op_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", op_backend)
    tokens = MAX_TOKENS if op_backend == "auto" else 6
    kwargs = dict(dtype=dtype, max_tokens=tokens, replaced="CPU_MLA")
    close = dtype == "bfloat16"  # 16 bits: equal up to a near-tie
    expected_top, got_top = ([], []) if close else (None, None)
    expected = _generate(models["deepseek_v2"], lean=False, top=expected_top, **kwargs)
    assert mla_decodes == []
    impls = []
    got = _generate(models["deepseek_v2"], lean=True, impls=impls, top=got_top, **kwargs)
    if close:
        _assert_greedy_close(got, expected, got_top, expected_top)
    else:
        assert got == expected
    assert len({tuple(t) for t in got}) == len(PROMPTS)
    assert impls == [["LeanCPUMLAImpl/16/1"]] and mla_decodes


# Prompts and generated tokens over ten token ids, so that the n-gram proposer finds every new token
# in the context and proposes drafts; 17 speculative tokens make verifications of up to 18 tokens,
# past the default mode's bound, and batches that mix lengths.
SPEC_IDS = list(range(1, 11))
SPEC_PROMPTS = [[(3 * i + 7 * n) % 10 + 1 for n in range(length)] for i, length in enumerate((80, 61, 93))]
SPEC_TOKENS = 17


def test_a_token_verified_among_drafts_gets_its_decode_rows_from_lean(models, in_process, monkeypatch):
    """N-gram speculative decoding with LEAN in the batch-invariant mode, on lean's kernel (the
    interpreter): every verification the engine runs, of every length it sends (up to 1 + 17
    tokens, in batches that mix lengths), is on lean, and the rows lean returns for each verified
    token equal, bitwise, those of decoding that token alone over the engine's own cache (the
    one-token call lean makes without speculation), checked on the first layer that makes each
    call (the model's layers make the same call over their own caches). vLLM's own ``VLLM_BATCH_INVARIANT=1`` needs
    its Triton kernels, which its CPU build lacks: here lean's modules alone see the flag, and
    vLLM's matmuls and sampler are not invariant (they are the engine's, outside the promise).
    One speculative engine a process: vLLM's CPU build fails to build a second one in the same
    process under the interpreter (its kernel dispatcher re-registers the drafter's kernels)."""
    import types

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only through the interpreter (tests/conftest.py sets it)")
    monkeypatch.setenv("LEAN_TP_VLLM_BACKEND", "triton")
    monkeypatch.setattr(lean_backend, "envs", types.SimpleNamespace(VLLM_BATCH_INVARIANT=True))
    real, verified, seen = lean_backend.decode_attention, [], set()

    def checked(q, k_cache, v_cache, seq_lens, **kw):
        out = real(q, k_cache, v_cache, seq_lens, **kw)
        assert kw["batch_invariant"]
        if q.dim() == 4 and (call := (tuple(q.shape), tuple(seq_lens.tolist()))) not in seen:
            seen.add(call)
            tq = q.shape[1]
            for t in range(tq):
                alone = real(q[:, t], k_cache, v_cache, (seq_lens - (tq - 1 - t)).clamp(min=0), **kw)
                assert torch.equal(out[:, t].view(torch.int32), alone.view(torch.int32)), f"token {t} of {tq}"
            verified.append(tq)
        return out

    monkeypatch.setattr(lean_backend, "decode_attention", checked)
    with in_place_of("CPU_ATTN"):
        llm = LLM(
            model=models["llama"],
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            max_num_seqs=4,
            block_size=32,
            kv_cache_memory_bytes=32 << 20,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": SPEC_TOKENS,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 2,
            },
        )
        params = SamplingParams(
            max_tokens=4, allowed_token_ids=SPEC_IDS, temperature=0.0, detokenize=False, ignore_eos=True
        )
        llm.generate([{"prompt_token_ids": p} for p in SPEC_PROMPTS], params, use_tqdm=False)
        del llm
        gc.collect()
    assert verified and max(verified) > 16, verified
