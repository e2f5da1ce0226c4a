"""What an MoE model's routers did, for TensorBoard (``moe/…``), the console and a routing-collapse warning.

* Every step: the load-balancing loss as megatron-core's routers record it (their layer-wise tracker), without its
  coefficient, averaged over the MoE layers and the step's micro batches — the quantity ``model.moe_aux_loss_coeff``
  weighs, the same at every layout.
* Every log interval, per MoE layer, over the interval's training micro batches: the share of the layer's tokens
  its busiest and its idlest expert took (``max_load``/``min_load``: an even split gives top-k / experts to each),
  the coefficient of variation of the experts' token counts (``load_cv``: 0 when even), and with a capacity factor
  the share of routed token slots dropped. The counts are taken from each router's routing map (a forward hook) and
  summed over all ranks, whose tokens are distinct (sequence parallelism, CP and DP split them); shares do not change
  when activation recompute runs a router twice.
* A warning when, in some layer, one expert took more than ``logging.moe_collapse_share`` of the tokens for
  ``logging.moe_collapse_intervals`` log intervals in a row.
"""

from __future__ import annotations

import logging
import re
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.config.schema import ModelConfig, RecipeConfig
from megatron_ext.config.shape import ModelShape
from megatron_ext.model.hybrid import positions_per_layer

log = logging.getLogger("megatron_ext")

MTP_DEPTH = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")  # a module inside multi-token prediction's depth k
# the tracker name of each load-balancing loss, as megatron-core's router records it
TRACKED_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def load_statistics(counts: torch.Tensor, tokens: torch.Tensor, topk: int) -> dict[str, torch.Tensor]:
    """Per layer ([layers, experts] token counts of each expert, [layers] tokens routed): the busiest and idlest
    expert's share of the tokens, the counts' coefficient of variation, and the share of token slots dropped."""
    counts, tokens = counts.double(), tokens.double().clamp_min(1)
    mean = counts.mean(dim=1).clamp_min(1e-12)
    return {
        "max_load": counts.max(dim=1).values / tokens,
        "min_load": counts.min(dim=1).values / tokens,
        "load_cv": counts.std(dim=1, unbiased=False) / mean,
        "dropped": 1 - counts.sum(dim=1) / (tokens * topk),
    }


def collapse_remedy(model: ModelConfig) -> str:
    """What to change against a routing collapse, given the balancing the model already has."""
    if model.moe_router_enable_expert_bias:
        return "raise model.moe_router_bias_update_rate (the expert bias's step), or lower the learning rate"
    if model.moe_router_load_balancing_type == "none":
        return ("balance the load: model.moe_router_load_balancing_type=aux_loss or seq_aux_loss, or the expert bias "
                "(model.moe_router_enable_expert_bias=true with sigmoid scores)")
    return "raise model.moe_aux_loss_coeff, or lower the learning rate"


class CollapseDetector:
    """Names a layer whose busiest expert took more than `share` of the tokens for `intervals` log intervals in a
    row, once until it recovers, with `remedy` (:func:`collapse_remedy`)."""

    def __init__(self, share: Optional[float], intervals: int, remedy: str):
        self.share, self.intervals, self.remedy = share, intervals, remedy
        self.streak: dict[int, int] = {}

    def update(self, max_load: dict[int, float], busiest: dict[int, int], even: float) -> list[str]:
        """`max_load` and `busiest` expert by layer number for one interval; the warnings due now."""
        if self.share is None:
            return []
        warnings = []
        for layer, load in max_load.items():
            self.streak[layer] = self.streak.get(layer, 0) + 1 if load > self.share else 0
            if self.streak[layer] == self.intervals:
                warnings.append(
                    f"routing collapse in MoE layer {layer}: expert {busiest[layer]} took {100 * load:.0f}% of the "
                    f"layer's tokens, above logging.moe_collapse_share={self.share:g}, for {self.intervals} log "
                    f"intervals in a row (an even split gives each expert {100 * even:.1f}%): {self.remedy}")
        return warnings


class RouterMetrics:
    """Reads megatron-core's MoE loss tracker every step and the routers' token counts every log interval.
    Collective: every rank calls :meth:`step`, since the values are reduced over the whole world."""

    def __init__(self, cfg: RecipeConfig, device: torch.device, model_chunks: list[torch.nn.Module]):
        m, g = cfg.model, cfg.logging
        # megatron-core numbers routers by layer position: a HybridModel's decoder layer takes two (model/hybrid.py)
        self.positions = positions_per_layer(cfg)
        self.decoder_layers, self.log_interval = m.num_layers, g.log_interval
        self.num_layers = self.positions * m.num_layers  # megatron-core's count
        self.moe = m.num_moe_experts is not None
        self.mtp_layers = m.mtp_num_layers
        # numbered from 1 (a decoder layer's number), multi-token prediction's after the decoder's
        shape = ModelShape.of(m)
        # as megatron-core's tracker takes moe_layer_freq: a flag per position, the MLP's the last of a layer's
        self.moe_layer_pattern = [flag if position == self.positions - 1 else 0 for flag in shape.moe_layers
                                  for position in range(self.positions)]
        self.moe_layers = [i + 1 for i in range(shape.num_layers + shape.mtp_num_layers) if shape.is_moe_layer(i)]
        tracked = TRACKED_LOSSES.get(m.moe_router_load_balancing_type)
        self.tracked = [tracked] if self.moe and tracked and m.moe_aux_loss_coeff > 0 else []
        self.topk, self.experts = m.moe_router_topk, m.num_moe_experts or 0
        self.capacity = m.moe_expert_capacity_factor is not None
        layers = shape.num_layers + shape.mtp_num_layers
        self.counts = torch.zeros(layers, self.experts, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(layers, dtype=torch.int64, device=device)
        self.collapse = CollapseDetector(g.moe_collapse_share, g.moe_collapse_intervals, collapse_remedy(m))
        for chunk in model_chunks if self.moe else []:
            for name, module in chunk.named_modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(partial(self._count, self._slot(name, module)))

    def _slot(self, name: str, router: TopKRouter) -> int:
        """The router's row in the counts: its decoder layer's, or after them its MTP depth's, read from where the
        module sits (a HybridModel's MTP stack numbers its positions from 1 and does not flag its MoE layers as MTP's,
        megatron-core 0.19.2)."""
        depth = MTP_DEPTH.search(name)
        return self.decoder_layers + int(depth.group(1)) if depth else (router.layer_number - 1) // self.positions

    def _count(self, layer: int, router: TopKRouter, _args: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not (router.training and torch.is_grad_enabled()):  # training micro batches only, as the aux loss
            return
        routing_map = output[1]
        self.counts[layer] += routing_map.sum(dim=0)
        self.tokens[layer] += routing_map.shape[0]

    def step(self, iteration: int, num_microbatches: int) -> dict[str, torch.Tensor | float]:
        """This step's ``moe/…`` scalars ({} for a dense model): the load-balancing loss, a device tensor (reduced
        on the device, read when the step is settled), and on log-interval steps the load statistics of the
        interval (which is then started anew)."""
        scalars = self._losses(num_microbatches)
        if self.moe and iteration % self.log_interval == 0:
            scalars.update(self._loads())
        return scalars

    def _losses(self, num_microbatches: int) -> dict[str, torch.Tensor]:
        if not self.tracked:
            return {}
        # report() reduces over the pipeline (a stage without MoE layers joins with zeros: force_initialize), TP×CP
        # and DP, averages over the layers and scales by `loss_scale`, then clears the tracker
        losses: dict[str, torch.Tensor] = {}
        get_moe_metrics_tracker().report(loss_scale=1 / num_microbatches, iteration=0, force_initialize=True,
                                         track_names=list(self.tracked), num_layers=self.num_layers,
                                         moe_layer_freq=self.moe_layer_pattern, mtp_num_layers=self.mtp_layers,
                                         total_loss_dict=losses)
        return {f"moe/{name}": losses[name] for name in self.tracked}

    def _loads(self) -> dict[str, float]:
        dist.all_reduce(self.counts)
        dist.all_reduce(self.tokens)
        stats = {name: values.tolist() for name, values in load_statistics(self.counts, self.tokens, self.topk).items()}
        busiest = self.counts.argmax(dim=1).tolist()
        self.counts.zero_()
        self.tokens.zero_()
        layers = self.moe_layers
        scalars = {f"moe/layer{layer}/{name}": values[layer - 1] for name, values in stats.items()
                   if name != "dropped" or self.capacity for layer in layers}
        scalars["moe/max_load"] = max(stats["max_load"][layer - 1] for layer in layers)
        scalars["moe/load_cv"] = sum(stats["load_cv"][layer - 1] for layer in layers) / len(layers)
        if self.capacity:
            scalars["moe/dropped"] = sum(stats["dropped"][layer - 1] for layer in layers) / len(layers)
        warnings = self.collapse.update({layer: stats["max_load"][layer - 1] for layer in layers},
                                        {layer: busiest[layer - 1] for layer in layers}, self.topk / self.experts)
        if dist.get_rank() == 0:
            for warning in warnings:
                log.warning(warning)
        return scalars
