"""End-to-end on CPU/gloo: TP2×PP2 reproduces the single-process run, resume is exact, TensorBoard is complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.checkpointing import latest_iteration
from tests.launch import SINGLE_PROCESS, SMALL_MODEL, max_relative_difference, read_scalars, run_pretrain

pytestmark = pytest.mark.slow

STEPS = 20
PARITY_STEPS = 5
PARITY_TOLERANCE = 1e-5  # fp32; measured differences are ~1e-7 (summation order across TP/PP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Initial weights, a 1-process reference, an uninterrupted TP2×PP2 run, and a 10+10 resumed one."""
    root = tmp_path_factory.mktemp("runs")
    init = root / "init"
    run_pretrain(1, [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=0", f"checkpoint.save={init}",
                     "logging.tensorboard_dir=null"])
    common = [*SMALL_MODEL, f"train.train_iters={STEPS}", f"checkpoint.pretrained_checkpoint={init}"]
    run_pretrain(1, [*common, *SINGLE_PROCESS, f"train.train_iters={PARITY_STEPS}",
                     f"optimizer.lr_decay_iters={STEPS}", f"logging.tensorboard_dir={root / 'tb_single'}"])
    run_pretrain(4, [*common, f"logging.tensorboard_dir={root / 'tb_full'}"])
    interrupted = [*common, f"checkpoint.save={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb_resumed'}"]
    run_pretrain(4, [*interrupted, "train.exit_interval=10"])
    assert latest_iteration(root / "ckpt") == 10
    run_pretrain(4, [*interrupted, f"checkpoint.load={root / 'ckpt'}"])
    return {"root": root, "single": root / "tb_single", "full": root / "tb_full", "resumed": root / "tb_resumed",
            "ckpt": root / "ckpt"}


def test_tp2_pp2_matches_single_process_from_the_same_weights(runs):
    for tag in ("train/lm_loss", "train/grad_norm"):
        single = read_scalars(runs["single"], tag)
        parallel = {k: v for k, v in read_scalars(runs["full"], tag).items() if k <= PARITY_STEPS}
        assert len(single) == PARITY_STEPS
        assert max_relative_difference(parallel, single) <= PARITY_TOLERANCE, (tag, single, parallel)


def test_loss_falls(runs):
    losses = read_scalars(runs["full"], "train/lm_loss")
    assert losses[STEPS] < losses[1] - 0.5, losses


def test_resume_reproduces_the_uninterrupted_run_exactly(runs):
    for tag in ("train/lm_loss", "train/grad_norm", "train/lr"):
        full = read_scalars(runs["full"], tag)
        resumed = read_scalars(runs["resumed"], tag)
        assert sorted(resumed) == list(range(1, STEPS + 1))  # one TensorBoard axis across both launches
        assert {k: resumed[k] for k in range(11, STEPS + 1)} == {k: full[k] for k in range(11, STEPS + 1)}, tag
    assert latest_iteration(runs["ckpt"]) == STEPS
    assert (runs["ckpt"] / "iter_0000020").is_dir() and (runs["ckpt"] / "iter_0000010").is_dir()


def test_tensorboard_has_one_value_per_step_for_every_train_tag(runs):
    for tag in ("train/lm_loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/step_time_s"):
        values = read_scalars(runs["full"], tag)
        assert sorted(values) == list(range(1, STEPS + 1)), tag
        assert all(v >= 0 for v in values.values())
    val = read_scalars(runs["full"], "val/lm_loss")
    assert list(val) == [STEPS] and 0 < val[STEPS] < 9
