"""Malformed calls raise ValueError/TypeError that name the argument and say what was expected."""

import pytest
import torch
from helpers import make_inputs

import lean_tp


def _base(layout="contiguous"):
    return make_inputs([5, 9], 8, 2, 64, torch.float16, layout, seed=0)


def _edit(layout="contiguous", **changes):
    inputs = _base(layout)
    for key, fn in changes.items():
        inputs[key] = fn(inputs)
    return inputs


CASES = {
    "q-ndim": (lambda: _edit(q=lambda i: i["q"][0]), ValueError, "q"),
    "q-not-tensor": (lambda: _edit(q=lambda i: i["q"].tolist()), TypeError, "q"),
    "q-int-dtype": (lambda: _edit(q=lambda i: i["q"].to(torch.int32)), TypeError, "q"),
    "k-ndim": (lambda: _edit(k_cache=lambda i: i["k_cache"][0]), ValueError, "k_cache"),
    "kv-shape-mismatch": (lambda: _edit(v_cache=lambda i: i["v_cache"][:, :, :-1]), ValueError, "v_cache"),
    "kv-head-dim": (
        lambda: _edit(k_cache=lambda i: i["k_cache"][..., :32], v_cache=lambda i: i["v_cache"][..., :32]),
        ValueError,
        "k_cache",
    ),
    "hq-not-multiple": (lambda: _edit(q=lambda i: i["q"][:, :7]), ValueError, "Hq"),
    "dtype-mismatch": (lambda: _edit(k_cache=lambda i: i["k_cache"].float()), TypeError, "k_cache"),
    "cache-batch": (
        lambda: _edit(k_cache=lambda i: i["k_cache"][:1], v_cache=lambda i: i["v_cache"][:1]),
        ValueError,
        "k_cache",
    ),
    "cache-last-stride": (
        lambda: _edit(k_cache=lambda i: i["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
        ValueError,
        "stride",
    ),
    "seqlens-int64": (lambda: _edit(cache_seqlens=lambda i: i["cache_seqlens"].long()), TypeError, "cache_seqlens"),
    "seqlens-shape": (lambda: _edit(cache_seqlens=lambda i: i["cache_seqlens"][:1]), ValueError, "cache_seqlens"),
    "seqlens-device": (
        lambda: _edit(cache_seqlens=lambda i: i["cache_seqlens"].to("meta")),
        ValueError,
        "cache_seqlens",
    ),
    "block-table-int64": (
        lambda: _edit("paged16", block_table=lambda i: i["block_table"].long()),
        TypeError,
        "block_table",
    ),
    "block-table-rows": (
        lambda: _edit("paged16", block_table=lambda i: i["block_table"][:1]),
        ValueError,
        "block_table",
    ),
    "block-table-ndim": (
        lambda: _edit("paged16", block_table=lambda i: i["block_table"][0]),
        ValueError,
        "block_table",
    ),
    "page-size-not-pow2": (
        lambda: _edit("paged16", k_cache=lambda i: i["k_cache"][:, :12], v_cache=lambda i: i["v_cache"][:, :12]),
        ValueError,
        "page size",
    ),
    "leftpad-int64": (
        lambda: _edit(cache_leftpad=lambda i: torch.zeros(2, dtype=torch.int64)),
        TypeError,
        "cache_leftpad",
    ),
    "leftpad-shape": (
        lambda: _edit(cache_leftpad=lambda i: torch.zeros(3, dtype=torch.int32)),
        ValueError,
        "cache_leftpad",
    ),
    "leftpad-not-tensor": (lambda: _edit(cache_leftpad=lambda i: [0, 0]), TypeError, "cache_leftpad"),
    "page-size-6": (
        lambda: _edit("paged16", k_cache=lambda i: i["k_cache"][:, :6], v_cache=lambda i: i["v_cache"][:, :6]),
        ValueError,
        "page size",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_named_error(case):
    make, exc, needle = CASES[case]
    with pytest.raises(exc, match="expected") as info:
        lean_tp.decode_attention(**make())
    assert needle in str(info.value)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend: expected one of"):
        lean_tp.decode_attention(**_base(), backend="cuda")


def test_bad_softmax_scale():
    with pytest.raises(TypeError, match="softmax_scale: expected a float"):
        lean_tp.decode_attention(**_base(), softmax_scale="0.1")


def test_unsupported_head_dim_for_triton():
    inputs = make_inputs([5], 4, 2, 36, torch.float16, seed=0)
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 8 up to 256"):
        lean_tp.decode_attention(**inputs, backend="triton")
    lean_tp.decode_attention(**inputs, backend="torch")  # the torch backend takes any head_dim


def test_triton_on_cpu_without_interpreter(monkeypatch):
    from lean_tp.ops.decode_attention import checks

    monkeypatch.setattr(checks, "interpreted", lambda kernel: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        lean_tp.decode_attention(**_base(), backend="triton")


@pytest.mark.parametrize("lens,layout", [([5, 100], "contiguous"), ([-1, 3], "contiguous"), ([5, 40], "paged16")])
def test_debug_checks_lengths(monkeypatch, lens, layout):
    inputs = _base(layout)
    inputs["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32)
    monkeypatch.setenv("LEAN_TP_DEBUG", "1")
    with pytest.raises(ValueError, match="cache_seqlens: expected values in"):
        lean_tp.decode_attention(**inputs)


def test_debug_checks_left_padding(monkeypatch):
    inputs = _base()
    inputs["cache_leftpad"] = torch.tensor([0, 10], dtype=torch.int32)  # beyond sequence 1's length 9
    monkeypatch.setenv("LEAN_TP_DEBUG", "1")
    with pytest.raises(ValueError, match=r"cache_leftpad: expected 0 <= cache_leftpad\[b\] <= cache_seqlens\[b\]"):
        lean_tp.decode_attention(**inputs)


def test_debug_checks_block_table(monkeypatch):
    inputs = _base("paged16")
    inputs["block_table"][1, 0] = 10**6
    monkeypatch.setenv("LEAN_TP_DEBUG", "1")
    with pytest.raises(
        ValueError, match=r"block_table: expected page ids in \[0, 5\) .* got 1000000 at sequence 1, column 0"
    ):
        lean_tp.decode_attention(**inputs)
    monkeypatch.delenv("LEAN_TP_DEBUG")
    out = lean_tp.decode_attention(**inputs)  # without the debug flag only that sequence is poisoned
    assert out[1].isnan().all() and not out[0].isnan().any()


def test_debug_block_table_check_skips_columns_no_key_is_read_from(monkeypatch):
    """Columns before the left padding or the window read nothing: any id there is harmless."""
    inputs = make_inputs([20, 30], 8, 2, 64, torch.float16, "paged16", leftpad=[17, 0], seed=0)
    inputs["block_table"][0, 0] = -1  # sequence 0's keys start at position 17, on column 1
    inputs["block_table"][1, 0] = -1  # a window of 8 (with Tq 1) reads positions 22..29, column 1
    monkeypatch.setenv("LEAN_TP_DEBUG", "1")
    out = lean_tp.decode_attention(**inputs, window=8)
    assert not out.isnan().any()
    with pytest.raises(ValueError, match="got -1 at sequence 1, column 0"):
        lean_tp.decode_attention(**inputs)


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(softcap=float("inf")), ValueError, "softcap: expected a finite float > 0 or None, got inf"),
        (dict(softcap=float("nan")), ValueError, "softcap: expected a finite float > 0 or None, got nan"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite float or None, got nan"),
        (dict(softmax_scale=float("-inf")), ValueError, "softmax_scale: expected a finite float or None, got -inf"),
        (dict(return_lse="yes"), TypeError, "return_lse: expected a bool, got str 'yes'"),
    ],
    ids=["softcap-inf", "softcap-nan", "scale-nan", "scale-inf", "return_lse-str"],
)
def test_non_finite_scalars_and_flags(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        lean_tp.decode_attention(**_base(), **kwargs)
    if "softmax_scale" in kwargs:  # the registered op checks too
        inputs = _base()
        with pytest.raises(exc, match=message):
            torch.ops.lean_tp.decode_attention(
                inputs["q"],
                inputs["k_cache"],
                inputs["v_cache"],
                inputs["cache_seqlens"],
                None,
                None,
                kwargs["softmax_scale"],
                "auto",
            )


def test_a_paged_pool_without_block_table_names_the_layout():
    inputs = _base("paged16")
    inputs.pop("block_table")
    with pytest.raises(ValueError, match=r"looks like a paged pool \(num_pages, page_size, Hkv, D\): pass block_table"):
        lean_tp.decode_attention(**inputs)


def test_a_flash_attn_layout_cache_names_the_layout():
    inputs = _base()
    for name in ("k_cache", "v_cache"):  # (B, Hkv, S, D) stored as flash-attn's (B, S, Hkv, D)
        inputs[name] = inputs[name].transpose(1, 2).contiguous()
    with pytest.raises(
        ValueError, match=r"looks like \(B, S_max, Hkv, D\) \(flash-attn's layout\): pass k_cache.transpose"
    ):
        lean_tp.decode_attention(**inputs)


def test_launch_runs_under_the_device_guard_of_q(monkeypatch):
    """Triton launches on the current device; the launcher makes q's device current first."""
    from lean_tp.ops.decode_attention import launcher

    guard = launcher.device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(launcher, "device_guard", Recorder)
    monkeypatch.setattr(launcher, "decode_attention_fwd_kernel", _RecordingKernel(entered))
    inputs = _base()
    launcher.decode_attention_fwd(**inputs, softmax_scale=0.1, num_programs=2)
    assert entered == [inputs["q"].device, "launch", "exit"]


class _RecordingKernel:
    """Stands in for the kernel: records when it is launched, relative to the guard."""

    def __init__(self, log):
        self.log = log
        from lean_tp.ops.decode_attention.kernel import decode_attention_fwd_kernel

        self.arg_names = decode_attention_fwd_kernel.arg_names
        self.__name__ = "decode_attention_fwd_kernel"

    def __getitem__(self, grid):
        return lambda **kwargs: self.log.append("launch")


def test_workspace_of_the_wrong_size_is_refused():
    from lean_tp.ops.decode_attention.launcher import decode_attention_fwd

    inputs = _base()
    small = (torch.empty(1, 2, 16, 64), torch.empty(1, 2, 2, 16))
    with pytest.raises(ValueError, match=r"workspace: expected contiguous tensors \(shape, dtype\)"):
        decode_attention_fwd(**inputs, softmax_scale=0.1, num_programs=4, workspace=small)
