"""The loop's part of train.cuda_graph_impl (docs/performance.md, "CUDA graphs"), as Megatron-LM's training loop
drives megatron-core's graphs:

* ``local``: nothing — megatron-core's schedules record the layers in the first step and capture them at its end;
* ``transformer_engine``: megatron-core's ``TECudaGraphHelper`` captures each decoder layer (or the regions of
  train.cuda_graph_modules) with TE's ``make_graphed_callables`` before step ``cuda_graph_warmup_steps + 1`` (3 eager
  steps first), the overlapped parameter gather's forward hooks set by hand on the graphed layers after it;
* ``full_iteration``: megatron-core's ``FullCudaGraphWrapper`` around the schedule captures a step's whole
  forward-backward (one graph for training, one for evaluation) on its ``cuda_graph_warmup_steps + 1``-th call and
  replays it after; its results are the graph's static tensors, overwritten by every replay, so they are copied out
  before the loop keeps them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.schema import RecipeConfig


class StepGraphs:
    """`cfg`'s CUDA graphs for one run: :meth:`schedule` wraps the pipeline schedule, :meth:`before_step` captures
    TransformerEngine's layer graphs when their warm-up steps have run, :meth:`close` frees them."""

    def __init__(self, cfg: RecipeConfig, config: TransformerConfig, model: list, optimizer, start_iteration: int):
        self.impl = cfg.train.cuda_graph_impl
        self.config, self.model, self.start_iteration = config, model, start_iteration
        self.warmup_steps = config.cuda_graph_warmup_steps
        # the overlapped parameter gather's forward pre-hooks: set on the graphed layers by hand after the capture
        self.param_gather_hooks = cfg.parallel.overlap_param_gather and cfg.parallel.use_distributed_optimizer
        self.te_helper = None
        if self.impl == "transformer_engine":
            from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

            self.te_helper = TECudaGraphHelper(model=model, config=config, seq_length=cfg.model.seq_length,
                                               micro_batch_size=cfg.train.micro_batch_size, optimizers=[optimizer])
        self._full: Optional[Callable] = None

    def schedule(self, forward_backward: Callable) -> Callable:
        """The pipeline schedule to run a step with: under full_iteration megatron-core's wrapper that captures and
        replays it (built once: it keeps the graphs and their static inputs), else `forward_backward` itself."""
        if self.impl != "full_iteration":
            return forward_backward
        if self._full is None:
            from megatron.core.full_cuda_graph import FullCudaGraphWrapper

            self._full = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=self.warmup_steps,
                                              use_single_mempool=self.config.cuda_graph_use_single_mempool)
        return self._full

    def results(self, losses: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """A step's per-micro-batch losses, copied out of a full-iteration graph's static tensors (which its next
        replay overwrites); as they are otherwise."""
        if self.impl != "full_iteration":
            return losses
        return [{name: value.clone() for name, value in micro_batch.items()} for micro_batch in losses]

    def before_step(self, iteration: int) -> bool:
        """Capture TransformerEngine's layer graphs before the step after `iteration` once the warm-up steps of this
        process have run; True when it captured."""
        helper = self.te_helper
        if helper is None or helper.capture_finished() or iteration - self.start_iteration != self.warmup_steps:
            return False
        if self.param_gather_hooks:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=False)
        helper.create_cudagraphs()
        if self.param_gather_hooks:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
            helper.cuda_graph_set_manual_hooks()
        return True

    def close(self) -> None:
        """Free TransformerEngine's layer graphs (Megatron-LM's end of training)."""
        if self.te_helper is not None and self.te_helper.graphs_created():
            self.te_helper.delete_cuda_graphs()
