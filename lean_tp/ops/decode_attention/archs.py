"""The GPU architectures the kernel is built for: one entry each, read by the tuning table (which
entries an architecture takes), the grid (occupancy limits), the kernel report and the simulator.

Limits are the CUDA C++ Programming Guide's "Technical Specifications per Compute Capability"
(the same numbers as CCCL's ``cuda::arch::traits``): shared memory a multiprocessor and the most
one block may opt into (the multiprocessor's less the 1 KB the driver reserves a block), resident
threads and blocks a multiprocessor; 64K 32-bit registers a multiprocessor on all of them. SM
counts are a part's, not an architecture's: the device reports them at run time, and ``PARTS``
names the ones the report and the simulator model.
"""

from __future__ import annotations

import dataclasses

import torch

KB = 1024


@dataclasses.dataclass(frozen=True)
class Arch:
    """One compute capability the kernel has tuning for."""

    key: str  # "sm80": the tuning table's and the kernel report's name
    capability: tuple[int, int]  # the compile target
    tuning: str  # whose tuning entries it takes where the table has none of its own key
    smem_per_sm: int  # bytes
    smem_per_block: int  # the most a block may opt into
    max_threads_per_sm: int
    max_blocks_per_sm: int
    # e4m3 -> f16 conversion in hardware (cvt.rn.f16x2.e4m3x2, sm_89 and later); before it the
    # kernel converts e4m3 bits by hand (plan.e4m3_as_bits).
    native_e4m3: bool
    reason: str
    regs_per_sm: int = 64 * KB
    smem_reserved_per_block: int = 1 * KB

    @property
    def target(self) -> int:
        """Triton's ``GPUTarget`` arch number: 80, 86, ..., 120."""
        return self.capability[0] * 10 + self.capability[1]


ARCHS: dict[str, Arch] = {
    a.key: a
    for a in (
        Arch("sm80", (8, 0), "sm80", 164 * KB, 163 * KB, 2048, 32, False, "A100, A30: Ampere data center"),
        Arch(
            "sm86", (8, 6), "sm80", 100 * KB, 99 * KB, 1536, 16, False,
            "A10, A40, RTX 3090, RTX A6000: Ampere's mma.sync and cp.async as sm_80, with 99 KB a block",
        ),
        Arch(
            "sm89", (8, 9), "sm80", 100 * KB, 99 * KB, 1536, 24, True,
            "L4, L40S, RTX 4090: Ada, sm_80's instructions plus fp8 conversion, with 99 KB a block",
        ),
        Arch("sm90", (9, 0), "sm90", 228 * KB, 227 * KB, 2048, 32, True, "H100, H200: Hopper"),
        Arch(
            "sm100", (10, 0), "sm90", 228 * KB, 227 * KB, 2048, 32, True,
            "B200, GB200, B300 (sm_103): Blackwell data center, Hopper's shared memory and occupancy; sm_90's "
            "entries, an output spread over up to 96 programs (tuning._B200)",
        ),
        Arch(
            "sm120", (12, 0), "sm80", 100 * KB, 99 * KB, 1536, 32, True,
            "RTX 5090, RTX PRO 6000 (and GB10, sm_121): Blackwell client; mma.sync and 99 KB a block, so "
            "sm_80's entries (sm_90's fp8 entries take 107-168 KB a block)",
        ),
    )
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Part:
    """A GPU the tools model: its architecture and SM count (the whitepaper's or datasheet's)."""

    name: str
    arch: str
    sms: int


PARTS: dict[str, Part] = {
    p.name: p
    for p in (
        Part("A100", "sm80", 108),  # A100 whitepaper (SXM4)
        Part("A10", "sm86", 72),  # A10 datasheet
        Part("L40S", "sm89", 142),  # L40S datasheet
        Part("L4", "sm89", 58),  # L4 datasheet
        Part("H100", "sm90", 132),  # H100 whitepaper (SXM5)
        Part("H200", "sm90", 132),  # the driver's count on the H200 of docs/results (GH100, as H100 SXM5)
        Part("B200", "sm100", 148),  # Blackwell datasheets: 148 SMs
        Part("RTX 5090", "sm120", 170),  # GeForce RTX 5090 specifications
    )
}
# The part the kernel report names for an architecture's programs per SM.
REPORT_PART = {"sm80": "A100", "sm86": "A10", "sm89": "L40S", "sm90": "H100", "sm100": "B200", "sm120": "RTX 5090"}


def arch_for_capability(major: int, minor: int, device: str = "this device") -> Arch:
    """The entry of a compute capability: its own, else the closest earlier one of its major
    version (sm_87 Orin: sm86; sm_103 B300: sm100; sm_121 GB10: sm120), else the closest earlier
    one (a later part: its resources are at least those). ``ValueError`` naming the device before
    sm_80: the kernel's cp.async and bf16 dots need Ampere."""
    capability = (major, minor)
    if capability < ARCHS["sm80"].capability:
        raise ValueError(
            f"device: expected a GPU of compute capability 8.0 or later for the Triton backend (cp.async, bf16 "
            f"dots), got {device} of {major}.{minor}; the torch backend runs anywhere (backend='torch')"
        )
    earlier = [a for a in ARCHS.values() if a.capability <= capability]
    same_major = [a for a in earlier if a.capability[0] == major]
    return max(same_major or earlier, key=lambda a: a.capability)


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, the current one for ``"cuda"`` without an index."""
    return device.index if device.index is not None else torch.cuda.current_device()
