"""Elastic training on torchrun's agent (issue #27), on CPU: two agents of 2 processes each meet in a c10d
rendezvous on localhost and train TP1 × PP2 (DP2). `kill -9` of one agent's whole process group: the other restarts
its workers, which resume at DP1 from the last checkpoint; a third agent joins: the job checkpoints at the next step
boundary and goes on at DP2. Every step's loss and grad-norm equal the single-process run's within the parity
matrix's bounds, the run ends at train.train_iters, and each world change is said once."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

from megatron_ext.checkpoint.layout import latest_iteration
from tests.integration.test_parallel_parity import TOLERANCE
from tests.launch import (
    ROOT,
    SINGLE_PROCESS,
    SMALL_MODEL,
    max_relative_difference,
    pretrain_command,
    read_scalars,
    run_env,
    run_pretrain,
)

STEPS = 40  # enough at DP1 (~150 ms a step) for the third agent to join before the end
PP2 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
       "parallel.sequence_parallel=false"]
# a low peak LR keeps 40 steps of different summation orders within the parity bounds
RUN = [*SMALL_MODEL, f"train.train_iters={STEPS}", "optimizer.lr=1e-4", "optimizer.min_lr=1e-5"]


def _agent(port: int, run_id: str, overrides: list[str], out: Path) -> subprocess.Popen:
    options = ("--nnodes=1:2", "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
               f"--rdzv-id={run_id}", "--monitor-interval=0.5",
               # dead peers found in 3 s (c10d keep-alives); a round waits 3 s for more members (b starts 1 s after a)
               "--rdzv-conf=last_call_timeout=3,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3")
    cmd = pretrain_command(2, overrides, launcher="recipes.launch", launch_options=options)
    cmd.remove("--standalone")
    with open(out, "w") as sink:
        return subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait(condition, what: str, *watched: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in watched), f"an agent ended while waiting for {what}"
        time.sleep(0.05)


def test_a_lost_node_and_its_return_change_dp_and_nothing_else(initial_weights, tmp_path):
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    start = [*RUN, f"checkpoint.pretrained_checkpoint={initial_weights}"]  # the same weights as the reference
    run_pretrain(1, [*start, *SINGLE_PROCESS, f"logging.tensorboard_dir={tmp_path / 'reference'}"])
    overrides = [*start, *PP2, f"checkpoint.save={ckpt}", "checkpoint.save_interval=2", f"logging.tensorboard_dir={tb}",
                 f"logging.log_dir={tmp_path / 'logs'}"]
    port, run_id = random.randint(20000, 60000), f"elastic-{os.getpid()}"
    out = {name: tmp_path / f"{name}.out" for name in "abc"}
    agents = {"a": _agent(port, run_id, overrides, out["a"])}
    time.sleep(1)  # a hosts the rendezvous (the first at the endpoint); losing it would end the job
    agents["b"] = _agent(port, run_id, overrides, out["b"])
    try:
        # the tracker is the commit point (written after the manifest): a kill between the two resumes the one before
        _wait(lambda: (latest_iteration(ckpt) or 0) >= 6, "the checkpoint of step 6", *agents.values())
        os.killpg(agents["b"].pid, signal.SIGKILL)
        _wait(lambda: "restart: world 4 → 2" in out["a"].read_text(), "a's restart at DP1", agents["a"])
        agents["c"] = _agent(port, run_id, overrides, out["c"])
        assert agents["a"].wait(timeout=180) == 0, out["a"].read_text()[-4000:]
        assert agents["c"].wait(timeout=60) == 0, out["c"].read_text()[-4000:]
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    # rank 0 of the world after the scale-up may be on either agent (the rendezvous orders them): a's log, then c's
    log = out["a"].read_text() + out["c"].read_text()
    restarts = re.findall(r"restart: world .*", log)
    # b dies once step 6's checkpoint is committed; a later one may be committed before the kill lands
    resumed = re.search(r"restart: world 4 → 2: DP 2 → 1, 2 → 4 micro batches per step, resumed at iteration (\d+)",
                        log)
    assert resumed and int(resumed[1]) >= 6 and (ckpt / f"iter_{int(resumed[1]):07d}").is_dir(), (restarts, log[-4000:])
    assert "restart: world 2 → 4: DP 1 → 2, 4 → 2 micro batches per step" in log and "lost 0 steps" in log
    # where each recovery went, from the agent's times (recipes.launch) and the new processes' start-up; on the
    # scale-up the agent may decide before the old world's last step, and rank 0 may be on the agent that joined,
    # which stopped no workers
    stopped = r"until the agent restarted the workers [\d.]+ s, stopping the old ones [\d.]+ s, "
    scaled_up = r"((until the agent restarted the workers [\d.]+ s, )?stopping the old ones [\d.]+ s, )?"
    for restart, agent_parts in zip(restarts, (stopped, scaled_up)):
        print(restart)
        assert re.search(rf"from the last step before it: {agent_parts}rendezvous [\d.]+ s, process start [\d.]+ s, "
                         r"imports [\d.]+ s, .*checkpoint load [\d.]+ s, .*first step [\d.]+ s$", restart), restart
    # one summary: the world stopped for the third node's joining does not print its own
    assert f"finished at iteration {STEPS}\n" in log and log.count("finished at iteration") == 1
    sizes = read_scalars(tb, "elastic/data_parallel_size")
    assert sorted(sizes.values()) == [1.0, 2.0], sizes
    for tag, tolerance in TOLERANCE.items():
        measured, reference = read_scalars(tb, tag), read_scalars(tmp_path / "reference", tag)
        assert sorted(measured) == list(range(1, STEPS + 1))
        diff = max_relative_difference(measured, reference)
        print(f"elastic {tag}: max rel diff {diff:.2e} against the single process")
        assert diff <= tolerance, (tag, diff)
