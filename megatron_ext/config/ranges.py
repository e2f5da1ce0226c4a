"""The range of every numeric config key, checked when a config loads (before any process starts): sizes and counts
at least 1, probabilities and betas in [0, 1), scales and rates above 0. A value outside is one ConfigError naming
the key, the value and the range. ``tests/unit/test_config_ranges.py`` holds that every numeric key of the schema is
listed here; rules between keys (a timeout against another, a size against the layout) are in
:mod:`megatron_ext.config.validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from megatron_ext.errors import ConfigError


@dataclass(frozen=True)
class Range:
    low: float
    high: float = math.inf
    low_open: bool = False  # low itself is outside
    high_open: bool = True  # high itself is outside (always, for infinity)

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below and not math.isnan(value)

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


# Keys that take a number (in their range below) or "auto" (the schema's AutoNumber), and whether null (off) too
AUTO_NUMBER_KEYS: dict[str, bool] = {"parallel.distributed_timeout_minutes": False, "train.hang_timeout_s": True}

AT_LEAST_1, AT_LEAST_0, ABOVE_0 = Range(1), Range(0), Range(0, low_open=True)
PROBABILITY = Range(0, 1)  # [0, 1)
FRACTION = Range(0, 1, low_open=True, high_open=False)  # (0, 1]
ABOVE_1 = Range(1, low_open=True)

RANGES: dict[str, Range] = {
    "recipe.gpus": AT_LEAST_1, "recipe.published_params": AT_LEAST_1,
    **{f"model.{key}": AT_LEAST_1 for key in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
        "seq_length", "vocab_size", "make_vocab_size_divisible_by", "num_moe_experts", "moe_ffn_hidden_size",
        "moe_router_topk", "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
        "qk_pos_emb_head_dim", "v_head_dim", "moe_router_num_groups", "moe_router_group_topk", "mtp_num_layers")},
    "model.mtp_loss_scaling_factor": ABOVE_0, "model.original_max_position_embeddings": AT_LEAST_1,
    "model.rotary_scaling_factor": Range(1), "model.beta_fast": ABOVE_0, "model.beta_slow": ABOVE_0,
    "model.mscale": ABOVE_0, "model.mscale_all_dim": AT_LEAST_0,
    "model.rotary_base": ABOVE_1, "model.rope_scaling_factor": ABOVE_0,
    "model.layernorm_epsilon": Range(0, 1, low_open=True), "model.init_method_std": ABOVE_0,
    "model.hidden_dropout": PROBABILITY, "model.attention_dropout": PROBABILITY,
    "model.moe_aux_loss_coeff": AT_LEAST_0, "model.moe_router_bias_update_rate": AT_LEAST_0,
    "model.moe_expert_capacity_factor": ABOVE_0, "model.moe_router_topk_scaling_factor": ABOVE_0,
    "model.activation_func_clamp_value": ABOVE_0, "model.glu_linear_offset": AT_LEAST_0,
    # [left, right] and N >= 2 or 0/1 flags: config/model_rules.py's rules, which know which
    "model.window_size": AT_LEAST_0, "model.window_attn_skip_freq": AT_LEAST_0,
    "model.moe_layer_freq": AT_LEAST_0,  # N >= 1 or 0/1 flags: config/validate.py's rule, which knows which it is
    **{f"parallel.{key}": AT_LEAST_1 for key in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "num_distributed_optimizer_instances", "distributed_timeout_minutes", "ddp_bucket_size")},
    "parallel.num_layers_in_first_pipeline_stage": AT_LEAST_0, "parallel.num_layers_in_last_pipeline_stage": AT_LEAST_0,
    "train.train_iters": AT_LEAST_0, "train.global_batch_size": AT_LEAST_1, "train.micro_batch_size": AT_LEAST_1,
    "train.seed": AT_LEAST_0, "train.eval_interval": AT_LEAST_1, "train.eval_iters": AT_LEAST_0,
    "train.initial_loss_scale": ABOVE_0, "train.min_loss_scale": ABOVE_0, "train.loss_scale_window": AT_LEAST_1,
    "train.hysteresis": AT_LEAST_1, "train.min_offloaded_tensor_size": AT_LEAST_0,
    "train.cpu_offloading_num_layers": AT_LEAST_0, "train.exit_interval": AT_LEAST_1,
    "train.hang_timeout_s": ABOVE_0, "train.skip_nonfinite_steps": AT_LEAST_0,
    "train.spike_window": Range(5), "train.spike_threshold": ABOVE_0, "train.max_rewinds": AT_LEAST_0,
    "optimizer.lr": AT_LEAST_0, "optimizer.min_lr": AT_LEAST_0, "optimizer.weight_decay": AT_LEAST_0,
    "optimizer.clip_grad": AT_LEAST_0, "optimizer.lr_warmup_iters": AT_LEAST_0, "optimizer.lr_decay_iters": AT_LEAST_1,
    "optimizer.lr_wsd_decay_iters": AT_LEAST_1,
    "optimizer.adam_beta1": PROBABILITY, "optimizer.adam_beta2": PROBABILITY, "optimizer.adam_eps": ABOVE_0,
    "optimizer.optimizer_offload_fraction": FRACTION,
    "optimizer.muon_momentum": PROBABILITY, "optimizer.muon_num_ns_steps": AT_LEAST_1,
    "optimizer.muon_extra_scale_factor": ABOVE_0,
    "model.qk_clip_threshold": ABOVE_0, "model.qk_clip_alpha": Range(0, 1, high_open=False),
    "data.num_workers": AT_LEAST_0,
    "checkpoint.save_interval": AT_LEAST_1, "checkpoint.save_interval_minutes": ABOVE_0,
    "checkpoint.keep_last": AT_LEAST_1, "checkpoint.keep_every": AT_LEAST_1,
    "logging.log_interval": AT_LEAST_1, "logging.gpu_peak_tflops": ABOVE_0, "logging.straggler_factor": ABOVE_1,
    "logging.straggler_intervals": AT_LEAST_1, "logging.moe_collapse_share": FRACTION,
    "logging.moe_collapse_intervals": AT_LEAST_1, "logging.profile_steps": AT_LEAST_1,
    "logging.profile_ranks": AT_LEAST_0,
}


def check_ranges(values: dict[str, Any]) -> None:
    """`values`: the loaded config as a nested dict. Raises one ConfigError for the first key out of its range (a
    list's every element is checked). Rules between keys are :mod:`megatron_ext.config.validate`'s."""
    for key, nullable in AUTO_NUMBER_KEYS.items():
        value = _lookup(values, key)
        if (isinstance(value, str) and value != "auto") or (value is None and not nullable):
            raise ConfigError(f"{key}={value!r} is invalid: must be a number or auto" + (" or null (off)"
                                                                                         if nullable else ""))
    for key, allowed in RANGES.items():
        value = _lookup(values, key)
        for item in value if isinstance(value, list) else [value]:
            if item not in (None, "auto") and not isinstance(item, bool) and not allowed.holds(item):
                raise ConfigError(f"{key}={value!r} is invalid: must be {allowed}")


def _lookup(values: dict[str, Any], dotted_key: str) -> Optional[Any]:
    for part in dotted_key.split("."):
        values = values[part]
    return values
