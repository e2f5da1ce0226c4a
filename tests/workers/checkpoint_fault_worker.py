"""torchrun worker: the recipe with a save of a chosen iteration that goes wrong on one rank.

``FAIL_ITERATION``/``FAIL_RANK`` (environment): that rank's save of that iteration writes part of a file and then
fails with ENOSPC after the other ranks finished theirs (the case where only one rank knows); with
``FAIL_AT=metadata`` rank 0's write of megatron-core's ``metadata.json`` fails instead (the last write of a save,
rank 0's alone, followed by a barrier on every rank) — or, with
checkpoint.async_save, its background writer dies without a word; with ``HANG_MARKER``
set it instead touches that file and waits there, for the test to kill the job mid-save: once the shards are
written (before the manifest and the tracker), or with ``HANG_AT=tracker`` when the tracker is about to move.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import torch.distributed as dist


def _killed_writer(*_args, **_kwargs) -> None:
    """The forked writer of an asynchronous save, killed (out of host memory, say) after part of a file."""
    os._exit(1)


def install() -> None:
    target_name = f"iter_{int(os.environ['FAIL_ITERATION']):07d}"
    if os.environ.get("FAIL_AT") == "metadata":  # before the recipe's checkpoint code takes megatron-core's writer
        from megatron.core.dist_checkpointing import serialization

        real_save_config = serialization.save_config

        def save_config(config, checkpoint_dir) -> None:
            if Path(checkpoint_dir).name == target_name and dist.get_rank() == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(checkpoint_dir) / "metadata.json"))
            real_save_config(config, checkpoint_dir)

        serialization.save_config = save_config
        return
    from megatron_ext.checkpoint import save_load

    real_save = save_load.dist_checkpointing.save

    def save(state, checkpoint_dir, *args, **kwargs):
        result = real_save(state, checkpoint_dir, *args, **kwargs)
        if os.environ.get("HANG_AT") == "tracker":
            return result
        if Path(checkpoint_dir).name == target_name and dist.get_rank() == int(os.environ["FAIL_RANK"]):
            if kwargs.get("async_sharded_save"):  # the background writer dies before reporting its files
                return result._replace(async_fn=_killed_writer)
            if os.environ.get("HANG_MARKER"):
                Path(os.environ["HANG_MARKER"]).touch()
                time.sleep(600)
            partial = Path(checkpoint_dir) / "__extra_0.distcp"
            partial.write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial))
        return result

    save_load.dist_checkpointing.save = save
    if os.environ.get("HANG_AT") == "tracker":
        real_write_tracker = save_load.write_tracker

        def write_tracker(root: Path, iteration: int) -> None:
            if iteration == int(os.environ["FAIL_ITERATION"]):
                Path(os.environ["HANG_MARKER"]).touch()
                time.sleep(600)
            real_write_tracker(root, iteration)

        save_load.write_tracker = write_tracker


if __name__ == "__main__":  # guard required: dist_checkpointing's save spawns processes
    install()
    from recipes.pretrain import entry_point

    entry_point()
