"""The CPU rehearsal backend's switch: off, CUDA placement fails as it would; with a GPU, installing it does nothing."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.distributed import cpu_backend

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is inactive on GPU machines")


def test_without_install_cuda_placement_fails():
    """The reason the backend exists: megatron's literals fail on a CPU-only torch."""
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")


def test_install_is_a_no_op_when_a_gpu_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_backend.needed() is False
    assert cpu_backend.install() is False
