"""Mixture-of-Experts layers: the recipe's ``model.moe_*`` keys as megatron-core's MoE settings (its MoELayer, router
and token dispatchers build and run the experts), and what the recipe adds around them.

An MoE recipe's decoder layers are MoE layers (all of them in Mixtral and Qwen3-MoE; those ``model.moe_layer_freq``
marks, e.g. all but DeepSeek-V3's first three, the others dense): attention as in the dense model, then a router
choosing ``moe_router_topk`` of ``num_moe_experts`` SwiGLU experts per token, split over the expert-parallel ranks
(``parallel.expert_model_parallel_size``) and, inside each expert, over ``expert_tensor_parallel_size``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config.schema import RecipeConfig, expert_tensor_parallel_size
from megatron_ext.config.shape import ModelShape, moe_layer_pattern
from megatron_ext.model.hybrid import decoder_layer_count


def moe_transformer_config(cfg: RecipeConfig) -> dict[str, Any]:
    """megatron-core TransformerConfig fields for the recipe's MoE keys ({} for a dense model)."""
    m, p = cfg.model, cfg.parallel
    if m.num_moe_experts is None:
        return {}
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_layer_freq=m.moe_layer_freq if isinstance(m.moe_layer_freq, int) else list(m.moe_layer_freq),
        moe_ffn_hidden_size=ModelShape.of(m).expert_ffn_hidden_size,
        moe_router_topk=m.moe_router_topk,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        # router logits and top-k in fp32 whatever the training precision: bf16 scores tie and flip choices
        moe_router_dtype="fp32",
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_token_drop_policy=m.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_flex_dispatcher_backend=m.moe_flex_dispatcher_backend,  # read with the flex dispatcher only
        moe_router_force_load_balancing=m.moe_router_force_load_balancing,
        # the 1F1B schedule's overlapped all-to-alls (training/micro_batch.py builds its schedule plan)
        overlap_moe_expert_parallel_comm=p.overlap_moe_expert_parallel_comm,
        moe_grouped_gemm=m.moe_grouped_gemm is True,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size(cfg),
    )


def describe_moe(chunks: list[torch.nn.Module], config: Any) -> str:
    """The start-up line for an MoE model, read from the built layers and their TransformerConfig."""
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers if hasattr(layer.mlp, "router")]
    if not layers:
        return "MoE: no MoE layer on this rank"
    mlp = layers[0].mlp
    balance = config.moe_router_load_balancing_type
    balance = (f"{balance} × {config.moe_aux_loss_coeff:g}" if balance != "none" else "no aux loss") + (
        ", expert bias" if config.moe_router_enable_expert_bias else "")
    capacity = config.moe_expert_capacity_factor
    shared = config.moe_shared_expert_intermediate_size
    groups = (f" from the best {config.moe_router_group_topk} of {config.moe_router_num_groups} groups"
              if config.moe_router_num_groups else "")
    scaling = config.moe_router_topk_scaling_factor
    pattern = moe_layer_pattern(config.moe_layer_freq, decoder_layer_count(config))
    dispatcher = config.moe_token_dispatcher_type + (
        f" ({config.moe_flex_dispatcher_backend})" if config.moe_token_dispatcher_type == "flex" else "") + (
        " dispatcher, its all-to-alls overlapped with another micro batch's compute"
        if config.overlap_moe_expert_parallel_comm else " dispatcher")
    if config.moe_router_force_load_balancing:
        balance += "; FORCED load balancing (benchmark mode: random router scores, not a real run)"
    where = "per layer" if all(pattern) else f"in {sum(pattern)} of the {len(pattern)} layers (the others dense)"
    return (f"MoE: {config.num_moe_experts} experts {where}, top-{config.moe_router_topk}{groups} "
            f"({config.moe_router_score_function}{f', weights × {scaling:g}' if scaling else ''}); "
            f"{mlp.num_local_experts} on this rank as "
            f"{type(mlp.experts).__name__}; {dispatcher}; {balance}; "
            + ("dropless" if capacity is None else f"capacity factor {capacity:g} ({config.moe_token_drop_policy})")
            + (f"; shared experts of width {shared}" if shared else ""))


def reduce_experts_over_expert_data_parallel(chunks: list[torch.nn.Module]) -> None:
    """Mark every expert weight expert-parallel, also at EP1.

    megatron-core marks them so (``allreduce=False``: the expert-DP gradient buffers and the experts' own distributed
    optimizer) only when expert_model_parallel_size > 1 or the expert TP size differs from TP (0.19.2). At EP1 with
    one TP size they would join the dense parameters' buffers and optimizer: a checkpoint's optimizer state would then
    have another structure than at EPn (one optimizer instead of megatron-core's chained dense + expert pair), so it
    could not move between EP1 and EPn.
    """
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):  # its routed experts (local or TE layers); shared experts stay dense
                for param in module.experts.parameters():
                    param.allreduce = False


def expert_biases(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The routers' learned expert biases (auxiliary-loss-free balancing), which the end of every step updates."""
    return [module.expert_bias for chunk in chunks for module in chunk.modules()
            if getattr(module, "expert_bias", None) is not None]


class ExpertOutputLinear(RowParallelLinear):
    """A local expert's down-projection whose output is its own tensor.

    With biased experts (GPT-OSS) megatron-core 0.19.2's ``MLP.forward`` adds the routing-weighted bias to this
    layer's output in place (mlp.py: ``output += output_bias ...``), but the output is what its tensor-parallel
    reduce returned as-is, which autograd refuses to modify in place ("is a view and is being modified inplace"):
    every biased local expert fails in training. A copy per expert output (only for biased experts) lets it add."""

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return (output.clone() if bias is not None else output), bias


def give_biased_experts_their_own_output(layer: ModuleSpec) -> None:
    """In a local MoE layer spec (`layer`, megatron-core's get_gpt_layer_local_spec), the routed experts'
    down-projection as :class:`ExpertOutputLinear`."""
    experts = layer.submodules.mlp.keywords["submodules"].experts
    experts.keywords["submodules"].linear_fc2 = ExpertOutputLinear
