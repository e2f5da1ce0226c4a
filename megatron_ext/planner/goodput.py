"""The checkpoint interval that maximises expected goodput — the share of wall-clock that advances the model — for a
job of N GPUs that fail at a given rate: Young (1974) and Daly (2006), "A higher order estimate of the optimum
checkpoint interval for restart dumps".

A run alternates τ seconds of training with a save that stalls it C seconds; failures arrive at random with the job's
mean time between failures M (one GPU's, divided by the GPU count). Each failure costs the restart R (requeue,
start-up, checkpoint load) plus, on average, half a segment of lost work. To first order the wasted share is
``C/(τ+C) + (R + (τ+C)/2)/M``; its minimum is near Young's ``τ = √(2CM)``, and Daly's higher-order estimate
(:func:`daly_interval_s`) is what the planner recommends. An asynchronous save stalls training only for its copy to
host memory, but the next save waits for the previous write: an interval shorter than the write adds the difference
to the stall, so none is recommended below it. Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.planner.layout import model_vocab_size
from megatron_ext.planner.static_memory import checkpoint_bytes

# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4): 419 unexpected interruptions in a 54-day
# snapshot of pretraining on 16,384 H100 GPUs — about one every 3 hours for the job
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# Aggregate write bandwidth to checkpoint.save's file system when not given
DEFAULT_WRITE_GB_S = 10.0
# A restart's cost when not measured: requeue, process start, rendezvous and checkpoint load of a large job
DEFAULT_RESTART_S = 600.0
# The stall of an asynchronous save: the GPU→host copy of this rank's shards, measured at 34 GB/s (17 GB in 0.5 s on
# an H100, docs/performance.md "Checkpoint stall")
ASYNC_STAGING_GB_S = 34.0


def job_mtbf_s(gpus: int, failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR) -> float:
    """The job's mean time between failures, in seconds: any one of its GPUs failing stops it."""
    return 3600.0 / (gpus * failures_per_gpu_hour)


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: √(2·C·M)."""
    return math.sqrt(2 * stall_s * mtbf_s)


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (his eq. 37): √(2CM)·(1 + ⅓√(C/2M) + ⅑·C/2M) − C while C < 2M, else M."""
    if stall_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = stall_s / (2 * mtbf_s)
    return young_interval_s(stall_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall_s


def expected_goodput(interval_s: float, stall_s: float, mtbf_s: float, restart_s: float,
                     background_write_s: float = 0.0) -> float:
    """The share of wall-clock that advances the model, to first order (the module's docstring), at least 0; an
    asynchronous save's `background_write_s` beyond the interval is waited for."""
    stall = stall_s + max(0.0, background_write_s - interval_s)
    segment = interval_s + stall
    return max(0.0, 1.0 - stall / segment - (restart_s + segment / 2) / mtbf_s)


@dataclass(frozen=True)
class CheckpointInterval:
    steps: int  # the recommended checkpoint.save_interval
    interval_s: float
    goodput: float  # expected at `steps`
    configured_steps: Optional[int]  # checkpoint.save_interval as set (None: unset)
    configured_goodput: Optional[float]
    mtbf_s: float
    stall_s: float
    background_write_s: float
    restart_s: float
    failures_per_gpu_hour: float

    def to_dict(self) -> dict:
        return asdict(self)


def checkpoint_write_s(cfg: RecipeConfig, write_gb_s: float = DEFAULT_WRITE_GB_S,
                       vocab_size: Optional[int] = None) -> float:
    """Seconds to write one checkpoint of `cfg` (weights and optimizer state) at `write_gb_s` (aggregate); the
    vocabulary is the model's (:func:`model_vocab_size`, which may read the tokenizer) unless given."""
    return checkpoint_bytes(cfg, vocab_size or model_vocab_size(cfg)) / 1e9 / write_gb_s


def save_stall_s(checkpoint_bytes_per_gpu: float, write_gb_s_per_gpu: float, asynchronous: bool) -> float:
    """How long one save holds training up: the GPU→host staging copy when asynchronous, else the whole write."""
    return checkpoint_bytes_per_gpu / 1e9 / (ASYNC_STAGING_GB_S if asynchronous else write_gb_s_per_gpu)


def checkpoint_interval(step_s: float, stall_s: float, gpus: int, configured_steps: Optional[int],
                        background_write_s: float = 0.0,
                        failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR,
                        restart_s: float = DEFAULT_RESTART_S) -> CheckpointInterval:
    """Daly's interval (not below an asynchronous save's `background_write_s`) in whole steps of `step_s`, at least
    one, with the expected goodput there and at the configured interval."""
    mtbf = job_mtbf_s(gpus, failures_per_gpu_hour)
    steps = max(1, math.ceil(background_write_s / step_s), round(daly_interval_s(stall_s, mtbf) / step_s))

    def goodput(n: int) -> float:
        return expected_goodput(n * step_s, stall_s, mtbf, restart_s, background_write_s)

    return CheckpointInterval(steps, steps * step_s, goodput(steps), configured_steps,
                              goodput(configured_steps) if configured_steps else None, mtbf, stall_s,
                              background_write_s, restart_s, failures_per_gpu_hour)


def recipe_checkpoint_interval(cfg: RecipeConfig, gpus: int, step_s: float, vocab_size: int,
                               write_gb_s: float = DEFAULT_WRITE_GB_S,
                               failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR,
                               restart_s: float = DEFAULT_RESTART_S) -> CheckpointInterval:
    """:func:`checkpoint_interval` for `cfg` on `gpus` at `step_s` per step: its checkpoint's size shared by the
    GPUs, asynchronous unless checkpoint.async_save is false (a GPU run's default)."""
    size = checkpoint_bytes(cfg, vocab_size)
    asynchronous = cfg.checkpoint.async_save is not False
    return checkpoint_interval(step_s, save_stall_s(size / gpus, write_gb_s / gpus, asynchronous), gpus,
                               cfg.checkpoint.save_interval,
                               checkpoint_write_s(cfg, write_gb_s, vocab_size) if asynchronous else 0.0,
                               failures_per_gpu_hour, restart_s)
