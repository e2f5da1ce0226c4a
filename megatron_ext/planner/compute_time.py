"""Seconds of one micro batch's compute on a pipeline stage in TransformerEngine's layers, by the kernels that spend
them: GEMMs at the precision's peak, the experts' grouped GEMMs, attention, memory-bound elementwise work, FP8/FP4
quantization, and the host's launches that CUDA graphs remove.

The constants below were fitted once to the published runs in docs/published-runs.csv (docs/planner.md: "Time model
against the published record"); each is a physical quantity — an efficiency, bytes moved, or host time — not a
per-row correction. Local layers (megatron-core's own, eager or compiled) keep the single calibrated efficiency of
:mod:`.step_time`, which was measured on an H100 without TE.
"""

from __future__ import annotations

import collections
from typing import Sequence

from megatron_ext.config.schema import RecipeConfig
from megatron_ext.hardware import GPUSpec
from megatron_ext.planner.layout import RankShape

# Fraction of the precision's dense peak TE's GEMMs reach at the shapes these models run (fit; cuBLASLt on H100 BF16
# reaches 0.7-0.8 on large square shapes). Blackwell's per-architecture figure: fit to its published runs.
GEMM_EFFICIENCY = {"hopper": 0.64, "blackwell": 0.45}
# Fraction of dense BF16 peak fused attention reaches forward + backward, causal, head dim 128, 4-8k tokens (published
# kernel measurements, not fit: FlashAttention-3 on H100 ~75 % forward and ~55 % backward — 0.5 for the 1:2.5 mix;
# cuDNN / FlashAttention-4 on B200 ~70 % forward, lower backward — 0.45)
ATTENTION_EFFICIENCY = {"hopper": 0.5, "blackwell": 0.45}
# Tokens per expert per micro batch at which the experts' grouped GEMM reaches half of GEMM_EFFICIENCY (fit): a
# group of small GEMMs wastes the tail of its tiles and waves, which the roofline below does not see
GROUPED_GEMM_HALF_TOKENS = 530
# Bytes per GEMM operand element by recipe (FP8 inputs and weights; NVFP4's 4 bits and its scales); BF16 otherwise
OPERAND_BYTES = {"delayed": 1, "tensorwise": 1, "blockwise": 1, "mxfp8": 1, "nvfp4": 0.5}
# Elementwise work per token per layer, in elements moved (read + written) at HBM bandwidth, forward and backward: two
# RMSNorms, two residual adds and RoPE on the hidden side (≈ 13·h forward, twice that backward), SwiGLU on the MLP
# side (read 2f, write f; ×3 with backward); an MoE layer's permute and unpermute copy each routed token's hidden
# state, both ways, forward and backward
ELEMENTWISE_PER_HIDDEN = 39
ELEMENTWISE_PER_FFN = 9
PERMUTE_PER_ROUTED_HIDDEN = 8
# Bytes one quantization moves per element: read bf16 (2), write FP8 row- and column-wise (2); tensorwise current
# scaling reads the tensor once more for its amax (2); block scales are written beside (≈ 0)
QUANTIZE_BYTES = {"delayed": 4, "tensorwise": 6, "blockwise": 4, "mxfp8": 4, "nvfp4": 3}
# Host time per decoder layer per micro batch the GPU waits for (kernel launches TE's layers issue; fit); a dropless MoE
# layer adds the device-to-host sync of its token counts, after which the GPU idles while the host launches the rest
LAUNCH_S = 0.01e-3
MOE_SYNC_S = 0.58e-3


def architecture(gpu: GPUSpec) -> str:
    """The GPU generation the efficiencies are kept for: hopper (and Ampere), blackwell."""
    return "blackwell" if gpu.compute_capability >= (10, 0) else "hopper"


def gemm_peak_tflops(cfg: RecipeConfig, gpu: GPUSpec) -> float:
    """The dense peak the recipe's linear layers run at: FP4 (train.fp4), FP8 (train.fp8), else BF16."""
    if cfg.train.fp4:
        return gpu.peak_fp4_tflops
    if cfg.train.fp8:
        return gpu.peak_fp8_tflops
    return gpu.peak_bf16_tflops


def graphed_launch_share(cfg: RecipeConfig, moe: bool) -> float:
    """The share of a layer's host launches CUDA graphs take away: all of them for a full-iteration graph or a
    whole-layer one; per captured region otherwise (attention and the MLP half each; the router and preprocessing
    half of an MoE layer's own)."""
    t = cfg.train
    if t.cuda_graph_impl == "none":
        return 0.0
    modules = set(t.cuda_graph_modules)
    if t.cuda_graph_impl == "full_iteration" or not modules:
        return 1.0
    if moe:
        return 0.5 * ("attn" in modules) + 0.5 * (0.5 * ("moe_router" in modules) + 0.5 * (
            "moe_preprocess" in modules) if "moe" not in modules else 1.0)
    return 0.5 * ("attn" in modules) + 0.5 * ("mlp" in modules)


def te_compute_seconds(cfg: RecipeConfig, shape: RankShape, layers: Sequence[int], output_layer: bool,
                       gpu: GPUSpec, tokens: int) -> dict[str, float]:
    """One micro batch of `tokens` per CP rank through `layers` (and the output layer) of TE's layers on one GPU,
    by kernel class, in seconds."""
    model, t = shape.model, cfg.train
    arch, tp = architecture(gpu), shape.tp
    peak = gemm_peak_tflops(cfg, gpu) * 1e12 * GEMM_EFFICIENCY[arch]
    attention_peak = gpu.peak_bf16_tflops * 1e12 * ATTENTION_EFFICIENCY[arch]
    hbm = gpu.hbm_tb_s * 1e12
    recompute = t.recompute_granularity
    modules = list(t.recompute_modules) or ["core_attn"]
    flops = {"dense_gemm": 0.0, "expert_gemm": 0.0, "attention": 0.0}
    elements, quantized, launch = 0.0, 0.0, 0.0
    operands = {"dense_gemm": 0.0, "expert_gemm": 0.0}  # bytes the GEMMs read and write, all three passes
    h = shape.hidden
    width = OPERAND_BYTES.get("nvfp4" if t.fp4 else t.fp8 or "", shape.bytes_per_value)
    per_expert = 0.0
    if shape.experts:  # a balanced share of the EP group's routed tokens per local expert
        per_expert = shape.ep * tokens / (tp if shape.sp else 1) * shape.topk / shape.experts
    # layers of one kind cost the same: each kind once, times its count (a search asks for every layer of every stage)
    kinds_of_layers = collections.Counter((model.is_moe_layer(layer), model.is_window_layer(layer)) for layer in layers)
    for (moe, windowed), count in kinds_of_layers.items():
        kinds = model.layer_flops_by_kind(moe, windowed=windowed)
        scale = 4 / 3 if recompute == "full" else 1.0  # the forward again
        for kind, value in kinds.items():
            flops[kind] += count * value * scale
        if recompute == "selective":
            flops["dense_gemm"] += count * model.recompute_flops_per_token(
                moe, [m for m in modules if m != "core_attn"])
            flops["attention"] += count * model.recompute_flops_per_token(
                moe, [m for m in modules if m == "core_attn"], windowed)
        ffn = shape.topk * shape.expert_ffn + shape.shared_ffn if moe else shape.ffn
        dense_ffn = shape.shared_ffn if moe else shape.ffn
        # weights on this rank and each token's GEMM inputs and outputs (qkv, proj, fc1, fc2), read or written once
        # per pass: forward, input gradient, weight gradient
        operands["dense_gemm"] += count * 3 * width * (
            (model.attention_parameters() + 3 * h * dense_ffn) / tp
            + tokens * (4 * h + (model.attention_parameters() / h + 3 * dense_ffn) / tp))
        if moe:
            experts_here, f = shape.experts // shape.ep, shape.expert_ffn // shape.etp
            operands["expert_gemm"] += count * 3 * width * experts_here * (
                3 * h * f + per_expert * (2 * h + 3 * f))
        elements += count * (ELEMENTWISE_PER_HIDDEN * h + ELEMENTWISE_PER_FFN * ffn + (
            PERMUTE_PER_ROUTED_HIDDEN * shape.topk * h if moe else 0))
        # every linear's input and output gradient quantized, forward and backward: attention's in and out
        # projections' and the MLP's (up: h → 2f, down: f → h)
        quantized += count * (2 * (h + model.num_attention_heads * model.query_key_head_dim) + 2 * (
            2 * (h + 2 * ffn) + (ffn + h)))
        # the sync stays with per-layer graphs (the experts and their dispatch run outside them); a full-iteration
        # graph pads the experts to a capacity and has none
        dropless = moe and cfg.model.moe_expert_capacity_factor is None and t.cuda_graph_impl != "full_iteration"
        launch += count * (LAUNCH_S * (1 - graphed_launch_share(cfg, moe)) + (MOE_SYNC_S if dropless else 0.0))
    if output_layer:
        flops["dense_gemm"] += model.output_layer_flops_per_token(shape.vocab) + model.mtp_num_layers * (
            model.output_layer_flops_per_token(shape.vocab) + 12.0 * h * h)
    recipe = "nvfp4" if t.fp4 else t.fp8
    # each GEMM class bound by its FLOPs or by its operands' HBM traffic, whichever is longer (the roofline): small
    # experts and narrow models on a fast GPU are bound by reading their weights
    return {
        "gemm": max(tokens * flops["dense_gemm"] / tp / peak, operands["dense_gemm"] / hbm),
        "expert_gemm": max(tokens * flops["expert_gemm"] / tp / peak * (1 + GROUPED_GEMM_HALF_TOKENS / per_expert)
                           if per_expert else 0.0, operands["expert_gemm"] / hbm),
        "attention": tokens * flops["attention"] / tp / attention_peak,
        "elementwise": tokens * elements * shape.bytes_per_value / tp / hbm,
        "quantize": tokens * quantized * QUANTIZE_BYTES[recipe] / tp / hbm if recipe else 0.0,
        "launch": launch,
    }
