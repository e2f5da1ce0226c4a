"""Timeouts that follow the plan: how long a run may be silent before it is taken for hung, how long a collective may
wait, and how long a stop on a signal needs — from the planned step time and checkpoint write, so that a slow recipe
(the 405B's planned step is 55 minutes) is not killed by its own step and a pre-empted one has time to save.

* The hang watchdog (``train.hang_timeout_s``): the host sees a step finish only where the loop reads the device, up
  to :func:`~megatron_ext.config.schema.steps_between_device_reads` steps apart; twice that stretch, at least
  ``HANG_TIMEOUT_FLOOR_S``. A checkpoint save or load is timed apart (:func:`checkpoint_io_limit_s`): a multiple
  of its planned write, at least the hang timeout.
* Collectives (``parallel.distributed_timeout_minutes``): a rank may wait in one for the slowest rank's step or for
  another's checkpoint write; ``COLLECTIVE_MARGIN_S`` above the longer of the hang timeout and the write, so that
  the watchdog names a hung rank before the collectives fail, and at least torch's 10 minutes.
* A stop on SIGTERM/SIGUSR1 (:attr:`Timeouts.stop_s`): the steps to the next device read, the save, and the exit.
  The SLURM templates must signal at least that long before the time limit (a run under SLURM warns when their
  ``SLURM_SIGNAL_LEAD_S`` is shorter). torchrun's ``--shutdown-timeout`` (30 s) is left as set: its agent waits
  that long for ranks stuck in a collective after a failure too; ``recipes.launch`` names ``stop_s`` when a signal
  stop was cut short by it.

A value the config sets is kept (and checked against the plan by the callers); only ``auto`` is derived. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from megatron_ext.config.schema import (
    AUTO,
    COLLECTIVE_TIMEOUT_FLOOR_MINUTES,
    HANG_MARGIN,
    HANG_TIMEOUT_FLOOR_S,
    RecipeConfig,
    steps_between_device_reads,
)
from megatron_ext.hardware import GPUS
from megatron_ext.planner.estimate import estimate
from megatron_ext.planner.goodput import DEFAULT_WRITE_GB_S, checkpoint_write_s
from megatron_ext.planner.layout import model_vocab_size

COLLECTIVE_MARGIN_S = 300.0  # a collective outlasts the hang watchdog (and a checkpoint write) by this much
EXIT_MARGIN_S = 120.0  # after the last save: the run's records, process exit, the launcher's teardown
# What the SLURM templates give a run between their warning signal and the time limit (#SBATCH --signal=B:USR1@600;
# tests/unit/test_timeouts.py holds the templates to it)
SLURM_SIGNAL_LEAD_S = 600


# A checkpoint save or load this many times its planned write is a hang: the plan writes at DEFAULT_WRITE_GB_S
# aggregate, and slower shared file systems and object stores run several times below that without being stuck.
CHECKPOINT_IO_MARGIN = 10.0


def hang_ceiling_s(collective_minutes: float) -> float:
    """The longest hang timeout under a collective timeout of `collective_minutes`: COLLECTIVE_MARGIN_S below it (half
    of it when that is shorter), so that the watchdog speaks before the collectives fail."""
    return collective_minutes * 60 - min(COLLECTIVE_MARGIN_S, collective_minutes * 30)


def checkpoint_io_limit_s(hang_s: float, save_s: float, collective_minutes: float) -> float:
    """How long a checkpoint save or load may run before the hang watchdog names it: CHECKPOINT_IO_MARGIN times the
    planned write `save_s`, at least the hang timeout `hang_s`, at most :func:`hang_ceiling_s` (the watchdog speaks
    before the collectives waiting for it fail)."""
    return min(max(hang_ceiling_s(collective_minutes), hang_s), max(hang_s, CHECKPOINT_IO_MARGIN * save_s))


@dataclass(frozen=True)
class Timeouts:
    hang_s: Optional[float]  # train.hang_timeout_s (None: off)
    collective_minutes: float  # parallel.distributed_timeout_minutes
    stop_s: float  # a stop on a signal: the steps to the next device read, a checkpoint write, the exit
    step_s: float  # planned
    quiet_s: float  # planned: the longest stretch between two steps the host sees finish
    save_s: float  # planned: one checkpoint written at the file system's bandwidth

    def to_dict(self) -> dict:
        return asdict(self)

    def overrides(self) -> list[str]:
        """The resolved values as config overrides."""
        hang = "null" if self.hang_s is None else f"{self.hang_s:g}"
        return [f"train.hang_timeout_s={hang}", f"parallel.distributed_timeout_minutes={self.collective_minutes:g}"]

    def describe(self) -> str:
        """One line: the values and what they were derived from."""
        hang = "off" if self.hang_s is None else f"{self.hang_s:,g} s"
        return (f"hang watchdog {hang}, collectives {self.collective_minutes:g} min, a stop on a signal needs "
                f"{self.stop_s:,.0f} s (planned: {self.step_s:,.1f} s/step, {self.quiet_s:,.0f} s between device "
                f"reads, {self.save_s:,.0f} s to write a checkpoint)")


def derive_timeouts(step_s: float, save_s: float, steps_between_reads: int, hang_s: float | str | None = AUTO,
                    collective_minutes: float | str = AUTO) -> Timeouts:
    """:class:`Timeouts` for a planned `step_s` and checkpoint write `save_s`; `hang_s` and `collective_minutes`
    are kept unless auto (see the module docstring)."""
    quiet = steps_between_reads * step_s
    if hang_s == AUTO:
        hang_s = max(HANG_TIMEOUT_FLOOR_S, 60 * math.ceil(HANG_MARGIN * quiet / 60))
        if collective_minutes != AUTO:  # below the collective timeout the config sets
            hang_s = min(hang_s, hang_ceiling_s(collective_minutes))
    if collective_minutes == AUTO:
        waited = max(hang_s or HANG_TIMEOUT_FLOOR_S, save_s) + COLLECTIVE_MARGIN_S
        collective_minutes = max(COLLECTIVE_TIMEOUT_FLOOR_MINUTES, math.ceil(waited / 60))
    stop = math.ceil(quiet + save_s + EXIT_MARGIN_S)
    return Timeouts(hang_s, collective_minutes, stop, step_s, quiet, save_s)


def recipe_timeouts(cfg: RecipeConfig, step_s: float, write_gb_s: float = DEFAULT_WRITE_GB_S) -> Timeouts:
    """:func:`derive_timeouts` for `cfg` at a planned `step_s`, its checkpoint written at `write_gb_s` (aggregate)."""
    return derive_timeouts(step_s, checkpoint_write_s(cfg, write_gb_s), steps_between_device_reads(cfg),
                           cfg.train.hang_timeout_s, cfg.parallel.distributed_timeout_minutes)


def planned_timeouts(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: str,
                     write_gb_s: float = DEFAULT_WRITE_GB_S, vocab_size: Optional[int] = None) -> Timeouts:
    """:func:`recipe_timeouts` at the planned step of `cfg`'s own layout on `world_size` GPUs of kind `gpu` (the
    vocabulary :func:`model_vocab_size`'s unless given)."""
    step = estimate(cfg, world_size, gpus_per_node, GPUS[gpu], vocab_size or model_vocab_size(cfg)).time["step"]
    return recipe_timeouts(cfg, step, write_gb_s)


def timeout_warnings(t: Timeouts, under_slurm: bool) -> list[str]:
    """What a config-set timeout (or, `under_slurm`, the templates' signal lead) risks against the plan."""
    warnings = []
    if under_slurm and t.stop_s > SLURM_SIGNAL_LEAD_S:
        warnings.append(f"a stop on a signal needs {t.stop_s:,.0f} s (a step, then the checkpoint write), more than "
                        f"the SLURM templates' {SLURM_SIGNAL_LEAD_S} s warning: submit with sbatch "
                        f"--signal=B:USR1@{t.stop_s:.0f} or the time limit may kill the run before it saves")
    if t.hang_s is not None and t.hang_s < HANG_MARGIN * t.quiet_s:
        warnings.append(f"train.hang_timeout_s={t.hang_s:g} is under twice the planned {t.quiet_s:,.0f} s between "
                        f"device reads: a slow stretch may be taken for a hang (auto derives it from the plan)")
    if t.collective_minutes * 60 < t.save_s + COLLECTIVE_MARGIN_S:
        warnings.append(f"parallel.distributed_timeout_minutes={t.collective_minutes:g} leaves a collective less "
                        f"than the planned {t.save_s:,.0f} s checkpoint write and 5 minutes: ranks waiting for a save "
                        "may time out (auto derives it from the plan)")
    return warnings
