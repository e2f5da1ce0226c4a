"""Multi-latent attention (DeepSeek-V2/V3): the recipe's MLA keys as megatron-core's ``MLATransformerConfig`` fields and
its local layer spec with this package's pieces.

megatron-core's ``MLASelfAttention`` computes the attention (low-rank query and KV projections, each followed by an
RMSNorm; every head's query and key a non-rotary and a rotary part, the key's rotary part shared by all heads). Its
local spec needs three replacements here: a core attention that takes keys and values of different head sizes and
MLA's own softmax scale (megatron-core's local ``DotProductAttention`` takes neither: this package's SDPA and ring
attention do), norms that support sequence parallelism (its torch-norm wrapper refuses SP), and
:class:`TensorParallelMLA`, which fixes the shared rotary key's gradient under tensor parallelism.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config.schema import YARN_KEYS, RecipeConfig
from megatron_ext.model.attention import CausalCoreAttention


def mla_transformer_config(cfg: RecipeConfig) -> dict[str, Any]:
    """``MLATransformerConfig`` fields for the recipe's MLA keys ({} without MLA): the rotary part's RoPE (its base
    read from this config by megatron-core's MLA, not from the GPTModel's), YaRN's keys only with it (megatron-core
    takes the softmax scale's mscale from them whatever the RoPE), and the compressed query's and KV's norms on
    (``qk_layernorm``: megatron-core drops them otherwise)."""
    m = cfg.model
    if not m.multi_latent_attention:
        return {}
    yarn = {key: getattr(m, key) for key in YARN_KEYS} if m.rope_type == "yarn" else {"mscale_all_dim": 0.0}
    return dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                rope_type=m.rope_type, rotary_base=m.rotary_base, **yarn, qk_layernorm=True)


class TensorParallelMLA(MLASelfAttention):
    """megatron-core's MLA with the KV down-projection's output whole (gathered over TP) before it goes on.

    With a tensor-parallel (column-parallel) KV down-projection, megatron-core 0.19.2 gathers its output over TP and
    takes the rotary key from it, shared by the heads this rank holds, but never sums that key's gradient over the
    TP ranks (``get_query_key_value_tensors``): the rank that owns the rotary rows of the down-projection gets only
    its own heads' share of their gradient (measured at TP2 in fp64: those rows' gradient 1e-2 off, the rest 1e-9).
    Handed the KV whole — as its duplicated-projection branch expects, sequence-parallel under SP — megatron-core
    gathers the rotary key over the sequence, whose backward pass sums it over TP; without SP the key's gradient
    is all-reduced over TP here."""

    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        rank, rotary = self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == rank + rotary:  # one TP rank: nothing is split
            return q_compressed, kv_combined
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
        if self.config.sequence_parallel:
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [rank, rotary], dim=-1)
        return q_compressed, torch.cat([kv_compressed, copy_to_tensor_model_parallel_region(k_pos_emb)], dim=-1)


def mla_local_layer_spec(num_experts: int | None, norm: type, core_attention: type[CausalCoreAttention]
                         ) -> ModuleSpec:
    """megatron-core's local MLA layer (an MoE layer with `num_experts`) with `norm` for every norm and
    `core_attention` (SDPA, or the ring attention under context parallelism: both take MLA's value head size). (A
    full-rank query projection builds only as TransformerEngine's fused norm+linear there: not offered.)"""
    layer = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm",
                                                   qk_layernorm=True, multi_latent_attention=True))
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    layer.submodules.self_attention.module = TensorParallelMLA
    attention = layer.submodules.self_attention.submodules
    attention.q_layernorm = attention.kv_layernorm = norm
    attention.core_attention = core_attention
    return layer
