"""Stopping at a step boundary on SIGTERM/SIGUSR1 (SLURM's pre-emption warning, torchrun's stop) and saving by the
clock, agreed by every rank without making the training loop wait for the device."""

from __future__ import annotations

import signal
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist


class ExitSignal:
    """Remembers SIGTERM/SIGUSR1 (SLURM's pre-emption warning) until the ranks agree on it at a step boundary.
    Collective: every rank constructs it (it makes the host-side process group the agreement runs on)."""

    def __init__(self, enabled: bool):
        self.received: Optional[int] = None
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handle)
        self.group = dist.new_group(backend="gloo")  # host memory: learning of a signal never waits for the device
        self._agreeing: Optional[tuple[dist.Work, np.ndarray]] = None

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def agree(self, save_due_by_clock: bool) -> tuple[bool, bool]:
        """(some rank had received the signal, some rank's clock said a save was due) at the previous step boundary:
        each boundary starts an asynchronous all-reduce of its flags on the host and reads the one started at the
        boundary before, finished by now, so every rank stops and saves at the same step, one step after the
        signal, without a wait."""
        agreed = (False, False)
        if self._agreeing is not None:
            work, flags = self._agreeing
            work.wait()
            agreed = bool(flags[0]), bool(flags[1])
        flags = np.array([self.received is not None, save_due_by_clock], dtype=np.int32)
        self._agreeing = (dist.all_reduce(torch.from_numpy(flags), op=dist.ReduceOp.MAX, group=self.group,
                                          async_op=True), flags)
        return agreed

    def close(self) -> None:
        """Collective: the last agreement started is finished on every rank."""
        if self._agreeing is not None:
            self._agreeing[0].wait()
            self._agreeing = None
