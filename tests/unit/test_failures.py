"""One message per failure, in this process: each error's kind and exit code, carried advice, the OOM advice, and
the detectors behind the run log (loss spikes, stragglers)."""

from __future__ import annotations

import errno
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_ext.config.schema import TrainConfig, load_config
from megatron_ext.errors import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_PEER_FAILED,
    EXIT_STORAGE,
    EXIT_USER_ERROR,
    CheckpointError,
    CheckpointStorageError,
    ConfigError,
    DivergenceError,
    IncompatibleCheckpointError,
    TokenizerError,
)
from megatron_ext.resilience.failures import out_of_memory_advice, report_failure
from megatron_ext.resilience.reruns import PendingRerun, Suspect, relative_difference
from megatron_ext.resilience.spikes import LossSpikes, Spike, SpikeDetector
from megatron_ext.resilience.stragglers import StragglerDetector, work_units
from tests.launch import ROOT, TINY, read_scalars


def test_report_failure_logs_the_traceback_and_says_it_once(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no job store: this process is the only one to say it
    try:
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/iter_0000004/__0_0.distcp")
    except OSError as exc:
        code = report_failure(exc, 3, "checkpoint save at iteration 4", tmp_path)
    err = capsys.readouterr().err
    assert code == EXIT_STORAGE and err.startswith(
        "[rank 3, checkpoint save at iteration 4] storage error: [Errno 28] No space")
    assert "free space there" in err and f"(traceback: {tmp_path / 'rank-3.log'})" in err and "Traceback" not in err
    assert "Traceback" in (tmp_path / "rank-3.log").read_text()
    try:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    except RuntimeError as exc:  # a survivor of another rank's failure: logged, not said
        assert report_failure(exc, 2, "iteration 5", tmp_path) == EXIT_PEER_FAILED
    assert capsys.readouterr().err == "" and "Connection closed" in (tmp_path / "rank-2.log").read_text()


@pytest.mark.parametrize("exc, kind, code", [
    (ConfigError("model.hidden_size=7 is invalid"), "config error", EXIT_USER_ERROR),
    (TokenizerError("tok.model is not a sentencepiece model"), "tokenizer error", EXIT_USER_ERROR),
    (CheckpointError("ckpt/iter_0000004 is corrupt"), "checkpoint error", EXIT_USER_ERROR),
    # another model's checkpoint is a user error too (it once exited 1, as an unknown crash)
    (IncompatibleCheckpointError("the checkpoint lacks decoder.layers.3"), "checkpoint error", EXIT_USER_ERROR),
    (DivergenceError("non-finite loss at iteration 7"), "divergence", EXIT_DIVERGED),
    (CheckpointStorageError("saving ckpt/iter_0000004 failed (rank 1: OSError: [Errno 28] ...)"), "checkpoint error",
     EXIT_STORAGE),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/tb/events.out"), "storage error", EXIT_STORAGE),
    (OSError(errno.EIO, "Input/output error", "/runs/x"), "I/O error", EXIT_FAILED),
    (ValueError("a bug"), "ValueError", EXIT_FAILED),
])
def test_each_error_says_its_kind_and_exits_with_its_code(exc, kind, code, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert report_failure(exc, 0, "start-up", tmp_path) == code
    assert capsys.readouterr().err.startswith(f"[rank 0, start-up] {kind}: {exc}")


def test_a_message_that_introduces_its_cause_or_runs_long_keeps_what_says_why(tmp_path, capsys, monkeypatch):
    """Both as an H100 printed them (2026-11-26): inductor's first line names no cause, and a cuDNN error's status
    code sits at the end of a 500-character line."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    inductor = RuntimeError("backend='inductor' raised:\nRuntimeError: Triton Error [CUDA]: out of resource\n\n"
                            "Set TORCH_LOGS for more")
    report_failure(inductor, 0, "iteration 1", tmp_path)
    assert capsys.readouterr().err.splitlines()[0] == ("[rank 0, iteration 1] RuntimeError: backend='inductor' "
                                                       "raised: RuntimeError: Triton Error [CUDA]: out of resource")
    cudnn = RuntimeError("fused_attn_f16_arbitrary_seqlen.cu:934 cuDNN Error: " + "x" * 400 +
                         " and code: CUDNN_STATUS_BAD_PARAM.")
    report_failure(cudnn, 0, "iteration 1", tmp_path)
    line = capsys.readouterr().err.splitlines()[0]
    assert "fused_attn_f16_arbitrary_seqlen.cu:934" in line and line.endswith("code: CUDNN_STATUS_BAD_PARAM.")
    assert len(line) < 340


def test_advice_carried_by_an_error_is_printed_on_its_own_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    report_failure(CheckpointError("ckpt/iter_0000004 is corrupt", advice="resume from iter_0000002"), 0,
                   "start-up", tmp_path)
    assert capsys.readouterr().err.splitlines()[:2] == ["[rank 0, start-up] checkpoint error: ckpt/iter_0000004 "
                                                        "is corrupt", "  → resume from iter_0000002"]


def test_a_second_parent_death_signal_does_not_cut_short_the_reporting_of_the_first():
    """A SIGKILLed torchrun signals each rank twice within milliseconds (once per launcher thread the rank is handed
    to): the second must not raise inside the first one's failure path, which then ended the rank without its log
    line."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        from megatron_ext.resilience.process_guard import LauncherGone, _on_parent_death
        signal.signal(signal.SIGHUP, _on_parent_death)
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)
        except LauncherGone:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)  # the failure path: the second signal's handler runs in here
            print("reported")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout == "reported\n" and done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_out_of_memory_advice_names_stage_micro_batch_and_the_planner_estimate():
    cfg = load_config(TINY, ["data.mock=true", "model.vocab_size=32000"])
    advice = out_of_memory_advice(cfg, 1, 4, 80 * 2**30)
    assert advice.startswith("pipeline stage 1 of 2, micro batch size 4 × seq 256: the planner estimates ")
    assert "GiB peak for this stage, the GPU has 80.0 GiB" in advice and "--gpus 4" in advice


def test_a_loss_spike_is_counted_in_median_absolute_deviations_of_the_previous_losses():
    detector = SpikeDetector(window=10, threshold=10.0)
    for loss in [3.0, 2.9, 2.8, 2.9]:
        assert detector.spike(0, loss) is None
        detector.remember(loss)
    # median 2.9, MAD 0.05: 3.4 is exactly 10 deviations above (not a spike), 3.5 is 12
    assert detector.spike(5, 3.4) is None
    spike = detector.spike(5, 3.5, (32, 39))
    assert (spike.iteration, spike.median, spike.deviations) == (5, pytest.approx(2.9), pytest.approx(12.0))
    assert spike.describe().endswith("samples 32..39 of the training dataset (in megatron-core's shuffled order)")
    assert "3.5000 is 12.0 median absolute deviations above the median 2.9000" in spike.describe()
    assert detector.spike(5, 0.5) is None  # a fall is never a spike


def test_on_a_flat_loss_curve_a_deviation_counts_as_one_percent_of_the_median():
    detector = SpikeDetector(window=10, threshold=10.0)
    for _ in range(5):
        detector.remember(4.0)  # MAD 0
    assert detector.spike(6, 4.39) is None and detector.spike(6, 4.41).deviations == pytest.approx(10.25)


def test_spikes_are_looked_for_once_a_fifth_of_the_window_is_seen():
    detector = SpikeDetector(window=50, threshold=10.0)
    for _ in range(9):
        detector.remember(2.0)
    assert detector.spike(10, 100.0) is None
    detector.remember(2.0)
    assert detector.spike(11, 100.0) is not None


def _policy(policy: str, max_rewinds: int = 1) -> LossSpikes:
    spikes = LossSpikes(TrainConfig(spike_policy=policy, spike_window=5, max_rewinds=max_rewinds))
    for loss in [3.0, 2.9, 2.8]:
        assert spikes.before_update(1, loss, 0) is None and spikes.settled(1, loss, 0) is None
    return spikes


def test_each_spike_policy_acts_where_it_should_and_remembers_only_accepted_losses():
    warn = _policy("warn")
    assert not warn.decides_before_update and warn.before_update(4, 9.0, 24) is None
    spike = warn.settled(4, 9.0, 24)
    assert (spike.iteration, spike.samples) == (4, (24, 31)) and 9.0 in warn.detector.history and warn.acted == 0
    assert _policy("off").settled(4, 9.0, 24) is None
    skip = _policy("skip")
    assert skip.decides_before_update and skip.before_update(4, 9.0, 24).loss == 9.0 and skip.acted == 1
    assert skip.settled(5, 2.9, 32) is None and list(skip.detector.history) == [3.0, 2.9, 2.8, 2.9]
    assert skip.count("skipped") == "skipped (1 of train.max_rewinds=1)"
    rewind = _policy("rewind")
    assert rewind.before_update(4, 9.0, 24) is None and rewind.settled(4, 9.0, 24).loss == 9.0
    assert rewind.acted == 1 and 9.0 not in rewind.detector.history


def test_the_spike_state_goes_through_the_run_state_registry_and_a_spent_budget_never_comes_back():
    from megatron_ext.checkpoint.run_state import RunState

    spent = _policy("rewind")
    assert spent.settled(4, 9.0, 24) is not None and spent.acted == 1
    saved = RunState()
    saved.register("spikes", spent)
    state = saved.state_dict()
    assert state == {"spikes": {"history": [3.0, 2.9, 2.8], "acted": 1}}
    fresh = LossSpikes(TrainConfig(spike_policy="rewind", spike_window=5, max_rewinds=1))
    restored = RunState()
    restored.register("spikes", fresh)
    assert restored.load_state_dict(state) == [] and restored.load_state_dict(None) == ["spikes"]
    assert list(fresh.detector.history) == [3.0, 2.9, 2.8] and fresh.acted == 1
    with pytest.raises(DivergenceError, match=r"after 1 spikes rewound past \(train.max_rewinds=1\)"):
        fresh.settled(5, 9.0, 32)  # the budget spent before the requeue stays spent
    # a rewind to an earlier checkpoint (acted 0 there) keeps the count; the rewinds the data skips recorded count
    fresh.load_state_dict({"history": [3.0], "acted": 0})
    assert fresh.acted == 1 and list(fresh.detector.history) == [3.0]
    fresh.count_recorded_rewinds(2)
    assert fresh.acted == 2
    with pytest.raises(ValueError, match="registered twice"):
        restored.register("spikes", fresh)


def test_the_spike_a_rerun_checks_for_is_the_one_skip_would_drop_and_is_asked_without_remembering():
    spikes = LossSpikes(TrainConfig(spike_policy="skip", spike_window=5))
    for loss in (3.0, 3.1, 2.9):
        spikes.settled(0, loss, 0)
    assert spikes.would_skip(9.0) and spikes.would_skip(9.0) and not spikes.would_skip(3.05)
    assert not spikes.would_skip(math.nan) and list(spikes.detector.history) == [3.0, 3.1, 2.9]
    assert not LossSpikes(TrainConfig(spike_policy="warn", spike_window=5)).would_skip(9.0)


def test_a_nonfinite_step_is_a_spike_to_rewind_past_under_rewind_only():
    assert _policy("skip").nonfinite(4, 24, "non-finite loss at iteration 4") is None
    rewind = _policy("rewind")
    spike = rewind.nonfinite(4, 24, "non-finite loss at iteration 4, first seen on pipeline stage 1")
    assert (spike.iteration, spike.samples, rewind.acted) == (4, (24, 31), 1) and spike.deviations == float("inf")
    assert spike.describe().startswith("non-finite loss at iteration 4, first seen on pipeline stage 1; the step "
                                       "trained on samples 24..31 of the training dataset")
    with pytest.raises(DivergenceError, match="non-finite loss at iteration 5.*after 1 spikes rewound past"):
        rewind.nonfinite(5, 32, "non-finite loss at iteration 5")  # max_rewinds=1 used


@pytest.mark.parametrize("policy", ["skip", "rewind"])
def test_the_spike_after_train_max_rewinds_stops_the_run_with_one_line(policy):
    spikes = _policy(policy, max_rewinds=1)
    act = spikes.before_update if policy == "skip" else spikes.settled
    act(4, 9.0, 24)
    with pytest.raises(DivergenceError) as stopped:
        act(5, 9.5, 32)
    message = str(stopped.value)
    assert message.startswith("loss spike at iteration 5: 9.5000 is ") and "\n" not in message
    assert "samples 32..39 of the training dataset" in message
    assert "after 1 spikes" in message and "train.max_rewinds=1" in message and "train.spike_threshold" in message


def _named(detector: StragglerDetector, times: list[float]) -> list[tuple[tuple[int, ...], str]]:
    return [(s.unit.ranks, s.against) for s in detector.update(times)]


def test_a_rank_slower_than_its_stages_peers_for_several_intervals_in_a_row_is_named():
    """PP2 × DP2 (ranks 0, 1 on stage 0; 2, 3 on stage 1): the last stage always computes more (output layer and
    loss), which is nobody's fault; rank 1 slower than its peer rank 0 is."""
    units = work_units([0, 0, 1, 1], [0, 1, 2, 3])
    detector = StragglerDetector(factor=1.2, intervals=3, units=units)
    fast, slow = [1.0, 1.0, 1.6, 1.6], [1.0, 1.5, 1.6, 1.6]
    assert _named(detector, slow) == []  # the first interval is warm-up
    assert _named(detector, slow) == [] and _named(detector, slow) == [] and _named(detector, slow) == [((1,), "peers")]
    assert _named(detector, fast) == [] and _named(detector, slow) == []  # a fast interval resets the streak
    assert StragglerDetector(factor=None, intervals=1, units=units).update(slow) == []


def test_a_unit_slower_than_it_was_is_named_where_its_stage_has_no_peers():
    """TP2 × PP2 at DP 1: each stage is one TP group. Everyone slowing together is nobody's fault; stage 0's group
    slowing alone is named, as one group."""
    units = work_units([0, 0, 1, 1], [0, 0, 2, 2])
    assert [u.ranks for u in units] == [(0, 1), (2, 3)] and str(units[0]) == \
        "ranks 0, 1 (one tensor-parallel group) on pipeline stage 0"
    detector = StragglerDetector(factor=1.2, intervals=2, units=units)
    for times in ([3.0, 3.0, 3.0, 3.0], [1.0, 1.0, 1.4, 1.4], [1.1, 1.0, 1.4, 1.4], [1.0, 1.0, 1.5, 1.4]):
        assert _named(detector, times) == []  # warm-up, then the baseline; stage 1 computes more, always
    for times in ([1.5, 1.5, 2.1, 2.1], [1.6, 1.6, 2.2, 2.2]):  # everyone 1.5× slower
        assert _named(detector, times) == []
    slow = [2.4, 2.4, 1.4, 1.4]
    assert _named(detector, slow) == [] and _named(detector, slow) == [((0, 1), "itself")]


def test_run_logger_writes_loss_spikes_and_the_rank_spread_to_tensorboard(tmp_path, caplog):
    from megatron_ext.metrics.run_logger import RunLogger

    cfg = load_config(TINY, ["data.mock=true", "model.vocab_size=1000", f"logging.tensorboard_dir={tmp_path}"])
    logger = RunLogger(cfg, 1000, world_size=4, enabled=True)
    logger.step(3, 2.5, 1e-3, 1.0, 0.5, console=True, rank_times=[0.2, 0.3, 0.25, 0.2])
    with caplog.at_level("WARNING", logger="megatron_ext"):
        logger.loss_spike(Spike(4, 6.0, 2.5, 70.0, (48, 63)))
        logger.loss_spike(Spike(5, 6.0, 2.5, 70.0, (64, 79)), "skipped (1 of train.max_rewinds=3)")
        logger.loss_spike(Spike(6, 6.0, 2.5, 70.0, (80, 95)), "rewound to iteration 2 (ckpt)", rewinds=1)
    logger.close()
    assert read_scalars(tmp_path, "train/loss_spike") == {4: 70.0, 5: 70.0, 6: 70.0}
    assert read_scalars(tmp_path, "train/spike_skipped") == {5: 1.0}
    assert read_scalars(tmp_path, "train/rewinds") == {6: 1.0}
    assert read_scalars(tmp_path, "perf/slowest_rank") == {3: 1.0}
    assert read_scalars(tmp_path, "perf/step_time_max_s") == {3: pytest.approx(0.3)}
    said = [r.getMessage() for r in caplog.records if "loss spike" in r.getMessage()]
    assert said[0].startswith("loss spike at iteration 4: 6.0000 is 70.0 median absolute deviations above the median "
                              "2.5000") and "samples 48..63" in said[0]
    assert said[1].endswith("; skipped (1 of train.max_rewinds=3)") and "samples 64..79" in said[1]
    assert said[2].endswith("; rewound to iteration 2 (ckpt)")


def test_the_peer_reference_is_the_median_of_the_stages_other_units():
    """The one-sort-per-stage median equals the plain median of each unit's peers (odd and even peer counts)."""
    import random
    import statistics

    detector = StragglerDetector(factor=1.2, intervals=3, units=work_units([0] * 7 + [1] * 6 + [2], list(range(14))))
    rng = random.Random(0)
    for _ in range(20):
        times = [rng.random() for _ in range(14)]
        now = {u: times[u.ranks[0]] for u in detector.units}
        got = detector._peer_references(now)
        want = {u: statistics.median([now[v] for v in detector.units if v.stage == u.stage and v != u])
                for u in detector.units if u.stage != 2}  # stage 2 has one unit: no peers
        assert got == pytest.approx(want)


def test_a_full_disk_at_close_does_not_hide_the_failure_being_reported(tmp_path, caplog):
    """TensorBoard's writer re-raises ENOSPC from close(), which the failure path calls: it is a warning there."""
    from megatron_ext.metrics.run_logger import RunLogger

    cfg = load_config(TINY, ["data.mock=true", "model.vocab_size=1000", f"logging.tensorboard_dir={tmp_path}"])
    logger = RunLogger(cfg, 1000, world_size=1, enabled=True)

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "events.out.tfevents"))

    logger.writer.close = full_disk
    with caplog.at_level("WARNING", logger="megatron_ext"):
        logger.close(failed=True)
    assert "could not write their last records (OSError: [Errno 28] No space left on device" in caplog.text


def test_the_shell_scripts_source_the_exit_codes_errors_py_defines():
    """launch/exit_codes.sh is errors.py's table, regenerated (the command is in its header) whenever a code
    changes; the SLURM body sources it instead of holding its own copy."""
    from megatron_ext.errors import exit_codes_shell

    assert (ROOT / "launch" / "exit_codes.sh").read_text() == exit_codes_shell()
    common = (ROOT / "launch" / "slurm" / "common.sh").read_text()
    assert "source launch/exit_codes.sh" in common and "EXIT_HUNG=" not in common


def test_a_container_step_mounts_the_run_and_checkpoint_directories_outside_the_checkout(tmp_path):
    """Under pyxis a checkpoint directory outside the checkout (on Lustre, say) is mounted at its own path, so the
    checkpoints land on the shared file system, not in the container's; directories inside the checkout are
    covered by its mount; CONTAINER_MOUNTS comes last."""
    import subprocess

    script = (f"source launch/slurm/common.sh; CONTAINER_MOUNTS=/data:/data _container_mounts "
              f"{tmp_path / 'run'} {tmp_path / 'lustre' / 'ckpt'} {ROOT / 'launch'}")
    mounts = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert mounts.strip().split(",") == [f"{ROOT}:{ROOT}", f"{tmp_path / 'run'}:{tmp_path / 'run'}",
                                         f"{tmp_path / 'lustre' / 'ckpt'}:{tmp_path / 'lustre' / 'ckpt'}",
                                         "/data:/data"]


def test_docker_run_forwards_wandb_and_can_mount_the_checkout_over_the_images_code(tmp_path):
    """launch/docker_run.sh with a stand-in `docker` that prints its arguments: W&B's settings reach the container,
    and MOUNT_CHECKOUT=1 puts this checkout over the image's copy of the code (edited configs run without a
    rebuild); by default the image's code is used."""
    import os
    import subprocess

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text('#!/bin/sh\necho "$@"\n')
    (fake / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "WANDB_MODE": "offline",
           "DATA_DIR": str(tmp_path / "data"), "RUNS_DIR": str(tmp_path / "runs")}

    def docker_args(extra: dict[str, str]) -> list[str]:
        return subprocess.run(["bash", "launch/docker_run.sh", "true"], cwd=ROOT, capture_output=True, text=True,
                              check=True, env={**env, **extra}).stdout.split()

    plain, mounted = docker_args({}), docker_args({"MOUNT_CHECKOUT": "1", "DOCKER_ARGS": "-v /lustre:/lustre"})
    assert "WANDB_MODE" in plain and f"{ROOT}:/workspace/megatron-recipes" not in plain
    assert f"{ROOT}:/workspace/megatron-recipes" in mounted
    # the mounts reach the ranks, which refuse a config path outside them (tests/unit/test_config_paths.py)
    workdir = "/workspace/megatron-recipes"
    assert f"CONTAINER_MOUNTED={tmp_path / 'data'}:{workdir}/data,{tmp_path / 'runs'}:{workdir}/runs" in plain
    assert next(a for a in mounted if a.startswith("CONTAINER_MOUNTED=")).endswith(f"{ROOT}:{workdir},/lustre:/lustre")


def test_the_launcher_names_the_rank_that_failed_by_itself():
    """torchrun's teardown SIGTERMs the others, and SIGKILLs a stopped rank (which cannot act on SIGTERM): after a
    hang that SIGKILL may carry the earliest timestamp, yet the job ended because the watchdog said so (exit 4, which
    the SLURM templates requeue as a hang). Seen once in 600 CI tests as exit 1."""
    import signal
    from types import SimpleNamespace as Failure

    from recipes.launch import _root_cause

    hang = {0: Failure(exitcode=4, timestamp=11), 1: Failure(exitcode=4, timestamp=12),
            2: Failure(exitcode=-signal.SIGKILL, timestamp=10), 3: Failure(exitcode=4, timestamp=11)}
    assert _root_cause(hang)[0] == 0
    oom = {0: Failure(exitcode=-signal.SIGTERM, timestamp=4), 1: Failure(exitcode=-signal.SIGKILL, timestamp=5)}
    assert _root_cause(oom)[0] == 1  # without a hang, a killed rank is the cause
    crash = {0: Failure(exitcode=EXIT_PEER_FAILED, timestamp=3), 1: Failure(exitcode=1, timestamp=4)}
    assert _root_cause(crash)[0] == 1


@pytest.mark.parametrize("initial, rerun, difference", [
    ([math.nan, math.nan], [math.nan, math.nan], 0.0),  # a NaN that recurs is the same result
    ([4.0, math.nan], [4.0, 2.0], math.inf),  # a NaN that did not recur: a transient fault
    ([math.inf, 1.0], [-math.inf, 1.0], math.inf),
    ([2.0, 1.0], [2.0, 1.5], 1 / 3),  # relative to the larger
    ([0.0, 0.0], [0.0, 0.0], 0.0),
])
def test_a_reruns_difference_from_its_run(initial, rerun, difference):
    assert relative_difference(torch.tensor(initial), torch.tensor(rerun)) == pytest.approx(difference)


def test_a_step_to_rerun_elsewhere_is_read_back_as_written_and_a_malformed_record_is_one_error(tmp_path):
    pending = PendingRerun(12, (Suspect(3, "node7", 1, "loss"), Suspect(5, "node9", 0, "gradients")))
    pending.write(tmp_path)
    assert PendingRerun.read(tmp_path) == pending and pending.nodes == ["node7", "node9"]
    assert PendingRerun.read(tmp_path / "elsewhere") is None and PendingRerun.read(None) is None
    for bad in ('{"iteration": 12}', '{"iteration": 0, "suspects": [{"rank": 1, "node": "n", "device": 0, '
                '"what": "loss"}]}', '{"iteration": 3, "suspects": [{"rank": 1, "node": "n", "device": 0, '
                '"what": "data"}]}', '{"iteration": 3, "suspects": []}', "[1, 2"):
        PendingRerun.path(tmp_path).write_text(bad)
        with pytest.raises(CheckpointError, match="rerun_elsewhere.json: not a step to re-run elsewhere"):
            PendingRerun.read(tmp_path)


def test_the_exit_code_of_a_step_to_rerun_elsewhere_is_megatron_cores():
    from megatron.core.rerun_state_machine import EXIT_CODE_RESUME_TO_DISAMBIGUATE

    from megatron_ext.errors import EXIT_RERUN_ELSEWHERE

    assert EXIT_RERUN_ELSEWHERE == EXIT_CODE_RESUME_TO_DISAMBIGUATE


@pytest.mark.parametrize("node, suspects, host, nodes, min_nodes, waiting, action", [
    ("b", ["b"], "a", 2, 2, 1, "leave"),  # a hot spare takes b's place: same world
    ("a", ["b"], "a", 2, 2, 1, "restart"),
    ("a", ["b"], "a", 2, 2, 0, "end"),  # no spare, no smaller world: requeue without b
    ("b", ["b"], "a", 2, 1, 0, "leave"),  # --nnodes 1:2: the job goes on without b
    ("b", ["b"], None, 2, 1, 0, "leave"),  # no agent of the round hosts the rendezvous
    ("a", ["a"], "a", 2, 1, 1, "end"),  # the rendezvous host cannot leave without ending the job
    ("b", ["b", "c", "b"], "a", 3, 2, 1, "leave"),  # two suspect nodes, one spare: 1 + 1 nodes still make 2
    ("b", ["b", "c"], "a", 3, 2, 0, "end"),
    ("a", ["a"], None, 1, 1, 3, "end"),  # a one-node job: nothing is left to restart with
])
def test_after_a_fault_recurs_its_node_leaves_only_where_the_job_can_go_on_without_it(node, suspects, host, nodes,
                                                                                     min_nodes, waiting, action):
    from megatron_ext.resilience.agent import after_a_fault_recurred

    assert after_a_fault_recurred(node, suspects, host, nodes, min_nodes, waiting) == action


def test_the_nodes_waiting_to_join_are_read_from_torchs_rendezvous_state_and_agreed_on():
    """torch exposes only its wait list; the hot spares are in the redundancy list of the same (private) state."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from megatron_ext.resilience.agent import _waiting_nodes, agreed

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    handler = DynamicRendezvousHandler.from_backend("run", store, C10dRendezvousBackend(store, "run"), 1, 2)
    assert _waiting_nodes(handler) == 0
    state = handler._state_holder.state
    state.redundancy_list.add(handler._this_node)
    state.wait_list.add(handler._this_node)
    handler._state_holder.mark_dirty()
    assert _waiting_nodes(handler) == 2
    assert _waiting_nodes(object()) == 0  # a static rendezvous
    # the agents act on the count of the first of them to decide
    assert agreed(store, "waiting", 1) == 1 and agreed(store, "waiting", 0) == 1


def test_where_the_agent_keeps_its_rendezvous_store_the_ranks_are_given_it_with_the_round(monkeypatch):
    """Unshared (every multi-node c10d launch), the ranks' MASTER_ADDR store lives in rank 0: their failure reports
    and hang heartbeats go to the agent's rendezvous store instead, under the round that made their world."""
    import os
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from megatron_ext.resilience.agent import Changes
    from megatron_ext.resilience.job_store import JOB_STORE, job_store

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    handler = DynamicRendezvousHandler.from_backend("run", store, C10dRendezvousBackend(store, "run"), 1, 2)
    handler._state_holder.state.round = 3

    class TorchsAgent:
        def _rendezvous(self, worker_group):
            return "rendezvous"

    class Agent(Changes, TorchsAgent):
        pass

    group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler))
    monkeypatch.setenv(JOB_STORE, "restored after the test")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert Agent()._rendezvous(group) == "rendezvous"
    assert os.environ[JOB_STORE] == f"127.0.0.1:{store.port}/run.3"
    job_store().set("hb/0", "1 7")
    assert store.get("megatron_ext/run.3/hb/0") == b"1 7"
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # shared: MASTER_ADDR is the agent's store
    Agent()._rendezvous(group)
    assert JOB_STORE not in os.environ


class _Spare:
    """An agent whose run ends as torch's does: a result, its graceful exit's None, or a rendezvous error."""

    def __init__(self, outcome, trained: bool = False):
        from types import SimpleNamespace

        self.outcome, self._worker_group = outcome, SimpleNamespace(group_rank=0 if trained else None)

    def run(self, role: str = "default"):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def test_a_spare_the_job_ended_without_is_told_apart_from_a_node_that_failed():
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousConnectionError

    from megatron_ext.resilience.agent import Changes, SpareNotNeeded

    class Spare(Changes, _Spare):
        pass

    assert Spare("result").run() == "result"
    for outcome, why in ((None, "it waited as a hot spare until the job ended"),
                         (RendezvousClosedError(), "it arrived after the job's rendezvous had closed"),
                         (RendezvousConnectionError(), "it waited as a hot spare until the rendezvous host ended")):
        with pytest.raises(SpareNotNeeded) as ended:
            Spare(outcome).run()
        assert ended.value.why == why
    # a node that trained and whose restart then found the job gone is not a spare: the error is its own
    with pytest.raises(RendezvousConnectionError):
        Spare(RendezvousConnectionError(), trained=True).run()


def test_signal_exit_codes_the_rank_log_name_and_store_keys_are_written_once():
    """128 + a signal's number is errors.signal_exit_code's alone, the rank log's name failures.RANK_LOG's, every
    store key distributed/store_keys.py's: a grep of the code (comments and docstrings aside) finds no second
    derivation."""
    import re

    sources = [*(ROOT / "megatron_ext").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]
    twice = []
    for path in sources:
        code = re.sub(r'"""(?:.|\n)*?"""', "", path.read_text())  # docstrings
        code = "\n".join(line.split("  #")[0] for line in code.splitlines() if not line.lstrip().startswith("#"))
        if path.name != "errors.py" and re.search(r"\b128 \+ ", code):
            twice.append(f"{path}: 128 + signal")
        if path.name != "failures.py" and re.search(r"rank-(\{[^}]*\}|\*)\.log", code):
            twice.append(f"{path}: the rank log's name")
        # store keys: distributed/store_keys.py names every one (its namespaces, the watchdog's, the reports', the
        # agents')
        if path.name != "store_keys.py" and re.search(r'f?"(megatron_ext/|hb/|proc/|failure/|rerun_elsewhere/)', code):
            twice.append(f"{path}: a store key")
    assert not twice, twice
