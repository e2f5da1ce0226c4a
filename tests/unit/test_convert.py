"""The converter's pure pieces: the layout a saved run is rebuilt under."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ext.config.schema import load_config
from megatron_ext.config.shape import ModelShape
from megatron_ext.config.validate import validate_layout
from megatron_ext.errors import ConversionError
from recipes import saved_model
from tests.launch import TINY


def test_the_layout_a_checkpoint_is_loaded_under_is_a_valid_recipe():
    """export-hf and the logit checks rebuild the saved run under another layout: that config passes validation."""
    saved = saved_model.SavedCheckpoint(Path("ckpt/iter_0000001"), load_config(TINY, ["data.mock=true",
                                    "model.vocab_size=1000"]), 1000, 1024, "training_state")
    for tp, pp in [(1, 1), (2, 2)]:
        validate_layout(saved_model.layout_config(saved, tp, pp), world_size=tp * pp)




def _mixtral_config(tmp_path: Path, **changes) -> Path:
    import json

    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1003, "num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6,
              "router_aux_loss_coef": 0.02, "sliding_window": None, "router_jitter_noise": 0.0, **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_mixtral_configs_read_as_moe_and_what_the_recipe_cannot_compute_is_one_error(tmp_path):
    import pytest

    from megatron_ext.convert import families, hf_llama
    from megatron_ext.errors import ConversionError

    shape = families.read_config(_mixtral_config(tmp_path))
    assert (shape.num_experts, shape.router_topk, shape.ffn_hidden_size, shape.model_type) == (4, 2, 96, "mixtral")
    names = set(hf_llama.hf_shapes(shape))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names and not any("mlp" in n for n in names)
    fields = hf_llama.recipe_model_fields(shape, 1)
    assert (fields["num_moe_experts"], fields["moe_router_topk"], fields["moe_aux_loss_coeff"]) == (4, 2, 0.02)
    for changes, fragment in [({"sliding_window": 4096}, "sliding_window=4096 is not supported"),
                              ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
                              ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
                              ({"architectures": ["Qwen2MoeForCausalLM"]}, "is not supported; one of")]:
        with pytest.raises(ConversionError, match=fragment):
            families.read_config(_mixtral_config(tmp_path, **changes))


def test_moe_settings_mixtral_has_no_counterpart_for_refuse_export():
    import pytest

    from megatron_ext.convert import hf_llama
    from megatron_ext.errors import ConversionError

    moe = load_config(TINY.parent / "tiny_moe.yaml", ["model.vocab_size=1000"])
    assert hf_llama.shape_from_recipe(moe, 1000).num_experts == 8
    shared = load_config(TINY.parent / "tiny_moe.yaml", ["model.moe_shared_expert_intermediate_size=256"])
    with pytest.raises(ConversionError, match="exported as Mixtral, whose router and experts have no such setting"):
        hf_llama.shape_from_recipe(shared, 1000)
    first_dense = load_config(TINY.parent / "tiny_moe.yaml", ["model.moe_layer_freq=[0,1,1,1]"])
    with pytest.raises(ConversionError, match=r"model.moe_layer_freq=\[0, 1, 1, 1\]: this MoE model is exported as "
                                              r"Mixtral, which has an MoE layer everywhere"):
        hf_llama.shape_from_recipe(first_dense, 1000)


def test_qwen3_moe_configs_read_with_their_router_and_what_differs_is_one_error(tmp_path):
    import pytest

    from megatron_ext.convert import families, hf_llama
    from megatron_ext.errors import ConversionError

    qwen3_moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                 "moe_intermediate_size": 48, "intermediate_size": 256, "norm_topk_prob": True, "head_dim": 32,
                 "num_local_experts": None, "router_aux_loss_coef": 0.001}
    shape = families.read_config(_mixtral_config(tmp_path, **qwen3_moe))
    assert (shape.num_experts, shape.ffn_hidden_size, shape.head_dim, shape.qk_norm, shape.norm_topk_prob,
            shape.model_type) == (4, 48, 32, True, True, "qwen3_moe")
    names = set(hf_llama.hf_shapes(shape))
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight",
            "model.layers.0.self_attn.k_norm.weight"} <= names and not any("block_sparse" in n for n in names)
    fields = hf_llama.recipe_model_fields(shape, 1)
    assert (fields["qk_layernorm"], fields["moe_router_pre_softmax"], fields["kv_channels"]) == (True, False, 32)
    for changes, fragment in [({"decoder_sparse_step": 2}, "only models whose every layer is an MoE layer"),
                              ({"mlp_only_layers": [0]}, "only models whose every layer is an MoE layer"),
                              ({"use_sliding_window": True}, "sliding-window attention, which is not supported")]:
        with pytest.raises(ConversionError, match=fragment):
            families.read_config(_mixtral_config(tmp_path, **{**qwen3_moe, **changes}))


def test_a_recipe_with_qk_layernorm_exports_as_qwen3_whose_router_may_skip_renormalising():
    import torch

    from megatron_ext.convert import hf_llama

    moe = load_config(TINY.parent / "tiny_moe.yaml", ["model.qk_layernorm=true", "model.moe_router_pre_softmax=true"])
    shape = hf_llama.shape_from_recipe(moe, 1000)
    assert (shape.model_type, shape.norm_topk_prob) == ("qwen3_moe", False)
    config = hf_llama.hf_config(shape, torch.float32, None, None)
    assert (config["architectures"], config["num_experts"], config["norm_topk_prob"]) == (
        ["Qwen3MoeForCausalLM"], 8, False)
    dense = load_config(TINY, ["model.qk_layernorm=true"])
    assert hf_llama.shape_from_recipe(dense, 1000).model_type == "qwen3"


DEEPSEEK_V3 = {  # DeepSeek-V3's published config.json, its size cut down (its FP8 and MTP fields as published)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 16, "routed_scaling_factor": 2.5, "kv_lora_rank": 24,
    "q_lora_rank": 32, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "vocab_size": 1003, "attention_bias": False,
}


def test_deepseek_v3_configs_read_as_mla_moe_and_what_differs_is_one_error(tmp_path):
    import json

    import pytest
    import torch

    from megatron_ext.convert import families, hf_deepseek
    from megatron_ext.errors import ConversionError

    def read(**changes):
        (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3, **changes}))
        return families.read_config(tmp_path)

    shape = read()
    assert (shape.first_k_dense, shape.num_groups, shape.topk_groups, shape.yarn, shape.mtp_layers) == (
        3, 8, 4, (40.0, 4096, 32.0, 1.0, 1.0, 1.0), 0)  # no safetensors read: no MTP weights counted
    fields = hf_deepseek.recipe_model_fields(shape, 1)
    assert (fields["moe_layer_freq"], fields["moe_shared_expert_intermediate_size"], fields["rope_type"],
            fields["qk_head_dim"], fields["moe_router_group_topk"], fields["seq_length"]) == (
        [0, 0, 0, 1], 32, "yarn", 16, 4, 4096)
    config = hf_deepseek.hf_config(shape, torch.bfloat16, 0, 1)
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    for changes, fragment in [
        ({"rope_interleave": False}, "rope_interleave=False is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"num_experts_per_tok": 6}, "num_experts_per_tok = 2 × topk_group"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05 is not supported"),
        ({"q_lora_rank": None}, "q_lora_rank=null"),
        ({"num_key_value_heads": 1}, "must equal num_attention_heads=4"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace=4 must be 0..num_hidden_layers-1"),
        ({"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "mscale_all_dim": None, "mscale": 0.7}},
         "mscale=0.7 without mscale_all_dim"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
        ({"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "beta_fast": "fast"}}, "beta_fast='fast' must be a positive"),
    ]:
        with pytest.raises(ConversionError, match=fragment):
            read(**changes)


def test_a_kimi_k2_config_reads_as_deepseek_v3_without_group_limits_and_validates_as_a_recipe(tmp_path):
    """Kimi K2's published config.json (its size cut down): DeepseekV3ForCausalLM with one expert group, YaRN with
    beta_fast = beta_slow = 1, no MTP layer; the recipe written for it validates at EP2."""
    import json

    from megatron_ext.config.schema import RecipeConfig
    from megatron_ext.convert import families, hf_deepseek

    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "n_routed_experts": 24,
            "num_experts_per_tok": 8, "first_k_dense_replace": 1, "routed_scaling_factor": 2.827,
            "num_nextn_predict_layers": 0, "rope_theta": 50000.0, "aux_loss_alpha": 0.001, "seq_aux": True,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
    (tmp_path / "config.json").write_text(json.dumps(kimi))
    shape = families.read_config(tmp_path)
    assert (shape.num_groups, shape.first_k_dense, shape.yarn[2:4], shape.rope_theta) == (1, 1, (1.0, 1.0), 50000.0)
    cfg = RecipeConfig()
    for key, value in hf_deepseek.recipe_model_fields(shape, 1).items():
        setattr(cfg.model, key, value)
    assert cfg.model.moe_router_num_groups is None and cfg.model.moe_layer_freq == [0, 1, 1, 1]
    cfg.parallel.expert_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = 2, 1
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel = 1, False
    validate_layout(cfg, world_size=2)


def test_a_deepseek_recipe_exports_as_deepseek_v3_and_what_it_cannot_hold_is_one_error():
    import pytest

    from megatron_ext.convert import families
    from megatron_ext.errors import ConversionError

    eps = ["model.layernorm_epsilon=1e-6"]  # DeepSeek-V3's (tiny_deepseek trains with 1e-5)
    deepseek = load_config(TINY.parent / "tiny_deepseek.yaml", eps)
    shape = families.shape_from_recipe(deepseek, 1000)
    assert (shape.architecture, shape.first_k_dense, shape.num_shared_experts, shape.mtp_layers, shape.yarn) == (
        "DeepseekV3ForCausalLM", 1, 1, 1, None)
    for overrides, fragment in [([], "model.layernorm_epsilon=1e-05: transformers' DeepSeek-V3 norms"),
                                ([*eps, "model.moe_router_enable_expert_bias=false"], "has moe_router_enable_expert_"),
                                ([*eps, "model.moe_layer_freq=[1,0,1,1]"], "first k layers dense and every later one"),
                                ([*eps, "model.moe_shared_expert_intermediate_size=100"], "make it a multiple"),
                                ([*eps, "model.moe_router_group_topk=2"], "moe_router_topk = 2 × moe_router_group_topk")]:
        with pytest.raises(ConversionError, match=fragment):
            families.shape_from_recipe(load_config(TINY.parent / "tiny_deepseek.yaml", overrides), 1000)


def test_a_conversion_says_what_it_will_read_write_and_hold_and_refuses_a_disk_too_small(tmp_path):
    from megatron_ext.convert.cost import export_cost, import_cost, streamed_parameters
    from megatron_ext.convert.hf_files import shard_size_bytes

    # Llama-3.1-405B's 405.9 B bf16 parameters at transformers' default shard size, streamed: its embedding and
    # output layer (2 × 128,256 × 16,384), the final norm, one layer twice (3.19 B each) and two 5 GB shards
    shape = ModelShape.of(load_config(TINY.parent / "llama3_1_405b_40gpu_bf16.yaml").model)
    first, layer = streamed_parameters(shape, 128_256)
    assert (first, layer) == (2 * 128_256 * 16_384 + 16_384, 3_187_703_808)
    assert shape.num_parameters(128_256) == 405_853_388_800
    cost = export_cost(405_853_388_800, 0, 2, shard_size_bytes("5GB"), tmp_path / "out", first, layer)
    assert (cost.read_bytes, cost.write_bytes, cost.files) == (811_706_777_600, 811_706_777_600, 163)
    assert cost.describe(10**12) == (
        f"export-hf: reads 811.71 GB, writes 811.71 GB in 163 files to {tmp_path / 'out'} (1,000.0 GB free there); "
        "this process holds about 31.16 GB at its peak")
    # its import writes a file per group (the first, then 126 layers) as it converts it: a layer twice is the peak
    hf = tmp_path / "model.safetensors"
    hf.write_bytes(b"0" * 1000)
    imported = import_cost([hf], 405_853_388_800, first, layer, 126, 2, tmp_path / "ckpt")
    assert imported.describe(10**12) == (
        f"import-hf: reads 0.00 GB, writes 811.71 GB in 127 files to {tmp_path / 'ckpt'} (1,000.0 GB free there); "
        "this process holds about 12.75 GB at its peak")
    cost.check_disk(10**12)
    with pytest.raises(ConversionError) as e:
        cost.check_disk(500 * 10**9)
    assert str(e.value) == (f"{tmp_path / 'out'}: 500.00 GB free, export-hf writes 827.94 GB: free space there or "
                            "choose another --output")
    assert cost.free_bytes() > 0  # the nearest existing ancestor's file system
    assert (shard_size_bytes("100KB"), shard_size_bytes("5GB")) == (100_000, 5_000_000_000)


def test_mxfp4_experts_dequantize_as_transformers_does():
    """OpenAI's MXFP4 expert tensors ([experts, out, in/32, 16] bytes, [experts, out, in/32] exponents), one expert
    row at a time, equal transformers' dequantization of the whole stack bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megatron_ext.convert.hf_files import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 8, 2), generator=generator, dtype=torch.uint8)
    ours = torch.stack([dequantize_mxfp4(blocks[e], scales[e]).transpose(-1, -2) for e in range(3)])
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales)) and ours.shape == (3, 64, 8)

