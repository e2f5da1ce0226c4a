"""Muon's cost in a training step: the Newton-Schulz iterations megatron-core's Muon runs on every 2-D hidden weight
(emerging-optimizers' quintic iteration), on the matrices this rank orthogonalizes. Its optimizer-state bytes are
:func:`megatron_ext.planner.static_memory.optimizer_bytes_per_element`'s."""

from __future__ import annotations

from typing import Iterable

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.hardware import GPUSpec
from megatron_ext.planner.compute_time import GEMM_EFFICIENCY, architecture
from megatron_ext.planner.layout import RankShape


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` quintic Newton-Schulz iterations on a rows×cols matrix (a ≤ b its sides): A = X·Xᵀ (2a²b),
    A·A (2a³), then (bA + cA²)·X (2a²b)."""
    a, b = sorted((rows, cols))
    return steps * (4.0 * a * a * b + 2.0 * a ** 3)


def layer_matrices(shape: RankShape, moe: bool, split_qkv: bool, tp: int) -> list[tuple[int, int]]:
    """(rows, cols) of the weights Muon orthogonalizes in one decoder layer, each split `tp` ways as megatron-core
    splits it over TP (1: whole): the fused QKV per query group's Q, K and V with muon_split_qkv, the attention's
    output, the MLP's fc1 (gate and up) and fc2 — an MoE layer's router, each local expert's and the shared
    experts' instead."""
    h, d, m = shape.hidden, shape.head_dim, shape.model
    if m.multi_latent_attention:  # its five projections, as one square-ish block of the attention's parameters
        attention = [(h, m.attention_parameters() // h // tp)]
    elif split_qkv:
        groups = max(1, shape.groups // tp)
        attention = [(shape.heads // shape.groups * d, h), (d, h), (d, h)] * groups
    else:
        attention = [((shape.heads + 2 * shape.groups) * d // tp, h)]
    attention.append((h, shape.heads * d // tp))

    def mlp(ffn: int, split: int) -> list[tuple[int, int]]:
        return [(2 * ffn // split, h), (h, ffn // split)] if ffn else []

    if not moe:
        return attention + mlp(shape.ffn, tp)
    experts = shape.experts // shape.ep
    return attention + [(shape.experts, h)] + mlp(shape.expert_ffn, shape.etp) * experts + mlp(shape.shared_ffn, tp)


def muon_seconds(cfg: RecipeConfig, shape: RankShape, layers: Iterable[int], dp_cp: int, gpu: GPUSpec) -> float:
    """Seconds of Newton-Schulz per step on one rank of the pipeline stage holding `layers`: blockwise on this TP
    rank's shards, duplicated on whole matrices, distributed on whole matrices' work split over TP; the layer-wise
    distributed optimizer spreads the matrices over DP×CP. At the Hopper/Blackwell GEMM efficiency of
    :mod:`.compute_time` (bf16 matmuls: megatron-core's `medium` fp32 matmul precision)."""
    o = cfg.optimizer
    if o.name != "muon":
        return 0.0
    split = shape.tp if o.muon_tp_mode == "blockwise" else 1
    flops = sum(newton_schulz_flops(rows, cols, o.muon_num_ns_steps)
                for layer in layers for rows, cols in layer_matrices(shape, shape.model.is_moe_layer(layer),
                                                                     o.muon_split_qkv, split))
    if o.muon_tp_mode == "distributed":
        flops /= shape.tp
    if cfg.parallel.use_distributed_optimizer:
        flops /= dp_cp
    return flops / (gpu.peak_bf16_tflops * 1e12 * GEMM_EFFICIENCY[architecture(gpu)])
