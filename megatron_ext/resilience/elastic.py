"""What a restart changed and cost: a relaunch, a SLURM requeue, or torchrun's elastic agent restarting the workers
on another set of nodes.

Rank 0 records the run's progress beside its checkpoints after its steps (``checkpoint.save/progress.json``: the
iteration reached, when, and on which world; at most once a second). A (re)started run reads the record its
predecessor left before writing its own, and after its first step says once what changed — ``world 4 → 2: DP 2 → 1,
2 → 4 micro batches per step, resumed at iteration 6, lost 1 step, recovered in 17.2 s`` — on the console and in
TensorBoard (``elastic/*``). The global batch is the recipe's, so a new DP only changes the number of micro batches.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

PROGRESS = "progress.json"


@dataclass(frozen=True)
class Progress:
    """Where a run was: the last finished iteration, when (seconds since the epoch), and its world."""

    iteration: int
    time: float
    world_size: int
    data_parallel_size: int
    num_microbatches: int


@dataclass(frozen=True)
class Restart:
    """A run resumed at `resumed_at` after `before` (its predecessor's last progress) on the world `now`."""

    before: Progress
    now: Progress  # this run's world (its iteration and time: the resume point, not yet a step)
    resumed_at: int

    @property
    def lost_steps(self) -> int:
        return max(self.before.iteration - self.resumed_at, 0)

    def describe(self, first_step_end: float) -> str:
        b, n = self.before, self.now
        world = (f"world {b.world_size} → {n.world_size}: DP {b.data_parallel_size} → {n.data_parallel_size}, "
                 f"{b.num_microbatches} → {n.num_microbatches} micro batches per step"
                 if b.world_size != n.world_size else f"same world ({n.world_size} ranks, DP {n.data_parallel_size})")
        lost = self.lost_steps
        return (f"restart: {world}, resumed at iteration {self.resumed_at}, lost {lost} step{'s' * (lost != 1)}, "
                f"recovered in {self.recovery_s(first_step_end):.1f} s (from the last step before the restart to the "
                "first one after it)")

    def recovery_s(self, first_step_end: float) -> float:
        return max(first_step_end - self.before.time, 0.0)

    def scalars(self, first_step_end: float) -> dict[str, float]:
        return {"elastic/world_size": float(self.now.world_size),
                "elastic/data_parallel_size": float(self.now.data_parallel_size),
                "elastic/lost_steps": float(self.lost_steps),
                "elastic/recovery_s": self.recovery_s(first_step_end)}


def read_progress(save_dir: str | Path) -> Optional[Progress]:
    """The progress the last run training into `save_dir` recorded (None when there is none, or it is unreadable)."""
    path = Path(save_dir) / PROGRESS
    if not path.is_file():
        return None
    try:
        return Progress(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


class ProgressRecord:
    """checkpoint.save/progress.json, written by rank 0 after a step (atomically: a crash leaves the old one), at most
    once every WRITE_EVERY_S: a file system round trip per step would cost fast steps on a parallel file system, and
    the lost steps are then counted to within that second."""

    WRITE_EVERY_S = 1.0

    def __init__(self, save_dir: Optional[str], rank: int, world_size: int, data_parallel_size: int,
                 num_microbatches: int):
        self.path = Path(save_dir) / PROGRESS if save_dir else None
        self.writer = self.path is not None and rank == 0
        self.world = (world_size, data_parallel_size, num_microbatches)
        self.written = float("-inf")

    def previous(self) -> Optional[Progress]:
        """What the run before this one recorded (None for a first start or an unreadable record)."""
        return read_progress(self.path.parent) if self.path is not None else None

    def restart(self, resumed_at: int) -> Optional[Restart]:
        """The restart this run is, if a predecessor left a record (call before the first :meth:`step_done`)."""
        before = self.previous()
        return None if before is None else Restart(before, Progress(resumed_at, time.time(), *self.world), resumed_at)

    def step_done(self, iteration: int) -> None:
        now = time.time()
        if not self.writer or now - self.written < self.WRITE_EVERY_S:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(Progress(iteration, now, *self.world))))
        os.replace(tmp, self.path)
        self.written = now
