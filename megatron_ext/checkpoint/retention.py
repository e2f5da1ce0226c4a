"""Checkpoint retention: ``checkpoint.keep_last`` newest complete checkpoints, plus every ``keep_every``-th, forever.

Runs on rank 0 after a new checkpoint is complete, verified and named by the tracker, so it never touches the
one being written or the latest one; directories without a manifest (older or partial saves) are left alone.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Optional

from megatron_ext.checkpoint.manifest import has_manifest

log = logging.getLogger(__name__)
_ITERATION_DIR = re.compile(r"iter_(\d{7})")


def complete_iterations(root: Path) -> list[int]:
    """Iterations of `root`'s ``iter_XXXXXXX`` directories that hold a manifest, oldest first."""
    found = []
    for path in Path(root).glob("iter_*"):
        match = _ITERATION_DIR.fullmatch(path.name)
        if match and path.is_dir() and has_manifest(path):
            found.append(int(match.group(1)))
    return sorted(found)


def apply_retention(root: Path, latest: int, keep_last: Optional[int], keep_every: Optional[int]) -> list[int]:
    """Delete the complete checkpoints older than the newest `keep_last`, except multiples of `keep_every`;
    returns the iterations deleted."""
    if keep_last is None:
        return []
    iterations = [i for i in complete_iterations(root) if i <= latest]
    kept = set(iterations[-keep_last:]) | {latest}
    doomed = [i for i in iterations if i not in kept and not (keep_every and i % keep_every == 0)]
    for iteration in doomed:
        path = Path(root) / f"iter_{iteration:07d}"
        shutil.rmtree(path)
        log.info(f"retention (checkpoint.keep_last={keep_last}"
                 + (f", keep_every={keep_every}" if keep_every else "") + f"): deleted {path}")
    return doomed
