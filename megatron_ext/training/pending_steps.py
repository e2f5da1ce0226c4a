"""Training steps whose numbers are still on the device. Each step leaves its loss (partial sums, all-reduced on the
device: NCCL enqueues the collective and the host goes on), its non-finite flags, its gradient norm and its MoE
router scalars as tensors; :meth:`PendingSteps.settle` reads all of them in one host read when the loop must know
them — a logging step, an evaluation, a checkpoint save, the end of the run. Between those the host never waits for
the device, so it keeps queueing the next step's kernels while the current one runs (as Megatron-LM's and
torchtitan's loops log every N steps). A step whose update depends on them reads its own flags at once
(:meth:`newest_now`): train.skip_nonfinite_steps and train.spike_policy=skip skip before the update, and fp16's grad
scaler reads its overflow flag on the host anyway.

With neither, a non-finite step is found when its interval settles: the run stops there, naming the first
non-finite iteration as before; no checkpoint is written in between, since a save settles first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

Scalar = Union[torch.Tensor, float]


@dataclass
class SettledStep:
    """A training step that updated the weights, with its numbers on the host."""

    iteration: int
    first_sample: int  # the first of the global batch's samples (consumed_samples before the step)
    loss: float  # the global batch's token-weighted mean
    grad_norm: float
    lr: float
    step_time: float  # the settled interval's mean (on a GPU the host's time of one step is not the device's)
    router: dict[str, float]


@dataclass
class Settled:
    steps: list[SettledStep]
    first_nonfinite: Optional[tuple[int, torch.Tensor]]  # (iteration, this rank's [loss, grads] flags) of the first


@dataclass
class _Step:
    iteration: int
    first_sample: int
    totals: torch.Tensor  # [loss sum, tokens, loss non-finite, grads non-finite], summed over every rank
    local_flags: torch.Tensor  # this rank's [loss, grads] non-finite flags, to name the ranks that saw it
    router: dict[str, Scalar]
    lr: float
    grad_norm: Scalar = 0.0
    seconds: float = 0.0  # the host's time for the step (and the settle's wait, for the newest)


def loss_totals(losses_reduced: list[dict[str, torch.Tensor]], device: torch.device,
                nonfinite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[loss sum, tokens, flags...] of the global batch, all-reduced on the device from the last pipeline stage's
    partial sums (every rank joins; TP replicas of the last stage add identical sums, which scale numerator and
    denominator alike, so the ratio is exact)."""
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    for item in losses_reduced:
        totals[:2] += item["lm loss"].to(totals)
    if nonfinite is not None:
        totals[2:] = nonfinite.to(totals)
    dist.all_reduce(totals)
    return totals


def global_mean_loss(losses_reduced: list[dict[str, torch.Tensor]], device: torch.device) -> float:
    """The token-weighted mean loss over the global batch, read now (an evaluation's)."""
    loss_sum, tokens = loss_totals(losses_reduced, device)[:2].tolist()
    return loss_sum / tokens


class PendingSteps:
    """The loop's steps since the last settle, oldest first."""

    def __init__(self, device: torch.device):
        self.device = device
        self._steps: list[_Step] = []

    def add(self, iteration: int, first_sample: int, losses_reduced: list[dict[str, torch.Tensor]],
            local_flags: torch.Tensor, router: dict[str, Scalar], lr: float) -> None:
        """Step `iteration` (on the global batch from sample `first_sample`) has its forward and backward queued:
        its loss and flags start their all-reduce."""
        self._steps.append(_Step(iteration, first_sample, loss_totals(losses_reduced, self.device, local_flags),
                                 local_flags, router, lr))

    def newest_now(self) -> tuple[float, bool]:
        """The newest step's loss and whether any rank saw a non-finite loss or gradient in it: one host read, for a
        decision that must precede the update."""
        loss_sum, tokens, *flags = self._steps[-1].totals.tolist()
        return loss_sum / tokens, any(flags)

    def drop_newest(self) -> None:
        """The newest step did not update the weights (skipped): it is not a training step."""
        self._steps.pop()

    def updated(self, grad_norm: Optional[Scalar]) -> None:
        """The newest step's update is queued; its gradient norm is a device tensor with TE's multi-tensor kernels
        or :func:`~megatron_ext.training.optimizer.keep_grad_norm_on_device`."""
        self._steps[-1].grad_norm = 0.0 if grad_norm is None else grad_norm

    def took(self, seconds: float) -> None:
        """The host's time for the newest step."""
        self._steps[-1].seconds = seconds

    def settle(self) -> Settled:
        """Every pending step's numbers, in one host read (it waits for the device to finish them)."""
        steps, self._steps = self._steps, []
        if not steps:
            return Settled([], None)
        values: list[torch.Tensor] = []  # what is still on the device, in one flat tensor
        for step in steps:
            values.append(step.totals)
            values.extend(v.reshape(1).to(device=self.device, dtype=torch.float64)
                          for v in (step.grad_norm, *step.router.values()) if isinstance(v, torch.Tensor))
        waited = time.perf_counter()
        flat = iter(torch.cat(values).tolist())
        steps[-1].seconds += time.perf_counter() - waited  # the device finishing what the host queued ahead
        mean_seconds = sum(step.seconds for step in steps) / len(steps)
        settled, first_nonfinite = [], None
        for step in steps:
            loss_sum, tokens, loss_bad, grads_bad = (next(flat) for _ in range(4))
            grad_norm, *router = (next(flat) if isinstance(v, torch.Tensor) else float(v)
                                  for v in (step.grad_norm, *step.router.values()))
            if (loss_bad or grads_bad) and first_nonfinite is None:
                first_nonfinite = (step.iteration, step.local_flags)
            settled.append(SettledStep(step.iteration, step.first_sample, loss_sum / tokens, grad_norm, step.lr, mean_seconds,
                                       dict(zip(step.router, router))))
        return Settled(settled, first_nonfinite)
