"""Shared fixtures: one set of initial weights and a single-process reference run for every layout test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import SINGLE_PROCESS, SMALL_MODEL, run_pretrain

PARITY_STEPS = 5
SCHEDULE_ITERS = 20  # every parity run uses the LR schedule of a 20-step run


@pytest.fixture(scope="session")
def initial_weights(tmp_path_factory) -> Path:
    """Weights saved by a 1-process run at iteration 0: CPU init differs across PP sizes, so every
    layout loads these instead of initialising its own."""
    path = tmp_path_factory.mktemp("init") / "ckpt"
    run_pretrain(1, [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=0", f"checkpoint.save={path}",
                     "logging.tensorboard_dir=null"])
    return path


def parity_overrides(initial_weights: Path | None, tensorboard_dir: Path, steps: int = PARITY_STEPS) -> list[str]:
    """The small model on a 20-step LR schedule, logging to `tensorboard_dir`, from `initial_weights`."""
    start = [f"checkpoint.pretrained_checkpoint={initial_weights}"] if initial_weights else []
    return [*SMALL_MODEL, f"train.train_iters={steps}", f"optimizer.lr_decay_iters={SCHEDULE_ITERS}",
            f"logging.tensorboard_dir={tensorboard_dir}", *start]


@pytest.fixture(scope="session")
def single_process_reference(initial_weights, tmp_path_factory) -> Path:
    """TensorBoard dir of the 1-process run every parallel layout must reproduce."""
    tb = tmp_path_factory.mktemp("reference") / "tb"
    run_pretrain(1, [*parity_overrides(initial_weights, tb), *SINGLE_PROCESS])
    return tb
