"""distributed/parallel.py's pure parts: what a finished run waits for before the process groups go."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

from megatron_ext.distributed.parallel import stop_data_parallel_communication


class _StoppedFSDP(FullyShardedDataParallel):
    """A Megatron-FSDP chunk without the process groups: stopping records itself and warns as Megatron-FSDP does
    when its last forward pass left parameter all-gathers in flight."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.stopped = 0
        pending = {(bucket, False): object() for bucket in range(4)}  # (bucket id, backward) → its event
        self.module = SimpleNamespace(all_gather_pipeline=SimpleNamespace(param_gather_event_map=pending))

    def stop_communication(self):
        warnings.warn("There are still pending all-gather tasks, process them. Bucket status: {}.", UserWarning)
        self.module.all_gather_pipeline.param_gather_event_map.clear()
        self.stopped += 1


def test_megatron_fsdp_chunks_finish_their_gathers_quietly():
    fsdp, ddp = _StoppedFSDP(), torch.nn.Linear(1, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        waited_for = stop_data_parallel_communication([fsdp, ddp])
    assert fsdp.stopped == 1 and waited_for == 4
    assert not seen


def test_megatron_cores_micro_batch_calculator_is_set_as_the_loop_counts():
    """The trainer sets megatron-core's global calculator (parts of megatron-core ask it, not the loop): it gives the
    micro batches the loop runs per step."""
    from megatron.core import num_microbatches_calculator as calculator

    from megatron_ext.config.schema import data_parallel_size, load_config, microbatches_per_step
    from megatron_ext.training.micro_batch import set_up_micro_batch_calculator
    from tests.launch import TINY

    for world, overrides in ((4, []), (8, ["train.micro_batch_size=1"])):
        cfg = load_config(TINY, overrides)
        set_up_micro_batch_calculator(0, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                      data_parallel_size(cfg, world))
        try:
            assert calculator.get_num_microbatches() == microbatches_per_step(cfg, world)
            assert calculator.get_micro_batch_size() == cfg.train.micro_batch_size
        finally:
            calculator.unset_num_microbatches_calculator()
