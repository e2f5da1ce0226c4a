"""The recipe's entry point made slow on purpose: on rank SLOW_RANK every forward pass first sleeps SLOW_MS
milliseconds, inside megatron-core's timed forward-compute region, as a throttled GPU would be slower; with
SLOW_DATA_MS every rank waits that long for each micro batch, as a slow data loader would make it."""

from __future__ import annotations

import os
import time

from megatron_ext.training import micro_batch, run_data
from recipes.pretrain import entry_point


def _slowed(forward_step):
    def forward_step_after_a_sleep(data_iterator, model):
        time.sleep(float(os.environ["SLOW_MS"]) / 1000)
        return forward_step(data_iterator, model)

    return forward_step_after_a_sleep


def _slow_loader(microbatch_iterator):
    def batches_after_a_sleep(*args, **kwargs):
        for batch in microbatch_iterator(*args, **kwargs):
            time.sleep(float(os.environ["SLOW_DATA_MS"]) / 1000)
            yield batch

    return batches_after_a_sleep


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    if os.environ.get("RANK") == os.environ.get("SLOW_RANK"):
        micro_batch.forward_step = _slowed(micro_batch.forward_step)
    if os.environ.get("SLOW_DATA_MS"):
        run_data.microbatch_iterator = _slow_loader(run_data.microbatch_iterator)
    entry_point()
