"""distributed/parallel.py's pure parts: what a finished run waits for before the process groups go."""

from __future__ import annotations

import warnings

import torch
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

from megatron_ext.distributed.parallel import stop_data_parallel_communication


class _StoppedFSDP(FullyShardedDataParallel):
    """A Megatron-FSDP chunk without the process groups: stopping records itself and warns as Megatron-FSDP does
    when its last forward pass left parameter all-gathers in flight."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.stopped = 0

    def stop_communication(self):
        warnings.warn("There are still pending all-gather tasks, process them. Bucket status: {}.", UserWarning)
        self.stopped += 1


def test_megatron_fsdp_chunks_finish_their_gathers_quietly():
    fsdp, ddp = _StoppedFSDP(), torch.nn.Linear(1, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stop_data_parallel_communication([fsdp, ddp])
    assert fsdp.stopped == 1
    assert not seen
