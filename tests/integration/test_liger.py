"""liger-kernel's Triton RMSNorm, SwiGLU and cross-entropy (train.liger_kernels), and its fused linear
cross-entropy (train.fused_linear_cross_entropy), train like megatron-core's own kernels. Triton needs a GPU: on
CPU these are skipped (the refusals there are tested in test_config.py, the fused output's wiring in
test_fused_output.py)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from tests.launch import ONE_GPU_SMALL, run_pretrain

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
    reason="liger-kernel's kernels are Triton: needs a GPU and `pip install liger-kernel==0.8.5`")

# compiled local layers (the GPU default without TE)
SHAPE = [*ONE_GPU_SMALL, "model.attention_backend=local"]


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss (\d+\.\d+) \|", stdout)]


def test_liger_kernels_run_and_train_like_megatron_cores_own():
    ours = run_pretrain(1, [*SHAPE, "train.liger_kernels=true"])
    assert "liger-kernel RMSNorm, SwiGLU, cross-entropy" in ours.stdout, ours.stdout[-3000:]
    reference = run_pretrain(1, SHAPE)
    a, b = _losses(ours.stdout), _losses(reference.stdout)
    assert len(a) == len(b) == 8
    # bf16, different reduction orders: the same training within bf16 noise, not bit for bit
    assert all(abs(x - y) / y < 2e-2 for x, y in zip(a, b)), (a, b)


def test_fused_linear_cross_entropy_trains_like_megatron_cores_output_layer():
    """liger's chunked kernel against the output layer + megatron-core's CE, both tied and untied weights."""
    for tied in ("true", "false"):
        shape = [*SHAPE, f"model.untie_embeddings_and_output_weights={tied}"]
        ours = run_pretrain(1, [*shape, "train.fused_linear_cross_entropy=true"])
        assert "fused linear cross-entropy (liger-kernel)" in ours.stdout, ours.stdout[-3000:]
        a, b = _losses(ours.stdout), _losses(run_pretrain(1, shape).stdout)
        assert len(a) == len(b) == 8
        assert all(abs(x - y) / y < 2e-2 for x, y in zip(a, b)), (a, b)
