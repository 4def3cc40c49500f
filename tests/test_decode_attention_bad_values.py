"""Values a scheduler can write that the checks cannot see without a host sync: lengths and left
padding that are negative, past the capacity or near 2**31, and caches whose unused slots hold NaN.

Every one must leave the kernel finishing in bounded time, writing nothing outside out and lse,
and giving the result of the lengths clamped into the cache (``cache.valid_keys``). The kernel
runs in the interpreter under a time limit, its out and lse inside NaN guard regions.
"""

import threading

import pytest
import torch
from helpers import ATOL, assert_matches_ref, launcher_form, make_inputs
from test_decode_attention_features import assert_matches_feature_ref, make_feature_inputs

import lean_tp
from lean_tp.ops.decode_attention import torch_impl
from lean_tp.ops.decode_attention.cache import CacheLayout, valid_keys
from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel
from lean_tp.ops.decode_attention.launcher import decode_attention_fwd, lean_schedule
from lean_tp.ops.utils import interpreted

pytestmark = pytest.mark.skipif(
    not interpreted(decode_attention_fwd_kernel),
    reason="runs the kernel in the Triton interpreter (TRITON_INTERPRET=1)",
)

INT_MAX, INT_MIN = 2**31 - 1, -(2**31)
GUARD = 4096  # NaN elements before and after out and lse


def run_with_time_limit(fn, seconds: float):
    """fn() on a daemon thread; fails the test if it has not returned within ``seconds`` (a hang)."""
    result, error = [], []
    thread = threading.Thread(target=lambda: _capture(fn, result, error), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not finish within {seconds} s (the kernel's walk does not end)"
    if error:
        raise error[0]
    return result[0]


def _capture(fn, result, error):
    try:
        result.append(fn())
    except BaseException as exc:  # re-raised on the test's thread
        error.append(exc)


def guarded(shape, dtype):
    """(the whole NaN buffer, a contiguous view of ``shape`` with GUARD elements on each side)."""
    n = torch.Size(shape).numel()
    buf = torch.full((n + 2 * GUARD,), float("nan"), dtype=dtype)
    return buf, buf[GUARD : GUARD + n].view(shape)


def run_kernel_guarded(inputs: dict, num_programs: int = 4, seconds: float = 120.0):
    """The kernel on ``inputs`` (with their feature arguments), out and lse in guarded buffers; asserts
    it ends in time and that nothing outside out and lse was written."""
    q = inputs["q"]
    out_buf, out = guarded(q.shape, q.dtype)
    lse_buf, lse = guarded(q.shape[:-1], torch.float32)
    call = launcher_form(inputs)
    run_with_time_limit(
        lambda: decode_attention_fwd(
            **call, softmax_scale=q.shape[-1] ** -0.5, out=out, lse=lse, num_programs=num_programs
        ),
        seconds,
    )
    for buf in (out_buf, lse_buf):
        assert buf[:GUARD].isnan().all() and buf[-GUARD:].isnan().all(), "the kernel wrote outside out/lse"
    return out, lse


def clamped(inputs: dict) -> dict:
    """The same call with lengths and left padding clamped into the cache, as the op reads them."""
    layout = CacheLayout.of(inputs["k_cache"], inputs["v_cache"], inputs["block_table"])
    start, end = valid_keys(inputs["cache_seqlens"], inputs["cache_leftpad"], layout.capacity)
    return dict(inputs, cache_seqlens=end, cache_leftpad=start)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


CAPACITY = 1000
# (seqlens, leftpad or None, layout): every sequence of the cache filled (all pages mapped), then
# lengths a scheduler could write.
CASES = {
    "leftpad-past-length": ([600, 100, 700], [0, 900, 0], "contiguous"),
    "negative-length": ([600, -800, 700], None, "contiguous"),
    "negative-first": ([-600, 50, 30], None, "contiguous"),
    "past-capacity": ([CAPACITY + 5, 3, INT_MAX], None, "contiguous"),
    "int-extremes": ([INT_MIN, INT_MAX, 0], None, "paged16"),
    "leftpad-out-of-range": ([50, 60, INT_MAX], [-5, 61, INT_MAX], "contiguous"),
    "paged-past-capacity": ([CAPACITY + 100, -1, 17], [0, 0, 16], "paged64"),
}


def bad_inputs(case: str, head_dim: int = 64, dtype=torch.float16) -> dict:
    seqlens, leftpad, layout = CASES[case]
    inputs = make_inputs([CAPACITY] * 3, 8, 2, head_dim, dtype, layout, capacity=CAPACITY, seed=len(case))
    inputs["cache_seqlens"], inputs["cache_leftpad"] = _i32(seqlens), None if leftpad is None else _i32(leftpad)
    return inputs


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_clamps_lengths_into_the_cache(case):
    """Ends, writes only out and lse, and equals float64 on the clamped lengths."""
    inputs = bad_inputs(case, head_dim=128 if case == "leftpad-past-length" else 64)
    out, lse = run_kernel_guarded(inputs)
    assert_matches_ref(out, lse, clamped(inputs), ATOL[torch.float16])


@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_clamps_lengths_into_the_cache(case):
    inputs = bad_inputs(case)
    out, lse = lean_tp.decode_attention(**inputs, backend="torch", return_lse=True)
    assert_matches_ref(out, lse, clamped(inputs), ATOL[torch.float16])


def test_kernel_clamps_lengths_with_features():
    """Several query tokens, a window, sinks and softcap over malformed lengths."""
    inputs = make_feature_inputs(
        [40, 40, 40, 40], 4, 2, 32, torch.float32, "paged16", tq=3, window=9, sinks=True, softcap=10.0, seed=5
    )
    inputs["cache_seqlens"] = _i32([-3, 2, INT_MAX, 45])  # capacity 48: three 16-key pages, all mapped
    out, lse = run_kernel_guarded(inputs)
    assert_matches_feature_ref(out, lse, clamped(inputs), ATOL[torch.float32])
    out, lse = lean_tp.decode_attention(**inputs, backend="torch", return_lse=True)
    assert_matches_feature_ref(out, lse, clamped(inputs), ATOL[torch.float32])


def test_schedule_of_malformed_lengths_is_that_of_the_clamped_ones():
    """lean_schedule returns, and schedules what the kernel does: lengths clamped into the capacity."""
    got = run_with_time_limit(lambda: lean_schedule(_i32([600, -800, 700]), 4, 64, 8, capacity=1000), 60)
    assert got == lean_schedule(_i32([600, 0, 700]), 4, 64, 8, capacity=1000)
    got = run_with_time_limit(lambda: lean_schedule(_i32([INT_MAX, INT_MIN, 70]), 4, 64, 8, capacity=1000), 60)
    assert got == lean_schedule(_i32([1000, 0, 70]), 4, 64, 8, capacity=1000)


def test_capacity_too_large_for_int32_tiles():
    with pytest.raises(ValueError, match="k_cache: expected a capacity of at most"):
        lean_schedule(_i32([5]), 1, 16, 2, capacity=2**31 - 1)


def _poison(cache: torch.Tensor, index) -> None:
    """NaN into ``cache[index]``: the float NaN, or for fp8 the byte 0x7F (NaN in e4m3fn and e5m2)."""
    if cache.element_size() == 1:
        cache.view(torch.uint8)[index] = 0x7F
    else:
        cache[index] = float("nan")


def poisoned_inputs(layout: str, cache_dtype=None) -> dict:
    """Valid lengths with left padding, and NaN in every slot no query may see: past each length,
    before each left padding, and in pages no sequence maps (the block table's unused entries
    point at one of them)."""
    inputs = make_feature_inputs(
        [5, 40, 0, 17], 8, 2, 64, torch.float16, layout, leftpad=[3, 0, 2, 9], cache_dtype=cache_dtype, seed=11
    )
    k, v = inputs["k_cache"], inputs["v_cache"]
    start, end = inputs["cache_leftpad"].long(), inputs["cache_seqlens"].long()
    if inputs["block_table"] is None:
        pos = torch.arange(k.shape[2])
        unseen = (pos < start[:, None]) | (pos >= end[:, None])  # (B, S)
        for c in (k, v):
            _poison(c.transpose(1, 2), unseen)
        return inputs
    table, page = inputs["block_table"], k.shape[1]
    mapped = set(table[table < k.shape[0]].tolist())
    spare = next(p for p in range(k.shape[0]) if p not in mapped)
    table[table >= k.shape[0]] = spare  # unused entries: a page full of NaN
    for c in (k, v):
        _poison(c, spare)
        for b in range(table.shape[0]):
            for n in list(range(int(start[b]))) + list(range(int(end[b]), table.shape[1] * page)):
                _poison(c, (int(table[b, n // page]), n % page))
    return inputs


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "layout, cache_dtype",
    [("contiguous", None), ("paged16", None), ("paged16", torch.float8_e4m3fn)],
    ids=["contiguous", "paged16", "paged16-fp8"],
)
def test_nan_in_unseen_slots_never_reaches_the_output(backend, layout, cache_dtype):
    inputs = poisoned_inputs(layout, cache_dtype)
    assert inputs["k_cache"].float().isnan().any() and inputs["v_cache"].float().isnan().any()
    out, lse = lean_tp.decode_attention(**inputs, backend=backend, return_lse=True)
    assert_matches_feature_ref(out, lse, inputs, ATOL[torch.float16])


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_torch_backend_on_cpu_reads_up_to_the_longest_length(monkeypatch, layout):
    """Eager on CPU the chunks stop at the longest sequence: the cost follows the lengths, not the capacity."""
    inputs = make_inputs([5, 100, 37], 4, 2, 32, torch.float32, layout, capacity=8192, seed=2)
    read = []
    chunks = torch_impl._kv_chunks
    monkeypatch.setattr(torch_impl, "_kv_chunks", lambda *a: [read.append(c[1].shape[2]) or c for c in chunks(*a)])
    monkeypatch.setattr(torch_impl, "CHUNK_TOKENS", 64)
    out, lse = lean_tp.decode_attention(**inputs, backend="torch", return_lse=True)
    assert_matches_ref(out, lse, inputs, ATOL[torch.float32])
    assert 100 <= sum(read) <= 128, f"read {sum(read)} positions for a longest length of 100"
