"""Mixture-of-Experts layers: the recipe's ``model.moe_*`` keys as megatron-core's MoE settings (its MoELayer, router
and token dispatchers build and run the experts), and what megatron-core 0.16.1 needs around them here.

Every decoder layer of an MoE recipe is an MoE layer (Mixtral, Qwen3-MoE): attention as in the dense model, then a
router choosing ``moe_router_topk`` of ``num_moe_experts`` SwiGLU experts per token, split over the expert-parallel
ranks (``parallel.expert_model_parallel_size``) and, inside each expert, over ``expert_tensor_parallel_size``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

from megatron_ext.config.schema import RecipeConfig, expert_tensor_parallel_size
from megatron_ext.config.shape import ModelShape


def moe_transformer_config(cfg: RecipeConfig) -> dict[str, Any]:
    """megatron-core TransformerConfig fields for the recipe's MoE keys ({} for a dense model)."""
    m, p = cfg.model, cfg.parallel
    if m.num_moe_experts is None:
        return {}
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_ffn_hidden_size=ModelShape.of(m).expert_ffn_hidden_size,
        moe_router_topk=m.moe_router_topk,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        # router logits and top-k in fp32 whatever the training precision: bf16 scores tie and flip choices
        moe_router_dtype="fp32",
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_token_drop_policy=m.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=m.moe_grouped_gemm is True,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size(cfg),
    )


def prepare_moe_layers() -> None:
    """What megatron-core 0.16.1's MoE code needs to run here, applied before the model is built.

    * Without TransformerEngine, ``moe_utils`` leaves ``te_general_gemm`` undefined (its import guard sets no
      fallback), and the router's fp32 gating GEMM then raises NameError: define it as absent.
    * Under the per-token loss (``calculate_per_token_loss``, this recipe's), megatron-core scales the load-balancing
      loss of each rank by that rank's own token count, which under sequence or context parallelism is 1/(TP·CP) of
      the micro batch's: the aux-loss gradient would shrink with TP and CP (Megatron-LM issue 1652, fixed upstream
      after 0.16.1 by the same factor). The scale the pipeline schedule sets is multiplied by the TP×CP size.
    """
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if getattr(MoEAuxLossAutoScaler.set_loss_scale, "scaled_by_tp_cp", False):
        return
    set_loss_scale = MoEAuxLossAutoScaler.set_loss_scale

    def set_loss_scale_for_every_token(scale: torch.Tensor) -> None:
        tp_cp = parallel_state.get_tensor_and_context_parallel_world_size()
        set_loss_scale(scale * tp_cp)

    set_loss_scale_for_every_token.scaled_by_tp_cp = True
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(set_loss_scale_for_every_token)


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
    return (f"MoE: {config.num_moe_experts} experts per layer, top-{config.moe_router_topk} "
            f"({config.moe_router_score_function}); {mlp.num_local_experts} on this rank as "
            f"{type(mlp.experts).__name__}; {config.moe_token_dispatcher_type} dispatcher; {balance}; "
            + ("dropless" if capacity is None else f"capacity factor {capacity:g} ({config.moe_token_drop_policy})")
            + (f"; shared experts of width {shared}" if shared else ""))


def reduce_experts_over_expert_data_parallel(chunks: list[torch.nn.Module]) -> None:
    """Mark every expert weight expert-parallel, also at EP1.

    megatron-core marks them so (``allreduce=False``: the expert-DP gradient buffers and the experts' own distributed
    optimizer) only when expert_model_parallel_size > 1. At EP1 they would join the dense parameters' buffers and
    optimizer: a checkpoint's optimizer state would then have another structure than at EPn (one optimizer instead of
    megatron-core's chained dense + expert pair), so it could not move between EP1 and EPn; and with an expert TP
    other than TP the experts' gradients would be reduced over the dense DP group instead of all of their replicas.
    """
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):  # its routed experts (local or TE layers); shared experts stay dense
                for param in module.experts.parameters():
                    param.allreduce = False
