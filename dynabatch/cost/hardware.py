"""Accelerator and interconnect presets for the analytic cost model.

Peak throughput, memory size and bandwidth and link speeds are public datasheet numbers
(NVIDIA A100 / H100 / H200 SXM datasheets, NVLink and InfiniBand HDR/NDR line rates), one
device's share, one direction. The efficiency fields are not datasheet numbers: they are the
fractions of peak that well-shaped kernels typically reach (large bf16 GEMMs reach 70-85% of peak on
A100/H100, attention kernels 35-70%, streaming elementwise kernels ~80% of HBM bandwidth, NCCL p2p
~85% of link rate) and are the knobs to calibrate against a profile. The ``cpu`` preset is a rough
stand-in for a 16-core AVX-512 server running fp32, for the CPU test tier.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

MIB = 2**20
LINKS = ("intra", "inter")
"""Links between pipeline neighbours: within a node (NVLink) or across nodes (InfiniBand)."""


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and the links a pipeline stage uses to reach its neighbours."""

    name: str
    """Preset name, e.g. ``h100-80gb``."""
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s (datasheet, without sparsity); fp32 for ``cpu``."""
    memory_bytes: int
    """Device memory in bytes, as the driver reports it (nvidia-smi total)."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s (datasheet)."""
    intra_node_bandwidth: float
    """Bytes/s one device can send to a peer in the same node, one direction (NVLink: half the quoted
    bidirectional total)."""
    intra_node_latency_s: float
    """Fixed cost of one intra-node p2p message (rough NCCL small-message latency)."""
    inter_node_bandwidth: float
    """Bytes/s one device can send to a peer in another node, one direction (one NIC per device)."""
    inter_node_latency_s: float
    """Fixed cost of one inter-node p2p message."""
    matmul_efficiency: float = 0.7
    """Fraction of ``peak_flops`` reached by the model's GEMMs."""
    attention_efficiency: float = 0.45
    """Fraction of ``peak_flops`` reached by the attention core (QK^T, AV or a fused kernel)."""
    memory_efficiency: float = 0.8
    """Fraction of ``memory_bandwidth`` reached by streaming kernels (norms, softmax, residuals)."""
    link_efficiency: float = 0.85
    """Fraction of a link's bandwidth reached by large p2p transfers."""
    kernel_launch_s: float = 5e-6
    """Fixed cost of one kernel (launch and framework dispatch), which dominates tiny micro-batches."""
    devices_per_node: int = 8
    """Devices sharing the fast intra-node link (8 in DGX/HGX nodes)."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.memory_bytes < 1 or self.devices_per_node < 1:
            raise ValueError(
                f"memory_bytes and devices_per_node must be >= 1, got {self.memory_bytes} and {self.devices_per_node}"
            )
        if min(self.intra_node_latency_s, self.inter_node_latency_s, self.kernel_launch_s) < 0:
            raise ValueError(
                f"latencies must be >= 0, got intra {self.intra_node_latency_s}, inter {self.inter_node_latency_s}, "
                f"kernel launch {self.kernel_launch_s}"
            )

    def send_time(self, num_bytes, link: str = "intra"):
        """Seconds to send ``num_bytes`` to a pipeline neighbour over ``link`` (``intra`` or ``inter`` node);
        ``latency + bytes / (bandwidth * link_efficiency)``, 0 for an empty message."""
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; valid links: {', '.join(LINKS)}")
        bandwidth, latency = ((self.intra_node_bandwidth, self.intra_node_latency_s) if link == "intra"
                              else (self.inter_node_bandwidth, self.inter_node_latency_s))
        scalar = np.ndim(num_bytes) == 0
        num_bytes = np.asarray(num_bytes, dtype=np.float64)
        if np.any(num_bytes < 0):
            raise ValueError(f"num_bytes must be >= 0, got min {num_bytes.min()}")
        t = np.where(num_bytes > 0, latency + num_bytes / (bandwidth * self.link_efficiency), 0.0)
        return float(t) if scalar else t


_NVLINK3 = 300e9  # A100: 12 links x 50 GB/s = 600 GB/s bidirectional
_NVLINK4 = 450e9  # H100/H200: 18 links, 900 GB/s bidirectional
_HDR = 25e9  # InfiniBand HDR 200 Gb/s
_NDR = 50e9  # InfiniBand NDR 400 Gb/s

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec("a100-40gb", 312e12, 40960 * MIB, 1555e9, _NVLINK3, 8e-6, _HDR, 15e-6),
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 81920 * MIB, 2039e9, _NVLINK3, 8e-6, _HDR, 15e-6),
    "h100-80gb": HardwareSpec("h100-80gb", 989e12, 81559 * MIB, 3.35e12, _NVLINK4, 8e-6, _NDR, 15e-6),
    "h200": HardwareSpec("h200", 989e12, 143771 * MIB, 4.8e12, _NVLINK4, 8e-6, _NDR, 15e-6),
    # Rough: 16 cores x 2 AVX-512 FMA units x 16 fp32 lanes x 2 FLOP x ~2 GHz; processes on one host
    # talk through gloo over loopback, hosts through 10 GbE.
    "cpu": HardwareSpec(
        "cpu",
        peak_flops=2e12,
        memory_bytes=64 * 2**30,
        memory_bandwidth=100e9,
        intra_node_bandwidth=5e9,
        intra_node_latency_s=50e-6,
        inter_node_bandwidth=1.25e9,
        inter_node_latency_s=100e-6,
        matmul_efficiency=0.4,
        attention_efficiency=0.25,
        memory_efficiency=0.5,
        link_efficiency=0.5,
        kernel_launch_s=10e-6,
        devices_per_node=4,
    ),
}
"""Named hardware; ``h200`` is the H200 SXM (141 GB HBM3e, 4.8 TB/s)."""


def hardware_spec(name: str) -> HardwareSpec:
    """The preset called ``name`` (see :data:`HARDWARE_PRESETS`)."""
    if name not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware {name!r}; valid names: {', '.join(HARDWARE_PRESETS)}")
    return HARDWARE_PRESETS[name]


GPU_NAME_PRESETS: tuple[tuple[str, str, int], ...] = (
    ("H200", "h200", 0),
    ("H100", "h100-80gb", 0),
    ("A100", "a100-80gb", 60 * 2**30),
    ("A100", "a100-40gb", 0),
)
"""``(name contains, preset, at least this much memory)``, first match wins: which preset prices a CUDA device."""


def gpu_preset(device_name: str, memory_bytes: int) -> HardwareSpec:
    """The preset of a CUDA device by its name (``torch.cuda.get_device_name``) and memory; a GPU no entry
    of :data:`GPU_NAME_PRESETS` names gets the ``h100-80gb`` preset with its own memory size (a rough
    stand-in that online calibration corrects)."""
    for part, preset, min_memory in GPU_NAME_PRESETS:
        if part.lower() in device_name.lower() and memory_bytes >= min_memory:
            return replace(HARDWARE_PRESETS[preset], memory_bytes=memory_bytes)
    return replace(HARDWARE_PRESETS["h100-80gb"], name=f"h100-80gb-like ({device_name})", memory_bytes=memory_bytes)


def device_hardware(device_type: str) -> HardwareSpec:
    """The analytic preset for the device a run trains on: ``cpu`` for CPU runs, else the first CUDA
    device's (:func:`gpu_preset`). Planning a GPU run with the ``cpu`` preset makes one-sample
    micro-batches look cheapest (a CPU core's per-kernel cost is small next to its compute); on an H200
    that plan ran 20x slower than padding-free packing (docs/benchmarks/gpu_h200/)."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return HARDWARE_PRESETS["cpu"]
    props = torch.cuda.get_device_properties(0)
    return gpu_preset(props.name, int(props.total_memory))
