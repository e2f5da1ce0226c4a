"""Activation offload: megatron-core's fine-grained activation offloading, switched on by train.offload_modules.

megatron-core does the work (``pipeline_parallel/fine_grained_activation_offload.py``): the tensors autograd saves
inside the named modules are copied to host memory on a side stream after each layer's forward and copied back before
its backward. This module owns what the recipe adds around it: the precondition (TransformerEngine's offload flag
module on a GPU), CPU rehearsal's stand-ins for that flag and for the device, and the start-up line that says what
moved, read from megatron-core's offload manager after the first step.
"""

from __future__ import annotations

import types

import torch

from megatron_ext.config.schema import RecipeConfig

MIB = 2**20
NOTHING_OFFLOADED = "none: every saved tensor is below train.min_offloaded_tensor_size"


def prepare(cfg: RecipeConfig, on_gpu: bool) -> None:
    """Before the model runs: megatron-core's offload context raises without TE's ``cpu_offload`` module, whose
    ``CPUOffloadEnabled`` flag tells TE's layers that their saved tensors are being offloaded. On a GPU that must be
    the real TE; in CPU rehearsal (no TE layers to tell) a plain flag holder stands in for it, and the host's tensors
    are the ones offloaded (to more host memory)."""
    if not cfg.train.offload_modules:
        return
    if on_gpu:  # TransformerEngine's own cpu_offload (config.kernels refused a GPU run without it)
        return
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.pipeline_parallel import fine_grained_activation_offload

    if te_extension.cpu_offload is None:
        te_extension.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)
    fine_grained_activation_offload.ChunkOffloadHandler._can_manage_tensor_for_offload = staticmethod(
        _can_manage_host_tensor)


def _can_manage_host_tensor(tensor: torch.Tensor) -> bool:
    """megatron-core 0.19.2's rule (``ChunkOffloadHandler._can_manage_tensor_for_offload``: not a parameter, not a
    fake or functional tensor, on the device) with the host as the device: its rule takes CUDA tensors only, so in
    CPU rehearsal nothing would be offloaded."""
    stray = (torch._subclasses.fake_tensor.FakeTensor, torch._subclasses.functional_tensor.FunctionalTensor)
    return not isinstance(tensor, (torch.nn.Parameter, *stray)) and tensor.device.type == "cpu"


def describe() -> str:
    """What megatron-core moved to host memory on this rank during the first step (its offload manager's summary:
    the bytes held on the host at once, until the first backward pass), per module."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    manager = PipelineOffloadManager.get_instance()
    per_module = manager.offload_summary_bytes
    parts = ", ".join(f"{name} {size / MIB:.1f} MiB" for name, size in sorted(per_module.items()))
    return (f"activation offload: {manager.offload_summary_total_bytes / MIB:.1f} MiB of saved activations held in "
            f"host memory at once on this rank ({parts or NOTHING_OFFLOADED}), copied back before each backward pass")
