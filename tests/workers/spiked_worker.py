"""The recipe's entry point with one corrupted global batch: the step that starts at sample SPIKE_AT_SAMPLE of the
training data has every token's loss multiplied by SPIKE_FACTOR (a batch of garbage makes such a spike), on every
rank; any other step trains as usual. With KILL_AT_ITERATION, every rank is killed (SIGKILL, as by a lost node) as
it starts that iteration, once: KILLED_MARKER names a file that says it happened. The goodput ledger is written
after every step (not at most once a second), so that the kill's accounting does not depend on when it lands."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from megatron_ext.metrics.goodput_ledger import GoodputLedger
from megatron_ext.training import trainer
from recipes.pretrain import entry_point
from tests.workers.step_patch import forward_step_per_step


def _choose(at_sample: int, factor: float):
    def forward_step_of(step: trainer.Trainer, plain):
        if os.environ.get("KILL_AT_ITERATION") == str(step.iteration + 1):
            marker = Path(f"{os.environ['KILLED_MARKER']}.{os.environ['RANK']}")
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        if step.consumed_samples != at_sample:
            return plain

        def forward_step_of_the_corrupted_batch(data_iterator, model):
            output, loss_func = plain(data_iterator, model)
            return output * factor, loss_func

        return forward_step_of_the_corrupted_batch

    return forward_step_of


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    GoodputLedger.WRITE_EVERY_S = 0.0
    forward_step_per_step(_choose(int(os.environ["SPIKE_AT_SAMPLE"]), float(os.environ["SPIKE_FACTOR"])))
    entry_point()
