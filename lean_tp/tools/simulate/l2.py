"""Which K/V reads the L2 serves: the simulator's model of re-read rows.

Several row blocks of one KV head (MLA's 128 heads at TP 1: lean's two head units of a 128-row block on
sm_90 and 32-row blocks on sm_80, FlashMLA's 64-row ones, the Triton kernels' 16-head blocks) each read every latent row of a sequence. A read of a
row that a running program read shortly before is an L2 hit; the first read, or one after the row
has been evicted, comes from HBM. Every method's reads are classified by the same rule
(``hbm_share``), and the device then streams at most ``min(L2 read bandwidth, copy bandwidth /
HBM share)`` (``schedules._stream_rates``), so a method that re-reads rows is bounded by the L2's
bandwidth, not by HBM's.

Reads are tracked per chunk of a sequence's keys (``L2_CHUNKS`` a sequence and KV head), each
read stamped with the time its program reaches it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from lean_tp.tools.gpus import GPUModel

# A row read from HBM is still in L2 for a later read while less than this share of the L2's
# capacity of other data has come from HBM since (least recently used, at the copy bandwidth):
# A100's and H100's L2 is two partitions, each SM's reads filling its near one, and a line may
# be held in both, so half the capacity is what a row can count on (assumed, unmeasured).
L2_RESIDENT_SHARE = 0.5
# Reads of one sequence's keys on one KV head are tracked in this many chunks: fine enough that a
# chunk is read in well under the residency window at the sweeps' shapes (4k-128k keys).
L2_CHUNKS = 32


class Read(NamedTuple):
    """``nbytes`` of key chunk ``chunk`` ((request, KV head, index), ``chunk_bytes`` in all) read at
    ``time_us``."""

    time_us: float
    chunk: tuple[int, int, int]
    nbytes: int
    chunk_bytes: int


def residency_us(gpu: GPUModel) -> float:
    """How long a row stays in L2 after its last read, at the copy bandwidth (``L2_RESIDENT_SHARE``)."""
    return L2_RESIDENT_SHARE * gpu.l2_mb * 1e6 / (gpu.hbm_tbps * 1e6)


def chunk_reads(request: int, kv_head: int, length: int, k0: int, k1: int, bytes_per_token: int, time_at) -> list[Read]:
    """The reads of keys [k0, k1) of ``request``'s ``length`` keys on ``kv_head``, one per chunk they
    touch, each stamped ``time_at(offset)``: the time its program has read ``offset`` keys into
    the range (the chunk's middle)."""
    size = max(1, math.ceil(length / L2_CHUNKS))
    reads = []
    for index in range(k0 // size, math.ceil(k1 / size) if k1 > k0 else 0):
        a, b = max(k0, index * size), min(k1, (index + 1) * size)
        whole = (min(length, (index + 1) * size) - index * size) * bytes_per_token
        reads.append(Read(time_at((a + b) / 2 - k0), (request, kv_head, index), (b - a) * bytes_per_token, whole))
    return reads


def hbm_share(reads: list[Read], gpu: GPUModel) -> float:
    """Share of the read bytes that come from HBM. Reads of a chunk come from HBM until they add up
    to the chunk's bytes (pieces of it read by different programs, each once); past that they
    re-read it and are L2 hits, while each follows the chunk's previous read within
    ``residency_us``; after a longer gap the chunk is read afresh from HBM."""
    window = residency_us(gpu)
    last: dict[tuple[int, int, int], tuple[float, int]] = {}
    hbm = total = 0
    for time_us, chunk, nbytes, chunk_bytes in sorted(reads):
        previous, covered = last.get(chunk, (None, 0))
        if previous is None or time_us - previous > window:
            covered = 0
        hbm += max(0, min(nbytes, chunk_bytes - covered))
        last[chunk] = (time_us, covered + nbytes)
        total += nbytes
    return hbm / total if total else 1.0
