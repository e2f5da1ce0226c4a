"""What a restart changed and cost (megatron_ext/resilience/elastic.py), from the progress record rank 0 keeps."""

from __future__ import annotations

import json

from megatron_ext.resilience.elastic import PROGRESS, ProgressRecord


def test_a_restart_on_a_smaller_world_names_the_change_the_lost_steps_and_the_recovery_time(tmp_path, monkeypatch):
    import megatron_ext.resilience.elastic as elastic

    clock = iter([100.0, 100.4, 101.0, 130.0])
    monkeypatch.setattr(elastic.time, "time", lambda: next(clock))
    before = ProgressRecord(str(tmp_path), rank=0, world_size=4, data_parallel_size=2, num_microbatches=2)
    assert before.restart(0) is None  # a first start
    before.step_done(5)
    before.step_done(6)  # 0.4 s later: not written
    assert json.loads((tmp_path / PROGRESS).read_text())["iteration"] == 5
    before.step_done(7)  # then a node is lost; the last checkpoint is iteration 6
    after = ProgressRecord(str(tmp_path), rank=0, world_size=2, data_parallel_size=1, num_microbatches=4)
    restart = after.restart(6)
    assert restart.lost_steps == 1
    assert restart.describe(118.5) == (
        "restart: world 4 → 2: DP 2 → 1, 2 → 4 micro batches per step, resumed at iteration 6, lost 1 step, "
        "recovered in 17.5 s (from the last step before the restart to the first one after it)")
    assert restart.scalars(118.5) == {"elastic/world_size": 2.0, "elastic/data_parallel_size": 1.0,
                                      "elastic/lost_steps": 1.0, "elastic/recovery_s": 17.5}


def test_only_rank_0_writes_and_an_unreadable_record_is_no_restart(tmp_path):
    ProgressRecord(str(tmp_path), rank=1, world_size=2, data_parallel_size=2, num_microbatches=1).step_done(3)
    assert not (tmp_path / PROGRESS).exists()
    (tmp_path / PROGRESS).write_text("{torn")
    assert ProgressRecord(str(tmp_path), 0, 2, 2, 1).restart(3) is None
    assert ProgressRecord(None, 0, 2, 2, 1).restart(0) is None  # no checkpoint.save: nothing recorded
