"""train.cuda_graphs on a GPU: a graphed run trains and resumes like the eager one."""

from __future__ import annotations

import re

import pytest
import torch

from tests.launch import ONE_GPU_SMALL, run_pretrain

SHAPE = [*ONE_GPU_SMALL, "model.attention_backend=local", "train.eval_interval=4", "train.eval_iters=1",
         "train.compile=false"]


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss (\d+\.\d+) \|", stdout)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_layers_train_and_resume_like_eager_ones(tmp_path):
    graphed = run_pretrain(1, [*SHAPE, "train.cuda_graphs=true"])
    assert "CUDA graphs per layer" in graphed.stdout, graphed.stdout[-3000:]
    eager = _losses(run_pretrain(1, SHAPE).stdout)
    ours = _losses(graphed.stdout)
    assert len(ours) == len(eager) == 8
    assert all(abs(x - y) / y < 1e-2 for x, y in zip(ours, eager)), (ours, eager)  # same kernels, replayed
    # a graphed run stopped at 4 (eval in between) resumes onto the same losses: RNG streams go through the
    # checkpoint as tensors and come back graph-safe
    save = [*SHAPE, "train.cuda_graphs=true", f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=4"]
    run_pretrain(1, [*save, "train.exit_interval=4"])
    resumed = _losses(run_pretrain(1, [*save, f"checkpoint.load={tmp_path / 'ckpt'}"]).stdout)
    assert resumed == pytest.approx(ours[4:], rel=1e-3), (resumed, ours)
