"""Where a step's time goes, from megatron-core's own timers: its schedules and grad finalisation call
``config.timers(name).start()/stop()`` around each region, and this object is that hook. Regions are summed into
parts of the step — compute (forward and backward), pipeline (sends and receives: the P2P transfers and the waits
of the pipeline bubble), grad sync (the data-parallel reduce and the embedding/norm all-reduces left exposed after
the backward pass), schedule (the rest of megatron-core's ``forward-backward`` region: its own bookkeeping between
those) — plus what the loop times itself: data (waiting for the next micro batch, which megatron-core counts inside
forward compute), the optimizer (zeroing the grads, the step) and the loss sync (queueing the all-reduce of the loss
and the non-finite flags, and the router's statistics). Whatever is left of the step is ``other`` (Python between
regions).

On a GPU each region records CUDA events and nothing waits for them until a logging step: the steps of a log
interval are closed (:meth:`StepTimers.end_step`) unread, and :meth:`StepTimers.take` synchronises with the device
once before reading them all (an event still queued behind the optimizer step cannot be read). On CPU the host
clock.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Literal, Optional

import torch

Part = Literal["compute", "pipeline", "grad_sync", "schedule", "optimizer", "loss_sync", "data"]
PARTS: tuple[Part, ...] = ("compute", "pipeline", "grad_sync", "schedule", "optimizer", "loss_sync", "data")
_WHOLE_SCHEDULE = "forward-backward"  # megatron-core's region around the whole schedule, grad finalisation included
_P2P = ("forward-recv", "forward-send", "backward-recv", "backward-send", "forward-send-backward-recv",
        "backward-send-forward-recv", "forward-send-forward-recv", "backward-send-backward-recv",
        "forward-backward-send-forward-backward-recv")
# megatron-core 0.19.2's region names (pipeline_parallel/schedules.py, p2p_communication.py,
# distributed/finalize_model_grads.py) → the part of the step they belong to.
REGIONS: dict[str, Part] = {
    "forward-compute": "compute", "backward-compute": "compute",
    **{name: "pipeline" for name in _P2P},
    "all-grads-sync": "grad_sync", "conditional-embedder-grads-all-reduce": "grad_sync",
    "non-tensor-parallel-grads-all-reduce": "grad_sync", "embedding-grads-all-reduce": "grad_sync",
}


class _Region:
    """One timed region: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, on_gpu: bool, spans: list):
        self.on_gpu, self.spans = on_gpu, spans

    def start(self, barrier: bool = False) -> None:  # megatron-core passes barrier=...; none is wanted here
        if self.on_gpu:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._begin = time.perf_counter()

    def stop(self) -> None:
        if self.on_gpu:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self._begin, end))
        else:
            self.spans.append(time.perf_counter() - self._begin)


class _Untimed:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self) -> None:
        pass


class StepTimers:
    """megatron-core's ``config.timers`` hook, plus the loop's own regions (:meth:`region`, :meth:`timed_batches`);
    with `enabled` False nothing is timed (megatron-core is then given no hook) and every part reads 0."""

    def __init__(self, on_gpu: bool, enabled: bool = True):
        self.on_gpu, self.enabled = on_gpu, enabled
        self._spans: dict[str, list] = {part: [] for part in (*PARTS, _WHOLE_SCHEDULE)}  # the step under way
        self._closed: dict[str, list] = {part: [] for part in self._spans}  # the interval's finished steps
        self._regions = {name: _Region(on_gpu, self._spans[part])
                         for name, part in (*REGIONS.items(), (_WHOLE_SCHEDULE, _WHOLE_SCHEDULE))}
        self._data_s = self._closed_data_s = 0.0

    def __call__(self, name: str, log_level: Optional[int] = None):
        return self._regions.get(name, _Untimed()) if self.enabled else _Untimed()

    @contextlib.contextmanager
    def region(self, part: Part) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        timer = _Region(self.on_gpu, self._spans[part])
        timer.start()
        yield
        timer.stop()

    def timed_batches(self, batches: Iterator) -> Iterator:
        """`batches` with the time spent waiting for each counted as data (host time: the loader runs there)."""
        if not self.enabled:
            yield from batches
            return
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._data_s += time.perf_counter() - start
            yield batch

    def end_step(self) -> None:
        """The step under way is finished: its regions join the interval's, unread (no wait for the device)."""
        for part, spans in self._spans.items():
            self._closed[part].extend(spans)
            spans.clear()
        self._closed_data_s += self._data_s
        self._data_s = 0.0

    def discard(self) -> None:
        """Forget the regions since the last finished step (an evaluation's forward passes, a skipped step)."""
        for spans in self._spans.values():
            spans.clear()
        self._data_s = 0.0

    def take(self) -> dict[Part, float]:
        """Seconds per part over the interval's steps, the one under way included, since the last call; on a GPU
        after one synchronisation with the device. Data waits happen inside megatron-core's forward-compute region,
        so they are taken out of compute."""
        self.end_step()
        if self.on_gpu and any(self._closed.values()):
            torch.cuda.synchronize()
        seconds = {}
        for part, spans in self._closed.items():
            seconds[part] = (sum(begin.elapsed_time(end) for begin, end in spans) / 1000.0 if self.on_gpu
                             else float(sum(spans)))
            spans.clear()
        whole = seconds.pop(_WHOLE_SCHEDULE)
        seconds["schedule"] = max(whole - seconds["compute"] - seconds["pipeline"] - seconds["grad_sync"], 0.0)
        seconds["data"] = self._closed_data_s
        seconds["compute"] = max(seconds["compute"] - self._closed_data_s, 0.0)
        self._closed_data_s = 0.0
        return seconds
