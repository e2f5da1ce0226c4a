"""What a restart changed and cost (megatron_ext/resilience/elastic.py), from the progress record rank 0 keeps."""

from __future__ import annotations

import itertools
import json

import pytest

from megatron_ext.checkpoint.layout import PROGRESS, progress_path
from megatron_ext.config.schema import load_config
from megatron_ext.errors import ConfigError
from megatron_ext.resilience.elastic import ProgressRecord
from recipes.launch import _elastic_worlds
from tests.launch import TINY


def test_a_restart_on_a_smaller_world_names_the_change_the_lost_steps_and_the_recovery_time(tmp_path, monkeypatch):
    import megatron_ext.resilience.elastic as elastic

    clock = itertools.chain([100.0, 100.4, 101.0], itertools.repeat(130.0))
    monkeypatch.setattr(elastic.time, "time", lambda: next(clock))
    before = ProgressRecord(progress_path(tmp_path), rank=0, world_size=4, data_parallel_size=2, num_microbatches=2)
    assert before.restart(0) is None  # a first start
    before.step_done(5)
    before.step_done(6)  # 0.4 s later: not written
    assert json.loads((tmp_path / PROGRESS).read_text())["iteration"] == 5
    before.step_done(7)  # then a node is lost; the last checkpoint is iteration 6
    after = ProgressRecord(progress_path(tmp_path), rank=0, world_size=2, data_parallel_size=1, num_microbatches=4)
    restart = after.restart(6)
    assert restart.lost_steps == 1
    startup = [("imports", 2.0), ("checkpoint load", 1.5)]  # this process, from its start at 115.0
    assert restart.describe(115.0, startup) == (
        "restart: world 4 → 2: DP 2 → 1, 2 → 4 micro batches per step, resumed at iteration 6, lost 1 step, "
        "recovered in 17.5 s from the last step before it: down until this process started 14.0 s, imports 2.0 s, "
        "checkpoint load 1.5 s")
    assert restart.scalars(115.0, startup) == {
        "elastic/world_size": 2.0, "elastic/data_parallel_size": 1.0, "elastic/lost_steps": 1.0,
        "elastic/recovery_s": 17.5, "elastic/down_before_start_s": 14.0}
    # under recipes.launch, the agent's times split what came before the process started
    monkeypatch.setenv(elastic.RESTART_DECIDED_AT, "104.0")
    monkeypatch.setenv(elastic.WORKERS_STOPPED_AT, "104.5")
    monkeypatch.setenv(elastic.RENDEZVOUS_DONE_AT, "114.0")
    assert dict(after.restart(6).parts(115.0, startup)) == {
        "until the agent restarted the workers": 3.0, "stopping the old ones": 0.5, "rendezvous": 9.5,
        "process start": 1.0, "imports": 2.0, "checkpoint load": 1.5}
    # a scale-up: the agent decides, then the old world takes its last step and checkpoints while it stops
    monkeypatch.setenv(elastic.RESTART_DECIDED_AT, "100.5")
    assert dict(after.restart(6).parts(115.0, [])) == {"stopping the old ones": 3.5, "rendezvous": 9.5,
                                                       "process start": 1.0}
    # an agent that joins at the scale-up: it started its workers (the first time) long before, stopped none
    monkeypatch.delenv(elastic.RESTART_DECIDED_AT)
    monkeypatch.setenv(elastic.WORKERS_STOPPED_AT, "60.0")
    assert dict(after.restart(6).parts(115.0, [])) == {"rendezvous": 13.0, "process start": 1.0}


def test_only_rank_0_writes_and_an_unreadable_record_is_no_restart(tmp_path):
    ProgressRecord(progress_path(tmp_path), rank=1, world_size=2, data_parallel_size=2,
                   num_microbatches=1).step_done(3)
    assert not (tmp_path / PROGRESS).exists()
    (tmp_path / PROGRESS).write_text("{torn")
    assert ProgressRecord(progress_path(tmp_path), 0, 2, 2, 1).restart(3) is None
    assert ProgressRecord(None, 0, 2, 2, 1).restart(0) is None  # no checkpoint.save: nothing recorded


def test_an_elastic_launch_says_what_each_node_count_trains_with_or_which_cannot():
    """Checked before any rank starts, for every node count of --nnodes MIN:MAX."""
    pp2 = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
           "train.global_batch_size=8", "train.micro_batch_size=2", "parallel.allow_idle_ranks=true"]
    said = _elastic_worlds(load_config(TINY, pp2), range(1, 4), 2)
    assert said == "elastic on 1-3 nodes × 2 processes: 1 → DP 1, 2 → DP 2, 3 → DP 2 (2 idle)"
    with pytest.raises(ConfigError, match=r"^with 1 node \(2 processes\) of --nnodes 1:2: world size"):
        _elastic_worlds(load_config(TINY, ["parallel.allow_idle_ranks=true"]), range(1, 3), 2)  # TP2 × PP2


def test_a_multi_node_launch_unshares_the_rendezvous_store_so_a_spare_can_join_a_later_round(monkeypatch, tmp_path):
    """torch 2.13 keeps a shared store's address from the first round: a hot spare at --nnodes N:N that takes a lost
    node's place then waits for an address nobody writes (seen: the round timed out). Any multi-node c10d launch
    unshares it; a one-node launch keeps torch's default."""
    import dataclasses
    import os

    import recipes.launch as launch

    seen = []
    real_agent = launch.agent
    monkeypatch.setattr(launch, "agent", lambda nvrx: dataclasses.replace(
        real_agent(nvrx), run=lambda args: seen.append(os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"))))
    recipe = ["--config", str(TINY), f"logging.log_dir={tmp_path}", "checkpoint.save=null"]
    for options, unshared in ((["--nnodes=2:2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29999",
                                "--rdzv-id=spare", "--nproc-per-node=2"], "1"), (["--standalone", "--nproc-per-node=4"], None)):
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
        assert launch.main([*options, *recipe]) == 0
        assert seen.pop() == unshared, options
