"""Failures speak once and leave nothing running: divergence, hangs, a killed launcher, stragglers' metrics, and
the pieces behind them (reporting, loss spikes, straggler detection, parent-death signals)."""

from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_ext.config.schema import load_config
from megatron_ext.errors import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_PEER_FAILED,
    EXIT_USER_ERROR,
    CheckpointError,
    ConfigError,
    DivergenceError,
    IncompatibleCheckpointError,
    TokenizerError,
)
from megatron_ext.resilience.divergence import LossSpikeDetector
from megatron_ext.resilience.failures import out_of_memory_advice, report_failure
from megatron_ext.resilience.stragglers import StragglerDetector
from tests.launch import ROOT, SMALL_MODEL, TINY, pretrain_command, read_scalars, run_env, run_pretrain

NO_SAVE = ["checkpoint.save=null"]


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _rank_pid(launcher_pid: int, rank: int) -> int:
    for pid in _children(launcher_pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"{text!r} did not appear: {path.read_text()[-3000:]}")


def test_divergence_stops_at_its_step_once_naming_where_after_the_allowed_skips(tmp_path):
    """lr 1e4 on TP2×PP2 in fp32 (megatron-core's own check said "iteration -1", 252 lines per rank): one skipped
    step, then one line naming the iteration and pipeline stage, exit 3; the per-rank compute spread is logged."""
    logs, tb = tmp_path / "logs", tmp_path / "tb"
    proc = run_pretrain(4, [*SMALL_MODEL, "train.train_iters=10", "optimizer.lr=1e4", "optimizer.lr_warmup_iters=0",
                            "train.skip_nonfinite_steps=1", f"logging.log_dir={logs}",
                            f"logging.tensorboard_dir={tb}"], launcher="recipes.launch", check=False)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "] divergence:" in line]
    assert len(said) == 1, proc.stderr
    step = int(re.search(r"non-finite \w+ at iteration (\d+)", said[0]).group(1))
    assert f"iteration {step}] divergence" in said[0] and "pipeline stage" in said[0] and "after skipping 1" in said[0]
    skips = [line for line in proc.stdout.splitlines() if "skipped: non-finite" in line]
    assert len(skips) == 1 and f"iteration {step - 1}" in skips[0], proc.stdout[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 4, proc.stderr
    assert re.search(r"training failed: rank \d exited with code 3", proc.stderr)
    assert all("Traceback" in (logs / f"rank-{r}.log").read_text() for r in range(4))
    slowest = read_scalars(tb, "perf/slowest_rank")
    assert slowest and set(slowest.values()) <= {0.0, 1.0, 2.0, 3.0}
    assert all(read_scalars(tb, "perf/step_time_max_s")[s] >= read_scalars(tb, "perf/step_time_min_s")[s] > 0
               for s in slowest)
    assert "compute " in proc.stdout and "slowest rank" in proc.stdout


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_hang_timeout(tmp_path):
    """SIGSTOP one of 4 ranks (a stuck GPU, a dead NIC): the others' watchdogs write their stacks, name it once,
    and the job is gone (exit 4, for SLURM to requeue) within the timeout plus a margin."""
    logs, out = tmp_path / "logs", tmp_path / "out.txt"
    cmd = pretrain_command(4, [*SMALL_MODEL, "train.train_iters=1000", "train.hang_timeout_s=5",
                               f"logging.log_dir={logs}"], launcher="recipes.launch")
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_for(out, "step      2 |", proc)
        stopped = _rank_pid(proc.pid, 2)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        proc.wait(timeout=60)
        gone = time.monotonic() - start
    finally:
        proc.kill()
    text = out.read_text()
    assert proc.returncode == 4, text[-3000:]
    assert gone < 5 + 20 and not _alive(stopped), (gone, text[-3000:])
    assert text.count("] hang:") == 1 and f"heartbeat stopped on rank 2 (host " in text and f"pid {stopped})" in text
    assert not re.search(r"heartbeat stopped on .*rank [013] ", text), text[-3000:]
    for rank in (0, 1, 3):
        stacks = (logs / f"rank-{rank}.log").read_text()
        assert "hang watchdog" in stacks and "(most recent call first)" in stacks and "training.py" in stacks


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_rank_running_and_no_checkpoint(tmp_path):
    """kill -9 of torchrun (its ranks are in their own sessions, so nothing reached them before): every rank is
    gone within seconds, says why in its log, and no orphan writes the checkpoint due at step 3."""
    logs, ckpt, out = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "out.txt"
    cmd = pretrain_command(2, [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
                               "train.train_iters=1000", f"logging.log_dir={logs}", f"checkpoint.save={ckpt}",
                               "checkpoint.save_interval=3"])
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_for(out, "step      1 |", proc)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), out.read_text()[-3000:]
    finally:
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    assert not list(ckpt.glob("iter_*")), sorted(ckpt.iterdir())
    said = [(logs / f"rank-{r}.log").read_text() for r in range(2) if (logs / f"rank-{r}.log").exists()]
    assert any("the launcher died: stopped without a checkpoint" in text for text in said), said


def test_die_with_parent_ends_a_busy_child_when_its_parent_is_killed(tmp_path):
    """A grandchild spinning in pure Python (nothing would stop it) is gone once its parent is SIGKILLed."""
    marker = tmp_path / "pid"
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "from megatron_ext.resilience.process_guard import die_with_parent; "
                                  "import os; die_with_parent(); open({str(marker)!r}, 'w').write(str(os.getpid())); "
                                  "exec('while True: pass')"])
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(marker.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        parent.kill()


def _pdeathsig_after_worker_init(queue) -> None:
    from data_prep.preprocess import _init_worker

    _init_worker(str(ROOT / "data" / "tiny" / "tokenizer.model"), None, True)
    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    queue.put(value.value)


def test_data_prep_workers_ask_to_die_with_their_parent():
    queue = multiprocessing.get_context("fork").Queue()
    worker = multiprocessing.get_context("fork").Process(target=_pdeathsig_after_worker_init, args=(queue,))
    worker.start()
    worker.join(60)
    assert queue.get(timeout=5) == signal.SIGHUP


def test_report_failure_logs_the_traceback_and_says_it_once(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no job store: this process is the only one to say it
    try:
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/iter_0000004/__0_0.distcp")
    except OSError as exc:
        code = report_failure(exc, 3, "checkpoint save at iteration 4", tmp_path)
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("[rank 3, checkpoint save at iteration 4] I/O error: [Errno 28] No space")
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
    (ValueError("a bug"), "ValueError", EXIT_FAILED),
])
def test_each_error_says_its_kind_and_exits_with_its_code(exc, kind, code, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert report_failure(exc, 0, "start-up", tmp_path) == code
    assert capsys.readouterr().err.startswith(f"[rank 0, start-up] {kind}: {exc}")


def test_advice_carried_by_an_error_is_printed_on_its_own_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    report_failure(CheckpointError("ckpt/iter_0000004 is corrupt", advice="resume from iter_0000002"), 0,
                   "start-up", tmp_path)
    assert capsys.readouterr().err.splitlines()[:2] == ["[rank 0, start-up] checkpoint error: ckpt/iter_0000004 "
                                                        "is corrupt", "  → resume from iter_0000002"]


def test_out_of_memory_advice_names_stage_micro_batch_and_the_planner_estimate():
    cfg = load_config(TINY, ["data.mock=true", "model.vocab_size=32000"])
    advice = out_of_memory_advice(cfg, 1, 4, 80 * 2**30)
    assert advice.startswith("pipeline stage 1 of 2, micro batch size 4 × seq 256: the planner estimates ")
    assert "GiB peak for this stage, the GPU has 80.0 GiB" in advice and "--gpus 4" in advice


def test_loss_spike_detector_flags_a_jump_above_the_rolling_median():
    detector = LossSpikeDetector(factor=1.5, window=10)
    assert [detector.check(loss) for loss in [3.0, 2.9, 2.8, 2.9]] == [None, None, None, None]
    ratio, median = detector.check(6.0)
    assert median == pytest.approx(2.9) and ratio == pytest.approx(6.0 / 2.9)
    assert detector.check(3.0) is None and LossSpikeDetector(None, 10).check(100.0) is None


def test_straggler_detector_names_a_rank_slow_for_several_intervals_in_a_row():
    detector = StragglerDetector(factor=1.2, intervals=3)
    fast, slow = [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.5, 1.0]
    assert detector.update(slow) == [] and detector.update(slow) == [] and detector.update(slow) == [2]
    assert detector.update(fast) == [] and detector.update(slow) == []  # a fast interval resets the streak
    assert StragglerDetector(factor=1.2, intervals=1).update([1.0, 1.3]) == [1]


def test_run_logger_writes_loss_spikes_and_the_rank_spread_to_tensorboard(tmp_path, caplog):
    from megatron_ext.metrics.run_logger import RunLogger

    cfg = load_config(TINY, ["data.mock=true", "model.vocab_size=1000", f"logging.tensorboard_dir={tmp_path}"])
    logger = RunLogger(cfg, 1000, world_size=4, enabled=True)
    logger.step(3, 2.5, 1e-3, 1.0, 0.5, console=True, rank_times=[0.2, 0.3, 0.25, 0.2])
    with caplog.at_level("WARNING", logger="megatron_ext"):
        logger.loss_spike(4, 6.0, 2.4, 2.5, (48, 63))
    logger.close()
    assert read_scalars(tmp_path, "train/loss_spike") == {4: pytest.approx(2.4)}
    assert read_scalars(tmp_path, "perf/slowest_rank") == {3: 1.0}
    assert read_scalars(tmp_path, "perf/step_time_max_s") == {3: pytest.approx(0.3)}
    assert "loss spike at iteration 4: 6.0000 is 2.40× the median 2.5000" in caplog.text and "48..63" in caplog.text
