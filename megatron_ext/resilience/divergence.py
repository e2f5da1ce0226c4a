"""Divergence: a non-finite loss or gradient stops the run at its step, naming where it was seen first (or is
skipped, up to train.skip_nonfinite_steps). Loss spikes are :mod:`.spikes`'s.

The check runs before the optimizer step, so a skipped step leaves weights, moments and LR schedule untouched.
It replaces megatron-core's ``check_for_nan_in_grad`` (which reports "iteration -1": the iteration lives in
Megatron-LM's training loop, not in megatron-core) at the same cost, one reduction over each gradient buffer.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.distributed.parallel import grad_buffers
from megatron_ext.errors import DivergenceError

log = logging.getLogger("megatron_ext")

LOSS_NONFINITE, GRADS_NONFINITE = 1, 2


def step_sums(losses_reduced: list[dict[str, torch.Tensor]], model: list, device: torch.device,
              check_grads: bool = True) -> torch.Tensor:
    """[this rank's loss summed over the step's micro batches, its gradient buffers summed] as a float tensor on
    `device` (0 where there is none: loss sums exist only on the last pipeline stage; `check_grads` False — fp16, whose
    overflowing scaled gradients are the grad scaler's to skip — leaves the gradients out). One reduction over each
    gradient buffer and no host sync, so its flags can ride along the step's loss all-reduce; a non-finite value
    anywhere makes its sum non-finite."""
    loss_sum = torch.zeros((), device=device)
    if losses_reduced:
        loss_sum = torch.stack([item["lm loss"][0] for item in losses_reduced]).to(device).float().sum()
    grad_sums = [buffer.sum(dtype=torch.float32) for chunk in model for buffer in grad_buffers(chunk)
                 ] if check_grads else []
    grad_sum = torch.stack(grad_sums).to(device).sum() if grad_sums else torch.zeros_like(loss_sum)
    return torch.stack([loss_sum, grad_sum])


def nonfinite_flags(sums: torch.Tensor) -> torch.Tensor:
    """[loss non-finite, grads non-finite] on this rank (1.0/0.0) from :func:`step_sums`."""
    return (~torch.isfinite(sums)).to(sums.dtype)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe_nonfinite(iteration: int, local_flags: torch.Tensor) -> str:
    """Which ranks and pipeline stages saw it (collective: every rank joins and gets the same text)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    mine = torch.tensor([int(local_flags[0].item()) * LOSS_NONFINITE | int(local_flags[1].item()) * GRADS_NONFINITE,
                         pp_rank], dtype=torch.int64, device=local_flags.device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    flags = {rank: (int(t[0]), int(t[1])) for rank, t in enumerate(gathered)}
    loss_ranks = [r for r, (f, _) in flags.items() if f & LOSS_NONFINITE]
    grad_ranks = [r for r, (f, _) in flags.items() if f & GRADS_NONFINITE]
    if loss_ranks:
        stage = flags[loss_ranks[0]][1]
        text = (f"non-finite loss at iteration {iteration}, first seen on pipeline stage {stage} "
                f"({_ranks(loss_ranks)}), where the loss is computed")
        if grad_ranks:
            text += f"; gradients non-finite on {_ranks(grad_ranks)}"
        return text
    # The backward pass runs from the last stage to the first: the highest stage with bad gradients saw them first.
    stage = max(flags[r][1] for r in grad_ranks)
    first = [r for r in grad_ranks if flags[r][1] == stage]
    return (f"non-finite gradients at iteration {iteration} with a finite loss, first seen in the backward pass on "
            f"pipeline stage {stage} ({_ranks(first)}); non-finite on {_ranks(grad_ranks)}")


class NonFiniteSteps:
    """Counts skipped non-finite steps against train.skip_nonfinite_steps; raises once they run out."""

    def __init__(self, allowed: int, lr: float, speak: bool):
        self.allowed, self.skipped, self.lr, self.speak = allowed, 0, lr, speak  # speak: this rank logs the skips

    @property
    def can_skip(self) -> bool:
        return self.skipped < self.allowed

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The skips spent before (a checkpoint's); the budget never comes back: a rewind to an older checkpoint
        keeps what was spent since, as a restart keeps what was spent before it."""
        self.skipped = max(self.skipped, int(state["skipped"]))

    def skip_or_raise(self, description: str) -> None:
        if self.skipped < self.allowed:
            self.skipped += 1
            if self.speak:
                    log.warning(f"skipped: {description} (weights and schedule unchanged; {self.skipped} of "
                            f"train.skip_nonfinite_steps={self.allowed} used)")
            return
        used = f" after skipping {self.skipped} such steps" if self.allowed else ""
        raise DivergenceError(
            f"{description}{used}. Resume from the last checkpoint (checkpoint.load) with a lower optimizer.lr "
            f"(now {self.lr:g}), a longer optimizer.lr_warmup_iters or a lower optimizer.clip_grad; "
            f"train.skip_nonfinite_steps=N skips up to N such steps instead of stopping")


def check_loss_scale_floor(iteration: int, scale: float, min_scale: float, lr: float) -> None:
    """fp16: an overflow is the grad scaler's business (the step is skipped, the scale backs off) unless the scale
    was already at train.min_loss_scale — then the gradients overflow fp16 however they are scaled, and the run
    stops."""
    if scale <= min_scale:
        raise DivergenceError(
            f"fp16 gradients overflow at iteration {iteration} with the loss scale already at train.min_loss_scale="
            f"{min_scale:g}: train in bf16 (train.precision=bf16, on Ampere or newer) or fp32, or resume from the last "
            f"checkpoint (checkpoint.load) with a lower optimizer.lr (now {lr:g})")
