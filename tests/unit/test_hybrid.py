"""megatron-core's HybridModel as this project builds it (model.model_class=hybrid, model/hybrid.py): the layer pattern
and layer counts it is given, the GPTModel names of its parameters, what it refuses, and its logits against
GPTModel's on the same weights (one CPU process each)."""

from __future__ import annotations

import pytest

from megatron_ext.config.schema import load_config
from megatron_ext.config.validate import validate
from megatron_ext.errors import ConfigError
from tests.launch import TINY
from tests.workers.hybrid_logits import largest_logit_difference

HYBRID = ["model.model_class=hybrid"]
ONE_PROCESS = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
               "parallel.sequence_parallel=false"]
MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_layer_freq=[0,1,1,1]"]


@pytest.mark.parametrize("overrides, pattern", [
    (ONE_PROCESS, "*-*-*-*-"),
    ([*ONE_PROCESS, *MOE], "*-*E*E*E"),
    ([*ONE_PROCESS, *MOE, "model.multi_latent_attention=true", "model.num_query_groups=null"], "+-+E+E+E"),
    # a multi-token-prediction depth: a layer of the last decoder layer's kind
    ([*MOE, "model.mtp_num_layers=1"], "*-*E|*E*E/*E"),
    # configs/tiny.yaml: PP2; the stages' layers as megatron-core's GPT split gives them
    ([], "*-*-|*-*-"),
    (["parallel.num_layers_in_first_pipeline_stage=1"], "*-|*-*-*-"),
    # interleaved: virtual chunk 0 of both stages (layers 1-2, 3-4), then chunk 1 (5-6, 7-8)
    (["model.num_layers=8", "parallel.virtual_pipeline_model_parallel_size=2"], "*-*-|*-*-|*-*-|*-*-"),
    (["model.num_layers=12", "parallel.virtual_pipeline_model_parallel_size=2",
      "parallel.num_layers_in_first_pipeline_stage=2", "parallel.pipeline_model_parallel_size=3",
      "parallel.num_layers_in_last_pipeline_stage=2"], "*-|*-*-*-*-|*-|*-|*-*-*-*-|*-"),
])
def test_the_layer_pattern_holds_each_stage_the_layers_gptmodel_gives_it(overrides, pattern):
    from megatron_ext.model.hybrid import layer_pattern

    assert layer_pattern(load_config(TINY, [*overrides, *HYBRID])) == pattern


def test_megatron_core_counts_positions_and_the_window_is_flagged_per_attention_position():
    from megatron_ext.model.llama import transformer_config

    window = ["model.window_size=[7,0]", "model.window_attn_skip_freq=2"]
    config = transformer_config(load_config(TINY, [*window, "parallel.num_layers_in_first_pipeline_stage=1",
                                                    *HYBRID]), on_gpu=False, use_te=False)
    assert (config.num_layers, config.is_hybrid_model) == (8, True)
    # the stages come from the pattern's segments, which megatron-core refuses beside uneven-stage counts
    assert config.num_layers_in_first_pipeline_stage is None
    assert config.window_attn_skip_freq == [1, 0, 0, 0, 1, 0, 0, 0]  # decoder layers 1 and 3 windowed
    assert config.recompute_num_layers is None
    full = transformer_config(load_config(TINY, ["train.recompute_granularity=full", *HYBRID]), False, False)
    assert full.recompute_num_layers == 2  # one decoder layer per recomputed block, as in GPTModel
    gpt = transformer_config(load_config(TINY, window), on_gpu=False, use_te=False)
    assert (gpt.num_layers, gpt.is_hybrid_model, gpt.window_attn_skip_freq) == (4, False, 2)


def test_parameters_are_named_as_gptmodel_names_them():
    from megatron_ext.checkpoint.model_class import gpt_parameter_name

    assert gpt_parameter_name("decoder.layers.6.self_attention.linear_qkv.weight", hybrid=True) == \
        "decoder.layers.3.self_attention.linear_qkv.weight"
    assert gpt_parameter_name("module.decoder.layers.7.mlp.linear_fc1.weight", hybrid=True) == \
        "module.decoder.layers.3.mlp.linear_fc1.weight"
    assert gpt_parameter_name("optimizer.state.exp_avg.decoder.final_norm.weight", hybrid=True) == \
        "optimizer.state.exp_avg.decoder.final_layernorm.weight"
    assert gpt_parameter_name("decoder.layers.7.mlp.linear_fc1.weight", hybrid=False) == \
        "decoder.layers.7.mlp.linear_fc1.weight"


@pytest.mark.parametrize("override, key", [
    ("train.cuda_graph_impl=local", "train.cuda_graph_impl"),
])
def test_what_hybrid_is_not_built_with_yet_is_refused_in_one_line(override, key):
    with pytest.raises(ConfigError) as refused:
        validate(load_config(TINY, [*ONE_PROCESS, *HYBRID, override]), world_size=1)
    assert str(refused.value).startswith(f"{key}=") and "model.model_class=gpt" in str(refused.value)


@pytest.mark.parametrize("overrides", [
    ["model.rope_scaling_factor=8.0", "model.qk_layernorm=true", "model.seq_length=256"],
    MOE,
    # GPT-OSS's pieces: sinks, a window on alternate layers, biased experts, the clamped GLU, YaRN
    ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.softmax_type=learnable", "model.window_size=[7,0]",
     "model.window_attn_skip_freq=2", "model.add_bias_linear=true", "model.add_qkv_bias=true",
     "model.activation_func=quick_gelu", "model.activation_func_clamp_value=7", "model.glu_linear_offset=1",
     "model.rope_type=yarn", "model.rotary_scaling_factor=32", "model.correction_range_round_to_int=false"],
    # DeepSeek-V3's attention and routing: multi-latent attention (YaRN inside it), shared experts, grouped sigmoid
    # routing with the expert bias
    ["model.multi_latent_attention=true", "model.num_query_groups=null", "model.q_lora_rank=32", "model.kv_lora_rank=24",
     "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=12", "model.rope_type=yarn",
     "model.rotary_scaling_factor=40", *MOE, "model.moe_shared_expert_intermediate_size=64",
     "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
     "model.moe_router_num_groups=2", "model.moe_router_group_topk=1", "model.moe_router_topk_scaling_factor=2.5"],
], ids=["llama31_rope_qk_norm", "moe_first_layer_dense", "gpt_oss", "deepseek_v3_mla"])
def test_hybrid_gives_gptmodels_logits_bit_for_bit(megatron, overrides):
    difference, largest = megatron(largest_logit_difference, [*ONE_PROCESS, *overrides], 256)
    assert largest > 0.5 and difference == 0.0, (difference, largest)
