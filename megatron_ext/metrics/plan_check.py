"""The run's measured step breakdown beside the planner's prediction for the same layout (the numbers
``python -m recipes.plan`` prints), with the parts that disagree named.

Measured: megatron-core's regions (:mod:`megatron_ext.metrics.step_time`), per step, averaged over the log intervals
after the first and over the ranks of each pipeline stage. Planned: :mod:`megatron_ext.planner.layouts`' step-time
components grouped the same way — compute is FLOPs plus the per-micro-batch overhead plus TP, CP and MoE
all-to-all communication (megatron-core times those inside its forward and backward compute regions, so they are
not told apart here), pipeline is the p2p transfers plus the bubble, grad sync the exposed DP reduce and gather,
optimizer the step (with an offloaded optimizer, the host's part of it too, which runs inside it).

On a GPU every part is compared with the planner's seconds for that GPU. In CPU rehearsal those seconds say nothing
about this machine; what carries over is the pipeline's cost *relative to compute*, set by the layout alone — the
bubble is (p−1)/(v·m) of the compute — so the pipeline is planned from the slowest stage's measured compute and
compared, and the other parts are shown measured only.

A part disagrees when measured and planned differ by more than ``AGREEMENT_FACTOR`` either way and one of them is at
least ``MIN_SHARE`` of the step. Why 2×: the planner's compute terms are fitted to H100 throughputs within 5 %, but
its communication terms use nominal bus bandwidths and an assumed overlap (2/3 of a micro batch's backward hides the
DP reduce) that no multi-GPU measurement has calibrated yet, and a measured bubble includes stage imbalances the
planner does not model: tens of percent off is expected from those, a factor of two is not — it points at something
the model does not know (a slow link, an unbalanced pipeline, a sync the overlap cannot hide). Memory: each stage's
planned peak (less the 2 GiB torch's allocator never sees) against ``torch.cuda.max_memory_allocated`` within
``MEMORY_TOLERANCE``, the bound docs/planner.md sets for the planner's GPU check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.hardware import GPUS
from megatron_ext.metrics.advice import stage_imbalance
from megatron_ext.planner import GIB, NON_TORCH_RESERVE_GIB, estimate, model_vocab_size, stage_peak_bytes

AGREEMENT_FACTOR = 2.0
MIN_SHARE = 0.05
MEMORY_TOLERANCE = 0.15
# The planner's step-time components in each measured part of the step: every one of them, once.
PLANNED_PARTS: dict[str, tuple[str, ...]] = {
    "compute": ("compute", "overhead", "tp_comm", "cp_comm", "moe_comm"),
    "pipeline": ("pp_p2p", "pp_bubble"),
    "grad_sync": ("dp_comm",),
    "optimizer": ("optimizer", "offload"),
}


@dataclass(frozen=True)
class PartCheck:
    """One part of the step: measured and planned seconds per step (planned None: not comparable here)."""

    part: str
    measured_s: float
    planned_s: Optional[float]
    step_s: float

    @property
    def disagrees(self) -> bool:
        if self.planned_s is None or max(self.measured_s, self.planned_s) < MIN_SHARE * self.step_s:
            return False
        low, high = sorted((self.measured_s, self.planned_s))
        return low == 0 or high / low > AGREEMENT_FACTOR

    def line(self) -> str:
        measured = f"{self.part.replace('_', ' ')}: {_seconds(self.measured_s)} ({self._share(self.measured_s)})"
        if self.planned_s is None:
            return f"{measured}, measured only"
        verdict = "DISAGREES" if self.disagrees else "agrees"
        return f"{measured}, planned {_seconds(self.planned_s)} ({self._share(self.planned_s)}): {verdict}"

    def _share(self, seconds: float) -> str:
        return f"{100 * seconds / self.step_s:.0f}% of the step"


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def planned_parts(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: str, on_gpu: bool,
                  slowest_compute_s: float) -> dict[str, Optional[float]]:
    """The planner's seconds per step for each measured part on `gpu`; in CPU rehearsal (`on_gpu` False) only the
    pipeline, scaled from the slowest stage's measured compute by the planner's pipeline-to-compute ratio."""
    if not on_gpu:  # a CPU rehearsal builds megatron-core's local layers: their pipeline-to-compute ratio
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_backend="local"))
    time = estimate(cfg, world_size, gpus_per_node, GPUS[gpu], model_vocab_size(cfg)).time
    planned = {part: sum(time[c] for c in components) for part, components in PLANNED_PARTS.items()}
    if on_gpu:
        return dict(planned)
    ratio = planned["pipeline"] / planned["compute"] if planned["compute"] else 0.0
    return {part: ratio * slowest_compute_s if part == "pipeline" else None for part in planned}


def check_against_plan(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: str, on_gpu: bool,
                       stages: dict[int, dict[str, float]],
                       peaks: Optional[dict[int, float]] = None) -> list[str]:
    """Summary lines: the measured breakdown (`stages`: pipeline stage → part → seconds per step, "step" included,
    averaged over its ranks) beside the planner's for the same layout, each disagreeing part named; `peaks`: each
    stage's peak allocated bytes (GPU)."""
    mean = {part: sum(s[part] for s in stages.values()) / len(stages) for part in next(iter(stages.values()))}
    compute = {stage: s["compute"] for stage, s in stages.items()}
    planned = planned_parts(cfg, world_size, gpus_per_node, gpu, on_gpu, max(compute.values()))
    checks = [PartCheck(part, mean.get(part, 0.0), planned[part], mean["step"]) for part in PLANNED_PARTS]
    # a part this layout does not have (the pipeline at PP 1, gradient sync at DP 1) is left out
    checks = [c for c in checks if c.measured_s >= 0.005 * c.step_s or c.planned_s]
    where = (f"planned for {gpu}" if on_gpu else f"CPU rehearsal: the pipeline is planned from the layout and the "
             f"measured compute, the planner's other parts are {gpu} times and not comparable here")
    lines = [f"step breakdown vs the planner, per step, mean over ranks ({where}):"]
    lines += [f"  {check.line()}" for check in checks]
    if peaks:
        vocab = model_vocab_size(cfg)
        for stage, peak in sorted(peaks.items()):
            plan = stage_peak_bytes(cfg, vocab, world_size, stage) - NON_TORCH_RESERVE_GIB * GIB
            verdict = "agrees" if abs(peak - plan) <= MEMORY_TOLERANCE * plan else "DISAGREES"
            lines.append(f"  memory, pipeline stage {stage}: peak {peak / GIB:.1f} GiB allocated, planned "
                         f"{plan / GIB:.1f} GiB: {verdict}")
    disagreeing = [c.part.replace("_", " ") for c in checks if c.disagrees]
    if disagreeing:
        lines.append(f"  differs from the plan by more than {AGREEMENT_FACTOR:.0f}×: {', '.join(disagreeing)}")
        imbalance = stage_imbalance(cfg, compute)
        if imbalance and "pipeline" in {c.part for c in checks if c.disagrees}:
            lines.append(f"  {imbalance}")
    return lines
