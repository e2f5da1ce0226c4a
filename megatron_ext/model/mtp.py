"""Multi-token prediction (DeepSeek-V3's MTP): megatron-core's ``MultiTokenPredictionBlock`` after the decoder, on
the last pipeline stage (megatron-core's placement without a custom pipeline layout).

MTP layer k normalises the previous layer's output (the decoder's for k = 1) and the embedding of the tokens k ahead,
projects their concatenation back to the hidden size (``eh_proj``), runs one decoder layer of the model's last
layer's kind (an MoE layer in DeepSeek-V3) and a final norm; the shared output layer then predicts the tokens k + 1
ahead. megatron-core adds the MTP losses to the gradients (``MTPLossAutoScaler``, weighted by
``mtp_loss_scaling_factor / mtp_num_layers``, its scale set by the pipeline schedule) but not to the loss the model
returns: train/lm_loss stays the next-token loss, comparable with a model without MTP, and each MTP loss is logged
beside it (``metrics/mtp_metrics.py``). The last stage also holds a copy of the embedding, kept equal to the first
stage's as a tied output layer's is.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.config.shape import moe_layer_pattern
from megatron_ext.model.hybrid import decoder_layer_count


def mtp_transformer_config(cfg: RecipeConfig) -> dict[str, Any]:
    """megatron-core TransformerConfig fields for the recipe's MTP keys ({} without MTP)."""
    m = cfg.model
    if m.mtp_num_layers is None:
        return {}
    return {"mtp_num_layers": m.mtp_num_layers, "mtp_loss_scaling_factor": m.mtp_loss_scaling_factor}


def mtp_block_spec(config: TransformerConfig, decoder: TransformerBlockSubmodules, use_te: bool,
                   vp_stage: Optional[int]) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """This GPTModel chunk's MTP layers (None where it has none), each around the chunk's last decoder layer spec; in
    local layers their norms are the decoder's (megatron-core's local norm refuses sequence parallelism)."""
    if not config.mtp_num_layers:
        return None
    spec = get_gpt_mtp_block_spec(config, decoder, use_transformer_engine=use_te, vp_stage=vp_stage)
    if spec is not None and not use_te:
        for layer in spec.layer_specs:
            _norms_of_the_decoder(layer, decoder.layer_norm)
    return spec


def hybrid_mtp_block_spec(config: TransformerConfig, use_te: bool, norm: type) -> Optional[ModuleSpec]:
    """A HybridModel's MTP block (None without MTP): megatron-core's MTP layer around a layer stack that HybridModel
    builds from the MTP part of its layer pattern (model/hybrid.py); in local layers its norms are the decoder's."""
    if not config.mtp_num_layers:
        return None
    layer = get_mtp_layer_spec(mtp_model_layer_spec=None, use_transformer_engine=use_te)
    if not use_te:
        _norms_of_the_decoder(layer, norm)
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]))


def _norms_of_the_decoder(layer: ModuleSpec, norm: type) -> None:
    layer.submodules.enorm = layer.submodules.hnorm = layer.submodules.layer_norm = norm


def describe_mtp(config: TransformerConfig) -> str:
    """The start-up line for multi-token prediction, from megatron-core's TransformerConfig."""
    n = config.mtp_num_layers
    moe = config.num_moe_experts and moe_layer_pattern(config.moe_layer_freq, decoder_layer_count(config))[-1]
    return (f"multi-token prediction: {n} layer{'s' if n > 1 else ''} ({'an MoE' if moe else 'a dense'} layer as the "
            f"last decoder layer) on the last pipeline stage, predicting {n + 1} tokens ahead; MTP losses × "
            f"{config.mtp_loss_scaling_factor:g}{f' / {n}' if n > 1 else ''} into the gradients, logged as mtp/loss_k")
