"""torch.profiler traces of chosen iterations on chosen ranks (``logging.profile_steps``, ``logging.profile_ranks``),
and on a GPU a ``torch.cuda.memory`` snapshot at the end of them (``logging.memory_snapshot``).

Each profiled rank writes ``<run dir>/profile/rank-R.iter_A-B.json`` (Chrome trace format: open it in Perfetto,
https://ui.perfetto.dev, or chrome://tracing), each iteration a ``step N`` region, and with the snapshot
``rank-R.iter_A-B.memory.pickle`` (open it at https://pytorch.org/memory_viz). The loop calls :meth:`step` around
each iteration; a rank or iteration outside the window costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from megatron_ext.config.schema import RecipeConfig, profile_dir

log = logging.getLogger("megatron_ext")


class StepProfiler:
    """The profiler of one rank, active from iteration ``first`` to ``last`` when this rank is one of those chosen."""

    def __init__(self, cfg: RecipeConfig, rank: int, on_gpu: bool):
        g = cfg.logging
        self.window = g.profile_steps if g.profile_steps and rank in g.profile_ranks else None
        self.with_stack, self.on_gpu, self.rank = g.profile_with_stack, on_gpu, rank
        self.snapshot = g.memory_snapshot and self.window is not None
        self.out = profile_dir(cfg)
        self._profile: Optional[torch.profiler.profile] = None
        self._first = self._last = 0  # the iterations traced so far
        self._done = False  # written: a rewind back into the window traces nothing more
        if self.snapshot and not on_gpu:
            log.warning(f"rank {rank}: logging.memory_snapshot needs a GPU (torch.cuda.memory); none is taken on CPU")
            self.snapshot = False

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Around one training iteration: starts the trace at the first in the window (a run resumed inside it starts
        there), writes it after the last."""
        if self.window is None or self._done or not self.window[0] <= iteration <= self.window[1]:
            yield
            return
        if self._profile is None:
            self._start(iteration)
        with torch.profiler.record_function(f"step {iteration}"):
            yield
        self._last = iteration
        if iteration == self.window[1]:
            self._write()

    def _start(self, iteration: int) -> None:
        self._first = iteration
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True,
                                               with_stack=self.with_stack, profile_memory=True)
        self._profile.__enter__()

    def _write(self) -> None:
        first, last = self._first, self._last
        self._profile.__exit__(None, None, None)
        self._done = True
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"rank-{self.rank}.iter_{first}-{last}.json"
        self._profile.export_chrome_trace(str(trace))
        self._profile = None
        written = [f"{trace} (open in https://ui.perfetto.dev or chrome://tracing)"]
        if self.snapshot:
            snapshot = self.out / f"rank-{self.rank}.iter_{first}-{last}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(f"{snapshot} (open in https://pytorch.org/memory_viz)")
        log.warning(f"rank {self.rank}: profiled iterations {first}-{last}: " + "; ".join(written))

    def close(self) -> None:
        """A run that stopped inside the window writes what it has."""
        if self._profile is not None:
            self._write()

