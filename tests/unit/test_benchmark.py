"""The throughput benchmark's pieces: comparisons within and across precision regimes, every recipe variant a
valid GPU config (or skipped with the recipe's own reason), and the peer: the recipe's model in transformers, fed the
recipe's tokens."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.config.shape import ModelShape
from megatron_ext.config.validate import validate_layout
from recipes import benchmark


def result(variant: str, mbs: int, tokens_per_sec: float, step_time_s: float = 1.0) -> benchmark.Result:
    master, regime = benchmark.regime(variant, "bf16")
    return benchmark.Result(variant, mbs, 4096, master, regime, "gpu", tokens_per_sec, 1.0, None, None, None,
                            step_time_s, 1)


def test_peers_are_compared_within_their_master_weight_regime():
    rows = benchmark.comparisons([result("megatron-eager", 1, 40), result("megatron-compile", 1, 45),
                                  result("hf", 1, 46), result("hf-amp-compile", 1, 42), result("hf-amp", 1, 34)])
    assert rows == [{"micro_batch_size": 1, "recipe": "megatron-compile",
                     "same_regime": {"peer": "hf-amp-compile", "ratio": 45 / 42},
                     "overall": {"peer": "hf", "ratio": 45 / 46}}]


def test_the_timers_cost_is_the_timed_over_the_untimed_step_time():
    assert benchmark.timer_overhead([result("megatron-eager", 1, 40, 1.02), result("megatron-untimed", 1, 41, 1.0),
                                     result("megatron-eager", 2, 40, 2.0), result("hf", 1, 40, 0.5)]) == \
        pytest.approx({1: 0.02})


def one_micro_batch(preset: str, mbs: int) -> dict:
    return {k: v for k, v in benchmark.PRESETS[preset].items() if k != "micro_batch_sizes"} | {"micro_batch_size": mbs}


@pytest.mark.parametrize("preset", ["1b", "moe", "deepseek"])
@pytest.mark.parametrize("te_available", [False, True])
@pytest.mark.parametrize("variant", list(benchmark.MEGATRON_VARIANTS))
def test_every_recipe_variant_is_a_valid_gpu_config(variant, te_available, preset):
    """GPU runs are rare: a variant the config rules reject must fail here, not on the GPU."""
    shape = one_micro_batch(preset, 4)
    reason = benchmark.unavailable(variant, shape, "bf16", te_available, compute_capability=(9, 0), on_gpu=True)
    if reason:  # skipped by the benchmark with the recipe's own reason
        expected = {"megatron-fp8": "TransformerEngine is not importable", "megatron-liger": "needs liger-kernel",
                    **({"megatron-cudagraph": "not verified with MoE models"} if preset != "1b" else {}),
                    **({"megatron-docmask": "cannot restart them at documents"} if preset == "deepseek" else {})}
        assert expected.get(variant) and expected[variant] in reason, (variant, reason)
        if variant == "megatron-fp8":
            assert not te_available
        return
    cfg = benchmark.recipe_config(shape, "bf16", steps=13, variant=variant)
    validate_layout(cfg, world_size=1, te_available=te_available, compute_capability=(9, 0))


@pytest.mark.parametrize("preset, peer", [("tiny", "LlamaForCausalLM"), ("moe-tiny", "MixtralForCausalLM"),
                                          ("deepseek-tiny", "DeepseekV3ForCausalLM")])
def test_the_peer_is_the_recipes_model_and_trains_on_its_tokens(preset, peer):
    shape = one_micro_batch(preset, 2)
    cfg = benchmark.recipe_config(shape, "fp32", steps=3)
    model = benchmark.hf_model(cfg, torch.float32)
    assert type(model).__name__ == peer
    model_shape = ModelShape.of(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == model_shape.num_parameters(shape["vocab_size"])
    if peer == "MixtralForCausalLM":  # the recipe's loss has megatron-core's load-balancing loss in it; the peer's too
        assert model.config.output_router_logits and model.config.router_aux_loss_coef == cfg.model.moe_aux_loss_coeff
    batches = benchmark.recipe_batches(cfg, 3)
    assert [b["tokens"].shape for b in batches] == [(2, shape["seq_length"])] * 3
    assert not torch.equal(batches[0]["tokens"], batches[1]["tokens"])  # a new micro batch each step
