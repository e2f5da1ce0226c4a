"""Checkpoints you can trust: nothing silent on resume, trackers never move back, corrupt checkpoints are set
aside, a failed save leaves nothing behind, retention keeps what it should. One process unless noted."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from megatron_ext.checkpoint.layout import RUN_LOCK, TRACKER, iteration_dir, latest_iteration, write_tracker
from tests.launch import (
    ROOT,
    SINGLE_PROCESS,
    SMALL_MODEL,
    free_ports,
    pretrain_command,
    read_scalars,
    run_env,
    run_pretrain,
)


def _overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=4", "optimizer.lr_decay_iters=null",
            f"logging.tensorboard_dir={tmp_path / name}", "checkpoint.save=null", *extra]


def _fails(proc, fragment: str) -> None:
    """The (single-process) run exits 2 after one line on stderr containing `fragment`, and no traceback."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[rank 0, start-up] checkpoint error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    """4 steps saved at 2 and 4 (tracker 4)."""
    root = tmp_path_factory.mktemp("ckpt_safety")
    run_pretrain(1, _overrides(root, "tb_full", f"checkpoint.save={root / 'ckpt'}", "checkpoint.save_interval=2"))
    return {"root": root, "ckpt": root / "ckpt", "tb": root / "tb_full"}


def test_a_mistyped_load_path_is_an_error_and_moves_no_tracker(run, tmp_path):
    proc = run_pretrain(1, _overrides(tmp_path, "tb", f"checkpoint.load={run['root'] / 'ckpt_typo'}",
                                      f"checkpoint.save={run['ckpt']}"), check=False)
    _fails(proc, "holds no checkpoint")
    assert latest_iteration(run["ckpt"]) == 4


def test_a_fresh_run_into_a_directory_ahead_of_it_is_refused(run, tmp_path):
    proc = run_pretrain(1, _overrides(tmp_path, "tb", f"checkpoint.save={run['ckpt']}", "checkpoint.load=null",
                                      "train.train_iters=5"), check=False)
    _fails(proc, f"checkpoint.save={run['ckpt']} already holds iteration 4")
    assert latest_iteration(run["ckpt"]) == 4


def test_the_runs_own_empty_save_directory_starts_fresh(tmp_path):
    own = tmp_path / "own"
    proc = run_pretrain(1, _overrides(tmp_path, "tb", "train.train_iters=1", f"checkpoint.save={own}"))
    assert f"no checkpoint in {own} yet" in proc.stdout and latest_iteration(own) == 1
    # the time to the first step, in parts, in the log and the summary
    assert re.search(r"start-up: [\d.]+ s to the end of the first step: imports [\d.]+ s, megatron-core imports, "
                     r"config and data checks [\d.]+ s, checkpoint save helper process [\d.]+ s, process groups "
                     r"[\d.]+ s, model and optimizer [\d.]+ s, run lock \(no checkpoint to load\) [\d.]+ s, "
                     r"dataset indices [\d.]+ s, first step [\d.]+ s",
                     proc.stdout)
    assert proc.stdout.count("start-up: ") == 2, proc.stdout


def test_a_relaunch_resumes_by_default_and_a_finished_run_says_so_before_any_rank_starts(run, tmp_path):
    ckpt = _copy(run["ckpt"], tmp_path / "ckpt")
    done = run_pretrain(1, _overrides(tmp_path, "tb", f"checkpoint.save={ckpt}"), launcher="recipes.launch")
    assert done.stdout.splitlines() == [f"run tiny-llama-tp2-pp2 is complete: {ckpt} holds iteration 4 "
                                        f"(train.train_iters=4). To train further raise train.train_iters; to "
                                        f"start over delete {ckpt} or choose another checkpoint.save"], done.stdout
    assert not done.stderr.strip(), done.stderr
    more = run_pretrain(1, _overrides(tmp_path, "tb2", "train.train_iters=5", f"checkpoint.save={ckpt}"))
    assert f"resumed from {ckpt} at iteration 4" in more.stdout and latest_iteration(ckpt) == 5


def test_of_two_runs_started_together_on_one_directory_one_is_refused(tmp_path):
    """Two plain torchrun launches (both with torchrun's default run id 'none'): both pass the launch check; the
    lock decides: one trains to the end, the other stops at start-up with one line naming the holder, and the
    finished run leaves no lock behind."""
    ckpt = tmp_path / "ckpt"

    ports = free_ports(2)

    def plain_torchrun(i: int) -> list[str]:
        python, *recipe = pretrain_command(1, _overrides(tmp_path, f"tb{i}", "train.train_iters=60",
                                                         f"checkpoint.save={ckpt}"))
        return [python, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={ports[i]}",
                f"--log-dir={tmp_path}", *recipe]

    procs = [subprocess.Popen(plain_torchrun(i), cwd=ROOT, env=run_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    codes = [proc.returncode for proc in procs]
    assert codes.count(0) == 1, outputs  # the refused rank exits 2; plain torchrun reports any failure as 1
    _, refused = outputs[1 - codes.index(0)]
    errors = [line for line in refused.splitlines() if "checkpoint error" in line]
    assert len(errors) == 1 and f"checkpoint.save={ckpt} is in use by another run (pid " in errors[0], refused
    assert latest_iteration(ckpt) == 60 and not (ckpt / RUN_LOCK).exists()


def test_the_launcher_refuses_a_directory_held_by_a_live_run_before_any_rank_starts(tmp_path):
    from megatron_ext.checkpoint.run_lock import RunLock

    lock = RunLock(tmp_path / "ckpt")  # held by this test process: alive, on this host
    lock.acquire()
    try:
        proc = run_pretrain(1, _overrides(tmp_path, "tb", f"checkpoint.save={tmp_path / 'ckpt'}"),
                            launcher="recipes.launch", check=False)
    finally:
        lock.release()
    assert proc.returncode == 2 and not proc.stdout.strip(), proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"checkpoint error: checkpoint.save={tmp_path / 'ckpt'} is in use by another run (pid {os.getpid()} on "), lines


def test_config_differences_are_listed_and_shape_changes_refused(run, tmp_path):
    seq = run_pretrain(1, _overrides(tmp_path, "tb", f"checkpoint.load={run['ckpt']}", "train.train_iters=5",
                                     "model.seq_length=64"))
    assert "model.seq_length: 128 → 64" in seq.stdout and "train.train_iters: 4 → 5" in seq.stdout, seq.stdout
    wider = run_pretrain(1, _overrides(tmp_path, "tb2", f"checkpoint.load={run['ckpt']}", "train.train_iters=5",
                                       "model.hidden_size=256"), check=False)
    _fails(wider, "model.hidden_size: 128 → 256")
    # another vocabulary (here: mock data of 1,000 tokens) pads to another embedding: refused before anything loads,
    # though no shape key of the config changed (model.vocab_size: None → 1000 is a tokenizer's choice)
    vocabulary = run_pretrain(1, _overrides(tmp_path, "tb3", f"checkpoint.load={run['ckpt']}", "train.train_iters=5",
                                            "data.mock=true", "model.vocab_size=1000"), check=False)
    _fails(vocabulary, "holds embedding.word_embeddings.weight of shape [4096, 128] and this run's model builds "
                       "[1024, 128]: it was saved from a model of another shape")


def test_extending_train_iters_follows_the_new_lr_schedule(run, tmp_path):
    """Resume 4 → 6: steps 5-6 get the LR an uninterrupted 6-step run has there, not the old min_lr."""
    run_pretrain(1, _overrides(tmp_path, "tb_six", "train.train_iters=6"))
    run_pretrain(1, _overrides(tmp_path, "tb_ext", "train.train_iters=6", f"checkpoint.load={run['ckpt']}"))
    six, extended = read_scalars(tmp_path / "tb_six", "train/lr"), read_scalars(tmp_path / "tb_ext", "train/lr")
    assert {k: extended[k] for k in (5, 6)} == {k: six[k] for k in (5, 6)}, (extended, six)
    min_lr = 3.0e-4  # configs/tiny.yaml: where the saved 4-step schedule ends
    assert min(extended.values()) > min_lr, extended


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_corrupt_latest_checkpoint_is_set_aside_and_the_previous_one_resumed(run, tmp_path):
    """2 processes (DP2), which split the CRC checks file by file: the corrupt shard is in rank 1's share, and
    rank 0 still sets the checkpoint aside, naming it; iteration 2 is resumed on both."""
    ckpt = _copy(run["ckpt"], tmp_path / "ckpt")
    files = sorted(str(p.relative_to(ckpt / "iter_0000004")) for p in (ckpt / "iter_0000004").rglob("*")
                   if p.is_file() and p.name != "manifest.json")
    shard = ckpt / "iter_0000004" / next(f for f in files[1::2] if f.endswith(".distcp"))  # rank 1's share
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated, as by a full disk
    proc = run_pretrain(2, _overrides(tmp_path, "tb", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}"))
    assert "CHECKPOINT NOT USABLE" in proc.stdout and shard.name in proc.stdout and "truncated" in proc.stdout
    assert (ckpt / "iter_0000004.corrupt").is_dir() and "resumed from" in proc.stdout
    resumed = read_scalars(tmp_path / "tb", "train/lm_loss")
    original = read_scalars(run["tb"], "train/lm_loss")
    assert sorted(resumed) == [3, 4]  # continued from iteration 2, DP2 summing what one process did
    assert max(abs(resumed[k] - original[k]) / original[k] for k in resumed) <= 1e-6, (resumed, original)
    assert latest_iteration(ckpt) == 4 and (ckpt / "iter_0000004" / "manifest.json").is_file()


@pytest.mark.parametrize("tracker", [None, "iter_0000004\n"], ids=["missing", "unreadable"])
def test_a_lost_tracker_resumes_the_newest_complete_checkpoint_and_overwrites_none(run, tmp_path, tracker):
    """The tracker deleted (or garbled) beside complete checkpoints: the relaunch resumes the newest of them and
    says so; before, it started from iteration 0 and overwrote each checkpoint as it reached its iteration."""
    ckpt = _copy(run["ckpt"], tmp_path / "ckpt")
    (ckpt / TRACKER).unlink()
    if tracker is not None:
        (ckpt / TRACKER).write_text(tracker)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file() and p.parent != ckpt}
    proc = run_pretrain(1, _overrides(tmp_path, "tb", f"checkpoint.save={ckpt}", "train.train_iters=6",
                                      "checkpoint.save_interval=2"))
    assert "CHECKPOINT TRACKER LOST" in proc.stdout and "iterations 2, 4: resuming from the newest, iteration 4" in (
        proc.stdout), proc.stdout[-3000:]
    assert f"resumed from {ckpt} at iteration 4" in proc.stdout and "lost 4 steps" not in proc.stdout
    assert sorted(read_scalars(tmp_path / "tb", "train/lm_loss")) == [5, 6] and latest_iteration(ckpt) == 6
    assert all(path.read_bytes() == data for path, data in before.items())  # iterations 2 and 4 untouched


def test_with_no_intact_checkpoint_the_error_is_one_line(run, tmp_path):
    ckpt = _copy(run["ckpt"], tmp_path / "ckpt")
    for iteration in (2, 4):
        shard = sorted((ckpt / f"iter_{iteration:07d}").glob("*.distcp"))[0]
        shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, wrong bytes
    proc = run_pretrain(1, _overrides(tmp_path, "tb", f"checkpoint.load={ckpt}", "train.train_iters=5"), check=False)
    _fails(proc, "holds no intact checkpoint")
    assert "CRC32" in proc.stderr


def test_retention_keeps_the_newest_n_and_every_kth_of_the_saves_the_clock_made(tmp_path):
    """checkpoint.save_interval_minutes shorter than a step: the clock makes a save after every step (logging every
    step, every step boundary agrees on the clock)."""
    ckpt = tmp_path / "ckpt"
    proc = run_pretrain(1, _overrides(tmp_path, "tb", "train.train_iters=6", f"checkpoint.save={ckpt}",
                                      "checkpoint.save_interval_minutes=0.00001", "checkpoint.keep_last=2",
                                      "checkpoint.keep_every=3"))
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000003", "iter_0000005", "iter_0000006"]
    assert proc.stdout.count("retention (checkpoint.keep_last=2, keep_every=3): deleted") == 3
    assert latest_iteration(ckpt) == 6


@pytest.mark.parametrize("fail", [{"FAIL_RANK": "1"}, {"FAIL_RANK": "0", "FAIL_AT": "metadata"}],
                         ids=["a_shard_on_rank_1", "metadata_json_on_rank_0"])
def test_a_save_that_fails_on_one_rank_removes_its_directory_and_keeps_the_tracker(tmp_path, fail):
    """2 processes; rank 1's write of iteration 4 hits ENOSPC after rank 0 finished its part — or rank 0's write of
    megatron-core's metadata.json, the save's last write and rank 0's alone: every rank stops in the same agreed way,
    without waiting for a collective timeout."""
    ckpt = tmp_path / "ckpt"
    overrides = [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                 "parallel.sequence_parallel=false", "train.train_iters=4", f"checkpoint.save={ckpt}",
                 "checkpoint.save_interval=2", "logging.tensorboard_dir=null", "parallel.distributed_timeout_minutes=30"]
    # torchrun for the metadata case: its fault must be in place before the recipe's checkpoint code is imported
    proc = run_pretrain(2, overrides, module="tests.workers.checkpoint_fault_worker", check=False,
                        env={"FAIL_ITERATION": "4", **fail}, timeout=300,
                        launcher="torchrun" if "FAIL_AT" in fail else "fork")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "checkpoint error" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"rank {fail['FAIL_RANK']}: OSError: [Errno 28] No space left on device" in errors[0], errors
    assert "iteration 2" in errors[0]
    assert not (ckpt / "iter_0000004").exists() and latest_iteration(ckpt) == 2
    assert (ckpt / "iter_0000002" / "manifest.json").is_file() and (ckpt / TRACKER).read_text().strip() == "2"


def test_a_failed_asynchronous_save_is_one_error_exit_2_and_leaves_the_previous_checkpoint(tmp_path):
    """2 processes, checkpoint.async_save (the GPU default): rank 1's background writer of iteration 4 dies. Every
    rank learns it when the save is finalised; one line says it, the job exits 2, iteration 4 is removed and the
    tracker still names 2."""
    ckpt = tmp_path / "ckpt"
    overrides = [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=4", f"checkpoint.save={ckpt}",
                 "checkpoint.save_interval=2", "checkpoint.async_save=true", "logging.tensorboard_dir=null",
                 f"logging.log_dir={tmp_path / 'logs'}"]
    proc = run_pretrain(2, overrides, module="tests.workers.checkpoint_fault_worker", check=False,
                        env={"FAIL_ITERATION": "4", "FAIL_RANK": "1"})
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr[-3000:]  # torchrun's
    errors = [line for line in proc.stderr.splitlines() if "checkpoint error" in line]
    assert len(errors) == 1 and f"the asynchronous save of {ckpt / 'iter_0000004'} failed" in errors[0], proc.stderr
    assert not (ckpt / "iter_0000004").exists() and latest_iteration(ckpt) == 2
    assert (ckpt / "iter_0000002" / "manifest.json").is_file()


def _optimizer_format(ckpt_dir: Path) -> str:
    from megatron_ext.checkpoint.common_state import read_common

    return read_common(ckpt_dir).optimizer_format


def test_async_saves_resume_exactly_and_the_default_format_reshards_across_dp_only(tmp_path):
    """2 processes, checkpoint.async_save: 4 steps stopped by exit_interval, resumed to 8, equals 8 uninterrupted.
    The step-4 checkpoint (dp_reshardable, the default mid-run) also continues on 1 process, which says what the
    restart changed; under TP2 it is refused with one message naming the format and the changed key."""
    dp2 = [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
           "parallel.sequence_parallel=false", "train.train_iters=8", "optimizer.lr_decay_iters=null"]
    ckpt = tmp_path / "ckpt"
    run_pretrain(2, [*dp2, f"logging.tensorboard_dir={tmp_path / 'full'}", "checkpoint.save=null"])
    asynchronous = [*dp2, f"logging.tensorboard_dir={tmp_path / 'resumed'}", f"checkpoint.save={ckpt}",
                    "checkpoint.save_interval=2", "checkpoint.async_save=true"]
    first = run_pretrain(2, [*asynchronous, "train.exit_interval=4"])
    assert "written in the background" in first.stdout, first.stdout[-3000:]
    assert latest_iteration(ckpt) == 4 and (ckpt / "iter_0000004" / "manifest.json").is_file()
    assert _optimizer_format(ckpt / "iter_0000004") == "dp_reshardable"

    on_dp1 = _copy(ckpt, tmp_path / "dp1_ckpt")  # with the run's progress record
    dp1 = run_pretrain(1, [*dp2, f"logging.tensorboard_dir={tmp_path / 'dp1'}", f"checkpoint.save={on_dp1}"])
    assert re.search(r"restart: world 2 → 1: DP 2 → 1, 2 → 4 micro batches per step, resumed at iteration 4, "
                     r"lost 0 steps, recovered in [\d.]+ s", dp1.stdout), dp1.stdout[-3000:]
    assert read_scalars(tmp_path / "dp1", "elastic/data_parallel_size") == {5: 1.0}
    full = read_scalars(tmp_path / "full", "train/lm_loss")
    on_one = read_scalars(tmp_path / "dp1", "train/lm_loss")
    # 2 × 2 micro batches summed as 4 on one process: measured 0.0
    assert sorted(on_one) == [5, 6, 7, 8] and max(abs(on_one[k] - full[k]) / full[k] for k in on_one) <= 1e-6
    tp2 = run_pretrain(2, [*dp2, "parallel.tensor_model_parallel_size=2", f"checkpoint.load={ckpt}"], check=False)
    assert tp2.returncode != 0
    assert "dp_reshardable format" in tp2.stderr and "parallel.tensor_model_parallel_size: 1 → 2" in tp2.stderr, \
        tp2.stderr[-3000:]

    resumed = run_pretrain(2, [*asynchronous, f"checkpoint.load={ckpt}"])
    assert "restart: same world (2 ranks, DP 2), resumed at iteration 4, lost 0 steps" in resumed.stdout
    for tag in ("train/lm_loss", "train/grad_norm"):
        assert read_scalars(tmp_path / "resumed", tag) == read_scalars(tmp_path / "full", tag), tag
    assert latest_iteration(ckpt) == 8 and (ckpt / "iter_0000008" / "manifest.json").is_file()
    assert _optimizer_format(ckpt / "iter_0000008") == "fully_reshardable_mem_efficient"  # the finished run's


def test_the_listing_command_shows_state_layout_and_config_differences(run, tmp_path):
    import sys

    from tests.launch import TINY

    ckpt = _copy(run["ckpt"], tmp_path / "ckpt")
    shard = sorted((ckpt / "iter_0000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    proc = subprocess.run([sys.executable, "-m", "recipes.checkpoints", str(ckpt), "--verify", "--config", str(TINY),
                           *SMALL_MODEL, *SINGLE_PROCESS, "model.hidden_size=256"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("iter_0000002") and "complete, verified" in line and "TP1×PP1×CP1, fp32" in line
               and "optimizer dp_reshardable" in line for line in lines), proc.stdout
    # the common state (iteration, config, layout) lives in the damaged shard (megatron-core >= 0.17)
    assert any(line.startswith("iter_0000004") and "CORRUPT" in line and "truncated" in line and "<- tracker" in line
               and "common state unreadable" in line for line in lines), proc.stdout
    assert "config of iter_0000002" in proc.stdout and "model.hidden_size: 128 → 256" in proc.stdout
    assert "a resume would be refused: parameter shapes differ (model.hidden_size: 128 → 256;" in proc.stdout


@pytest.mark.parametrize("hang_at", ["shards", "tracker"])
def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoint_to_resume(run, tmp_path, hang_at):
    """The job is SIGKILLed during iteration 4's save — after its shards are written, or when its tracker is about
    to move (its manifest is already written: a manifest never lags the tracker): the tracker still names 2, and
    the resumed run continues the uninterrupted one exactly."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.launch import DATASET_CACHE, ROOT, TINY

    ckpt, marker = tmp_path / "ckpt", tmp_path / "saving"
    # the rank logs of the killed job (a rank may see its launcher die before its own SIGKILL) stay in tmp_path
    overrides = _overrides(tmp_path, "tb_killed", f"checkpoint.save={ckpt}", "checkpoint.save_interval=2",
                           f"logging.log_dir={tmp_path / 'logs'}", f"data.path_to_cache={DATASET_CACHE}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "FAIL_ITERATION": "4", "FAIL_RANK": "0",
           "HANG_MARKER": str(marker), "HANG_AT": hang_at}
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                            f"--log-dir={tmp_path}", "-m",
                            "tests.workers.checkpoint_fault_worker", "--config", str(TINY), *overrides], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not marker.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert marker.exists(), "the save of iteration 4 never started"
    processes = [job_process := psutil.Process(job.pid), *job_process.children(recursive=True)]
    for process in processes:  # torchrun puts its ranks in their own process groups: kill each
        process.send_signal(signal.SIGKILL)
    job.wait(timeout=60)
    assert latest_iteration(ckpt) == 2
    assert (ckpt / "iter_0000004" / "manifest.json").exists() == (hang_at == "tracker")
    run_pretrain(1, _overrides(tmp_path, "tb_resumed", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}",
                               "checkpoint.save_interval=2"))
    original = read_scalars(run["tb"], "train/lm_loss")
    assert read_scalars(tmp_path / "tb_resumed", "train/lm_loss") == {3: original[3], 4: original[4]}
    assert latest_iteration(ckpt) == 4 and (ckpt / "iter_0000004" / "manifest.json").is_file()


def test_resumed_dropout_draws_from_the_restored_rng_streams(tmp_path):
    """Dropout on (hidden and attention): stopped at 2 and resumed to 4 equals 4 uninterrupted steps exactly, so the
    masks after the resume come from the RNG states the checkpoint restored (fresh streams give other masks)."""
    dropout = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    run_pretrain(1, _overrides(tmp_path, "tb_full", *dropout))
    run_pretrain(1, _overrides(tmp_path, "tb_first", *dropout, "train.exit_interval=2",
                               f"checkpoint.save={tmp_path / 'ckpt'}"))
    run_pretrain(1, _overrides(tmp_path, "tb_resumed", *dropout, f"checkpoint.load={tmp_path / 'ckpt'}"))
    full = read_scalars(tmp_path / "tb_full", "train/lm_loss")
    assert read_scalars(tmp_path / "tb_resumed", "train/lm_loss") == {3: full[3], 4: full[4]}


def test_a_dp_reshardable_save_whose_last_padding_runs_past_its_bucket_is_written_and_resumes_exactly(tmp_path):
    """2 processes, PP2 with the output layer tied to the embedding: hidden size 200 leaves the first stage's last
    parameter 8 elements past a multiple of 64, so the embedding's bucket starts 56 elements later and the bucket
    before it is padded 64 further. megatron-core 0.19.2 covers that gap with one padding shard reaching past the
    bucket's checkpoint tensor, and torch's distributed checkpoint refuses the save (Megatron-LM pull request 5898).
    Without optimizer_format.padding_within_buckets the first save never ends (tried): torch refuses the plan on rank
    0 while rank 1 waits in megatron-core's barrier. The checkpoint written at step 2 resumes to the uninterrupted
    run's numbers."""
    tied = [*SMALL_MODEL, "model.hidden_size=200", "model.num_attention_heads=4", "model.num_query_groups=2",
            "model.ffn_hidden_size=256", "model.num_layers=2", "model.untie_embeddings_and_output_weights=false",
            "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
            "parallel.sequence_parallel=false", "train.train_iters=4", "optimizer.lr_decay_iters=null",
            "checkpoint.optimizer_format=dp_reshardable"]
    saved = tmp_path / "saved"
    run_pretrain(2, [*tied, f"logging.tensorboard_dir={tmp_path / 'full'}", f"checkpoint.save={saved}",
                     "checkpoint.save_interval=2"])
    ckpt = tmp_path / "ckpt"
    shutil.copytree(iteration_dir(saved, 2), iteration_dir(ckpt, 2))
    write_tracker(ckpt, 2)
    run_pretrain(2, [*tied, f"logging.tensorboard_dir={tmp_path / 'resumed'}", f"checkpoint.load={ckpt}",
                     "checkpoint.save=null"])
    for tag in ("train/lm_loss", "train/grad_norm"):
        full, resumed = read_scalars(tmp_path / "full", tag), read_scalars(tmp_path / "resumed", tag)
        assert sorted(resumed) == [3, 4] and resumed == {step: full[step] for step in (3, 4)}, tag


DP2_SAVING_EVERY_2 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                      "parallel.sequence_parallel=false", "checkpoint.save_interval=2"]


@pytest.fixture(scope="module")
def uninterrupted_dp2(initial_weights, tmp_path_factory) -> Path:
    """TensorBoard directory of the DP2 run saving every 2 steps that the runs whose save helper dies must end as."""
    from tests.conftest import parity_overrides

    root = tmp_path_factory.mktemp("uninterrupted_dp2")
    run_pretrain(2, [*parity_overrides(initial_weights, root / "tb"), *DP2_SAVING_EVERY_2,
                     f"checkpoint.save={root / 'ckpt'}"])
    return root / "tb"


@pytest.mark.parametrize("when", ["before a save", "while an async save writes"])
def test_a_dead_save_helper_is_one_line_and_the_restart_finishes_as_the_uninterrupted_run(initial_weights, tmp_path,
                                                                                        uninterrupted_dp2, when):
    """Rank 1's save helper killed (SIGKILL) in a DP2 run saving every 2 steps — during iteration 3 (synchronous
    saves), or right after the asynchronous save of iteration 4 was scheduled, its shards being written: the save of
    4 stops every rank at once with one line naming the rank, the helper's pid and the signal (before: the save
    waited on the dead helper until the collective timeout, the hang watchdog paused; asynchronously, the ranks met
    in mismatched collectives and hung), exit 1, which the agent restarts; the half-written iter_0000004 is removed,
    the workers resume at 2 and end as the uninterrupted run, step for step."""
    from tests.conftest import parity_overrides

    writing = when == "while an async save writes"
    dp2 = [*DP2_SAVING_EVERY_2, f"checkpoint.async_save={writing}"]
    cmd = pretrain_command(2, [*parity_overrides(initial_weights, tmp_path / "tb"), *dp2,
                               f"checkpoint.save={tmp_path / 'ckpt'}", f"logging.log_dir={tmp_path / 'logs'}"],
                           launcher="recipes.launch", launch_options=("--max-restarts=1",))
    cmd[cmd.index("recipes.launch")] = "tests.workers.helper_killed_worker"  # recipes.launch, its ranks' kill injected
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=run_env(
        {"KILL_HELPER_AT": "4" if writing else "3", "KILL_HELPER_RANK": "1", "KILLED_MARKER": str(tmp_path / "killed"),
         **({"KILL_HELPER_IN_SAVE": "1"} if writing else {})}))
    assert proc.returncode == 0 and (tmp_path / "killed").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "'s checkpoint save helper process" in line]
    happened = (f"while {tmp_path / 'ckpt' / 'iter_0000004'} was written in the background: removed" if writing else
                "before the checkpoint of iteration 4 was written: nothing was saved")
    assert said and all(re.search(r"rank 1's checkpoint save helper process \(pid \d+\) was killed by SIGKILL, "
                                  + re.escape(happened), line) for line in said), said
    assert f"resumed from {tmp_path / 'ckpt'} at iteration 2" in proc.stdout, proc.stdout[-3000:]
    for tag in ("train/lm_loss", "train/grad_norm"):
        assert read_scalars(tmp_path / "tb", tag) == read_scalars(uninterrupted_dp2, tag), tag
    assert latest_iteration(tmp_path / "ckpt") == 6


def test_a_read_only_checkpoint_directory_is_the_storage_error_in_one_line(tmp_path):
    """A real read-only mount (a tmpfs remounted read-only) holding a finished run's checkpoints and logs: the
    relaunch ends with the storage code 6 (the SLURM template requeues it elsewhere) after one line naming the
    directory; the traceback sits in a rank log that exists (the temporary directory stands in for the read-only
    log directory, and both the rank and the launcher point there); no run lock is left, the checkpoints are as
    they were."""
    from megatron_ext.errors import EXIT_STORAGE
    from megatron_ext.resilience.failures import writable_log_dir

    mount = tmp_path / "mount"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        ckpt = mount / "ckpt"
        overrides = [*_overrides(tmp_path, "tb", f"checkpoint.save={ckpt}", "checkpoint.save_interval=2",
                                 f"logging.log_dir={mount / 'logs'}"), "logging.tensorboard_dir=null"]
        run_pretrain(1, [*overrides, "train.train_iters=2"])
        before = {path: path.read_bytes() for path in ckpt.rglob("*") if path.is_file()}
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        proc = run_pretrain(1, overrides, launcher="recipes.launch", check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == EXIT_STORAGE, out[-3000:]
        said = [line for line in out.splitlines() if "cannot be written (OSError: Read-only file system)" in line]
        assert len(said) == 1 and f"checkpoint.save={ckpt} " in said[0], out[-3000:]
        logs = {Path(path) for path in re.findall(r"(?:traceback|its log): (\S+?)\)?$", out, re.M)}
        assert logs and all(log.is_file() and "Traceback" in log.read_text() for log in logs), (logs, out[-3000:])
        assert not (ckpt / RUN_LOCK).exists()
        assert {path: path.read_bytes() for path in ckpt.rglob("*") if path.is_file()} == before
    finally:
        stand_in = writable_log_dir(mount / "logs")  # while the mount is read-only: the logs' place under /tmp
        subprocess.run(["umount", str(mount)], capture_output=True)
        if mount not in stand_in.parents:
            shutil.rmtree(stand_in, ignore_errors=True)
            with contextlib.suppress(OSError):
                stand_in.parent.rmdir()  # unless another run's logs are there


@pytest.mark.serial  # a 10 s hang timeout
def test_a_save_that_never_finishes_is_named_by_the_hang_watchdog(tmp_path):
    """Rank 1's checkpoint save helper stopped (SIGSTOP: alive, so no death to notice, and never answering) as
    iteration 4 starts: rank 1's save of 4 waits on it while rank 0 waits in the save's collectives. The watchdog,
    whose step timeout does not apply during a save, ends the job when the save outlasts its limit (ten times the
    tiny model's planned write, at least the hang timeout: 10 s; the collectives time out after 1 minute), naming
    the save — not "a stuck device or network" after the collective timeout — with every rank's stacks in its log
    (rank 1's in the helper's queue) and the tracker still at iteration 2."""
    from megatron_ext.errors import EXIT_HUNG

    ckpt, logs, stopped = tmp_path / "ckpt", tmp_path / "logs", tmp_path / "stopped"
    env = {"KILL_HELPER_AT": "4", "KILL_HELPER_RANK": "1", "KILLED_MARKER": str(stopped),
           "KILL_HELPER_SIGNAL": "SIGSTOP"}
    try:
        proc = run_pretrain(2, [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=6",
                                f"checkpoint.save={ckpt}", "checkpoint.save_interval=2", "train.hang_timeout_s=10",
                                "parallel.distributed_timeout_minutes=1", f"logging.log_dir={logs}",
                                "logging.tensorboard_dir=null"],
                            module="tests.workers.helper_killed_worker", check=False, env=env, timeout=300)
    finally:
        if stopped.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stopped.read_text()), signal.SIGKILL)
    assert f"exitcode : {EXIT_HUNG}" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("[rank 0, the checkpoint save of iteration 4] hang: the checkpoint save of iteration 4 has not finished "
            "in 10 s") in proc.stderr, proc.stderr[-3000:]
    assert "a stuck device or network" not in proc.stderr
    assert "save_helper.py" in (logs / "rank-1.log").read_text()  # where rank 1 waits
    assert latest_iteration(ckpt) == 2
