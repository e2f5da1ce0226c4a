"""Loss spikes: a step's loss far above the recent ones, and the run's answer to one (train.spike_policy).

"Far above" is measured robustly: more than train.spike_threshold median absolute deviations (MADs) above the
median of the previous train.spike_window accepted losses. The median and the MAD ignore the odd outlier that a
mean and a standard deviation would follow, and a falling loss (the warm-up) is never above its median; a deviation
counts as at least 1 % of the median, so noise on a flat loss curve is no spike.

The answers: ``warn`` (a line and ``train/loss_spike``); ``skip`` (the step's update is dropped, decided before it
as a non-finite step's is — such runs read every step's loss before its update); ``rewind`` (the trainer goes back
to the newest checkpoint and the data continues after the spike: :mod:`megatron_ext.checkpoint.data_skips`). Under
``rewind`` a non-finite loss or gradient that train.skip_nonfinite_steps does not skip is rewound past as well (its
update has made the weights non-finite; the checkpoint has not).
Skips and rewinds are capped by train.max_rewinds; the next spike stops the run with one line. Every rank sees the
same global-batch losses in the same order, so every rank decides the same without a collective of its own.
The detector's losses and the count acted on are run state (:meth:`LossSpikes.state_dict`), saved with every
checkpoint: a requeued run sees the spikes the uninterrupted one would, and a budget spent stays spent.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from megatron_ext.config.schema import TrainConfig
from megatron_ext.errors import DivergenceError

MIN_DEVIATION = 0.01  # of the median: a deviation below it counts as this much
REWIND_REASON = "rewound past the loss spike"  # how a rewind's data skip begins (checkpoint/data_skips.py)


@dataclass(frozen=True)
class Spike:
    """A step whose loss was a spike, and how far above the previous steps it was."""

    iteration: int
    loss: float
    median: float
    deviations: float  # median absolute deviations above the median
    samples: tuple[int, int]  # the first and last sample of the step's global batch
    nonfinite: str = ""  # for a non-finite step (loss NaN, deviations infinite): where it was seen

    def describe(self) -> str:
        what = self.nonfinite or (
            f"loss spike at iteration {self.iteration}: {self.loss:.4f} is {self.deviations:.1f} median absolute "
            f"deviations above the median {self.median:.4f} of the previous steps")
        return (f"{what}; the step trained on samples {self.samples[0]}..{self.samples[1]} of the training dataset "
                "(in megatron-core's shuffled order)")


class SpikeDetector:
    """The median and MAD of the last `window` losses it was given; looks for spikes once a fifth of them are in."""

    def __init__(self, window: int, threshold: float):
        self.threshold = threshold
        self.history: deque[float] = deque(maxlen=window)
        self.warm_up = max(window // 5, 1)

    def spike(self, iteration: int, loss: float, samples: tuple[int, int] = (0, 0)) -> Optional[Spike]:
        """A :class:`Spike` when `loss` (of the step on `samples`) is one against the losses remembered so far, else
        None (remembers nothing)."""
        if len(self.history) < self.warm_up:
            return None
        median = statistics.median(self.history)
        mad = statistics.median(abs(x - median) for x in self.history)
        unit = max(mad, MIN_DEVIATION * abs(median))
        if unit == 0 or loss - median <= self.threshold * unit:
            return None
        return Spike(iteration, loss, median, (loss - median) / unit, samples)

    def remember(self, loss: float) -> None:
        self.history.append(loss)


class LossSpikes:
    """train.spike_policy for one run: the loop asks :meth:`before_update` for each step (``skip``) and
    :meth:`settled` for each step whose numbers it reads (the others)."""

    def __init__(self, t: TrainConfig):
        self.policy, self.max_acted, self.acted = t.spike_policy, t.max_rewinds, 0
        self.global_batch_size = t.global_batch_size
        self.detector = SpikeDetector(t.spike_window, t.spike_threshold)

    @property
    def decides_before_update(self) -> bool:
        return self.policy == "skip"

    def _check(self, iteration: int, loss: float, first_sample: int) -> Optional[Spike]:
        return self.detector.spike(iteration, loss, (first_sample, first_sample + self.global_batch_size - 1))

    def would_skip(self, loss: float) -> bool:
        """Whether :meth:`before_update` would drop a step with this loss now (remembers nothing)."""
        return self.decides_before_update and math.isfinite(loss) and self._check(0, loss, 0) is not None

    def before_update(self, iteration: int, loss: float, first_sample: int) -> Optional[Spike]:
        """``skip``: the spike whose update the loop drops (counted against train.max_rewinds), else None.
        `first_sample`: where the step's global batch starts."""
        spike = self._check(iteration, loss, first_sample) if self.decides_before_update else None
        if spike:
            self._act(spike, "skipped")
        return spike

    def settled(self, iteration: int, loss: float, first_sample: int) -> Optional[Spike]:
        """A settled step's loss: the spike to warn about (``warn``) or rewind past (``rewind``, counted), else None.
        Accepted losses are remembered; a spike that is skipped or rewound past is not."""
        if self.policy == "off":
            return None
        spike = None if self.decides_before_update else self._check(iteration, loss, first_sample)
        if spike and self.policy == "rewind":
            self._act(spike, "rewound past")
            return spike
        self.detector.remember(loss)
        return spike

    def nonfinite(self, iteration: int, first_sample: int, description: str) -> Optional[Spike]:
        """``rewind``: the non-finite step (`description`: divergence.describe_nonfinite's) to rewind past, counted
        as a spike; None under the other policies (the run skips or stops as train.skip_nonfinite_steps says)."""
        if self.policy != "rewind":
            return None
        spike = Spike(iteration, math.nan, math.nan, math.inf,
                      (first_sample, first_sample + self.global_batch_size - 1), description)
        self._act(spike, "rewound past")
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.detector.history), "acted": self.acted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The losses as they were at the checkpoint (the newest spike_window of them); the count acted on never
        goes down: a rewind to an earlier checkpoint keeps the rewinds spent since."""
        self.detector.history.clear()
        self.detector.history.extend(float(loss) for loss in state["history"])
        self.acted = max(self.acted, int(state["acted"]))

    def count_recorded_rewinds(self, rewinds: int) -> None:
        """At least `rewinds` acted on: the rewinds the data skips recorded (each is written when it happens, a
        checkpoint only later)."""
        self.acted = max(self.acted, rewinds)

    def count(self, done: str) -> str:
        """`done` with how many spikes were acted on, for the line that says it."""
        return f"{done} ({self.acted} of train.max_rewinds={self.max_acted})"

    def _act(self, spike: Spike, done: str) -> None:
        if self.acted >= self.max_acted:
            raise DivergenceError(
                f"{spike.describe()}, after {self.acted} spikes {done} (train.max_rewinds={self.max_acted}). Resume "
                f"from the last checkpoint (checkpoint.load) with a lower optimizer.lr or optimizer.clip_grad; if "
                f"these are not spikes, raise train.spike_threshold (now {self.detector.threshold:g})")
        self.acted += 1
