"""megatron-core's HybridModel for this project's decoders: the road off GPTModel, which megatron-core is retiring.

A recipe's decoder layer i becomes two positions of HybridModel's layer pattern: its attention at 2i ('*', or '+'
for multi-latent attention: input norm, self-attention, residual add) and its MLP at 2i + 1 ('-' dense, 'E' MoE:
pre-MLP norm, MLP, residual add).
GPTModel's TransformerLayer computes exactly these two halves in this order, so the same weights give the same
logits; the halves are the GPT layer specs this package builds (``llama.layer_specs``), split in two. Pipeline
stages and virtual chunks are the pattern's '|'-separated segments, cut where megatron-core's GPT split cuts
(:func:`layer_pattern`): each stage holds the same decoder layers under either class.

In a hybrid model megatron-core numbers its per-layer settings by position, not by decoder layer: the layer count it
is given is the number of positions, and the sliding-window flags are given per position (:func:`layer_fields`).

What megatron-core's HybridStack hard-codes and this replaces: its final norm is TransformerEngine's ``TENorm``,
which CPU rehearsal has not; :class:`Decoder` builds the layer spec's own norm there (RMSNorm in local layers, TE's
under TE), saved under the same key. Llama 3.1's RoPE scaling, which HybridModel's constructor does not take, is
applied to its rotary embedding after the build (:func:`scale_rotary_like_llama31`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_ext.config.schema import RecipeConfig, pipeline_stage_layers
from megatron_ext.config.shape import moe_layer_pattern, window_layer_pattern

POSITIONS_PER_LAYER = 2  # a decoder layer's attention, then its MLP
ATTENTION_HALF = ("input_layernorm", "self_attention", "self_attn_bda")
MLP_HALF = ("pre_mlp_layernorm", "mlp", "mlp_bda")


def is_hybrid(cfg: RecipeConfig) -> bool:
    """Whether the recipe builds megatron-core's HybridModel (model.model_class)."""
    return cfg.model.model_class == "hybrid"


def positions_per_layer(cfg: RecipeConfig) -> int:
    """How many of megatron-core's layer numbers one decoder layer takes in the recipe's model class: a router's or
    an attention's ``layer_number`` counts positions in a HybridModel."""
    return POSITIONS_PER_LAYER if is_hybrid(cfg) else 1


def layer_pattern(cfg: RecipeConfig) -> str:
    """HybridModel's layer pattern for the recipe: '*-' per dense decoder layer, '*E' per MoE layer ('+' for '*' with
    multi-latent attention), '|' between pipeline segments in megatron-core's interleaved order (virtual chunk v of
    every stage before chunk v + 1), each segment holding the decoder layers megatron-core's GPT split gives that stage
    and chunk; then '/' and the layer of each multi-token-prediction depth."""
    m = cfg.model
    moe = moe_layer_pattern(m.moe_layer_freq, m.num_layers) if m.num_moe_experts else (0,) * m.num_layers
    attention = Symbols.MLA if m.multi_latent_attention else Symbols.ATTENTION
    layers = [attention + (Symbols.MOE if flag else Symbols.MLP) for flag in moe]
    # each multi-token-prediction depth: a layer of the last decoder layer's kind, after '/'
    mtp = (Symbols.MTP_SEPARATOR + layers[-1]) * (m.mtp_num_layers or 0)
    chunks = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    segments, first = [], 0
    for _chunk in range(chunks):
        for stage_layers in pipeline_stage_layers(cfg):
            count = stage_layers // chunks
            segments.append("".join(layers[first:first + count]))
            first += count
    return Symbols.PIPE.join(segments) + mtp


def layer_fields(cfg: RecipeConfig) -> dict[str, Any]:
    """The TransformerConfig fields that count layers, for the recipe's model class: GPTModel's decoder layers and
    uneven first/last stages, or HybridModel's positions (its segments already place the stages) with the sliding
    window flagged per attention position."""
    m, p = cfg.model, cfg.parallel
    if not is_hybrid(cfg):
        return dict(num_layers=m.num_layers, window_attn_skip_freq=m.window_attn_skip_freq,
                    num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
                    num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage)
    windowed = window_layer_pattern(m.window_size, m.window_attn_skip_freq, m.num_layers)
    return dict(num_layers=positions_per_layer(cfg) * m.num_layers, is_hybrid_model=True,
                window_attn_skip_freq=[flag for layer in windowed for flag in (layer, 0)] or None)


def decoder_layer_numbers(chunks: list[torch.nn.Module]) -> list[list[int]]:
    """Each model chunk's decoder layers, numbered from 1 in the whole model (a HybridModel's two positions per
    layer folded back into the layer)."""
    return [sorted({(layer.layer_number - 1) // _positions(chunk) + 1 for layer in chunk.decoder.layers})
            for chunk in chunks]


def attention_layers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The chunks' layers that hold a self-attention: every GPTModel layer, a HybridModel's attention positions."""
    return [layer for chunk in chunks for layer in chunk.decoder.layers
            if not isinstance(layer.self_attention, IdentityOp)]


def decoder_layer_count(config: TransformerConfig) -> int:
    """The model's decoder layers, from megatron-core's TransformerConfig (a hybrid model's counts positions)."""
    return config.num_layers // (POSITIONS_PER_LAYER if config.is_hybrid_model else 1)


def _positions(chunk: torch.nn.Module) -> int:
    return POSITIONS_PER_LAYER if isinstance(chunk, HybridModel) else 1


class Decoder(HybridStack):
    """megatron-core's HybridStack with `final_norm` as its final norm (HybridStack's own is TransformerEngine's)."""

    def __init__(self, config: TransformerConfig, submodules: HybridStackSubmodules, *args: Any, final_norm: type,
                 post_layer_norm: bool = True, **kwargs: Any):
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = final_norm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


def stack_spec(dense_layer: ModuleSpec, moe_layer: Optional[ModuleSpec], norm: type,
               mtp_block: Optional[ModuleSpec] = None) -> ModuleSpec:
    """The HybridStack spec whose attention (multi-latent or not: the layer specs say which), MLP and MoE positions
    are the halves of the GPT layer specs; `mtp_block`: the multi-token-prediction block around its own stack of
    those positions (model/mtp.py)."""
    attention = _half(dense_layer, ATTENTION_HALF)
    return ModuleSpec(module=Decoder, params={"final_norm": norm}, submodules=HybridStackSubmodules(
        attention_layer=attention, mla_layer=attention, mtp_block_spec=mtp_block,
        mlp_layer=_half(dense_layer, MLP_HALF),
        moe_layer=_half(moe_layer, MLP_HALF) if moe_layer is not None else IdentityOp))


def _half(layer: ModuleSpec, fields: tuple[str, ...]) -> ModuleSpec:
    """`layer`'s spec with only `fields` built (the others stay megatron-core's identity defaults), and the
    checkpoint key renames that concern them."""
    kept = layer.submodules
    renames = {old: new for old, new in kept.sharded_state_dict_keys_map.items() if old.rstrip(".") in fields}
    return ModuleSpec(module=layer.module, params=dict(layer.params), submodules=TransformerLayerSubmodules(
        **{field: getattr(kept, field) for field in fields}, sharded_state_dict_keys_map=renames))


def build_hybrid_model(cfg: RecipeConfig, stack: ModuleSpec, model_class: type[HybridModel],
                       **model_args: Any) -> HybridModel:
    """One `model_class` (HybridModel or a subclass) chunk of the recipe (`model_args`: HybridModel's and GPTModel's
    common arguments)."""
    model = model_class(hybrid_stack_spec=stack, hybrid_layer_pattern=layer_pattern(cfg), **model_args)
    if cfg.model.rope_scaling_factor is not None:
        scale_rotary_like_llama31(model, cfg.model.rope_scaling_factor)
    return model


def scale_rotary_like_llama31(model: HybridModel, factor: float) -> None:
    """Llama 3.1's long-context RoPE scaling on a HybridModel, whose constructor (megatron-core 0.19.2) does not take
    GPTModel's ``rope_scaling``: megatron-core's own scaling applied to the built embedding's frequencies."""
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, factor=factor)
