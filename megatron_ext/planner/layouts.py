"""Parallel layout planner: per-GPU memory and step time of every valid TP/PP/VPP/CP/DP layout.

Everything here is arithmetic on the config — no process group, no model — so a layout can be
chosen before any GPU hour is spent. ``docs/planner.md`` derives the formulas; in short:

Memory (per GPU, the worst pipeline stage and the worst DP×CP rank), as megatron-core 0.19.2
allocates it under this recipe (``wrap_with_ddp`` sets ``grad_reduce_in_fp32=True``):

* parameters in ``params_dtype``; under the distributed optimizer they live in DDP's contiguous
  param buffer, padded like the grad buffer;
* gradients: DDP's grad buffer in fp32, one per model chunk. With the distributed optimizer each
  parameter starts at a multiple of 64 elements and each bucket ends at a multiple of
  lcm(DP×CP, 128); a tied embedding/output weight gets a bucket of its own; buckets are
  ``max(4e7, 1e6·DP)`` elements with ``overlap_grad_reduce`` (only chunk 0 of pipeline stage 0),
  else one per chunk;
* optimizer: Adam's exp_avg/exp_avg_sq in fp32 plus fp32 main params when params are bf16, for
  every parameter — or, with the distributed optimizer, for the elements of this DP×CP rank's
  1/(DP×CP) slice of each bucket (padding excluded);
* activations: bytes autograd saves per micro batch (see :func:`layer_activation_bytes`) times
  the micro batches in flight on the stage under 1F1B / interleaved 1F1B;
* buffers: the working set of one layer's backward (two with full recompute), the last stage's
  logits gradient, the SP all-gather buffer, plus ``NON_TORCH_RESERVE_GIB`` outside torch's
  allocator (CUDA context, cuBLAS/NCCL workspaces).

A layout fits when (allocated + reserve) · (1 + ``FRAGMENTATION``) ≤ GPU memory (and, with optimizer offload, the
node's offloaded state ≤ ``HOST_MEMORY_FOR_OFFLOAD`` of its host memory).

Step time: model FLOPs (+ recompute) at the calibrated ``KERNEL_EFFICIENCY`` of dense BF16 peak (eager or
compiled layers) on the slowest stage, a fixed cost per micro batch (grad accumulation, per-layer launches),
TP collectives (4 per layer per micro batch, 6 with full recompute) on NVLink, CP's
K/V ring hidden behind attention where it can be, pipeline p2p, the bubble (p−1)/(v·m) of
micro-batch times, the DP gradient reduce-scatter/all-gather (exposed beyond one micro batch's
backward when overlapped), and the optimizer step at HBM bandwidth. The single-GPU constants are fitted to
measured H100 throughputs (see the calibration block below). Collectives cost
``bytes·algorithm factor / bus bandwidth + latency`` on the link class their group spans
(megatron's rank order is TP fastest, then CP, DP, PP).

GPU table (``GPUS``): memory as ``nvidia-smi`` reports it, dense BF16 peak (datasheet, no
sparsity), HBM bandwidth (datasheet), NVLink and inter-node *bus* bandwidths as NCCL reaches them
(about 80 % of the link rate: NVLink 4 = 450 GB/s per direction → 360; NVLink 3 = 300 → 230;
one 400 Gb/s NDR NIC per GPU = 50 GB/s → 40; one 200 Gb/s HDR NIC per GPU = 25 GB/s → 20), and host ↔ GPU
copies at the same 80 % of the PCIe link (PCIe 5 x16 = 64 GB/s per direction → 50; PCIe 4 x16 = 32 → 25), and
the host memory of the DGX node of 8 (DGX H100/H200 and DGX A100 640GB: 2 TB; DGX A100 320GB: 1 TB).

Optimizer CPU offload (searched only when no layout fits without it): the offloaded fraction of a rank's optimizer
state leaves its memory; the step gains the host's Adam step over those elements (``HOST_ADAM_ELEMENTS_PER_S``) or
their gradients' and weights' PCIe copies, whichever is longer (megatron-core overlaps them group by group) —
uncalibrated on a GPU node.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from megatron_ext.config.kernels import compiles_layers
from megatron_ext.config.schema import (
    ZERO_LEVEL,
    OuterShardingStrategy,
    RecipeConfig,
    ShardingStrategy,
    data_parallel_size,
    expert_tensor_parallel_size,
    pipeline_stage_layers,
)
from megatron_ext.config.shape import ModelShape, model_flops_per_token, padded_vocab_size
from megatron_ext.config.validate import validate_layout
from megatron_ext.errors import ConfigError
from megatron_ext.hardware import GPUS, GPUSpec
from megatron_ext.model.document_mask import block_mask_bytes

GIB = 2**30
NON_TORCH_RESERVE_GIB = 2.0  # CUDA context + cuBLAS/NCCL workspaces: memory torch's allocator never sees
FRAGMENTATION = 0.05  # caching-allocator slack between allocated and reserved memory
LATENCY_INTRA_S = 8e-6  # per collective or p2p message inside a node
LATENCY_INTER_S = 25e-6  # per collective or p2p message across nodes
# Calibration of the single-GPU costs, fitted to the eight throughputs measured on one H100 80GB (torch 2.11,
# megatron-core 0.16.1, no TE; docs/measurements/h100-2026-11-23.md §2-3): the 1.2B benchmark shape
# (one micro batch per step: eager mbs 1; compiled mbs 1, 2, 4) and configs/llama3_2_1b_1gpu_bf16.yaml (global
# batch 64: eager and compiled, mbs 2 and 4). With these constants every one is predicted within 5 %
# (tests/unit/test_planner.py holds them).
KERNEL_EFFICIENCY = {"eager": 0.393, "compiled": 0.482}  # of dense BF16 peak, by the model's (causal) FLOP count
LAYER_OVERHEAD_S = 0.5e-3  # per layer per micro batch: launches and small ops the FLOP count does not see
GRAD_ACCUMULATE_BYTES = 10  # per parameter per micro batch: fp32 main_grad += bf16 grad (read 4 + 2, write 4)
# per owned element per step at HBM bandwidth: AdamW over fp32 master weights (11.8 ms), the bf16 copy of the
# updated weights (2.7 ms) and the grad-norm passes (3.4 ms) profiled for 1.24 B parameters: 17.9 ms.
OPTIMIZER_BYTES_PER_ELEMENT = 48
# torch's fused CPU AdamW, which megatron-core's HybridDeviceOptimizer steps the offloaded state with: 2.2-2.4 G
# elements/s measured on one and two cores of the project's 2-core AMD EPYC VM (2026-11-24, torch 2.13.0)
HOST_ADAM_ELEMENTS_PER_S = 2.0e9
OFFLOAD_COPY_BYTES = 4  # per offloaded element and direction: its fp32 gradient to the host, its fp32 weight back
HOST_BYTES_PER_OFFLOADED_ELEMENT = 16  # the host's fp32 weight, gradient and both Adam moments
OFFLOAD_FRACTIONS = (0.5, 1.0)  # what the search tries when no layout fits without offload
# of a node's host memory the offloaded optimizer state may take: the rest is the OS's, the data loaders' and the
# page cache's, and the staging copies of asynchronous checkpoint saves
HOST_MEMORY_FOR_OFFLOAD = 0.75
CP_STEP_LAUNCH_S = 10e-6  # per ring step of context-parallel attention: extra kernel launches and sync


@dataclass(frozen=True)
class Layout:
    """One candidate: the parallel sizes and the memory/throughput switches the planner varies."""

    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    dp: int
    sp: bool
    distopt: bool
    recompute: Optional[str]
    mbs: int
    # Megatron-FSDP's strategy (ZeRO-2/3) on top of the distributed optimizer; None = its DDP (docs/memory.md).
    sharding: Optional[ShardingStrategy] = None
    # HSDP under Megatron-FSDP: shard within this many groups of DP×CP ranks, replicated across them
    replicas: int = 1
    # optimizer.optimizer_offload_fraction under optimizer.optimizer_cpu_offload; 0 = no offload
    offload: float = 0.0
    ep: int = 1  # MoE: experts split over this many ranks
    etp: Optional[int] = None  # MoE: each expert's matrices split over this many ranks; None = TP
    # uneven pipeline stages: the first's and the last's decoder layers (the rest split evenly); None = even
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    def overrides(self) -> dict[str, Any]:
        """The config values of this layout, as ``section.key`` → value."""
        # Megatron-FSDP overlaps its own gathers and reduce-scatters (megatron-core's overlap flags are refused).
        memory = ({"parallel.data_parallel_sharding_strategy": self.sharding, "parallel.overlap_grad_reduce": False,
                   "parallel.overlap_param_gather": False} if self.sharding else {})
        # the planner's HSDP replicates across its groups (it does not search outer sharding)
        memory.update({"parallel.num_distributed_optimizer_instances": self.replicas,
                       "parallel.outer_dp_sharding_strategy": "no_shard",
                       "optimizer.optimizer_cpu_offload": self.offload > 0})
        if self.offload:
            memory["optimizer.optimizer_offload_fraction"] = self.offload
        experts = {"parallel.expert_model_parallel_size": self.ep, "parallel.expert_tensor_parallel_size": self.etp}
        return {"parallel.use_megatron_fsdp": self.sharding is not None, **memory,
            **(experts if self.ep > 1 or self.etp is not None else {}),
            "parallel.tensor_model_parallel_size": self.tp,
            "parallel.pipeline_model_parallel_size": self.pp,
            "parallel.virtual_pipeline_model_parallel_size": self.vpp,
            "parallel.num_layers_in_first_pipeline_stage": self.first_stage_layers,
            "parallel.num_layers_in_last_pipeline_stage": self.last_stage_layers,
            "parallel.context_parallel_size": self.cp,
            "parallel.sequence_parallel": self.sp,
            "parallel.use_distributed_optimizer": self.distopt,
            "train.micro_batch_size": self.mbs,
            "train.recompute_granularity": self.recompute,
        }

    def apply(self, cfg: RecipeConfig) -> RecipeConfig:
        """A copy of `cfg` with this layout (param gather overlap needs distopt)."""
        p = dataclasses.replace(
            cfg.parallel, tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp, context_parallel_size=self.cp,
            sequence_parallel=self.sp, use_distributed_optimizer=self.distopt,
            use_megatron_fsdp=self.sharding is not None,
            data_parallel_sharding_strategy=self.sharding or cfg.parallel.data_parallel_sharding_strategy,
            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce and self.sharding is None,
            overlap_param_gather=cfg.parallel.overlap_param_gather and self.distopt and self.sharding is None,
            num_distributed_optimizer_instances=self.replicas,
            outer_dp_sharding_strategy=cfg.parallel.outer_dp_sharding_strategy if self.replicas > 1 else "no_shard",
            num_layers_in_first_pipeline_stage=self.first_stage_layers,
            num_layers_in_last_pipeline_stage=self.last_stage_layers,
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp,
        )
        t = dataclasses.replace(cfg.train, micro_batch_size=self.mbs, recompute_granularity=self.recompute)
        o = cfg.optimizer
        if self.offload or o.optimizer_cpu_offload:
            o = dataclasses.replace(o, optimizer_cpu_offload=self.offload > 0,
                                    optimizer_offload_fraction=self.offload or o.optimizer_offload_fraction)
        return dataclasses.replace(cfg, parallel=p, train=t, optimizer=o)

    @classmethod
    def of(cls, cfg: RecipeConfig, world_size: int) -> "Layout":
        """The layout `cfg` already specifies."""
        p = cfg.parallel
        dp = data_parallel_size(cfg, world_size)
        return cls(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                   p.virtual_pipeline_model_parallel_size, p.context_parallel_size, dp, p.sequence_parallel,
                   p.use_distributed_optimizer, cfg.train.recompute_granularity, cfg.train.micro_batch_size,
                   p.data_parallel_sharding_strategy if p.use_megatron_fsdp else None,
                   p.num_distributed_optimizer_instances, offload_fraction(cfg), p.expert_model_parallel_size,
                   p.expert_tensor_parallel_size, p.num_layers_in_first_pipeline_stage,
                   p.num_layers_in_last_pipeline_stage)

    def label(self) -> str:
        vpp = f" VPP{self.vpp}" if self.vpp else ""
        vpp += f" first{self.first_stage_layers}" if self.first_stage_layers is not None else ""
        vpp += f" last{self.last_stage_layers}" if self.last_stage_layers is not None else ""
        return (f"TP{self.tp} PP{self.pp}{vpp} CP{self.cp} DP{self.dp}"
                f"{' SP' if self.sp else ''}{' distopt' if self.distopt else ''}"
                f"{f' ZeRO-{ZERO_LEVEL[self.sharding]}' if self.sharding else ''}"
                f"{f' HSDP{self.replicas}' if self.replicas > 1 else ''}"
                f"{f' offload{self.offload:.0%}' if self.offload else ''}"
                f"{f' EP{self.ep}' if self.ep > 1 else ''}{f' ETP{self.etp}' if self.etp is not None else ''}"
                f" mbs{self.mbs} recompute={self.recompute or 'none'}")


def offload_fraction(cfg: RecipeConfig) -> float:
    """The fraction of each rank's optimizer state `cfg` keeps in host memory (0 without offload)."""
    o = cfg.optimizer
    return o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0


@dataclass(frozen=True)
class _Shape:
    """Per-rank tensor dimensions of the model under one layout."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int  # padded
    seq: int
    tp: int
    cp: int
    sp: bool
    tied: bool
    bytes_per_value: int  # params_dtype / activation dtype
    model: ModelShape  # the whole model's shape, for its FLOP count
    qk_norm: bool = False
    experts: int = 0  # MoE: experts per layer (0: dense)
    expert_ffn: int = 0
    topk: int = 0
    shared_ffn: int = 0  # the shared experts' width (0: none)
    ep: int = 1
    etp: int = 1  # expert TP

    @classmethod
    def of(cls, cfg: RecipeConfig, vocab_size: int) -> "_Shape":
        m, p = cfg.model, cfg.parallel
        # by value: a search asks for the shape of each candidate layout many times over (and config sections are
        # mutable, so not by identity)
        key = (tuple(vars(m).values()), p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel,
               p.expert_model_parallel_size, p.expert_tensor_parallel_size, cfg.train.precision, vocab_size)
        if key not in _SHAPES:
            if len(_SHAPES) >= 4096:
                _SHAPES.clear()
            _SHAPES[key] = cls._of(cfg, vocab_size)
        return _SHAPES[key]

    @classmethod
    def _of(cls, cfg: RecipeConfig, vocab_size: int) -> "_Shape":
        m, p = cfg.model, cfg.parallel
        model = ModelShape.of(m)
        return cls(
            layers=model.num_layers, hidden=model.hidden_size, heads=model.num_attention_heads,
            groups=model.num_query_groups, head_dim=model.kv_channels, ffn=model.ffn_hidden_size,
            vocab=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, p.tensor_model_parallel_size),
            seq=m.seq_length, tp=p.tensor_model_parallel_size, cp=p.context_parallel_size,
            sp=p.sequence_parallel, tied=not m.untie_embeddings_and_output_weights,
            bytes_per_value=4 if cfg.train.precision == "fp32" else 2, model=model, qk_norm=model.qk_layernorm,
            experts=model.num_experts, expert_ffn=model.expert_ffn_hidden_size, topk=model.router_topk,
            shared_ffn=model.shared_expert_ffn_hidden_size, ep=p.expert_model_parallel_size,
            etp=expert_tensor_parallel_size(cfg),
        )

    def layer_params(self) -> list[int]:
        """One decoder layer's parameter sizes on a TP rank, in ``named_parameters`` order, its experts left out
        (:meth:`expert_params`): an MoE layer's MLP is its router (whole on every rank) and shared experts."""
        h, d, t = self.hidden, self.head_dim, self.tp
        attention = [h, h * self.heads * d // t, (self.heads + 2 * self.groups) * d * h // t]
        attention += [d, d] if self.qk_norm else []
        if not self.experts:
            return [*attention, h, 2 * self.ffn * h // t, self.ffn * h // t]
        shared = [2 * self.shared_ffn * h // t, self.shared_ffn * h // t] if self.shared_ffn else []
        return [*attention, h, self.experts * h, *shared]

    def expert_params(self) -> list[int]:
        """One MoE layer's expert parameters on an EP×ETP rank (its experts' fc1 and fc2), in ``named_parameters``
        order; megatron-core keeps them in buffers of their own, reduced and sharded over expert-DP."""
        f, h = self.expert_ffn, self.hidden
        return [n for _ in range(self.experts // self.ep) for n in (2 * f * h // self.etp, f * h // self.etp)]

    def expert_dp(self, world_size: int, pp: int) -> int:
        """The expert-data-parallel size: the ranks of a pipeline stage regrouped as ETP × EP × expert-DP."""
        return world_size // (pp * self.ep * self.etp)


_SHAPES: dict[tuple, _Shape] = {}


def model_vocab_size(cfg: RecipeConfig) -> int:
    """The unpadded vocabulary: ``model.vocab_size``, else the tokenizer's."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.tokenizer_model:
        from megatron_ext.data.tokenizer import load_tokenizer

        return load_tokenizer(cfg.data.tokenizer_model, cfg.data.tokenizer_type).vocab_size
    raise ConfigError("model.vocab_size=None is invalid for planning: set it or data.tokenizer_model")


# ---------------------------------------------------------------------------------------------
# Parameters, gradient buffers, optimizer state


def _stage_chunks(stages: tuple[int, ...], vpp: Optional[int], pp_rank: int) -> list[tuple[int, bool, bool]]:
    """(layers, holds the embedding, holds the output layer) for each model chunk of a stage; `stages`: each
    stage's decoder layers (:func:`pipeline_stage_layers`)."""
    v, pp = vpp or 1, len(stages)
    per_chunk = stages[pp_rank] // v
    return [(per_chunk, pp_rank == 0 and c == 0, pp_rank == pp - 1 and c == v - 1) for c in range(v)]


def _chunk_params(shape: _Shape, pp: int, layers: int, pre: bool, post: bool) -> list[tuple[int, bool]]:
    """(numel, is a shared embedding copy) per parameter of one chunk, in ``named_parameters`` order."""
    embedding = shape.vocab * shape.hidden // shape.tp
    params: list[tuple[int, bool]] = []
    if pre:  # a tied embedding on a stage without the output layer is kept in sync with the last stage
        params.append((embedding, shape.tied and pp > 1 and not post))
    params += [(n, False) for _ in range(layers) for n in shape.layer_params()]
    if post:
        params.append((shape.hidden, False))  # final norm
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
    """Parameter elements (padding excluded) in each DP×CP rank's slice of every bucket."""
    owned = [0] * dp_cp
    for start, end, members in buckets:
        size = (end - start) // dp_cp
        if size == 0:
            continue
        for a, b in members:
            for r in range((a - start) // size, (b - 1 - start) // size + 1):
                lo, hi = start + r * size, start + (r + 1) * size
                owned[r] += min(b, hi) - max(a, lo)
    return owned


@functools.lru_cache(maxsize=4096)
def _stage_static(shape: _Shape, stages: tuple[int, ...], vpp: Optional[int], pp_rank: int, dp: int, distopt: bool,
                  overlap_grad_reduce: bool, experts: bool = False) -> tuple[int, int, tuple[int, ...]]:
    """(param elements, grad-buffer elements, optimizer-owned elements per DP×CP rank) of one stage; with
    `experts`, of its expert buffers instead, over expert-DP ranks (`dp` is then the expert-DP size)."""
    dp_cp = dp if experts else dp * shape.cp
    param_elems = grad_elems = 0
    owned = [0] * dp_cp
    for c, (layers, pre, post) in enumerate(_stage_chunks(stages, vpp, pp_rank)):
        if experts:
            params = [(n, False) for _ in range(layers) for n in shape.expert_params()]
        else:
            params = _chunk_params(shape, len(stages), layers, pre, post)
        bucketed = overlap_grad_reduce and pp_rank == 0 and c == 0  # DDP buckets only there
        buckets = _ddp_buckets(params, dp_cp, distopt, max(40_000_000, 1_000_000 * dp) if bucketed else None)
        numel = buckets[-1][1] if buckets else 0
        unpadded = sum(n for n, _ in params)
        grad_elems += numel
        param_elems += numel if distopt else unpadded
        if distopt:
            owned = [a + b for a, b in zip(owned, _owned_elements(buckets, dp_cp))]
        else:
            owned = [a + unpadded for a in owned]
    return param_elems, grad_elems, tuple(owned)


def _expert_static(shape: _Shape, world_size: int, stages: tuple[int, ...], vpp: Optional[int], pp_rank: int,
                   distopt: bool, overlap_grad_reduce: bool) -> tuple[int, int, tuple[int, ...]]:
    """:func:`_stage_static` of the stage's expert buffers, over the expert-DP ranks of `world_size`."""
    return _stage_static(shape, stages, vpp, pp_rank, shape.expert_dp(world_size, len(stages)), distopt,
                         overlap_grad_reduce,
                         experts=True)


def _model_elements(shape: _Shape) -> int:
    """Parameter elements of one TP rank's part of the whole model (PP 1)."""
    return sum(n for n, _ in _chunk_params(shape, 1, shape.layers, True, True))


def sharded_static(shape: _Shape, dp_cp: int, sharding: ShardingStrategy, replicas: int = 1,
                   outer: OuterShardingStrategy = "no_shard") -> tuple[int, int, int, int]:
    """Megatron-FSDP at PP 1: (parameter elements held, fp32 gradient elements held, optimizer-owned elements,
    parameter elements unsharded at once). Each rank holds 1/(DP×CP) of the gradients (and, optim_grads_params,
    of the parameters, two decoder layers of which are gathered at a time: the one computing and the one
    prefetched). Under HSDP the sharding is over one of the `replicas` groups, DP×CP/replicas ranks; with the
    optimizer sharded across them too (outer optim) only the optimizer's part is 1/(DP×CP): Megatron-FSDP keeps
    the group's parameter and gradient shards whole. Bucket padding (under 1 % on the tiny model) is left out."""
    whole = _model_elements(shape)
    shard = -(-whole // (dp_cp // replicas))
    owned = -(-whole // dp_cp) if outer == "optim" and replicas > 1 else shard
    if sharding == "optim_grads_params":
        return shard, shard, owned, 2 * sum(shape.layer_params())
    return whole, shard, owned, 0


def rank_static_bytes(cfg: RecipeConfig, world_size: int, pp_rank: int, dp_cp_rank: int,
                      vocab_size: int, expert_dp_rank: int = 0) -> dict[str, int]:
    """Bytes of parameters, grad buffers and optimizer state on one rank (fp32 grad buffers, as ``wrap_with_ddp``
    configures them): exact under DDP (an MoE model's expert buffers included), without Megatron-FSDP's bucket
    padding under it."""
    p = cfg.parallel
    shape = _Shape.of(cfg, vocab_size)
    dp = data_parallel_size(cfg, world_size)
    if p.use_megatron_fsdp:
        params, grads, shard, _ = sharded_static(shape, dp * shape.cp, p.data_parallel_sharding_strategy,
                                                 p.num_distributed_optimizer_instances, p.outer_dp_sharding_strategy)
        owned = shard
    else:
        stages, vpp = tuple(pipeline_stage_layers(cfg)), p.virtual_pipeline_model_parallel_size
        params, grads, dense_owned = _stage_static(shape, stages, vpp, pp_rank, dp, p.use_distributed_optimizer,
                                                   p.overlap_grad_reduce)
        owned = dense_owned[dp_cp_rank]
        if shape.experts:
            expert_params, expert_grads, expert_owned = _expert_static(
                shape, world_size, stages, vpp, pp_rank, p.use_distributed_optimizer, p.overlap_grad_reduce)
            params, grads, owned = params + expert_params, grads + expert_grads, owned + expert_owned[expert_dp_rank]
    return {"params": params * shape.bytes_per_value, "grads": grads * 4,
            "optimizer": owned * _optimizer_bytes_per_element(shape)}


def _optimizer_bytes_per_element(shape: _Shape) -> int:
    """Adam's two fp32 moments, plus an fp32 main copy for bf16 params (fp32 ones are optimized in place)."""
    return 8 + (4 if shape.bytes_per_value == 2 else 0)


def checkpoint_bytes(cfg: RecipeConfig, vocab_size: int) -> int:
    """One training checkpoint on disk: every parameter once (padded vocabulary) and its optimizer state, whatever
    the layout (dist_checkpointing writes each shard once; the few KB of common state aside)."""
    shape = _Shape.of(cfg, vocab_size)
    params = ModelShape.of(cfg.model).num_parameters(shape.vocab)
    return params * (shape.bytes_per_value + _optimizer_bytes_per_element(shape))


# ---------------------------------------------------------------------------------------------
# Activations


def layer_activation_bytes(cfg: RecipeConfig, fused_norm: bool = True) -> int:
    """Bytes one decoder layer saves for backward per micro batch on one rank (flash attention).

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
    shape = _Shape.of(cfg, 1)
    d_bytes = shape.bytes_per_value
    tokens = cfg.train.micro_batch_size * m.seq_length // shape.cp
    seq_shard = shape.tp if shape.sp else 1
    h, t = shape.hidden, shape.tp
    if cfg.train.recompute_granularity == "full":
        return tokens // seq_shard * h * d_bytes
    norm = h * d_bytes + 4 if fused_norm else 2 * h * 4 + 4
    seq_part = tokens // seq_shard * (2 * norm + 2 * h * d_bytes)
    hq, hkv = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    tp_part = tokens * d_bytes * (3 * hq + 3 * hkv + (0 if shape.experts else 5 * shape.ffn)) // t
    if shape.qk_norm:  # each head's query and key normed as the layer norms are, with an fp32 rstd per head
        per_channel = d_bytes if fused_norm else 2 * 4
        tp_part += tokens * ((hq + hkv) * per_channel + (shape.heads + shape.groups) * 4) // t
    if shape.experts:
        tp_part += _moe_activation_bytes(shape, tokens // seq_shard)
    # selective: the checkpoint keeps q, k, v (and megatron's int32 mask-type tensor) instead of the lse
    lse = 4 if cfg.train.recompute_granularity == "selective" else tokens * 4 * shape.heads // t
    rope = 4 * (m.seq_length // shape.cp) * shape.head_dim * d_bytes
    return seq_part + tp_part + lse + rope


def _expert_tokens(shape: _Shape, sequence_tokens: int) -> int:
    """Token-expert assignments one rank's experts compute per micro batch under balanced routing: the
    `sequence_tokens` of each of the EP×ETP ranks, top-k each, spread over the EP ranks (ETP ranks see them all)."""
    return sequence_tokens * shape.etp * shape.topk


def _moe_activation_bytes(shape: _Shape, sequence_tokens: int) -> int:
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
    shape = _Shape.of(cfg, 1)
    d_bytes, h, t = shape.bytes_per_value, shape.hidden, shape.tp
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length // shape.cp
    seq_shard = t if shape.sp else 1
    norm = h * d_bytes + 4 if fused_norm else 2 * h * 4 + 4
    hq, hkv = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    per_token = {"attn_norm": norm // seq_shard, "mlp_norm": norm // seq_shard, "qkv_linear": h * d_bytes / seq_shard,
                 "core_attn": d_bytes * (2 * hq + 3 * hkv) / t + 4 * shape.heads / t, "attn_proj": d_bytes * hq / t}
    return int(tokens * sum(per_token[m] for m in modules))


def chunk_activation_bytes(cfg: RecipeConfig, vocab_size: int, layers: int, pre: bool, post: bool,
                           fused_norm: bool = True) -> int:
    """Bytes one model chunk saves for backward per micro batch: its layers, embedding and loss."""
    shape = _Shape.of(cfg, vocab_size)
    d_bytes, h = shape.bytes_per_value, shape.hidden
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length // shape.cp
    seq_shard = shape.tp if shape.sp else 1
    total = layers * layer_activation_bytes(cfg, fused_norm)
    if cfg.train.recompute_granularity == "full" and layers:
        total += 4 * cfg.model.seq_length * shape.head_dim  # fp32 rotary table, shared by the layers
    if pre:  # token ids (int64), and the out-of-shard mask of the vocab-parallel embedding
        total += tokens * 8 + (tokens if shape.tp > 1 else 0)
    if post:
        norm = h * d_bytes + 4 if fused_norm else 2 * h * 4 + 4
        total += tokens // seq_shard * (norm + h * d_bytes)  # final norm, output layer input
        total += _output_loss_bytes(cfg, shape, tokens)[0]
        total += tokens * (1 + 8 + 4)  # CE target mask and masked targets, the loss mask
    return total


def _output_loss_bytes(cfg: RecipeConfig, shape: _Shape, tokens: int) -> tuple[int, int]:
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
    shape = _Shape.of(cfg, vocab_size)
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    dp = world_size // (shape.tp * pp * shape.cp)
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    chunks = _stage_chunks(tuple(pipeline_stage_layers(cfg)), vpp, pp_rank)
    n = microbatches_in_flight(pp, vpp, m, pp_rank)
    layers = chunks[0][0]
    body = chunk_activation_bytes(cfg, vocab_size, layers, False, False, fused_norm)
    total = n * body
    # Activation offload keeps two layers' saved tensors on the device: megatron-core's last group of each
    # module (not offloaded, so its reload cannot stall the backward pass) and the one being copied.
    total -= max(n * layers - 2, 0) * offloaded_layer_bytes(cfg, fused_norm)
    if any(pre for _, pre, _ in chunks):  # chunk 0 holds at most ceil(n / vpp) of the in-flight ones
        total += -(-n // len(chunks)) * (chunk_activation_bytes(cfg, vocab_size, 0, True, False, fused_norm))
    if any(post for *_, post in chunks):  # the loss chunk runs its backward right after its forward
        total += chunk_activation_bytes(cfg, vocab_size, 0, False, True, fused_norm)
    # deallocate_pipeline_outputs is off: every in-flight output sent downstream stays allocated.
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length // shape.cp
    sent = n - (1 if pp_rank == pp - 1 else 0) if pp > 1 else 0
    total += sent * tokens // (shape.tp if shape.sp else 1) * shape.hidden * shape.bytes_per_value
    return total


# ---------------------------------------------------------------------------------------------
# Time


def _flops_per_token(shape: _Shape, layers: int, output_layer: bool, recompute: Optional[str]) -> float:
    """Forward+backward FLOPs per token of `layers` layers (and the output layer) plus recompute: the model's own
    count (:class:`ModelShape`), on the padded vocabulary as the run log counts it."""
    output = shape.model.output_layer_flops_per_token(shape.vocab) if output_layer else 0.0
    return layers * shape.model.layer_flops_per_token(recompute=recompute) + output


def _ring(bytes_: float, n: int, bus_gb_s: float, latency: float, factor: float = 1.0) -> float:
    """Seconds for a ring collective over n ranks moving `bytes_` (factor 2 for all-reduce)."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) / n * bytes_ / (bus_gb_s * 1e9) + latency


@dataclass
class Estimate:
    """The planner's verdict on one layout."""

    layout: Layout
    memory: dict[str, float]  # bytes: params, grads, optimizer, activations, buffers, reserved, total
    peak_stage: int
    time: dict[str, float]  # seconds per step, by component, and "step"
    num_microbatches: int
    mfu: float
    tokens_per_s_per_gpu: float
    fits: bool
    gpu_memory: float
    # Megatron-FSDP layouts: the same layout's memory (bytes, by part as `memory`) with ZeRO-1 instead
    without_sharding: Optional[dict[str, float]] = None
    # Optimizer-offload layouts found by the search: the same layout's memory without offload
    without_offload: Optional[dict[str, float]] = None

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.label(), "overrides": self.layout.overrides(),
                "memory_gib": {k: round(v / GIB, 3) for k, v in self.memory.items()},
                "peak_stage": self.peak_stage, "time_s": {k: round(v, 4) for k, v in self.time.items()},
                "num_microbatches": self.num_microbatches, "mfu": round(self.mfu, 4),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1), "fits": self.fits}


def _stage_memory(cfg: RecipeConfig, vocab_size: int, world_size: int, pp_rank: int,
                  grad_bytes: int) -> dict[str, float]:
    """Peak bytes on one pipeline stage (worst DP×CP rank), by category."""
    layout, shape, stages = Layout.of(cfg, world_size), _Shape.of(cfg, vocab_size), tuple(pipeline_stage_layers(cfg))
    d_bytes = shape.bytes_per_value
    params, grads, owned = _stage_static(shape, stages, layout.vpp, pp_rank, layout.dp, layout.distopt,
                                         cfg.parallel.overlap_grad_reduce)
    if shape.experts:  # the worst dense shard and the worst expert shard, on one rank
        expert_params, expert_grads, expert_owned = _expert_static(
            shape, world_size, stages, layout.vpp, pp_rank, layout.distopt, cfg.parallel.overlap_grad_reduce)
        params, grads, owned = params + expert_params, grads + expert_grads, (max(owned) + max(expert_owned),)
    gathered = 0
    if layout.sharding:
        params, grads, shard, gathered = sharded_static(shape, layout.dp * layout.cp, layout.sharding,
                                                        layout.replicas, cfg.parallel.outer_dp_sharding_strategy)
        owned = (shard,)
    tokens = layout.mbs * shape.seq // layout.cp
    no_recompute = cfg if cfg.train.recompute_granularity is None else dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, recompute_granularity=None))
    # Working set of the layer being back-propagated (and the one being recomputed, with full recompute).
    buffers = layer_activation_bytes(no_recompute) * (2 if layout.recompute == "full" else 1)
    if layout.sp:
        buffers += tokens * shape.hidden * d_bytes  # all-gathered input of one linear
    if layout.sharding:  # gathered layers, and one layer's unsharded gradients before their reduce-scatter
        buffers += (gathered + sum(shape.layer_params())) * d_bytes
    if _stage_chunks(stages, layout.vpp, pp_rank)[-1][2]:
        buffers += _output_loss_bytes(cfg, shape, tokens)[1]
    if cfg.data.reset_attention_mask:  # document ids and FlexAttention's block mask, per micro batch
        buffers += block_mask_bytes(layout.mbs, shape.seq)
    # bf16 grads get fp32 copies for the optimizer shard only at step time, after activations are freed.
    # optimizer.optimizer_cpu_offload keeps that fraction of the state (fp32 master weights, moments) in host memory.
    on_device = 1 - layout.offload
    mem = {
        "params": params * d_bytes, "grads": grads * grad_bytes,
        "optimizer": max(owned) * (8 + (4 if d_bytes == 2 else 0)) * on_device,
        "activations": stage_activation_bytes(cfg, vocab_size, world_size, pp_rank),
        "buffers": buffers, "reserved": NON_TORCH_RESERVE_GIB * GIB,
    }
    mem["total"] = sum(mem.values())
    mem["host"] = layout.offload * max(owned) * HOST_BYTES_PER_OFFLOADED_ELEMENT  # not on the GPU: not in the total
    return mem


def stage_peak_bytes(cfg: RecipeConfig, vocab_size: int, world_size: int, pp_rank: int) -> float:
    """Estimated peak bytes on pipeline stage `pp_rank` under `cfg`'s layout (fp32 gradient buffers, as run)."""
    return _stage_memory(cfg, vocab_size, world_size, pp_rank, grad_bytes=4)["total"]


def compiled_layers(cfg: RecipeConfig) -> bool:
    """Whether the recipe runs `cfg` with compiled layers on a GPU, as its start-up resolves train.compile. The
    layer spec is TransformerEngine's only for model.attention_backend=te: the efficiencies were calibrated without
    TE, so `auto` is planned as local layers. Graphed eager layers are planned at the eager efficiency."""
    return compiles_layers(cfg.train, on_gpu=True, use_te=cfg.model.attention_backend == "te")


def kernel_efficiency(cfg: RecipeConfig) -> float:
    """The calibrated fraction of peak the layer kernels reach under `cfg`'s compile choice."""
    return KERNEL_EFFICIENCY["compiled" if compiled_layers(cfg) else "eager"]


def _step_time(cfg: RecipeConfig, vocab_size: int, world_size: int, gpus_per_node: int, gpu: GPUSpec,
               mfu: float, grad_bytes: int) -> dict[str, float]:
    """Seconds per training step, by component (see the module docstring)."""
    layout, shape = Layout.of(cfg, world_size), _Shape.of(cfg, vocab_size)
    tp, pp, cp, dp, v = layout.tp, layout.pp, layout.cp, layout.dp, layout.vpp or 1
    d_bytes = shape.bytes_per_value
    m = cfg.train.global_batch_size // (layout.mbs * dp)
    tokens = layout.mbs * shape.seq // cp  # per CP rank per micro batch

    def link(span: int) -> tuple[float, float]:
        """(bus GB/s, latency) of a group spanning `span` consecutive ranks (TP fastest, then CP, DP, PP)."""
        return (gpu.nvlink_gb_s, LATENCY_INTRA_S) if span <= gpus_per_node else (gpu.internode_gb_s,
                                                                                 LATENCY_INTER_S)

    peak = gpu.peak_bf16_tflops * 1e12 * mfu
    # one micro batch through the slowest stage (its layers, the last's with the output layer), fwd + bwd
    stages = tuple(pipeline_stage_layers(cfg))
    flops, layers = max((_flops_per_token(shape, n, r == pp - 1, layout.recompute), n) for r, n in enumerate(stages))
    flops *= layout.mbs * shape.seq
    compute = flops / (tp * cp) / peak

    bw, lat = link(tp)
    collectives = 6 if layout.recompute == "full" else 4  # AR (or AG+RS with SP) ×2 forward, ×2 backward
    tp_comm = layers * collectives * _ring(tokens * shape.hidden * d_bytes, tp, bw, lat, 2.0)

    cp_comm = 0.0
    if cp > 1:
        bw, lat = link(tp * cp)
        kv = tokens * 2 * shape.groups * shape.head_dim // tp * d_bytes
        ring = 3 * (cp - 1) * (kv / (bw * 1e9) + lat)  # K/V forward, K/V + dK/dV backward
        attention = shape.model.attention_flops_per_token() * layout.mbs * shape.seq / (tp * cp) / peak
        # Each of the 2·CP block steps (forward, backward) launches its own kernels and rescales the
        # partial output with the new log-sum-exp: a memory-bound pass over the fp32 output.
        rescale = tokens * shape.heads * shape.head_dim // tp * 4 * 3 / (gpu.hbm_tb_s * 1e12)
        cp_comm = layers * (max(0.0, ring - attention) + 2 * cp * (CP_STEP_LAUNCH_S + rescale))

    moe_comm = 0.0
    if shape.experts:  # per MoE layer: dispatch and combine all-to-alls, forward and backward, over EP
        sequence_tokens = tokens // (tp if layout.sp else 1)
        bw, lat = link(shape.etp * shape.ep)  # expert ranks: ETP fastest, then EP
        routed = sequence_tokens * shape.topk * shape.hidden * d_bytes
        moe_comm = layers * 4 * ((shape.ep - 1) / shape.ep * routed / (bw * 1e9) + lat) if shape.ep > 1 else 0.0
        if shape.etp > 1:  # the routed tokens gathered over expert TP and their outputs reduce-scattered back
            bw, lat = link(shape.etp)
            moe_comm += layers * 4 * _ring(routed * shape.etp, shape.etp, bw, lat)

    p2p = 0.0
    if pp > 1:
        bw, lat = link(tp * cp * dp + 1)  # the next stage is tp·cp·dp ranks away
        sent = tokens // (tp if layout.sp else 1) * shape.hidden * d_bytes
        p2p = v * 2 * (sent / (bw * 1e9) + lat)

    # Grads are reduced over DP×CP: distopt = reduce-scatter + param all-gather, else all-reduce.
    params, grads, owned = _stage_static(shape, stages, layout.vpp, 0, dp, layout.distopt,
                                         cfg.parallel.overlap_grad_reduce)
    expert_dp = shape.expert_dp(world_size, pp)
    expert_params, expert_grads, expert_owned = _expert_static(shape, world_size, stages, layout.vpp, 0, layout.distopt,
                                                               cfg.parallel.overlap_grad_reduce)
    # What a micro batch costs besides its FLOPs: why small micro batches are slow (measured mbs 1 → 4: 1.45×)
    overhead = (params + expert_params) * GRAD_ACCUMULATE_BYTES / (gpu.hbm_tb_s * 1e12) + layers * LAYER_OVERHEAD_S

    per_microbatch = compute + overhead + tp_comm + cp_comm + moe_comm + p2p
    bubble = per_microbatch * (pp - 1) / v

    bw, lat = link(tp * cp * dp)
    if layout.sharding:  # Megatron-FSDP: per micro batch, overlapped layer by layer with compute (uncalibrated)
        whole, group = _model_elements(shape), dp * cp // layout.replicas  # HSDP: within a group
        bw, lat = link(tp * group)
        traffic = _ring(whole * grad_bytes, group, bw, lat)  # the gradients' reduce-scatter
        if layout.sharding == "optim_grads_params":
            traffic += 2 * _ring(whole * d_bytes, group, bw, lat)  # parameters gathered for forward and backward
        reduce = m * max(traffic - compute, traffic / max(layers, 1))
        gather = 0.0 if layout.sharding == "optim_grads_params" else _ring(whole * d_bytes, group, bw, lat)
        if layout.replicas > 1:  # once per step: the group's gradient shard all-reduced across the replicas
            bw, lat = link(tp * cp * dp)
            reduce += _ring(-(-whole // group) * grad_bytes, layout.replicas, bw, lat, 2.0)
    else:
        if layout.distopt:
            reduce = _ring(grads * grad_bytes, dp * cp, bw, lat)
            gather = _ring(params * d_bytes, dp * cp, bw, lat)
        else:
            reduce, gather = _ring(grads * grad_bytes, dp * cp, bw, lat, 2.0), 0.0
        if cfg.parallel.overlap_grad_reduce:
            reduce = max(0.0, reduce - 2 / 3 * compute)  # hidden behind the last micro batch's backward
        if cfg.parallel.overlap_param_gather and layout.distopt:
            gather = max(0.0, gather - 1 / 3 * compute)  # hidden behind the next step's first forward
    owned_max = max(owned)
    if shape.experts:  # the experts' gradients are reduced over expert-DP, their state sharded over it
        bw, lat = link(world_size // pp)
        if layout.distopt:
            reduce += _ring(expert_grads * grad_bytes, expert_dp, bw, lat)
            gather += _ring(expert_grads * d_bytes, expert_dp, bw, lat)
        else:
            reduce += _ring(expert_grads * grad_bytes, expert_dp, bw, lat, 2.0)
        owned_max += max(expert_owned)
    optimizer = (1 - layout.offload) * owned_max * OPTIMIZER_BYTES_PER_ELEMENT / (gpu.hbm_tb_s * 1e12)
    hosted = layout.offload * owned_max  # the host's Adam step overlapped with the copies to and from it
    offload = max(hosted / HOST_ADAM_ELEMENTS_PER_S, hosted * OFFLOAD_COPY_BYTES / (gpu.pcie_gb_s * 1e9))
    time = {"compute": compute * m, "overhead": overhead * m, "tp_comm": tp_comm * m, "cp_comm": cp_comm * m,
            "moe_comm": moe_comm * m, "pp_p2p": p2p * m,
            "pp_bubble": bubble, "dp_comm": reduce + gather, "optimizer": optimizer, "offload": offload}
    time["step"] = sum(time.values())
    return time


def estimate(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: GPUSpec, vocab_size: int,
             mfu: Optional[float] = None, grad_reduce_in_fp32: bool = True) -> Estimate:
    """Memory and step time of the layout `cfg` specifies on `world_size` GPUs.

    `mfu`: the layer kernels' fraction of dense BF16 peak; None = calibrated (:func:`kernel_efficiency`).

    `grad_reduce_in_fp32=False` is a what-if for bf16 grad buffers (as Megatron-Bridge's performance
    configs run); the recipe's ``wrap_with_ddp`` always reduces in fp32.
    """
    layout, shape = Layout.of(cfg, world_size), _Shape.of(cfg, vocab_size)
    grad_bytes = 4 if grad_reduce_in_fp32 else shape.bytes_per_value
    stages = [_stage_memory(cfg, vocab_size, world_size, r, grad_bytes) for r in range(layout.pp)]
    peak_stage = max(range(layout.pp), key=lambda r: stages[r]["total"])
    memory = stages[peak_stage]
    host_per_node = memory["host"] * min(gpus_per_node, world_size)
    fits = (memory["total"] * (1 + FRAGMENTATION) <= gpu.memory_gib * GIB
            and host_per_node <= HOST_MEMORY_FOR_OFFLOAD * gpu.node_host_memory_gib * GIB)
    time = _step_time(cfg, vocab_size, world_size, gpus_per_node, gpu, mfu or kernel_efficiency(cfg), grad_bytes)
    tokens = cfg.train.global_batch_size * shape.seq
    model_flops = model_flops_per_token(cfg, vocab_size) * tokens
    mfu_est = model_flops / (time["step"] * world_size * gpu.peak_bf16_tflops * 1e12)
    m = cfg.train.global_batch_size // (layout.mbs * layout.dp)
    return Estimate(layout, memory, peak_stage, time, m, mfu_est, tokens / time["step"] / world_size, fits,
                    gpu.memory_gib * GIB)


# ---------------------------------------------------------------------------------------------
# Search


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# (distributed optimizer, Megatron-FSDP strategy): DDP, ZeRO-1, ZeRO-2, ZeRO-3
_DATA_PARALLEL_SHARDINGS: tuple[tuple[bool, Optional[ShardingStrategy]], ...] = (
    (False, None), (True, None), (True, "optim_grads"), (True, "optim_grads_params"))


def _hsdp_replicas(sharding: Optional[ShardingStrategy], tp: int, cp: int, dp: int, gpus_per_node: int
                   ) -> list[int]:
    """HSDP group counts worth trying: 1, and for Megatron-FSDP over more than one node, one group per node (the
    sharding's gathers on NVLink, one all-reduce across nodes per step)."""
    nodes, spare = divmod(tp * cp * dp, gpus_per_node)
    return [1, nodes] if sharding and not spare and nodes > 1 and (dp * cp) % nodes == 0 else [1]


def _expert_layouts(cfg: RecipeConfig, stage_ranks: int, tp: int) -> list[tuple[int, Optional[int]]]:
    """(EP, ETP) pairs worth trying for an MoE model on `stage_ranks` ranks per pipeline stage: every EP dividing
    the experts and the stage, each expert split over TP (ETP None) or whole (ETP1); (1, None) for a dense model."""
    experts = cfg.model.num_moe_experts
    if experts is None:
        return [(1, None)]
    etps: list[Optional[int]] = [None, 1] if tp > 1 else [None]
    return [(ep, etp) for ep in _divisors(math.gcd(experts, stage_ranks)) for etp in etps]


def _pipeline_splits(layers: int, pp: int) -> list[tuple[Optional[int], Optional[int]]]:
    """(first, last) stage layer counts the search tries at `pp` stages: the even split where the layers divide,
    else near-even ones — the middle stages k = ⌊layers/pp⌋ or ⌈layers/pp⌉ each, the rest halved between the first
    and last stage with the last (which also runs the output layer and loss) never holding more, at most k + 1
    (126 layers at PP 8: 15 + 6 × 16 + 15). At PP 2 only the last is set (megatron-core refuses both there)."""
    if layers % pp == 0:
        return [(None, None)]
    splits: list[tuple[Optional[int], Optional[int]]] = []
    for k in sorted({layers // pp, -(-layers // pp)}):
        rest = layers - (pp - 2) * k
        last = rest // 2
        first = rest - last
        if 1 <= last <= first <= k + 1:
            splits.append((None, last) if pp == 2 else (first, last))
    return list(dict.fromkeys(splits))


def candidate_layouts(cfg: RecipeConfig, world_size: int, gpus_per_node: int,
                      micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> Iterator[Layout]:
    """Every layout `validate_layout` accepts, with TP inside one node and the pipeline split evenly or near-evenly
    (:func:`_pipeline_splits`; virtual stages only with an even split); with the
    distributed optimizer, also ZeRO-2 and ZeRO-3 through Megatron-FSDP (PP=1); for an MoE model, every EP and
    expert TP too. Without optimizer offload, whatever `cfg` sets: like recompute, it is the search's to choose
    (:func:`plan`)."""
    gpn = min(gpus_per_node, world_size)
    layers = cfg.model.num_layers
    for tp in _divisors(gpn):
        for pp in _divisors(world_size // tp):
            splits: list[tuple[Optional[int], tuple[Optional[int], Optional[int]]]] = [
                (None, split) for split in _pipeline_splits(layers, pp)]
            if pp > 1 and layers % pp == 0:
                splits += [(v, (None, None)) for v in _divisors(layers // pp) if v > 1]
            for cp in _divisors(world_size // (tp * pp)):
                dp = world_size // (tp * pp * cp)
                choices = itertools.product(splits, [False, True] if tp > 1 else [False], _DATA_PARALLEL_SHARDINGS,
                                            (None, "selective", "full"), micro_batch_sizes,
                                            _expert_layouts(cfg, world_size // pp, tp))
                for (vpp, (first, last)), sp, (distopt, sharding), recompute, mbs, (ep, etp) in choices:
                    for replicas in _hsdp_replicas(sharding, tp, cp, dp, gpn):
                        layout = Layout(tp, pp, vpp, cp, dp, sp, distopt, recompute, mbs, sharding, replicas,
                                        ep=ep, etp=etp, first_stage_layers=first, last_stage_layers=last)
                        try:
                            validate_layout(layout.apply(cfg), world_size, te_available=True, fp8_capable=True)
                        except ConfigError:
                            continue
                        yield layout


def _with_offload(cfg: RecipeConfig, world_size: int, layouts: list[Layout]) -> Iterator[Layout]:
    """The distributed-optimizer layouts among `layouts` again with OFFLOAD_FRACTIONS of the optimizer state in host
    memory, where `validate_layout` accepts it (bf16, no Megatron-FSDP)."""
    for layout in layouts:
        if layout.distopt and not layout.sharding:
            for fraction in OFFLOAD_FRACTIONS:
                offloaded = dataclasses.replace(layout, offload=fraction)
                try:
                    validate_layout(offloaded.apply(cfg), world_size, te_available=True, fp8_capable=True)
                except ConfigError:
                    continue
                yield offloaded


def plan(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: str | GPUSpec,
         mfu: Optional[float] = None, grad_reduce_in_fp32: bool = True) -> list[Estimate]:
    """Every valid layout: those that fit first, DDP/ZeRO-1 before ZeRO-2/3 before optimizer offload (tried only
    when nothing fits without it), fastest first (then smallest memory)."""
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    vocab = model_vocab_size(cfg)

    def estimates_of(layouts: Iterator[Layout]) -> list[Estimate]:
        return [estimate(layout.apply(cfg), world_size, gpus_per_node, spec, vocab, mfu, grad_reduce_in_fp32)
                for layout in layouts]

    estimates = estimates_of(candidate_layouts(cfg, world_size, gpus_per_node))
    if not any(e.fits for e in estimates):  # the guide's last resort
        estimates += estimates_of(_with_offload(cfg, world_size, [e.layout for e in estimates]))
    by_layout = {e.layout: e for e in estimates}
    for e in estimates:
        if e.layout.sharding:
            counterpart = by_layout.get(dataclasses.replace(e.layout, sharding=None, replicas=1))
            e.without_sharding = counterpart.memory if counterpart else None
        if e.layout.offload:
            counterpart = by_layout.get(dataclasses.replace(e.layout, offload=0.0))
            e.without_offload = counterpart.memory if counterpart else None
    # The guide's decision tree: ZeRO-2/3 when nothing lighter fits, offload last. Megatron-FSDP's and offload's time
    # terms are uncalibrated and cost bandwidth ZeRO-1 does not spend, so a fitting DDP/ZeRO-1 layout ranks first.
    return sorted(estimates, key=lambda e: (not e.fits, e.layout.offload > 0, e.layout.sharding is not None,
                                            e.time["step"], e.memory["total"]))


def detect_gpu() -> str:
    """This machine's GPU as a GPUS key; a CPU rehearsal plans for an H100 cluster."""
    import torch

    if not torch.cuda.is_available():
        return "h100-80gb"
    name = torch.cuda.get_device_name()
    memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    for key, spec in GPUS.items():
        if spec.name.split()[0] in name and abs(spec.memory_gib - memory_gib) < 8:
            return key
    raise ConfigError(f"parallel.auto: no planner entry for {name} ({memory_gib:.0f} GiB); "
                      f"set parallel.auto_gpu to one of {', '.join(GPUS)}")


def best_layout(cfg: RecipeConfig, world_size: int, gpus_per_node: int, gpu: str) -> dict[str, Any]:
    """The fastest layout that fits, as ``parallel.*`` / ``train.*`` values to set on the config."""
    ranked = plan(cfg, world_size, gpus_per_node, gpu)
    if not ranked or not ranked[0].fits:
        smallest = min(ranked, key=lambda e: e.memory["total"], default=None)
        need = f"; the smallest needs {smallest.memory['total'] / GIB:.1f} GiB ({smallest.layout.label()})" \
            if smallest else ""
        raise ConfigError(f"no valid layout of {cfg.recipe.name} fits on {world_size}× {gpu}{need}")
    return ranked[0].layout.overrides()


def explain(e: Estimate, gpus_per_node: int, gpu: GPUSpec) -> str:
    """A few plain sentences on why this layout costs what it costs."""
    L, t, mem = e.layout, e.time, e.memory
    parts = [f"{L.label()}: {t['step']:.2f} s/step, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
             f"MFU ≈ {100 * e.mfu:.0f} %, {mem['total'] / GIB:.1f} of {gpu.memory_gib:.0f} GiB "
             f"(pipeline stage {e.peak_stage})."]
    if L.tp > 1:
        parts.append(f"TP{L.tp} splits every layer across {L.tp} GPUs of one node"
                     + (" and sequence parallelism also splits norms and dropout-free residual activations"
                        if L.sp else "") + f"; its collectives cost {t['tp_comm']:.2f} s.")
    if L.pp > 1:
        parts.append(f"PP{L.pp}{f' with {L.vpp} virtual stages' if L.vpp else ''} leaves a bubble of "
                     f"{t['pp_bubble']:.2f} s ((p−1)/(v·m) = {L.pp - 1}/({L.vpp or 1}·"
                     f"{e.num_microbatches})).")
    if L.cp > 1:
        parts.append(f"CP{L.cp} splits each sequence in {L.cp}; the K/V ring costs {t['cp_comm']:.2f} s "
                     "beyond what attention hides.")
    if L.ep > 1 or L.etp is not None:
        etp = L.tp if L.etp is None else L.etp
        expert_dp = L.tp * L.cp * L.dp // (L.ep * etp)
        parts.append(f"EP{L.ep} puts 1/{L.ep} of each layer's experts on a GPU"
                     + (f", each expert's matrices split over ETP{etp}" if etp > 1 else ", each expert whole")
                     + f"; the tokens' all-to-all dispatch and combine cost {t['moe_comm']:.2f} s, and the experts' "
                     f"gradients and optimizer state are reduced and sharded over expert-DP={expert_dp}.")
    over = f"DP×CP={L.dp * L.cp}" if L.replicas == 1 else f"HSDP groups of {L.dp * L.cp // L.replicas} DP×CP ranks"
    shard = f"sharded over {over}" if L.distopt and L.dp * L.cp > 1 else "replicated"
    if L.offload:
        shard = f"{1 - L.offload:.0%} of it on the GPU, {shard}"
    if L.sharding:
        level = ZERO_LEVEL[L.sharding]
        shard += (f"; Megatron-FSDP ZeRO-{level} shards the gradients"
                  + (" and the parameters, gathering two layers at a time," if level == 3 else "") + " there too")
    parts.append(f"Optimizer state {mem['optimizer'] / GIB:.1f} GiB ({shard}); "
                 f"params {mem['params'] / GIB:.1f}, "
                 f"grads {mem['grads'] / GIB:.1f}, activations {mem['activations'] / GIB:.1f} GiB "
                 f"with recompute={L.recompute or 'none'} and micro batch {L.mbs}; DP gradient sync exposes "
                 f"{t['dp_comm']:.2f} s.")
    if L.replicas > 1:
        parts.append(f"HSDP keeps the sharding's gathers inside each of the {L.replicas} groups; the groups replicate "
                     "each other and all-reduce their gradient shards once per step.")
    if L.offload:
        parts.append(f"Optimizer CPU offload keeps {L.offload:.0%} of this rank's optimizer state in host memory "
                     f"({mem['host'] / GIB:.1f} GiB per GPU, {gpus_per_node * mem['host'] / GIB:.0f} of the "
                     f"{gpus_per_node}-GPU node's {gpu.node_host_memory_gib:.0f} GiB); the host's Adam step and the "
                     f"PCIe copies add {t['offload']:.2f} s (uncalibrated).")
    if L.offload and e.without_offload is not None:
        parts.append(f"Without offload this layout needs {e.without_offload['total'] / GIB:.1f} GiB/GPU (optimizer "
                     f"state {e.without_offload['optimizer'] / GIB:.1f} GiB) and nothing fits without it.")
    zero1 = e.without_sharding
    if L.sharding and zero1 is not None:
        verdict = "does not fit" if zero1["total"] * (1 + FRAGMENTATION) > e.gpu_memory else "would fit too"
        parts.append(f"With ZeRO-1 this layout needs {zero1['total'] / GIB:.1f} GiB/GPU (params "
                     f"{zero1['params'] / GIB:.1f}, grads {zero1['grads'] / GIB:.1f}, optimizer state "
                     f"{zero1['optimizer'] / GIB:.1f} GiB) and {verdict}; ZeRO-{level} over {over} "
                     f"brings params and grads to {mem['params'] / GIB:.1f} + {mem['grads'] / GIB:.1f} GiB.")
    return " ".join(parts)
