"""The sbatch templates in launch/slurm on a real SLURM: slurmctld and two slurmd ("node1", "node2")
on this machine, started for this module and stopped by PID at its end.

(1) the single-node template trains the tiny recipe with 2 processes and leaves TensorBoard events
and a checkpoint; (2) the multi-node template joins one torchrun per node in a c10d rendezvous and, elastic, goes
on without a lost node;
(3) SIGUSR1 to the batch script mid-run checkpoints, stops and requeues the job, and the requeued
attempt finishes with exactly the losses of the uninterrupted run (1); (4) a rank killed mid-run requeues the job
without its node, and the next attempt resumes the last checkpoint and finishes as (1) did.

Installs Debian's slurm-wlm and munge when they are missing (as root); skips only when they cannot
be installed, or when not running as root (slurmd launches jobs as their users).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_ext.checkpoint.layout import latest_iteration
from megatron_ext.resilience.run_record import verdict
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import ROOT, SMALL_MODEL, free_ports, max_relative_difference, read_scalars

# one local SLURM cluster, and the processes its jobs leave (make test runs it alone)
pytestmark = pytest.mark.serial

STEPS = 16
SAVE_INTERVAL = 5  # a periodic checkpoint before the signal, as in any real run
SIGNAL_AFTER = 6  # the step whose log line triggers the signal
GLOBAL_BATCH = 8  # SMALL_MODEL's train.global_batch_size
# 2 processes: TP1 × PP2 on one node, or one pipeline stage on each of the two nodes.
RECIPE = [*SMALL_MODEL, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
          "parallel.sequence_parallel=false", f"train.train_iters={STEPS}",
          f"checkpoint.save_interval={SAVE_INTERVAL}"]
JOB_TIMEOUT = 240  # seconds; a job takes 20-60 s here

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "squeue", "sinfo")


def _which(name: str) -> str | None:
    """Daemons live in /usr/sbin, which is not on every PATH."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _unavailable(reason: str) -> None:
    """Skip locally (with the reason, `-rs`); fail where the suite must prove SLURM (CI sets REQUIRE_SLURM=1)."""
    if os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


def _ensure_slurm_installed() -> None:
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if _which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        _unavailable(f"SLURM test cluster: {', '.join(missing)} missing and cannot be installed here "
                    f"(needs root and apt-get: apt-get install {' '.join(PACKAGES)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:  # stale or absent package lists
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=900)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if _which(tool) is None]
    if proc.returncode != 0 or missing:
        _unavailable(f"SLURM test cluster: `{' '.join(install)}` failed (exit {proc.returncode}), "
                    f"missing {missing}: {proc.stderr.strip()[-500:]}")


class SlurmCluster:
    """munged, slurmctld and one slurmd per node, all in `root`, on free ports; clients via SLURM_CONF."""

    NODES = ("node1", "node2")

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.processes: dict[str, subprocess.Popen] = {}
        # A SLURM job running this test suite must not leak its own job into ours.
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env = {**clean, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        r = self.root
        ctld_port, slurmd_port, *node_ports = free_ports(2 + len(self.NODES))
        (r / "state").mkdir()
        nodes = "\n".join(
            # CPUs above the machine's real count: SlurmdParameters=config_overrides accepts them,
            # so 2 single-CPU tasks (or one 2-CPU task) fit on each node of a small machine.
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=4 RealMemory=4000"
            for name, port in zip(self.NODES, node_ports))
        self.conf.write_text(f"""\
ClusterName=rehearsal
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long (default 120 s) before it may start again.
AuthInfo=socket={r}/munge.socket,cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool.%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
# Schedule every second rather than every minute: a requeued job starts again within seconds.
SchedulerParameters=sched_interval=1
JobRequeue=1
MinJobAge=4
ReturnToService=2
KillWait=15
InactiveLimit=0
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
{nodes}
PartitionName=debug Nodes={','.join(self.NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)

    def _start(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / f"{name}.out", "w")
        self.processes[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=self.root, start_new_session=True)

    def start(self) -> None:
        r = self.root
        self.write_config()
        # --force: munged otherwise insists that every directory above its socket be world-executable,
        # and pytest's temporary directories are private.
        self._start("munged", [_which("munged"), "--foreground", "--force", f"--socket={r}/munge.socket",
                               f"--key-file={r}/munge.key", f"--pid-file={r}/munged.pid",
                               f"--log-file={r}/munged.log", f"--seed-file={r}/munged.seed"])
        self._wait_for(lambda: (r / "munge.socket").exists(), 30, "munged did not create its socket")
        self._start("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        for node in self.NODES:
            self._start(f"slurmd-{node}", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", node])

        def nodes_idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            return dict(zip(out[::2], out[1::2])) == {node: "idle" for node in self.NODES}

        self._wait_for(nodes_idle, 60, "the nodes did not come up idle")

    def _wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [name for name, p in self.processes.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test cluster: {what} (exited: {dead})\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def run(self, *cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              timeout=60, **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()

    def stop(self) -> None:
        # Jobs first (their slurmstepd and training processes are not children of slurmd), then
        # the daemons, each by the PID we started it with.
        if self.jobs():
            self.run("scancel", *self.jobs(), check=False)
            deadline = time.monotonic() + 60
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(1)
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _ensure_slurm_installed()
    if os.geteuid() != 0:
        _unavailable("SLURM test cluster: slurmd launches jobs as their user, so it must run as root")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _head_and_tail(text: str, chars: int = 3000) -> str:
    """A log for an assertion message: its start says how the run was set up, its end how it finished."""
    return text if len(text) <= 2 * chars else f"{text[:chars]}\n[...]\n{text[-chars:]}"


class Job:
    """One sbatch of a template with a recipe, and where it writes."""

    def __init__(self, cluster: SlurmCluster, workdir: Path, template: str, nproc_per_node: int,
                 sbatch_args: list[str], overrides: list[str], knobs: dict[str, str] | None = None):
        self.cluster, self.workdir = cluster, workdir
        self.run_dir = workdir / "run"
        env = {**cluster.env, "CONFIG": "configs/tiny.yaml", "NPROC_PER_NODE": str(nproc_per_node),
               "RUN_DIR": str(self.run_dir), "PYTHON": sys.executable,
               # megatron-core's dataset index cache next to the job, not inside the repository's data/
               "OVERRIDES": " ".join([f"data.path_to_cache={workdir / 'dataset_cache'}", *overrides]),
               "PYTHONWARNINGS": "ignore", **(knobs or {})}
        proc = cluster.run("sbatch", "--parsable", "--gpus-per-node=0", f"--output={workdir}/batch-%j.out",
                           *sbatch_args, f"launch/slurm/{template}", cwd=ROOT, env=env)
        self.id = proc.stdout.strip().split(";")[0]

    def log(self, attempt: int = 0) -> Path:
        return self.run_dir / "logs" / f"job-{self.id}.{attempt}.log"

    def text(self, path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def batch_output(self) -> str:
        return self.text(self.workdir / f"batch-{self.id}.out")

    def debug(self) -> str:
        logs = "\n".join(f"--- {path}\n{_head_and_tail(self.text(path))}"
                         for path in sorted((self.run_dir / "logs").rglob("*")) if path.is_file())
        return f"--- batch output\n{self.batch_output}\n{logs}\n{self.cluster.logs()}"

    def wait_for_log(self, pattern: str, timeout: float = JOB_TIMEOUT, attempt: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text(self.log(attempt))):
            if time.monotonic() > deadline or self.id not in self.cluster.jobs():
                raise AssertionError(f"job {self.id}: no {pattern!r} in its log\n{self.debug()}")
            time.sleep(0.2)

    def wait(self, timeout: float = JOB_TIMEOUT) -> None:
        """Until the job has left the queue (completed, failed or cancelled; MinJobAge=4)."""
        deadline = time.monotonic() + timeout
        while self.id in self.cluster.jobs():
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id} still queued after {timeout} s\n{self.debug()}")
            time.sleep(1)


@pytest.fixture(scope="module")
def single_node_job(cluster, tmp_path_factory) -> Job:
    """The uninterrupted run: single-node template, one torchrun of 2 processes (TP1 × PP2)."""
    job = Job(cluster, tmp_path_factory.mktemp("single"), "pretrain_single_node.sbatch", 2,
              ["--cpus-per-task=2"], RECIPE)
    job.wait()
    return job


def test_single_node_template_trains_the_tiny_recipe_on_cpu(single_node_job):
    job = single_node_job
    assert "training finished" in job.batch_output, job.debug()
    log = job.text(job.log())
    assert "1 node(s) x 2 process(es)" in job.batch_output
    assert "world=2 = TP1 × CP1 × DP1 × PP2" in log, job.debug()
    assert f"finished at iteration {STEPS}" in log
    ckpt = job.run_dir / "checkpoints"
    assert latest_iteration(ckpt) == STEPS and (ckpt / f"iter_{STEPS:07d}").is_dir()
    assert sorted(read_scalars(job.run_dir / "tensorboard", "train/lm_loss")) == list(range(1, STEPS + 1))


def test_multi_node_template_goes_on_without_a_lost_node_when_elastic(cluster, single_node_job, tmp_path):
    """ELASTIC_MIN_NODES=1, 2 nodes × 2 processes: the torchruns meet in a rendezvous (world 4 = TP1 × PP2 × DP2
    across the nodes). node2's processes are killed after step 6 (a lost node): node1's agent restarts its workers,
    which resume at DP1 from the last committed checkpoint and finish the run; the job ends done, not requeued. The steps
    before the loss are the single-node run's within the parity bounds (test_elastic.py checks the rest)."""
    job = Job(cluster, tmp_path, "pretrain_multi_node.sbatch", 2, ["--nodes=2", "--cpus-per-task=2", "--no-kill"],
              RECIPE, {"ELASTIC_MIN_NODES": "1",
                       "RDZV_CONF": "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"})
    # a round waits 3 s for more nodes; a node2 later than that joins at a restart of node1's world 2 (as on a
    # loaded CI machine): the loss comes once both are in, at step 6 or later
    job.wait_for_log(rf"world=4 = [\s\S]*step +(?:[{SIGNAL_AFTER}-9]|1\d)/")
    lost = [proc for proc in psutil.process_iter(["name", "environ"])  # all of the job's processes there
            if (proc.info["environ"] or {}).get("SLURMD_NODENAME") == "node2"
            and proc.info["environ"].get("SLURM_JOB_ID") == job.id and proc.info["name"] != "slurmstepd"]
    assert lost, job.debug()
    for proc in lost:
        proc.kill()
    job.wait()

    log = job.text(job.log())
    assert "2 node(s) x 2 process(es), elastic down to 1 node(s)" in job.batch_output, job.debug()
    assert "elastic on 1-2 nodes × 2 processes: 1 → DP 1, 2 → DP 2" in log, job.debug()
    assert "world=4 = TP1 × CP1 × DP2 × PP2" in log and "world=2 = TP1 × CP1 × DP1 × PP2" in log, job.debug()
    resumed = re.search(r"restart: world 4 → 2: DP 2 → 1, 2 → 4 micro batches per step, resumed at iteration "
                        r"(\d+), lost \d+ steps?", log)
    assert resumed and int(resumed[1]) % SAVE_INTERVAL == 0 and int(resumed[1]) >= SAVE_INTERVAL, job.debug()
    assert "training finished on the nodes left" in job.batch_output and "requeue" not in job.batch_output, \
        job.debug()
    assert latest_iteration(job.run_dir / "checkpoints") == STEPS
    elastic = read_scalars(job.run_dir / "tensorboard", "train/lm_loss")
    one_node = read_scalars(single_node_job.run_dir / "tensorboard", "train/lm_loss")
    assert sorted(elastic) == list(range(1, STEPS + 1))
    before = range(1, SAVE_INTERVAL + 1)
    assert max_relative_difference({s: elastic[s] for s in before}, {s: one_node[s] for s in before}) <= \
        TOLERANCE["train/lm_loss"]


def _training_rank(job: Job, rank: int) -> psutil.Process:
    """The rank's process: the oldest with its command line and RANK, not the checkpoint save helper it forked (which
    inherits both, and whose pid is the lower one after the pids wrap, at 32768 on this VM)."""
    found = [proc for proc in psutil.process_iter(["cmdline", "environ", "create_time"])
             if "recipes.pretrain" in " ".join(proc.info["cmdline"] or []) and str(job.run_dir) in
             " ".join(proc.info["cmdline"] or []) and (proc.info["environ"] or {}).get("RANK") == str(rank)]
    if not found:
        raise AssertionError(f"job {job.id}: no training rank {rank} running\n{job.debug()}")
    return min(found, key=lambda proc: (proc.info["create_time"], proc.pid))


def test_a_crash_then_a_preemption_requeue_and_the_run_finishes_exactly(cluster, single_node_job, tmp_path):
    """One job, three attempts. Rank 0 crashes in native code (SIGSEGV, as a driver or kernel fault would) after
    step 6: its log holds its Python stack, and the job is requeued without node1. The attempt on node2 takes over
    the dead run's lock and resumes the step-5 checkpoint; a pre-emption warning (what `#SBATCH
    --signal=B:USR1@600` sends before the time limit) then makes it checkpoint, stop and requeue (a planned requeue:
    still on node2, node1 stays excluded). The last attempt resumes where that one stopped, no sample lost or
    repeated, and the run ends with the uninterrupted run's losses, bit for bit. (The requeue policy's other cases
    are tests/unit/test_slurm_policy.py's.)"""
    job = Job(cluster, tmp_path, "pretrain_single_node.sbatch", 2, ["--cpus-per-task=2"], RECIPE)
    job.wait_for_log(rf"step +{SIGNAL_AFTER}/")
    _training_rank(job, 0).send_signal(signal.SIGSEGV)
    job.wait_for_log(rf"step +(?:{SAVE_INTERVAL + 3}|{SAVE_INTERVAL + 4}|1[0-5])/", attempt=1)
    cluster.run("scancel", "--batch", "--signal=USR1", job.id)
    job.wait()

    crashed, preempted, last = (job.text(job.log(attempt)) for attempt in range(3))
    said = re.search(r"training failed: rank 0 on node1 was killed by SIGSEGV .*; its log: (\S+)", crashed)
    assert said, job.debug()
    stack = Path(said.group(1)).read_text()
    assert "Fatal Python error: Segmentation fault" in stack and "(most recent call first)" in stack, stack
    assert "a rank failed on node1; requeueing (failure requeue 1 of 3) without node1" in job.batch_output, \
        job.debug()
    ckpt = job.run_dir / "checkpoints"
    assert "restart 1 on node2" in job.batch_output and "took over" in preempted, job.debug()
    assert f"resumed from {ckpt} at iteration {SAVE_INTERVAL}" in preempted, job.debug()
    stopped = re.search(r"stopped cleanly after iteration (\d+) \(exit signal\)", preempted)
    assert stopped, job.debug()
    stop = int(stopped.group(1))
    assert SAVE_INTERVAL < stop < STEPS, f"the signal came too late to test a resume: {stop}\n{job.debug()}"
    assert "restart 2 on node2" in job.batch_output and "failure requeue 2" not in job.batch_output, job.debug()
    assert f"resumed from {ckpt} at iteration {stop} ({stop * GLOBAL_BATCH} samples consumed)" in last, job.debug()
    assert re.findall(r"step +(\d+)/", last)[0] == str(stop + 1)
    assert f"finished at iteration {STEPS}" in last and "training finished" in job.batch_output
    assert verdict(job.run_dir / "logs") == {"ENDED": "finished", "ITERATION": str(STEPS), "FAILED_NODES": "", "SUSPECT_NODES": ""}
    assert (ckpt / f"iter_{stop:07d}").is_dir() and latest_iteration(ckpt) == STEPS
    for tag in ("train/lm_loss", "train/grad_norm", "train/lr"):
        resumed = read_scalars(job.run_dir / "tensorboard", tag)
        uninterrupted = read_scalars(single_node_job.run_dir / "tensorboard", tag)
        assert resumed == uninterrupted, (tag, resumed, uninterrupted)


def test_two_job_steps_of_one_allocation_never_share_a_checkpoint_directory(cluster, tmp_path):
    """Two srun steps of one sbatch allocation (the same SLURM job id) start on one checkpoint.save together: one
    trains, the other stops at start-up with the one line naming the holder (exit 2)."""
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, "-m", "recipes.pretrain", "--config", "configs/tiny.yaml", *SMALL_MODEL,
               "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
               "parallel.sequence_parallel=false", "train.train_iters=30", f"checkpoint.save={ckpt}",
               "logging.tensorboard_dir=null", f"data.path_to_cache={tmp_path / 'dataset_cache'}"]
    steps = "\n".join(
        f"(srun --ntasks=1 --cpus-per-task=1 --exact --output={tmp_path}/step-{i}.out --error={tmp_path}/step-{i}.err "
        f"{' '.join(command)} logging.log_dir={tmp_path}/logs-{i}; echo $? > {tmp_path}/step-{i}.rc) &"
        for i in range(2))
    script = tmp_path / "two_steps.sbatch"
    script.write_text(f"#!/bin/bash\ncd {ROOT}\nexport OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore\n{steps}\nwait\n")
    job_id = cluster.run("sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--cpus-per-task=1",
                         "--gpus-per-node=0", f"--output={tmp_path}/batch.out", str(script), cwd=ROOT
                         ).stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    while job_id in cluster.jobs() and time.monotonic() < deadline:
        time.sleep(1)
    codes = [(tmp_path / f"step-{i}.rc").read_text().strip() if (tmp_path / f"step-{i}.rc").exists() else None
             for i in range(2)]
    outputs = [(tmp_path / f"step-{i}.err").read_text(errors="replace") for i in range(2)]
    assert sorted(codes) == ["0", "2"], (codes, outputs, (tmp_path / "batch.out").read_text(), cluster.logs())
    refused = outputs[codes.index("2")]
    lines = [line for line in refused.splitlines() if "checkpoint error" in line]
    assert len(lines) == 1 and f"checkpoint.save={ckpt} is in use by another run (pid " in lines[0], refused
    assert latest_iteration(ckpt) == 30


def test_a_missing_cluster_fails_where_slurm_is_required(monkeypatch):
    monkeypatch.setenv("REQUIRE_SLURM", "1")
    with pytest.raises(pytest.fail.Exception, match="REQUIRE_SLURM=1 but no slurmd"):
        _unavailable("no slurmd")
    monkeypatch.delenv("REQUIRE_SLURM")
    with pytest.raises(pytest.skip.Exception, match="no slurmd"):
        _unavailable("no slurmd")
