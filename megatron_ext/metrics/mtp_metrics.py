"""Multi-token prediction's losses for TensorBoard and the console: ``mtp/loss_k``, the cross-entropy of the k-th MTP
layer's prediction (the token k + 1 ahead), averaged over the step's training micro batches and the DP×CP ranks.

megatron-core records each micro batch's MTP losses (a mean over its tokens) on the last pipeline stage; they reach
the gradients through the schedule, not the loss the model returns (``model/mtp.py``). Read every step, left on the
device as the step's other scalars are, and summed over the pipeline so that rank 0 (the first stage) holds them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_ext.config.schema import RecipeConfig


class MTPMetrics:
    """Collective: every rank calls :meth:`step`."""

    def __init__(self, cfg: RecipeConfig, device: torch.device):
        self.layers, self.device = cfg.model.mtp_num_layers or 0, device

    def step(self, num_microbatches: int) -> dict[str, torch.Tensor]:
        """This step's ``mtp/loss_k`` scalars ({} without MTP), as device tensors; the tracker is cleared."""
        if not self.layers:
            return {}
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" in tracker:  # the last stage, once a training micro batch ran
            losses = tracker["loss_values"].clone()
            MTPLossLoggingHelper.clean_metrics_in_tracker()
        else:
            losses = torch.zeros(self.layers, device=self.device)
        data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(losses, group=data_parallel)  # a sum: gloo has no average
        dist.all_reduce(losses, group=parallel_state.get_pipeline_model_parallel_group())  # zeros but on the last
        losses /= num_microbatches * dist.get_world_size(data_parallel)
        return {f"mtp/loss_{k + 1}": losses[k] for k in range(self.layers)}
