"""One layout's estimate: its peak memory per pipeline stage, whether it fits, its step time and MFU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megatron_ext.config.kernels import block_mask_bytes
from megatron_ext.config.schema import RecipeConfig, ddp_bucket_size, microbatches_per_step, pipeline_stage_layers
from megatron_ext.config.shape import model_flops_per_token
from megatron_ext.hardware import GPUSpec
from megatron_ext.planner.activations import layer_activation_bytes, output_loss_bytes, stage_activation_bytes
from megatron_ext.planner.layout import GIB, Layout, RankShape
from megatron_ext.planner.static_memory import (
    expert_static,
    largest_layer_elements,
    optimizer_bytes_per_element,
    sharded_static,
    stage_chunks,
    stage_layer_indices,
    stage_static,
)
from megatron_ext.planner.step_time import kernel_efficiency, step_time

NON_TORCH_RESERVE_GIB = 2.0  # CUDA context + cuBLAS/NCCL workspaces: memory torch's allocator never sees
FRAGMENTATION = 0.05  # caching-allocator slack between allocated and reserved memory
HOST_BYTES_PER_OFFLOADED_ELEMENT = 16  # the host's fp32 weight, gradient and both Adam moments
# of a node's host memory the offloaded optimizer state may take: the rest is the OS's, the data loaders' and the
# page cache's, and the staging copies of asynchronous checkpoint saves
HOST_MEMORY_FOR_OFFLOAD = 0.75


@dataclass
class Estimate:
    """The planner's verdict on one layout."""

    layout: Layout
    memory: dict[str, float]  # bytes: params, grads, optimizer, activations, buffers, reserved, total
    peak_stage: int
    time: dict[str, float]  # seconds per step, by component, and "step"
    num_microbatches: int
    mfu: float
    tokens_per_s_per_gpu: float
    fits: bool
    gpu_memory: float
    # Megatron-FSDP layouts: the same layout's memory (bytes, by part as `memory`) with ZeRO-1 instead
    without_sharding: Optional[dict[str, float]] = None
    # Optimizer-offload layouts found by the search: the same layout's memory without offload
    without_offload: Optional[dict[str, float]] = None
    # the layout as the config values the estimate was made with (Layout.overrides): what to set to run it
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.label(), "overrides": self.overrides,
                "memory_gib": {k: round(v / GIB, 3) for k, v in self.memory.items()},
                "peak_stage": self.peak_stage, "time_s": {k: round(v, 4) for k, v in self.time.items()},
                "num_microbatches": self.num_microbatches, "mfu": round(self.mfu, 4),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1), "fits": self.fits}


class _Stages:
    """What every pipeline stage's memory of one layout shares, worked out once per estimate."""

    def __init__(self, cfg: RecipeConfig, vocab_size: int, world_size: int, grad_bytes: int):
        self.cfg, self.vocab_size, self.world_size, self.grad_bytes = cfg, vocab_size, world_size, grad_bytes
        self.layout, self.shape = Layout.of(cfg, world_size), RankShape.of(cfg, vocab_size)
        self.stages = tuple(pipeline_stage_layers(cfg))
        self.bucket_size = ddp_bucket_size(cfg, self.layout.dp)
        self._largest: dict[bool, float] = {}

    def largest_layer_activation(self, moe: bool) -> float:
        """The working set of the layer being back-propagated (recomputed or not: it is materialized then)."""
        if moe not in self._largest:
            cfg = self.cfg
            no_recompute = cfg if cfg.train.recompute_granularity is None else dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, recompute_granularity=None))
            self._largest[moe] = layer_activation_bytes(no_recompute, moe=moe)
        return self._largest[moe]

    def memory(self, pp_rank: int) -> dict[str, float]:
        cfg, layout, shape, stages = self.cfg, self.layout, self.shape, self.stages
        d_bytes, bucket_size = shape.bytes_per_value, self.bucket_size
        params, grads, owned = stage_static(shape, stages, layout.vpp, pp_rank, layout.dp, layout.distopt, bucket_size)
        if shape.experts:  # the worst dense shard and the worst expert shard, on one rank
            expert_params, expert_grads, expert_owned = expert_static(
                shape, self.world_size, stages, layout.vpp, pp_rank, layout.distopt, bucket_size)
            params, grads, owned = params + expert_params, grads + expert_grads, (max(owned) + max(expert_owned),)
        gathered = 0
        if layout.sharding:
            params, grads, shard, gathered = sharded_static(shape, layout.dp * layout.cp, layout.sharding,
                                                            layout.replicas, cfg.parallel.outer_dp_sharding_strategy)
            owned = (shard,)
        tokens = layout.mbs * shape.seq // layout.cp
        # Working set of the layer being back-propagated (and the one being recomputed, with full recompute).
        largest = max(self.largest_layer_activation(moe) for moe in {
            shape.model.is_moe_layer(layer) for layer in stage_layer_indices(stages, layout.vpp, pp_rank)})
        buffers = largest * (2 if layout.recompute == "full" else 1)
        if layout.sp:
            buffers += tokens * shape.hidden * d_bytes  # all-gathered input of one linear
        if layout.sharding:  # gathered layers, and one layer's unsharded gradients before their reduce-scatter
            buffers += (gathered + largest_layer_elements(shape)) * d_bytes
        if stage_chunks(stages, layout.vpp, pp_rank)[-1][2]:
            buffers += output_loss_bytes(cfg, shape, tokens)[1]
        if cfg.data.reset_attention_mask:  # document ids and FlexAttention's block mask, per micro batch
            buffers += block_mask_bytes(layout.mbs, shape.seq)
        # bf16 grads get fp32 copies for the optimizer shard only at step time, after activations are freed.
        # optimizer.optimizer_cpu_offload keeps that fraction of the state (fp32 master weights, moments) in host
        # memory.
        on_device = 1 - layout.offload
        mem = {
            "params": params * d_bytes, "grads": grads * self.grad_bytes,
            "optimizer": max(owned) * optimizer_bytes_per_element(shape) * on_device,
            "activations": stage_activation_bytes(cfg, self.vocab_size, self.world_size, pp_rank),
            "buffers": buffers, "reserved": NON_TORCH_RESERVE_GIB * GIB,
        }
        mem["total"] = sum(mem.values())
        mem["host"] = layout.offload * max(owned) * HOST_BYTES_PER_OFFLOADED_ELEMENT  # not on the GPU: not in the total
        return mem


def stage_memory(cfg: RecipeConfig, vocab_size: int, world_size: int, pp_rank: int,
                  grad_bytes: int) -> dict[str, float]:
    """Peak bytes on one pipeline stage (worst DP×CP rank), by category."""
    return _Stages(cfg, vocab_size, world_size, grad_bytes).memory(pp_rank)


def stage_peak_bytes(cfg: RecipeConfig, vocab_size: int, world_size: int, pp_rank: int) -> float:
    """Estimated peak bytes on pipeline stage `pp_rank` under `cfg`'s layout (fp32 gradient buffers, as run)."""
    return stage_memory(cfg, vocab_size, world_size, pp_rank, grad_bytes=4)["total"]


def estimate(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: GPUSpec, vocab_size: int,
             mfu: Optional[float] = None, grad_reduce_in_fp32: bool = True) -> Estimate:
    """Memory and step time of the layout `cfg` specifies on `world_size` GPUs.

    `mfu`: the layer kernels' fraction of dense BF16 peak; None = calibrated (:func:`kernel_efficiency`).

    `grad_reduce_in_fp32=False` is a what-if for bf16 grad buffers (as Megatron-Bridge's performance
    configs run); the recipe's ``wrap_with_ddp`` always reduces in fp32.
    """
    shape = RankShape.of(cfg, vocab_size)
    per_stage = _Stages(cfg, vocab_size, world_size, 4 if grad_reduce_in_fp32 else shape.bytes_per_value)
    layout, grad_bytes = per_stage.layout, per_stage.grad_bytes
    stages = [per_stage.memory(r) for r in range(layout.pp)]
    peak_stage = max(range(layout.pp), key=lambda r: stages[r]["total"])
    memory = stages[peak_stage]
    fits = (memory["total"] * (1 + FRAGMENTATION) <= gpu.memory_gib * GIB
            and memory["host"] <= HOST_MEMORY_FOR_OFFLOAD * gpu.host_memory_gib * GIB)
    time = step_time(cfg, vocab_size, world_size, gpus_per_node, gpu, mfu or kernel_efficiency(cfg), grad_bytes)
    tokens = cfg.train.global_batch_size * shape.seq
    model_flops = model_flops_per_token(cfg, vocab_size) * tokens
    mfu_est = model_flops / (time["step"] * world_size * gpu.peak_bf16_tflops * 1e12)
    m = microbatches_per_step(cfg, world_size)
    return Estimate(layout, memory, peak_stage, time, m, mfu_est, tokens / time["step"] / world_size, fits,
                    gpu.memory_gib * GIB, overrides=layout.overrides(cfg))
