"""Asynchronous checkpoint writes through NVRx's ``AsyncCallsQueue`` (a writer process per rank): nvidia-resiliency-ext's
async checkpoint writer, megatron-core 0.19's default (its own is deprecated for it), taken through megatron-core's
``get_async_strategy`` so that the queue, the request and the writer that fills it are one strategy's
(:func:`writer_modules`).

Training goes on while the shards are written; the save's finalisation (metadata, manifest, tracker, retention)
runs on every rank once every rank's writer has finished, from :meth:`AsyncCheckpointSaver.finalize` — called
at every step without blocking, and blocking before the next save and at the end of training, so an exit by
signal or ``train.exit_interval`` still leaves a complete checkpoint.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.checkpoint.save_helper import raise_if_a_helper_died, signals_ignored
from megatron_ext.errors import CheckpointError
from megatron_ext.storage import files

log = logging.getLogger(__name__)

ASYNC_STRATEGY = "nvrx"  # megatron-core's name for NVRx's async writer


@functools.cache
def writer_modules() -> dict[str, Any]:
    """The async strategy's pieces, by megatron-core's names (AsyncCallsQueue, AsyncRequest, FileSystemWriterAsync,
    save_state_dict_async_plan/_finalize, get_write_results_queue, ...)."""
    return get_async_strategy(ASYNC_STRATEGY)[1]


def agreed_failure(exc: Optional[BaseException]) -> Optional[str]:
    """Collective: None when no rank failed (`exc` None everywhere), else the same 'rank R: Type: message; ...' text
    on every rank. torch's CheckpointException (a BaseException) lists the ranks whose writes failed on the
    coordinating rank only; any other exception is its own rank's cause."""
    rank = dist.get_rank()
    if exc is None:
        mine: Optional[dict[int, str]] = None
    elif isinstance(exc, CheckpointException):
        mine = {r: f"{type(e).__name__}: {e}" for r, (e, _trace) in exc.failures.items()}
    else:
        mine = {rank: f"{type(exc).__name__}: {exc}"}
    gathered: list[Optional[dict[int, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if all(causes is None for causes in gathered):
        return None
    merged = {r: text for causes in gathered if causes for r, text in causes.items()}
    return "; ".join(f"rank {r}: {text}" for r, text in sorted(merged.items())) or "no rank reported a cause"


def _nothing() -> None:
    """The writer's first request: it only starts the process."""


class AsyncCheckpointSaver:
    """The queue of this rank's checkpoint writes in flight (NVRx's persistent async caller)."""

    def __init__(self) -> None:
        # On GPUs, NVRx's persistent writer process (it stages the shards device-to-host while training waits, then
        # writes). On CPU it cannot start (it selects a CUDA device); there the writer is a process forked per save,
        # whose copy-on-write memory is the snapshot of the state being saved.
        self.queue = writer_modules()["AsyncCallsQueue"](persistent=torch.cuda.is_available())
        self.in_flight: list[tuple[Optional[Path], float]] = []
        if self.queue.persistent:
            self._start_writer()

    def _start_writer(self) -> None:
        """Spawn the persistent writer now, with an empty request, rather than in the first save: starting it
        held an H100 run's first save up 20.9 s, against 0.5 s for the next one."""
        with signals_ignored():
            self.queue.schedule_async_request(
                writer_modules()["AsyncRequest"](async_fn=_nothing, async_fn_args=(), finalize_fns=[]))
        self.in_flight.append((None, time.perf_counter()))

    def schedule(self, request: Any, target: Path, finish: Callable[[], None]) -> None:
        """Collective: start writing `target`; `finish` runs on every rank when every rank's write is done."""
        request.add_finalize_fn(finish)
        with signals_ignored():  # the first call spawns the writer process
            self.queue.schedule_async_request(request)
        self.in_flight.append((target, time.perf_counter()))

    def finalize(self, blocking: bool) -> list[Path]:
        """Collective: finish the saves whose writes are done (all of them if `blocking`); returns their paths."""
        if not self.in_flight:
            return []

        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointError:  # from the save's own finalisation, which already cleaned up
            self.in_flight.pop(0)
            raise
        except (Exception, CheckpointException) as e:  # a write failed: megatron-core raises it on every rank
            target, _ = self.in_flight.pop(0)
            causes = agreed_failure(e)
            if target is not None and dist.get_rank() == 0:
                files.remove_tree(target)
            raise_if_a_helper_died(f"while {target} was written in the background", f"removed {target}")
            raise CheckpointError(f"the asynchronous save of {target} failed ({causes}); removed it, the tracker "
                                  "and older checkpoints are untouched") from None
        finished = self.in_flight[:len(done)]
        del self.in_flight[:len(done)]
        for target, started in finished:
            if target is not None and dist.get_rank() == 0:
                log.info(f"saved checkpoint {target} (written in the background in {time.perf_counter() - started:.1f} s)")
        return [target for target, _ in finished if target is not None]

    def abort(self) -> None:
        """Stop the writer process now, finishing nothing (the run is failing; the tracker stays where it is)."""
        self.queue.close(abort=True)

    def close(self) -> None:
        """Collective: wait for every save in flight, then stop the writer processes."""
        self.finalize(blocking=True)
        self.queue.close()  # (megatron-core drops the stopped writer itself)
