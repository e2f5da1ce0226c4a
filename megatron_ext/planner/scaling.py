"""Strong and weak scaling of a recipe's model: the best layout at each GPU count with the global batch fixed (strong)
or the batch per GPU fixed (weak), the speed-up over the smallest count, the efficiency (speed-up / ideal), and the
time term that costs the efficiency: what grew in GPU-seconds per token against the smallest count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.planner.estimate import Estimate
from megatron_ext.planner.search import plan

Scaling = Literal["strong", "weak"]
# the step-time parts as the causes a user can act on
CAUSES = {"pp_bubble": "pipeline bubble", "pp_p2p": "exposed communication", "tp_comm": "exposed communication",
          "cp_comm": "exposed communication", "moe_comm": "exposed communication", "dp_comm": "exposed communication",
          "overhead": "per-micro-batch overhead", "optimizer": "optimizer step", "offload": "optimizer offload"}


@dataclass
class ScalingPoint:
    """The best layout that fits at one GPU count (None: nothing fits), against the smallest count's."""

    gpus: int
    global_batch_size: int
    best: Optional[Estimate]
    speedup: Optional[float] = None  # total tokens/s over the smallest count's
    efficiency: Optional[float] = None  # speedup / (gpus / smallest gpus)
    cause: Optional[str] = None  # the term that grew most in GPU-seconds per token

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"gpus": self.gpus, "global_batch_size": self.global_batch_size,
                "layout": best.layout.label() if best else None,
                "tokens_per_s_per_gpu": round(best.tokens_per_s_per_gpu, 1) if best else None,
                "speedup": _round(self.speedup), "efficiency": _round(self.efficiency), "cause": self.cause}


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 4)


def gpu_seconds_per_token(e: Estimate, gpus: int, global_batch_size: int, seq_length: int) -> dict[str, float]:
    """Each step-time part as GPU-seconds per trained token: constant under ideal scaling."""
    tokens = global_batch_size * seq_length
    return {k: v * gpus / tokens for k, v in e.time.items() if k != "step"}


def scaling_cause(base: Estimate, point: Estimate, base_gpus: int, gpus: int, base_batch: int, batch: int,
                  seq_length: int) -> str:
    """What costs `point` its efficiency against `base`: the part that grew most in GPU-seconds per token — compute
    that grew under a heavier recompute is memory forcing recompute."""
    before = gpu_seconds_per_token(base, base_gpus, base_batch, seq_length)
    after = gpu_seconds_per_token(point, gpus, batch, seq_length)
    part = max(after, key=lambda k: after[k] - before.get(k, 0.0))
    if part == "compute":
        heavier = {None: 0, "selective": 1, "full": 2}
        if heavier[point.layout.recompute] > heavier[base.layout.recompute]:
            return "memory forcing recompute"
        return "compute per GPU (smaller matrices and micro batches)"
    return CAUSES.get(part, part)


def scaling(cfg: RecipeConfig, gpu_counts: list[int], gpus_per_node: int, gpu: str, mode: Scaling
            ) -> list[ScalingPoint]:
    """The best fitting layout of `cfg`'s model at each of `gpu_counts` (ascending): strong scaling keeps
    train.global_batch_size; weak scaling keeps the smallest count's batch per GPU."""
    counts = sorted(gpu_counts)
    base_batch = cfg.train.global_batch_size
    points = []
    for gpus in counts:
        batch = base_batch if mode == "strong" else max(1, base_batch * gpus // counts[0])
        sized = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=batch))
        best = next((e for e in plan(sized, gpus, gpus_per_node, gpu) if e.fits), None)
        points.append(ScalingPoint(gpus, batch, best))
    base = points[0]
    if base.best is None:
        return points
    seq = cfg.model.seq_length
    for p in points:
        if p.best is None:
            continue
        p.speedup = p.best.tokens_per_s_per_gpu * p.gpus / (base.best.tokens_per_s_per_gpu * base.gpus)
        p.efficiency = p.speedup / (p.gpus / base.gpus)
        if p is not base:
            p.cause = scaling_cause(base.best, p.best, base.gpus, p.gpus, base.global_batch_size,
                                    p.global_batch_size, seq)
    return points
