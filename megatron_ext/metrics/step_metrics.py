"""The loop's metrics, as torchtitan's metrics processor: megatron-core's timers on this rank
(:mod:`megatron_ext.metrics.step_time`), closed unread after each step (:meth:`StepMetrics.step_done`); each settled
step's numbers (:meth:`StepMetrics.record`); and each log interval one all-gather of every rank's breakdown, peak memory
and compute, from which rank 0 writes the console line and scalars (the mean over ranks: a pipeline's stages spend
their steps differently), warns about stragglers, gives advice, and at the end sets the run's breakdown beside the
planner's prediction (:mod:`megatron_ext.metrics.plan_check`)."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.distributed.parallel import gather_from_ranks
from megatron_ext.metrics.advice import Advisor, Machine, exposed_grad_sync_share
from megatron_ext.metrics.plan_check import check_against_plan
from megatron_ext.metrics.run_logger import RunLogger, breakdown_shares
from megatron_ext.metrics.step_time import PARTS, StepTimers
from megatron_ext.planner import planner_gpu
from megatron_ext.resilience.stragglers import StragglerDetector, work_units

_GATHERED = (*PARTS, "step", "peak_bytes")  # what each rank contributes per log interval


class StepMetrics:
    """Owns the step timers (``timers`` is megatron-core's ``config.timers`` hook) and what is made of them."""

    def __init__(self, cfg: RecipeConfig, logger: RunLogger, device: torch.device):
        """Collective: learns every rank's pipeline stage and tensor-parallel group."""
        self.cfg, self.logger, self.device = cfg, logger, device
        self.on_gpu = device.type == "cuda"
        tp_group = min(dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()))
        ranks = gather_from_ranks([parallel_state.get_pipeline_model_parallel_rank(), tp_group], device)
        self.stage_of_rank = [int(stage) for stage, _ in ranks]
        self.world_size = len(ranks)
        self.gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.gpu = planner_gpu(cfg)
        self.timed = cfg.logging.step_breakdown
        self.timers = StepTimers(self.on_gpu, self.timed)
        self.stragglers = StragglerDetector(cfg.logging.straggler_factor, cfg.logging.straggler_intervals,
                                            work_units(self.stage_of_rank, [int(group) for _, group in ranks]))
        self.advisor = Advisor(cfg, self.world_size, Machine(self.gpu, self.gpus_per_node) if self.gpu else None)
        self._interval: dict[str, float] = {}  # this rank's seconds per part since the last log, and "steps"
        self._intervals = 0
        self._run: dict[int, dict[str, float]] = {}  # stage → part → seconds, summed over steps after interval 1
        self._run_steps = 0.0
        self._peaks: dict[int, float] = {}  # stage → peak allocated bytes of its fullest rank (GPU)

    @property
    def core_timers(self) -> Optional[StepTimers]:
        """What megatron-core's ``config.timers`` gets: the timers, or None (it then times nothing) with
        logging.step_breakdown=false."""
        return self.timers if self.timed else None

    def discard(self) -> None:
        """Forget what the timers saw since the last step (an evaluation's forward passes, a skipped step)."""
        self.timers.discard()

    def step_done(self) -> None:
        """A training step is queued: its timed regions join the interval's, unread (reading a CUDA event waits for
        the device; they are read on the logging step)."""
        self.timers.end_step()

    def record(self, iteration: int, loss: float, lr: float, grad_norm: float, step_time: float,
               loss_scale: Optional[float] = None, extra: Optional[dict[str, float]] = None) -> None:
        """One training step, once settled, in order (collective on log-interval steps); `loss_scale`: fp16's;
        `extra`: more of the step's scalars (an MoE model's router metrics)."""
        parts = self._interval
        for part, seconds in (("step", step_time), ("steps", 1.0)):
            parts[part] = parts.get(part, 0.0) + seconds
        if iteration % self.cfg.logging.log_interval:
            self.logger.step(iteration, loss, lr, grad_norm, step_time, console=False, loss_scale=loss_scale,
                             extra=extra)
            return
        parts.update(self.timers.take())
        steps, self._interval = parts["steps"], {}
        if not self.timed:
            self.logger.step(iteration, loss, lr, grad_norm, step_time, console=True, loss_scale=loss_scale,
                             extra=extra)
            return
        peak = float(torch.cuda.max_memory_allocated()) if self.on_gpu else 0.0
        rows = [dict(zip(_GATHERED, row)) for row in
                gather_from_ranks([parts.get(p, 0.0) / steps for p in _GATHERED[:-1]] + [peak], self.device)]
        breakdown = {part: sum(row[part] for row in rows) / len(rows) for part in (*PARTS, "step")}
        compute = [row["compute"] for row in rows]
        self.logger.step(iteration, loss, lr, grad_norm, step_time, console=True, rank_times=compute,
                         breakdown=breakdown, loss_scale=loss_scale, extra=extra)
        self.logger.stragglers(iteration, self.stragglers.update(compute))
        stages = self._by_stage(rows)
        self._add_to_run(stages, rows, steps)
        memory_used = (max(row["peak_bytes"] for row in rows) / torch.cuda.get_device_properties(0).total_memory
                       if self.on_gpu else None)
        shares = {**breakdown_shares(breakdown), "grad_sync": exposed_grad_sync_share(rows)}
        self.logger.advice(self.advisor.check(shares, memory_used,
                                              {stage: parts["compute"] for stage, parts in stages.items()}))

    def _add_to_run(self, stages: dict[int, dict[str, float]], rows: list[dict[str, float]], steps: float) -> None:
        """The run-wide totals the summary's check uses: per-stage seconds (after the first interval, which holds the
        first step's allocations and compilation) and each stage's peak memory."""
        self._intervals += 1
        if self._intervals > 1:
            for stage, seconds in stages.items():
                total = self._run.setdefault(stage, {})
                for part, value in seconds.items():
                    total[part] = total.get(part, 0.0) + value * steps
            self._run_steps += steps
        if self.on_gpu:
            for rank, row in enumerate(rows):
                stage = self.stage_of_rank[rank]
                self._peaks[stage] = max(self._peaks.get(stage, 0.0), row["peak_bytes"])

    def _by_stage(self, rows: list[dict[str, float]]) -> dict[int, dict[str, float]]:
        """Each pipeline stage's mean over its ranks, per part (and "step")."""
        out: dict[int, dict[str, float]] = {}
        for stage in sorted(set(self.stage_of_rank)):
            mine = [row for rank, row in enumerate(rows) if self.stage_of_rank[rank] == stage]
            out[stage] = {part: sum(row[part] for row in mine) / len(mine) for part in (*PARTS, "step")}
        return out

    def plan_check(self) -> list[str]:
        """The run's breakdown beside the planner's, for the summary (rank 0; empty before two log intervals)."""
        if not self.logger.enabled or not self._run_steps or self.gpu is None:
            return []
        stages = {stage: {part: total / self._run_steps for part, total in parts.items()}
                  for stage, parts in self._run.items()}
        return check_against_plan(self.cfg, self.world_size, self.gpus_per_node, self.gpu, self.on_gpu, stages,
                                  self._peaks or None)
