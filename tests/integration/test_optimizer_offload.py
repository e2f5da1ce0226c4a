"""Optimizer CPU offload (megatron-core's HybridDeviceOptimizer) rehearsed on CPU/gloo: at DP2 in bf16 it trains
exactly as the distributed optimizer without it, says where the state lives, and a run stopped and resumed under it
reproduces the uninterrupted one (the restored master weights and per-parameter step counts,
:func:`megatron_ext.checkpoint.compat._complete_offloaded_load`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import SMALL_MODEL, read_scalars, run_pretrain, steps_per_launch

STEPS, STOP = 4, 2
DP2_BF16 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
            "parallel.sequence_parallel=false", "train.precision=bf16", f"train.train_iters={STEPS}", *SMALL_MODEL]
OFFLOAD = ["optimizer.optimizer_cpu_offload=true"]
TAGS = ("train/lm_loss", "train/grad_norm")


def _scalars(tb: Path) -> dict[str, dict[int, float]]:
    return {tag: read_scalars(tb, tag) for tag in TAGS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    """The distributed optimizer without offload, and with it: stopped at STOP, then resumed to STEPS."""
    root = tmp_path_factory.mktemp("offload")
    run_pretrain(2, [*DP2_BF16, f"logging.tensorboard_dir={root / 'tb_plain'}"])
    offloaded = [*DP2_BF16, *OFFLOAD, f"logging.tensorboard_dir={root / 'tb_offload'}",
                 f"checkpoint.save={root / 'ckpt'}"]
    first = run_pretrain(2, [*offloaded, f"train.exit_interval={STOP}"])
    run_pretrain(2, offloaded)
    return {"plain": _scalars(root / "tb_plain"), "offload": _scalars(root / "tb_offload"),
            "launches": steps_per_launch(root / "tb_offload", "train/lm_loss"), "log": first.stdout + first.stderr}


def test_offloaded_optimizer_trains_exactly_as_the_device_one_and_resumes_exactly(runs):
    """Steps 1..STOP compare the offloaded optimizer with the device one; STOP+1..STEPS, after the resume, too."""
    assert "optimizer CPU offload: 918,080 of this rank's 918,080 optimizer elements (100 %" in runs["log"]
    assert "torch AdamW on the CPU" in runs["log"]
    assert runs["launches"] == [list(range(1, STOP + 1)), list(range(STOP + 1, STEPS + 1))]  # resumed, not restarted
    for tag in TAGS:
        assert sorted(runs["offload"][tag]) == list(range(1, STEPS + 1))
        assert runs["offload"][tag] == runs["plain"][tag], tag
    assert runs["offload"]["train/lm_loss"][STEPS] < runs["offload"]["train/lm_loss"][1]
