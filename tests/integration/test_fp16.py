"""FP16 with dynamic loss scaling, one process each: the loss scale multiplies the backward pass; overflows are
skipped without counting as a divergence, the scale halves after train.hysteresis of them and doubles back after
train.loss_scale_window clean steps; the loss follows bf16's, the scaler's state (scale and both trackers) resumes
exactly, and a scale stuck at its floor stops the run with one line."""

from __future__ import annotations

import pytest

from megatron_ext.errors import EXIT_DIVERGED
from tests.launch import SINGLE_PROCESS, SMALL_MODEL, read_scalars, run_pretrain

# overflows at 3 and 4: with hysteresis 2 the first leaves the scale, the second halves it; 3 clean steps (5-7) later
# it doubles back
FP16 = [*SMALL_MODEL, *SINGLE_PROCESS, "model.seq_length=64", "train.train_iters=8", "train.precision=fp16",
        "train.initial_loss_scale=512", "train.hysteresis=2", "train.loss_scale_window=3"]
OVERFLOW_AT_3_4 = dict(module="tests.workers.overflow_worker", env={"OVERFLOW_AT": "3,4"})
SCALES = {1: 512, 2: 512, 3: 512, 4: 256, 5: 256, 6: 256, 7: 512, 8: 512}  # after each step's update


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tb = tmp_path_factory.mktemp("fp16")
    grads = tb / "grads.txt"
    proc = run_pretrain(1, [*FP16, f"logging.tensorboard_dir={tb}"], module=OVERFLOW_AT_3_4["module"],
                        env={**OVERFLOW_AT_3_4["env"], "GRAD_LOG": str(grads)})
    return proc, tb, grads


def test_overflows_are_skipped_and_the_scale_follows_hysteresis_and_the_window(uninterrupted):
    proc, tb, _ = uninterrupted
    assert ("fp16 overflow at iteration 3: step skipped, loss scale stays 512 (it halves after train.hysteresis "
            "overflows)") in proc.stdout, proc.stdout
    assert "fp16 overflow at iteration 4: step skipped, loss scale 512 -> 256" in proc.stdout
    assert "precision: fp16 with dynamic loss scaling" in proc.stdout
    assert "divergence" not in proc.stdout.lower() and "skipped:" not in proc.stdout  # not a non-finite step
    assert read_scalars(tb, "train/overflow_skipped") == {3: 1.0, 4: 1.0}
    assert read_scalars(tb, "train/loss_scale") == SCALES
    assert sorted(read_scalars(tb, "train/lm_loss")) == [1, 2, 5, 6, 7, 8]


def test_the_loss_scale_multiplies_the_backward_pass(uninterrupted):
    """The gradient reaching the per-token losses is the scale in force over the tokens: its ratio to that scale is
    the same at 512 and at 256 (unscaled, it would halve)."""
    _, _, grads = uninterrupted
    seen: dict[int, float] = {}
    for line in grads.read_text().splitlines():
        iteration, value = line.split()
        seen[int(iteration)] = max(seen.get(int(iteration), 0.0), float(value))
    in_force = {i: SCALES.get(i - 1, 512) for i in seen}  # the scale a step's backward pass ran with
    assert sorted(seen) == [1, 2, 5, 6, 7, 8] and {in_force[i] for i in seen} == {256, 512}, (seen, in_force)
    ratios = [seen[i] / in_force[i] for i in seen]
    assert max(ratios) <= 1.001 * min(ratios), (seen, in_force)


def test_fp16_trains_like_bf16(uninterrupted, tmp_path):
    """The same skipped step in bf16 (its non-finite gradients skipped by train.skip_nonfinite_steps): the losses
    agree within 1 %."""
    _, tb, _ = uninterrupted
    run_pretrain(1, [*FP16, "train.precision=bf16", "train.skip_nonfinite_steps=2",
                     f"logging.tensorboard_dir={tmp_path}"], **OVERFLOW_AT_3_4)
    fp16, bf16 = read_scalars(tb, "train/lm_loss"), read_scalars(tmp_path, "train/lm_loss")
    assert fp16.keys() == bf16.keys() and fp16[6] < fp16[1] - 0.3, (fp16, bf16)
    assert all(abs(fp16[i] - bf16[i]) <= 0.01 * bf16[i] for i in fp16), (fp16, bf16)


def test_the_loss_scale_resumes_exactly(uninterrupted, tmp_path):
    """Stopped after iteration 5 (scale halved, one clean step towards the window) and resumed to 8: the same losses
    and scales as the uninterrupted run, bit for bit — the growth at 7 needs the growth tracker resumed too."""
    _, tb, _ = uninterrupted
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "tb"
    run_pretrain(1, [*FP16, "train.exit_interval=5", f"checkpoint.save={ckpt}"], **OVERFLOW_AT_3_4)
    # the resumed launch loads its data with worker processes: the same batches, in order, from where it stopped
    run_pretrain(1, [*FP16, f"checkpoint.save={ckpt}", f"logging.tensorboard_dir={resumed}", "data.num_workers=2"])
    for tag in ("train/lm_loss", "train/loss_scale"):
        after = read_scalars(resumed, tag)
        assert sorted(after) == [6, 7, 8] and after == {i: read_scalars(tb, tag)[i] for i in (6, 7, 8)}, (tag, after)


def test_an_overflow_at_the_scale_floor_stops_the_run_with_one_line(tmp_path):
    proc = run_pretrain(1, [*FP16, "train.min_loss_scale=512", f"logging.log_dir={tmp_path}"], check=False,
                        **OVERFLOW_AT_3_4)
    assert proc.returncode == EXIT_DIVERGED, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "train.min_loss_scale=512" in line]
    assert len(said) == 1 and "fp16 gradients overflow at iteration 3" in said[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
