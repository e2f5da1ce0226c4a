"""Goodput of a long pretraining job by Monte Carlo: failures, loss-spike rewinds, checkpoints and hot spare nodes,
where the closed form of :mod:`.goodput` (no spares, no spikes) stops.

A job needs ``work_s`` seconds of training. It trains in segments of ``interval_s`` closed by a save that stalls it
``stall_s``; interruptions arrive at random while it trains or saves: node failures (the job's MTBF) and loss spikes
(``spikes_per_hour``). An interruption loses the segment under way. A spike costs a rewind (``rewind_s``: reload the
last checkpoint). A failure costs a restart onto a hot spare (``spare_restart_s``) while one is free — the failed
node comes back as a spare after ``repair_s`` — else a cold restart (``restart_s``: requeue, a replacement node, start-
up, checkpoint load); a failure during a restart repeats it. Goodput is the productive share of every GPU-second the
job holds, its spare nodes' included.

Without spares and spikes the expected wall-clock is Daly's exactly, ``(W/τ)·M·e^{R/M}·(e^{(τ+C)/M} − 1)``
(:func:`expected_wall_s`), which tests/unit/test_simulate.py holds the simulation to. It needs numpy but not torch
(``recipes.plan`` does not import it, and runs without numpy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Job:
    work_s: float  # training time the job needs (train_iters × step time)
    gpus: int  # training GPUs
    gpus_per_node: int
    mtbf_s: float  # the training GPUs' mean time between failures
    interval_s: float  # training between two saves
    stall_s: float  # what one save holds training up
    restart_s: float  # a restart without a free spare
    spare_nodes: int = 0
    spare_restart_s: float = 0.0  # a restart onto a hot spare
    repair_s: float = 0.0  # until a failed node is back, as a spare
    spikes_per_hour: float = 0.0  # loss spikes that need a rewind, per hour of training
    rewind_s: float = 0.0  # a rewind's reload


@dataclass(frozen=True)
class Simulated:
    goodput: float  # mean over the trials
    goodput_std: float
    goodput_p5: float
    goodput_p95: float
    wall_s: float  # mean
    failures: float  # mean per job
    spikes: float
    cold_restarts: float  # failures that found no free spare

    def to_dict(self) -> dict:
        return asdict(self)


def expected_wall_s(job: Job) -> float:
    """Daly's expected wall-clock for `job` without spares and spikes (and a whole number of segments)."""
    m, segment = job.mtbf_s, job.interval_s + job.stall_s
    return job.work_s / job.interval_s * m * math.exp(job.restart_s / m) * math.expm1(segment / m)


def _restart_s(rng: np.random.Generator, cost: np.ndarray, mtbf_s: float) -> np.ndarray:
    """Each restart of `cost` seconds, repeated while a failure interrupts it: the wall-clock it takes."""
    total, pending = np.zeros_like(cost), np.ones(cost.shape, dtype=bool)
    while pending.any():
        until = rng.exponential(mtbf_s, cost.shape)
        failed = pending & (until < cost)
        total += np.where(failed, until, np.where(pending, cost, 0.0))
        pending = failed
    return total


def simulate(job: Job, trials: int = 200, seed: int = 0) -> Simulated:
    """`trials` independent runs of `job`, advanced interruption by interruption (vectorised over the trials)."""
    rng = np.random.default_rng(seed)
    segment = job.interval_s + job.stall_s
    spike_rate = job.spikes_per_hour / 3600.0
    rate = 1.0 / job.mtbf_s + spike_rate
    done, wall = np.zeros(trials), np.zeros(trials)
    failures, spikes, cold = np.zeros(trials), np.zeros(trials), np.zeros(trials)
    spare_free_at = np.zeros((trials, job.spare_nodes))  # when each spare node is (back) in service
    rows = np.arange(trials)
    running = np.ones(trials, dtype=bool)
    while running.any():
        remaining = job.work_s - done
        whole = np.floor(remaining / job.interval_s + 1e-9)
        rest = np.clip(remaining - whole * job.interval_s, 0.0, None)
        to_finish = whole * segment + np.where(rest > 1e-9, rest + job.stall_s, 0.0)
        until = rng.exponential(1.0 / rate, trials)
        finishing = running & (until >= to_finish)
        wall += np.where(finishing, to_finish, 0.0)
        done = np.where(finishing, job.work_s, done)
        hit = running & ~finishing
        wall += np.where(hit, until, 0.0)
        done += np.where(hit, np.minimum(np.floor(until / segment), whole) * job.interval_s, 0.0)
        spike = hit & (rng.random(trials) < spike_rate / rate)
        failed = hit & ~spike
        spikes += spike
        failures += failed
        wall += np.where(spike, job.rewind_s, 0.0)
        cost = np.full(trials, job.restart_s)
        if job.spare_nodes:
            slot = spare_free_at.argmin(axis=1)
            free = failed & (spare_free_at[rows, slot] <= wall)
            spare_free_at[rows[free], slot[free]] = wall[free] + job.repair_s
            cost = np.where(free, job.spare_restart_s, cost)
        cold += failed & (cost == job.restart_s)
        wall += np.where(failed, _restart_s(rng, np.where(failed, cost, 0.0), job.mtbf_s), 0.0)
        running = done < job.work_s
    held = job.gpus + job.spare_nodes * job.gpus_per_node
    goodput = job.work_s * job.gpus / (wall * held)
    return Simulated(float(goodput.mean()), float(goodput.std()), float(np.percentile(goodput, 5)),
                     float(np.percentile(goodput, 95)), float(wall.mean()), float(failures.mean()),
                     float(spikes.mean()), float(cold.mean()))


def sweep(job: Job, intervals_s: list[float], spare_counts: list[int], trials: int = 200,
          seed: int = 0) -> dict[int, list[Simulated]]:
    """{spare nodes: [the job simulated at each interval]}, every point from the same seed."""
    return {spares: [simulate(replace(job, interval_s=interval, spare_nodes=spares), trials, seed)
                     for interval in intervals_s] for spares in spare_counts}
