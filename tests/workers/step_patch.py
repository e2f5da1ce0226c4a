"""Each training step's forward step chosen per step: the workers that corrupt chosen steps patch it in here."""

from __future__ import annotations

from typing import Callable

from megatron_ext.training import micro_batch, trainer

ForwardStep = Callable  # micro_batch.forward_step's signature


def forward_step_per_step(choose: Callable[[trainer.Trainer, ForwardStep], ForwardStep]) -> None:
    """Every Trainer.train_step runs with the forward step `choose(the trainer, the plain forward step)` returns
    (the plain one is back after the step)."""
    train_step = trainer.Trainer.train_step

    def train_step_with_its_forward_step(self, data_iterator):
        plain = micro_batch.forward_step
        micro_batch.forward_step = choose(self, plain)
        try:
            return train_step(self, data_iterator)
        finally:
            micro_batch.forward_step = plain

    trainer.Trainer.train_step = train_step_with_its_forward_step
