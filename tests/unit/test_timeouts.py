"""Timeouts follow the plan (megatron_ext/planner/timeouts.py): derived for auto, kept when set, checked against each
other and the plan; every shipped recipe survives its own step, save and stop; the hang watchdog widens to what it
sees, never past its ceiling; a checkpoint save or load may take a multiple of its planned write."""

from __future__ import annotations

import re

import pytest

from megatron_ext.config.schema import (
    COLLECTIVE_TIMEOUT_FLOOR_MINUTES,
    HANG_MARGIN,
    HANG_TIMEOUT_FLOOR_S,
    collective_timeout_minutes,
    hang_timeout_s,
    load_config,
)
from megatron_ext.errors import ConfigError
from megatron_ext.planner.timeouts import (
    CHECKPOINT_IO_MARGIN,
    COLLECTIVE_MARGIN_S,
    EXIT_MARGIN_S,
    SLURM_SIGNAL_LEAD_S,
    checkpoint_io_limit_s,
    derive_timeouts,
    hang_ceiling_s,
    planned_timeouts,
    timeout_warnings,
)
from megatron_ext.resilience import watchdog as watchdog_module
from megatron_ext.resilience.watchdog import HangWatchdog
from tests.launch import ROOT, TINY

GPU_RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml") if "gpu" in p.stem)


def test_a_fast_run_keeps_the_floors():
    t = derive_timeouts(step_s=1.0, save_s=2.0, steps_between_reads=10)
    assert (t.hang_s, t.collective_minutes) == (HANG_TIMEOUT_FLOOR_S, COLLECTIVE_TIMEOUT_FLOOR_MINUTES)
    assert t.stop_s == 10 + 2 + EXIT_MARGIN_S


def test_a_slow_run_gets_twice_its_quiet_stretch_and_collectives_above_it():
    """The 405B shape's numbers: a 3310 s step read every step, a 568 s write."""
    t = derive_timeouts(step_s=3309.7, save_s=568.0, steps_between_reads=1)
    assert t.hang_s == 6660  # 2 × 3309.7 = 6619.4, up to the minute
    assert t.collective_minutes == 116  # (6660 + 300) / 60
    assert t.stop_s == 3998  # 3309.7 + 568 + 120, up
    t = derive_timeouts(step_s=20.0, save_s=3000.0, steps_between_reads=1)  # the write, not the step, bounds it
    assert t.collective_minutes * 60 >= 3000 + COLLECTIVE_MARGIN_S


def test_the_host_sees_steps_finish_only_where_the_loop_reads_the_device():
    """Between logging steps the host runs ahead; fp16 and step skipping read every step."""
    def quiet(*overrides: str) -> float:
        return planned_timeouts(load_config(TINY, list(overrides)), 4, 8, "h100-80gb").quiet_s

    every_10 = quiet("logging.log_interval=10")
    assert every_10 == pytest.approx(10 * quiet("logging.log_interval=1"))
    assert quiet("logging.log_interval=10", "train.skip_nonfinite_steps=2") == pytest.approx(every_10 / 10)


def test_set_values_are_kept_and_an_auto_hang_stays_under_set_collectives():
    t = derive_timeouts(3309.7, 568.0, 1, hang_s=900, collective_minutes=30)
    assert (t.hang_s, t.collective_minutes) == (900, 30)
    t = derive_timeouts(3309.7, 568.0, 1, collective_minutes=60)
    assert t.hang_s == 60 * 60 - COLLECTIVE_MARGIN_S and t.collective_minutes == 60
    assert derive_timeouts(3309.7, 568.0, 1, hang_s=None).hang_s is None


def test_timeouts_set_below_the_plan_are_warned_about():
    t = derive_timeouts(3309.7, 568.0, 1, hang_s=300, collective_minutes=10)
    said = timeout_warnings(t, under_slurm=True)
    assert [w.split("=")[0] for w in said[1:]] == ["train.hang_timeout_s", "parallel.distributed_timeout_minutes"]
    assert "sbatch --signal=B:USR1@3998" in said[0]
    assert timeout_warnings(derive_timeouts(3309.7, 568.0, 1), under_slurm=False) == []


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_a_recipe_survives_its_own_step_save_and_stop(path):
    """On its GPUs (H100 80GB), a recipe's timeouts as it runs them: the watchdog allows twice the planned stretch
    between device reads, a collective outlasts the watchdog and a checkpoint write, and a stop on a signal fits the
    SLURM templates' warning or the recipe says which --signal to submit with."""
    cfg = load_config(path)
    t = planned_timeouts(cfg, cfg.recipe.gpus, 8, "h100-80gb")
    assert t.hang_s is None or t.hang_s >= HANG_MARGIN * t.quiet_s, (path.name, t)
    assert t.collective_minutes * 60 >= max(t.hang_s or 0, t.save_s) + COLLECTIVE_MARGIN_S, (path.name, t)
    assert timeout_warnings(t, under_slurm=False) == [], path.name
    if t.stop_s > SLURM_SIGNAL_LEAD_S:
        said = re.search(r"--signal=B:USR1@(\d+)", path.read_text())
        assert said and int(said[1]) >= t.stop_s, (path.name, t.stop_s)


def test_the_slurm_templates_signal_as_planned():
    for template in (ROOT / "launch/slurm").glob("*.sbatch"):
        assert f"#SBATCH --signal=B:USR1@{SLURM_SIGNAL_LEAD_S}\n" in template.read_text(), template.name


@pytest.mark.parametrize("override, message", [
    ("train.hang_timeout_s=soon", "train.hang_timeout_s='soon' is invalid: must be a number or auto or null (off)"),
    ("parallel.distributed_timeout_minutes=null",
     "parallel.distributed_timeout_minutes=None is invalid: must be a number or auto"),
])
def test_a_timeout_is_a_number_or_auto(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [override])
    assert str(error.value) == message


def test_unplanned_auto_is_the_floor_and_set_values_are_read_as_set():
    cfg = load_config(TINY)
    assert (hang_timeout_s(cfg), collective_timeout_minutes(cfg)) == (HANG_TIMEOUT_FLOOR_S,
                                                                       COLLECTIVE_TIMEOUT_FLOOR_MINUTES)
    cfg = load_config(TINY, ["train.hang_timeout_s=null", "parallel.distributed_timeout_minutes=25"])
    assert (hang_timeout_s(cfg), collective_timeout_minutes(cfg)) == (None, 25)


def test_a_launch_resolves_auto_from_the_plan():
    """recipes.pretrain's load_and_validate: the ranks run the planned numbers; a value the command line sets
    stays."""
    from recipes.pretrain import load_and_validate

    cfg, _, t = load_and_validate(str(TINY), ["logging.log_interval=5"], 4, 4, say_timeouts=False)
    assert (cfg.train.hang_timeout_s, cfg.parallel.distributed_timeout_minutes) == (t.hang_s, t.collective_minutes)
    cfg, _, _ = load_and_validate(str(TINY), ["train.hang_timeout_s=42"], 4, 4, say_timeouts=False)
    assert cfg.train.hang_timeout_s == 42 and cfg.parallel.distributed_timeout_minutes == 10


def test_the_watchdog_widens_to_what_it_sees_up_to_its_ceiling(monkeypatch, tmp_path):
    now = [0.0]
    monkeypatch.setattr(watchdog_module.time, "monotonic", lambda: now[0])
    dog = HangWatchdog(10.0, tmp_path, 0, 1, ceiling_s=30.0)

    def step_after(seconds: float) -> float:
        now[0] += seconds
        dog.step_done(dog.iteration + 1)
        return dog.timeout_s

    assert step_after(100.0) == 10.0  # the first step (start-up) is not a stretch: the watchdog is not armed yet
    assert step_after(2.0) == 10.0  # twice 2 s is under the configured 10 s
    assert step_after(7.0) == 14.0
    assert step_after(3.0) == 14.0  # never narrower
    with dog.timed("the checkpoint save of iteration 4"):  # a save is no stretch
        now[0] += 500.0
    assert step_after(1.0) == 14.0
    assert step_after(20.0) == 30.0  # the ceiling: below the collective timeout
    assert HangWatchdog(10.0, tmp_path, 0, 1, ceiling_s=5.0).ceiling_s == 10.0  # never below the configured value


def test_rank_0_says_at_start_up_when_the_save_interval_costs_goodput(caplog):
    """run_timeouts with `say` (rank 0, before training): the 70B recipe on 2,048 GPUs saving only at the end gets
    the advice line with the planner's interval; saving at that interval gets none."""
    from recipes.pretrain import run_timeouts

    said = {}
    for save_interval in ("null", "31"):
        cfg = load_config(ROOT / "configs" / "llama3_70b_64gpu_bf16.yaml", [f"checkpoint.save_interval={save_interval}"])
        caplog.clear()
        with caplog.at_level("INFO", logger="megatron_ext"):
            run_timeouts(cfg, 2048, 8, say=True)
        said[save_interval] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("advice: ")]
    assert len(said["null"]) == 1 and "set checkpoint.save_interval=31 " in said["null"][0], said
    assert said["31"] == []


def test_a_save_may_take_a_multiple_of_its_planned_write_at_least_the_hang_timeout_below_the_ceiling(tmp_path):
    assert checkpoint_io_limit_s(10.0, 0.01, 1) == 10.0  # a tiny model's save: the hang timeout
    assert checkpoint_io_limit_s(300.0, 120.0, 30) == CHECKPOINT_IO_MARGIN * 120.0
    assert checkpoint_io_limit_s(300.0, 600.0, 30) == hang_ceiling_s(30) == 30 * 60 - COLLECTIVE_MARGIN_S
    assert checkpoint_io_limit_s(900.0, 0.0, 10) == 900.0  # a set hang timeout above the ceiling is kept
    dog = HangWatchdog(10.0, tmp_path, 0, 1, ceiling_s=30.0, io_limit_s=12.0)
    assert (dog.io_limit_s, HangWatchdog(10.0, tmp_path, 0, 1, ceiling_s=30.0).io_limit_s) == (12.0, 30.0)


def test_the_watchdog_names_a_save_that_outlasts_its_limit(monkeypatch, tmp_path):
    now, fired = [0.0], []
    monkeypatch.setattr(watchdog_module.time, "monotonic", lambda: now[0])
    dog = HangWatchdog(10.0, tmp_path, 0, 1, ceiling_s=30.0, io_limit_s=12.0)
    monkeypatch.setattr(dog, "_fire", lambda phase=None: fired.append(phase))
    monkeypatch.setattr(dog._stop, "wait", lambda _: len(fired) > 0 or now.__setitem__(0, now[0] + 5.0))
    dog.step_done(1)
    with dog.timed("the checkpoint save of iteration 1"):
        dog._run()
    assert fired == ["the checkpoint save of iteration 1"] and now[0] == 15.0  # the first beat past 12 s
