"""Bottleneck advice: rules over a log interval's time breakdown (metrics.step_time) and memory, each said once per
run with the setting to change. Thresholds, from the usage targets (communication under 20 % of the step, the GPU
busy over 80 %): pipeline waits above 15 % of the step, exposed gradient sync above 10 %, data waits above 5 %, and
on a GPU more than 30 % of its memory unused at the peak."""

from __future__ import annotations

from typing import Optional

from megatron_ext.config.schema import RecipeConfig, data_parallel_size

# The share of the step (of the GPU's memory, for "memory": unused at the peak) above which each rule speaks.
THRESHOLDS = {"pipeline": 0.15, "grad_sync": 0.10, "data": 0.05, "memory": 0.30}


def advise(cfg: RecipeConfig, world_size: int, shares: dict[str, float],
           memory_used: Optional[float] = None) -> dict[str, str]:
    """{rule: advice} for the rules this interval breaks. `shares`: each part's fraction of the step; `memory_used`:
    the peak allocated fraction of the GPU's memory (None on CPU)."""
    p, t = cfg.parallel, cfg.train
    out = {}
    if shares.get("pipeline", 0.0) > THRESHOLDS['pipeline'] and p.pipeline_model_parallel_size > 1:
        m = t.global_batch_size // (t.micro_batch_size * data_parallel_size(cfg, world_size))
        vpp = "" if p.virtual_pipeline_model_parallel_size else \
            ", or interleave stages (parallel.virtual_pipeline_model_parallel_size=2)"
        out["pipeline"] = (f"pipeline sends, receives and bubble take {100 * shares['pipeline']:.0f}% of the step "
                           f"(above {100 * THRESHOLDS['pipeline']:.0f}%): more micro batches per step shrink the "
                           f"bubble, (PP-1)/(VPP·m) — raise train.global_batch_size or lower "
                           f"train.micro_batch_size (now m = {m} per pipeline){vpp}")
    if shares.get("grad_sync", 0.0) > THRESHOLDS['grad_sync']:
        fix = ("parallel.overlap_grad_reduce=true (and parallel.overlap_param_gather=true with the distributed "
               "optimizer) to hide it behind the backward pass" if not p.overlap_grad_reduce else
               "a larger global batch per DP rank (more backward pass to hide it behind), or less DP")
        out["grad_sync"] = (f"exposed gradient sync takes {100 * shares['grad_sync']:.0f}% of the step (above "
                            f"{100 * THRESHOLDS['grad_sync']:.0f}%): {fix}")
    if shares.get("data", 0.0) > THRESHOLDS['data']:
        out["data"] = (f"waiting for data takes {100 * shares['data']:.0f}% of the step (above "
                       f"{100 * THRESHOLDS['data']:.0f}%): data.num_workers={max(2, 2 * cfg.data.num_workers)} "
                       f"loads batches in the background; check the storage's read speed")
    if memory_used is not None and 1 - memory_used > THRESHOLDS['memory']:
        recompute = f" or drop train.recompute_granularity={t.recompute_granularity}" if t.recompute_granularity else ""
        out["memory"] = (f"the peak uses {100 * memory_used:.0f}% of the GPU's memory: a larger "
                         f"train.micro_batch_size{recompute} would use the rest (python -m recipes.plan "
                         f"estimates each)")
    return out


class Advisor:
    """Says each rule's advice once per run (from the second log interval: the first holds the first step)."""

    def __init__(self, cfg: RecipeConfig, world_size: int):
        self.cfg, self.world_size, self.said, self.intervals = cfg, world_size, set(), 0

    def check(self, shares: dict[str, float], memory_used: Optional[float] = None) -> list[str]:
        self.intervals += 1
        if self.intervals == 1:
            return []
        new = {rule: text for rule, text in advise(self.cfg, self.world_size, shares, memory_used).items()
               if rule not in self.said}
        self.said.update(new)
        return list(new.values())
