"""Failures in running jobs speak once and leave nothing running: divergence, hangs, a killed launcher, and
parent-death signals for ranks and data workers."""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from megatron_ext.checkpoint.layout import complete_iterations, latest_iteration
from megatron_ext.errors import EXIT_FAILED
from megatron_ext.resilience import flight_recorder
from megatron_ext.resilience.run_record import read_node_ends, verdict
from tests.launch import ROOT, SMALL_MODEL, free_ports, pretrain_command, read_scalars, run_env, run_pretrain


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


# Two processes (PP2) that train until the test stops them.
TWO_STAGES_UNTIL_STOPPED = [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
                            "train.train_iters=1000"]


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"{text!r} did not appear: {path.read_text()[-3000:]}")


def test_a_divergence_between_logging_steps_is_named_at_the_next_one_with_the_steps_before_it_recorded(tmp_path):
    """No skips allowed, one process, a log step every 8: the flags are read with the losses at step 8, which names
    the first non-finite iteration (2 at lr 1e4); step 1's loss reaches TensorBoard, nothing from 2 on does."""
    tb = tmp_path / "tb"
    proc = run_pretrain(1, [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1",
                            "parallel.pipeline_model_parallel_size=1", "parallel.sequence_parallel=false",
                            "train.train_iters=10", "optimizer.lr=1e4", "optimizer.lr_warmup_iters=0",
                            "logging.log_interval=8", f"logging.tensorboard_dir={tb}"], check=False)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "] divergence:" in line]
    assert len(said) == 1 and said[0].startswith("[rank 0, iteration 8] divergence: non-finite gradients at "
                                                 "iteration 2 with a finite loss"), proc.stderr
    assert list(read_scalars(tb, "train/lm_loss")) == [1]


def test_divergence_stops_at_its_step_once_naming_where_after_the_allowed_skips(tmp_path):
    """lr 1e4 on TP2×PP2 in fp32 (megatron-core's own check said "iteration -1", 252 lines per rank): one skipped
    step, then one line naming the iteration and pipeline stage, exit 3, not retried although torchrun may restart
    the workers twice; the per-rank compute spread is logged."""
    logs, tb = tmp_path / "logs", tmp_path / "tb"
    proc = run_pretrain(4, [*SMALL_MODEL, "train.train_iters=10", "optimizer.lr=1e4", "optimizer.lr_warmup_iters=0",
                            "train.skip_nonfinite_steps=1", f"logging.log_dir={logs}",
                            f"logging.tensorboard_dir={tb}"], launcher="recipes.launch", check=False,
                        launch_options=("--max-restarts=2",))
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "] divergence:" in line]
    assert len(said) == 1, proc.stderr
    step = int(re.search(r"non-finite \w+ at iteration (\d+)", said[0]).group(1))
    assert f"iteration {step}] divergence" in said[0] and "pipeline stage" in said[0] and "after skipping 1" in said[0]
    skips = [line for line in proc.stdout.splitlines() if "skipped: non-finite" in line]
    assert len(skips) == 1 and f"iteration {step - 1}" in skips[0], proc.stdout[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 4, proc.stderr
    assert re.search(r"training failed: rank \d on \S+ exited with code 3", proc.stderr)
    [node] = read_node_ends(logs)  # what a SLURM template reads: this node's rank failed by itself, exit 3
    assert (node.outcome, node.exit_code, node.failed_rank in range(4)) == ("failed", 3, True)
    assert verdict(logs)["ENDED"] == ""  # training did not end
    assert all("Traceback" in (logs / f"rank-{r}.log").read_text() for r in range(4))
    slowest = read_scalars(tb, "perf/slowest_rank")
    assert slowest and set(slowest.values()) <= {0.0, 1.0, 2.0, 3.0}
    assert all(read_scalars(tb, "perf/step_time_max_s")[s] >= read_scalars(tb, "perf/step_time_min_s")[s] > 0
               for s in slowest)
    assert "compute " in proc.stdout and "slowest rank" in proc.stdout


def _stop_a_rank(cmd: list[str], out: Path, rank: int, after_step: int, env: dict[str, str] | None = None,
                 before_stop: Callable[[], None] = lambda: None) -> tuple[subprocess.Popen, int, float]:
    """Launch `cmd` (output to `out`), SIGSTOP rank `rank` once step `after_step` is logged and `before_stop` has
    returned, and wait for the job to end: the launcher, the stopped rank's pid and the seconds from the stop to the
    end."""
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(env), stdout=sink, stderr=subprocess.STDOUT)
    stopped = None
    try:
        _wait_for(out, f"step {after_step:>6}/", proc)
        before_stop()
        stopped = _rank_pid(proc.pid, rank)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        proc.wait(timeout=60)
        return proc, stopped, time.monotonic() - start
    finally:
        proc.kill()
        if stopped is not None and _alive(stopped):  # a job that did not end leaves its stopped rank behind
            os.kill(stopped, signal.SIGKILL)


@pytest.mark.serial  # hang timeouts of seconds
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_hang_timeout(tmp_path):
    """SIGSTOP one of 4 ranks (a stuck GPU, a dead NIC): the others' watchdogs write their stacks, name it once,
    and the job is gone (exit 4, for SLURM to requeue) within the timeout plus a margin. The job is a node of a
    c10d rendezvous (--nnodes 1:1), as on a multi-node SLURM job, where rank 0 hosts the ranks' own store: the
    stopped rank is rank 0, and the heartbeats still reach the others through the agent's store. A hot spare waits
    beside the job: when the job ends it says it was not needed and exits 0 (torch's launcher failed it, and SLURM
    counted a failed task)."""
    logs, out, spare_out = tmp_path / "logs", tmp_path / "out.txt", tmp_path / "spare.txt"
    port = free_ports(1)[0]
    cmd = pretrain_command(4, [*SMALL_MODEL, "train.train_iters=1000", "train.hang_timeout_s=5",
                               f"logging.log_dir={logs}"], launcher="recipes.launch",
                           launch_options=("--nnodes=1:1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
                                           f"--rdzv-id=hang-{os.getpid()}"))
    cmd.remove("--standalone")
    spare: list[subprocess.Popen] = []

    def start_a_spare() -> None:  # once it has joined the rendezvous: the job is full, it waits in torch's list
        with open(spare_out, "w") as sink:
            spare.append(subprocess.Popen(cmd, cwd=ROOT, env=run_env({"SLURMD_NODENAME": "node-spare"}), stdout=sink,
                                          stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while not any(c.raddr and c.raddr.port == port for c in psutil.Process(spare[0].pid).net_connections()):
            assert time.monotonic() < deadline and spare[0].poll() is None, spare_out.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)

    try:
        proc, stopped, gone = _stop_a_rank(cmd, out, rank=0, after_step=2, env={"SLURMD_NODENAME": "node-a"},
                                           before_stop=start_a_spare)
        assert spare[0].wait(timeout=30) == 0, spare_out.read_text()[-3000:]
    finally:
        for process in spare:
            process.kill()
    text = out.read_text()
    assert proc.returncode == 4, text[-3000:]
    assert gone < 5 + 20 and not _alive(stopped), (gone, text[-3000:])
    assert text.count("] hang:") == 1 and "heartbeat stopped on rank 0 (host " in text and f"pid {stopped})" in text
    assert not re.search(r"heartbeat stopped on .*rank [123] ", text), text[-3000:]
    for rank in (1, 2, 3):
        stacks = (logs / f"rank-{rank}.log").read_text()
        assert "hang watchdog" in stacks and "(most recent call first)" in stacks and "training/trainer.py" in stacks
        # its flight recorder's dump: the collectives it ran, the last one still open (the stopped rank never joined)
        trace = pickle.loads((logs / f"{flight_recorder.PREFIX}{rank}").read_bytes())
        assert trace["entries"] and trace["entries"][-1]["state"] != "completed", trace["entries"][-1]
    assert f"fr_trace {logs} --prefix {flight_recorder.PREFIX}" in text
    # which of the job's two ways of ending reaches the spare first is a race (recipes.launch's agent module)
    assert re.search(r"^node node-spare was not needed: it waited as a hot spare until the (job|rendezvous host) "
                     r"ended", spare_out.read_text(), re.MULTILINE), spare_out.read_text()[-3000:]
    assert {node.node: node.outcome for node in read_node_ends(logs)} == {"node-a": "failed",
                                                                          "node-spare": "not needed"}


@pytest.mark.serial  # hang timeouts of seconds
def test_under_nvrx_a_stopped_rank_is_ended_by_the_rank_monitor_outside_it(tmp_path):
    """recipes.launch --nvrx (NVIDIA Resiliency Extension's ft_launcher), the hang watchdog off: rank 1 SIGSTOPped
    after step 3 stalls both pipeline stages; their rank monitors kill them once 3 s pass without a heartbeat, and
    the job ends with the one-line summary. Before the first heartbeat the timeout is 60 s: ending within 20 s shows
    the step boundaries reach the monitors as heartbeats."""
    out = tmp_path / "out.txt"
    cmd = pretrain_command(2, [*TWO_STAGES_UNTIL_STOPPED, "train.hang_timeout_s=null"], launcher="recipes.launch",
                           launch_options=("--nvrx", "--ft-initial-rank-heartbeat-timeout=60",
                                           "--ft-rank-heartbeat-timeout=3", "--ft-workload-check-interval=0.5"))
    proc, stopped, gone = _stop_a_rank(cmd, out, rank=1, after_step=3)
    text = out.read_text()
    assert gone < 20 and not _alive(stopped), (gone, text[-3000:])
    assert re.search(r"training failed: rank [01] on \S+ was killed by SIGKILL", text), text[-3000:]
    assert "Did not get subsequent heartbeat. Waited 3.00 seconds" in text
    # (NVRx's GPU health check logs NVML tracebacks on a machine without NVIDIA's driver: its own, harmless)
    assert proc.returncode == EXIT_FAILED and "SignalException" not in text, text[-3000:]


@pytest.mark.serial  # step times compared across ranks
def test_a_rank_slowed_on_purpose_is_named_and_nobody_else(tmp_path):
    """PP2 × DP2, rank 1 (stage 0) 150 ms slower in every forward pass: the loop's detector names it against its
    stage's other rank; the last stage, which always computes more, is not named, nor anybody else."""
    proc = run_pretrain(4, [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1",
                            "parallel.pipeline_model_parallel_size=2", "parallel.sequence_parallel=false",
                            "train.train_iters=10", "logging.log_interval=2", "logging.straggler_intervals=2"],
                        module="tests.workers.slowed_worker", env={"SLOW_RANK": "1", "SLOW_MS": "150"})
    named = [line for line in proc.stdout.splitlines() if "straggler:" in line]
    assert named and all("straggler: rank 1 on pipeline stage 0 computed" in line for line in named), proc.stdout
    assert "the median of its pipeline stage's other ranks" in named[0] and "that CPU's cores" in named[0]


@pytest.mark.serial  # processes gone within seconds
@pytest.mark.parametrize("signal_lost", [False, True], ids=["signalled", "signal_lost"])
def test_a_killed_launcher_leaves_no_rank_running_and_no_checkpoint(signal_lost, tmp_path):
    """kill -9 of torchrun (its ranks are in their own sessions, so nothing reached them before): every rank is
    gone within seconds, says why in its log, and no orphan completes the checkpoint due at step 3. With
    `signal_lost` the ranks never see the parent-death signal (blocked, as when its exception is raised inside a
    finalizer and dropped): the step boundary's check stops them before the next save. Each micro batch waits
    250 ms for its data (4 per step), so steps 2 and 3 take 2 s: the kill, at most 0.5 s after step 1 is logged,
    lands before the save is due."""
    logs, ckpt, out = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "out.txt"
    cmd = pretrain_command(2, [*TWO_STAGES_UNTIL_STOPPED, f"logging.log_dir={logs}", f"checkpoint.save={ckpt}",
                               "checkpoint.save_interval=3"], module="tests.workers.slowed_worker", launcher="torchrun")
    marker = {"TEST_PROCESS_TREE": str(tmp_path)}  # inherited by every process the run starts

    def run_processes() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["environ"]) if p.pid != proc.pid and
                (p.info["environ"] or {}).get("TEST_PROCESS_TREE") == marker["TEST_PROCESS_TREE"]]

    with open(out, "w") as sink:
        block = (lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})) if signal_lost else None
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**run_env({"SLOW_DATA_MS": "250"}), **marker}, stdout=sink,
                                stderr=subprocess.STDOUT, preexec_fn=block)
    try:
        _wait_for(out, "step      1/", proc)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), out.read_text()[-3000:]
        if not signal_lost:  # and the ranks' helpers (the checkpoint save's worker processes) with them
            _, alive = psutil.wait_procs(run_processes(), timeout=5)
            assert not alive, [p.cmdline()[:3] for p in alive]
    finally:
        # with SIGHUP blocked the helpers inherit the mask and cannot get their parent-death signal either
        for leftover in run_processes():
            leftover.kill()
    time.sleep(2)
    # Nothing a resume would use: no tracker, no complete (manifest-bearing) checkpoint.
    assert latest_iteration(ckpt) is None and complete_iterations(ckpt) == [], sorted(ckpt.rglob("*"))
    said = [(logs / f"rank-{r}.log").read_text() for r in range(2) if (logs / f"rank-{r}.log").exists()]
    assert any("the launcher died: stopped without a checkpoint" in text for text in said), said


@pytest.mark.serial  # processes gone within seconds
def test_die_with_parent_ends_a_busy_child_when_its_parent_is_killed(tmp_path):
    """A grandchild spinning in pure Python (nothing would stop it) is gone once its parent is SIGKILLed, also when it
    inherited SIGHUP ignored (a job started under nohup)."""
    marker = tmp_path / "pid"
    script = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "from megatron_ext.resilience.process_guard import die_with_parent; "
                                  "import os; die_with_parent(); open({str(marker)!r}, 'w').write(str(os.getpid())); "
                                  "exec('while True: pass')"])
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    child = None
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
        if child is not None and _alive(child):  # a spinning orphan would slow every test after this one
            os.kill(child, signal.SIGKILL)


@pytest.mark.serial  # processes gone within seconds
def test_the_checkpoint_save_helper_ends_with_a_rank_killed_by_sigkill():
    """The trainer starts dist_checkpointing's Manager process with die_with_parent: a rank that cannot unwind (the
    OOM killer, a native crash) does not leave it and its resource tracker running for good."""
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from megatron_ext.checkpoint.save_load import start_save_helpers
        from megatron_ext.resilience.process_guard import die_with_parent
        start_save_helpers(die_with_parent)
        print("started", flush=True)
        time.sleep(600)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "started\n"
        helpers = _children(rank.pid)
        assert helpers
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in helpers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in helpers)
    finally:
        rank.kill()


def _pdeathsig_after_worker_init(queue) -> None:
    from data_prep.preprocess import _init_worker

    _init_worker(str(ROOT / "data" / "tiny" / "tokenizer.model"), None, True, False)
    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    queue.put(value.value)


def test_data_prep_workers_ask_to_die_with_their_parent():
    queue = multiprocessing.get_context("fork").Queue()
    worker = multiprocessing.get_context("fork").Process(target=_pdeathsig_after_worker_init, args=(queue,))
    worker.start()
    worker.join(60)
    assert queue.get(timeout=5) == signal.SIGHUP




def test_a_skipped_nonfinite_step_or_spike_leaves_weights_optimizer_state_and_schedule_untouched(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "tests.workers.nonfinite_step_worker", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["skipped"] == [True, True] and result["spikes_skipped"] == 1 and result["next_step_finite"], result
    assert all(result["unchanged"].values()), result["unchanged"]


@pytest.mark.serial  # what the launch leaves in /tmp
def test_ctrl_c_to_the_launcher_checkpoints_and_says_where_to_resume(tmp_path):
    """Ctrl-C to recipes.launch alone (its ranks are in their own sessions): the ranks checkpoint at the next step
    boundary, the launcher ends with one line naming that checkpoint and exit 130, no traceback. The elastic
    agent's own files stay in the run's log directory (torch's agent would make a directory under /tmp)."""
    ckpt, out, logs = tmp_path / "ckpt", tmp_path / "out.txt", tmp_path / "logs"
    cmd = pretrain_command(2, [*TWO_STAGES_UNTIL_STOPPED, f"checkpoint.save={ckpt}", "checkpoint.save_interval=1000",
                               f"logging.log_dir={logs}"], launcher="recipes.launch")
    in_tmp = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    with open(out, "w") as sink:  # a suite started from a non-interactive shell inherits SIGINT ignored
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=sink, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(out, "step      2/", proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    text = out.read_text()
    stopped = re.search(r"stopped by SIGINT at iteration (\d+); checkpoint saved in (\S+); resume with the same "
                        r"command\n", text)
    assert proc.returncode == 130 and stopped and "Traceback" not in text and "SignalException" not in text, text
    iteration = int(stopped.group(1))
    assert iteration >= 2 and latest_iteration(ckpt) == iteration and iteration in complete_iterations(ckpt)
    assert f"stopped cleanly after iteration {iteration} (exit signal)" in text
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) == in_tmp and (logs / "agent").is_dir()
