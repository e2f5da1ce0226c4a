"""Which Hugging Face model family a directory or a recipe is, and that family's module: :mod:`hf_llama` (Llama,
Qwen3, Mixtral, Qwen3-MoE) or :mod:`hf_deepseek` (DeepSeek-V3 class). Each family module offers the same functions —
``shape_from_config``, ``shape_from_recipe``, ``hf_config``, ``recipe_model_fields``, ``weight_mappings``,
``hf_shapes``, ``tensor_copies``, ``qkv_codec`` — over its own shape type; :mod:`recipes.convert` calls them through
:func:`family_of` and never names a family itself."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Union

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.convert import hf_deepseek, hf_llama
from megatron_ext.convert.hf_files import SafetensorsReader, read_config_json
from megatron_ext.errors import ConversionError

HFShape = Union[hf_llama.LlamaShape, hf_deepseek.DeepseekShape]
_FAMILIES: dict[str, ModuleType] = {model_type: family for family in (hf_llama, hf_deepseek)
                                    for model_type in family.ARCHITECTURES}
ARCHITECTURES: dict[str, str] = {**hf_llama.ARCHITECTURES, **hf_deepseek.ARCHITECTURES}  # model_type: architecture


def _model_type(config: dict[str, Any], source: str) -> str:
    architectures, model_type = config.get("architectures"), config.get("model_type")
    if architectures is not None:
        by_architecture = {name: kind for kind, name in ARCHITECTURES.items()}
        if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in by_architecture:
            raise ConversionError(f"{source}: architectures={architectures!r} is not supported; one of "
                                  f"{sorted(by_architecture)} converts")
        return by_architecture[architectures[0]]
    if model_type not in ARCHITECTURES:
        raise ConversionError(f"{source}: neither architectures nor model_type says this is one of "
                              f"{sorted(ARCHITECTURES)} (model_type={model_type!r})")
    return model_type


def read_hf_dir(hf_dir: Path) -> tuple[HFShape, SafetensorsReader]:
    """The checked shape of the model in `hf_dir` (config.json and the tensor names its safetensors files hold)."""
    config, source = read_config_json(hf_dir)
    model_type = _model_type(config, source)
    reader = SafetensorsReader(hf_dir)
    return _FAMILIES[model_type].shape_from_config(config, source, model_type, reader.files), reader


def read_config(hf_dir: Path) -> HFShape:
    """The checked shape config.json describes (its safetensors files not read: no optional tensors counted)."""
    config, source = read_config_json(hf_dir)
    model_type = _model_type(config, source)
    return _FAMILIES[model_type].shape_from_config(config, source, model_type, ())


def family_of(shape: HFShape) -> ModuleType:
    """The module that converts models of this shape."""
    return _FAMILIES[shape.model_type]


def shape_from_recipe(cfg: RecipeConfig, vocab_size: int) -> HFShape:
    """The Hugging Face shape a recipe exports as: DeepSeek-V3 with multi-latent attention, else a Llama-family
    model."""
    family = hf_deepseek if cfg.model.multi_latent_attention else hf_llama
    return family.shape_from_recipe(cfg, vocab_size)
