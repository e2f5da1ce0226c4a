"""What a restart changed and cost: a relaunch, a SLURM requeue, or torchrun's elastic agent restarting the workers
on another set of nodes.

Rank 0 records the run's progress beside its checkpoints after its steps (``checkpoint.save/progress.json``, named by
``checkpoint.layout.progress_path``: the
iteration reached, when, and on which world; at most once a second). A (re)started run reads the record its
predecessor left before writing its own, and after its first step says once what changed and where the time went —
``world 4 → 2: DP 2 → 1, 2 → 4 micro batches per step, resumed at iteration 6, lost 1 step, recovered in 17.2 s from
the last step before it: until the agent restarted the workers 3.1 s, ...`` — on the console and in TensorBoard
(``elastic/*``). The global batch is the recipe's, so a new DP only changes the number of micro batches.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from megatron_ext.storage.files import write_atomically

# Set by recipes.launch in torchrun's agent (its workers inherit its environment): when it decided to restart the
# workers (a failure, or a node waiting to join), and when the rendezvous of the new world was complete.
RESTART_DECIDED_AT = "RECIPES_RESTART_DECIDED_AT"
WORKERS_STOPPED_AT = "RECIPES_WORKERS_STOPPED_AT"
RENDEZVOUS_DONE_AT = "RECIPES_RENDEZVOUS_DONE_AT"
CLOCK_TICK_SLACK_S = 0.02


@dataclass(frozen=True)
class Progress:
    """Where a run was: the last finished iteration, when (seconds since the epoch), and its world."""

    iteration: int
    time: float
    world_size: int
    data_parallel_size: int
    num_microbatches: int


@dataclass(frozen=True)
class AgentTimes:
    """When torchrun's agent decided to restart the workers, had stopped the old ones and had the new world's
    rendezvous complete (seconds since the epoch), as recipes.launch recorded them; None under another launcher."""

    decided: Optional[float] = None
    stopped: Optional[float] = None
    rendezvous_done: Optional[float] = None

    @classmethod
    def from_environment(cls) -> AgentTimes:
        def read(name: str) -> Optional[float]:
            try:
                return float(os.environ[name])
            except (KeyError, ValueError):
                return None
        return cls(read(RESTART_DECIDED_AT), read(WORKERS_STOPPED_AT), read(RENDEZVOUS_DONE_AT))


@dataclass(frozen=True)
class Restart:
    """A run resumed at `resumed_at` after `before` (its predecessor's last progress) on the world `now`."""

    before: Progress
    now: Progress  # this run's world (its iteration and time: the resume point, not yet a step)
    resumed_at: int
    agent: AgentTimes = AgentTimes()

    @property
    def lost_steps(self) -> int:
        return max(self.before.iteration - self.resumed_at, 0)

    def describe(self, started: float, startup: list[tuple[str, float]]) -> str:
        """The line, from this process's start time and its start-up phases up to the end of its first step."""
        b, n = self.before, self.now
        world = (f"world {b.world_size} → {n.world_size}: DP {b.data_parallel_size} → {n.data_parallel_size}, "
                 f"{b.num_microbatches} → {n.num_microbatches} micro batches per step"
                 if b.world_size != n.world_size else f"same world ({n.world_size} ranks, DP {n.data_parallel_size})")
        lost = self.lost_steps
        parts = self.parts(started, startup)
        return (f"restart: {world}, resumed at iteration {self.resumed_at}, lost {lost} step{'s' * (lost != 1)}, "
                f"recovered in {sum(s for _, s in parts):.1f} s from the last step before it: "
                + ", ".join(f"{part} {seconds:.1f} s" for part, seconds in parts))

    def parts(self, started: float, startup: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """Where the recovery went, in order: before this process started (with recipes.launch's times: until the
        agent restarted the workers, stopping the old ones, the rendezvous, the process start; on a scale-up the
        agent decides before the old world's last step, which then checkpoints while stopping, and an agent that
        joins has only its rendezvous), then this process's
        start-up phases to the end of its first step."""
        a, since, parts = self.agent, self.before.time, []
        # under recipes.launch; an agent that joined at this restart stopped no workers, and only its rendezvous
        # falls after the last step
        for part, at in (("until the agent restarted the workers", a.decided),
                         ("stopping the old ones", a.stopped), ("rendezvous", a.rendezvous_done)):
            # the process start is known to a clock tick (10 ms): the agent's last time may read a little later
            if at is not None and since <= at <= started + CLOCK_TICK_SLACK_S:
                at = min(at, started)
                parts.append((part, at - since))
                since = at
        parts.append(("process start" if parts else "down until this process started", started - since))
        return [*parts, *startup]

    def scalars(self, started: float, startup: list[tuple[str, float]]) -> dict[str, float]:
        before_start = started - self.before.time
        return {"elastic/world_size": float(self.now.world_size),
                "elastic/data_parallel_size": float(self.now.data_parallel_size),
                "elastic/lost_steps": float(self.lost_steps),
                "elastic/recovery_s": before_start + sum(s for _, s in startup),
                "elastic/down_before_start_s": before_start}


def read_progress(path: Path) -> Optional[Progress]:
    """The progress the last run recorded at `path` (None when there is none, or it is unreadable)."""
    if not path.is_file():
        return None
    try:
        return Progress(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


class ProgressRecord:
    """The progress record at `path` (None: the run saves no checkpoints), written by rank 0 after a step (atomically: a crash leaves the old one), at most
    once every WRITE_EVERY_S: a file system round trip per step would cost fast steps on a parallel file system, and
    the lost steps are then counted to within that second."""

    WRITE_EVERY_S = 1.0

    def __init__(self, path: Optional[Path], rank: int, world_size: int, data_parallel_size: int,
                 num_microbatches: int):
        self.path = path
        self.writer = self.path is not None and rank == 0
        self.world = (world_size, data_parallel_size, num_microbatches)
        self.written = float("-inf")

    def previous(self) -> Optional[Progress]:
        """What the run before this one recorded (None for a first start or an unreadable record)."""
        return read_progress(self.path) if self.path is not None else None

    def restart(self, resumed_at: int) -> Optional[Restart]:
        """The restart this run is, if a predecessor left a record (call before the first :meth:`step_done`)."""
        before = self.previous()
        return None if before is None else Restart(before, Progress(resumed_at, time.time(), *self.world), resumed_at,
                                                   AgentTimes.from_environment())

    def step_done(self, iteration: int) -> None:
        now = time.time()
        if not self.writer or now - self.written < self.WRITE_EVERY_S:
            return
        write_atomically(self.path, json.dumps(asdict(Progress(iteration, now, *self.world))))
        self.written = now
