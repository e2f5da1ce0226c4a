"""Loss spikes and the goodput ledger on CPU/gloo, PP2: a run that rewinds past a corrupted batch, is killed before
its next checkpoint and started again ends bit-identical to a run whose data skipped the same batches from the start
(the restart skips them again), and its goodput ledger puts every second of the two attempts in a bucket; under
Megatron-FSDP ZeRO-3 a run whose corrupted batch makes the step non-finite rewinds past it to the end of the ZeRO-3 run
that skipped it."""

from __future__ import annotations

import json
import re
import time

import pytest

from megatron_ext.checkpoint.layout import DATA_SKIPS, GOODPUT
from megatron_ext.errors import DivergenceError
from megatron_ext.metrics.goodput_ledger import Ledger
from megatron_ext.resilience.run_record import read_training_end
from tests.conftest import parity_overrides
from tests.launch import read_scalars, run_pretrain

STEPS, SAVE_EVERY, SPIKE, KILLED = 8, 4, 6, 8  # checkpoints at 4 and 8; iteration 6's batch is corrupted
GLOBAL_BATCH = 8  # SMALL_MODEL's
TWO_STAGES = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
              "parallel.sequence_parallel=false"]
ZERO3 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
         "parallel.sequence_parallel=false", "parallel.use_megatron_fsdp=true"]
REWIND = ["train.spike_policy=rewind", "train.spike_window=5", f"checkpoint.save_interval={SAVE_EVERY}",
          "train.eval_interval=1000", "train.eval_iters=1"]
# the corrupted batch starts at this sample; the rewind goes back to iteration 4 and skips the batches of 5 and 6
SPIKED = {"SPIKE_AT_SAMPLE": str((SPIKE - 1) * GLOBAL_BATCH), "SPIKE_FACTOR": "30"}
SKIPPED = {"iteration": SAVE_EVERY, "from_sample": SAVE_EVERY * GLOBAL_BATCH, "to_sample": SPIKE * GLOBAL_BATCH}
DOWN_S = 2.0  # between the killed attempt and the next, as a requeue would wait


def _run(initial_weights, root, ckpt: str, tb: str, env: dict[str, str], check: bool = True,
         layout: tuple[str, ...] = tuple(TWO_STAGES)) -> str:
    """A run saving into root/ckpt, logging to root/tb; its console output."""
    proc = run_pretrain(2, [*parity_overrides(initial_weights, root / tb, STEPS), *layout, *REWIND,
                            f"checkpoint.save={root / ckpt}", f"logging.log_dir={root / f'logs_{ckpt}'}"],
                        module="tests.workers.spiked_worker", env={**SPIKED, **env}, check=check)
    return proc.stdout


def _numbers(tb) -> dict[str, dict[int, float]]:
    return {tag: read_scalars(tb, tag) for tag in ("train/lm_loss", "train/grad_norm", "val/lm_loss")}


@pytest.fixture(scope="module")
def skipped(initial_weights, tmp_path_factory) -> dict[str, dict[int, float]]:
    """The numbers of the run whose data skips the batches of iterations 5 and 6 from the start (its corrupted batch
    is never reached): what a rewind past iteration 6 must end as."""
    root = tmp_path_factory.mktemp("skipped")
    (root / "skipped").mkdir()
    (root / "skipped" / DATA_SKIPS).write_text(json.dumps([SKIPPED]))
    assert "loss spike" not in _run(initial_weights, root, "skipped", "tb_skipped", env={})
    return _numbers(root / "tb_skipped")


@pytest.mark.serial  # the seconds it was down, measured
def test_a_rewind_past_a_spike_and_a_restart_end_as_a_run_that_skipped_its_batches_and_every_second_is_accounted(
        initial_weights, skipped, tmp_path):
    started = time.time()
    said = _run(initial_weights, tmp_path, "rewound", "tb_rewound", check=False,
                env={"KILL_AT_ITERATION": str(KILLED), "KILLED_MARKER": str(tmp_path / "killed")})
    rewind = [line for line in said.splitlines() if "] loss spike at iteration" in line]
    assert len(rewind) == 1 and f"loss spike at iteration {SPIKE}: " in rewind[0], said[-4000:]
    assert f"samples {(SPIKE - 1) * GLOBAL_BATCH}..{SPIKE * GLOBAL_BATCH - 1} " in rewind[0]
    assert re.search(rf"rewound to iteration {SAVE_EVERY} \(\S+iter_{SAVE_EVERY:07d}\) \(1 of train.max_rewinds=3\)$",
                     rewind[0]), rewind[0]
    skip_said = (f"data: after iteration {SAVE_EVERY} the training data goes on at sample {SPIKE * GLOBAL_BATCH}, "
                 f"skipping samples {SAVE_EVERY * GLOBAL_BATCH}..{SPIKE * GLOBAL_BATCH - 1}")
    assert skip_said in said and f"step {KILLED - 1:>6}/" in said and f"step {KILLED:>6}/" not in said
    recorded = json.loads((tmp_path / "rewound" / DATA_SKIPS).read_text())
    assert [{k: v for k, v in entry.items() if k != "reason"} for entry in recorded] == [SKIPPED]
    assert read_scalars(tmp_path / "tb_rewound", "train/rewinds") == {SPIKE: 1.0}

    # killed before its checkpoint at 8: the next start resumes at 4 and skips the spike's batches again
    time.sleep(DOWN_S)
    said_again = _run(initial_weights, tmp_path, "rewound", "tb_rewound", env={})
    ended = time.time()
    assert f"resumed from {tmp_path / 'rewound'} at iteration {SAVE_EVERY}" in said_again and skip_said in said_again
    assert "] loss spike" not in said_again

    # as the run whose data skips those batches from the start
    assert sorted(skipped["train/lm_loss"]) == list(range(1, STEPS + 1)) and skipped["val/lm_loss"]
    # every step's last loss and gradient norm, and the final validation loss, bit for bit
    assert _numbers(tmp_path / "tb_rewound") == skipped

    ledger = Ledger(**json.loads((tmp_path / "rewound" / GOODPUT).read_text()))
    seconds = ledger.seconds
    print(f"{ledger.summary()}; test's wall-clock {ended - started:.2f} s; seconds {seconds}")
    assert ledger.starts == 2 and ledger.furthest_iteration == STEPS
    # within 2 %, and the suite's client start and the launchers' end after the ranks' last record (0.2 s measured),
    # which no rank sees (the launchers' start is in the ledger: run_logger.launcher_start_time)
    assert abs(ledger.total - (ended - started)) <= 0.02 * (ended - started) + 0.3, (ledger, ended - started)
    assert DOWN_S <= seconds["down"] <= DOWN_S + 3, seconds  # the wait, the kill's last second and the relaunch
    assert all(seconds[b] > 0 for b in ("startup", "checkpoint", "evaluation")), seconds
    # 5 steps recomputed (5 and 6 after the rewind; 5, 6, 7 after the restart) against 8 that advanced the run
    assert 0.3 < seconds["recomputed"] / seconds["productive"] < 1.2, seconds
    summary = re.search(r"goodput (\d+\.\d) % of \d+ s since the first start \(2 starts\): recomputed steps \d",
                        said_again)
    assert summary and float(summary.group(1)) == round(100 * seconds["productive"] / ledger.total, 1), said_again
    assert read_scalars(tmp_path / "tb_rewound", "goodput/productive")[STEPS] == pytest.approx(
        seconds["productive"] / ledger.total, rel=1e-6)  # TensorBoard keeps float32
    assert read_training_end(tmp_path / "logs_rewound").goodput_seconds == seconds


def test_a_nonfinite_step_is_rewound_past_as_a_spike_is_also_under_zero3(initial_weights, tmp_path):
    """Megatron-FSDP ZeRO-3 over 2 ranks; the corrupted batch's loss is infinite: past train.skip_nonfinite_steps (0)
    the step's update has made the weights non-finite, and under train.spike_policy=rewind the run goes back to
    iteration 4 (the checkpoint loaded into the sharded model in-process) and on after that batch, ending as the
    ZeRO-3 run that skipped it."""
    said = _run(initial_weights, tmp_path, "rewound", "tb_rewound", env={"SPIKE_FACTOR": "inf"}, layout=tuple(ZERO3))
    rewind = [line for line in said.splitlines() if "] non-finite loss at iteration" in line]
    assert len(rewind) == 1 and f"non-finite loss at iteration {SPIKE}, first seen on pipeline stage 0" in rewind[0]
    assert re.search(rf"samples {(SPIKE - 1) * GLOBAL_BATCH}..{SPIKE * GLOBAL_BATCH - 1} .*; rewound to iteration "
                     rf"{SAVE_EVERY} \(\S+iter_{SAVE_EVERY:07d}\) \(1 of train.max_rewinds=3\)$", rewind[0]), rewind[0]
    (tmp_path / "skipped").mkdir()
    (tmp_path / "skipped" / DATA_SKIPS).write_text(json.dumps([SKIPPED]))
    assert "non-finite" not in _run(initial_weights, tmp_path, "skipped", "tb_skipped", env={}, layout=tuple(ZERO3))
    assert _numbers(tmp_path / "tb_rewound") == _numbers(tmp_path / "tb_skipped")



def test_a_requeued_run_sees_the_spikes_and_keeps_the_budget_of_the_uninterrupted_one(initial_weights, tmp_path):
    """The detector's losses and the count of spikes acted on are run state saved with every checkpoint: with a
    20-loss window (a warm-up of 4 losses) a run stopped at its checkpoint at 4 and started again still detects the
    spike at 6 (a fresh detector would be warming up until 8) and rewinds past it; started again after its checkpoint
    at 8 with train.max_rewinds=1 spent, its next spike ends it in one line instead of a second rewind."""
    budget = ["train.spike_window=20", "train.max_rewinds=1"]

    def run(steps: int, spike_at_sample: int, check: bool = True) -> str:
        proc = run_pretrain(2, [*parity_overrides(initial_weights, tmp_path / "tb", steps), *TWO_STAGES, *REWIND,
                                *budget, f"checkpoint.save={tmp_path / 'ckpt'}", f"logging.log_dir={tmp_path / 'logs'}"],
                            module="tests.workers.spiked_worker", check=check,
                            env={"SPIKE_AT_SAMPLE": str(spike_at_sample), "SPIKE_FACTOR": "30"})
        return proc.stdout + proc.stderr

    assert "loss spike" not in run(SAVE_EVERY, int(SPIKED["SPIKE_AT_SAMPLE"]))
    said = run(STEPS, int(SPIKED["SPIKE_AT_SAMPLE"]))
    assert f"resumed from {tmp_path / 'ckpt'} at iteration {SAVE_EVERY}" in said
    assert re.search(rf"loss spike at iteration {SPIKE}: .* \(1 of train.max_rewinds=1\)", said), said[-3000:]
    # the data went on past the spike's batches: iteration 10 starts at sample 88
    said = run(12, (10 - 1) * GLOBAL_BATCH + SKIPPED["to_sample"] - SKIPPED["from_sample"], check=False)
    assert f"resumed from {tmp_path / 'ckpt'} at iteration {STEPS}" in said
    assert "loss spike at iteration 10" in said and "after 1 spikes rewound past (train.max_rewinds=1)" in said, (
        said[-3000:])


def test_a_requeued_run_keeps_the_non_finite_skips_it_spent(initial_weights, tmp_path):
    """train.skip_nonfinite_steps' budget is run state saved with every checkpoint: a run that skipped its one allowed
    non-finite step (iteration 3) and stopped at its checkpoint at 4 stops, started again, at the next non-finite
    step (iteration 6) in one line, instead of skipping it on a budget the restart gave back."""

    def run(steps: int, nan_at_iteration: int, check: bool = True):
        return run_pretrain(2, [*parity_overrides(initial_weights, tmp_path / "tb", steps), *TWO_STAGES,
                                "train.skip_nonfinite_steps=1", f"checkpoint.save_interval={SAVE_EVERY}",
                                f"checkpoint.save={tmp_path / 'ckpt'}", f"logging.log_dir={tmp_path / 'logs'}"],
                            module="tests.workers.spiked_worker", check=check,
                            env={"SPIKE_AT_SAMPLE": str((nan_at_iteration - 1) * GLOBAL_BATCH), "SPIKE_FACTOR": "nan"})

    first = run(SAVE_EVERY, 3)
    assert "skipped: non-finite loss at iteration 3" in first.stdout + first.stderr, first.stdout[-3000:]
    again = run(STEPS, 6, check=False)
    said = again.stdout + again.stderr
    assert f"resumed from {tmp_path / 'ckpt'} at iteration {SAVE_EVERY}" in said, said[-3000:]
    assert again.returncode != 0 and f"exitcode : {DivergenceError.exit_code}" in said, said[-3000:]
    assert "non-finite loss at iteration 6" in said and "after skipping 1 such steps" in said, said[-3000:]
