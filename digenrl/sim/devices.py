"""The device catalog: peak dense bf16 FLOP/s, memory, and link bandwidths of the GPUs the simulator places.

All figures are vendor datasheet values, per GPU, per direction, without sparsity:
- H100 SXM5 / H800 SXM5 / H200 SXM: 989.4 TFLOP/s dense bf16 (NVIDIA H100 and H200 datasheets; the H800
  is an H100 with NVLink cut to 400 GB/s bidirectional). HBM 3.35 TB/s (H100/H800), 4.8 TB/s (H200).
  NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction (H800: 200). PCIe Gen5 x16: 64 GB/s.
- A100 SXM 80 GB: 312 TFLOP/s bf16, 2.04 TB/s, NVLink 3 600 GB/s bidirectional, PCIe Gen4 32 GB/s.
- L40S: 362 TFLOP/s bf16 dense (733 with sparsity), 48 GB GDDR6 at 864 GB/s, PCIe Gen4 only.
- RTX 4090: 165 TFLOP/s bf16 with fp32 accumulate (the mode training uses), 24 GB at 1008 GB/s, PCIe Gen4.
- Inter-node: one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s) on the HGX/HGX-class nodes, as in the
  verl checkpoint-engine runs (4x8 H100, 400 Gb IB); 100 Gb/s Ethernet (12.5 GB/s) per GPU on the
  PCIe boxes (L40S, 4090). A100 nodes: 200 Gb/s HDR (25 GB/s).
- ``measured``: this project's CI machine (2 Xeon cores with AMX-BF16, no GPU), measured on 2026-11-22
  with a 2048^3 bf16 matmul at 2 threads (``measure_local_device`` repeats it). It lets the simulator
  predict the tiny-model CPU runs the real coordinator does here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from digenrl.errors import ConfigError

__all__ = ["DeviceSpec", "CATALOG", "device_spec", "measure_local_device", "GPUS_PER_NODE"]

GB = 1e9
TFLOPS = 1e12

# GPUs per node on HGX-style boxes; latents and weights inside a node go over NVLink, across over the network.
GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator model. Bandwidths are bytes/s per direction, per GPU."""

    name: str
    peak_bf16_flops: float
    memory_bytes: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # 0 = no NVLink: intra-node traffic uses PCIe
    pcie_bytes_per_s: float
    net_bytes_per_s: float  # inter-node NIC share of one GPU

    @property
    def intra_node_bytes_per_s(self) -> float:
        return self.nvlink_bytes_per_s or self.pcie_bytes_per_s


CATALOG: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("H800", 989.4 * TFLOPS, 80 * GB, 3350 * GB, 200 * GB, 64 * GB, 50 * GB),
        DeviceSpec("H100", 989.4 * TFLOPS, 80 * GB, 3350 * GB, 450 * GB, 64 * GB, 50 * GB),
        DeviceSpec("H200", 989.4 * TFLOPS, 141 * GB, 4800 * GB, 450 * GB, 64 * GB, 50 * GB),
        DeviceSpec("A100", 312 * TFLOPS, 80 * GB, 2039 * GB, 300 * GB, 32 * GB, 25 * GB),
        DeviceSpec("L40S", 362 * TFLOPS, 48 * GB, 864 * GB, 0.0, 32 * GB, 12.5 * GB),
        DeviceSpec("RTX4090", 165 * TFLOPS, 24 * GB, 1008 * GB, 0.0, 32 * GB, 12.5 * GB),
        # measured on this machine (see module docstring): bf16 matmul 0.168 TFLOP/s at 2 threads,
        # 24 GiB RAM; "links" are host memory copies (about 1.3 GB/s measured under load).
        DeviceSpec("measured", 0.168 * TFLOPS, 24 * GB, 10 * GB, 0.0, 1.3 * GB, 1.3 * GB),
    )
}


def device_spec(name: str) -> DeviceSpec:
    """Catalog entry by name (case-insensitive).

    Raises:
        ConfigError: unknown device name; the message lists the catalog.
    """
    for key, spec in CATALOG.items():
        if key.lower() == name.lower():
            return spec
    raise ConfigError(f"unknown device {name!r}; the catalog has: {', '.join(CATALOG)}")


def measure_local_device(size: int = 2048, repeats: int = 5) -> DeviceSpec:
    """Re-measure the ``measured`` entry on this machine: bf16 matmul FLOP/s and a host memory copy.

    Uses whatever thread count torch is set to; keep it at the count real runs use.
    """
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    a @ b  # warm-up: first call pays allocation and kernel selection
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    flops = 2 * size**3 * repeats / (time.perf_counter() - start)
    x = torch.ones(32 * 1024 * 1024)
    start = time.perf_counter()
    x.clone()
    copy = 2 * x.numel() * 4 / (time.perf_counter() - start)
    return replace(CATALOG["measured"], peak_bf16_flops=flops, hbm_bytes_per_s=copy, pcie_bytes_per_s=copy, net_bytes_per_s=copy)
