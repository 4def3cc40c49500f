"""Bad page ids in used block-table columns: the cases of tests/test_decode_attention_page_ids.py.

``python tests/page_id_worker.py ID_NAME`` runs every case of one edge id on both backends in
its own process (the test starts it), so that a read outside the pool, which makes the Triton
interpreter segfault, fails that test instead of killing the run. Exit 0 when every case holds.
The helpers are imported by the in-process feature tests too.
"""

from __future__ import annotations

import os
import sys

import torch
from helpers import ATOL, assert_matches_ref, make_inputs, run_kernel, select

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
EDGE_IDS = ("INT_MIN", "-1", "num_pages", "num_pages+1", "INT_MAX")
PAGE = 16
# Healthy lengths around the page and the kernel's block: 0, 1, page - 1, page, page + 1, long.
HEALTHY = [0, 1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE + 3]
BAD_LEN = 3 * PAGE - 5  # three used columns: first 0, middle 1, last 2 (partly used)
COLUMNS = {"first": 0, "middle": 1, "last": 2}


def edge_id(name: str, num_pages: int) -> int:
    return {"INT_MIN": INT_MIN, "-1": -1, "num_pages": num_pages, "num_pages+1": num_pages + 1, "INT_MAX": INT_MAX}[
        name
    ]


def used_columns(inputs: dict, b: int) -> range:
    """Columns sequence b reads (no window): those holding keys [leftpad, length)."""
    page = inputs["k_cache"].shape[1]
    pads = inputs.get("cache_leftpad")
    start = int(pads[b]) if pads is not None else 0
    end = int(inputs["cache_seqlens"][b])
    return range(start // page, -(-end // page)) if end > start else range(0)


def fill_unused(inputs: dict) -> None:
    """Every column no key of its sequence is read from gets junk a scheduler may leave there:
    the edge ids and stale ids of pages that belong to other sequences."""
    table, num_pages = inputs["block_table"], inputs["k_cache"].shape[0]
    junk = [INT_MIN, -1, INT_MAX, num_pages, num_pages + 1, 0, num_pages - 1]
    for b in range(table.shape[0]):
        used = used_columns(inputs, b)
        for c in range(table.shape[1]):
            if c not in used:
                table[b, c] = junk[(b + c) % len(junk)]


def run(inputs: dict, backend: str, batch_invariant: bool = False, num_programs: int | None = None, config=None):
    """(out, lse) of the op, or of the launcher on a forced grid (splits outputs over programs) and
    tuning entry, into NaN-filled out and lse."""
    import lean_tp

    if backend == "torch" or num_programs is None:
        return lean_tp.decode_attention(**inputs, backend=backend, return_lse=True, batch_invariant=batch_invariant)
    return run_kernel(inputs, batch_invariant=batch_invariant, num_programs=num_programs, config=config)


def check_poisoned(out, lse, inputs: dict, bad_rows: list[int], assert_healthy) -> None:
    """Rows of sequences in ``bad_rows`` are NaN in out and lse; the others pass ``assert_healthy``
    (out, lse, inputs) on the call restricted to them."""
    batch = inputs["q"].shape[0]
    for b in bad_rows:
        assert out[b].isnan().all() and lse[b].isnan().all(), f"sequence {b} (bad page id) is not NaN"
    good = [b for b in range(batch) if b not in bad_rows]
    if good:
        assert_healthy(out[good], lse[good], select(inputs, good))


def _batch_case(name: str):
    """A batch of healthy sequences with one bad sequence per column position among them."""
    bad_at = {1: "first", 4: "middle", 6: "last"}
    lens = list(HEALTHY)
    for b in sorted(bad_at):
        lens.insert(b, BAD_LEN)
    inputs = make_inputs(lens, 8, 2, 64, torch.float16, f"paged{PAGE}", seed=len(name))
    fill_unused(inputs)
    for b, where in bad_at.items():
        inputs["block_table"][b, COLUMNS[where]] = edge_id(name, inputs["k_cache"].shape[0])
    return inputs, sorted(bad_at)


def main(name: str) -> None:
    for backend in ("triton", "torch"):
        _check_backend(backend, name)


def _check_backend(backend: str, name: str) -> None:
    def healthy(out, lse, inputs):
        assert_matches_ref(out, lse, inputs, ATOL[torch.float16])

    inputs, bad_rows = _batch_case(name)
    grid = 5 if backend == "triton" else None  # 5 programs: the long sequences' outputs are split
    for b in bad_rows:  # each bad sequence alone
        alone = select(inputs, [b])
        out, lse = run(alone, backend, num_programs=grid)
        check_poisoned(out, lse, alone, [0], healthy)
    out, lse = run(inputs, backend, num_programs=grid)
    check_poisoned(out, lse, inputs, bad_rows, healthy)
    # The invariant mode: healthy rows bitwise what they are without the bad sequences.
    good = [b for b in range(inputs["q"].shape[0]) if b not in bad_rows]
    out, lse = run(inputs, backend, batch_invariant=True, num_programs=grid)
    ref_out, ref_lse = run(select(inputs, good), backend, batch_invariant=True, num_programs=grid)
    check_poisoned(out, lse, inputs, bad_rows, healthy)
    assert torch.equal(out[good], ref_out) and torch.equal(lse[good], ref_lse), "invariant rows changed"
    print(f"{backend} {name}: ok")


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before lean_tp is imported (in ``run``)
    main(*sys.argv[1:])
