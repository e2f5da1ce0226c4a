"""Activation offload on a GPU: with megatron-core's fine-grained offload of every module it offers, the saved
activations wait in host memory, so the step's peak GPU memory falls, and the run trains as without it. Needs a GPU
and TransformerEngine (megatron-core's offload context sets TE's offload flag); on CPU the same path is rehearsed in
the parity matrix (pp2_vpp2_interleaved_activation_offload)."""

from __future__ import annotations

import importlib.util
import re
from typing import get_args

import pytest
import torch

from megatron_ext.config.schema import OffloadModule
from tests.launch import ONE_GPU_SMALL, read_scalars, run_pretrain

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="activation offload on a device needs a GPU and TransformerEngine")

# Long sequences, so that the saved activations (not the weights) set the peak: 2 × 4096 × 512 elements per
# layer input, over megatron-core's 1M-element offload threshold.
SHAPE = [*ONE_GPU_SMALL, "model.seq_length=4096"]
OFFLOAD = [f"train.offload_modules=[{','.join(get_args(OffloadModule))}]"]


def _run(tmp_path, name: str, extra: list[str]) -> tuple[str, dict[int, float], dict[int, float]]:
    tb = tmp_path / name
    proc = run_pretrain(1, [*SHAPE, *extra, f"logging.tensorboard_dir={tb}"])
    return proc.stdout, read_scalars(tb, "train/lm_loss"), read_scalars(tb, "perf/mem_peak_gib")


def test_offloaded_activations_lower_the_peak_and_train_alike(tmp_path):
    log, losses, peak = _run(tmp_path, "offload", OFFLOAD)
    moved = re.search(r"activation offload: ([\d.]+) MiB of saved activations held in host memory", log)
    assert moved and float(moved.group(1)) > 0, log[-3000:]
    _, reference_losses, reference_peak = _run(tmp_path, "reference", [])
    print(f"peak GPU memory: {max(peak.values()):.2f} GiB offloaded, {max(reference_peak.values()):.2f} GiB not; "
          f"{moved.group(1)} MiB on the host")
    assert max(peak.values()) < max(reference_peak.values())
    assert sorted(losses) == sorted(reference_losses) == list(range(1, 9))
    assert all(abs(losses[i] - reference_losses[i]) / reference_losses[i] < 1e-2 for i in losses)
