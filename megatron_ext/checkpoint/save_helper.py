"""The rank's checkpoint save helper: the long-lived process through which a save's writer hands its results back, and
what happens when it dies.

dist_checkpointing's writers (megatron-core's own, which its synchronous save runs, and NVRx's asynchronous one) put
each save's write results on a queue served by a multiprocessing Manager; megatron-core starts that Manager at the
first save (``get_write_results_queue``). The recipe starts it itself, before the process groups (:func:`start`).
When it dies — ``kill -9``, as the kernel's OOM killer picks the process holding a copy of the shards — every rank
must take the same path: reading its queue then is that rank's write failure, which the writers' own finalisation
spreads to every rank (:class:`_ResultsQueue`), and :func:`raise_if_a_helper_died` turns any failure into the one
line naming the dead helper, with the node-fault exit code the agent restarts on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.managers
import signal
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from megatron_ext.errors import SaveHelperDiedError

_helper: Optional[multiprocessing.managers.SyncManager] = None  # for the life of the rank


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGTERM/SIGUSR1 ignored while checkpoint helper processes are started.

    A spawned child starts with the default action for every signal its parent handles, and SLURM
    (scancel --signal, pre-emption) and torchrun (killpg) signal a rank's whole process tree: a helper would
    die, and the checkpoint the signal asked for would fail. An ignored signal stays ignored through spawn.
    """
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _ResultsQueue:
    """The helper's queue as the writers use it. Where the helper is gone, reading it gives the writers the failure
    they already handle (an exception in place of the results: their finalisation gathers it to the coordinator and
    raises on every rank) instead of a connection error raised on this rank alone while the others wait for it in
    the finalisation's collectives."""

    def __init__(self, queue: Any):
        self.queue = queue

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        self.queue.put(item, *args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self._read(self.queue.get, *args, **kwargs)

    def get_nowait(self) -> Any:
        return self._read(self.queue.get_nowait)

    @staticmethod
    def _read(read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return read(*args, **kwargs)
        except (EOFError, OSError) as e:  # ConnectionRefusedError, BrokenPipeError: the Manager process is gone
            return SaveHelperDiedError(death() or f"this rank's checkpoint save helper did not answer ({e!r})")


def start(initializer: Optional[Callable[[], object]] = None) -> _ResultsQueue:
    """Start the helper (forked, SIGTERM/SIGUSR1 ignored, running `initializer` first) and return its results queue.

    Forked, not spawned as megatron-core's is: the write results it queues unpickle into torch's classes, which a
    spawned helper imports first (with the rank's entry point: 2.5-4 s of CPU per rank, on 2 cores a 4-rank run's
    start-up or first save 3.5-4 s longer); forked before the process groups start their threads, it has them
    already. `initializer` can make it end with its rank: otherwise a rank killed with SIGKILL leaves it, and its
    resource tracker, running for good."""
    global _helper
    with signals_ignored():
        _helper = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("fork"))
        _helper.start(initializer)
        return _ResultsQueue(_helper.Queue())


def pid() -> Optional[int]:
    process = getattr(_helper, "_process", None)  # multiprocessing's BaseManager keeps its server process there
    return None if process is None else process.pid


def death() -> Optional[str]:
    """How this rank's save helper process ended, if it has (None while it runs, or when none was started)."""
    process = getattr(_helper, "_process", None)
    if process is None or process.is_alive():
        return None
    code = process.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
    return f"rank {dist.get_rank()}'s checkpoint save helper process (pid {process.pid}) {how}"


def raise_if_a_helper_died(when: str, outcome: str) -> None:
    """Collective: every rank raises the same one line when any rank's save helper is gone — `when` (``before the
    checkpoint of iteration 4 was written``) and what became of that checkpoint (`outcome`) — a node fault, which
    the agent's restart repairs."""
    gathered: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, death())
    deaths = [found for found in gathered if found]
    if deaths:
        raise SaveHelperDiedError(f"{'; '.join(deaths)}, {when}: {outcome}; the run resumes from its last complete "
                                  "checkpoint when its workers are restarted (recipes.launch --max-restarts, or the "
                                  "SLURM requeue)")
