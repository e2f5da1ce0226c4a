"""Checkpoint retention: ``checkpoint.keep_last`` newest complete checkpoints, plus every ``keep_every``-th, forever.

Runs on rank 0 after a new checkpoint is complete, verified and named by the tracker, so it never touches the
one being written or the latest one; directories without a manifest (older or partial saves) are left alone.
"""

from __future__ import annotations

import logging
from typing import Optional

from megatron_ext.checkpoint.layout import complete_iterations, iteration_dir
from megatron_ext.storage import files
from megatron_ext.storage.files import AnyPath

log = logging.getLogger(__name__)


def apply_retention(root: AnyPath, latest: int, keep_last: Optional[int], keep_every: Optional[int]) -> list[int]:
    """Delete the complete checkpoints older than the newest `keep_last`, except multiples of `keep_every`;
    returns the iterations deleted (one that cannot be deleted is a warning, not a failure)."""
    if keep_last is None:
        return []
    iterations = [i for i in complete_iterations(root) if i <= latest]
    kept = set(iterations[-keep_last:]) | {latest}
    doomed = [i for i in iterations if i not in kept and not (keep_every and i % keep_every == 0)]
    for iteration in doomed:
        path = iteration_dir(root, iteration)
        try:
            files.remove_tree(path)
        except OSError as e:  # NFS's .nfsXXXX files of a reader, permissions: the new checkpoint is safe anyway
            log.warning(f"retention could not delete {path} ({type(e).__name__}: {e}); training goes on, "
                        "delete it by hand")
            continue
        log.info(f"retention (checkpoint.keep_last={keep_last}"
                 + (f", keep_every={keep_every}" if keep_every else "") + f"): deleted {path}")
    return [i for i in doomed if not iteration_dir(root, i).is_dir()]
