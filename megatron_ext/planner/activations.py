"""Activation bytes per layer, chunk and pipeline stage under (interleaved) 1F1B, with recompute, activation
offload and the output layer's logits."""

from __future__ import annotations

import math
from typing import Callable, Optional

from megatron_ext.config.schema import RecipeConfig, microbatches_per_step, pipeline_stage_layers
from megatron_ext.planner.layout import RankShape
from megatron_ext.planner.static_memory import mtp_layers, stage_chunks


def layer_activation_bytes(cfg: RecipeConfig, fused_norm: bool = True, moe: bool = True) -> int:
    """Bytes one decoder layer (an MoE layer with `moe`, in an MoE model) saves for backward per micro batch on one
    rank (flash attention).

    Per token with t = TP, D = activation bytes, Hq = heads·head_dim, Hkv = groups·head_dim, f = FFN:
    sequence-parallel part (÷t with SP, else replicated): two norms (each its input in D + fp32
    rstd when fused; torch's composite CPU RMSNorm keeps an fp32 input copy, the fp32 normalized
    tensor and rstd) and the inputs of linear_qkv and linear_fc1 (h·D each);
    tensor-parallel part (÷t): the fused QKV output (v is a view of it), RoPE'd q and k, the
    attention output (shared with linear_proj's input), fc1's output (2f), silu's output, the
    ``x_linear + offset`` copy and fc2's input (f each) = D·(3Hq + 3Hkv + 5f), plus the fp32
    log-sum-exp per head. No s² term: flash kernels (TE, cuDNN, and torch's CPU SDPA) keep none.
    RoPE keeps cos/sin for q and k: 4·(s/CP)·head_dim·D per micro batch.
    Selective recompute re-runs core attention from q, k, v: only the log-sum-exp goes (with flash
    attention there is no s² score matrix for it to save).
    Full recompute keeps only the layer input (h·D per token, ÷t with SP).
    """
    m = cfg.model
    shape = RankShape.of(cfg, 1)
    d_bytes = shape.bytes_per_value
    tokens = cfg.train.micro_batch_size * m.seq_length // shape.cp
    seq_shard = shape.tp if shape.sp else 1
    h, t = shape.hidden, shape.tp
    if cfg.train.recompute_granularity == "full":
        return tokens // seq_shard * h * d_bytes
    def norm(width: int) -> int:  # a norm's saved input (and rstd) per token; unfused: fp32 input and output copies
        return width * d_bytes + 4 if fused_norm else 2 * width * 4 + 4

    seq_part = tokens // seq_shard * (2 * norm(h) + 2 * h * d_bytes)
    hq, hkv = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    moe_layer = moe and shape.experts > 0
    tp_part = tokens * d_bytes * (0 if moe_layer else 5 * shape.ffn) // t
    model = shape.model
    if model.multi_latent_attention:
        tp_part += _latent_attention_bytes(shape, tokens, seq_shard, norm)
    else:
        tp_part += tokens * d_bytes * (3 * hq + 3 * hkv) // t
    if shape.qk_norm:  # each head's query and key normed as the layer norms are, with an fp32 rstd per head
        per_channel = d_bytes if fused_norm else 2 * 4
        tp_part += tokens * ((hq + hkv) * per_channel + (shape.heads + shape.groups) * 4) // t
    if moe_layer:
        tp_part += _moe_activation_bytes(shape, tokens // seq_shard)
    # selective: the checkpoint keeps q, k, v (and megatron's int32 mask-type tensor) instead of the lse
    lse = 4 if cfg.train.recompute_granularity == "selective" else tokens * 4 * shape.heads // t
    rotary = model.qk_pos_emb_head_dim if model.multi_latent_attention else shape.head_dim
    rope = 4 * (m.seq_length // shape.cp) * rotary * d_bytes
    return seq_part + tp_part + lse + rope


def _latent_attention_bytes(shape: RankShape, tokens: int, seq_shard: int, norm: Callable[[int], int]) -> int:
    """What megatron-core's multi-latent attention saves per micro batch on one rank besides the layer's norms, the
    down-projections' input and RoPE's cos/sin: the compressed query's and KV's norms and the up-projections' inputs
    (split over the sequence under SP), then per head (÷TP) what flash attention keeps (:func:`mla_core_attention_bytes`)
    and its output, linear_proj's input. (The rotary halves are not kept: RoPE saves only its cos/sin.)"""
    model, d_bytes = shape.model, shape.bytes_per_value
    latent = tokens // seq_shard * sum(norm(rank) + rank * d_bytes for rank in (model.q_lora_rank, model.kv_lora_rank))
    output = tokens * d_bytes * shape.heads * model.value_head_dim // shape.tp
    return latent + mla_core_attention_bytes(shape, tokens) + output


def mla_core_attention_bytes(shape: RankShape, tokens: int) -> int:
    """What a flash core attention keeps for multi-latent attention per micro batch on one rank, its log-sum-exp
    aside: each head's query and key (non-rotary + rotary channels) and value. (On CPU, torch's SDPA takes its math
    path for keys and values of different head sizes, which keeps fp32 copies and the score matrix instead.)"""
    model = shape.model
    return tokens * shape.bytes_per_value * shape.heads * (2 * model.query_key_head_dim + model.value_head_dim) // (
        shape.tp)


def _expert_tokens(shape: RankShape, sequence_tokens: int) -> int:
    """Token-expert assignments one rank's experts compute per micro batch under balanced routing: the
    `sequence_tokens` of each of the EP×ETP ranks, top-k each, spread over the EP ranks (ETP ranks see them all)."""
    return sequence_tokens * shape.etp * shape.topk


def _moe_activation_bytes(shape: RankShape, sequence_tokens: int) -> int:
    """What an MoE layer's MLP saves per micro batch on one rank, for `sequence_tokens` tokens (÷TP with SP): the
    router's fp32 logits and scores and its routing map (per expert), its top-k scores and indices (per choice);
    then per token-expert assignment its permuted input, its sort index and fp32 weight, and the expert's SwiGLU
    tensors (fc1 output 2f, silu, the gated product, fc2 input: 5f/ETP); and the shared experts' SwiGLU tensors of
    the whole TP group's tokens."""
    d_bytes, f = shape.bytes_per_value, shape.expert_ffn
    router = sequence_tokens * (shape.experts * (4 + 4 + 1) + shape.topk * (8 + 8 + 4))
    experts = _expert_tokens(shape, sequence_tokens) * (d_bytes * (shape.hidden + 5 * f // shape.etp) + 8 + 4)
    shared = sequence_tokens * (shape.tp if shape.sp else 1) * d_bytes * 5 * shape.shared_ffn // shape.tp
    return router + experts + shared


def offloaded_layer_bytes(cfg: RecipeConfig, fused_norm: bool = True) -> int:
    """Device bytes train.offload_modules moves to host memory per decoder layer and micro batch (megatron-core's
    fine-grained offload copies what autograd saves inside each named module), in :func:`layer_activation_bytes`'
    terms: each norm its saved input (and rstd), qkv_linear its input; core_attn the RoPE'd q and k, v (a view that
    keeps the whole fused QKV output) and the log-sum-exp; its output only with attn_proj, whose input it is."""
    modules = set(cfg.train.offload_modules)
    if not modules or cfg.train.recompute_granularity == "full":
        return 0
    shape = RankShape.of(cfg, 1)
    d_bytes, h, t = shape.bytes_per_value, shape.hidden, shape.tp
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length // shape.cp
    seq_shard = t if shape.sp else 1
    norm = h * d_bytes + 4 if fused_norm else 2 * h * 4 + 4
    hq, hkv = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    per_token = {"attn_norm": norm // seq_shard, "mlp_norm": norm // seq_shard, "qkv_linear": h * d_bytes / seq_shard,
                 "core_attn": d_bytes * (2 * hq + 3 * hkv) / t + 4 * shape.heads / t, "attn_proj": d_bytes * hq / t}
    return int(tokens * sum(per_token[m] for m in modules))


def chunk_activation_bytes(cfg: RecipeConfig, vocab_size: int, layers: range, pre: bool, post: bool,
                           fused_norm: bool = True) -> int:
    """Bytes one model chunk saves for backward per micro batch: its decoder `layers` (numbered from 0 in the whole
    model), embedding and loss, and with the loss the MTP layers (each a decoder layer, its input norms and projection,
    and an output layer and loss of its own)."""
    shape = RankShape.of(cfg, vocab_size)
    d_bytes, h = shape.bytes_per_value, shape.hidden
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length // shape.cp
    seq_shard = shape.tp if shape.sp else 1
    model = shape.model
    moe = sum(map(model.is_moe_layer, layers))  # each kind of layer computed once: the search asks many times
    total = sum(n * layer_activation_bytes(cfg, fused_norm, kind) for kind, n in ((True, moe), (False, len(layers) - moe))
                if n)
    if cfg.train.recompute_granularity == "full" and layers:
        total += 4 * cfg.model.seq_length * shape.head_dim  # fp32 rotary table, shared by the layers
    if pre:  # token ids (int64), and the out-of-shard mask of the vocab-parallel embedding
        total += tokens * 8 + (tokens if shape.tp > 1 else 0)
    if post:
        norm = h * d_bytes + 4 if fused_norm else 2 * h * 4 + 4
        output = tokens // seq_shard * (norm + h * d_bytes)  # final norm, output layer input
        output += output_loss_bytes(cfg, shape, tokens)[0]
        output += tokens * (1 + 8 + 4)  # CE target mask and masked targets, the loss mask
        mtp = mtp_layers(shape)
        total += output * (1 + len(mtp)) + sum(
            layer_activation_bytes(cfg, fused_norm, model.is_moe_layer(layer))
            + tokens // seq_shard * (2 * norm + 2 * h * d_bytes) for layer in mtp)  # + enorm, hnorm, eh_proj input
    return total


def output_loss_bytes(cfg: RecipeConfig, shape: RankShape, tokens: int) -> tuple[int, int]:
    """Bytes the output layer + loss of one micro batch keep for backward, and its transient working set.

    megatron-core: the vocab-parallel CE keeps an fp32 softmax; the logits, then their gradient, are the
    working set. liger-kernel's fused linear cross-entropy (train.fused_linear_cross_entropy) computes the
    gradients in the forward pass and keeps them (input's in the activation dtype, the output weight's cast
    back from its fp32 accumulator); its working set is one chunk of logits — ``next_pow2(tokens /
    ceil(vocab / hidden))`` tokens wide, its chunking rule — and the fp32 weight-gradient accumulator."""
    d_bytes, h, vocab = shape.bytes_per_value, shape.hidden, shape.vocab
    if not cfg.train.fused_linear_cross_entropy:
        return tokens * vocab // shape.tp * 4, tokens * vocab // shape.tp * d_bytes
    chunk = min(2 ** math.ceil(math.log2(-(-tokens // -(-vocab // h)))), tokens)
    return tokens * h * d_bytes + vocab * h * d_bytes, chunk * vocab * d_bytes + vocab * h * 4


def microbatches_in_flight(pp: int, vpp: Optional[int], num_microbatches: int, pp_rank: int) -> int:
    """Chunk-micro-batches whose activations a stage holds at its peak (megatron's warmup + 1)."""
    if pp == 1:
        return 1
    if not vpp:
        return min(pp - pp_rank, num_microbatches)
    total = num_microbatches * vpp
    warmup = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp
    return total if warmup >= total else warmup + 1


def stage_activation_bytes(cfg: RecipeConfig, vocab_size: int, world_size: int, pp_rank: int,
                           fused_norm: bool = True) -> int:
    """Activations a pipeline stage holds at its peak under (interleaved) 1F1B."""
    p = cfg.parallel
    shape = RankShape.of(cfg, vocab_size)
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    m = microbatches_per_step(cfg, world_size)
    chunks = stage_chunks(tuple(pipeline_stage_layers(cfg)), vpp, pp_rank)
    n = microbatches_in_flight(pp, vpp, m, pp_rank)
    # the in-flight micro batches are spread over the chunks: counted at the chunk that saves the most (they differ
    # where some layers are MoE layers and some dense)
    layers = chunks[0][0]
    body = max(chunk_activation_bytes(cfg, vocab_size, chunk, False, False, fused_norm) for chunk, _, _ in chunks)
    total = n * body
    # Activation offload keeps two layers' saved tensors on the device: megatron-core's last group of each
    # module (not offloaded, so its reload cannot stall the backward pass) and the one being copied.
    total -= max(n * len(layers) - 2, 0) * offloaded_layer_bytes(cfg, fused_norm)
    if any(pre for _, pre, _ in chunks):  # chunk 0 holds at most ceil(n / vpp) of the in-flight ones
        total += -(-n // len(chunks)) * (chunk_activation_bytes(cfg, vocab_size, range(0), True, False, fused_norm))
    if any(post for *_, post in chunks):  # the loss chunk runs its backward right after its forward
        total += chunk_activation_bytes(cfg, vocab_size, range(0), False, True, fused_norm)
    # deallocate_pipeline_outputs is off: every in-flight output sent downstream stays allocated.
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length // shape.cp
    sent = n - (1 if pp_rank == pp - 1 else 0) if pp > 1 else 0
    total += sent * tokens // (shape.tp if shape.sp else 1) * shape.hidden * shape.bytes_per_value
    return total
