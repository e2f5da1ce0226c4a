"""GPT-OSS's pieces — attention sinks, sliding windows, biases in every linear layer, the clamped quick-GeGLU, YaRN in
GPT layers: each recipe key reaching megatron-core's TransformerConfig, the rules refused before launch in one line,
and the shape's and planner's counts against the model megatron-core builds (one CPU process), against
megatron-core's own window rule and against GPT-OSS-120B's published sizes."""

from __future__ import annotations

import pytest

from megatron_ext.config.schema import expert_tensor_parallel_size, load_config
from megatron_ext.config.shape import ModelShape, window_layer_pattern
from megatron_ext.config.validate import validate
from megatron_ext.errors import ConfigError, ConversionError
from megatron_ext.planner.layout import RankShape
from tests.launch import TINY
from tests.workers.built_model import assert_the_planner_counts_what_was_built, built_model_facts

VOCAB = 256
# a tiny GPT-OSS: 4 MoE layers of 4 biased experts top-2, sinks, a window of 8 keys on layers 1 and 3, YaRN
GPT_OSS = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64",
           "model.softmax_type=learnable", "model.window_size=[7,0]", "model.window_attn_skip_freq=2",
           "model.add_bias_linear=true", "model.activation_func=quick_gelu", "model.activation_func_clamp_value=7",
           "model.glu_linear_offset=1", "model.rope_type=yarn", "model.rotary_scaling_factor=32",
           "model.correction_range_round_to_int=false", "model.seq_length=32", f"model.vocab_size={VOCAB}",
           "train.precision=fp32", "train.fused_cross_entropy=false"]
ONE_PROCESS = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
               "parallel.sequence_parallel=false"]


def test_each_key_reaches_megatron_cores_transformer_config():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from megatron_ext.model.llama import transformer_config

    config = transformer_config(load_config(TINY, [*GPT_OSS, *ONE_PROCESS]), on_gpu=False, use_te=False)
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq) == ("learnable", (7, 0), 2)
    assert config.add_bias_linear and config.activation_func is quick_gelu
    assert (config.activation_func_clamp_value, config.glu_linear_offset) == (7.0, 1.0)
    # megatron-core's GPTModel and attention read YaRN from these attributes of a plain TransformerConfig
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings, config.yarn_beta_fast,
            config.yarn_beta_slow, config.yarn_mscale, config.yarn_mscale_all_dim,
            config.yarn_correction_range_round_to_int) == (32.0, 4096, 32.0, 1.0, 1.0, 0.0, False)
    qwen2 = transformer_config(load_config(TINY, ["model.add_qkv_bias=true", *ONE_PROCESS]), False, False)
    assert qwen2.add_qkv_bias and not qwen2.add_bias_linear and qwen2.softmax_type == "vanilla"
    assert not hasattr(qwen2, "yarn_rotary_scaling_factor")


def test_biased_experts_are_never_split_over_tensor_parallel_ranks():
    """megatron-core asserts ETP 1 for biased experts: null resolves to it, and another value is refused."""
    cfg = load_config(TINY, GPT_OSS)
    assert cfg.parallel.tensor_model_parallel_size == 2 and expert_tensor_parallel_size(cfg) == 1
    assert expert_tensor_parallel_size(load_config(TINY, GPT_OSS[:3])) == 2
    with pytest.raises(ConfigError, match="experts with biases .* are never split over TP"):
        validate(load_config(TINY, [*GPT_OSS, "parallel.expert_tensor_parallel_size=2"]), 4)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=1"],
     "parallel.context_parallel_size=2 is invalid: the ring attention that splits sequences over CP ranks here has no "
     "attention sinks"),
    (["model.softmax_type=vanilla", "parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=1"],
     "has no sliding window"),
    (["model.window_size=[7,1]"], "model.window_size=[7, 1] is invalid: must be [left, 0]"),
    (["model.window_size=[0,0]"], "must be [left, 0]: each query sees the left >= 1 keys"),
    (["model.window_attn_skip_freq=1"], "model.window_attn_skip_freq=1 is invalid: must be N >= 2"),
    (["model.window_attn_skip_freq=[1,0]"], "a 0/1 flag for each of the model.num_layers=4 layers"),
    (["model.window_size=null"], "chooses which layers keep a sliding window: set model.window_size"),
    (["train.fused_swiglu=true"], "train.fused_swiglu=True is invalid: fuses the plain SwiGLU"),
    (["data.reset_position_ids=true"], "megatron-core's YaRN embedding numbers positions 0..seq_length-1"),
    (["model.rope_scaling_factor=8"], "are two long-context scalings: keep one"),
    (["model.activation_func_clamp_value=0"], "model.activation_func_clamp_value=0.0 is invalid: must be > 0"),
])
def test_each_rule_is_one_config_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:  # a range when the config is read, a rule when it is validated
        validate(load_config(TINY, [*GPT_OSS, *overrides]), 4)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_tiny_gpt_oss_validates():
    validate(load_config(TINY, GPT_OSS), 4)


@pytest.mark.parametrize("skip", [None, 2, 3, [1, 0, 0, 1]])
def test_the_window_layers_are_megatron_cores(skip):
    from megatron.core.transformer.utils import is_layer_window_attention

    assert window_layer_pattern((7, 0), skip, 4) == tuple(
        int(is_layer_window_attention((7, 0), skip, layer + 1)) for layer in range(4))
    assert window_layer_pattern(None, skip, 4) == ()


def test_counts_equal_the_model_megatron_core_builds(megatron):
    overrides = [*GPT_OSS, *ONE_PROCESS]
    built = megatron(built_model_facts, overrides, VOCAB)
    cfg = load_config(TINY, overrides)
    assert_the_planner_counts_what_was_built(built, cfg, VOCAB)
    assert built["windows"] == [7, None, 7, None] and ModelShape.of(cfg.model).window_layers == (1, 0, 1, 0)
    assert built["experts"] == RankShape.of(cfg, VOCAB).expert_params()


def test_gpt_oss_120b_counts_its_published_sizes():
    """OpenAI's gpt-oss model card: 116.83B parameters, 5.13B active per token (36 layers of width 2880, 64 query
    and 8 key/value heads of 64, 128 experts of width 2880, top-4, vocabulary 201,088, untied). Its active count
    leaves out the embedding (a lookup)."""
    cfg = load_config("configs/gpt_oss_120b_64gpu_bf16.yaml")
    shape = ModelShape.of(cfg.model)
    assert shape.num_parameters(201_088) == cfg.recipe.published_params == 116_829_156_672
    assert shape.num_parameters(201_088, active=True) - 201_088 * 2880 == pytest.approx(5.13e9, rel=1e-3)


def test_windows_cut_the_attention_flops_to_the_keys_a_query_sees():
    full = ModelShape.of(load_config(TINY, [*GPT_OSS[:4], "model.seq_length=32"]).model)
    windowed = ModelShape.of(load_config(TINY, GPT_OSS).model)
    # causal: 16 keys per query on average without a window; with 8 keys at most, 8 - 64/64 = 7
    assert windowed.attention_flops_per_token(windowed=True) / full.attention_flops_per_token() == pytest.approx(7 / 16)
    assert windowed.layer_flops_per_token(1) == full.layer_flops_per_token(1)  # layer 2: full attention
    assert windowed.layer_flops_per_token(0) < full.layer_flops_per_token(0)
    # the biases and sinks are adds, not matmuls: no FLOPs of theirs
    assert windowed.layer_flops_by_kind(True)["dense_gemm"] == full.layer_flops_by_kind(True)["dense_gemm"]


def test_a_llama_recipe_with_gpt_oss_keys_is_not_exported_as_llama():
    from megatron_ext.convert.families import shape_from_recipe

    with pytest.raises(ConversionError, match="model.add_bias_linear=True: this model is exported as a "
                                              "llama-family model, which has no such setting"):
        shape_from_recipe(load_config(TINY, ["model.add_bias_linear=true"]), VOCAB)
    assert shape_from_recipe(load_config(TINY, GPT_OSS), VOCAB).architecture == "GptOssForCausalLM"
