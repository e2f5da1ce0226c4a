"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi K2 and their derivatives) ↔ our
megatron-core GPTModel with multi-latent attention: config mapping, input checks and weight names.

Every tensor is a plain rename (megatron-core's MLA keeps Hugging Face's layouts):

* MLA: ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` are ``linear_q_down_proj``/``q_layernorm``/``linear_q_up_proj``,
  ``kv_a_proj_with_mqa``/``kv_a_layernorm``/``kv_b_proj`` are ``linear_kv_down_proj``/``kv_layernorm``/
  ``linear_kv_up_proj``, ``o_proj`` is ``linear_proj``. Both split the KV down-projection's output as [compressed KV;
  the shared rotary key] and each head's query as [non-rotary; rotary], and both rotate interleaved channel pairs
  (``rope_interleave=true``; megatron-core's MLA always does).
* The first ``first_k_dense_replace`` layers are dense SwiGLUs (``model.moe_layer_freq`` flags 0), the others MoE:
  ``mlp.gate`` (with ``e_score_correction_bias``: megatron-core's ``router.expert_bias``), per-expert
  ``gate_proj``/``up_proj``/``down_proj`` and one ``shared_experts`` SwiGLU as wide as all shared experts together.
* Routing: sigmoid scores, the bias added for the choice only, the best ``topk_group`` of ``n_group`` groups (each
  scored by its best two experts: megatron-core's best topk/group_topk, hence the rule topk = 2·topk_group), the k
  weights renormalised and multiplied by ``routed_scaling_factor`` (megatron-core's topk scaling factor).
* YaRN (``rope_parameters.rope_type=yarn``) is megatron-core's MLA YaRN with the same six numbers.
* Multi-token prediction: DeepSeek-V3's checkpoint carries its MTP layer as ``model.layers.{N}`` (N = the decoder's
  layer count): ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer, ``shared_head.norm`` (megatron-core's
  ``mtp.layers.0`` ``enorm``/``hnorm``/``eh_proj``/``mtp_model_layer``/``final_layernorm``) and its own copies of the
  embedding and output layer, which megatron-core shares with the main model (checked equal on import, written on
  export). transformers' ``DeepseekV3ForCausalLM`` neither builds nor saves them; a directory without them imports
  without MTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterator, Optional

import torch

from megatron_ext.config.schema import YARN_KEYS, RecipeConfig
from megatron_ext.config.shape import ModelShape
from megatron_ext.convert.hf_files import (
    HF_YARN,
    field,
    refuse_unless,
    rope_config_fields,
    shared_config_fields,
    shared_recipe_fields,
    yarn_rope,
)
from megatron_ext.convert.weight_mapping import WeightMapping
from megatron_ext.errors import ConversionError

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM"}  # model_type: architecture
# transformers' DeepseekV3RMSNorm over the compressed query and KV takes its default epsilon, not rms_norm_eps;
# megatron-core's MLA norms take the model's one epsilon, so the two agree only at this value.
_MLA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DeepseekShape:
    """What both sides must agree on: the architecture hyper-parameters of one DeepSeek-V3-class model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn_hidden_size: int  # the first dense layers' SwiGLU width
    first_k_dense: int
    num_experts: int
    moe_ffn_hidden_size: int
    num_shared_experts: int
    router_topk: int
    num_groups: int  # 1: no group limit
    topk_groups: int
    routed_scaling_factor: float
    vocab_size: int
    rope_theta: float
    yarn: Optional[tuple[float, ...]]  # YARN_KEYS' values, in their order
    rms_norm_eps: float
    tied: bool
    max_position_embeddings: int
    init_std: float
    mtp_layers: int  # multi-token-prediction layers carried by the checkpoint

    model_type = "deepseek_v3"

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def shape_from_config(config: dict[str, Any], source: str, model_type: str, tensors: Collection[str]
                      ) -> DeepseekShape:
    """Check config.json's fields (read from `source`): a DeepSeek-V3-class model our model reproduces exactly, with
    its MTP layers where `tensors` (the names in its safetensors files) carry them."""
    refuse_unless(config, source, {"attention_bias": False, "hidden_act": "silu", "rope_interleave": True,
                                   "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
                  "the recipe's multi-latent attention and sigmoid router are DeepSeek-V3's")
    heads = field(config, "num_attention_heads", source)
    if config.get("num_key_value_heads", heads) != heads:
        raise ConversionError(f"{source}: num_key_value_heads={config['num_key_value_heads']!r} must equal "
                              f"num_attention_heads={heads} (multi-latent attention gives every head its own keys)")
    if config.get("q_lora_rank") is None:
        raise ConversionError(f"{source}: q_lora_rank=null (a full-rank query projection, DeepSeek-V2-Lite) is not "
                              "supported: the recipe's local MLA layer has the low-rank query only")
    eps = field(config, "rms_norm_eps", source, default=_MLA_NORM_EPS, kind=float)
    if eps != _MLA_NORM_EPS:
        raise ConversionError(f"{source}: rms_norm_eps={eps!r} is not supported: transformers' DeepSeek-V3 norms the "
                              f"compressed query and KV with epsilon {_MLA_NORM_EPS:g} whatever rms_norm_eps says, "
                              "megatron-core with the model's one epsilon")
    num_layers = field(config, "num_hidden_layers", source)
    first_k_dense = config.get("first_k_dense_replace", 0)
    if isinstance(first_k_dense, bool) or not isinstance(first_k_dense, int) or not 0 <= first_k_dense < num_layers:
        raise ConversionError(f"{source}: first_k_dense_replace={first_k_dense!r} must be 0..num_hidden_layers-1 "
                              f"({num_layers - 1}): at least one MoE layer")
    experts = field(config, "n_routed_experts", source)
    topk = field(config, "num_experts_per_tok", source)
    groups = config.get("n_group") or 1
    topk_groups = config.get("topk_group") or 1
    if groups > 1 and (experts % groups or topk != 2 * topk_groups):
        raise ConversionError(f"{source}: n_group={groups}, topk_group={topk_groups}, num_experts_per_tok={topk}: "
                              "group-limited routing converts with n_routed_experts a multiple of n_group and "
                              "num_experts_per_tok = 2 × topk_group (transformers scores a group by its best two "
                              "experts, megatron-core by its best num_experts_per_tok / topk_group)")
    if topk > 1 and not field(config, "norm_topk_prob", source, default=True, kind=bool):
        raise ConversionError(f"{source}: norm_topk_prob=false is not supported: megatron-core renormalises the "
                              "chosen experts' sigmoid scores")
    theta, yarn, _ = yarn_rope(config, source)
    mtp = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0
    carried = [k for k in range(mtp) if f"model.layers.{num_layers + k}.eh_proj.weight" in tensors]
    if len(carried) not in (0, mtp):
        raise ConversionError(f"{source}: num_nextn_predict_layers={mtp}, but the safetensors files carry only "
                              f"{len(carried)} of those layers")
    return DeepseekShape(
        num_layers=num_layers,
        hidden_size=field(config, "hidden_size", source),
        num_heads=heads,
        q_lora_rank=field(config, "q_lora_rank", source),
        kv_lora_rank=field(config, "kv_lora_rank", source),
        qk_nope_head_dim=field(config, "qk_nope_head_dim", source),
        qk_rope_head_dim=field(config, "qk_rope_head_dim", source),
        v_head_dim=field(config, "v_head_dim", source),
        ffn_hidden_size=field(config, "intermediate_size", source),
        first_k_dense=first_k_dense,
        num_experts=experts,
        moe_ffn_hidden_size=field(config, "moe_intermediate_size", source),
        num_shared_experts=config.get("n_shared_experts") or 0,
        router_topk=topk,
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(field(config, "routed_scaling_factor", source, default=1.0, kind=float)),
        vocab_size=field(config, "vocab_size", source),
        rope_theta=theta,
        yarn=yarn,
        rms_norm_eps=eps,
        tied=field(config, "tie_word_embeddings", source, default=False, kind=bool),
        max_position_embeddings=field(config, "max_position_embeddings", source, default=4096),
        init_std=field(config, "initializer_range", source, default=0.02, kind=float),
        mtp_layers=len(carried),
    )


def hf_config(shape: DeepseekShape, dtype: torch.dtype, bos_id: Optional[int], eos_id: Optional[int]
              ) -> dict[str, Any]:
    """config.json for transformers' DeepseekV3ForCausalLM (both the transformers-5 rope_parameters and the
    published rope_scaling form of the RoPE)."""
    rope = {"rope_type": "default"} if shape.yarn is None else {"rope_type": "yarn", **dict(zip(HF_YARN, shape.yarn))}
    return {
        "intermediate_size": shape.ffn_hidden_size,
        "moe_intermediate_size": shape.moe_ffn_hidden_size,
        "num_key_value_heads": shape.num_heads,
        "q_lora_rank": shape.q_lora_rank,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "first_k_dense_replace": shape.first_k_dense,
        "n_routed_experts": shape.num_experts,
        "n_shared_experts": shape.num_shared_experts,
        "num_experts_per_tok": shape.router_topk,
        "n_group": shape.num_groups,
        "topk_group": shape.topk_groups,
        "norm_topk_prob": True,
        "routed_scaling_factor": shape.routed_scaling_factor,
        "num_nextn_predict_layers": shape.mtp_layers,
        "hidden_act": "silu",
        **rope_config_fields(shape.rope_theta, rope),
        "rope_interleave": True,
        **shared_config_fields(shape, dtype, bos_id, eos_id),
    }


# ---------------------------------------------------------------------------------------------
# Recipe config


def recipe_model_fields(shape: DeepseekShape, tensor_parallel_size: int) -> dict[str, Any]:
    """The ``model.*`` section of a recipe that builds exactly this model, training its router as DeepSeek-V3 did:
    aux-loss-free balancing (the expert bias) beside a small per-sequence balance loss."""
    yarn = {} if shape.yarn is None else {"rope_type": "yarn", **dict(zip(YARN_KEYS, shape.yarn))}
    return {
        **shared_recipe_fields(shape, tensor_parallel_size),
        "multi_latent_attention": True,
        "q_lora_rank": shape.q_lora_rank,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_head_dim": shape.qk_nope_head_dim,
        "qk_pos_emb_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "ffn_hidden_size": shape.ffn_hidden_size,
        **yarn,
        "num_moe_experts": shape.num_experts,
        "moe_layer_freq": [0] * shape.first_k_dense + [1] * (shape.num_layers - shape.first_k_dense),
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": shape.num_shared_experts * shape.moe_ffn_hidden_size or None,
        "moe_router_topk": shape.router_topk,
        "moe_router_score_function": "sigmoid",
        "moe_router_num_groups": shape.num_groups if shape.num_groups > 1 else None,
        "moe_router_group_topk": shape.topk_groups if shape.num_groups > 1 else None,
        "moe_router_topk_scaling_factor": shape.routed_scaling_factor,
        "moe_router_enable_expert_bias": True,
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 1.0e-4,  # DeepSeek-V3's sequence-wise balance loss weight
        "mtp_num_layers": shape.mtp_layers or None,
    }


def shape_from_recipe(cfg: RecipeConfig, vocab_size: int) -> DeepseekShape:
    """The DeepSeek-V3 shape a multi-latent-attention recipe builds. ConversionError for what the architecture has
    no counterpart for."""
    m, model = cfg.model, ModelShape.of(cfg.model)
    pattern = list(model.moe_layers)
    first_k = pattern.index(True) if True in pattern else len(pattern)
    for key, wanted in (("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True)):
        if not model.is_moe or getattr(m, key) != wanted:
            raise ConversionError(f"model.{key}={getattr(m, key)!r}: this model is exported as DeepSeek-V3, whose "
                                  f"MoE router has {key}={wanted!r} only")
    if not all(pattern[first_k:]):
        raise ConversionError(f"model.moe_layer_freq={m.moe_layer_freq!r}: DeepSeek-V3 has its first k layers dense "
                              "and every later one MoE; only such a pattern exports")
    if m.layernorm_epsilon != _MLA_NORM_EPS:
        raise ConversionError(f"model.layernorm_epsilon={m.layernorm_epsilon:g}: transformers' DeepSeek-V3 norms the "
                              f"compressed query and KV with epsilon {_MLA_NORM_EPS:g} whatever rms_norm_eps says, so "
                              f"only a model trained with {_MLA_NORM_EPS:g} exports as one")
    shared = m.moe_shared_expert_intermediate_size or 0
    if shared % model.expert_ffn_hidden_size:
        raise ConversionError(f"model.moe_shared_expert_intermediate_size={shared}: DeepSeek-V3's shared experts are "
                              f"each model.moe_ffn_hidden_size={model.expert_ffn_hidden_size} wide: make it a multiple")
    groups = m.moe_router_num_groups or 1
    if groups > 1 and model.router_topk != 2 * m.moe_router_group_topk:
        raise ConversionError(f"model.moe_router_topk={model.router_topk}: DeepSeek-V3 scores an expert group by its "
                              f"best two experts, so only moe_router_topk = 2 × moe_router_group_topk "
                              f"({2 * m.moe_router_group_topk}) exports")
    return DeepseekShape(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_attention_heads,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim,
        qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim, ffn_hidden_size=model.ffn_hidden_size,
        first_k_dense=first_k, num_experts=model.num_experts, moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        num_shared_experts=shared // model.expert_ffn_hidden_size, router_topk=model.router_topk,
        num_groups=groups, topk_groups=m.moe_router_group_topk or 1,
        routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0, vocab_size=vocab_size,
        rope_theta=float(m.rotary_base),
        yarn=tuple(getattr(m, key) for key in YARN_KEYS) if m.rope_type == "yarn" else None,
        rms_norm_eps=m.layernorm_epsilon, tied=not m.untie_embeddings_and_output_weights,
        max_position_embeddings=m.seq_length, init_std=m.init_method_std, mtp_layers=model.mtp_num_layers,
    )


# ---------------------------------------------------------------------------------------------
# The weight mapping (megatron names: the TP1/PP1 local-spec GPTModel's; "{i}" the layer, "{e}" the expert)

_ATTENTION = [(f"self_attention.{ours}.weight", f"self_attn.{theirs}.weight") for ours, theirs in [
    ("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj"),
    ("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
    ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]]
_NORMS = [("input_layernorm.weight", "input_layernorm.weight"),
          ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
_SWIGLU = [("linear_fc1.weight", ("gate_proj.weight", "up_proj.weight"), "gate_up"),
           ("linear_fc2.weight", ("down_proj.weight",), "direct")]
_MTP = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
        ("final_layernorm.weight", "shared_head.norm.weight")]


def _layer(ours: str, theirs: str, moe: bool, experts: int, shared: bool) -> Iterator[WeightMapping]:
    """One decoder layer's mappings: megatron prefix `ours`, Hugging Face prefix `theirs`."""
    for a, b in _ATTENTION + _NORMS:
        yield WeightMapping(f"{ours}.{a}", (f"{theirs}.{b}",), "direct")
    if not moe:
        for a, bs, kind in _SWIGLU:
            yield WeightMapping(f"{ours}.mlp.{a}", tuple(f"{theirs}.mlp.{b}" for b in bs), kind)
        return
    yield WeightMapping(f"{ours}.mlp.router.weight", (f"{theirs}.mlp.gate.weight",), "direct")
    yield WeightMapping(f"{ours}.mlp.router.expert_bias", (f"{theirs}.mlp.gate.e_score_correction_bias",), "direct")
    for e in range(experts):
        for a, bs, kind in _SWIGLU:
            yield WeightMapping(f"{ours}.mlp.experts.local_experts.{e}.{a}",
                                tuple(f"{theirs}.mlp.experts.{e}.{b}" for b in bs), kind)
    if shared:
        for a, bs, kind in _SWIGLU:
            yield WeightMapping(f"{ours}.mlp.shared_experts.{a}", tuple(f"{theirs}.mlp.shared_experts.{b}" for b in bs),
                                kind)


def weight_mappings(shape: DeepseekShape) -> Iterator[WeightMapping]:
    """Every tensor pair of a model of this shape: embedding, layers, final norm, output layer (when untied), then
    the MTP layers (their decoder layer of the last layer's kind, as megatron-core builds it)."""
    shared = shape.num_shared_experts > 0
    yield WeightMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab_rows")
    for i in range(shape.num_layers):
        yield from _layer(f"decoder.layers.{i}", f"model.layers.{i}", i >= shape.first_k_dense, shape.num_experts,
                          shared)
    yield WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "direct")
    if not shape.tied:
        yield WeightMapping("output_layer.weight", ("lm_head.weight",), "vocab_rows")
    for k in range(shape.mtp_layers):
        theirs = f"model.layers.{shape.num_layers + k}"
        for a, b in _MTP:
            yield WeightMapping(f"mtp.layers.{k}.{a}", (f"{theirs}.{b}",), "direct")
        yield from _layer(f"mtp.layers.{k}.mtp_model_layer", theirs, True, shape.num_experts, shared)


def tensor_copies(shape: DeepseekShape) -> dict[str, str]:
    """Tensors the Hugging Face checkpoint holds twice, each named with the one it must equal: every MTP layer's
    embedding and output layer (written on export, checked on import)."""
    head = "model.embed_tokens.weight" if shape.tied else "lm_head.weight"
    copies = {}
    for k in range(shape.mtp_layers):
        layer = f"model.layers.{shape.num_layers + k}"
        copies.update({f"{layer}.embed_tokens.weight": "model.embed_tokens.weight",
                       f"{layer}.shared_head.head.weight": head})
    return copies


def hf_shapes(shape: DeepseekShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face model of this shape, with its shape."""
    h, heads = shape.hidden_size, shape.num_heads
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    moe_ffn = shape.moe_ffn_hidden_size
    by_suffix = {  # the longest suffixes first
        "embed_tokens.weight": (shape.vocab_size, h), "lm_head.weight": (shape.vocab_size, h),
        "q_a_layernorm.weight": (shape.q_lora_rank,), "kv_a_layernorm.weight": (shape.kv_lora_rank,),
        "q_a_proj.weight": (shape.q_lora_rank, h), "q_b_proj.weight": (heads * qk, shape.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (shape.kv_lora_rank + shape.qk_rope_head_dim, h),
        "kv_b_proj.weight": (heads * (shape.qk_nope_head_dim + shape.v_head_dim), shape.kv_lora_rank),
        "o_proj.weight": (h, heads * shape.v_head_dim), "eh_proj.weight": (h, 2 * h),
        "gate.e_score_correction_bias": (shape.num_experts,), "gate.weight": (shape.num_experts, h),
        "shared_experts.gate_proj.weight": (moe_ffn * shape.num_shared_experts, h),
        "shared_experts.up_proj.weight": (moe_ffn * shape.num_shared_experts, h),
        "shared_experts.down_proj.weight": (h, moe_ffn * shape.num_shared_experts),
        "norm.weight": (h,), "layernorm.weight": (h,),
    }
    out = {}
    for m in weight_mappings(shape):
        for name in m.hf:
            dims = next((d for suffix, d in by_suffix.items() if name.endswith(suffix)), None)
            if dims is None:  # a SwiGLU's projection: an expert's, or a dense layer's
                ffn = moe_ffn if ".experts." in name else shape.ffn_hidden_size
                dims = (h, ffn) if name.endswith("down_proj.weight") else (ffn, h)
            out[name] = dims
    return out


def qkv_codec(shape: DeepseekShape) -> None:
    """No fused projections: MLA's are all plain renames."""
    return None

