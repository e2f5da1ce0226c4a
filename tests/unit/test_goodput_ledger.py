"""The goodput ledger: each second in one bucket, steps productive only the first time an iteration is reached, the
time between two starts counted as down, and the record that carries it across restarts checked when read."""

from __future__ import annotations

import json

import pytest

from megatron_ext.checkpoint.layout import GOODPUT
from megatron_ext.metrics import goodput_ledger
from megatron_ext.metrics.goodput_ledger import BUCKETS, GoodputLedger, Ledger


class Clock:
    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch) -> Clock:
    fake = Clock(1000.0)
    monkeypatch.setattr(goodput_ledger.time, "time", fake.time)
    return fake


def _attempt(root, clock: Clock, start: float, steps: range) -> GoodputLedger:
    """An attempt started at `start` that takes 5 s to start up, then 2 s per step of `steps`."""
    clock.now = start + 5
    ledger = GoodputLedger(root, process_start=start, writer=True)
    ledger.spent("startup")
    for iteration in steps:
        clock.now += 2
        ledger.step_done(iteration)
    return ledger


def test_a_restart_counts_the_time_between_starts_as_down_and_redone_steps_as_recomputed(tmp_path, clock):
    first = _attempt(tmp_path, clock, 1000.0, range(1, 6))  # steps 1..5, then killed: the record is as of step 5
    clock.now += 3
    first.spent("checkpoint")
    first.write()
    second = _attempt(tmp_path, clock, clock.now + 20, range(4, 9))  # resumed at 3: steps 4, 5 again, then 6..8
    second.spent("other")
    second.write()
    ledger = Ledger(**json.loads((tmp_path / GOODPUT).read_text()))
    assert ledger.seconds == {"productive": 16.0, "recomputed": 4.0, "startup": 10.0, "checkpoint": 3.0,
                              "evaluation": 0.0, "down": 20.0, "other": 0.0}
    assert (ledger.starts, ledger.furthest_iteration, ledger.first_start) == (2, 8, 1000.0)
    assert ledger.total == clock.now - 1000.0  # every second from the first start to the last record
    assert ledger.summary() == ("goodput 30.2 % of 53 s since the first start (2 starts): recomputed steps 7.5 %, "
                                "start-up and recovery 18.9 %, checkpoint stalls 5.7 %, down between starts 37.7 %")


def test_only_rank_0_writes_and_a_run_without_checkpoints_keeps_it_in_memory(tmp_path, clock):
    other_rank = GoodputLedger(tmp_path, 1000.0, writer=False)
    other_rank.spent("startup")
    other_rank.write()
    assert not (tmp_path / GOODPUT).exists()
    in_memory = GoodputLedger(None, 1000.0, writer=True)
    clock.now += 2
    in_memory.step_done(1)
    in_memory.write()
    assert in_memory.ledger.seconds["productive"] == 2.0 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("content", ["{", '{"first_start": 1.0}', json.dumps(
    {"first_start": 1.0, "accounted_until": 2.0, "seconds": {"productive": 1.0}}), json.dumps(
    {"first_start": 1.0, "accounted_until": 2.0, "seconds": dict.fromkeys(BUCKETS, -1.0)})])
def test_a_record_that_is_not_a_ledger_is_said_once_and_the_accounting_starts_over(tmp_path, clock, caplog, content):
    (tmp_path / GOODPUT).write_text(content)
    with caplog.at_level("WARNING", logger="megatron_ext"):
        ledger = GoodputLedger(tmp_path, 990.0, writer=True)
    assert ledger.ledger.starts == 1 and ledger.ledger.first_start == 990.0
    assert len(caplog.records) == 1 and "is not a goodput ledger" in caplog.text and str(tmp_path / GOODPUT) in caplog.text


def test_an_attempt_whose_launcher_started_before_the_last_record_counts_from_that_record(tmp_path, clock):
    """A spare agent's launcher waits from the job's start; when it joins after a node is lost, its workers' attempt
    starts at the last record, so no second is counted twice and the total is still the wall-clock."""
    first = _attempt(tmp_path, clock, 1000.0, range(1, 6))
    first.write()  # the record is as of 1015
    clock.now = 1020.0  # the spare's workers, started at the restart, reach their first record
    second = GoodputLedger(tmp_path, process_start=1002.0, writer=True)  # its launcher started at 1002
    second.spent("startup")
    second.write()
    ledger = Ledger(**json.loads((tmp_path / GOODPUT).read_text()))
    assert ledger.total == clock.now - 1000.0 and ledger.seconds["down"] == 0.0, ledger
    assert ledger.seconds["startup"] == 5.0 + 5.0, ledger  # each attempt's own
