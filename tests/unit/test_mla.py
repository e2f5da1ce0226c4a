"""Multi-latent attention (DeepSeek-V3's), its routing keys, first dense layers and multi-token prediction: the config
rules, and the parameter and FLOP counts of the model shape and the planner against the model megatron-core builds
from them (one CPU process) and Megatron-LM's formula."""

from __future__ import annotations

import pytest

from megatron_ext.config.schema import load_config
from megatron_ext.config.shape import ModelShape
from megatron_ext.config.validate import validate
from megatron_ext.errors import ConfigError
from tests.launch import TINY
from tests.workers.built_model import assert_the_planner_counts_what_was_built, built_model_facts

VOCAB = 256
# a tiny DeepSeek-V3: every head's query/key 16 + 8 rotary channels, values 12; query and KV ranks 32 and 24
MLA = ["model.multi_latent_attention=true", "model.num_query_groups=null", "model.q_lora_rank=32",
       "model.kv_lora_rank=24", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=12",
       "model.seq_length=32", f"model.vocab_size={VOCAB}", "train.precision=fp32", "train.fused_cross_entropy=false"]
ROUTED = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_shared_expert_intermediate_size=64",
          "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
          "model.moe_router_num_groups=2", "model.moe_router_group_topk=1", "model.moe_router_topk_scaling_factor=2.5",
          "model.moe_router_load_balancing_type=none"]
ONE_PROCESS = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
               "parallel.sequence_parallel=false"]


@pytest.mark.parametrize("routed", [[], ROUTED, [*ROUTED, "model.moe_layer_freq=[0,1,0,1]", "model.mtp_num_layers=2"]],
                         ids=["dense", "moe", "moe_every_other_layer_from_the_second_and_two_mtp_layers"])
def test_counts_equal_the_model_megatron_core_builds(megatron, routed):
    overrides = [*MLA, *ONE_PROCESS, *routed]
    built = megatron(built_model_facts, overrides, VOCAB)
    cfg = load_config(TINY, overrides)
    shape = ModelShape.of(cfg.model)
    assert built["moe_layers"] == [shape.is_moe_layer(layer) for layer in range(shape.num_layers)] == (
        [False, True, False, True] if "model.moe_layer_freq=[0,1,0,1]" in routed else [bool(routed)] * 4)
    assert_the_planner_counts_what_was_built(built, cfg, VOCAB)
    assert built["softmax_scale"] == pytest.approx((16 + 8) ** -0.5)  # MLA's own: over query/key channels


def test_flops_count_the_latent_projections_and_both_head_sizes():
    """Narayanan et al.'s count as Megatron-LM's num_floating_point_operations has it for MLA (its norm terms
    aside): 6 × the projection weights + 3·heads·s·(query/key + value channels) per token, causal."""
    cfg = load_config(TINY, MLA)
    s, n, h, layers = 32, cfg.model.num_attention_heads, cfg.model.hidden_size, cfg.model.num_layers
    q = 32 * (h + n * (16 + 8))
    kv = 24 * (n * (16 + 12)) + h * (24 + 8)
    projections = q + kv + n * 12 * h
    mlp = 3 * h * ModelShape.of(cfg.model).ffn_hidden_size
    per_layer = 6 * (projections + mlp) + 3 * n * s * (16 + 8 + 12)
    assert ModelShape.of(cfg.model).flops_per_token(VOCAB) == layers * per_layer + 6 * VOCAB * h


def test_context_parallelism_passes_every_heads_key_and_value_around_its_ring():
    """Under CP the keys (non-rotary + rotary channels) and values of every head travel (the ring attention's and
    TE's), not the compressed KV; a grouped-query model passes its groups' keys and values."""
    assert ModelShape.of(load_config(TINY, MLA).model).key_value_channels == 8 * ((16 + 8) + 12)  # 8 heads
    assert ModelShape.of(load_config(TINY).model).key_value_channels == 4 * 2 * 32  # 4 groups of 32 channels


def test_dense_and_moe_layers_are_counted_each_as_what_it_is():
    """With model.moe_layer_freq a dense layer counts the dense SwiGLU (ffn_hidden_size wide) and an MoE layer its
    router, top-k experts and shared expert; an integer N marks every N-th layer from the first."""
    first_dense = ModelShape.of(load_config(TINY, [*MLA, *ROUTED, "model.moe_layer_freq=[0,1,1,1]"]).model)
    every_other = ModelShape.of(load_config(TINY, [*MLA, *ROUTED, "model.moe_layer_freq=2"]).model)
    assert (first_dense.moe_layers, every_other.moe_layers) == ((0, 1, 1, 1), (1, 0, 1, 0))
    h, ffn, expert = first_dense.hidden_size, first_dense.ffn_hidden_size, first_dense.expert_ffn_hidden_size
    dense_mlp, moe_mlp = 3 * h * ffn, h * 4 + 2 * 3 * h * expert + 3 * h * 64  # router, top-2, the shared expert
    attention = 6 * first_dense.attention_parameters() + first_dense.attention_flops_per_token()
    assert first_dense.flops_per_token(VOCAB) == 4 * attention + 6 * (dense_mlp + 3 * moe_mlp) + 6 * VOCAB * h
    assert every_other.flops_per_token(VOCAB) == 4 * attention + 6 * (2 * dense_mlp + 2 * moe_mlp) + 6 * VOCAB * h
    # each MTP layer: its projection of [embedding; hidden] (2h × h), a layer of the last one's kind, the output layer
    mtp = ModelShape.of(load_config(TINY, [*MLA, *ROUTED, "model.moe_layer_freq=[0,1,1,1]",
                                           "model.mtp_num_layers=2"]).model)
    assert mtp.flops_per_token(VOCAB) - first_dense.flops_per_token(VOCAB) == 2 * (
        6 * 2 * h * h + attention + 6 * moe_mlp + 6 * VOCAB * h)


@pytest.mark.parametrize("overrides, message", [
    (["model.num_query_groups=2"], "model.num_query_groups=2 is invalid: does not apply to multi-latent attention"),
    (["model.kv_channels=16"], "model.kv_channels=16 is invalid: does not apply to multi-latent attention"),
    (["model.qk_layernorm=true"], "has its own norms (over the compressed query and KV), always on"),
    (["model.q_lora_rank=33"], "the q down-projection's 33 outputs are split over parallel.tensor_model_parallel_size=2"),
    (["model.kv_lora_rank=23"], "the kv down-projection's 31 outputs are split over"),
    (["model.rope_scaling_factor=8"], "does not apply to multi-latent attention, whose long-context scaling is YaRN"),
    (["model.rope_type=yarn", "model.correction_range_round_to_int=false"], "multi-latent attention always rounds "
                                                                             "YaRN's frequency band"),
    (["model.rope_type=yarn", "model.beta_fast=0.5"], "model.beta_fast=0.5 is invalid: must be at least "
                                                      "model.beta_slow=1"),
    (["model.rope_type=yarn", "model.rotary_scaling_factor=0.5"], "model.rotary_scaling_factor=0.5 is invalid: must "
                                                                  "be >= 1"),
    (["model.qk_pos_emb_head_dim=7"], "is rotated in pairs of channels: make it even"),
    (["data.reset_position_ids=true"], "cannot restart them at documents"),
    ([*ROUTED, "model.moe_router_num_groups=3"], "model.moe_router_num_groups=3 is invalid: must divide"),
    ([*ROUTED, "model.moe_router_group_topk=null"], "needs both model.moe_router_num_groups and"),
    ([*ROUTED, "model.moe_router_group_topk=3"], "model.moe_router_group_topk=3 is invalid: must be at most"),
    ([*ROUTED, "model.moe_layer_freq=[0,1]"], "model.moe_layer_freq=[0, 1] is invalid: must be a 0/1 flag for each "
                                               "of the model.num_layers=4 layers"),
    ([*ROUTED, "model.moe_layer_freq=[0,0,0,0]"], "(1 = MoE), at least one of them 1"),
    ([*ROUTED, "model.moe_layer_freq=[0,2,1,1]"], "must be a 0/1 flag"),
    ([*ROUTED, "model.moe_layer_freq=0"], "model.moe_layer_freq=0 is invalid: must be N >= 1"),
    (["model.moe_layer_freq=2"], "says which layers of an MoE model are MoE layers: set model.num_moe_experts"),
    (["model.mtp_num_layers=1", "model.untie_embeddings_and_output_weights=false"], "model.untie_embeddings_and_"
     "output_weights=False is invalid: multi-token prediction is verified here with an output layer of its own"),
    (["model.mtp_num_layers=1", "data.reset_attention_mask=true"], "data.reset_attention_mask=True is invalid: is not "
     "verified with multi-token prediction"),
    (["model.mtp_num_layers=0"], "model.mtp_num_layers=0 is invalid: must be >= 1"),
    ([*ROUTED, "model.moe_router_topk_scaling_factor=0"], "model.moe_router_topk_scaling_factor=0.0 is invalid: must "
                                                           "be > 0"),
])
def test_each_rule_is_one_config_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:  # a range when the config is read, a rule when it is validated
        validate(load_config(TINY, [*MLA, "parallel.sequence_parallel=true", *overrides]), 8)
    assert message in str(error.value), str(error.value)


def test_a_tiny_deepseek_layout_validates():
    validate(load_config(TINY, [*MLA, *ROUTED, "parallel.sequence_parallel=true",
                                "parallel.expert_model_parallel_size=2"]), 8)
