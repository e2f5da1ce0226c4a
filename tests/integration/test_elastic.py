"""Elastic training and hot spares on torchrun's agent (issues #27, #45), on CPU: agents of 2 processes each meet in
a c10d rendezvous on localhost and train TP1 × PP2 (DP2) on `--nnodes=1:2`, each agent a "node" of its own
(SLURMD_NODENAME). A third agent started once the world is full waits as a hot spare (torchrun's redundancy list).
`kill -9` of an active agent's whole process group: the spare takes its place at the next rendezvous and the run
resumes on the same world, so every step up to the next loss equals the uninterrupted run's exactly. Then the former
spare's "GPUs" go bad (tests/workers/faulty_step_worker.py: NaN on every run of every step from FAULTY_NODE_FROM):
the fault recurs when the step is re-run in place (train.rerun_mode=validate_results), the job saves the state
before the step and exits 16 (train.recurring_fault=rerun_elsewhere), and with no spare left that node's agent leaves
the job while the survivor resumes at DP1 and runs the step again, clean: that GPU was faulty. A fourth agent joins:
the job checkpoints at the next step boundary and goes on at DP2. Every step's loss and grad-norm equal the
uninterrupted run's within the parity matrix's bounds, the run ends at train.train_iters, and each world change is
said once."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from megatron_ext.checkpoint.layout import latest_iteration
from megatron_ext.errors import EXIT_RERUN_ELSEWHERE
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import (
    ROOT,
    SMALL_MODEL,
    max_relative_difference,
    pretrain_command,
    read_scalars,
    run_env,
    run_pretrain,
)

# rendezvous windows and a join timed against the training (make test runs it alone)
pytestmark = pytest.mark.serial

STEPS = 48
FAULTY_FROM = 18  # the spare's node goes bad here, a few checkpoints after it took b's place
JOIN_S = 5  # for the fourth agent's rendezvous join, after its config checks, while the DP1 world waits
PP2 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
       "parallel.sequence_parallel=false"]
# a low peak LR keeps 40 steps of different summation orders within the parity bounds
RUN = [*SMALL_MODEL, f"train.train_iters={STEPS}", "optimizer.lr=1e-4", "optimizer.min_lr=1e-5"]
RERUN_ELSEWHERE = ["train.rerun_mode=validate_results", "train.recurring_fault=rerun_elsewhere"]


def _agent(port: int, run_id: str, overrides: list[str], out: Path, node: str) -> subprocess.Popen:
    options = ("--nnodes=1:2", "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
               f"--rdzv-id={run_id}", "--monitor-interval=0.5",
               # dead peers found in 3 s (c10d keep-alives); a round waits 3 s for more members (b starts 1 s after a);
               # a hosts the rendezvous store, said explicitly as the SLURM template does: every agent here matches
               # localhost, and the first to get through its start-up checks would host it (losing it ends the job)
               "--rdzv-conf=last_call_timeout=3,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3,"
               f"is_host={int(node == 'a')}")
    cmd = pretrain_command(2, overrides, launcher="recipes.launch", launch_options=options)
    cmd.remove("--standalone")
    cmd[cmd.index("recipes.launch")] = "tests.workers.faulty_launch"  # recipes.launch, its ranks' faults injected
    env = run_env({"SLURMD_NODENAME": f"node-{node}", "FAULTY_NODE": "node-s", "FAULTY_NODE_FROM": str(FAULTY_FROM)})
    with open(out, "w") as sink:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(condition, what: str, *watched: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in watched), f"an agent ended while waiting for {what}"
        time.sleep(0.05)


def test_a_spare_replaces_a_lost_node_exactly_and_without_one_the_world_shrinks_and_grows_back(initial_weights,
                                                                                               tmp_path):
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    start = [*RUN, f"checkpoint.pretrained_checkpoint={initial_weights}"]  # the same weights as the reference
    overrides = [*start, *PP2, *RERUN_ELSEWHERE, f"checkpoint.save={ckpt}", "checkpoint.save_interval=2",
                 f"logging.tensorboard_dir={tb}", f"logging.log_dir={tmp_path / 'logs'}"]
    run_pretrain(4, [*start, *PP2, f"logging.tensorboard_dir={tmp_path / 'reference'}"])  # uninterrupted, DP2
    port, run_id = random.randint(20000, 60000), f"elastic-{os.getpid()}"
    out = {name: tmp_path / f"{name}.out" for name in "abcs"}
    agents = {"a": _agent(port, run_id, overrides, out["a"], "a")}
    time.sleep(1)
    agents["b"] = _agent(port, run_id, overrides, out["b"], "b")

    def said(text: str) -> bool:
        return any(text in path.read_text() for path in out.values() if path.exists())

    try:
        _wait(lambda: said("world=4 = "), "the first world", *agents.values())
        agents["s"] = _agent(port, run_id, overrides, out["s"], "s")  # the world is full: s waits as a spare
        # the tracker is the commit point (written after the manifest): a kill between the two resumes the one before
        _wait(lambda: (latest_iteration(ckpt) or 0) >= 6, "the checkpoint of step 6", *agents.values())
        os.killpg(agents["b"].pid, signal.SIGKILL)
        _wait(lambda: said("restart: same world (4 ranks, DP 2)"), "the spare's taking b's place", agents["a"],
              agents["s"])
        # the former spare's node goes bad at FAULTY_FROM; no spare is left: it leaves, the job goes on at DP1
        _wait(lambda: said("restart: world 4 → 2"), "a's restart at DP1", agents["a"])
        assert agents["s"].wait(timeout=60) == EXIT_RERUN_ELSEWHERE, out["s"].read_text()[-4000:]
        # a's ranks wait while c starts (its imports take seconds, more on a loaded machine) and joins the
        # rendezvous, so that c's join, not the end of training, comes first
        workers = psutil.Process(agents["a"].pid).children()
        for worker in workers:
            worker.suspend()
        try:
            agents["c"] = _agent(port, run_id, overrides, out["c"], "c")
            _wait(lambda: "elastic on" in out["c"].read_text(), "the fourth agent's start", agents["a"], agents["c"])
            time.sleep(JOIN_S)
        finally:
            for worker in workers:
                worker.resume()
        assert agents["a"].wait(timeout=180) == 0, out["a"].read_text()[-4000:]
        assert agents["c"].wait(timeout=60) == 0, out["c"].read_text()[-4000:]
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    # rank 0 of a world after a restart may be on any of its agents (the rendezvous orders them)
    log = "".join(out[name].read_text() for name in "asc")
    restarts = re.findall(r"restart: .*", log)
    # each node dies once a checkpoint is committed; a later one may be committed before the kill lands
    replaced = re.search(r"restart: same world \(4 ranks, DP 2\), resumed at iteration (\d+)", log)
    assert replaced and int(replaced[1]) >= 6, (restarts, log[-4000:])
    resumed = re.search(r"restart: world 4 → 2: DP 2 → 1, 2 → 4 micro batches per step, resumed at iteration (\d+)",
                        log)
    # the state before the faulty step was saved as its own checkpoint, where the job resumed on the good node
    assert int(replaced[1]) + 4 <= FAULTY_FROM - 1, (replaced[0], "the spare took over too late to run a few steps")
    assert resumed and int(resumed[1]) == FAULTY_FROM - 1 and (ckpt / f"iter_{FAULTY_FROM - 1:07d}").is_dir(), \
        (restarts, log[-4000:])
    # the ranks of node-s: the last stage's (its loss) or the first stage's (its gradients), as the rendezvous placed it
    suspects = r"rank \d's (loss|gradients) on node node-s, device 0"
    assert re.search(rf"node node-s left the job: iteration {FAULTY_FROM}'s fault recurred in place on its GPU "
                     rf"\({suspects}; {suspects}\); the job goes on without it", out["s"].read_text()), \
        out["s"].read_text()[-4000:]
    assert f"iteration {FAULTY_FROM}: the fault that recurred on " in log and "that GPU is faulty" in log, log[-4000:]
    assert "restart: world 2 → 4: DP 1 → 2, 4 → 2 micro batches per step" in log and "lost 0 steps" in log
    # where each recovery went, from the agent's times (recipes.launch) and the new processes' start-up; on the
    # scale-up the agent may decide before the old world's last step, and rank 0 may be on an agent that joined,
    # which stopped no workers
    stopped = r"until the agent restarted the workers [\d.]+ s, stopping the old ones [\d.]+ s, "
    joined = r"((until the agent restarted the workers [\d.]+ s, )?stopping the old ones [\d.]+ s, )?"
    assert len(restarts) == 3, restarts
    for restart, agent_parts in zip(restarts, (joined, stopped, joined)):
        print(restart)
        assert re.search(rf"from the last step before it: {agent_parts}rendezvous [\d.]+ s, process start [\d.]+ s, "
                         r"imports [\d.]+ s, .*checkpoint load [\d.]+ s, .*first step [\d.]+ s$", restart), restart
    # one summary: the worlds stopped for a node's joining do not print their own
    assert f"finished at iteration {STEPS}\n" in log and log.count("finished at iteration") == 1
    sizes = read_scalars(tb, "elastic/data_parallel_size")
    assert sorted(sizes.values()) == [1.0, 2.0, 2.0], sizes
    for tag, tolerance in TOLERANCE.items():
        measured, reference = read_scalars(tb, tag), read_scalars(tmp_path / "reference", tag)
        assert sorted(measured) == list(range(1, STEPS + 1))
        same_world = range(1, int(resumed[1]) + 1)  # a, b, then a and the spare: DP2 throughout
        assert {k: measured[k] for k in same_world} == {k: reference[k] for k in same_world}, tag
        diff = max_relative_difference(measured, reference)
        print(f"elastic {tag}: max rel diff {diff:.2e} against the uninterrupted run")
        assert diff <= tolerance, (tag, diff)
