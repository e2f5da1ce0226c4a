"""Hugging Face GPT-OSS (``GptOssForCausalLM``) ↔ our megatron-core GPTModel: config mapping, input checks and weight
layouts.

GPT-OSS is a Llama-like decoder whose every layer is an MoE layer, with pieces megatron-core 0.19 names itself:

* attention sinks — per head a learned logit (``self_attn.sinks``) that joins every row's softmax and attends to
  nothing: ``softmax_type=learnable``, the parameter ``core_attention.softmax_offset``;
* sliding-window attention on the layers ``layer_types`` marks ``sliding_attention``: there a query sees itself and
  the ``sliding_window - 1`` keys before it (``window_size=[W-1, 0]``), full causal attention on the others
  (``window_attn_skip_freq``: 2 for the published alternation from a windowed first layer, else a flag per layer);
* biases on the query/key/value and output projections, the router and every expert (``add_bias_linear``);
* a clamped GLU: gate clamped above at ``swiglu_limit``, the linear half to ±limit, ``(up + 1)·gate·σ(1.702·gate)`` —
  megatron-core's quick-GELU GLU with ``activation_func_clamp_value=limit``, ``glu_linear_offset=1``;
* routing: the top-k of the router's logits (bias included), softmax over those k — megatron-core's softmax router
  without pre-softmax;
* YaRN RoPE with ``truncate=false`` — megatron-core's GPT YaRN with ``correction_range_round_to_int=false``; rotate-half
  as Llama.

Its experts are stored stacked per layer and applied as ``x @ w``: ``gate_up_proj`` [experts, hidden, 2·width] with the
gate and up columns interleaved, ``down_proj`` [experts, width, hidden], their biases [experts, ...]. One megatron-core
expert (``local_experts.{e}``, the EP1 name) is row e, transposed to [out, in] and regrouped as [gate; up] (the stacked
kinds of :mod:`weight_mapping`); import reads only that row of the file.

OpenAI publishes the experts MXFP4-quantized (``*_blocks``/``*_scales``, ``quantization_config.quant_method=mxfp4``):
the import dequantizes each expert's row as it reads it (:func:`hf_files.dequantize_mxfp4`, to bf16 as transformers
does); the export writes bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterator, Optional

import torch

from megatron_ext.config.schema import YARN_KEYS, RecipeConfig
from megatron_ext.config.shape import ModelShape
from megatron_ext.convert import hf_llama
from megatron_ext.convert.hf_files import (
    HF_YARN,
    field,
    rope_config_fields,
    shared_config_fields,
    shared_recipe_fields,
    yarn_rope,
)
from megatron_ext.convert.weight_mapping import QKVCodec, WeightMapping
from megatron_ext.errors import ConversionError

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}  # model_type: architecture
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x·σ(1.702·x), GPT-OSS's swiglu_alpha
GLU_LINEAR_OFFSET = 1.0  # GPT-OSS's (up + 1)
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass(frozen=True)
class GptOssShape:
    """What both sides must agree on: the architecture hyper-parameters of one GPT-OSS model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # each expert's width
    vocab_size: int
    rope_theta: float
    yarn: Optional[tuple[float, ...]]  # YARN_KEYS' values, in their order; None: plain RoPE
    yarn_rounded: bool  # YaRN's correction range rounded to whole channels (transformers' truncate)
    rms_norm_eps: float
    tied: bool
    max_position_embeddings: int
    init_std: float
    num_experts: int
    router_topk: int
    router_aux_loss_coef: float
    sliding_window: Optional[int]  # Hugging Face's: keys a windowed query sees, itself included
    sliding_layers: tuple[bool, ...]  # per layer: windowed
    swiglu_limit: float

    model_type = "gpt_oss"
    architecture = ARCHITECTURES["gpt_oss"]

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def shape_from_config(config: dict[str, Any], source: str, model_type: str, tensors: Collection[str]
                      ) -> GptOssShape:
    """Check config.json's fields (read from `source`): a GPT-OSS our model reproduces exactly."""
    quantization = config.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise ConversionError(f"{source}: quantization_config.quant_method="
                              f"{quantization.get('quant_method')!r} is not supported (only OpenAI's mxfp4 experts, "
                              "dequantized on import)")
    if not config.get("attention_bias", True):
        raise ConversionError(f"{source}: attention_bias=false is not supported (GPT-OSS's attention has biases, and "
                              "the recipe's add_bias_linear gives them to every linear layer)")
    alpha = config.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise ConversionError(f"{source}: swiglu_alpha={alpha!r} is not supported (megatron-core's quick_gelu is "
                              f"x·sigmoid({QUICK_GELU_ALPHA}·x))")
    hidden = field(config, "hidden_size", source)
    heads = field(config, "num_attention_heads", source)
    kv_heads = field(config, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise ConversionError(f"{source}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    layers = field(config, "num_hidden_layers", source)
    experts = field(config, "num_local_experts", source)
    topk = field(config, "num_experts_per_tok", source, default=config.get("experts_per_token"))
    if topk > experts:
        raise ConversionError(f"{source}: num_experts_per_tok={topk} exceeds num_local_experts={experts}")
    coef = config.get("router_aux_loss_coef", 0.9)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ConversionError(f"{source}: router_aux_loss_coef={coef!r} must be a number >= 0")
    layer_types = config.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers or not set(layer_types) <= {SLIDING, FULL}:
        raise ConversionError(f"{source}: layer_types must list {SLIDING!r} or {FULL!r} for each of the "
                              f"num_hidden_layers={layers} layers")
    sliding = tuple(kind == SLIDING for kind in layer_types)
    window = field(config, "sliding_window", source) if any(sliding) else config.get("sliding_window")
    theta, yarn, rounded = yarn_rope(config, source, unrounded_allowed=True)
    if float(theta) != int(theta):  # megatron_ext.model.llama passes rotary_base as an int
        raise ConversionError(f"{source}: rope_theta={theta!r} is not an integer; only integer RoPE bases are "
                              "supported")
    return GptOssShape(
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=field(config, "head_dim", source, default=hidden // heads),
        ffn_hidden_size=field(config, "intermediate_size", source),
        vocab_size=field(config, "vocab_size", source),
        rope_theta=theta, yarn=yarn, yarn_rounded=rounded,
        rms_norm_eps=field(config, "rms_norm_eps", source, default=1e-5, kind=float),
        tied=field(config, "tie_word_embeddings", source, default=False, kind=bool),
        max_position_embeddings=field(config, "max_position_embeddings", source, default=4096),
        init_std=field(config, "initializer_range", source, default=0.02, kind=float),
        num_experts=experts, router_topk=topk, router_aux_loss_coef=float(coef),
        sliding_window=window, sliding_layers=sliding,
        swiglu_limit=float(field(config, "swiglu_limit", source, default=7.0, kind=float)),
    )


def hf_config(shape: GptOssShape, dtype: torch.dtype, bos_id: Optional[int], eos_id: Optional[int]
              ) -> dict[str, Any]:
    """config.json for transformers' GptOssForCausalLM (both the transformers-5 rope_parameters and the published
    rope_scaling form of the RoPE)."""
    unset = {("mscale", 1.0), ("mscale_all_dim", 0.0)}  # transformers' defaults, absent from GPT-OSS's published form
    rope = {"rope_type": "default"} if shape.yarn is None else {
        "rope_type": "yarn", **{key: value for key, value in zip(HF_YARN, shape.yarn) if (key, value) not in unset},
        "truncate": shape.yarn_rounded}
    return {
        "intermediate_size": shape.ffn_hidden_size,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "num_local_experts": shape.num_experts,
        "num_experts_per_tok": shape.router_topk,
        "experts_per_token": shape.router_topk,
        "router_aux_loss_coef": shape.router_aux_loss_coef,
        "output_router_logits": False,
        "sliding_window": shape.sliding_window,
        "layer_types": [SLIDING if windowed else FULL for windowed in shape.sliding_layers],
        "swiglu_limit": shape.swiglu_limit,
        "hidden_act": "silu",
        **rope_config_fields(shape.rope_theta, rope),
        **shared_config_fields(shape, dtype, bos_id, eos_id),
        "attention_bias": True,
    }


# ---------------------------------------------------------------------------------------------
# Recipe config


def _skip_freq(sliding: tuple[bool, ...]) -> Optional[int | list[int]]:
    """megatron-core's window_attn_skip_freq for these windowed layers: None (all), 2 (alternating from a windowed
    first layer), else a 1/0 flag per layer."""
    if all(sliding):
        return None
    if sliding == tuple(i % 2 == 0 for i in range(len(sliding))):
        return 2
    return [int(windowed) for windowed in sliding]


def recipe_model_fields(shape: GptOssShape, tensor_parallel_size: int) -> dict[str, Any]:
    """The ``model.*`` section of a recipe that builds exactly this GPT-OSS."""
    windowed = any(shape.sliding_layers)
    yarn = {} if shape.yarn is None else {"rope_type": "yarn", **dict(zip(YARN_KEYS, shape.yarn)),
                                          "correction_range_round_to_int": shape.yarn_rounded}
    return {
        **shared_recipe_fields(shape, tensor_parallel_size),
        "num_query_groups": shape.num_kv_heads,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "kv_channels": shape.head_dim,
        **yarn,
        "softmax_type": "learnable",
        "window_size": [shape.sliding_window - 1, 0] if windowed else None,
        "window_attn_skip_freq": _skip_freq(shape.sliding_layers) if windowed else None,
        "add_bias_linear": True,
        "activation_func": "quick_gelu",
        "activation_func_clamp_value": shape.swiglu_limit,
        "glu_linear_offset": GLU_LINEAR_OFFSET,
        "num_moe_experts": shape.num_experts,
        "moe_ffn_hidden_size": shape.ffn_hidden_size,
        "moe_router_topk": shape.router_topk,
        "moe_router_pre_softmax": False,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": shape.router_aux_loss_coef,
    }


def shape_from_recipe(cfg: RecipeConfig, vocab_size: int) -> GptOssShape:
    """The GPT-OSS a recipe with attention sinks builds; ConversionError for settings GPT-OSS has no counterpart
    for."""
    m, model = cfg.model, ModelShape.of(cfg.model)
    for key, value in [("add_bias_linear", True), ("activation_func", "quick_gelu"),
                       ("glu_linear_offset", GLU_LINEAR_OFFSET), ("qk_layernorm", False),
                       ("moe_shared_expert_intermediate_size", None), ("moe_router_score_function", "softmax"),
                       ("moe_router_pre_softmax", False), ("moe_router_enable_expert_bias", False),
                       ("moe_router_num_groups", None), ("moe_router_topk_scaling_factor", None),
                       ("mtp_num_layers", None), ("rope_scaling_factor", None)]:
        if getattr(m, key) != value:
            raise ConversionError(f"model.{key}={getattr(m, key)!r}: a model with attention sinks is exported as "
                                  f"GPT-OSS, which has no such setting (only {key}={value!r} converts)")
    if m.activation_func_clamp_value is None or not model.is_moe or not all(model.moe_layers):
        raise ConversionError("a model with attention sinks is exported as GPT-OSS, whose every layer is an MoE "
                              "layer with a clamped GLU: set model.num_moe_experts, moe_layer_freq=1 and "
                              "activation_func_clamp_value")
    window = tuple(m.window_size) if m.window_size else None
    sliding = tuple(map(bool, model.window_layers)) or (False,) * model.num_layers
    return GptOssShape(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_attention_heads,
        num_kv_heads=model.num_query_groups, head_dim=model.kv_channels, ffn_hidden_size=model.expert_ffn_hidden_size,
        vocab_size=vocab_size, rope_theta=float(int(m.rotary_base)),
        yarn=tuple(getattr(m, key) for key in YARN_KEYS) if m.rope_type == "yarn" else None,
        yarn_rounded=m.correction_range_round_to_int, rms_norm_eps=m.layernorm_epsilon,
        tied=not m.untie_embeddings_and_output_weights, max_position_embeddings=m.seq_length,
        init_std=m.init_method_std, num_experts=model.num_experts, router_topk=model.router_topk,
        router_aux_loss_coef=m.moe_aux_loss_coeff, sliding_window=window[0] + 1 if window else None,
        sliding_layers=sliding, swiglu_limit=float(m.activation_func_clamp_value),
    )


# ---------------------------------------------------------------------------------------------
# The weight mapping (megatron names are those of the TP1/PP1 local-spec GPTModel's state_dict; "{i}" the layer,
# "{e}" the expert)

_LAYER = "model.layers.{i}"
_BIASES_AND_SINKS = [
    WeightMapping("decoder.layers.{i}.self_attention.linear_qkv.bias",
                  tuple(f"{_LAYER}.self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    WeightMapping("decoder.layers.{i}.self_attention.linear_proj.bias", (f"{_LAYER}.self_attn.o_proj.bias",), "direct"),
    WeightMapping("decoder.layers.{i}.self_attention.core_attention.softmax_offset", (f"{_LAYER}.self_attn.sinks",),
                  "direct"),
    WeightMapping(hf_llama.ROUTER, (f"{_LAYER}.mlp.router.weight",), "direct"),
    WeightMapping("decoder.layers.{i}.mlp.router.bias", (f"{_LAYER}.mlp.router.bias",), "direct"),
]
_EXPERT = "decoder.layers.{i}.mlp.experts.local_experts.{e}"
_EXPERTS = [
    WeightMapping(f"{_EXPERT}.linear_fc1.weight", (f"{_LAYER}.mlp.experts.gate_up_proj",), "stacked_glu"),
    WeightMapping(f"{_EXPERT}.linear_fc1.bias", (f"{_LAYER}.mlp.experts.gate_up_proj_bias",), "stacked_glu"),
    WeightMapping(f"{_EXPERT}.linear_fc2.weight", (f"{_LAYER}.mlp.experts.down_proj",), "stacked_t"),
    WeightMapping(f"{_EXPERT}.linear_fc2.bias", (f"{_LAYER}.mlp.experts.down_proj_bias",), "stacked"),
]


def weight_mappings(shape: GptOssShape) -> Iterator[WeightMapping]:
    """Every tensor pair of a model of this shape, layer by layer (the output layer only when untied)."""
    yield from hf_llama.GLOBAL_BEFORE
    for i in range(shape.num_layers):
        for m in hf_llama.ATTENTION + _BIASES_AND_SINKS:
            yield m.format(i=i)
        for e in range(shape.num_experts):
            for m in _EXPERTS:
                yield m.format(i=i, e=e)
    yield from hf_llama.GLOBAL_AFTER
    if not shape.tied:
        yield hf_llama.UNTIED_OUTPUT


def hf_shapes(shape: GptOssShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face model of this shape, with its shape."""
    h, f, n, experts = shape.hidden_size, shape.ffn_hidden_size, shape.num_heads, shape.num_experts
    q, kv = n * shape.head_dim, shape.num_kv_heads * shape.head_dim
    by_suffix = {"embed_tokens.weight": (shape.vocab_size, h), "lm_head.weight": (shape.vocab_size, h),
                 "layernorm.weight": (h,), "norm.weight": (h,), "q_proj.weight": (q, h), "k_proj.weight": (kv, h),
                 "v_proj.weight": (kv, h), "o_proj.weight": (h, q), "q_proj.bias": (q,), "k_proj.bias": (kv,),
                 "v_proj.bias": (kv,), "o_proj.bias": (h,), "sinks": (n,), "router.weight": (experts, h),
                 "router.bias": (experts,), "gate_up_proj": (experts, h, 2 * f), "gate_up_proj_bias": (experts, 2 * f),
                 "down_proj": (experts, f, h), "down_proj_bias": (experts, h)}
    return {name: next(dims for suffix, dims in by_suffix.items() if name.endswith(suffix))
            for m in weight_mappings(shape) for name in m.hf}


def qkv_codec(shape: GptOssShape) -> QKVCodec:
    """How the q, k, v projections and their biases fuse into ``linear_qkv`` (Llama's grouping)."""
    return hf_llama.qkv_codec(shape)


def tensor_copies(shape: GptOssShape) -> dict[str, str]:
    """Tensors the Hugging Face checkpoint holds twice: none."""
    return {}
