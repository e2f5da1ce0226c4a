"""optimizer.name=muon and model.qk_clip: each key reaches megatron-core's OptimizerConfig / TransformerConfig, what
megatron-core 0.19.2 cannot run is one line before launch, the planner's Muon terms against their formulas and
megatron-core's built optimizer, and QK-clip holding the attention logits at the threshold (one CPU process)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.config.schema import load_config
from megatron_ext.config.shape import ModelShape
from megatron_ext.config.validate import validate_layout
from megatron_ext.errors import ConfigError
from megatron_ext.planner.layout import RankShape
from megatron_ext.planner.muon import layer_matrices, newton_schulz_flops
from megatron_ext.planner.static_memory import optimizer_bytes_per_element
from tests.launch import SINGLE_PROCESS, TINY

MUON = ["optimizer.name=muon", "train.precision=bf16"]
VOCAB = 256


def tiny(*overrides: str):
    return load_config(TINY, [*MUON, *overrides])


def test_muon_and_its_options_reach_megatron_cores_optimizer_config():
    from megatron_ext.training.optimizer import optimizer_config

    cfg = tiny("optimizer.muon_momentum=0.9", "optimizer.muon_nesterov=true", "optimizer.muon_num_ns_steps=7",
               "optimizer.muon_scale_mode=unit_rms_norm", "optimizer.muon_extra_scale_factor=0.2",
               "optimizer.muon_split_qkv=false", "optimizer.muon_tp_mode=duplicated",
               "optimizer.muon_fp32_matmul_prec=highest")
    config = optimizer_config(cfg)
    assert (config.optimizer, config.muon_momentum, config.muon_nesterov, config.muon_num_ns_steps,
            config.muon_scale_mode, config.muon_extra_scale_factor, config.muon_split_qkv, config.muon_tp_mode,
            config.muon_fp32_matmul_prec) == ("muon", 0.9, True, 7, "unit_rms_norm", 0.2, False, "duplicated", "highest")
    # the distributed optimizer of a Muon run is megatron-core's layer-wise one
    assert (config.use_layer_wise_distributed_optimizer, config.use_distributed_optimizer) == (True, False)
    plain = optimizer_config(tiny("parallel.use_distributed_optimizer=false", "parallel.overlap_param_gather=false"))
    assert (plain.use_layer_wise_distributed_optimizer, plain.use_distributed_optimizer) == (False, False)
    assert optimizer_config(load_config(TINY)).optimizer == "adam"


def test_qk_clip_reaches_megatron_cores_transformer_config():
    from megatron_ext.model.llama import transformer_config

    config = transformer_config(tiny("model.qk_clip=true", "model.qk_clip_threshold=50", "model.qk_clip_alpha=0.3"),
                                on_gpu=False, use_te=False)
    assert (config.qk_clip, config.qk_clip_threshold, config.qk_clip_alpha) == (True, 50.0, 0.3)


@pytest.mark.parametrize("overrides, message", [
    ([*SINGLE_PROCESS, "parallel.use_megatron_fsdp=true"],
     "parallel.use_megatron_fsdp=True is invalid: Megatron-FSDP shards"),
    (["optimizer.optimizer_cpu_offload=true"], "optimizer.optimizer_cpu_offload=True is invalid: megatron-core's "
                                                "optimizer offload steps Adam"),
    (["train.precision=fp16"], "train.precision='fp16' is invalid: megatron-core 0.19.2 refuses Muon with fp16"),
    (["train.precision=fp32"], "train.precision='fp32' is invalid: Muon's layer-wise distributed optimizer runs in "
                               "bf16"),
    (["checkpoint.optimizer_format=fully_reshardable_mem_efficient"], "gathers over gloo groups"),
    (["optimizer.name=adam", "model.qk_clip=true"], "model.qk_clip=True is invalid: is MuonClip's, and needs "
                                                    "optimizer.name=muon"),
    (["model.qk_clip=true", "parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=1",
      "parallel.sequence_parallel=false", "model.attention_backend=local"],
     "model.qk_clip=True is invalid: records each head's largest logit in one piece of the sequence"),
])
def test_what_megatron_core_cannot_run_with_muon_is_one_line(overrides, message):
    """(The numeric keys' ranges are config/ranges.py's, held by test_config_ranges.py.)"""
    with pytest.raises(ConfigError) as e:
        validate_layout(tiny(*overrides), 4)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_fp32_muon_runs_without_the_distributed_optimizer():
    validate_layout(tiny("train.precision=fp32", "parallel.use_distributed_optimizer=false",
                         "parallel.overlap_param_gather=false"), 4)


def test_newton_schulz_flops_are_the_quintic_iterations_matmuls():
    # one iteration on a 64×256 matrix: X·Xᵀ (64·64·256 multiply-adds), A·A (64³), B·X (64·64·256), ×2 FLOPs each
    assert newton_schulz_flops(64, 256, 1) == 2 * (64 * 64 * 256 + 64 ** 3 + 64 * 64 * 256)
    assert newton_schulz_flops(256, 64, 5) == 5 * newton_schulz_flops(64, 256, 1)


def test_the_matrices_muon_orthogonalizes_are_the_layers_two_dimensional_weights():
    cfg = tiny(*SINGLE_PROCESS, "model.num_query_groups=4")
    shape = RankShape.of(cfg, VOCAB)
    h, f, d = shape.hidden, shape.ffn, shape.head_dim
    whole = layer_matrices(shape, moe=False, split_qkv=False, tp=1)
    assert whole == [((shape.heads + 2 * 4) * d, h), (h, shape.heads * d), (2 * f, h), (h, f)]
    split = layer_matrices(shape, moe=False, split_qkv=True, tp=1)
    assert sum(r * c for r, c in split) == sum(r * c for r, c in whole)  # the same weights, per query group
    layer = shape.model.attention_parameters() + shape.model.mlp_parameters(moe=False)
    assert sum(r * c for r, c in whole) == layer


def test_the_planner_counts_muons_one_momentum_for_the_matrices_it_steps():
    adam, muon = (RankShape.of(load_config(TINY, [*o, "train.precision=bf16"]), VOCAB) for o in ([], MUON))
    assert optimizer_bytes_per_element(adam) == 12
    model = ModelShape.of(load_config(TINY).model)
    share = model.matrix_parameters(VOCAB) / model.num_parameters(VOCAB)
    assert 0.5 < share < 1 and math.isclose(optimizer_bytes_per_element(muon), 12 - 4 * share)


def _built_muon_state(overrides: list[str]) -> dict:
    """In a spawned world of one: megatron-core's Muon built for the tiny model, its state after one step (bytes of
    the Muon momenta, of Adam's moments and fp32 main copies), and the model's parameter count."""
    from megatron.core import tensor_parallel

    from megatron_ext.distributed.parallel import wrap_with_ddp
    from megatron_ext.model.llama import transformer_config
    from megatron_ext.training.optimizer import build_optimizer
    from recipes.saved_model import build_model, model_parallel_world

    cfg = load_config(TINY, overrides)
    with model_parallel_world(cfg):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = build_model(cfg, VOCAB)
        chunks = wrap_with_ddp([model], transformer_config(cfg, on_gpu=False, use_te=False), cfg)
        optimizer = build_optimizer(cfg, chunks, on_gpu=False)
        tokens = torch.randint(0, VOCAB, (2, cfg.model.seq_length))
        chunks[0].module(tokens, None, attention_mask=None, labels=tokens).float().mean().backward()
        optimizer.step()
        state = sum(t.numel() * t.element_size() for opt in optimizer.chained_optimizers
                    for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return {"state": state, "parameters": sum(p.numel() for p in model.parameters())}


def test_the_planners_muon_state_bytes_match_megatron_cores_built_optimizer(megatron):
    overrides = ["optimizer.name=muon", "train.precision=fp32", "parallel.use_distributed_optimizer=false",
                 "parallel.overlap_param_gather=false", f"model.vocab_size={VOCAB}", *SINGLE_PROCESS]
    built = megatron(_built_muon_state, overrides)
    shape = RankShape.of(load_config(TINY, overrides), VOCAB)
    # fp32 parameters are stepped in place: the state is Muon's momentum and Adam's two moments
    assert built["state"] == pytest.approx(built["parameters"] * optimizer_bytes_per_element(shape) , rel=1e-9)


def _logits_after_clip(overrides: list[str], clip: bool) -> dict:
    """In a spawned world of one: the tiny model's largest attention logit per layer before and after one
    clip_after_update, the query/key weights blown up 30× first (a forced large logit)."""
    from megatron.core import tensor_parallel

    from megatron_ext.training import qk_clip
    from recipes.saved_model import build_model, model_parallel_world

    cfg = load_config(TINY, overrides)
    with model_parallel_world(cfg):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = build_model(cfg, VOCAB).train()
        with torch.no_grad():
            for layer in model.decoder.layers:
                layer.self_attention.linear_qkv.weight.mul_(30.0)
        tokens = torch.randint(0, VOCAB, (2, cfg.model.seq_length))

        def largest() -> list[float]:
            qk_clip.forget_max_logits([model])
            with torch.no_grad():
                model(tokens, None, attention_mask=None)
            return [layer.self_attention.core_attention.current_max_attn_logits.max().item()
                    for layer in model.decoder.layers]

        before = largest()
        logged = qk_clip.clip_after_update([model]) if clip else None
        return {"before": before, "after": largest(), "logged": logged}


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "not_clipped"])
def test_qk_clip_holds_every_heads_largest_logit_at_the_threshold(megatron, clip):
    threshold = 20.0
    overrides = [*MUON, *SINGLE_PROCESS, "train.precision=fp32", "parallel.use_distributed_optimizer=false",
                 "parallel.overlap_param_gather=false", "model.qk_clip=true", f"model.qk_clip_threshold={threshold}",
                 f"model.vocab_size={VOCAB}"]
    out = megatron(_logits_after_clip, overrides, clip)
    assert min(out["before"]) > 2 * threshold  # the forced logits are far past it
    if clip:
        assert out["logged"] == pytest.approx(max(out["before"]))
        # the first layer's input is the embedding, which the clip leaves alone: its largest logit is the threshold;
        # the later layers' inputs changed with the earlier layers' attention, their logits fell as far
        assert out["after"][0] == pytest.approx(threshold, rel=1e-4)
        assert max(out["after"]) < min(out["before"]) / 2
    else:  # the same model without the clip keeps its logits: the assertion above is the clip's
        assert out["after"] == pytest.approx(out["before"])


def test_the_recorded_logit_is_the_largest_visible_q_dot_k():
    from megatron_ext.model.attention import max_logit_per_head

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8)  # 4 query heads over 2 KV groups
    documents = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    full = torch.einsum("bhsd,bhtd->bhst", q, k.repeat_interleave(2, dim=1)) * 0.5
    allowed = torch.ones(9, 9).tril().bool() & (documents[:, :, None] == documents[:, None, :])[:, None]
    expected = full.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.equal(max_logit_per_head(q, k, 0.5, documents), expected)
    # causal only: a later key's larger logit is not seen
    causal = full.masked_fill(~torch.ones(9, 9).tril().bool(), float("-inf")).amax(dim=(0, 2, 3))
    assert torch.equal(max_logit_per_head(q, k, 0.5, None), causal)
