"""The recipe's entry point with one step's gradients overflowing on purpose: at iteration OVERFLOW_AT every
gradient flowing back from the loss is multiplied by inf (the loss itself stays finite), as an fp16 overflow
would make them."""

from __future__ import annotations

import os
import sys

from megatron_ext.training import trainer
from recipes.pretrain import main


def _overflowing(forward_step):
    def forward_step_with_infinite_gradients(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        output.register_hook(lambda grad: grad * float("inf"))
        return output, loss_func

    return forward_step_with_infinite_gradients


def _injecting(train_step):
    def train_step_overflowing_once(self, data_iterator):
        finite = trainer._forward_step
        if self.iteration + 1 == int(os.environ["OVERFLOW_AT"]):
            trainer._forward_step = _overflowing(finite)
        try:
            return train_step(self, data_iterator)
        finally:
            trainer._forward_step = finite

    return train_step_overflowing_once


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    trainer.Trainer.train_step = _injecting(trainer.Trainer.train_step)
    sys.exit(main())
