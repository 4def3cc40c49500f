"""The hardware the tools model: GPUs (the simulator's time model, the kernel report's issue
share and Little's-law budget) and the links between them, every constant with its source."""

from __future__ import annotations

from dataclasses import dataclass

from lean_tp.ops.decode_attention.archs import PARTS


@dataclass(frozen=True)
class GPUModel:
    """The constants of the time model for one GPU (sources in ``MODEL_SOURCES``)."""

    name: str
    sms: int  # archs.PARTS
    arch: str  # archs.ARCHS key
    clock_ghz: float  # SM clock under load
    hbm_tbps: float  # device-to-device copy bandwidth, TB/s (bytes read + written)
    hbm_latency_us: float  # loaded HBM latency, what Little's law needs in flight
    l2_latency_cycles: int  # L2 hit and atomic round trip
    l2_bytes_per_clk_per_sm: int  # what one SM can pull from L2
    launch_gap_us: float  # a dependent second kernel's start after the first ends (CUDA graph)
    l2_mb: float  # L2 capacity, MB
    l2_read_tbps: float  # what all SMs together read from L2 (hits), TB/s
    tensor_tflops: float  # dense 16-bit tensor-core peak, TFLOP/s: no SM computes faster
    combine_ctas_per_sm: int = 4  # resident CTAs of a combine kernel

    @property
    def l2_latency_us(self) -> float:
        return self.l2_latency_cycles / (self.clock_ghz * 1e3)

    @property
    def l2_port_gbps(self) -> float:
        return self.l2_bytes_per_clk_per_sm * self.clock_ghz


GPUS = {
    g.name: g
    for g in (
        GPUModel("A100", PARTS["A100"].sms, PARTS["A100"].arch, 1.41, 1.5, 0.6, 200, 47, 1.0, 40.0, 5.4, 312.0),
        GPUModel("H100", PARTS["H100"].sms, PARTS["H100"].arch, 1.755, 3.0, 0.7, 260, 64, 1.0, 50.0, 6.9, 989.4),
        GPUModel("H200", PARTS["H200"].sms, PARTS["H200"].arch, 1.755, 4.24, 0.7, 260, 64, 1.0, 50.0, 6.9, 989.4),
        GPUModel("B200", PARTS["B200"].sms, PARTS["B200"].arch, 1.965, 6.9, 0.8, 295, 64, 1.0, 126.5, 8.7, 2250.0),
        GPUModel("L40S", PARTS["L40S"].sms, PARTS["L40S"].arch, 2.52, 0.78, 0.6, 279, 64, 1.0, 96.0, 10.7, 362.05),
    )
}
# Measured time of one K/V-loop iteration (one block_n-key block of one head unit, one program an
# SM) of a kernel entry, keyed (arch, head_dim, cache bytes an element, BLOCK_G, block_n): a floor on
# how fast a program streams, however many bytes it has in flight. MLA's loop is bound by it, not
# by memory: its two dots, the softmax between them and their barriers run in series, one program
# an SM (the loop issues in about a quarter of these times: kernel report). Measured on an H200
# (torch 2.11, triton 3.6), DeepSeek-V3, B=32, 32k keys, paged64, as the time over the iterations
# an SM runs: docs/results/2026-11-27-nvidia-h200.json for the entries (16 heads in 16-row blocks
# of 64 keys; 128 heads in 128-row blocks of two head units, the benchmark's lean-cols128 there) and
# docs/results/2026-11-26-nvidia-h200-2.json for 32-key blocks of 16 rows (16 heads, and 128 heads
# by the benchmark's lean-rows16) and 64 rows. With them the model gives the records' B=32 MLA rows
# within 0.9-1.2x; at B=1 it stays 1.3-2.7x too fast (the merge and a call's fixed costs, not
# calibrated). The H100 shares the H200's SM and clocks, so the same times model it; other parts
# and entries (sm_80, sm_100, 32-row blocks) are not measured and keep the memory-bound model. The
# batch-invariant variant's loops (16-row blocks; 64-row ones in 512-key chunks, a loop a chunk)
# are assumed to take the default's time for the same block (unmeasured).
LOOP_US = {
    ("sm90", 576, 2, 16, 32): 2.10,  # 2.07 (16 heads), 2.13 (128 heads in 16-row blocks)
    ("sm90", 576, 2, 16, 64): 2.73,  # 16 heads; 2.51 for 128 heads in 16-row blocks
    ("sm90", 576, 2, 64, 32): 2.84,
    ("sm90", 576, 2, 128, 32): 2.58,  # a head unit's iteration: 256 of V's columns
    ("sm90", 576, 1, 16, 32): 3.00,  # e4m3: 3.01 and 2.98
    ("sm90", 576, 1, 16, 64): 4.55,  # 16 heads; 4.49 for 128 heads in 16-row blocks
    ("sm90", 576, 1, 64, 32): 3.94,
    ("sm90", 576, 1, 128, 32): 3.15,
}


# The e4m3 times in LOOP_US are of loops whose conversion to bf16 ran on the conversion unit
# (Triton's e4m3 to fp16 a pair, fp16 to bf16 a value); the loops convert with integer and bf16x2
# operations instead (``attend.e4m3_to_bf16``). Per thread an iteration, from each entry's SASS
# compiled both ways (triton 3.7.1): (conversion-unit instructions removed, 32-bit integer ones
# added, bf16x2 ones added). Each is charged at the CUDA C++ Programming Guide's throughput for
# compute capability 9.0 (arithmetic instructions, results a clock an SM): 16 for the conversions
# ("all other type conversions"), 64 for bitwise operations and shifts (PRMT counted as one of
# them), 256 16-bit floating-point results (a bf16x2 instruction is two). In the measured loops the
# e4m3 iteration exceeded the 16-bit one by 0.58-1.12x the conversion unit's issue time, so an
# e4m3 iteration is modelled as its measurement less the issue time saved, and no less than the
# 16-bit iteration (unmeasured).
E4M3_CONVERSION_CHANGE = {
    ("sm90", 576, 1, 16, 32): (108, 108, 36),
    ("sm90", 576, 1, 16, 64): (216, 216, 72),
    ("sm90", 576, 1, 64, 32): (108, 108, 36),
    ("sm90", 576, 1, 128, 32): (108, 108, 36),
}
CONVERSION_RESULTS, INTEGER_RESULTS, BF16X2_RESULTS = 16, 64, 128  # a clock an SM (bf16x2: instructions)
LOOP_THREADS = 256  # the entries' 8 warps


def issue_us(gpu: GPUModel, conversions: float = 0, integer: float = 0, bf16x2: float = 0) -> float:
    """Microseconds an SM takes to issue a thread's ``conversions``, ``integer`` and ``bf16x2``
    instructions in each of ``LOOP_THREADS`` threads, at their rates (``CONVERSION_RESULTS``...)."""
    clocks = LOOP_THREADS * (conversions / CONVERSION_RESULTS + integer / INTEGER_RESULTS + bf16x2 / BF16X2_RESULTS)
    return clocks / (gpu.clock_ghz * 1e3)


def loop_us(gpu: GPUModel, head_dim: int, elem_bytes: int, block_g: int, block_n: int) -> float | None:
    """``LOOP_US`` of a kernel entry on ``gpu``, or None where it is not measured; an e4m3 entry's
    less the conversion's issue time ``E4M3_CONVERSION_CHANGE`` saves."""
    key = (gpu.arch, head_dim, elem_bytes, block_g, block_n)
    measured = LOOP_US.get(key)
    if key not in E4M3_CONVERSION_CHANGE or measured is None:
        return measured
    removed, integer, bf16x2 = E4M3_CONVERSION_CHANGE[key]
    saved = issue_us(gpu, conversions=removed) - issue_us(gpu, integer=integer, bf16x2=bf16x2)
    return max(measured - saved, LOOP_US[key[:2] + (2,) + key[3:]])


# The GPUs a sweep models unless --gpu names others: the ones its published tables were made on.
DEFAULT_GPUS = ("A100", "H100")
MODEL_SOURCES = {
    "sms": "NVIDIA A100 and H100 (SXM) whitepapers: 108 and 132 SMs; B200: 148 (Chips and Cheese, 'Nvidia's "
    "B200: Keeping the CUDA Juggernaut Rolling', 2025, and the driver's count in pytorch/ao #4002); L40S "
    "datasheet: 142",
    "clock_ghz": "Chips and Cheese, 'Nvidia's H100: Funny L2, and Tons of Bandwidth' (2023): 1755 MHz H100 boost, "
    "A100 held at 1410 MHz under load; B200 1965 MHz and L40S 2520 MHz boost (NVIDIA specifications), assumed "
    "held under load (Chips and Cheese 2025 finds B200's clocks like H100 SXM5's)",
    "hbm_tbps": "H100: ~3.0 TB/s device-to-device copy as measured on an H100 SXM; H200: 4.24 TB/s, the copy "
    "bandwidth benchmarks/bench_decode.py measured (docs/results/2026-11-26-nvidia-h200-2.json); "
    "A100: ~1.5 TB/s as measured on A100-SXM4 parts (peak 1.55-2.0 TB/s); "
    "B200 and L40S: 0.9 of their peaks, H100's measured copy share (3.0 of 3.35 TB/s), unmeasured here: "
    "B200 7.67 TB/s (7680-bit bus at 3996 MHz, pytorch/ao #4002; decode kernels reach 5.3-5.8 TB/s, "
    "flash-attention #2104 and FlashInfer #1415), L40S 864 GB/s (datasheet)",
    "hbm_latency_us": "loaded latency for Little's law, 0.6-0.8 us as measured on an H100 SXM; A100 assumed 0.6 us; "
    "B200 assumed 0.8 us (HBM3e behind two dies), L40S 0.6 us (GDDR6): unmeasured; H200 assumed H100's. "
    "The H200's SMs, clocks and L2 are the H100's GH100 die's (its clock, L2 latency, port, size and read "
    "bandwidth are H100's here, unmeasured)",
    "l2_latency_cycles": "L2 hit ~260 cycles on H100 (Chips and Cheese 2023); ~200 cycles on A100 "
    "(Chips and Cheese 2023, Jia et al., 'Dissecting the Ampere GPU architecture', GTC 2021); B200 ~150 ns "
    "(Chips and Cheese 2025) at 1965 MHz; L40: 279 cycles on average over its SMs, 222-339 by SM "
    "(arXiv 2606.22588), taken for the L40S (the same AD102 die)",
    "l2_bytes_per_clk_per_sm": "A100 whitepaper: 5120 B/clk L2 read bandwidth over 108 SMs = 47; H100, B200 and "
    "L40S assumed 64 (unmeasured)",
    "launch_gap_us": "assumed 1 us between dependent kernels inside a CUDA graph (unmeasured here)",
    "l2_mb": "A100 and H100 whitepapers: 40 and 50 MB; B200: 126.5 MB (the driver's figure, pytorch/ao #4002); "
    "L40S datasheet: 96 MB",
    "tensor_tflops": "dense BF16 tensor-core peaks (without 2:4 sparsity): A100 312 (A100 datasheet), H100 SXM "
    "989.4 (H100 whitepaper), H200 989.4 (its GH100 die's: H200 datasheet, 1979 with sparsity), B200 2250 "
    "(HGX B200 at 1000 W: NVIDIA's figures, 4500 with sparsity), L40S 362.05 (L40S datasheet, 733 with "
    "sparsity)",
    "l2_read_tbps": "L2 read bandwidth measured with te42kyfo/gpu-benches (gpu-l2-cache): A100-80GB ~5.4 TB/s, "
    "H100 PCIe ~6.9 TB/s; B200 and L40S assumed: H100's bytes per SM per clock (29.8) x SMs x clock, unmeasured",
}


@dataclass(frozen=True)
class Link:
    """One kind of link between the ranks of a collective (sources in ``LINK_SOURCES``)."""

    name: str
    gbps: float  # GB/s per GPU, one direction
    latency_us: float  # a small collective's fixed cost over this link


# Each GPU's (link inside a node, link across nodes); a collective whose ranks span nodes runs at
# the network's figures.
LINKS = {
    "A100": (Link("NVLink 3", 300.0, 10.0), Link("HDR InfiniBand", 25.0, 20.0)),
    "H100": (Link("NVLink 4", 450.0, 10.0), Link("NDR InfiniBand", 50.0, 20.0)),
    "H200": (Link("NVLink 4", 450.0, 10.0), Link("NDR InfiniBand", 50.0, 20.0)),  # HGX H200: H100's links
    "B200": (Link("NVLink 5", 900.0, 10.0), Link("ConnectX-7 400G", 50.0, 20.0)),
    "L40S": (Link("PCIe 4.0 x16", 32.0, 15.0), Link("ConnectX-7 400G, 2 GPUs a port", 25.0, 20.0)),
}
LINK_SOURCES = {
    "gbps": "NVIDIA A100 and H100 (SXM) whitepapers: NVLink 600 and 900 GB/s per GPU, both directions together; "
    "one 200 Gb/s HDR (A100 systems) or 400 Gb/s NDR (H100 systems) InfiniBand adapter per GPU (DGX A100 "
    "and DGX H100 user guides); B200: NVLink 5 1.8 TB/s both directions (Blackwell datasheet), one 400 Gb/s "
    "ConnectX-7 a GPU (DGX B200 user guide; InferenceX's B200 system, ai-dynamo/aisimulate #157); L40S: no "
    "NVLink, PCIe 4.0 x16 64 GB/s both directions (L40S datasheet), one 400 Gb/s adapter a GPU pair assumed",
    "latency_us": "assumed, unmeasured here: NCCL's small-message collectives take ~10 us within an NVSwitch node, "
    "~15 us over PCIe and ~20 us across InfiniBand nodes",
    "gpus_per_node": "8 GPUs per node (DGX/HGX A100, H100 and B200; 8-GPU L40S servers)",
}
GPUS_PER_NODE = 8


def link_of(gpu: GPUModel, ranks: int) -> Link:
    """The link a collective over ``ranks`` consecutive GPUs runs at: the node's when they fit in one."""
    inside, across = LINKS[gpu.name]
    return inside if ranks <= GPUS_PER_NODE else across
