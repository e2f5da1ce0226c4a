"""Stragglers: every rank's own compute time per step, gathered each log interval; the spread goes to the console
and TensorBoard, and a rank slower than the median of the others by ``logging.straggler_factor`` for
``logging.straggler_intervals`` intervals in a row is named in a warning.

Wall-clock step times are the same on every rank of a synchronous job (the fast ranks wait for the slow one in
the step's collectives), so what is compared is the time inside megatron-core's forward and backward compute,
which it reports through the ``config.timers`` hook of its schedules. On a GPU the timer records CUDA events (no
synchronisation) read after the step's own sync. Tensor-parallel peers share their in-layer collectives, so a
slow GPU drags its TP group's numbers with it: the warning names ranks, which narrows it to one TP group.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("megatron_ext")


class _Interval:
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


class ComputeTimers:
    """What megatron-core's schedules call as ``config.timers(name, log_level).start()/stop()``: sums the forward
    and backward compute regions; every other region (sends, receives, grad sync) is ignored."""

    TIMED = ("forward-compute", "backward-compute")

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self._spans: list = []
        self._timers = {name: _Interval(on_gpu, self._spans) for name in self.TIMED}

    def __call__(self, name: str, log_level: Optional[int] = None):
        return self._timers.get(name, _Untimed())

    def take(self) -> float:
        """Seconds of compute since the last call (call after the step has synchronised with the device)."""
        spans, self._spans[:] = list(self._spans), []
        if self.on_gpu:
            return sum(begin.elapsed_time(end) for begin, end in spans) / 1000.0
        return float(sum(spans))


def gather_times(seconds: float, device: torch.device) -> list[float]:
    """Every rank's value, indexed by rank (collective)."""
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.item() for t in out]


class StragglerDetector:
    """Counts, per rank, consecutive intervals slower than `factor` × the median of the other ranks."""

    def __init__(self, factor: Optional[float], intervals: int):
        self.factor, self.intervals = factor, intervals
        self.streak: dict[int, int] = {}

    def update(self, times: list[float]) -> list[int]:
        """The ranks to warn about now: those whose streak just reached `intervals` (again every `intervals`)."""
        if not self.factor or len(times) < 2:
            return []
        named = []
        for rank, t in enumerate(times):
            others = statistics.median(times[:rank] + times[rank + 1:])
            if others > 0 and t > self.factor * others:
                self.streak[rank] = self.streak.get(rank, 0) + 1
                if self.streak[rank] % self.intervals == 0:
                    named.append(rank)
            else:
                self.streak.pop(rank, None)
        return named


def spread_scalars(times: list[float]) -> dict[str, float]:
    """TensorBoard scalars for one interval's per-rank compute times."""
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"perf/step_time_max_s": times[slowest], "perf/step_time_min_s": min(times),
            "perf/slowest_rank": float(slowest)}


def warn_stragglers(named: list[int], times: list[float], factor: float, intervals: int, iteration: int) -> None:
    for rank in named:
        others = statistics.median(times[:rank] + times[rank + 1:])
        log.warning(f"straggler: rank {rank} computed {times[rank] * 1000:.0f} ms per step at iteration {iteration}, "
                    f"{times[rank] / others:.2f}× the other ranks' median {others * 1000:.0f} ms, for "
                    f"{intervals}+ log intervals in a row (logging.straggler_factor={factor:g}); check that "
                    f"rank's GPU (clocks, temperature, ECC) and data loading")
