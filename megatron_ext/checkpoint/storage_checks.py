"""Checkpoints in object storage — checkpoint.save, checkpoint.load and checkpoint.pretrained_checkpoint naming
``msc://PROFILE/prefix`` — checked before any rank trains, each refusal one line naming the key: the run's
multi-storage-client configuration and its profile, a save location this job can write (an object written and deleted
there), a load location whose tracker reads. Megatron-FSDP's checkpoints are written by torch's local file writer, and
are refused there."""

from __future__ import annotations

import os
import socket
from typing import Any

from megatron_ext.checkpoint.layout import latest_iteration
from megatron_ext.config.paths import is_object_storage
from megatron_ext.config.schema import RecipeConfig, resume_dir
from megatron_ext.errors import CheckpointError, ConfigError, require
from megatron_ext.storage import files


def remote_locations(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """(key, location) of every checkpoint location `cfg` names in object storage."""
    ck = cfg.checkpoint
    named = [("checkpoint.save", ck.save), ("checkpoint.load", resume_dir(cfg)),
             ("checkpoint.pretrained_checkpoint", ck.pretrained_checkpoint)]
    return [(key, location) for key, location in named if location and is_object_storage(location)]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def validate_checkpoint_storage(cfg: RecipeConfig) -> None:
    """The object-storage checkpoint locations of `cfg`, in this process (rank 0 or the launcher also writes a probe
    object and reads the trackers). Turns on multi-storage-client for the process and those it starts."""
    remote = remote_locations(cfg)
    if not remote:
        return
    key, location = remote[0]
    require(not cfg.parallel.use_megatron_fsdp, "parallel.use_megatron_fsdp", True,
            f"Megatron-FSDP writes its checkpoints with torch's local file writer, and {key}={location} is in object "
            "storage: keep the checkpoints on a file system, or train without Megatron-FSDP")
    files.enable_for(cfg, key, location)
    if os.environ.get("RANK", "0") != "0":
        return
    for key, location in remote:
        try:
            if key == "checkpoint.save":
                _probe_write(location)
            else:
                latest_iteration(location)
        except CheckpointError as e:
            raise ConfigError(f"{key}={location} is invalid: {e}") from None
        except Exception as e:  # an unknown profile, an unreachable endpoint, a refusal (botocore's own errors)
            verb = "write" if key == "checkpoint.save" else "read"
            raise ConfigError(f"{key}={location} is invalid: multi-storage-client cannot {verb} it with "
                              f"storage.msc_config={cfg.storage.msc_config}: {_first_line(e)}") from None


def _probe_write(location: str) -> None:
    """Write and delete one small object under `location`: the job may write there."""
    probe: Any = files.at(location) / f".write_probe.{socket.gethostname()}.{os.getpid()}"
    probe.write_text("this job can write here\n")
    probe.unlink()
