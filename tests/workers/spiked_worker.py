"""The recipe's entry point with one corrupted global batch: the step that starts at sample SPIKE_AT_SAMPLE of the
training data has every token's loss multiplied by SPIKE_FACTOR (a batch of garbage makes such a spike), on every
rank; any other step trains as usual."""

from __future__ import annotations

import os
import sys

from megatron_ext.training import trainer
from recipes.pretrain import main
from tests.workers.step_patch import forward_step_per_step


def _choose(at_sample: int, factor: float):
    def forward_step_of(step: trainer.Trainer, plain):
        if step.consumed_samples != at_sample:
            return plain

        def forward_step_of_the_corrupted_batch(data_iterator, model):
            output, loss_func = plain(data_iterator, model)
            return output * factor, loss_func

        return forward_step_of_the_corrupted_batch

    return forward_step_of


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    forward_step_per_step(_choose(int(os.environ["SPIKE_AT_SAMPLE"]), float(os.environ["SPIKE_FACTOR"])))
    sys.exit(main())
