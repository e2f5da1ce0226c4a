"""Stragglers: every rank's own compute time per step, gathered each log interval; the spread goes to the console
and TensorBoard, and a rank (a tensor-parallel group) slower by ``logging.straggler_factor`` than the ranks doing
the same work, or than it was itself, for ``logging.straggler_intervals`` intervals in a row is named in a warning.

Wall-clock step times are the same on every rank of a synchronous job (the fast ranks wait for the slow one in
the step's collectives), so what is compared is the time inside megatron-core's forward and backward compute,
which it reports through the ``config.timers`` hook of its schedules (:mod:`megatron_ext.metrics.step_time`
collects it). Tensor-parallel peers share their in-layer collectives, so a
slow GPU drags its TP group's numbers with it: the unit compared and named is the TP group.
"""

from __future__ import annotations

import collections
import logging
import statistics
from dataclasses import dataclass
from typing import Literal, Optional

log = logging.getLogger("megatron_ext")


@dataclass(frozen=True)
class WorkUnit:
    """Ranks that do the same work and are timed as one: a tensor-parallel group (its members wait for each other
    inside every layer, so a slow GPU drags the whole group), on one pipeline stage."""

    ranks: tuple[int, ...]
    stage: int

    def __str__(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else \
            f"ranks {', '.join(map(str, self.ranks))} (one tensor-parallel group)"
        return f"{who} on pipeline stage {self.stage}"


def work_units(stage_of_rank: list[int], tp_group_of_rank: list[int]) -> list[WorkUnit]:
    """The job's units from each rank's pipeline stage and tensor-parallel group (any id shared by its members)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, (stage, group) in enumerate(zip(stage_of_rank, tp_group_of_rank)):
        groups.setdefault((stage, group), []).append(rank)
    return [WorkUnit(tuple(ranks), stage) for (stage, _), ranks in sorted(groups.items(), key=lambda kv: kv[1])]


@dataclass(frozen=True)
class Straggler:
    unit: WorkUnit
    seconds: float  # its compute per step in this interval
    reference: float  # what it is compared with
    against: Literal["peers", "itself"]  # its stage's other units, or its own earlier intervals


class StragglerDetector:
    """Names a work unit slower than `factor` × its reference for `intervals` log intervals in a row.

    Two references, in the spirit of NVRx's relative and individual scores but against medians of like work: the
    median of the other units of the same pipeline stage (the last stage also runs the output layer and the loss,
    so stages are never compared with each other), and the unit's own median over its earlier intervals, scaled by
    how much every unit slowed down (a slower step for everyone is nobody's fault). The second finds a degraded
    device where a stage has no peers (DP 1). The first interval is warm-up and is skipped."""

    def __init__(self, factor: Optional[float], intervals: int, units: list[WorkUnit], history: int = 10):
        self.factor, self.intervals, self.units = factor, intervals, units
        self.stage_units: dict[int, list[WorkUnit]] = {}
        for unit in units:
            self.stage_units.setdefault(unit.stage, []).append(unit)
        self.past: dict[WorkUnit, collections.deque[float]] = {u: collections.deque(maxlen=history) for u in units}
        self.seen = 0
        self.streak: dict[WorkUnit, int] = {}

    def _peer_references(self, now: dict[WorkUnit, float]) -> dict[WorkUnit, float]:
        """Each unit's median of the other units of its stage: one sort per stage, then the median of the list with
        that unit's entry left out (indices past it shift by one)."""
        out = {}
        for units in self.stage_units.values():
            if len(units) < 2:
                continue
            order = sorted(units, key=now.__getitem__)
            values = [now[u] for u in order]
            k = len(values) - 1  # peers of each unit
            for i, unit in enumerate(order):
                at = [j if j < i else j + 1 for j in ((k - 1) // 2, k // 2)]
                out[unit] = (values[at[0]] + values[at[1]]) / 2
        return out

    def _own_references(self, now: dict[WorkUnit, float]) -> dict[WorkUnit, float]:
        """Each unit's median over its earlier intervals (two at least) × everyone's median slowdown against theirs."""
        base = {u: m for u, past in self.past.items() if len(past) >= 2 and (m := statistics.median(past)) > 0}
        if not base:
            return {}
        slowdown = max(statistics.median(now[u] / b for u, b in base.items()), 1.0)
        return {u: b * slowdown for u, b in base.items()}

    def update(self, times: list[float]) -> list[Straggler]:
        """Each rank's compute per step in this interval (by rank) → the units to warn about now: those whose
        streak just reached `intervals` (and again every `intervals`)."""
        if not self.factor:
            return []
        now = {u: max(times[r] for r in u.ranks) for u in self.units}
        self.seen += 1
        named = []
        if self.seen > 1:  # the first interval holds the first step (allocations, compilation)
            peers, own = self._peer_references(now), self._own_references(now)
            for unit in self.units:
                slow = [Straggler(unit, now[unit], ref, against)
                        for against, ref in (("peers", peers.get(unit)), ("itself", own.get(unit)))
                        if ref and now[unit] > self.factor * ref]
                if slow:
                    self.streak[unit] = self.streak.get(unit, 0) + 1
                    if self.streak[unit] % self.intervals == 0:
                        named.append(slow[0])
                else:
                    self.streak.pop(unit, None)
            for unit in self.units:
                if not self.streak.get(unit):  # a unit's baseline is what it does when it is not straggling
                    self.past[unit].append(now[unit])
        return named


def spread_scalars(times: list[float]) -> dict[str, float]:
    """TensorBoard scalars for one interval's per-rank compute times."""
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"perf/step_time_max_s": times[slowest], "perf/step_time_min_s": min(times),
            "perf/slowest_rank": float(slowest)}


def warn_stragglers(stragglers: list[Straggler], factor: float, intervals: int, iteration: int,
                    on_gpu: bool) -> None:
    check = ("that GPU (clocks, temperature, ECC errors: nvidia-smi -q) and its data loading" if on_gpu
             else "what else runs on that CPU's cores, and its data loading")
    for s in stragglers:
        reference = ("the median of its pipeline stage's other ranks" if s.against == "peers"
                     else "its own earlier log intervals (allowing for the others' slowdown)")
        log.warning(f"straggler: {s.unit} computed {s.seconds * 1000:.0f} ms per step at iteration {iteration}, "
                    f"{s.seconds / s.reference:.2f}× {reference} ({s.reference * 1000:.0f} ms), for {intervals}+ log "
                    f"intervals in a row (logging.straggler_factor={factor:g}); check {check}")
