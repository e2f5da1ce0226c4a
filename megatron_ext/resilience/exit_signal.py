"""Stopping at a step boundary on SIGTERM/SIGUSR1 (SLURM's pre-emption warning, torchrun's stop) and saving by the
clock, agreed by every rank at the loop's settling steps — where it reads the device anyway
(:mod:`megatron_ext.training.pending_steps`), so the agreement adds no wait of its own."""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist


class ExitSignal:
    """Remembers SIGTERM/SIGUSR1 until the ranks agree on it."""

    def __init__(self, enabled: bool, device: torch.device):
        self.received: Optional[int] = None
        self.device = device
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def agree(self, save_due_by_clock: bool) -> tuple[bool, bool]:
        """(some rank received the signal, some rank's clock says a save is due): collective, one all-reduce, so
        every rank stops and saves at the same step."""
        flags = torch.tensor([self.received is not None, save_due_by_clock], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, clock_due = flags.tolist()
        return bool(signalled), bool(clock_due)
