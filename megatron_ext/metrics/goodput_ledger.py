"""The run's goodput ledger: where its wall-clock went since it first started, across restarts, requeues and spike
rewinds, kept by rank 0 in ``<checkpoint.save>/goodput.json`` (in memory only for a run that saves nothing).

Every second from the first start to the last record is in exactly one bucket:

- ``productive``: training steps that took the run to an iteration it had not reached before;
- ``recomputed``: steps redone — after a restart, the work since the last checkpoint; after a rewind, the steps
  since the checkpoint it went back to; a step's first run that a re-run replaced (train.rerun_mode);
- ``startup``: start-up and recovery — each attempt's start to its first step (its launcher's start on a first start
  by an elastic agent: run_logger.launcher_start_time; imports, process groups, model, checkpoint load) and each
  rewind's reload;
- ``checkpoint``: training stalled for checkpoint saves (and for the last background save at the end);
- ``evaluation``: validation and the test split;
- ``down``: no process of the run was keeping the ledger — from an attempt's last record to the next one's start:
  its crash or kill, the teardown, a requeue's wait in the queue, the launcher's restart;
- ``other``: closing the run's writers after the last step.

Goodput is ``productive`` over the total (Google's ML goodput: the share of the time that advanced the model). The
record is written atomically at most once a second, so a kill loses at most that second to ``down``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional

from megatron_ext.checkpoint.layout import GOODPUT
from megatron_ext.metrics.units import format_duration
from megatron_ext.storage import files
from megatron_ext.storage.files import write_atomically

log = logging.getLogger("megatron_ext")

Bucket = Literal["productive", "recomputed", "startup", "checkpoint", "evaluation", "down", "other"]
BUCKETS: tuple[Bucket, ...] = ("productive", "recomputed", "startup", "checkpoint", "evaluation", "down", "other")
LOST_TO = {"recomputed": "recomputed steps", "startup": "start-up and recovery", "checkpoint": "checkpoint stalls",
           "evaluation": "evaluation", "down": "down between starts", "other": "other"}


@dataclass
class Ledger:
    first_start: float  # the first attempt's start (seconds since the epoch)
    accounted_until: float  # the end of the last second in a bucket
    furthest_iteration: int = 0  # the highest iteration any attempt finished
    starts: int = 1
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def fractions(self) -> dict[str, float]:
        total = self.total or 1.0
        return {bucket: seconds / total for bucket, seconds in self.seconds.items()}

    def summary(self) -> str:
        """``goodput 30.2 % of 53 s since the first start (2 starts): recomputed steps 7.5 %, ...``"""
        shares = self.fractions()
        lost = ", ".join(f"{LOST_TO[b]} {100 * shares[b]:.1f} %" for b in BUCKETS[1:] if self.seconds[b] > 0)
        starts = f"{self.starts} start{'s' if self.starts > 1 else ''}"
        return (f"goodput {100 * shares['productive']:.1f} % of {format_duration(self.total)} since the first start "
                f"({starts})" + (f": {lost}" if lost else ""))


def read_ledger(path: Path) -> Optional[Ledger]:
    """The ledger at `path`; None when there is none. One that does not read as a ledger is set aside with a warning
    (the run's accounting starts over; nothing else depends on it)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
        ledger = Ledger(**value)
        if set(ledger.seconds) != set(BUCKETS) or not all(
                isinstance(v, (int, float)) and v >= 0 for v in ledger.seconds.values()):
            raise ValueError(f"buckets {sorted(ledger.seconds)}")
        return ledger
    except (OSError, ValueError, TypeError) as e:
        log.warning(f"{path} is not a goodput ledger ({e}): the accounting starts over from this start")
        return None


class GoodputLedger:
    """Rank 0's ledger (`writer`) of the run saving into `root`, from this attempt's start (`process_start`: its
    launcher's or its process's, as the start-up clock has it)."""

    WRITE_EVERY_S = 1.0

    def __init__(self, root: Optional[str | Path], process_start: float, writer: bool):
        self.path = files.at(root) / GOODPUT if root and writer else None
        before = read_ledger(self.path) if self.path else None
        if before is None:
            self.ledger = Ledger(process_start, process_start)
        else:
            self.ledger = before
            self.ledger.starts += 1
            self.ledger.seconds["down"] += max(0.0, process_start - before.accounted_until)
            # a start before the last record (a spare agent's launcher, waiting to join) counts from that record
            self.ledger.accounted_until = max(process_start, before.accounted_until)
        self.written = float("-inf")

    def spent(self, bucket: Bucket) -> None:
        """The time since the last call (or this process's start) went to `bucket`."""
        now = time.time()
        self.ledger.seconds[bucket] += max(0.0, now - self.ledger.accounted_until)
        self.ledger.accounted_until = now
        if now - self.written >= self.WRITE_EVERY_S:
            self.write()

    def step_done(self, iteration: int) -> None:
        """Training step `iteration` ended now: productive if no attempt had finished it before, else recomputed."""
        self.spent("productive" if iteration > self.ledger.furthest_iteration else "recomputed")
        self.ledger.furthest_iteration = max(self.ledger.furthest_iteration, iteration)

    def write(self) -> None:
        if self.path is not None:
            write_atomically(self.path, json.dumps(asdict(self.ledger)))
            self.written = time.time()
