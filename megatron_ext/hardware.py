"""Accelerator facts, written once: dense BF16 peak TFLOP/s per GPU family (MFU in the run log and benchmark) and
the planner's GPU specs (memory, low-precision peaks, HBM and link bandwidths), which take their BF16 peaks from the
same table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Dense BF16 peak TFLOP/s per GPU (vendor datasheets, without sparsity), keyed by a substring of the CUDA device
# name. More specific names first: "GB200" must match before "B200", "GB300" before "B300".
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe part is 756 — override with logging.gpu_peak_tflops
    "H800": 989.0,  # H100's die with NVLink cut to 400 GB/s
    "A100": 312.0,
    "L40S": 362.0,
    "GB300": 2500.0,
    "GB200": 2500.0,
    "B300": 2250.0,
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
    peak_fp8_tflops: float  # dense; 0 = no FP8 tensor cores
    peak_fp4_tflops: float  # dense; 0 = no FP4 tensor cores
    compute_capability: tuple[int, int]
    hbm_tb_s: float
    nvlink_gb_s: float  # NCCL bus bandwidth inside the NVLink domain
    nvlink_domain: int  # GPUs one NVLink/NVSwitch fabric joins: 8 in an HGX/DGX node, 72 in an NVL72 rack
    node_gpus: int  # GPUs per host (per SLURM node): 8 in an HGX/DGX node, 4 in an NVL72 compute tray
    internode_gb_s: float  # NCCL bus bandwidth per GPU across NVLink domains
    pcie_gb_s: float  # host ↔ GPU copies of pinned memory, per direction
    host_memory_gib: float  # CPU memory per GPU (the node's, divided by its GPUs)


# Sources, per column. Memory: what nvidia-smi reports (H100/H200/A100 measured; Blackwell: the datasheet's
# capacity, B200 180 GB of DGX B200's 1,440 GB, GB200 186 GB of NVL72's 13.4 TB, B300/GB300 288 GB). Peaks: NVIDIA's
# datasheets and the Blackwell architecture brief, dense (half the "with sparsity" figures): H100/H200 989 BF16 /
# 1,979 FP8; A100 312 BF16; HGX B200 (1,000 W) 2,250 / 4,500 / 9,000 FP4; GB200 (1,200 W) 2,500 / 5,000 / 10,000;
# HGX B300 2,250 / 4,500 / 13,125 FP4; GB300 NVL72 2,500 / 5,000 (360 PF FP8 per 72 GPUs) / 15,000 FP4 (1.1 EF).
# HBM: 3.35 (H100 HBM3), 4.8 (H200), 2.04 / 1.555 (A100), 8 TB/s for every Blackwell (DGX B200: 64 TB/s per 8).
# Links at ~80 % of the link rate, as NCCL's bus bandwidth reaches it: NVLink 4 = 450 GB/s per direction → 360,
# H800's 200 → 160, NVLink 3 = 300 → 230, NVLink 5 = 900 → 720; one 400 Gb/s NIC (NDR, ConnectX-7) per GPU = 50 GB/s
# → 40, 200 Gb/s HDR → 20, 800 Gb/s ConnectX-8 (B300, GB300) → 80. Host copies: PCIe 5 x16 64 GB/s → 50, PCIe 4 → 25,
# PCIe 6 (B300) → 100; Grace's NVLink-C2C 900 GB/s (450 per direction) shared by its two GPUs → 180 each. Host memory:
# DGX H100/H200/A100-640GB/B200/B300 2 TB per 8 GPUs, DGX A100 320GB 1 TB; GB200/GB300 480 GB per Grace and 2 GPUs.
GPUS: dict[str, GPUSpec] = {
    "h100-80gb": GPUSpec("H100 SXM 80GB", 79.6, PEAK_BF16_TFLOPS["H100"], peak_fp8_tflops=1979.0, peak_fp4_tflops=0.0,
                         compute_capability=(9, 0), hbm_tb_s=3.35, nvlink_gb_s=360.0, nvlink_domain=8, node_gpus=8,
                         internode_gb_s=40.0, pcie_gb_s=50.0, host_memory_gib=256.0),
    "h200-141gb": GPUSpec("H200 SXM 141GB", 139.8, PEAK_BF16_TFLOPS["H200"], peak_fp8_tflops=1979.0,
                          peak_fp4_tflops=0.0, compute_capability=(9, 0), hbm_tb_s=4.8, nvlink_gb_s=360.0,
                          nvlink_domain=8, node_gpus=8, internode_gb_s=40.0, pcie_gb_s=50.0, host_memory_gib=256.0),
    # Meta's Grand Teton H100 (96 GB HBM2e at 500 W), as torchtitan's published runs use it; its power cap lowers
    # sustained clocks, which the time model does not see
    "h100-96gb-500w": GPUSpec("H100 SXM 96GB 500W", 94.5, PEAK_BF16_TFLOPS["H100"], peak_fp8_tflops=1979.0,
                              peak_fp4_tflops=0.0, compute_capability=(9, 0), hbm_tb_s=3.35, nvlink_gb_s=360.0,
                              nvlink_domain=8, node_gpus=8, internode_gb_s=40.0, pcie_gb_s=50.0, host_memory_gib=256.0),
    "h800-80gb": GPUSpec("H800 SXM 80GB", 79.6, PEAK_BF16_TFLOPS["H800"], peak_fp8_tflops=1979.0, peak_fp4_tflops=0.0,
                         compute_capability=(9, 0), hbm_tb_s=3.35, nvlink_gb_s=160.0, nvlink_domain=8, node_gpus=8,
                         internode_gb_s=40.0, pcie_gb_s=50.0, host_memory_gib=256.0),
    "a100-80gb": GPUSpec("A100 SXM 80GB", 79.2, PEAK_BF16_TFLOPS["A100"], peak_fp8_tflops=0.0, peak_fp4_tflops=0.0,
                         compute_capability=(8, 0), hbm_tb_s=2.04, nvlink_gb_s=230.0, nvlink_domain=8, node_gpus=8,
                         internode_gb_s=20.0, pcie_gb_s=25.0, host_memory_gib=256.0),
    "a100-40gb": GPUSpec("A100 SXM 40GB", 39.4, PEAK_BF16_TFLOPS["A100"], peak_fp8_tflops=0.0, peak_fp4_tflops=0.0,
                         compute_capability=(8, 0), hbm_tb_s=1.555, nvlink_gb_s=230.0, nvlink_domain=8, node_gpus=8,
                         internode_gb_s=20.0, pcie_gb_s=25.0, host_memory_gib=128.0),
    "b200": GPUSpec("B200 180GB", 167.6, PEAK_BF16_TFLOPS["B200"], peak_fp8_tflops=4500.0, peak_fp4_tflops=9000.0,
                    compute_capability=(10, 0), hbm_tb_s=8.0, nvlink_gb_s=720.0, nvlink_domain=8, node_gpus=8,
                    internode_gb_s=40.0, pcie_gb_s=50.0, host_memory_gib=256.0),
    "gb200": GPUSpec("GB200 NVL72 186GB", 173.2, PEAK_BF16_TFLOPS["GB200"], peak_fp8_tflops=5000.0,
                     peak_fp4_tflops=10000.0, compute_capability=(10, 0), hbm_tb_s=8.0, nvlink_gb_s=720.0,
                     nvlink_domain=72, node_gpus=4, internode_gb_s=40.0, pcie_gb_s=180.0, host_memory_gib=240.0),
    "b300": GPUSpec("B300 288GB", 268.2, PEAK_BF16_TFLOPS["B300"], peak_fp8_tflops=4500.0, peak_fp4_tflops=13125.0,
                    compute_capability=(10, 3), hbm_tb_s=8.0, nvlink_gb_s=720.0, nvlink_domain=8, node_gpus=8,
                    internode_gb_s=80.0, pcie_gb_s=100.0, host_memory_gib=256.0),
    "gb300": GPUSpec("GB300 NVL72 288GB", 268.2, PEAK_BF16_TFLOPS["GB300"], peak_fp8_tflops=5000.0,
                     peak_fp4_tflops=15000.0, compute_capability=(10, 3), hbm_tb_s=8.0, nvlink_gb_s=720.0,
                     nvlink_domain=72, node_gpus=4, internode_gb_s=80.0, pcie_gb_s=180.0, host_memory_gib=240.0),
}
