"""A candidate layout (:class:`Layout`: the parallel sizes and switches the planner varies) and the model's
dimensions on one rank under it (:class:`RankShape`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_ext.config.schema import (
    ZERO_LEVEL,
    RecipeConfig,
    ShardingStrategy,
    data_parallel_size,
    expert_data_parallel_size,
    expert_tensor_parallel_size,
    model_expert_tensor_parallel_size,
)
from megatron_ext.config.shape import ModelShape, cached_by_section, padded_vocab_size
from megatron_ext.errors import ConfigError

GIB = 2**30


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

    def overrides(self, cfg: RecipeConfig) -> dict[str, Any]:
        """This layout over `cfg`, as ``section.key`` → value: the one mapping from a layout to a config — what
        :meth:`apply` sets, what the planner estimates and what it prints to use."""
        p = cfg.parallel
        keys: dict[str, Any] = {
            "parallel.use_megatron_fsdp": self.sharding is not None,
            "parallel.num_distributed_optimizer_instances": self.replicas,
            # the planner's HSDP replicates across its groups unless the config shards the optimizer there too
            "parallel.outer_dp_sharding_strategy": p.outer_dp_sharding_strategy if self.replicas > 1 else "no_shard",
            "optimizer.optimizer_cpu_offload": self.offload > 0,
            # (EP1 too: applied over an MoE recipe's EP, the layout must set it)
            "parallel.expert_model_parallel_size": self.ep, "parallel.expert_tensor_parallel_size": self.etp,
            "parallel.tensor_model_parallel_size": self.tp, "parallel.pipeline_model_parallel_size": self.pp,
            "parallel.virtual_pipeline_model_parallel_size": self.vpp,
            "parallel.num_layers_in_first_pipeline_stage": self.first_stage_layers,
            "parallel.num_layers_in_last_pipeline_stage": self.last_stage_layers,
            "parallel.context_parallel_size": self.cp, "parallel.sequence_parallel": self.sp,
            "parallel.use_distributed_optimizer": self.distopt,
            "train.micro_batch_size": self.mbs, "train.recompute_granularity": self.recompute,
        }
        if self.offload:
            keys["optimizer.optimizer_offload_fraction"] = self.offload
        if self.sharding:  # Megatron-FSDP overlaps its own gathers and reduce-scatters (megatron-core's flags refused)
            keys.update({"parallel.data_parallel_sharding_strategy": self.sharding,
                         "parallel.overlap_grad_reduce": False, "parallel.overlap_param_gather": False})
        elif p.overlap_param_gather and not self.distopt:  # the parameters' gather is the distributed optimizer's
            keys["parallel.overlap_param_gather"] = False
        return keys

    def apply(self, cfg: RecipeConfig) -> RecipeConfig:
        """A copy of `cfg` with this layout: :meth:`overrides` set."""
        sections: dict[str, dict[str, Any]] = {}
        for key, value in self.overrides(cfg).items():
            section, name = key.split(".")
            sections.setdefault(section, {})[name] = value
        applied = _shallow_copy(cfg)
        for section, values in sections.items():
            changed = _shallow_copy(getattr(cfg, section))
            vars(changed).update(values)
            setattr(applied, section, changed)
        return applied

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
                   p.expert_tensor_parallel_size or model_expert_tensor_parallel_size(cfg.model),
                   p.num_layers_in_first_pipeline_stage,
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


def _shallow_copy(section: Any) -> Any:
    """A shallow copy of a config (section), as dataclasses.replace makes one (the config's classes have no
    __post_init__ and no slots), without its __init__: a search applies a layout to the recipe hundreds of thousands
    of times."""
    copied = object.__new__(type(section))
    vars(copied).update(vars(section))
    return copied


def offload_fraction(cfg: RecipeConfig) -> float:
    """The fraction of each rank's optimizer state `cfg` keeps in host memory (0 without offload)."""
    o = cfg.optimizer
    return o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0


@dataclass(frozen=True)
class RankShape:
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
    experts: int = 0  # MoE: experts per MoE layer (0: dense)
    expert_ffn: int = 0
    topk: int = 0
    shared_ffn: int = 0  # the shared experts' width (0: none)
    ep: int = 1
    etp: int = 1  # expert TP
    muon_share: float = 0.0  # of the parameters, those optimizer.name=muon steps with Muon (the rest: Adam)

    @classmethod
    def of(cls, cfg: RecipeConfig, vocab_size: int) -> "RankShape":
        p = cfg.parallel
        # a search asks for the shape of each candidate layout many times over
        key = (p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel,
               p.expert_model_parallel_size, p.expert_tensor_parallel_size, cfg.train.precision, vocab_size,
               cfg.optimizer.name)
        return cached_by_section(_SHAPES, cfg.model, key, lambda: cls._of(cfg, vocab_size))

    @classmethod
    def _of(cls, cfg: RecipeConfig, vocab_size: int) -> "RankShape":
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
            muon_share=model.matrix_parameters(vocab_size) / model.num_parameters(vocab_size)
            if cfg.optimizer.name == "muon" else 0.0,
        )

    def layer_params(self, moe: bool = True) -> list[int]:
        """One decoder layer's parameter sizes on a TP rank, in ``named_parameters`` order, its experts left out
        (:meth:`expert_params`): an MoE layer's MLP (`moe`, in an MoE model) is its router (whole on every rank) and
        shared experts."""
        h, d, t, m = self.hidden, self.head_dim, self.tp, self.model
        if m.multi_latent_attention:  # the output, q down/up, KV down/up projections (column-parallel), their norms
            q_rank, kv_rank, n = m.q_lora_rank, m.kv_lora_rank, self.heads
            attention = [h, h * n * m.v_head_dim // t, q_rank * h // t, n * m.query_key_head_dim * q_rank // t,
                         (kv_rank + m.qk_pos_emb_head_dim) * h // t, n * (m.qk_head_dim + m.v_head_dim) * kv_rank // t,
                         q_rank, kv_rank]
        else:  # the input norm, the sinks, the output projection (and its bias, whole), the QKV projection and bias
            qkv = (self.heads + 2 * self.groups) * d
            attention = [h, *([self.heads // t] if m.attention_sinks else []), h * self.heads * d // t,
                         *([h] if m.linear_biases else []), qkv * h // t, *([qkv // t] if m.qkv_bias else [])]
            attention += [d, d] if self.qk_norm else []
        if not (moe and self.experts):
            return [*attention, h, *self._glu_params(self.ffn, t)]
        shared = self._glu_params(self.shared_ffn, t) if self.shared_ffn else []
        return [*attention, h, self.experts * h, *([self.experts] if m.linear_biases else []), *shared]

    def _glu_params(self, width: int, split: int) -> list[int]:
        """A GLU MLP's up and down projections (each followed by its bias with model.add_bias_linear; the down
        projection's whole) with `split`-way tensor parallelism."""
        h, biased = self.hidden, self.model.linear_biases
        return [2 * width * h // split, *([2 * width // split] if biased else []), width * h // split,
                *([h] if biased else [])]

    def expert_params(self) -> list[int]:
        """One MoE layer's expert parameters on an EP×ETP rank (its experts' fc1 and fc2, and their biases), in
        ``named_parameters`` order; megatron-core keeps them in buffers of their own, reduced and sharded over
        expert-DP."""
        return [n for _ in range(self.experts // self.ep) for n in self._glu_params(self.expert_ffn, self.etp)]

    def expert_dp(self, world_size: int, pp: int) -> int:
        """The expert-data-parallel size: the ranks of a pipeline stage regrouped as ETP × EP × expert-DP."""
        return expert_data_parallel_size(world_size, pp, self.ep, self.etp)


_SHAPES: dict[tuple, tuple[dict, RankShape]] = {}


def model_vocab_size(cfg: RecipeConfig) -> int:
    """The unpadded vocabulary: ``model.vocab_size``, else the tokenizer's."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.tokenizer_model:
        from megatron_ext.data.tokenizer import load_tokenizer

        return load_tokenizer(cfg.data.tokenizer_model, cfg.data.tokenizer_type).vocab_size
    raise ConfigError("model.vocab_size=None is invalid for planning: set it or data.tokenizer_model")
