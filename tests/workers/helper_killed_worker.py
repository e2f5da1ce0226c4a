"""recipes.launch (started without torchrun's LOCAL_RANK) whose ranks run this module: the recipe's entry point on
which rank KILL_HELPER_RANK kills its own checkpoint save helper process (SIGKILL, as
the kernel's OOM killer would pick the process holding a copy of the shards) as it starts iteration KILL_HELPER_AT,
once: KILLED_MARKER names a file that says it happened (a restarted worker leaves its new helper alone)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from megatron_ext.checkpoint import save_load
from megatron_ext.training import trainer
from recipes.launch import main as launch
from recipes.pretrain import entry_point
from tests.workers.step_patch import forward_step_per_step


def _choose(step: trainer.Trainer, plain):
    marker = Path(os.environ["KILLED_MARKER"])
    if (step.iteration + 1 == int(os.environ["KILL_HELPER_AT"]) and step.rank == int(os.environ["KILL_HELPER_RANK"])
            and not marker.exists()):
        marker.touch()
        os.kill(save_load._save_helper._process.pid, signal.SIGKILL)
    return plain


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    if "LOCAL_RANK" not in os.environ:  # the launcher
        sys.exit(launch(entry="tests.workers.helper_killed_worker"))
    forward_step_per_step(_choose)
    entry_point()
