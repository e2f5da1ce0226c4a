"""Hugging Face Mixtral import/export, proven against transformers: a small random MixtralForCausalLM (4 experts,
top-2, 2 layers) is saved with transformers and imported; our model's logits must match transformers' at EP1 in-process
and at EP2 and EP2 × TP2 (+SP) under torchrun, and export must give back every tensor bit for bit.
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


def make_mixtral(path: Path, seed: int = 0) -> Path:
    """A random fp32 MixtralForCausalLM saved with save_pretrained (sharded), its weights scaled as test_convert's
    Llamas' are."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOPK, max_position_embeddings=128, rms_norm_eps=1e-5,
                           rope_theta=1e6, router_aux_loss_coef=0.02, tie_word_embeddings=False)
    scale_weights(MixtralForCausalLM(config)).save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def mixtral(megatron, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixtral")
    hf = make_mixtral(root / "hf")
    ckpt = megatron(convert.import_hf, hf, root / "ckpt", 1, 1, 2)  # recipe.yaml: EP2
    return {"hf": hf, "ckpt": ckpt, "root": root}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(7))


def test_import_writes_an_moe_recipe_with_mixtrals_router(mixtral):
    cfg = load_config(mixtral["ckpt"] / "recipe.yaml")
    m = cfg.model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (EXPERTS, TOPK, 96)
    assert not m.moe_router_pre_softmax and m.moe_router_score_function == "softmax"
    assert m.moe_aux_loss_coeff == 0.02 and m.rotary_base == 1e6
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.recipe.gpus == 2


def test_import_reproduces_transformers_logits_at_ep1(megatron, mixtral, tokens):
    ours = megatron(checkpoint_logits, mixtral["ckpt"], tokens)
    theirs = hf_logits(mixtral["hf"], tokens)
    diff = max_diff(ours, theirs)
    print(f"Mixtral EP1: max |Δlogit| = {diff:.2e} (max |logit| {theirs.abs().max():.2f})")
    assert diff <= TOLERANCE and theirs.abs().max() > 1.0


def test_ep2_and_ep2_tp2_reproduce_transformers_logits(mixtral, tokens):
    root = mixtral["root"]
    torch.save(tokens, root / "tokens.pt")
    layouts = [(1, 2, False), (2, 2, True)]  # (TP, EP, SP) in one world of 4: DP4 × EP2, and TP2 × DP2 × EP2
    jobs = [{"checkpoint": str(mixtral["ckpt"]), "tp": tp, "pp": 1, "sp": sp, "ep": ep,
             "output": str(root / f"tp{tp}_ep{ep}.pt")} for tp, ep, sp in layouts]
    (root / "jobs.json").write_text(json.dumps({"tokens": str(root / "tokens.pt"), "jobs": jobs}))
    torchrun(4, ["-m", "tests.workers.convert_logits_worker", str(root / "jobs.json")])
    theirs = hf_logits(mixtral["hf"], tokens)
    for tp, ep, _ in layouts:
        diff = max_diff(torch.load(root / f"tp{tp}_ep{ep}.pt"), theirs)
        print(f"Mixtral TP{tp} × EP{ep}: max |Δlogit| = {diff:.2e}")
        assert diff <= TOLERANCE, (tp, ep)


def test_export_gives_back_every_tensor_bit_exactly(megatron, mixtral, tokens):
    exported = megatron(convert.export_hf, mixtral["ckpt"], mixtral["root"] / "exported")
    assert_same_model(mixtral["hf"], exported, tokens)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (EXPERTS, TOPK)
