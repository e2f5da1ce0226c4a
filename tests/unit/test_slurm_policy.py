"""The SLURM templates' requeue policy (launch/slurm/common.sh `slurm_pretrain`), in plain bash with stand-ins for
`srun`, `scontrol` and `scancel`: the step's exit code and run records decide. At most MAX_REQUEUES failure
requeues; none after exit 2, 3 or 6; a hang requeues (without excluding a node); failed nodes are excluded and the
exclusions add up across requeues; a fault that recurred in place (exit 16) requeues without the nodes it names; a
signal stop requeues and is not counted. (The cluster tests,
tests/integration/test_slurm.py, run one failure and one signal requeue on a real SLURM.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.errors import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_RERUN_ELSEWHERE,
    EXIT_STORAGE,
    EXIT_USER_ERROR,
)
from tests.launch import ROOT

# srun: ends as $STEP_EXIT after writing the records $STEP_TRAINING (training.json) and $STEP_FAILED_NODE
# (that node's launcher record, a rank failed there) would say
SRUN = """#!/bin/bash
for a in "$@"; do case $a in logging.log_dir=*) logs=${a#logging.log_dir=} ;; esac; done
mkdir -p "$logs/run-result"
[[ -n ${STEP_TRAINING:-} ]] && echo "$STEP_TRAINING" > "$logs/run-result/training.json"
[[ -n ${STEP_FAILED_NODE:-} ]] &&
    echo "{\\"node\\": \\"$STEP_FAILED_NODE\\", \\"outcome\\": \\"failed\\", \\"exit_code\\": $STEP_EXIT, \\"failed_rank\\": 3}" \\
        > "$logs/run-result/node-$STEP_FAILED_NODE.json"
exit "$STEP_EXIT"
"""
# scontrol: remembers the job's excluded nodes in $SCONTROL_STATE and logs every call
SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$CALLS"
case $1 in
    show) echo "JobId=$SLURM_JOB_ID ExcNodeList=$(cat "$SCONTROL_STATE" 2>/dev/null || echo '(null)')" ;;
    update) for a in "$@"; do case $a in ExcNodeList=*) echo "${a#ExcNodeList=}" > "$SCONTROL_STATE" ;; esac; done ;;
esac
"""


@pytest.fixture
def job(tmp_path: Path):
    """Runs one attempt of the job (`slurm_pretrain` on the tiny recipe) with the step ending as told; returns
    (exit code, what it logged, the scontrol calls of this attempt)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", "#!/bin/bash\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node[1-2]", "NPROC_PER_NODE": "2", "CONFIG": "configs/tiny.yaml",
           "RUN_DIR": str(tmp_path / "run"), "PYTHON": sys.executable, "RDZV_HOST": "node1", "CALLS": str(calls),
           "SCONTROL_STATE": str(tmp_path / "excluded")}
    for knob in ("MAX_REQUEUES", "REQUEUE_ON_FAILURE", "REQUEUE_ON_HANG", "REQUEUE_ON_SIGNAL", "EXCLUDE_FAILED_NODES",
                 "CONTAINER_IMAGE", "ELASTIC_MIN_NODES", "SPARE_NODES"):
        env.pop(knob, None)

    def attempt(exit_code: int, failed_node: str = "", training: dict | None = None,
                **knobs: str) -> tuple[int, str, list[str]]:
        calls.write_text("")
        step = {"STEP_EXIT": str(exit_code), "STEP_FAILED_NODE": failed_node,
                "STEP_TRAINING": json.dumps(training) if training else ""}
        done = subprocess.run(["bash", "-c", "source launch/slurm/common.sh; slurm_pretrain"], cwd=ROOT,
                              env={**env, **step, **knobs}, capture_output=True, text=True, timeout=60)
        return done.returncode, done.stdout + done.stderr, calls.read_text().splitlines()

    attempt.excluded = lambda: (tmp_path / "excluded").read_text().strip()
    return attempt


REQUEUED = ["scontrol requeuehold 77", "scontrol release 77"]


def test_failures_requeue_without_their_nodes_until_max_requeues(job):
    code, _, calls = job(EXIT_FAILED, failed_node="node2", MAX_REQUEUES="2")
    assert code == 0 and calls[0] == REQUEUED[0] and calls[-1] == REQUEUED[1]
    assert "scontrol update JobId=77 ExcNodeList=node2" in calls
    code, said, calls = job(EXIT_FAILED, failed_node="node1", MAX_REQUEUES="2")
    assert code == 0 and "failure requeue 2 of 2" in said
    assert job.excluded() == "node2,node1"  # the exclusions add up across requeues
    code, said, calls = job(EXIT_FAILED, failed_node="node3", MAX_REQUEUES="2")
    assert code == EXIT_FAILED and calls == [] and "not requeueing: MAX_REQUEUES=2" in said


@pytest.mark.parametrize("code", [EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_STORAGE])
def test_no_requeue_after_what_needs_a_person(job, code):
    ended, said, calls = job(code, failed_node="node1")
    assert ended == code and calls == [] and f"not requeueing: exit {code}" in said


def test_a_hang_requeues_without_excluding_a_node_and_counts(job):
    code, said, calls = job(EXIT_HUNG, MAX_REQUEUES="1")
    assert code == 0 and calls == REQUEUED and "hang watchdog" in said
    code, _, calls = job(EXIT_HUNG, MAX_REQUEUES="1")
    assert code == EXIT_HUNG and calls == []


def test_a_fault_that_recurred_in_place_requeues_without_the_suspect_nodes_not_those_that_followed(job):
    """Every rank exits 16 (a collective decision), so every node's launcher says "failed": the training record's
    suspect nodes are the ones left out."""
    recurred = {"ended": "rerun elsewhere", "iteration": 12, "suspect_nodes": ["node2"]}
    code, said, calls = job(EXIT_RERUN_ELSEWHERE, failed_node="node1", training=recurred, MAX_REQUEUES="1")
    assert code == 0 and calls[0] == REQUEUED[0] and calls[-1] == REQUEUED[1], said
    assert "iteration 13's fault recurred when re-run on node2" in said and job.excluded() == "node2"
    assert job(EXIT_RERUN_ELSEWHERE, training=recurred, MAX_REQUEUES="1")[::2] == (EXIT_RERUN_ELSEWHERE, [])


def test_signal_stops_requeue_and_are_not_counted(job):
    signal_stop = {"ended": "exit signal", "iteration": 40}
    assert job(EXIT_FAILED, failed_node="node2", MAX_REQUEUES="1")[0] == 0  # the one failure requeue allowed
    for _ in range(3):
        code, said, calls = job(0, training=signal_stop, MAX_REQUEUES="1")
        assert code == 0 and calls == REQUEUED and "stopped early on a signal after iteration 40" in said
    assert job(EXIT_FAILED, failed_node="node2", MAX_REQUEUES="1")[0] == EXIT_FAILED  # the cap still holds


def test_the_knobs_turn_requeues_off(job):
    assert job(EXIT_FAILED, failed_node="node2", REQUEUE_ON_FAILURE="0")[::2] == (EXIT_FAILED, [])
    assert job(EXIT_HUNG, REQUEUE_ON_HANG="0")[::2] == (EXIT_HUNG, [])
    assert job(0, training={"ended": "exit signal", "iteration": 5}, REQUEUE_ON_SIGNAL="0")[::2] == (0, [])
    code, _, calls = job(EXIT_FAILED, failed_node="node2", EXCLUDE_FAILED_NODES="0")
    assert code == 0 and calls == REQUEUED  # requeued, no node left out


def test_a_finished_run_is_not_requeued(job):
    assert job(0, training={"ended": "finished", "iteration": 100})[::2] == (0, [])


@pytest.mark.parametrize("knobs, nodes, restarts", [
    ({}, "3:3", "0"),  # a lost node ends the step; the job is requeued
    ({"SPARE_NODES": "1"}, "2:2", "3"),  # the third node's agent waits to replace a lost one
    ({"SPARE_NODES": "1", "ELASTIC_MIN_NODES": "1"}, "1:2", "3"),  # then shrinks once no spare is left
    ({"ELASTIC_MIN_NODES": "2"}, "2:3", "3"),
])
def test_each_nodes_torchrun_admits_the_training_nodes_and_the_spares_wait(tmp_path, knobs, nodes, restarts):
    """launch/slurm/torchrun_node.sh on node 2 of a 3-node step: the rendezvous admits the nodes that train (the
    spares' agents wait in torchrun's redundancy list), and restarts are allowed where a node may be replaced."""
    python = tmp_path / "python"
    python.write_text('#!/bin/bash\necho "$@"\n')
    python.chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if key not in ("SPARE_NODES", "ELASTIC_MIN_NODES", "MAX_RESTARTS")}
    env.update(PYTHON=str(python), NPROC_PER_NODE="2", SLURM_STEP_NUM_NODES="3", SLURM_NODEID="1",
               RDZV_ENDPOINT="node1:29500", **knobs)
    done = subprocess.run(["bash", "launch/slurm/torchrun_node.sh", "--config", "configs/tiny.yaml"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    args = done.stdout.split()
    assert done.returncode == 0 and args[:2] == ["-m", "recipes.launch"], done.stdout + done.stderr
    assert (args[args.index("--nnodes") + 1], args[args.index("--max-restarts") + 1]) == (nodes, restarts)


def test_spares_that_leave_no_node_to_train_on_are_refused(job):
    code, said, calls = job(0, SPARE_NODES="2")
    assert code == EXIT_USER_ERROR and "SPARE_NODES=2 leaves no node to train on (the job has 2)" in said
    assert calls == []
    code, said, _ = job(0, SPARE_NODES="1")
    assert code == 0 and "2 node(s) x 2 process(es), 1 of them hot spares" in said, said
