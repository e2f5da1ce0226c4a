"""The recipe's entry point with one rank made slow on purpose: on rank SLOW_RANK every forward pass first sleeps
SLOW_MS milliseconds, inside megatron-core's timed forward-compute region, as a throttled GPU would be slower."""

from __future__ import annotations

import os
import sys
import time

from megatron_ext.training import trainer
from recipes.pretrain import main


def _slowed(forward_step):
    def forward_step_after_a_sleep(data_iterator, model):
        time.sleep(float(os.environ["SLOW_MS"]) / 1000)
        return forward_step(data_iterator, model)

    return forward_step_after_a_sleep


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    if os.environ.get("RANK") == os.environ["SLOW_RANK"]:
        trainer._forward_step = _slowed(trainer._forward_step)
    sys.exit(main())
