"""Checkpoints that move from megatron-core's GPTModel to its HybridModel (model.model_class; model/hybrid.py).

A GPTModel checkpoint keeps decoder layer i's attention and MLP under ``decoder.layers.i.``, or, for a model whose
layers are all alike, under ``decoder.layers.`` with the layer as each tensor's first axis (megatron-core's
homogeneous format); a HybridModel keeps them at positions 2i and 2i + 1 (``decoder.layers.<position>.``) and calls
the final norm ``final_norm`` where GPTModel has ``final_layernorm``. When a hybrid run reads a checkpoint without
hybrid keys, its requests (model tensors, and the optimizer state of the fully reshardable formats, whose keys embed
the model's) are pointed at the GPT keys before dist_checkpointing reads: the indexed format by renaming, the
homogeneous one by megatron-core's own retargeting (``dist_checkpointing/gpt_checkpoint_interop.py``, which adds the
layer axis). Nothing on disk is rewritten; the run's next save is in the hybrid layout. The optimizer state of the
dp_reshardable format (flat buffers, no keys) loads where the parameters sit at the same buffer offsets, which its
signature checks under the GPTModel names of the parameters (:func:`gpt_parameter_name`): the two classes order the
same parameters alike, so a checkpoint crosses the move under the layout it was saved in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
    GPTCompatLayerMaps,
    retarget_fsdp_state_dict_to_gpt_checkpoint,
    retarget_sharded_state_dict_to_gpt_checkpoint,
)
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer import TransformerConfig

from megatron_ext.model.hybrid import POSITIONS_PER_LAYER

POSITION = re.compile(r"decoder\.layers\.(\d+)\.")
# a multi-token-prediction depth's layer: GPTModel's one transformer layer, HybridModel's stack of two positions
MTP_LAYER, GPT_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.)mtp_model_layer\.layers\.\d+\."), r"\1transformer_layer."
GPT_FINAL_NORM, HYBRID_FINAL_NORM = "decoder.final_layernorm.", "decoder.final_norm."
GPT_LAYER_AXIS = re.compile(r"(^|\.)decoder\.layers\.[a-z_]")  # a homogeneous GPT checkpoint's layer tensors


def gpt_parameter_name(name: str, hybrid: bool) -> str:
    """`name`, a parameter's (or checkpoint key's) name in a HybridModel where `hybrid`, as GPTModel names it."""
    if not hybrid:
        return name
    name = POSITION.sub(lambda m: f"decoder.layers.{int(m.group(1)) // POSITIONS_PER_LAYER}.", name)
    return MTP_LAYER.sub(GPT_MTP_LAYER, name.replace(HYBRID_FINAL_NORM, GPT_FINAL_NORM))


def gpt_fsdp_state_for_hybrid(state: dict[str, Any], stored: set[str], config: TransformerConfig) -> dict[str, Any]:
    """A Megatron-FSDP (fsdp_dtensor) state to load from a checkpoint whose keys are `stored`: `state` itself, or for
    a HybridModel (its `config`) and a GPTModel checkpoint, the same tensors under the checkpoint's GPT keys
    (megatron-core's ``retarget_fsdp_state_dict_to_gpt_checkpoint``), into which the load then reads."""
    if not config.is_hybrid_model or not any(GPT_FINAL_NORM in key for key in stored):
        return state
    return retarget_fsdp_state_dict_to_gpt_checkpoint(state, _layer_maps(config), checkpoint_keys=stored)


def _layer_maps(config: TransformerConfig) -> GPTCompatLayerMaps:
    """Position 2i (attention) and 2i + 1 (MLP) of the hybrid model are GPT layer i."""
    layers = config.num_layers // POSITIONS_PER_LAYER
    return GPTCompatLayerMaps(attention_to_gpt={POSITIONS_PER_LAYER * i: i for i in range(layers)},
                              mlp_to_gpt={POSITIONS_PER_LAYER * i + 1: i for i in range(layers)},
                              fresh_init=frozenset(), num_gpt_layers=layers)


def read_gpt_checkpoint_into_hybrid(state: dict[str, Any], checkpoint_dir: Path, models: list[torch.nn.Module]
                                    ) -> bool:
    """Point `state`'s requests at the GPTModel keys of `checkpoint_dir` where `models` (unwrapped chunks) are
    HybridModels and the checkpoint is a GPTModel's (written before the move); returns whether it did."""
    if not all(isinstance(model, HybridModel) for model in models):
        return False
    saved = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir)).keys()
    if not any(key.startswith(GPT_FINAL_NORM) for key in saved):  # (a hybrid checkpoint's is decoder.final_norm.)
        return False
    homogeneous = any(GPT_LAYER_AXIS.search(key) for key in saved)
    if homogeneous:  # the decoder layers' keys, by megatron-core; MTP layers index their keys in either format
        retarget_sharded_state_dict_to_gpt_checkpoint(state, _layer_maps(models[0].config))
    for entry in (entry for entry in nested_values(state) if isinstance(entry, ShardedBase)):
        entry.key = MTP_LAYER.sub(GPT_MTP_LAYER, entry.key) if homogeneous else gpt_parameter_name(entry.key, True)
    return True
