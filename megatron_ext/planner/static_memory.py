"""Parameters, gradient buffers and optimizer state per rank, as megatron-core 0.19.2's DDP (its buckets and
padding), distributed optimizer and Megatron-FSDP allocate them; checkpoint sizes."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

from megatron_ext.config.schema import (
    OuterShardingStrategy,
    RecipeConfig,
    ShardingStrategy,
    data_parallel_size,
    ddp_bucket_size,
    pipeline_stage_layers,
)
from megatron_ext.config.shape import ModelShape
from megatron_ext.planner.layout import RankShape


def stage_chunks(stages: tuple[int, ...], vpp: Optional[int], pp_rank: int) -> list[tuple[range, bool, bool]]:
    """(its decoder layers, numbered from 0 in the whole model; holds the embedding; holds the output layer) for each
    model chunk of a stage; `stages`: each stage's decoder layers (:func:`pipeline_stage_layers`). Chunk c of every
    stage comes before chunk c + 1 of any, as megatron-core numbers them (``get_transformer_layer_offset``)."""
    v, pp = vpp or 1, len(stages)
    per_round, before, per_chunk = sum(n // v for n in stages), sum(n // v for n in stages[:pp_rank]), \
        stages[pp_rank] // v
    return [(range(c * per_round + before, c * per_round + before + per_chunk), pp_rank == 0 and c == 0,
             pp_rank == pp - 1 and c == v - 1) for c in range(v)]


def mtp_layers(shape: RankShape) -> range:
    """The multi-token-prediction layers, numbered on after the decoder's (all on the last pipeline stage)."""
    return range(shape.layers, shape.layers + shape.model.mtp_num_layers)


def stage_layer_indices(stages: tuple[int, ...], vpp: Optional[int], pp_rank: int) -> list[int]:
    """The decoder layers (numbered from 0 in the whole model) of a stage's chunks."""
    return [layer for layers, _, _ in stage_chunks(stages, vpp, pp_rank) for layer in layers]


def chunk_params(shape: RankShape, pp: int, layers: range, pre: bool, post: bool) -> list[tuple[int, bool]]:
    """(numel, is a shared embedding copy) per parameter of one chunk holding `layers` (and, with the output layer,
    the MTP layers), in ``named_parameters`` order."""
    h, model = shape.hidden, shape.model
    embedding = shape.vocab * h // shape.tp
    params: list[tuple[int, bool]] = []
    mtp = mtp_layers(shape) if post else range(0)
    # a tied or MTP-read embedding is kept in sync between the first stage and a copy on the last
    if pre or mtp:
        params.append((embedding, pp > 1 and not (pre and post) and (shape.tied or bool(model.mtp_num_layers))))
    kinds = {moe: [(n, False) for n in shape.layer_params(moe)] for moe in (False, True)}
    params += [param for layer in layers for param in kinds[model.is_moe_layer(layer)]]
    if post:
        params.append((h, False))  # final norm
        # each MTP layer: its embedding and hidden-state norms, their projection (column-parallel), its decoder layer,
        # its final norm
        params += [param for layer in mtp for param in [(h, False), (h, False), (2 * h * h // shape.tp, False),
                                                        *kinds[model.is_moe_layer(layer)], (h, False)]]
        if not shape.tied or not pre:  # the tied copy on the last stage when PP > 1
            params.append((embedding, shape.tied))
    return params


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _ddp_buckets(params: list[tuple[int, bool]], dp_cp: int, distopt: bool, bucket_size: Optional[int]
                 ) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """megatron-core's grad buffer layout: (start, end, param index ranges) per bucket.

    Parameters are laid out in reverse order (the order backward produces their grads).
    """
    buckets: list[tuple[int, int, list[tuple[int, int]]]] = []
    bucket_start, start, members = 0, 0, []
    end_multiple = math.lcm(dp_cp, 128)

    def close(end: int) -> int:
        nonlocal bucket_start, members
        padded = _round_up(end, end_multiple) if distopt else end
        buckets.append((bucket_start, padded, members))
        bucket_start, members = padded, []
        return padded

    end = 0
    for numel, shared in reversed(params):
        if distopt:
            start = _round_up(start, 64)  # 128-byte aligned parameters
        own_bucket = shared and distopt
        if own_bucket and members:
            start = close(start)
        end = start + numel
        members.append((start, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if members:
        close(end)
    return buckets


def _owned_elements(buckets: list[tuple[int, int, list[tuple[int, int]]]], dp_cp: int) -> list[int]:
    """Parameter elements (padding excluded) in each DP×CP rank's slice of every bucket: each slice's size less the
    padding in it (the alignment gaps before parameters, and the bucket's end), which touches few slices."""
    whole, padding = 0, [0] * dp_cp
    for start, end, members in buckets:
        size = (end - start) // dp_cp
        if size == 0:
            continue
        whole += size
        bounds = [start, *(x for member in members for x in member), end]
        for gap_start, gap_end in zip(bounds[::2], bounds[1::2]):
            for r in range((gap_start - start) // size, (gap_end - 1 - start) // size + 1):
                padding[r] += min(gap_end, start + (r + 1) * size) - max(gap_start, start + r * size)
    return [whole - pad for pad in padding]


def stage_static(shape: RankShape, stages: tuple[int, ...], vpp: Optional[int], pp_rank: int, dp: int, distopt: bool,
                  bucket_size: Optional[int], experts: bool = False) -> tuple[int, int, tuple[int, ...]]:
    """(param elements, grad-buffer elements, optimizer-owned elements per DP×CP rank) of one stage; with
    `experts`, of its expert buffers instead, over expert-DP ranks (`dp` is then the expert-DP size); `bucket_size`:
    :func:`ddp_bucket_size`."""
    # a search asks again for layouts that differ only where the buffers do not: sequence parallelism and CP (passed
    # as the DP×CP size), and for the expert buffers TP too
    key = _BUFFER_SHAPES.get((shape, experts))
    if key is None:
        key = _BUFFER_SHAPES[shape, experts] = dataclasses.replace(shape, cp=1, sp=False,
                                                                   **({"tp": 1} if experts else {}))
    return _stage_static(key, stages, vpp, pp_rank, dp, dp if experts else dp * shape.cp, distopt, bucket_size, experts)


_BUFFER_SHAPES: dict[tuple[RankShape, bool], RankShape] = {}  # a shape → the one its buffers are cached under


@functools.lru_cache(maxsize=4096)
def _stage_static(shape: RankShape, stages: tuple[int, ...], vpp: Optional[int], pp_rank: int, dp: int, dp_cp: int,
                  distopt: bool, bucket_size: Optional[int], experts: bool) -> tuple[int, int, tuple[int, ...]]:
    param_elems = grad_elems = 0
    owned = [0] * dp_cp
    expert_params = [(n, False) for n in shape.expert_params()] if experts else []
    for c, (layers, pre, post) in enumerate(stage_chunks(stages, vpp, pp_rank)):
        if experts:
            held = [*layers, *(mtp_layers(shape) if post else [])]
            params = [param for layer in held if shape.model.is_moe_layer(layer) for param in expert_params]
        else:
            params = chunk_params(shape, len(stages), layers, pre, post)
        bucketed = pp_rank == 0 and c == 0  # DDP buckets only there
        numel, unpadded, chunk_owned = _chunk_buffer(tuple(params), dp_cp, distopt, bucket_size if bucketed else None)
        grad_elems += numel
        param_elems += numel if distopt else unpadded
        owned = [a + b for a, b in zip(owned, chunk_owned)]
    return param_elems, grad_elems, tuple(owned)


@functools.lru_cache(maxsize=4096)
def _chunk_buffer(params: tuple[tuple[int, bool], ...], dp_cp: int, distopt: bool, bucket_size: Optional[int]
                  ) -> tuple[int, int, tuple[int, ...]]:
    """(padded elements, parameter elements, optimizer-owned elements per DP×CP rank) of one model chunk's grad
    buffer. Cached by the parameters themselves: the chunks of other stages and pipeline splits that hold the same
    parameters (a middle stage's MoE layers, one stage of two splits) share it."""
    buckets = _ddp_buckets(list(params), dp_cp, distopt, bucket_size)
    unpadded = sum(n for n, _ in params)
    owned = _owned_elements(buckets, dp_cp) if distopt else [unpadded] * dp_cp
    return (buckets[-1][1] if buckets else 0), unpadded, tuple(owned)


def expert_static(shape: RankShape, world_size: int, stages: tuple[int, ...], vpp: Optional[int], pp_rank: int,
                   distopt: bool, bucket_size: Optional[int]) -> tuple[int, int, tuple[int, ...]]:
    """:func:`stage_static` of the stage's expert buffers, over the expert-DP ranks of `world_size` (buckets of the
    dense DP's `bucket_size`, as megatron-core sizes them)."""
    return stage_static(shape, stages, vpp, pp_rank, shape.expert_dp(world_size, len(stages)), distopt, bucket_size,
                        experts=True)


def model_elements(shape: RankShape) -> int:
    """Parameter elements of one TP rank's part of the whole model (PP 1)."""
    return sum(n for n, _ in chunk_params(shape, 1, range(shape.layers), True, True))


def sharded_static(shape: RankShape, dp_cp: int, sharding: ShardingStrategy, replicas: int = 1,
                   outer: OuterShardingStrategy = "no_shard") -> tuple[int, int, int, int]:
    """Megatron-FSDP at PP 1: (parameter elements held, fp32 gradient elements held, optimizer-owned elements,
    parameter elements unsharded at once). Each rank holds 1/(DP×CP) of the gradients (and, optim_grads_params,
    of the parameters, two decoder layers of which are gathered at a time: the one computing and the one
    prefetched). Under HSDP the sharding is over one of the `replicas` groups, DP×CP/replicas ranks; with the
    optimizer sharded across them too (outer optim) only the optimizer's part is 1/(DP×CP): Megatron-FSDP keeps
    the group's parameter and gradient shards whole. Bucket padding (under 1 % on the tiny model) is left out."""
    whole = model_elements(shape)
    shard = -(-whole // (dp_cp // replicas))
    owned = -(-whole // dp_cp) if outer == "optim" and replicas > 1 else shard
    if sharding == "optim_grads_params":
        return shard, shard, owned, 2 * largest_layer_elements(shape)
    return whole, shard, owned, 0


def largest_layer_elements(shape: RankShape) -> int:
    """Parameter elements of the largest decoder layer on a TP rank, its experts left out."""
    kinds = {shape.model.is_moe_layer(layer) for layer in range(shape.layers)}
    return max(sum(shape.layer_params(moe)) for moe in kinds)


def rank_static_bytes(cfg: RecipeConfig, world_size: int, pp_rank: int, dp_cp_rank: int,
                      vocab_size: int, expert_dp_rank: int = 0) -> dict[str, int]:
    """Bytes of parameters, grad buffers and optimizer state on one rank (fp32 grad buffers, as ``wrap_with_ddp``
    configures them): exact under DDP (an MoE model's expert buffers included), without Megatron-FSDP's bucket
    padding under it."""
    p = cfg.parallel
    shape = RankShape.of(cfg, vocab_size)
    dp = data_parallel_size(cfg, world_size)
    if p.use_megatron_fsdp:
        params, grads, shard, _ = sharded_static(shape, dp * shape.cp, p.data_parallel_sharding_strategy,
                                                 p.num_distributed_optimizer_instances, p.outer_dp_sharding_strategy)
        owned = shard
    else:
        stages, vpp = tuple(pipeline_stage_layers(cfg)), p.virtual_pipeline_model_parallel_size
        bucket_size = ddp_bucket_size(cfg, dp)
        params, grads, dense_owned = stage_static(shape, stages, vpp, pp_rank, dp, p.use_distributed_optimizer,
                                                   bucket_size)
        owned = dense_owned[dp_cp_rank]
        if shape.experts:
            expert_params, expert_grads, expert_owned = expert_static(
                shape, world_size, stages, vpp, pp_rank, p.use_distributed_optimizer, bucket_size)
            params, grads, owned = params + expert_params, grads + expert_grads, owned + expert_owned[expert_dp_rank]
    return {"params": params * shape.bytes_per_value, "grads": grads * 4,
            "optimizer": owned * optimizer_bytes_per_element(shape)}


def optimizer_bytes_per_element(shape: RankShape) -> float:
    """Adam's two fp32 moments, plus an fp32 main copy for bf16 params (fp32 ones are optimized in place); Muon keeps
    one fp32 momentum where Adam keeps two, for its share of the parameters (:attr:`RankShape.muon_share`: the
    model's average, the embedding-holding stages have fewer)."""
    return 8 - 4 * shape.muon_share + (4 if shape.bytes_per_value == 2 else 0)


def checkpoint_bytes(cfg: RecipeConfig, vocab_size: int) -> int:
    """One training checkpoint on disk: every parameter once (padded vocabulary) and its optimizer state, whatever
    the layout (dist_checkpointing writes each shard once; the few KB of common state aside)."""
    shape = RankShape.of(cfg, vocab_size)
    params = ModelShape.of(cfg.model).num_parameters(shape.vocab)
    return params * (shape.bytes_per_value + optimizer_bytes_per_element(shape))
