"""FP16 with dynamic loss scaling, one process each: an overflow is skipped and halves the scale without counting as
a divergence, the loss follows bf16's, the scaler's state resumes exactly, and a scale stuck at its floor stops the
run with one line."""

from __future__ import annotations

import pytest

from megatron_ext.errors import EXIT_DIVERGED
from tests.launch import SINGLE_PROCESS, SMALL_MODEL, read_scalars, run_pretrain

FP16 = [*SMALL_MODEL, *SINGLE_PROCESS, "model.seq_length=64", "train.train_iters=6", "train.precision=fp16",
        "train.initial_loss_scale=512", "train.hysteresis=1"]
OVERFLOW_AT_3 = dict(module="tests.workers.overflow_worker", env={"OVERFLOW_AT": "3"})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tb = tmp_path_factory.mktemp("fp16")
    proc = run_pretrain(1, [*FP16, f"logging.tensorboard_dir={tb}"], **OVERFLOW_AT_3)
    return proc, tb


def test_an_overflow_is_skipped_halves_the_scale_and_training_goes_on(uninterrupted):
    proc, tb = uninterrupted
    assert "fp16 overflow at iteration 3: step skipped, loss scale 512 -> 256" in proc.stdout, proc.stdout
    assert "precision: fp16 with dynamic loss scaling" in proc.stdout
    assert "divergence" not in proc.stdout.lower() and "skipped:" not in proc.stdout  # not a non-finite step
    assert read_scalars(tb, "train/overflow_skipped") == {3: 1.0}
    assert read_scalars(tb, "train/loss_scale") == {1: 512, 2: 512, 3: 256, 4: 256, 5: 256, 6: 256}
    assert sorted(read_scalars(tb, "train/lm_loss")) == [1, 2, 4, 5, 6]
    assert "loss scale 256 |" in proc.stdout


def test_fp16_trains_like_bf16(uninterrupted, tmp_path):
    """The same skipped step in bf16 (its non-finite gradients skipped by train.skip_nonfinite_steps): the losses
    agree within 1 %."""
    _, tb = uninterrupted
    run_pretrain(1, [*FP16, "train.precision=bf16", "train.skip_nonfinite_steps=1",
                     f"logging.tensorboard_dir={tmp_path}"], **OVERFLOW_AT_3)
    fp16, bf16 = read_scalars(tb, "train/lm_loss"), read_scalars(tmp_path, "train/lm_loss")
    assert fp16.keys() == bf16.keys() and fp16[6] < fp16[1] - 0.3, (fp16, bf16)
    assert all(abs(fp16[i] - bf16[i]) <= 0.01 * bf16[i] for i in fp16), (fp16, bf16)


def test_the_loss_scale_resumes_exactly(uninterrupted, tmp_path):
    """Stopped after iteration 4 (its scale already halved by the overflow at 3) and resumed to 6: the same losses and
    scales as the uninterrupted run, bit for bit."""
    _, tb = uninterrupted
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "tb"
    run_pretrain(1, [*FP16, "train.exit_interval=4", f"checkpoint.save={ckpt}"], **OVERFLOW_AT_3)
    run_pretrain(1, [*FP16, f"checkpoint.save={ckpt}", f"logging.tensorboard_dir={resumed}"])
    for tag in ("train/lm_loss", "train/loss_scale"):
        after = read_scalars(resumed, tag)
        assert sorted(after) == [5, 6] and after == {i: read_scalars(tb, tag)[i] for i in (5, 6)}, (tag, after)


def test_an_overflow_at_the_scale_floor_stops_the_run_with_one_line(tmp_path):
    proc = run_pretrain(1, [*FP16, "train.min_loss_scale=512", f"logging.log_dir={tmp_path}"], check=False,
                        **OVERFLOW_AT_3)
    assert proc.returncode == EXIT_DIVERGED, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "train.min_loss_scale=512" in line]
    assert len(said) == 1 and "fp16 gradients overflow at iteration 3" in said[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
