"""What an MoE model's routers did in a training step, for TensorBoard (``moe/…``) and the console: the
load-balancing loss, as megatron-core's routers record it (their layer-wise tracker, summed over the micro batches).

The loss reported is the model's mean over its MoE layers and over the step's micro batches, without the
coefficient: the quantity ``model.moe_aux_loss_coeff`` weighs, the same at every layout.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils

from megatron_ext.config.schema import RecipeConfig

# the tracker name of each load-balancing loss, as megatron-core's router records it
TRACKED_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


class RouterMetrics:
    """Reads and resets megatron-core's MoE loss tracker once per training step (collective: every rank calls
    :meth:`step`, since the values are reduced over the pipeline, tensor/context and data-parallel groups)."""

    def __init__(self, cfg: RecipeConfig, device: torch.device):
        m = cfg.model
        self.num_layers = m.num_layers
        self.device = device
        tracked = TRACKED_LOSSES.get(m.moe_router_load_balancing_type)
        self.tracked = [tracked] if m.num_moe_experts is not None and tracked and m.moe_aux_loss_coeff > 0 else []

    def step(self, num_microbatches: int) -> dict[str, float]:
        """This step's ``moe/<loss>`` scalars ({} for a dense model); clears the tracker for the next step."""
        if not self.tracked:
            return {}
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        for name in self.tracked:  # a pipeline stage without MoE layers has recorded nothing, yet must reduce
            if name not in tracker:
                tracker[name] = {"values": torch.zeros(self.num_layers, device=self.device), "reduce_group": None,
                                 "avg_group": None, "reduce_group_has_dp": False}
        moe_utils.reduce_aux_losses_tracker_across_ranks(self.tracked)
        scalars = {f"moe/{name}": (tracker[name]["values"].sum() / self.num_layers / num_microbatches).item()
                   for name in self.tracked}
        moe_utils.clear_aux_losses_tracker()
        return scalars

