"""Seconds per training step by component: compute at the calibrated kernel efficiency, per-micro-batch costs, TP /
CP / MoE / PP communication, the bubble, the DP gradient sync, the optimizer step and its offload."""

from __future__ import annotations

from typing import Iterable, Optional

from megatron_ext.config.kernels import compiles_layers
from megatron_ext.config.schema import RecipeConfig, ddp_bucket_size, microbatches_per_step, pipeline_stage_layers
from megatron_ext.hardware import GPUSpec
from megatron_ext.planner.compute_time import te_compute_seconds
from megatron_ext.planner.layout import Layout, RankShape
from megatron_ext.planner.muon import muon_seconds
from megatron_ext.planner.static_memory import (
    expert_static,
    model_elements,
    mtp_layers,
    stage_layer_indices,
    stage_static,
)

LATENCY_INTRA_S = 8e-6  # per collective or p2p message inside a node
LATENCY_INTER_S = 25e-6  # per collective or p2p message across nodes
# Calibration of the single-GPU costs, fitted to the eight throughputs measured on one H100 80GB (torch 2.11,
# megatron-core 0.16.1, no TE; docs/measurements/h100-2026-11-23.md §2-3): the 1.2B benchmark shape
# (one micro batch per step: eager mbs 1; compiled mbs 1, 2, 4) and configs/llama3_2_1b_1gpu_bf16.yaml (global
# batch 64: eager and compiled, mbs 2 and 4). With these constants every one is predicted within 5 %
# (tests/unit/test_planner.py holds them).
KERNEL_EFFICIENCY = {"eager": 0.393, "compiled": 0.482}  # of dense BF16 peak, by the model's (causal) FLOP count
LAYER_OVERHEAD_S = 0.5e-3  # per layer per micro batch: launches and small ops the FLOP count does not see
GRAD_ACCUMULATE_BYTES = 10  # per parameter per micro batch: fp32 main_grad += bf16 grad (read 4 + 2, write 4)
# per owned element per step at HBM bandwidth: AdamW over fp32 master weights (11.8 ms), the bf16 copy of the
# updated weights (2.7 ms) and the grad-norm passes (3.4 ms) profiled for 1.24 B parameters: 17.9 ms.
OPTIMIZER_BYTES_PER_ELEMENT = 48
# torch's fused CPU AdamW, which megatron-core's HybridDeviceOptimizer steps the offloaded state with: 2.2-2.4 G
# elements/s measured on one and two cores of the project's 2-core AMD EPYC VM (2026-11-24, torch 2.13.0)
HOST_ADAM_ELEMENTS_PER_S = 2.0e9
OFFLOAD_COPY_BYTES = 4  # per offloaded element and direction: its fp32 gradient to the host, its fp32 weight back
CP_STEP_LAUNCH_S = 10e-6  # per ring step of context-parallel attention: extra kernel launches and sync
# Of the link's bus bandwidth an MoE token dispatch reaches, (on NVLink, on the network): DeepEP's published kernels
# ~95 % of both (its README: 153 of 160 GB/s NVLink, 43-58 of 50 GB/s RDMA on H800), HybridEP as DeepEP; NCCL's
# all-to-all (and the all-gather dispatcher) fit — on the network the NIC is the bottleneck either way
DISPATCH_EFFICIENCY = {"deepep": (0.95, 0.95), "hybridep": (0.95, 0.95), "alltoall": (0.3, 0.84),
                       "allgather": (0.3, 0.84)}


def stage_flops_per_token(shape: RankShape, layers: Iterable[int], output_layer: bool,
                          recompute: Optional[str]) -> float:
    """Forward+backward FLOPs per token of decoder `layers` (numbered from 0 in the whole model; and the output
    layer and the MTP layers after it) plus recompute: the model's own count (:class:`ModelShape`), on the padded
    vocabulary as the run log counts it."""
    model = shape.model
    output = model.output_layer_flops_per_token(shape.vocab) + model.mtp_flops_per_token(shape.vocab) if (
        output_layer) else 0.0
    return model.layers_flops_per_token(layers, recompute=recompute) + output


def ring_seconds(bytes_: float, n: int, bus_gb_s: float, latency: float, factor: float = 1.0) -> float:
    """Seconds for a ring collective over n ranks moving `bytes_` (factor 2 for all-reduce)."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) / n * bytes_ / (bus_gb_s * 1e9) + latency


def all_to_all_seconds(cfg: RecipeConfig, routed_bytes: float, ep: int, etp: int, gpus_per_node: int,
                       gpu: GPUSpec) -> float:
    """One dispatch (or combine) of `routed_bytes` per rank over EP (expert ranks: ETP fastest, then EP): the share
    bound for peers in this rank's NVLink domain on NVLink, the rest on the network, both at once, at the
    dispatcher's efficiency."""
    if ep <= 1:
        return 0.0
    nvlink_peers = max(1, min(ep, max(gpus_per_node, gpu.nvlink_domain) // etp))  # this rank included
    near = routed_bytes * (nvlink_peers - 1) / ep / (gpu.nvlink_gb_s * 1e9)
    far = routed_bytes * (ep - nvlink_peers) / ep / (gpu.internode_gb_s * 1e9)
    m = cfg.model
    kernels = m.moe_flex_dispatcher_backend if m.moe_token_dispatcher_type == "flex" else m.moe_token_dispatcher_type
    on_nvlink, on_network = DISPATCH_EFFICIENCY[kernels]
    return max(near / on_nvlink, far / on_network) + (LATENCY_INTER_S if far else LATENCY_INTRA_S)


def compiled_layers(cfg: RecipeConfig) -> bool:
    """Whether the recipe runs `cfg` with compiled layers on a GPU, as its start-up resolves train.compile (never in
    TransformerEngine's layers, :func:`te_layers`). Graphed eager layers are planned at the eager efficiency."""
    return compiles_layers(cfg, on_gpu=True, use_te=te_layers(cfg))


def te_layers(cfg: RecipeConfig) -> bool:
    """Whether the plan runs TransformerEngine's layers, timed kernel by kernel (:mod:`.compute_time`):
    model.attention_backend=te, and `auto`, which the GPU cluster's NGC container resolves to TE; `local` runs
    megatron-core's own layers at the H100-calibrated efficiency of :data:`KERNEL_EFFICIENCY`."""
    return cfg.model.attention_backend != "local"


def kernel_efficiency(cfg: RecipeConfig) -> float:
    """The calibrated fraction of peak the layer kernels reach under `cfg`'s compile choice."""
    return KERNEL_EFFICIENCY["compiled" if compiled_layers(cfg) else "eager"]


def step_time(cfg: RecipeConfig, vocab_size: int, world_size: int, gpus_per_node: int, gpu: GPUSpec,
               mfu: float, grad_bytes: int) -> dict[str, float]:
    """Seconds per training step, by component (see the module docstring)."""
    layout, shape = Layout.of(cfg, world_size), RankShape.of(cfg, vocab_size)
    tp, pp, cp, dp, v = layout.tp, layout.pp, layout.cp, layout.dp, layout.vpp or 1
    d_bytes = shape.bytes_per_value
    m = microbatches_per_step(cfg, world_size)
    tokens = layout.mbs * shape.seq // cp  # per CP rank per micro batch

    def link(span: int) -> tuple[float, float]:
        """(bus GB/s, latency) of a group spanning `span` consecutive ranks (TP fastest, then CP, DP, PP): NVLink
        within a node or the NVLink domain it belongs to (an NVL72 rack's 72 GPUs), the network beyond."""
        nvlink = max(gpus_per_node, gpu.nvlink_domain)
        return (gpu.nvlink_gb_s, LATENCY_INTRA_S) if span <= nvlink else (gpu.internode_gb_s, LATENCY_INTER_S)

    peak = gpu.peak_bf16_tflops * 1e12 * mfu
    # one micro batch through the slowest stage (its layers, the last's with the output layer), fwd + bwd
    stages = tuple(pipeline_stage_layers(cfg))
    flops, last, slowest = max((stage_flops_per_token(shape, indices, r == pp - 1, layout.recompute), r == pp - 1,
                                indices) for r in range(pp) for indices in [stage_layer_indices(stages, layout.vpp, r)])
    if last:  # the last stage, with the MTP layers
        slowest = [*slowest, *mtp_layers(shape)]
    layers, moe_layers = len(slowest), sum(shape.model.is_moe_layer(layer) for layer in slowest)
    flops *= layout.mbs * shape.seq
    if te_layers(cfg):
        kernels = te_compute_seconds(cfg, shape, slowest, last, gpu, tokens)
        compute, launches = sum(kernels.values()) - kernels["launch"], kernels["launch"]
        gemm = kernels["gemm"]
    else:
        compute, launches, kernels = flops / (tp * cp) / peak, layers * LAYER_OVERHEAD_S, {}
        gemm = compute

    bw, lat = link(tp)
    collectives = 6 if layout.recompute == "full" else 4  # AR (or AG+RS with SP) ×2 forward, ×2 backward
    tp_comm = layers * collectives * ring_seconds(tokens * shape.hidden * d_bytes, tp, bw, lat, 2.0)

    cp_comm = 0.0
    if cp > 1:
        bw, lat = link(tp * cp)
        kv = tokens * shape.model.key_value_channels // tp * d_bytes
        ring = 3 * (cp - 1) * (kv / (bw * 1e9) + lat)  # K/V forward, K/V + dK/dV backward
        attention = shape.model.attention_flops_per_token() * layout.mbs * shape.seq / (tp * cp) / peak
        # Each of the 2·CP block steps (forward, backward) launches its own kernels and rescales the
        # partial output with the new log-sum-exp: a memory-bound pass over the fp32 output.
        rescale = tokens * shape.heads * shape.model.value_head_dim // tp * 4 * 3 / (gpu.hbm_tb_s * 1e12)
        cp_comm = layers * (max(0.0, ring - attention) + 2 * cp * (CP_STEP_LAUNCH_S + rescale))

    moe_comm = 0.0
    if shape.experts:  # per MoE layer: dispatch and combine all-to-alls, forward and backward, over EP
        sequence_tokens = tokens // (tp if layout.sp else 1)
        routed = sequence_tokens * shape.topk * shape.hidden * d_bytes
        moe_comm = moe_layers * 4 * all_to_all_seconds(cfg, routed, shape.ep, shape.etp, gpus_per_node, gpu)
        if shape.etp > 1:  # the routed tokens gathered over expert TP and their outputs reduce-scattered back
            bw, lat = link(shape.etp)
            moe_comm += moe_layers * 4 * ring_seconds(routed * shape.etp, shape.etp, bw, lat)

    p2p = 0.0
    if pp > 1:
        bw, lat = link(tp * cp * dp + 1)  # the next stage is tp·cp·dp ranks away
        sent = tokens // (tp if layout.sp else 1) * shape.hidden * d_bytes
        p2p = v * 2 * (sent / (bw * 1e9) + lat)

    # Grads are reduced over DP×CP: distopt = reduce-scatter + param all-gather, else all-reduce.
    bucket_size = ddp_bucket_size(cfg, dp)
    params, grads, owned = stage_static(shape, stages, layout.vpp, 0, dp, layout.distopt, bucket_size)
    expert_dp = shape.expert_dp(world_size, pp)
    expert_params, expert_grads, expert_owned = expert_static(shape, world_size, stages, layout.vpp, 0, layout.distopt,
                                                               bucket_size)
    # What a micro batch costs besides its FLOPs: why small micro batches are slow (measured mbs 1 → 4: 1.45×)
    # (TE fuses the accumulation into its weight-gradient GEMMs)
    accumulate = 0.0 if kernels else (params + expert_params) * GRAD_ACCUMULATE_BYTES / (gpu.hbm_tb_s * 1e12)
    overhead = accumulate + launches
    if cfg.parallel.tp_comm_overlap:  # TE's userbuffers hide the TP collectives behind the GEMMs that need them
        tp_comm = max(0.0, tp_comm - gemm)
    if cfg.parallel.overlap_moe_expert_parallel_comm:  # one micro batch's all-to-alls behind another's compute
        moe_comm = max(0.0, moe_comm - compute)

    per_microbatch = compute + overhead + tp_comm + cp_comm + moe_comm + p2p
    bubble = per_microbatch * (pp - 1) / v

    expert_reduce = expert_gather = 0.0
    if shape.experts:  # the experts' gradients are reduced over expert-DP, their state sharded over it
        bw, lat = link(world_size // pp)
        factor = 1.0 if layout.distopt else 2.0  # reduce-scatter (and the parameters' all-gather), or all-reduce
        expert_reduce = ring_seconds(expert_grads * grad_bytes, expert_dp, bw, lat, factor)
        expert_gather = ring_seconds(expert_grads * d_bytes, expert_dp, bw, lat) if layout.distopt else 0.0
    bw, lat = link(tp * cp * dp)
    if layout.sharding:  # Megatron-FSDP: per micro batch, overlapped layer by layer with compute (uncalibrated)
        # this stage's share of the parameters (PP > 1: the stages shard and gather their own layers)
        whole, group = model_elements(shape) // pp, dp * cp // layout.replicas  # HSDP: within a group
        bw, lat = link(tp * group)
        traffic = ring_seconds(whole * grad_bytes, group, bw, lat)  # the gradients' reduce-scatter
        if layout.sharding == "optim_grads_params":
            traffic += 2 * ring_seconds(whole * d_bytes, group, bw, lat)  # parameters gathered for forward and backward
        reduce = m * max(traffic - compute, traffic / max(layers, 1))
        gather = 0.0 if layout.sharding == "optim_grads_params" else ring_seconds(whole * d_bytes, group, bw, lat)
        if layout.replicas > 1:  # once per step: the group's gradient shard all-reduced across the replicas
            bw, lat = link(tp * cp * dp)
            reduce += ring_seconds(-(-whole // group) * grad_bytes, layout.replicas, bw, lat, 2.0)
        reduce, gather = reduce + expert_reduce, gather + expert_gather
    else:
        if layout.distopt:
            reduce = ring_seconds(grads * grad_bytes, dp * cp, bw, lat) + expert_reduce
            gather = ring_seconds(params * d_bytes, dp * cp, bw, lat) + expert_gather
        else:
            reduce, gather = ring_seconds(grads * grad_bytes, dp * cp, bw, lat, 2.0) + expert_reduce, 0.0
        if cfg.parallel.overlap_grad_reduce:  # megatron-core's buckets, the experts' among them
            reduce = max(0.0, reduce - 2 / 3 * compute)  # hidden behind the last micro batch's backward
        if cfg.parallel.overlap_param_gather and layout.distopt:
            gather = max(0.0, gather - 1 / 3 * compute)  # hidden behind the next step's first forward
    owned_max = max(owned) + (max(expert_owned) if shape.experts else 0)
    optimizer = (1 - layout.offload) * owned_max * OPTIMIZER_BYTES_PER_ELEMENT / (gpu.hbm_tb_s * 1e12) + muon_seconds(
        cfg, shape, slowest, dp * cp, gpu)
    hosted = layout.offload * owned_max  # the host's Adam step overlapped with the copies to and from it
    offload = max(hosted / HOST_ADAM_ELEMENTS_PER_S, hosted * OFFLOAD_COPY_BYTES / (gpu.pcie_gb_s * 1e9))
    time = {"compute": compute * m, "overhead": overhead * m, "tp_comm": tp_comm * m, "cp_comm": cp_comm * m,
            "moe_comm": moe_comm * m, "pp_p2p": p2p * m,
            "pp_bubble": bubble, "dp_comm": reduce + gather, "optimizer": optimizer, "offload": offload}
    time["step"] = sum(time.values())
    return time
