"""The steps a training loop leaves on the device come back in order, each with its own loss, gradient norm and
router scalars, the interval's mean time, and the first non-finite one named (one process, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.training.pending_steps import PendingSteps


@pytest.fixture()
def one_process():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _losses(loss_sum: float, tokens: float) -> list[dict[str, torch.Tensor]]:
    return [{"lm loss": torch.tensor([loss_sum, tokens])}]


def test_steps_settle_in_order_with_their_own_numbers(one_process):
    pending = PendingSteps(torch.device("cpu"))
    ok = torch.zeros(2)
    pending.add(1, 0, _losses(6.0, 2.0), ok, {"moe/aux_loss": torch.tensor(0.5)}, lr=0.1)
    pending.updated(torch.tensor([2.0]))
    pending.took(1.0)
    pending.add(2, 8, _losses(8.0, 4.0), ok, {"moe/aux_loss": torch.tensor(0.25), "moe/max_load": 0.75}, lr=0.2)
    pending.updated(None)  # megatron-core without clipping
    pending.took(3.0)
    settled = pending.settle()
    assert pending.settle().steps == [] and settled.first_nonfinite is None  # nothing is left pending
    assert [(s.iteration, s.first_sample, s.loss, s.grad_norm, s.lr, s.router) for s in settled.steps] == [
        (1, 0, 3.0, 2.0, 0.1, {"moe/aux_loss": 0.5}),
        (2, 8, 2.0, 0.0, 0.2, {"moe/aux_loss": 0.25, "moe/max_load": 0.75})]
    assert settled.steps[0].step_time == settled.steps[1].step_time >= 2.0  # the mean, plus the settle's wait


def test_the_first_nonfinite_step_is_named_and_a_dropped_step_is_gone(one_process):
    pending = PendingSteps(torch.device("cpu"))
    pending.add(1, 0, _losses(float("nan"), 2.0), torch.tensor([1.0, 0.0]), {}, lr=0.1)
    assert pending.newest_now()[1]  # a step skipped before its update
    pending.drop_newest()
    for iteration, flags in ((2, [0.0, 0.0]), (3, [0.0, 1.0]), (4, [1.0, 1.0])):
        pending.add(iteration, 8 * iteration, _losses(2.0, 4.0), torch.tensor(flags), {}, lr=0.1)
        pending.updated(torch.tensor(1.0))
        pending.took(1.0)
    assert pending.newest_now() == (0.5, True)
    settled = pending.settle()
    assert [s.iteration for s in settled.steps] == [2, 3, 4]
    iteration, local_flags = settled.first_nonfinite
    assert iteration == 3 and local_flags.tolist() == [0.0, 1.0]

