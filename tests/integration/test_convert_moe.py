"""Hugging Face Mixtral, Qwen3-MoE, DeepSeek-V3 and GPT-OSS import/export, proven against transformers: a small random
MixtralForCausalLM and Qwen3MoeForCausalLM (4 experts, top-2, 2 layers), DeepseekV3ForCausalLM (MLA with q and kv
LoRA, a first dense layer, 8 routed experts in 4 groups with a learned bias, 2 shared experts, YaRN, an odd vocabulary,
an MTP layer in DeepSeek-V3's published form) and GptOssForCausalLM (attention sinks, a sliding window of 8 on its
first layer and full attention on its second, biases everywhere, a GLU clamped at 1.5 so the clamp bites, YaRN
without rounding) are saved with transformers and imported; our model's logits must match transformers' at EP1
in-process and at EP2 and EP2 × TP2 (+SP) — DeepSeek also TP2+SP — under one torchrun, GPT-OSS's greedy tokens must
be transformers' generate()'s, and export must give back every tensor bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ext.config.schema import load_config
from recipes import convert
from tests.integration.test_convert import (
    TOLERANCE,
    assert_same_model,
    hf_logits,
    max_diff,
    safetensors_state,
    scale_weights,
)
from tests.launch import run_module
from tests.workers.convert_logits_worker import checkpoint_greedy, checkpoint_logits

EXPERTS, TOPK, VOCAB = 4, 2, 1003
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=TOPK, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
SOFTMAX_TOP2 = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=96,
                    moe_router_score_function="softmax", rotary_base=1e6)
# family: (config class, model class, its config fields beyond SHAPE, the router the import must choose)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=EXPERTS, router_aux_loss_coef=0.02, rope_theta=1e6),
                dict(moe_router_pre_softmax=False, moe_aux_loss_coeff=0.02, qk_layernorm=False, **SOFTMAX_TOP2)),
    # the top-k weights not renormalised (softmax over all experts first), a head dimension other than hidden / heads
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=96, intermediate_size=256, num_experts=EXPERTS, norm_topk_prob=False,
                       head_dim=32, router_aux_loss_coef=0.001, rope_theta=1e6),
                  dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.001, qk_layernorm=True, **SOFTMAX_TOP2)),
    # 3 layers, the first dense; top-4 of 8 experts from the best 2 of 4 groups; YaRN with a base other than 10000
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_hidden_layers=3, num_key_value_heads=4, rms_norm_eps=1e-6, num_experts_per_tok=4,
                         intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
                         n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32,
                         kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         rope_parameters=YARN),
                    dict(num_moe_experts=8, moe_router_topk=4, moe_ffn_hidden_size=32, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=64, moe_router_num_groups=4,
                         moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, rope_type="yarn",
                         rotary_base=50000.0, rotary_scaling_factor=4.0, mscale_all_dim=1.0, mtp_num_layers=1)),
    # every layer MoE; sinks; windowed then full attention over 48 tokens; YaRN ×4 with truncate=false
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=96, num_local_experts=EXPERTS, head_dim=16, sliding_window=8, swiglu_limit=1.5,
                     router_aux_loss_coef=0.02, rope_parameters={
                         "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 32, "truncate": False}),
                dict(moe_router_pre_softmax=False, moe_aux_loss_coeff=0.02, qk_layernorm=False, softmax_type="learnable",
                     window_size=[7, 0], window_attn_skip_freq=2, add_bias_linear=True, activation_func="quick_gelu",
                     activation_func_clamp_value=1.5, glu_linear_offset=1.0, rope_type="yarn",
                     correction_range_round_to_int=False, **{**SOFTMAX_TOP2, "rotary_base": 150000.0})),
}


# Kimi K2 (moonshotai/Kimi-K2-Base's config.json): DeepSeek-V3's architecture with one expert group (n_group 1, topk_group
# 1: no group-limited routing), one first dense layer, 384 experts top-8 (here 16), a single shared expert, routed
# scaling 2.827, 64 heads (here 4), no MTP layer, YaRN ×32 over 4,096 positions; published as model_type kimi_k2 with
# transformers' DeepseekV3ForCausalLM as its architecture
KIMI_K2 = dict(num_hidden_layers=2, num_key_value_heads=4, rms_norm_eps=1e-6, num_experts_per_tok=8,
               intermediate_size=96, moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=1, n_group=1,
               topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               rope_parameters={**YARN, "factor": 32.0, "original_max_position_embeddings": 4, "beta_fast": 1.0})


def make_moe_model(path: Path, family: str, seed: int = 0) -> Path:
    """A random fp32 model of `family` saved with save_pretrained (sharded), its weights scaled as test_convert's
    Llamas' are (DeepSeek-V3: a random expert bias too, and an MTP layer added)."""
    import transformers

    config_class, model_class, fields, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SHAPE, **fields})
    model = scale_weights(getattr(transformers, model_class)(config))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
            buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(path, max_shard_size="200KB")
    if family == "deepseek_v3":
        add_mtp_layer(path)
    return path


def add_mtp_layer(hf_dir: Path) -> None:
    """DeepSeek-V3's published MTP layer, which transformers does not save: model.layers.{N} (N = the layer count) with
    a decoder layer's tensors (here the last layer's, perturbed), enorm, hnorm, eh_proj, shared_head.norm, and its
    own copies of the embedding and output layer — in a shard of its own, listed in the index."""
    from safetensors.torch import save_file

    state = safetensors_state(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, f"model.layers.{config['num_hidden_layers']}"
    generator = torch.Generator().manual_seed(11)
    layer = {name.replace(f"model.layers.{last}.", f"{mtp}."): t + 0.1 * torch.randn(t.shape, generator=generator)
             for name, t in state.items() if name.startswith(f"model.layers.{last}.")}
    hidden = config["hidden_size"]
    layer.update({f"{mtp}.enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=generator),
                  f"{mtp}.hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=generator),
                  f"{mtp}.shared_head.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=generator),
                  f"{mtp}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5,
                  f"{mtp}.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                  f"{mtp}.shared_head.head.weight": state["lm_head.weight"].clone()})
    save_file(layer, str(hf_dir / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in layer})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def models(megatron, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Each family's Hugging Face directory and the checkpoint imported from it (recipe.yaml: EP2)."""
    out = {}
    for seed, family in enumerate(FAMILIES):
        root = tmp_path_factory.mktemp(family)
        hf = make_moe_model(root / "hf", family, seed)
        out[family] = {"hf": hf, "ckpt": megatron(convert.import_hf, hf, root / "ckpt", 1, 1, 2), "root": root}
    return out


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("family", FAMILIES)
def test_import_writes_an_moe_recipe_with_the_models_router(models, family):
    cfg = load_config(models[family]["ckpt"] / "recipe.yaml")
    assert {key: getattr(cfg.model, key) for key in FAMILIES[family][3]} == FAMILIES[family][3]
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.recipe.gpus == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_import_reproduces_transformers_logits_at_ep1(megatron, models, tokens, family):
    ours = megatron(checkpoint_logits, models[family]["ckpt"], tokens)
    theirs = hf_logits(models[family]["hf"], tokens)
    diff = max_diff(ours, theirs)
    print(f"{family} EP1: max |Δlogit| = {diff:.2e} (max |logit| {theirs.abs().max():.2f})")
    assert diff <= TOLERANCE and theirs.abs().max() > 1.0


def test_ep2_ep2_tp2_and_mla_tp2_reproduce_transformers_logits(models, tokens, tmp_path):
    torch.save(tokens, tmp_path / "tokens.pt")
    # (TP, EP, SP) in one world of 4: DP4 × EP2, TP2 × DP2 × EP2, and for MLA TP2 × DP2 with SP
    layouts = {family: [(1, 2, False), (2, 2, True)] + ([(2, 1, True)] if family == "deepseek_v3" else [])
               for family in FAMILIES}
    jobs = [{"checkpoint": str(models[family]["ckpt"]), "tp": tp, "pp": 1, "sp": sp, "ep": ep,
             "output": str(tmp_path / f"{family}_tp{tp}_ep{ep}.pt")} for family in FAMILIES
            for tp, ep, sp in layouts[family]]
    (tmp_path / "jobs.json").write_text(json.dumps({"tokens": str(tmp_path / "tokens.pt"), "jobs": jobs}))
    run_module(4, ["-m", "tests.workers.convert_logits_worker", str(tmp_path / "jobs.json")])
    for family in FAMILIES:
        theirs = hf_logits(models[family]["hf"], tokens)
        for tp, ep, _ in layouts[family]:
            diff = max_diff(torch.load(tmp_path / f"{family}_tp{tp}_ep{ep}.pt"), theirs)
            print(f"{family} TP{tp} × EP{ep}: max |Δlogit| = {diff:.2e}")
            assert diff <= TOLERANCE, (family, tp, ep)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_back_every_tensor_bit_exactly(megatron, models, tokens, family):
    exported = megatron(convert.export_hf, models[family]["ckpt"], models[family]["root"] / "exported")
    assert_same_model(models[family]["hf"], exported, tokens)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family][1]]
    original = json.loads((models[family]["hf"] / "config.json").read_text())
    # the published form (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts)
    original = {("num_experts" if key == "num_local_experts" and family == "qwen3_moe" else key): value
                for key, value in original.items()}
    original["rope_theta"] = original["rope_parameters"]["rope_theta"]  # transformers 5 writes it there
    for key in ("num_experts_per_tok", *FAMILIES[family][2]):
        if (family, key) != ("qwen3_moe", "intermediate_size"):  # Qwen3-MoE's dense width: no layer uses it
            assert config[key] == original[key], key


def test_gpt_oss_greedy_tokens_are_transformers_generate(megatron, models):
    """Past the sliding window (a 10-token prompt and 14 more), recipes.generate's loop on the imported checkpoint
    writes what transformers' generate() (its KV cache, sliding-window cache layers) writes."""
    from transformers import AutoModelForCausalLM

    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(models["gpt_oss"]["hf"], dtype=torch.float32).eval()
    reference = model.generate(prompt, max_new_tokens=14, do_sample=False, attention_mask=torch.ones_like(prompt))
    ours = megatron(checkpoint_greedy, models["gpt_oss"]["ckpt"], prompt[0].tolist(), 14)
    assert ours == reference[0, 10:].tolist()


def test_a_kimi_k2_shaped_model_imports_and_exports_bit_identically(megatron, tokens, tmp_path):
    """As Moonshot publishes it (model_type kimi_k2, architecture DeepseekV3ForCausalLM): imported as a DeepSeek-V3
    class model without group-limited routing, exported back tensor for tensor (as transformers' deepseek_v3, which
    loads it without remote code)."""
    import transformers

    torch.manual_seed(5)
    model = scale_weights(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE, **KIMI_K2})))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.3 * torch.randn_like(buffer))
    hf = tmp_path / "hf"
    model.save_pretrained(hf, max_shard_size="200KB")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2", "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}))
    checkpoint = megatron(convert.import_hf, hf, tmp_path / "ckpt", 1, 1, 2)
    cfg = load_config(checkpoint / "recipe.yaml")
    assert (cfg.model.num_moe_experts, cfg.model.moe_router_topk, cfg.model.moe_router_num_groups,
            cfg.model.moe_router_topk_scaling_factor, cfg.model.moe_layer_freq, cfg.model.mtp_num_layers) == (
        16, 8, None, 2.827, [0, 1], None)
    exported = megatron(convert.export_hf, checkpoint, tmp_path / "exported")
    (hf / "config.json").write_text(json.dumps(config))  # transformers reads the original as deepseek_v3
    assert_same_model(hf, exported, tokens)
    written = json.loads((exported / "config.json").read_text())
    for key in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                "first_k_dense_replace", "n_shared_experts", "q_lora_rank", "kv_lora_rank"):
        assert written[key] == config[key], key



def test_a_gpt_oss_with_mxfp4_experts_imports_as_transformers_dequantizes_it(megatron, models, tokens, tmp_path):
    """OpenAI's published form: each layer's expert tensors as MXFP4 blocks and scales (random ones here) with
    quantization_config mxfp4. Imported, its logits are transformers' for the same model with the experts
    dequantized by transformers' own function."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state, config = safetensors_state(models["gpt_oss"]["hf"]), json.loads(
        (models["gpt_oss"]["hf"] / "config.json").read_text())
    generator = torch.Generator().manual_seed(13)
    dense, quantized = dict(state), dict(state)
    for name in [name for name in state if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state[name].shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(121, 126, (experts, outputs, inputs // 32), generator=generator, dtype=torch.uint8)
        dense[name] = convert_moe_packed_tensors(blocks, scales).float()
        del quantized[name]
        quantized.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
    for directory, tensors, extra in [("dense", dense, {}),
                                      ("mxfp4", quantized, {"quantization_config": {"quant_method": "mxfp4"}})]:
        (tmp_path / directory).mkdir()
        save_file(tensors, str(tmp_path / directory / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / directory / "config.json").write_text(json.dumps({**config, **extra}))
    checkpoint = megatron(convert.import_hf, tmp_path / "mxfp4", tmp_path / "ckpt", 1, 1, 2)
    ours, theirs = megatron(checkpoint_logits, checkpoint, tokens), hf_logits(tmp_path / "dense", tokens)
    diff = max_diff(ours, theirs)
    print(f"gpt_oss MXFP4 EP1: max |Δlogit| = {diff:.2e} (max |logit| {theirs.abs().max():.2f})")
    assert diff <= TOLERANCE and theirs.abs().max() > 1.0
