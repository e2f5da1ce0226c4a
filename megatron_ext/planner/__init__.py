"""Parallel layout planner: per-GPU memory and step time of every valid TP/PP/VPP/CP/DP/EP layout.

Everything here is arithmetic on the config — no process group, no model — so a layout can be
chosen before any GPU hour is spent. ``docs/planner.md`` derives the formulas; in short:

Memory (per GPU, the worst pipeline stage and the worst DP×CP rank), as megatron-core 0.19.2
allocates it under this recipe (``wrap_with_ddp`` sets ``grad_reduce_in_fp32=True``):

* parameters in ``params_dtype``; under the distributed optimizer they live in DDP's contiguous
  param buffer, padded like the grad buffer;
* gradients: DDP's grad buffer in fp32, one per model chunk. With the distributed optimizer each
  parameter starts at a multiple of 64 elements and each bucket ends at a multiple of
  lcm(DP×CP, 128); a tied embedding/output weight gets a bucket of its own; buckets are
  ``max(4e7, 1e6·DP)`` elements with ``overlap_grad_reduce`` (only chunk 0 of pipeline stage 0),
  else one per chunk;
* optimizer: Adam's exp_avg/exp_avg_sq in fp32 plus fp32 main params when params are bf16, for
  every parameter — or, with the distributed optimizer, for the elements of this DP×CP rank's
  1/(DP×CP) slice of each bucket (padding excluded);
* activations: bytes autograd saves per micro batch (see :func:`layer_activation_bytes`) times
  the micro batches in flight on the stage under 1F1B / interleaved 1F1B;
* buffers: the working set of one layer's backward (two with full recompute), the last stage's
  logits gradient, the SP all-gather buffer, plus ``NON_TORCH_RESERVE_GIB`` outside torch's
  allocator (CUDA context, cuBLAS/NCCL workspaces).

A layout fits when (allocated + reserve) · (1 + ``FRAGMENTATION``) ≤ GPU memory (and, with optimizer offload, the
node's offloaded state ≤ ``HOST_MEMORY_FOR_OFFLOAD`` of its host memory).

Step time: TransformerEngine's layers kernel by kernel (:mod:`.compute_time`: GEMMs at the precision's peak, the
experts' grouped GEMMs, attention, elementwise and quantization traffic, host launches; fitted to the published runs
of docs/published-runs.csv, :mod:`.published`), or for megatron-core's local layers model FLOPs (+ recompute) at the
calibrated ``KERNEL_EFFICIENCY`` of dense BF16 peak (eager or compiled layers), on the slowest stage, a fixed cost per micro batch (grad accumulation, per-layer launches),
TP collectives (4 per layer per micro batch, 6 with full recompute) on NVLink, CP's
K/V ring hidden behind attention where it can be, pipeline p2p, the bubble (p−1)/(v·m) of
micro-batch times, the DP gradient reduce-scatter/all-gather (exposed beyond one micro batch's
backward when overlapped), and the optimizer step at HBM bandwidth. The single-GPU constants are fitted to
measured H100 throughputs (see the calibration block below). Collectives cost
``bytes·algorithm factor / bus bandwidth + latency`` on the link class their group spans
(megatron's rank order is TP fastest, then CP, DP, PP).

GPU table (``GPUS``): memory as ``nvidia-smi`` reports it, dense BF16 peak (datasheet, no
sparsity), HBM bandwidth (datasheet), NVLink and inter-node *bus* bandwidths as NCCL reaches them
(about 80 % of the link rate: NVLink 4 = 450 GB/s per direction → 360; NVLink 3 = 300 → 230;
one 400 Gb/s NDR NIC per GPU = 50 GB/s → 40; one 200 Gb/s HDR NIC per GPU = 25 GB/s → 20), and host ↔ GPU
copies at the same 80 % of the PCIe link (PCIe 5 x16 = 64 GB/s per direction → 50; PCIe 4 x16 = 32 → 25), and
the host memory of the DGX node of 8 (DGX H100/H200 and DGX A100 640GB: 2 TB; DGX A100 320GB: 1 TB).

Optimizer CPU offload (searched only when no layout fits without it): the offloaded fraction of a rank's optimizer
state leaves its memory; the step gains the host's Adam step over those elements (``HOST_ADAM_ELEMENTS_PER_S``) or
their gradients' and weights' PCIe copies, whichever is longer (megatron-core overlaps them group by group) —
uncalibrated on a GPU node.

The modules: :mod:`.layout` (a candidate and the model's per-rank dimensions under it), :mod:`.static_memory`
(parameters, gradient buffers, optimizer state), :mod:`.activations`, :mod:`.compute_time`, :mod:`.step_time`,
:mod:`.estimate` (memory, fit, time and MFU of one layout), :mod:`.search`, :mod:`.explain`, :mod:`.goodput` (the
checkpoint interval), :mod:`.published` (the published runs re-planned) and :mod:`.scaling`. Nothing here imports torch or megatron-core:
``python -m recipes.plan`` runs where they are not installed.
"""

from megatron_ext.planner.activations import (
    chunk_activation_bytes,
    layer_activation_bytes,
    microbatches_in_flight,
    mla_core_attention_bytes,
    offloaded_layer_bytes,
    stage_activation_bytes,
)
from megatron_ext.planner.estimate import (
    FRAGMENTATION,
    NON_TORCH_RESERVE_GIB,
    Estimate,
    estimate,
    stage_peak_bytes,
)
from megatron_ext.planner.explain import explain
from megatron_ext.planner.layout import GIB, Layout, RankShape, model_vocab_size
from megatron_ext.planner.search import (
    best_layout,
    candidate_layouts,
    detect_gpu,
    pipeline_splits,
    plan,
    planner_gpu,
)
from megatron_ext.planner.static_memory import checkpoint_bytes, rank_static_bytes, sharded_static
from megatron_ext.planner.step_time import (
    KERNEL_EFFICIENCY,
    compiled_layers,
    kernel_efficiency,
    stage_flops_per_token,
)

__all__ = [
    "FRAGMENTATION", "GIB", "KERNEL_EFFICIENCY", "NON_TORCH_RESERVE_GIB", "Estimate", "Layout", "RankShape",
    "best_layout", "candidate_layouts", "checkpoint_bytes", "chunk_activation_bytes", "compiled_layers", "detect_gpu",
    "estimate", "explain", "kernel_efficiency", "layer_activation_bytes", "microbatches_in_flight",
    "mla_core_attention_bytes", "model_vocab_size", "offloaded_layer_bytes", "pipeline_splits", "plan", "planner_gpu", "rank_static_bytes", "sharded_static",
    "stage_activation_bytes", "stage_flops_per_token", "stage_peak_bytes",
]
