"""train.cuda_graph_impl on a GPU: a graphed run trains like the eager one, and megatron-core's layer graphs resume
like it too."""

from __future__ import annotations

import re

import pytest
import torch

from tests.launch import ONE_GPU_SMALL, run_pretrain

SHAPE = [*ONE_GPU_SMALL, "model.attention_backend=local", "train.eval_interval=4", "train.eval_iters=1",
         "train.compile=false"]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss (\d+\.\d+) \|", stdout)]


def _transformer_engine() -> bool:
    from megatron_ext.model.llama import transformer_engine_available

    return transformer_engine_available()


@needs_gpu
def test_graphed_layers_train_and_resume_like_eager_ones(tmp_path):
    graphed = run_pretrain(1, [*SHAPE, "train.cuda_graph_impl=local"])
    assert "CUDA graphs per layer" in graphed.stdout, graphed.stdout[-3000:]
    eager = _losses(run_pretrain(1, SHAPE).stdout)
    ours = _losses(graphed.stdout)
    assert len(ours) == len(eager) == 8
    assert all(abs(x - y) / y < 1e-2 for x, y in zip(ours, eager)), (ours, eager)  # same kernels, replayed
    # a graphed run stopped at 4 (eval in between) resumes onto the same losses: RNG streams go through the
    # checkpoint as tensors and come back graph-safe
    save = [*SHAPE, "train.cuda_graph_impl=local", f"checkpoint.save={tmp_path / 'ckpt'}",
            "checkpoint.save_interval=4"]
    run_pretrain(1, [*save, "train.exit_interval=4"])
    resumed = _losses(run_pretrain(1, [*save, f"checkpoint.load={tmp_path / 'ckpt'}"]).stdout)
    assert resumed == pytest.approx(ours[4:], rel=1e-3), (resumed, ours)


@needs_gpu
def test_a_full_iteration_graph_trains_like_the_eager_schedule():
    """The whole forward-backward captured at step 4 and replayed: every step's loss is its own (copied out of the
    graph's static buffers before the next replay), as eager's."""
    untimed = [*SHAPE, "logging.step_breakdown=false"]
    graphed = run_pretrain(1, [*untimed, "train.cuda_graph_impl=full_iteration"])
    assert "one CUDA graph of each step's forward-backward" in graphed.stdout, graphed.stdout[-3000:]
    eager, ours = _losses(run_pretrain(1, untimed).stdout), _losses(graphed.stdout)
    assert len(ours) == len(eager) == 8 and len(set(ours)) == 8, (ours, eager)
    assert all(abs(x - y) / y < 1e-2 for x, y in zip(ours, eager)), (ours, eager)


@pytest.mark.skipif(not torch.cuda.is_available() or not _transformer_engine(),
                    reason="TransformerEngine's CUDA graphs need a GPU and TransformerEngine")
def test_transformer_engines_layer_graphs_train_like_its_eager_layers():
    te = [*ONE_GPU_SMALL, "model.attention_backend=te", "train.eval_interval=4", "train.eval_iters=1",
          "train.compile=false"]
    graphed = run_pretrain(1, [*te, "train.cuda_graph_impl=transformer_engine"])
    assert "TransformerEngine captured the decoder layers before iteration 4" in graphed.stdout, graphed.stdout[-3000:]
    eager, ours = _losses(run_pretrain(1, te).stdout), _losses(graphed.stdout)
    assert len(ours) == len(eager) == 8
    assert all(abs(x - y) / y < 1e-2 for x, y in zip(ours, eager)), (ours, eager)
