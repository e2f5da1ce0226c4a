"""The recipe's entry point with steps whose gradients overflow on purpose: at each iteration of OVERFLOW_AT
(comma separated) every gradient flowing back from the loss is multiplied by inf (the loss itself stays finite), as
an fp16 overflow would make them. With GRAD_LOG, each step's largest gradient reaching the per-token losses (the
loss scale over the number of tokens, if megatron-core scaled the loss before the backward pass) is appended there
as ``iteration value``."""

from __future__ import annotations

import os

from megatron_ext.training import trainer
from recipes.pretrain import entry_point
from tests.workers.step_patch import forward_step_per_step


def _hooked(forward_step, overflow: bool, iteration: int):
    def forward_step_with_a_gradient_hook(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)

        def hook(grad):
            if os.environ.get("GRAD_LOG") and not overflow:
                with open(os.environ["GRAD_LOG"], "a") as log:
                    log.write(f"{iteration} {grad.abs().max().item()!r}\n")
            return grad * float("inf") if overflow else grad

        output.register_hook(hook)
        return output, loss_func

    return forward_step_with_a_gradient_hook


def _choose(overflows: set[int]):
    def forward_step_of(step: trainer.Trainer, plain):
        return _hooked(plain, step.iteration + 1 in overflows, step.iteration + 1)

    return forward_step_of


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    forward_step_per_step(_choose({int(i) for i in os.environ.get("OVERFLOW_AT", "").split(",") if i}))
    entry_point()
