"""train.recompute_modules in CPU rehearsal: recomputing megatron-core's modules in the backward pass changes nothing
the model computes — a run with them trains onto the same losses as one without, in a dense and in a DeepSeek-V3-style
(MLA, MoE with a shared expert) model. One process each."""

from __future__ import annotations

import re

import pytest

from tests.launch import ROOT, SINGLE_PROCESS, TINY, run_pretrain

RUN = [*SINGLE_PROCESS, "train.train_iters=3", "train.eval_iters=0", "logging.log_interval=1", "checkpoint.save=null",
       "checkpoint.load=null", "logging.tensorboard_dir=null"]


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss (\d+\.\d+) \|", stdout)]


@pytest.mark.parametrize("config, modules", [
    (TINY, ["mlp", "core_attn"]),
    (ROOT / "configs" / "tiny_deepseek.yaml", ["moe", "shared_experts", "core_attn"]),
], ids=["dense", "deepseek"])
def test_recomputed_modules_train_onto_the_same_losses(config, modules, tmp_path):
    expert_layout = ["parallel.expert_model_parallel_size=1"] if "deepseek" in config.name else []
    common = [*RUN, *expert_layout, f"logging.log_dir={tmp_path / 'logs'}"]
    plain = run_pretrain(1, common, config=config)
    recomputed = run_pretrain(1, [*common, "train.recompute_granularity=selective",
                                  f"train.recompute_modules=[{','.join(modules)}]"], config=config)
    assert f"selective recompute of {', '.join(modules)}" in recomputed.stdout, recomputed.stdout[-3000:]
    assert len(_losses(plain.stdout)) == 3 and _losses(recomputed.stdout) == _losses(plain.stdout)
