"""The >100B recipe rehearsed on CPU: its first and last pipeline stages, at reduced width, built and trained under
the recipe's own layout rules (stage depth, sequence parallelism, full recompute, micro batch, untied output, the
optimizer state in host memory)."""

from __future__ import annotations

import math

import pytest

from megatron_ext.config.schema import load_config, pipeline_stage_layers
from tests.launch import ROOT, read_scalars, run_pretrain

RECIPE = ROOT / "configs" / "llama3_1_405b_40gpu_bf16.yaml"


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
