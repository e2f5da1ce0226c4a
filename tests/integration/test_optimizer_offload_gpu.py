"""Optimizer CPU offload on a GPU: half of the optimizer state (fp32 master weights and Adam moments) in host memory,
stepped by torch AdamW on the CPU, trains like the run with all of it on the GPU. Needs a GPU and TransformerEngine
(megatron-core's precision-aware optimizer path); on CPU the same wiring is rehearsed in test_optimizer_offload.py."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from tests.launch import ONE_GPU_SMALL, run_pretrain

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="optimizer CPU offload on a device needs a GPU and TransformerEngine")

SHAPE = ONE_GPU_SMALL


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss (\d+\.\d+) \|", stdout)]


def test_half_the_optimizer_state_on_the_host_trains_like_all_on_the_gpu():
    offloaded = run_pretrain(1, [*SHAPE, "optimizer.optimizer_cpu_offload=true",
                                 "optimizer.optimizer_offload_fraction=0.5"])
    share = re.search(r"optimizer CPU offload: [\d,]+ of this rank's [\d,]+ optimizer elements \((\d+) %",
                      offloaded.stdout)
    assert share and 40 <= int(share.group(1)) <= 60, offloaded.stdout[-3000:]
    reference = run_pretrain(1, SHAPE)
    a, b = _losses(offloaded.stdout), _losses(reference.stdout)
    assert len(a) == len(b) == 8
    assert all(abs(x - y) / y < 2e-2 for x, y in zip(a, b)), (a, b)
