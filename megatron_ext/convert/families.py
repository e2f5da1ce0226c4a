"""Which Hugging Face model family a directory or a recipe is, and that family's module: :mod:`hf_llama` (Llama,
Qwen3, Mixtral, Qwen3-MoE), :mod:`hf_deepseek` (DeepSeek-V3 class, Kimi K2) or :mod:`hf_gpt_oss` (GPT-OSS). Each family module offers the same functions —
``shape_from_config``, ``shape_from_recipe``, ``hf_config``, ``recipe_model_fields``, ``weight_mappings``,
``hf_shapes``, ``tensor_copies``, ``qkv_codec`` — over its own shape type; :mod:`recipes.convert` calls them through
:func:`family_of` and never names a family itself."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Union

from megatron_ext.config.schema import ModelConfig, RecipeConfig
from megatron_ext.convert import hf_deepseek, hf_gpt_oss, hf_llama
from megatron_ext.convert.hf_files import SafetensorsReader, read_config_json
from megatron_ext.errors import ConversionError

HFShape = Union[hf_llama.LlamaShape, hf_deepseek.DeepseekShape, hf_gpt_oss.GptOssShape]
_FAMILIES: dict[str, ModuleType] = {model_type: family for family in (hf_llama, hf_deepseek, hf_gpt_oss)
                                    for model_type in family.ARCHITECTURES}
ARCHITECTURES: dict[str, str] = {model_type: family.ARCHITECTURES[model_type]  # model_type: architecture
                                 for model_type, family in _FAMILIES.items()}


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
    """The Hugging Face shape a recipe exports as: DeepSeek-V3 with multi-latent attention, GPT-OSS with attention
    sinks, else a Llama-family model."""
    family = (hf_deepseek if cfg.model.multi_latent_attention else hf_gpt_oss if cfg.model.softmax_type == "learnable"
              else hf_llama)
    if family is not hf_gpt_oss:
        plain = _GPT_OSS_KEYS + (("rope_type", "correction_range_round_to_int") if family is hf_llama else ())
        for key in plain:
            if getattr(cfg.model, key) != getattr(ModelConfig, key):
                raise ConversionError(f"model.{key}={getattr(cfg.model, key)!r}: this model is exported as a "
                                      f"{family.__name__.rsplit('_', 1)[-1]}-family model, which has no such setting "
                                      f"(only {key}={getattr(ModelConfig, key)!r} converts)")
    return family.shape_from_recipe(cfg, vocab_size)


# the keys only GPT-OSS among the families sets (another family exports only their defaults)
_GPT_OSS_KEYS = ("softmax_type", "window_size", "window_attn_skip_freq", "add_bias_linear", "add_qkv_bias",
                 "activation_func", "activation_func_clamp_value", "glu_linear_offset")
