"""recipes.launch (started without torchrun's LOCAL_RANK) whose ranks run this module: the recipe's entry point on
which rank KILL_HELPER_RANK kills its own checkpoint save helper process (SIGKILL, as the kernel's OOM killer would
pick the process holding a copy of the shards), once: as it starts iteration KILL_HELPER_AT, or with
KILL_HELPER_IN_SAVE=1 right after the asynchronous save of that iteration was scheduled (its shards being written).
KILLED_MARKER names a file that says it happened (a restarted worker leaves its new helper alone) and holds the
helper's pid. KILL_HELPER_SIGNAL=SIGSTOP stops the helper instead (a process that neither answers nor dies: the
test kills it when it is done)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_ext.checkpoint import async_save, save_helper
from megatron_ext.training import trainer
from recipes.launch import main as launch
from recipes.pretrain import entry_point
from tests.workers.step_patch import forward_step_per_step


def _kill_once(rank: int) -> None:
    marker = Path(os.environ["KILLED_MARKER"])
    if rank == int(os.environ["KILL_HELPER_RANK"]) and not marker.exists():
        marker.write_text(str(save_helper.pid()))
        os.kill(save_helper.pid(), signal.Signals[os.environ.get("KILL_HELPER_SIGNAL", "SIGKILL")])


def _choose(step: trainer.Trainer, plain):
    if step.iteration + 1 == int(os.environ["KILL_HELPER_AT"]):
        _kill_once(step.rank)
    return plain


def _kill_after_scheduling() -> None:
    schedule = async_save.AsyncCheckpointSaver.schedule

    def schedule_then_kill(self, request, target, finish):
        schedule(self, request, target, finish)
        if target.name == f"iter_{int(os.environ['KILL_HELPER_AT']):07d}":
            _kill_once(dist.get_rank())

    async_save.AsyncCheckpointSaver.schedule = schedule_then_kill


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    if "LOCAL_RANK" not in os.environ:  # the launcher
        sys.exit(launch(entry="tests.workers.helper_killed_worker"))
    if os.environ.get("KILL_HELPER_IN_SAVE"):
        _kill_after_scheduling()
    else:
        forward_step_per_step(_choose)
    entry_point()
