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
    combine_ctas_per_sm: int = 4  # resident CTAs of a combine kernel

    @property
    def l2_latency_us(self) -> float:
        return self.l2_latency_cycles / (self.clock_ghz * 1e3)

    @property
    def l2_port_gbps(self) -> float:
        return self.l2_bytes_per_clk_per_sm * self.clock_ghz


GPUS = {
    "A100": GPUModel("A100", PARTS["A100"].sms, PARTS["A100"].arch, 1.41, 1.5, 0.6, 200, 47, 1.0),
    "H100": GPUModel("H100", PARTS["H100"].sms, PARTS["H100"].arch, 1.755, 3.0, 0.7, 260, 64, 1.0),
}
MODEL_SOURCES = {
    "sms": "NVIDIA A100 and H100 (SXM) whitepapers: 108 and 132 SMs",
    "clock_ghz": "Chips and Cheese, 'Nvidia's H100: Funny L2, and Tons of Bandwidth' (2023): 1755 MHz H100 boost, "
    "A100 held at 1410 MHz under load",
    "hbm_tbps": "H100: ~3.0 TB/s device-to-device copy as measured on an H100 SXM; "
    "A100: ~1.5 TB/s as measured on A100-SXM4 parts (peak 1.55-2.0 TB/s)",
    "hbm_latency_us": "loaded latency for Little's law, 0.6-0.8 us as measured on an H100 SXM; A100 assumed 0.6 us",
    "l2_latency_cycles": "L2 hit ~260 cycles on H100 (Chips and Cheese 2023); ~200 cycles on A100 "
    "(Chips and Cheese 2023, Jia et al., 'Dissecting the Ampere GPU architecture', GTC 2021)",
    "l2_bytes_per_clk_per_sm": "A100 whitepaper: 5120 B/clk L2 read bandwidth over 108 SMs = 47; H100 assumed 64 "
    "(unmeasured)",
    "launch_gap_us": "assumed 1 us between dependent kernels inside a CUDA graph (unmeasured here)",
}


@dataclass(frozen=True)
class Link:
    """One kind of link between the ranks of a collective (sources in ``LINK_SOURCES``)."""

    name: str
    gbps: float  # GB/s per GPU, one direction
    latency_us: float  # a small collective's fixed cost over this link


# (A100 link, H100 link) by kind; a collective whose ranks span nodes runs at the network's figures.
LINKS = {
    "nvlink": (Link("NVLink 3", 300.0, 10.0), Link("NVLink 4", 450.0, 10.0)),
    "network": (Link("HDR InfiniBand", 25.0, 20.0), Link("NDR InfiniBand", 50.0, 20.0)),
}
LINK_SOURCES = {
    "gbps": "NVIDIA A100 and H100 (SXM) whitepapers: NVLink 600 and 900 GB/s per GPU, both directions together; "
    "one 200 Gb/s HDR (A100 systems) or 400 Gb/s NDR (H100 systems) InfiniBand adapter per GPU (DGX A100 "
    "and DGX H100 user guides)",
    "latency_us": "assumed, unmeasured here: NCCL's small-message collectives take ~10 us within an NVSwitch node "
    "and ~20 us across InfiniBand nodes",
    "gpus_per_node": "8 GPUs per node (DGX/HGX A100 and H100)",
}
GPUS_PER_NODE = 8
