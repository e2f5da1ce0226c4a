"""The run's megatron-core optimizer: its config from the recipe, optimizer CPU offload (megatron-core's
HybridDeviceOptimizer, with CPU rehearsal's stand-ins), the torch AdamW kernel, a gradient norm that stays on the
device, and what the start-up log says."""

from __future__ import annotations

import contextlib

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.checkpoint.compat import is_adam, is_torch_adam, megatron_optimizers
from megatron_ext.config.schema import RecipeConfig, lr_decay_iterations
from megatron_ext.distributed import cpu_backend
from megatron_ext.model.llama import PARAMETER_DTYPES

OFFLOADED_BYTES_PER_ELEMENT = 12  # fp32 master weight + two fp32 Adam moments


def optimizer_config(cfg: RecipeConfig) -> OptimizerConfig:
    o, t = cfg.optimizer, cfg.train
    muon = o.name == "muon"
    return OptimizerConfig(
        optimizer=o.name, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        bf16=t.precision == "bf16", fp16=t.precision == "fp16", params_dtype=PARAMETER_DTYPES[t.precision],
        initial_loss_scale=t.initial_loss_scale, min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window, hysteresis=t.hysteresis,
        # Muon's distributed optimizer is megatron-core's layer-wise one (whole matrices per DP rank: Newton-Schulz
        # needs a matrix whole); megatron-core's DDP then all-reduces the gradients (parallel.ddp_config)
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer and not muon,
        use_layer_wise_distributed_optimizer=cfg.parallel.use_distributed_optimizer and muon,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        # megatron-core's offload reuses the precision-aware optimizer's path (as Megatron-LM requires it)
        optimizer_cpu_offload=o.optimizer_cpu_offload, use_precision_aware_optimizer=o.optimizer_cpu_offload,
        optimizer_offload_fraction=o.optimizer_offload_fraction,
        muon_momentum=o.muon_momentum, muon_nesterov=o.muon_nesterov, muon_num_ns_steps=o.muon_num_ns_steps,
        muon_scale_mode=o.muon_scale_mode, muon_extra_scale_factor=o.muon_extra_scale_factor,
        muon_split_qkv=o.muon_split_qkv, muon_tp_mode=o.muon_tp_mode, muon_fp32_matmul_prec=o.muon_fp32_matmul_prec,
    )


def build_scheduler(cfg: RecipeConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """megatron-core's LR (and weight-decay) schedule for `cfg`. A resumed run follows the current config's schedule
    (train_iters raised to go on, say), not the checkpoint's."""
    o, t = cfg.optimizer, cfg.train
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters, lr_decay_steps=lr_decay_iterations(cfg),
        lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=max(t.train_iters, 1), wd_incr_style="constant",
        wsd_decay_steps=o.lr_wsd_decay_iters, lr_wsd_decay_style=o.lr_wsd_decay_style,
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )


def offload_stand_ins(cfg: RecipeConfig, model_chunks: list, on_gpu: bool) -> contextlib.AbstractContextManager:
    """CPU rehearsal's stand-ins for megatron-core's optimizer offload, wherever it (re)builds its host copies: when
    the optimizer is built and when a checkpoint is loaded into it."""
    if on_gpu or not cfg.optimizer.optimizer_cpu_offload:
        return contextlib.nullcontext()
    return cpu_backend.host_offload_stand_ins(model_chunks)


def _l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
             *args) -> tuple[torch.Tensor, None]:
    """The L2 norm of a list of tensors, as megatron-core's local fallback computes it (each tensor's norm, then
    the norm of those, in fp32) but left on the device: [1] tensor."""
    norms = [torch.norm(tensor) for tensor in tensor_lists[0]]
    return torch.norm(torch.stack(norms)).reshape(1).float(), None


def _scale_by_tensor(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                     scale: torch.Tensor) -> None:
    """dst = src × scale with `scale` a device tensor (the clip coefficient)."""
    for src, dst in zip(*tensor_lists):
        dst.copy_(src * scale)


def keep_grad_norm_on_device() -> None:
    """megatron-core's gradient clipping keeps the norm and the clip coefficient on the device only with
    TransformerEngine's multi-tensor kernels; its other paths read the norm to the host every step (the local
    fallback converts each tensor's norm to a Python float). Without TE this gives it device-side equivalents, so a
    training step that does not log never waits for the device (:mod:`megatron_ext.training.pending_steps`)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.multi_tensor_scale_tensor_impl is not None:  # TE's kernels: already on the device
        return
    clip_grads.multi_tensor_scale_tensor_impl = _scale_by_tensor
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:  # apex's kernel stays: it is a device op
        clip_grads.l2_norm_impl = _l2_norm


def build_optimizer(cfg: RecipeConfig, model_chunks: list, on_gpu: bool) -> MegatronOptimizer:
    """megatron-core's optimizer for the model; with optimizer.optimizer_cpu_offload its HybridDeviceOptimizer."""
    keep_grad_norm_on_device()
    with offload_stand_ins(cfg, model_chunks, on_gpu):
        optimizer = get_megatron_optimizer(optimizer_config(cfg), model_chunks)
    if cfg.parallel.outer_dp_sharding_strategy == "optim":
        # megatron-core 0.19.2 sums the gradient norm over one HSDP replica's ranks, but with the optimizer sharded
        # across the replicas each rank's gradient shard is its own: only the sum over every rank is the norm
        # (measured at DP4 in 2 replicas: 1.23 for 3.13, so clipping scaled the step wrongly). Megatron-FSDP runs
        # at PP=1, so every rank is TP×CP×DP: the world.
        for inner in megatron_optimizers(optimizer):
            inner.grad_stats_parallel_group = None  # megatron-core's all-reduce over the default group
    return optimizer


def describe_offload(optimizer: MegatronOptimizer) -> str:
    """Where megatron-core's HybridDeviceOptimizer keeps this rank's optimizer state, read from its host copies."""
    hybrid = optimizer.optimizer
    total = sum(p.numel() for group in hybrid.param_groups for p in group["params"])
    host = sum(p.numel() for p in hybrid.gpu_params_map_cpu_copy)
    share = 100 * host / max(total, 1)
    stepper = type(hybrid.cpu_optimizers[0]).__name__ if hybrid.cpu_optimizers else "AdamW"
    return (f"optimizer CPU offload: {host:,} of this rank's {total:,} optimizer elements ({share:.0f} %, "
            f"{host * OFFLOADED_BYTES_PER_ELEMENT / 2**30:.2f} GiB of fp32 weights and Adam moments) live in host "
            f"memory and are stepped by torch {stepper} on the CPU")


def select_torch_adam_kernel(optimizer: MegatronOptimizer, fused: bool) -> None:
    """Pick the update kernel of megatron-core's torch AdamW fallback (no TE/apex): torch's fused
    kernel (one pass over params, grads and moments) or torch's default (foreach on GPU, several
    passes). TE/apex FusedAdam is left alone."""
    for opt in megatron_optimizers(optimizer):
        inner = opt.optimizer
        if not is_torch_adam(inner):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = fused, False if fused else None
            for param in group["params"]:
                state = inner.state[param]
                if fused and "step" in state:  # the fused kernel reads the step count on the param's device
                    state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def _muon_split(optimizer: MegatronOptimizer) -> str:
    """Which parameters Muon steps and which take megatron-core's Adam fallback, counted on this rank."""
    counts = {"muon": [0, 0], "adam": [0, 0]}
    for opt in megatron_optimizers(optimizer):
        kind = "adam" if is_adam(opt.optimizer) else "muon"
        for group in opt.optimizer.param_groups:
            counts[kind][0] += len(group["params"])
            counts[kind][1] += sum(p.numel() for p in group["params"])
    (muon, muon_numel), (adam, adam_numel) = counts["muon"], counts["adam"]
    return (f"Muon on {muon} matrices ({muon_numel:,} parameters) and megatron-core's Adam fallback on {adam} "
            f"embedding, output-layer, norm and bias tensors ({adam_numel:,}) held by this rank")


def update_kernel(optimizer: MegatronOptimizer) -> str:
    """Which optimizer updates the weights (for Muon: which parameters it steps), for the start-up log."""
    if not all(is_adam(opt.optimizer) for opt in megatron_optimizers(optimizer)):
        return _muon_split(optimizer)
    inner = megatron_optimizers(optimizer)[0].optimizer
    if not is_torch_adam(inner):
        return f"{type(inner).__module__.split('.')[0]} {type(inner).__name__}"  # TE's or apex's FusedAdam
    kernel = "fused kernel" if inner.param_groups[0].get("fused") else "torch's default kernel (foreach on GPU)"
    return f"torch {type(inner).__name__}, {kernel}"
