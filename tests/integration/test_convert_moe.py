"""Hugging Face Mixtral and Qwen3-MoE import/export, proven against transformers: a small random MixtralForCausalLM
and Qwen3MoeForCausalLM (4 experts, top-2, 2 layers) are saved with transformers and imported; our model's logits must
match transformers' at EP1 in-process and at EP2 and EP2 × TP2 (+SP) under torchrun, and export must give back every
tensor bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ext.config.schema import load_config
from recipes import convert
from tests.integration.test_convert import TOLERANCE, assert_same_model, hf_logits, max_diff, scale_weights, torchrun
from tests.workers.convert_logits_worker import checkpoint_logits

EXPERTS, TOPK, VOCAB = 4, 2, 1003
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=TOPK, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e6,
             tie_word_embeddings=False)
# family: (config class, model class, its config fields beyond SHAPE, the router the import must choose)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=EXPERTS, router_aux_loss_coef=0.02),
                dict(moe_router_pre_softmax=False, moe_aux_loss_coeff=0.02, qk_layernorm=False)),
    # the top-k weights not renormalised (softmax over all experts first), a head dimension other than hidden / heads
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=96, intermediate_size=256, num_experts=EXPERTS, norm_topk_prob=False,
                       head_dim=32, router_aux_loss_coef=0.001),
                  dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.001, qk_layernorm=True)),
}


def make_moe_model(path: Path, family: str, seed: int = 0) -> Path:
    """A random fp32 model of `family` saved with save_pretrained (sharded), its weights scaled as test_convert's
    Llamas' are."""
    import transformers

    config_class, model_class, fields, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**SHAPE, **fields)
    scale_weights(getattr(transformers, model_class)(config)).save_pretrained(path, max_shard_size="200KB")
    return path


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
    m = cfg.model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (EXPERTS, TOPK, 96)
    assert m.moe_router_score_function == "softmax" and m.rotary_base == 1e6
    assert {key: getattr(m, key) for key in FAMILIES[family][3]} == FAMILIES[family][3]
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.recipe.gpus == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_import_reproduces_transformers_logits_at_ep1(megatron, models, tokens, family):
    ours = megatron(checkpoint_logits, models[family]["ckpt"], tokens)
    theirs = hf_logits(models[family]["hf"], tokens)
    diff = max_diff(ours, theirs)
    print(f"{family} EP1: max |Δlogit| = {diff:.2e} (max |logit| {theirs.abs().max():.2f})")
    assert diff <= TOLERANCE and theirs.abs().max() > 1.0


def test_ep2_and_ep2_tp2_reproduce_transformers_logits(models, tokens, tmp_path):
    torch.save(tokens, tmp_path / "tokens.pt")
    layouts = [(1, 2, False), (2, 2, True)]  # (TP, EP, SP) in one world of 4: DP4 × EP2, and TP2 × DP2 × EP2
    jobs = [{"checkpoint": str(models[family]["ckpt"]), "tp": tp, "pp": 1, "sp": sp, "ep": ep,
             "output": str(tmp_path / f"{family}_tp{tp}_ep{ep}.pt")} for family in FAMILIES for tp, ep, sp in layouts]
    (tmp_path / "jobs.json").write_text(json.dumps({"tokens": str(tmp_path / "tokens.pt"), "jobs": jobs}))
    torchrun(4, ["-m", "tests.workers.convert_logits_worker", str(tmp_path / "jobs.json")])
    for family in FAMILIES:
        theirs = hf_logits(models[family]["hf"], tokens)
        for tp, ep, _ in layouts:
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
    for key in ("num_experts_per_tok", "router_aux_loss_coef", *FAMILIES[family][2]):
        if key != "intermediate_size":  # Qwen3-MoE's dense width: no layer of the model uses it
            assert config[key] == original[key], key
