"""No block-table value reads outside the pool: a page id outside [0, num_pages) in a column a
sequence reads makes that sequence's rows NaN (out and lse) and leaves every other sequence exact;
columns no key is read from (past the length, before the left padding, before the window) are
never read, whatever they hold. In the batch-invariant mode each query token is decoded over its
own keys, and the rows NaN are those of the tokens whose keys lie on such a page.

The edge ids run in a subprocess each (``page_id_worker.py``): before the rule, the interpreter
segfaulted on them, which a test in this process could not report. The feature cases run here.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from page_id_worker import BAD_LEN, EDGE_IDS, INT_MAX, INT_MIN, check_poisoned, fill_unused, run, used_columns
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

import lean_tp
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.tuning import get_config
from lean_tp.ops.utils import interpreted

pytestmark = pytest.mark.skipif(
    not interpreted(decode_attention_fwd_kernel),
    reason="runs the kernel in the Triton interpreter (TRITON_INTERPRET=1)",
)
WORKER = os.path.join(os.path.dirname(__file__), "page_id_worker.py")


@pytest.mark.parametrize("name", EDGE_IDS)
def test_bad_page_id_poisons_only_its_sequence(name):
    """Each edge id in the first, middle and last used column, alone and among healthy sequences
    (float64 in the default mode, bitwise the batch without it in the invariant mode), both backends."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, WORKER, name], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by that signal)\n{proc.stderr[-4000:]}"


# (page size, q dtype, head dim, features, block_n override or None). Page sizes 1 to 64; the
# overrides give blocks no longer than a page, the kernel's one-page-id-a-block path.
FEATURE_CASES = {
    "paged1-tq4-window": (1, torch.float32, 32, dict(tq=4, window=7), None),
    "paged2-leftpad-sinks": (2, torch.float32, 32, dict(leftpad=[3, 0, 5, 0, 9], sinks=True), None),
    "paged4-e4m3-softcap": (4, torch.float16, 64, dict(cache_dtype=torch.float8_e4m3fn, softcap=20.0), None),
    "paged8-tq16": (8, torch.float16, 32, dict(tq=16), None),
    "paged32-block32": (32, torch.float32, 32, dict(tq=2), 32),
    "paged64-e5m2-block64": (64, torch.float16, 64, dict(cache_dtype=torch.float8_e5m2, per_head_scale=True), 64),
}


def _feature_case(page: int, dtype, head_dim: int, features: dict):
    """Healthy sequences of 0, 1, page - 1, page + 1 keys and a long one, then a sequence with an
    edge id in a column it reads and others in columns it does not (before its left padding or
    window); junk in every unused column."""
    lens = [0, 1, max(page - 1, 1), page + 1, 3 * page + 7]
    bad_len = max(BAD_LEN, 2 * page + 9)
    if "leftpad" in features:
        features = dict(features, leftpad=features["leftpad"] + [page + 3])
    inputs = make_feature_inputs(lens + [bad_len], 8, 2, head_dim, dtype, f"paged{page}", seed=page, **features)
    fill_unused(inputs)
    b = len(lens)
    num_pages = inputs["k_cache"].shape[0]
    cols = used_columns(inputs, b)
    if features.get("window"):  # the span is the last window + Tq - 1 keys: its last column is read
        read, unread = cols[-1], cols[0]
        inputs["block_table"][b, unread] = INT_MIN
    else:
        read = cols[len(cols) // 2]
    if cols.start > 0:  # a column wholly before the left padding is never read
        inputs["block_table"][b, 0] = INT_MAX
    inputs["block_table"][b, read] = num_pages
    return inputs, b


@pytest.mark.parametrize("case", FEATURE_CASES)
def test_bad_page_id_with_features(case):
    page, dtype, head_dim, features, block_n = FEATURE_CASES[case]
    inputs, bad = _feature_case(page, dtype, head_dim, features)
    atol = {torch.float32: 2e-5, torch.float16: 4e-3}[dtype]

    def healthy(out, lse, inputs):
        assert_matches_feature_ref(out, lse, inputs, atol)

    out, lse = run(inputs, "torch")
    check_poisoned(out, lse, inputs, [bad], healthy)
    config = get_config(inputs["q"].device, head_dim, dtype, inputs["k_cache"].dtype)
    if block_n is not None:
        config = dataclasses.replace(config, block_n=block_n)
    out, lse = run(inputs, "triton", num_programs=3, config=config)
    check_poisoned(out, lse, inputs, [bad], healthy)
    out, lse = run(inputs, "triton", batch_invariant=True, num_programs=3, config=config)
    reading = _tokens_reading(inputs, bad, features.get("window"))
    # The invariant mode decodes each query token over its own keys: the tokens whose keys hold
    # the bad id are NaN, and the others have the bits of their one-token decode.
    tq = inputs["q"].shape[1] if inputs["q"].dim() == 4 else 1
    # The first, middle and last tokens, and the first and last whose keys hold the bad id.
    for t in sorted({0, tq // 2, tq - 1} | ({min(reading), max(reading)} if reading else set())):
        token = _token_call(inputs, t)
        want = run(token, "triton", batch_invariant=True, num_programs=5, config=config)
        if t in reading:
            check_poisoned(*want, token, [bad], healthy)
        else:
            assert not want[0][bad].isnan().any() and not want[1][bad].isnan().any()
        got = (out[:, t], lse[:, t]) if inputs["q"].dim() == 4 else (out, lse)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=f"token {t}")


def _token_call(inputs: dict, t: int) -> dict:
    """Query token t of a Tq-token call as a one-token call: its q, the keys up to its own."""
    if inputs["q"].dim() == 3:
        return inputs
    tq = inputs["q"].shape[1]
    return dict(inputs, q=inputs["q"][:, t], cache_seqlens=inputs["cache_seqlens"] - (tq - 1 - t))


def _tokens_reading(inputs: dict, b: int, window: int | None) -> set[int]:
    """Query tokens of sequence b whose keys lie on a page with an id outside the pool."""
    page, num_pages = inputs["k_cache"].shape[1], inputs["k_cache"].shape[0]
    tq = inputs["q"].shape[1] if inputs["q"].dim() == 4 else 1
    pads = inputs.get("cache_leftpad")
    start = int(pads[b]) if pads is not None else 0
    found = set()
    for t in range(tq):
        end = int(inputs["cache_seqlens"][b]) - (tq - 1 - t)
        lo = max(start, end - window) if window else start
        ids = inputs["block_table"][b, lo // page : -(-end // page)] if end > lo else torch.empty(0)
        if ((ids < 0) | (ids >= num_pages)).any():
            found.add(t)
    return found


def test_a_pool_of_one_page_and_ids_past_it():
    """The smallest pool: page 0 valid, every other id bad, on both backends."""
    inputs = make_feature_inputs([5, 9], 4, 1, 32, torch.float32, "paged16")
    inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"][:1], inputs["v_cache"][:1]
    inputs["block_table"] = torch.tensor([[0, -1], [1, 0]], dtype=torch.int32)
    for backend in ("torch", "triton"):
        out, lse = run(inputs, backend)
        check_poisoned(out, lse, inputs, [1], lambda o, s, i: assert_matches_feature_ref(o, s, i, 2e-5))


def test_an_empty_pool_is_refused():
    inputs = make_feature_inputs([0, 0], 4, 1, 32, torch.float32, "paged16")
    inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"][:0], inputs["v_cache"][:0]
    with pytest.raises(ValueError, match=r"k_cache: expected a pool of at least one page \(dim 0\), got shape \(0, "):
        lean_tp.decode_attention(**inputs)
