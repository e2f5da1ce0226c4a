"""Accelerator facts, written once: dense BF16 peak TFLOP/s per GPU family (MFU in the run log and benchmark) and
the planner's GPU specs (memory, HBM and link bandwidths), which take their peaks from the same table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Dense BF16 peak TFLOP/s per GPU (vendor datasheets, without sparsity), keyed by a substring of the CUDA device
# name. More specific names first: "GB200" must match before "B200".
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe part is 756 — override with logging.gpu_peak_tflops
    "A100": 312.0,
    "L40S": 362.0,
    "GB200": 2500.0,
    "B200": 2250.0,
}


def peak_bf16_tflops(device_name: str) -> Optional[float]:
    """The table's peak for a CUDA device name (torch.cuda.get_device_name()), None for a GPU it does not list."""
    return next((tflops for family, tflops in PEAK_BF16_TFLOPS.items() if family in device_name), None)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type: memory, compute and the link classes the planner's time model uses."""

    name: str
    memory_gib: float
    peak_bf16_tflops: float
    hbm_tb_s: float
    nvlink_gb_s: float  # NCCL bus bandwidth inside a node
    internode_gb_s: float  # NCCL bus bandwidth per GPU across nodes
    fp8: bool
    pcie_gb_s: float  # host ↔ GPU copies of pinned memory, per direction
    node_host_memory_gib: float  # CPU memory of the 8-GPU DGX/HGX node that carries them


GPUS: dict[str, GPUSpec] = {
    "h100-80gb": GPUSpec("H100 SXM 80GB", 79.6, PEAK_BF16_TFLOPS["H100"], 3.35, 360.0, 40.0, True, 50.0, 2048.0),
    "h200-141gb": GPUSpec("H200 SXM 141GB", 139.8, PEAK_BF16_TFLOPS["H200"], 4.8, 360.0, 40.0, True, 50.0, 2048.0),
    "a100-80gb": GPUSpec("A100 SXM 80GB", 79.2, PEAK_BF16_TFLOPS["A100"], 2.04, 230.0, 20.0, False, 25.0, 2048.0),
    "a100-40gb": GPUSpec("A100 SXM 40GB", 39.4, PEAK_BF16_TFLOPS["A100"], 1.555, 230.0, 20.0, False, 25.0, 1024.0),
}
