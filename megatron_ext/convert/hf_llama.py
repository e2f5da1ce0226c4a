"""Hugging Face Llama, Mixtral, Qwen3 and Qwen3-MoE ↔ our megatron-core GPTModel: config mapping, input checks and
weight layouts.

Mixtral is a Llama whose MLPs are MoE layers: a router (``block_sparse_moe.gate``) and experts ``w1``/``w3``/``w2``
(gate, up, down), which become megatron-core's ``mlp.router`` and ``mlp.experts.local_experts.{e}`` (the EP1 names;
dist_checkpointing splits the experts over any EP). Its routing — softmax over all experts, top-k, the k weights
renormalised — is megatron-core's softmax over the top-k scores (``moe_router_pre_softmax=false``).

Qwen3 is a Llama with an RMSNorm over each query and key head (``q_norm``/``k_norm``, megatron-core's
``qk_layernorm``); Qwen3-MoE is a Qwen3 whose MLPs are MoE layers (``mlp.gate``, ``mlp.experts.{e}.gate_proj``/
``up_proj``/``down_proj``), its top-k weights renormalised (``norm_topk_prob=true``, as Mixtral's) or not (softmax over
all experts first: megatron-core's ``moe_router_pre_softmax=true``).

The weight mapping works on the *unsharded* (TP1/PP1) local state dict of the model that
:mod:`megatron_ext.model.llama` builds with the local layer spec; dist_checkpointing reshards it to any
TP/PP layout. Layout differences handled here:

* ``linear_qkv`` holds Q, K and V grouped per query group — for each of the ``num_query_groups``
  groups, that group's ``heads/groups`` query heads, then its key head, then its value head, each
  ``head_dim`` rows (megatron-core ``SelfAttention.get_query_key_value_tensors``);
* ``linear_fc1`` is ``[gate; up]``: megatron's GLU applies the activation to the first half;
* the embedding and output rows are padded past the vocabulary (zero rows here, dropped on export).

RoPE needs no permutation: Hugging Face Llama checkpoints already use the half-rotation
(``rotate_half``) convention, which is megatron-core's ``rotary_interleaved=False`` default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterator, Optional

import torch

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.config.shape import ModelShape
from megatron_ext.convert.hf_files import field, shared_config_fields, shared_recipe_fields
from megatron_ext.convert.weight_mapping import QKVCodec, WeightMapping
from megatron_ext.errors import ConversionError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",  # model_type: architecture
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# megatron-core 0.19.2 hard-codes these Llama-3.1 constants in RotaryEmbedding._apply_scaling.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class LlamaShape:
    """What both sides must agree on: the architecture hyper-parameters of one Llama-family model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling_factor: Optional[float]
    rms_norm_eps: float
    tied: bool
    max_position_embeddings: int
    init_std: float = 0.02
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head
    num_experts: int = 0  # experts per layer (0: dense)
    router_topk: int = 0  # experts per token
    router_aux_loss_coef: float = 0.0  # the load-balancing loss coefficient (the recipe trains with it)
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum to 1 (always in Mixtral)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def model_type(self) -> str:
        if self.qk_norm:
            return "qwen3_moe" if self.num_experts else "qwen3"
        return "mixtral" if self.num_experts else "llama"


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def _rope(config: dict[str, Any], source: str) -> tuple[float, Optional[float]]:
    """(rope_theta, llama3 scaling factor or None) from the legacy or the transformers-5 form."""
    # transformers 5 writes rope_parameters={rope_type, rope_theta, ...}; older ones rope_theta +
    # rope_scaling={type|rope_type, factor, ...} (null without scaling).
    params = config.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = config.get("rope_scaling"), "rope_scaling"
    params = dict(params or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConversionError(f"{source}: rope_theta={theta!r} must be a positive number")
    if float(theta) != int(theta):  # megatron_ext.model.llama passes rotary_base as an int
        raise ConversionError(f"{source}: rope_theta={theta!r} is not an integer; only integer RoPE bases "
                              "are supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConversionError(f"{source}: {key}.rope_type={rope_type!r} is not supported "
                              "(supported: none/default, and llama3 with megatron-core's fixed constants)")
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ConversionError(f"{source}: {key}.factor={factor!r} must be a positive number for llama3 RoPE")
    for name, fixed in MEGATRON_LLAMA3_ROPE.items():
        if float(params.get(name, fixed)) != fixed:
            raise ConversionError(f"{source}: {key}.{name}={params.get(name)!r} is not supported: "
                                  f"megatron-core 0.19.2 implements llama3 RoPE scaling only with "
                                  f"{name}={fixed:g}")
    return float(theta), float(factor)


def shape_from_config(config: dict[str, Any], source: str, model_type: str, tensors: Collection[str]) -> LlamaShape:
    """Check config.json's fields (read from `source`) of a model of `model_type`: one our model reproduces exactly.
    (`tensors`, the names in its safetensors files, decide nothing here: these families have no optional tensors.)"""
    family = {"mixtral": _mixtral_fields, "qwen3": _qwen3_fields, "qwen3_moe": _qwen3_moe_fields}.get(
        model_type, lambda *_: {})(config, source)
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise ConversionError(f"{source}: {flag}=true is not supported (the recipe's Llama has no "
                                  "biases)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{source}: hidden_act={act!r} is not supported (only silu, i.e. SwiGLU)")

    hidden = field(config, "hidden_size", source)
    heads = field(config, "num_attention_heads", source)
    kv_heads = field(config, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise ConversionError(f"{source}: num_key_value_heads={kv_heads} must divide "
                              f"num_attention_heads={heads}")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConversionError(f"{source}: hidden_size={hidden} is not divisible by "
                                  f"num_attention_heads={heads} and head_dim is not given")
        head_dim = hidden // heads
    head_dim = field({"head_dim": head_dim}, "head_dim", source)
    theta, scaling = _rope(config, source)
    return LlamaShape(**{
        "ffn_hidden_size": field(config, "intermediate_size", source), **family}, **dict(
        num_layers=field(config, "num_hidden_layers", source),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=field(config, "vocab_size", source),
        rope_theta=theta,
        rope_scaling_factor=scaling,
        rms_norm_eps=field(config, "rms_norm_eps", source, default=1e-6, kind=float),
        tied=field(config, "tie_word_embeddings", source, default=False, kind=bool),
        max_position_embeddings=field(config, "max_position_embeddings", source, default=2048),
        init_std=field(config, "initializer_range", source, default=0.02, kind=float),
    ))


def _router_fields(config: dict[str, Any], source: str, experts_key: str, aux_loss_default: float
                   ) -> dict[str, Any]:
    experts = field(config, experts_key, source)
    topk = field(config, "num_experts_per_tok", source)
    if topk > experts:
        raise ConversionError(f"{source}: num_experts_per_tok={topk} exceeds {experts_key}={experts}")
    coef = config.get("router_aux_loss_coef", aux_loss_default)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ConversionError(f"{source}: router_aux_loss_coef={coef!r} must be a number >= 0")
    return {"num_experts": experts, "router_topk": topk, "router_aux_loss_coef": float(coef)}


def _mixtral_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """A Mixtral's MoE fields, refusing what the recipe's MoE layers would compute differently."""
    for name, plain in [("sliding_window", None), ("router_jitter_noise", 0.0)]:
        if config.get(name, plain) not in (plain, 0):
            raise ConversionError(f"{source}: {name}={config[name]!r} is not supported (the recipe's attention "
                                  "is full causal and its router adds no jitter)")
    return _router_fields(config, source, "num_local_experts", 0.02)


def _qwen3_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """A Qwen3's per-head q/k norms, refusing sliding-window attention (the recipe's is full causal)."""
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if config.get("use_sliding_window", False) or layer_types != {"full_attention"}:
        raise ConversionError(f"{source}: use_sliding_window/layer_types ask for sliding-window attention, which is "
                              "not supported (the recipe's attention is full causal)")
    return {"qk_norm": True}


def _qwen3_moe_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """A Qwen3-MoE's fields: every layer an MoE layer (the recipe has no dense layers between them)."""
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise ConversionError(f"{source}: decoder_sparse_step={config.get('decoder_sparse_step')!r}, "
                              f"mlp_only_layers={config.get('mlp_only_layers')!r}: only models whose every layer "
                              "is an MoE layer are supported (decoder_sparse_step=1, mlp_only_layers=[])")
    # the published configs say num_experts; transformers 5 writes its attribute num_local_experts
    experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
    return {**_qwen3_fields(config, source), **_router_fields(config, source, experts_key, 0.001),
            "ffn_hidden_size": field(config, "moe_intermediate_size", source),
            "norm_topk_prob": field(config, "norm_topk_prob", source, default=False, kind=bool)}


def hf_config(shape: LlamaShape, dtype: torch.dtype, bos_id: Optional[int],
              eos_id: Optional[int]) -> dict[str, Any]:
    """config.json for the transformers class of `shape`'s family (legacy rope keys: read by transformers 4 and
    5)."""
    rope_scaling = None
    if shape.rope_scaling_factor is not None:
        rope_scaling = {"rope_type": "llama3", "factor": shape.rope_scaling_factor, **MEGATRON_LLAMA3_ROPE}
    router = {"num_experts_per_tok": shape.router_topk, "router_aux_loss_coef": shape.router_aux_loss_coef,
              "output_router_logits": False}
    family = {
        "llama": {"mlp_bias": False},
        "mixtral": {"num_local_experts": shape.num_experts, **router, "router_jitter_noise": 0.0,
                    "sliding_window": None},
        "qwen3": {"use_sliding_window": False, "sliding_window": None},
        "qwen3_moe": {"use_sliding_window": False, "sliding_window": None, "num_experts": shape.num_experts,
                      **router, "moe_intermediate_size": shape.ffn_hidden_size, "norm_topk_prob": shape.norm_topk_prob,
                      "decoder_sparse_step": 1, "mlp_only_layers": []},
    }[shape.model_type]
    return {
        "intermediate_size": shape.ffn_hidden_size,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rope_theta": shape.rope_theta,
        "rope_scaling": rope_scaling,
        **family,
        **shared_config_fields(shape, dtype, bos_id, eos_id),
    }


# ---------------------------------------------------------------------------------------------
# Recipe config


def recipe_model_fields(shape: LlamaShape, tensor_parallel_size: int) -> dict[str, Any]:
    """The ``model.*`` section of a recipe that builds exactly this Llama."""
    return {
        **shared_recipe_fields(shape, tensor_parallel_size),
        "num_query_groups": shape.num_kv_heads,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "kv_channels": shape.head_dim,
        "rope_scaling_factor": shape.rope_scaling_factor,
        **({"qk_layernorm": True} if shape.qk_norm else {}),
        **({"num_moe_experts": shape.num_experts, "moe_ffn_hidden_size": shape.ffn_hidden_size,
            "moe_router_topk": shape.router_topk, "moe_router_pre_softmax": not shape.norm_topk_prob,
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": shape.router_aux_loss_coef}
           if shape.num_experts else {}),
    }


def shape_from_recipe(cfg: RecipeConfig, vocab_size: int) -> LlamaShape:
    """The shape a recipe config builds: a Llama, or with ``qk_layernorm`` a Qwen3; an MoE recipe as Mixtral, or
    with ``qk_layernorm`` Qwen3-MoE. ConversionError for MoE settings the family has no counterpart for."""
    m, model = cfg.model, ModelShape.of(cfg.model)
    if model.is_moe:
        family = "Qwen3-MoE" if m.qk_layernorm else "Mixtral"
        plain = [("moe_shared_expert_intermediate_size", None), ("moe_router_score_function", "softmax"),
                 ("moe_router_enable_expert_bias", False)]
        if not m.qk_layernorm:  # Qwen3-MoE's norm_topk_prob=false is the pre-softmax router
            plain.append(("moe_router_pre_softmax", False))
        for key, value in plain:
            if getattr(m, key) != value:
                raise ConversionError(f"model.{key}={getattr(m, key)!r}: this MoE model is exported as {family}, "
                                      f"whose router and experts have no such setting (only {key}={value!r} converts)")
        if not all(model.moe_layers):
            raise ConversionError(f"model.moe_layer_freq={m.moe_layer_freq!r}: this MoE model is exported as {family}, "
                                  f"which has an MoE layer everywhere (only moe_layer_freq=1 converts)")
    return LlamaShape(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_heads=model.num_attention_heads,
        num_kv_heads=model.num_query_groups,
        head_dim=model.kv_channels,
        ffn_hidden_size=model.expert_ffn_hidden_size if model.is_moe else model.ffn_hidden_size,
        vocab_size=vocab_size,
        rope_theta=float(int(m.rotary_base)),
        rope_scaling_factor=m.rope_scaling_factor,
        rms_norm_eps=m.layernorm_epsilon,
        tied=not m.untie_embeddings_and_output_weights,
        max_position_embeddings=m.seq_length,
        init_std=m.init_method_std,
        qk_norm=m.qk_layernorm,
        num_experts=model.num_experts,
        router_topk=model.router_topk,
        router_aux_loss_coef=m.moe_aux_loss_coeff if model.is_moe else 0.0,
        norm_topk_prob=not m.moe_router_pre_softmax,
    )


# ---------------------------------------------------------------------------------------------
# The weight mapping: one table serves import, export and the input checks
# (megatron names are those of the TP1/PP1 local-spec GPTModel's state_dict; "{i}" is the layer)

GLOBAL_BEFORE = [WeightMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab_rows")]
ATTENTION = [
    WeightMapping("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "direct"),
    WeightMapping("decoder.layers.{i}.self_attention.linear_qkv.weight",
                  ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                   "model.layers.{i}.self_attn.v_proj.weight"), "qkv"),
    WeightMapping("decoder.layers.{i}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",),
                  "direct"),
    WeightMapping("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
                  "direct"),
]
_QK_NORMS = [
    WeightMapping("decoder.layers.{i}.self_attention.q_layernorm.weight", ("model.layers.{i}.self_attn.q_norm.weight",),
                  "direct"),
    WeightMapping("decoder.layers.{i}.self_attention.k_layernorm.weight", ("model.layers.{i}.self_attn.k_norm.weight",),
                  "direct"),
]
_DENSE_MLP = [
    WeightMapping("decoder.layers.{i}.mlp.linear_fc1.weight",
                  ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), "gate_up"),
    WeightMapping("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "direct"),
]
ROUTER = "decoder.layers.{i}.mlp.router.weight"
_EXPERT_FC1 = "decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"  # "{e}": the expert
_EXPERT_FC2 = "decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"
_MOE_MLP = {  # by model_type: the router, then one expert's tensors
    "mixtral": [
        WeightMapping(ROUTER, ("model.layers.{i}.block_sparse_moe.gate.weight",), "direct"),
        WeightMapping(_EXPERT_FC1, ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
                                    "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"), "gate_up"),
        WeightMapping(_EXPERT_FC2, ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",), "direct"),
    ],
    "qwen3_moe": [
        WeightMapping(ROUTER, ("model.layers.{i}.mlp.gate.weight",), "direct"),
        WeightMapping(_EXPERT_FC1, ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
                                    "model.layers.{i}.mlp.experts.{e}.up_proj.weight"), "gate_up"),
        WeightMapping(_EXPERT_FC2, ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "direct"),
    ],
}
GLOBAL_AFTER = [WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "direct")]
UNTIED_OUTPUT = WeightMapping("output_layer.weight", ("lm_head.weight",), "vocab_rows")


def weight_mappings(shape: LlamaShape) -> Iterator[WeightMapping]:
    """Every tensor pair of a model of this shape, layer by layer (the output layer only when untied)."""
    yield from GLOBAL_BEFORE
    for i in range(shape.num_layers):
        per_layer = [(m, 0) for m in ATTENTION + (_QK_NORMS if shape.qk_norm else [])]
        if shape.num_experts:
            router, *expert = _MOE_MLP[shape.model_type]
            per_layer += [(router, 0)] + [(m, e) for e in range(shape.num_experts) for m in expert]
        else:
            per_layer += [(m, 0) for m in _DENSE_MLP]
        for m, e in per_layer:
            yield m.format(i=i, e=e)
    yield from GLOBAL_AFTER
    if not shape.tied:
        yield UNTIED_OUTPUT


def hf_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face model of this shape, with its shape."""
    h, ffn = shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    by_suffix = {"q_norm.weight": (shape.head_dim,), "k_norm.weight": (shape.head_dim,),  # before "norm.weight"
                 "embed_tokens.weight": (shape.vocab_size, h), "lm_head.weight": (shape.vocab_size, h),
                 "layernorm.weight": (h,), "norm.weight": (h,), "q_proj.weight": (q, h), "k_proj.weight": (kv, h),
                 "v_proj.weight": (kv, h), "o_proj.weight": (h, q), "gate_proj.weight": (ffn, h),
                 "up_proj.weight": (ffn, h), "down_proj.weight": (h, ffn), "gate.weight": (shape.num_experts, h),
                 "w1.weight": (ffn, h), "w3.weight": (ffn, h), "w2.weight": (h, ffn)}
    return {name: next(dims for suffix, dims in by_suffix.items() if name.endswith(suffix))
            for m in weight_mappings(shape) for name in m.hf}


# ---------------------------------------------------------------------------------------------
# Weight layouts (megatron names are those of the TP1/PP1 local-spec GPTModel's state_dict)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    groups, d, rest = shape.num_kv_heads, shape.head_dim, q.shape[1:]  # rest: () for a bias
    per_group = [q.reshape(groups, shape.heads_per_group * d, *rest), k.reshape(groups, d, *rest),
                 v.reshape(groups, d, *rest)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: LlamaShape) -> tuple[torch.Tensor, ...]:
    groups, d, rest = shape.num_kv_heads, shape.head_dim, qkv.shape[1:]
    grouped = qkv.reshape(groups, (shape.heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [shape.heads_per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def qkv_codec(shape: LlamaShape) -> QKVCodec:
    """How this shape's q, k, v projections (weights, or biases) fuse into megatron-core's ``linear_qkv`` and split
    back (any shape with ``num_kv_heads``, ``head_dim`` and ``heads_per_group``)."""
    return (lambda q, k, v: _fuse_qkv(q, k, v, shape)), (lambda qkv: _split_qkv(qkv, shape))


def tensor_copies(shape: LlamaShape) -> dict[str, str]:
    """Tensors the Hugging Face checkpoint holds twice (none in these families; a tied output layer is not saved)."""
    return {}
