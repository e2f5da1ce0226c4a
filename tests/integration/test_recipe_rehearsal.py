"""The >100B recipes rehearsed on CPU at reduced width, built and trained under each recipe's own layout rules: the
405B's first and last pipeline stages (stage depth, sequence parallelism, full recompute, micro batch, untied output,
the optimizer state in host memory); DeepSeek-V3 671B's layer pattern and parallelism (its dense first layers on a
deeper first stage, MoE layers with shared experts and group-limited routing split over EP with whole experts, YaRN
MLA under TP + SP, the MTP layer and the output layer on the last stage); GPT-OSS-120B's attention and experts (sinks,
windowed and full layers alternating across pipeline stages, biases everywhere, the clamped GLU, YaRN, biased experts
whole under EP)."""

from __future__ import annotations

import math

import pytest

from megatron_ext.config.schema import load_config, pipeline_stage_layers
from tests.launch import ROOT, read_scalars, run_pretrain

RECIPE = ROOT / "configs" / "llama3_1_405b_40gpu_bf16.yaml"
DEEPSEEK_V3 = ROOT / "configs" / "deepseek_v3_671b_192gpu_fp8.yaml"
GPT_OSS = ROOT / "configs" / "gpt_oss_120b_64gpu_bf16.yaml"


def test_405b_first_and_last_pipeline_stages_train_at_reduced_width(tmp_path):
    cfg = load_config(RECIPE)
    m = cfg.model
    stage_layers = pipeline_stage_layers(cfg)[0]  # 11 of 126 on PP10's first and last stages
    assert pipeline_stage_layers(cfg)[-1] == stage_layers
    # 1/128 of the width with the recipe's head/group ratio; the full vocabulary (its embedding and output layer are
    # what make the first and last stages the largest); TP2 stands in for TP4 (the same TP rules, 4 processes).
    heads, groups = m.num_attention_heads // 8, m.num_query_groups
    tb = tmp_path / "tb"
    run = run_pretrain(4, [
        f"model.num_layers={2 * stage_layers}", f"model.hidden_size={m.hidden_size // 128}",
        f"model.num_attention_heads={heads}", f"model.num_query_groups={groups}",
        f"model.ffn_hidden_size={m.ffn_hidden_size // 128}", "model.seq_length=128",
        "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
        "parallel.num_layers_in_first_pipeline_stage=null", "parallel.num_layers_in_last_pipeline_stage=null",
        "train.global_batch_size=4", "train.train_iters=2", "train.eval_interval=1000", "train.eval_iters=1",
        "data.mock=true", "data.blend=null", "logging.log_interval=1", f"logging.tensorboard_dir={tb}",
        "optimizer.lr_warmup_iters=0",  # the recipe's 8,000-step warm-up would leave the first steps at LR ~0
    ], config=RECIPE)
    log = run.stdout + run.stderr
    assert "TP2 × CP1 × DP1 × PP2" in log, log[-3000:]
    assert f"layers 1-{stage_layers} + embedding" in log and \
        f"layers {stage_layers + 1}-{2 * stage_layers} + output layer/loss" in log, log[-3000:]
    assert "sequence parallel" in log and "full recompute" in log, log[-3000:]
    assert "optimizer CPU offload: " in log and "(100 %" in log, log[-3000:]
    losses = read_scalars(tb, "train/lm_loss")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert abs(losses[1] - math.log(m.vocab_size)) < 0.5  # an untrained model over the full vocabulary
    # the offloaded optimizer stepped with the recipe's learning rate on finite gradients
    lr, grad_norm = read_scalars(tb, "train/lr"), read_scalars(tb, "train/grad_norm")
    assert lr[1] == pytest.approx(cfg.optimizer.lr, rel=1e-3) and all(0 < g < 1e3 for g in grad_norm.values()), \
        (lr, grad_norm)


def test_deepseek_v3_671b_layer_pattern_and_parallelism_train_at_reduced_width(tmp_path):
    cfg = load_config(DEEPSEEK_V3)
    m, p = cfg.model, cfg.parallel
    dense = m.moe_layer_freq.index(1)  # DeepSeek-V3's 3 dense layers, then MoE layers
    assert (dense, p.expert_tensor_parallel_size, p.sequence_parallel, m.rope_type) == (3, 1, True, "yarn")
    # the first stage the deeper (the dense layers and one MoE layer), the last holding 2 MoE layers, the MTP layer and
    # the output layer; widths 1/64 (heads 1/16), experts 1/16 with the top-k and groups 1/2: the recipe's
    # topk = 2 × group_topk; TP2 + SP × PP2 × EP2 (ETP1) stands in for TP4 × PP6 × EP32 in 4 processes, with the
    # recipe's micro batch 2 and full recompute; no FP8 on CPU
    tb = tmp_path / "tb"
    run = run_pretrain(4, [
        "model.num_layers=6", f"model.moe_layer_freq={[0] * dense + [1] * 3}",
        "parallel.num_layers_in_first_pipeline_stage=4", "parallel.num_layers_in_last_pipeline_stage=null",
        f"model.hidden_size={m.hidden_size // 64}", f"model.num_attention_heads={m.num_attention_heads // 16}",
        f"model.q_lora_rank={m.q_lora_rank // 32}", f"model.kv_lora_rank={m.kv_lora_rank // 32}",
        f"model.qk_head_dim={m.qk_head_dim // 16}", f"model.qk_pos_emb_head_dim={m.qk_pos_emb_head_dim // 16}",
        f"model.v_head_dim={m.v_head_dim // 16}", f"model.ffn_hidden_size={m.ffn_hidden_size // 64}",
        f"model.num_moe_experts={m.num_moe_experts // 16}", f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size // 64}",
        f"model.moe_shared_expert_intermediate_size={m.moe_shared_expert_intermediate_size // 64}",
        f"model.moe_router_topk={m.moe_router_topk // 2}", f"model.moe_router_num_groups={m.moe_router_num_groups // 2}",
        f"model.moe_router_group_topk={m.moe_router_group_topk // 2}", "model.seq_length=128",
        "model.original_max_position_embeddings=64", "model.make_vocab_size_divisible_by=128",
        "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
        "parallel.expert_model_parallel_size=2", "train.fp8=null", "train.global_batch_size=4", "train.train_iters=2", "train.eval_interval=1000", "train.eval_iters=1",
        "data.mock=true", "data.blend=null", "logging.log_interval=1", f"logging.tensorboard_dir={tb}",
        "optimizer.lr_warmup_iters=0", "checkpoint.save_interval=null",
    ], config=DEEPSEEK_V3)
    log = run.stdout + run.stderr
    assert "TP2 × CP1 × DP1 × PP2" in log and "EP2" in log, log[-3000:]
    assert "layers 1-4 + embedding" in log and "layers 5-6 + output layer/loss" in log, log[-3000:]
    assert "sequence parallel" in log and "full recompute" in log, log[-3000:]
    losses, mtp = read_scalars(tb, "train/lm_loss"), read_scalars(tb, "mtp/loss_1")
    assert sorted(losses) == sorted(mtp) == [1, 2] and all(math.isfinite(v) for v in [*losses.values(), *mtp.values()])
    assert abs(losses[1] - math.log(m.vocab_size)) < 1.0  # an untrained model over the full vocabulary
    lr = read_scalars(tb, "train/lr")
    assert lr[1] == pytest.approx(cfg.optimizer.lr, rel=1e-3), lr


def test_gpt_oss_120b_attention_and_experts_train_at_reduced_width(tmp_path):
    cfg = load_config(GPT_OSS)
    m = cfg.model
    assert (m.softmax_type, m.window_size, m.window_attn_skip_freq, m.add_bias_linear) == (
        "learnable", [127, 0], 2, True)
    # 4 layers (windowed, full | windowed, full: the alternation crosses the stage boundary by global layer number),
    # 1/30 of the width with 8 heads of 16 in 2 groups, 8 experts top-2 (the recipe's 128, top-4), a window of 15
    # earlier keys over 64 tokens, the full vocabulary; PP2 × EP2 (experts whole) stands in for PP8 × EP8 in 4
    # processes, in the recipe's bf16 with selective recompute of core attention (the recipe's moe_act is TE's)
    tb = tmp_path / "tb"
    run = run_pretrain(4, [
        "model.num_layers=4", "model.hidden_size=96", "model.num_attention_heads=8", "model.num_query_groups=2",
        "model.kv_channels=16", "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=96", "model.num_moe_experts=8",
        "model.moe_router_topk=2", "model.window_size=[15,0]", "model.seq_length=64",
        "model.original_max_position_embeddings=16", "parallel.pipeline_model_parallel_size=2",
        "parallel.num_layers_in_first_pipeline_stage=null", "parallel.num_layers_in_last_pipeline_stage=null",
        "parallel.expert_model_parallel_size=2", "train.recompute_modules=[core_attn]", "train.global_batch_size=4",
        "train.train_iters=2",
        "train.eval_interval=1000", "train.eval_iters=1", "data.mock=true", "data.blend=null", "logging.log_interval=1",
        f"logging.tensorboard_dir={tb}", "optimizer.lr_warmup_iters=0", "checkpoint.save_interval=null",
    ], config=GPT_OSS)
    log = run.stdout + run.stderr
    assert "TP1 × CP1 × DP2 × PP2" in log and "ETP1 × EP2 × expert-DP1 × PP2" in log, log[-3000:]
    for said in ("learnable attention sinks", "a window of 15 earlier keys on 1 of this rank's 2 layers",
                 "biases in every linear layer", "GLU quick_gelu clamped at 7, linear half + 1", "selective recompute"):
        assert said in log, (said, log[-3000:])
    losses, grad_norm = read_scalars(tb, "train/lm_loss"), read_scalars(tb, "train/grad_norm")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert abs(losses[1] - math.log(m.vocab_size)) < 1.0  # an untrained model over the full vocabulary
    assert all(0 < g < 1e3 for g in grad_norm.values()), grad_norm

