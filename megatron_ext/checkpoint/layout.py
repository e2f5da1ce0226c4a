"""A checkpoint directory on disk, named in one place: ``<root>/iter_XXXXXXX/`` per saved iteration, the tracker
file naming the newest complete one, ``iter_XXXXXXX.corrupt`` for one set aside, and the files inside
(``common.pt`` where a format keeps its common state apart, dist_checkpointing's ``metadata.json``, our
``manifest.json``), and the lock of the run writing into it. Everything that reads or writes
a checkpoint (training, retention, the converter, ``recipes.checkpoints``) goes through these names. A root may be
local or in object storage (``msc://PROFILE/...``): the paths are :func:`megatron_ext.storage.files.at`'s."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Optional

from megatron_ext.errors import CheckpointError
from megatron_ext.storage import files
from megatron_ext.storage.files import AnyPath

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name: the newest complete iteration, as text
CORRUPT_SUFFIX = ".corrupt"
MANIFEST = "manifest.json"  # every file's size and CRC32 (checkpoint.manifest); written last: its presence = complete
COMMON_STATE = "common.pt"  # non-sharded state (iteration, config, content, ...): fsdp_dtensor; torch_dist < mcore 0.17
DIST_METADATA = "metadata.json"  # dist_checkpointing's own; present once its shards are written
DCP_METADATA = ".metadata"  # torch DCP's, also inside dist_checkpointing's; alone in an fsdp_dtensor checkpoint
RUN_LOCK = "run.lock"  # held by the run writing into this directory (checkpoint.run_lock)
PROGRESS = "progress.json"  # the iteration the run reached, when and on which world (resilience.elastic)
DATA_SKIPS = "data_skips.json"  # training data the run skips, from where to where (checkpoint.data_skips)
GOODPUT = "goodput.json"  # where the run's wall-clock went since its first start (metrics.goodput_ledger)
# a step to re-run on other GPUs than those where its fault recurred (resilience.reruns, train.recurring_fault)
RERUN_ELSEWHERE = "rerun_elsewhere.json"
# `content` in a checkpoint's common state: a training run's full state, or model weights only
# (e.g. converted from Hugging Face), which `checkpoint.load` starts from at iteration 0.
TRAINING_STATE = "training_state"
WEIGHTS_ONLY = "weights_only"
_ITERATION_DIR = re.compile(r"iter_(\d{7})(" + re.escape(CORRUPT_SUFFIX) + r")?")


def progress_path(root: Optional[str | AnyPath]) -> Optional[AnyPath]:
    """Where the run training into checkpoint directory `root` records its progress (None: no checkpoint.save)."""
    return files.at(root) / PROGRESS if root else None


def iteration_dir(root: str | AnyPath, iteration: int) -> AnyPath:
    return files.at(root) / f"iter_{iteration:07d}"


class IterationDir(NamedTuple):
    iteration: int
    path: AnyPath
    set_aside: bool  # renamed to .corrupt when found unusable


def iteration_dirs(root: str | AnyPath) -> list[IterationDir]:
    """Every ``iter_XXXXXXX`` (and ``.corrupt``) directory in `root`, by iteration."""
    found, base = [], files.at(root)
    for path in base.iterdir() if base.is_dir() else ():
        match = _ITERATION_DIR.fullmatch(path.name.rstrip("/"))
        if match and path.is_dir():
            found.append(IterationDir(int(match.group(1)), path, match.group(2) is not None))
    return sorted(found)


def has_manifest(ckpt_dir: AnyPath) -> bool:
    """The manifest is written last: a directory with one is a complete checkpoint."""
    return (ckpt_dir / MANIFEST).is_file()


def complete_iterations(root: str | Path) -> list[int]:
    """Iterations whose directory holds a manifest, oldest first."""
    return [d.iteration for d in iteration_dirs(root) if not d.set_aside and has_manifest(d.path)]


def set_aside(ckpt_dir: AnyPath) -> AnyPath:
    """Rename an unusable checkpoint to ``iter_XXXXXXX.corrupt`` (replacing an older one set aside)."""
    aside = ckpt_dir.with_name(ckpt_dir.name + CORRUPT_SUFFIX)
    files.remove_tree(aside)
    files.rename_tree(ckpt_dir, aside)
    return aside


def latest_iteration(root: str | Path) -> Optional[int]:
    """The iteration recorded in `root`'s tracker file, or None when there is no complete checkpoint."""
    tracker = files.at(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}; write the iteration of "
                              f"an intact {root}/iter_XXXXXXX into it, or remove it to start over")
    return int(text)


def resumable_iteration(root: str | Path) -> Optional[int]:
    """The iteration a resume of `root` starts from, read without writing: the tracker's, or where it is missing or
    unreadable, the newest complete checkpoint's (to which ``save_load.recover_tracker`` restores it)."""
    try:
        latest = latest_iteration(root)
    except CheckpointError:
        latest = None
    if latest is not None:
        return latest
    complete = complete_iterations(root)
    return complete[-1] if complete else None


def write_tracker(root: str | AnyPath, iteration: int) -> None:
    """Point the tracker at `iteration` (atomically)."""
    files.write_atomically(files.at(root) / TRACKER, f"{iteration}\n")
