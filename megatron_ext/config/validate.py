"""Cross-field rules of the recipe config for a world size: the model shape, the 4D layout, precision, kernels,
checkpointing and monitoring. Each failure is one :class:`ConfigError` naming the key, its value and what would
be valid, raised before any process group exists instead of a traceback (or a hang) deep inside megatron-core.

The data files and tokenizer are checked by :mod:`megatron_ext.data.checks`; what this machine can run (a GPU,
TransformerEngine, liger-kernel) by :mod:`megatron_ext.config.kernels`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import typing
from typing import Any, Optional

from megatron_ext.config.cuda_graph_rules import validate_cuda_graphs
from megatron_ext.config.model_rules import (
    validate_attention_and_glu,
    validate_megatron_fsdp_model,
    validate_mla,
    validate_model_class,
    validate_moe,
    validate_moe_layer_freq,
    validate_mtp,
)
from megatron_ext.config.optimizer_rules import validate_optimizer
from megatron_ext.config.precision import Capability, validate_precision
from megatron_ext.config.schema import (
    RecipeConfig,
    allowed_values,
    collective_timeout_minutes,
    hang_timeout_s,
    lr_decay_iterations,
    shown_value,
)
from megatron_ext.config.shape import ModelShape, moe_layer_pattern
from megatron_ext.errors import ConfigError, require


@functools.cache
def _literal_keys(section: type) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """A config section's Literal-typed keys and their values (resolving the annotations is slow: the planner
    validates thousands of candidate layouts)."""
    hints = typing.get_type_hints(section)
    return tuple((name, allowed_values(annotation)) for name, annotation in hints.items() if allowed_values(annotation))


def _check_enum_values(cfg: RecipeConfig) -> None:
    """Every Literal-typed key holds one of its values, also in a config built in code rather than loaded."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for name, allowed in _literal_keys(type(values)):
            value = getattr(values, name)
            if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
                require(False, f"{section.name}.{name}", value, f"one of {', '.join(map(shown_value, allowed))}")


def validate(cfg: RecipeConfig, world_size: int, te_available: bool = False,
             compute_capability: Optional[Capability] = None) -> None:
    """Every config rule: the model shape and 4D layout for `world_size` processes, checkpointing, monitoring."""
    validate_layout(cfg, world_size, te_available, compute_capability)
    _validate_checkpoint(cfg)
    _validate_monitoring(cfg, world_size)


@dataclasses.dataclass(frozen=True)
class TrainedWorld:
    """The ranks of a started world that train: ranks 0..size-1; `idle_because` says why the rest do not."""

    size: int
    idle_because: Optional[str] = None


def trained_world(cfg: RecipeConfig, world_size: int, te_available: bool = False,
                  compute_capability: Optional[Capability] = None) -> TrainedWorld:
    """`world_size` when :func:`validate` accepts it; else, with parallel.allow_idle_ranks, the largest smaller world
    it accepts (DP lowered, TP × PP × CP kept); else the started world's ConfigError."""
    try:
        validate(cfg, world_size, te_available, compute_capability)
        return TrainedWorld(world_size)
    except ConfigError as error:
        if not cfg.parallel.allow_idle_ranks:
            raise
        p = cfg.parallel
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        for size in range((world_size - 1) // model_parallel * model_parallel, 0, -model_parallel):
            try:
                validate(cfg, size, te_available, compute_capability)
            except ConfigError:
                continue
            return TrainedWorld(size, str(error))
        raise


def _validate_checkpoint(cfg: RecipeConfig) -> None:
    c = cfg.checkpoint
    require(c.keep_every is None or c.keep_last is not None, "checkpoint.keep_every", c.keep_every,
            "only applies with checkpoint.keep_last (without it every checkpoint is kept)")
    if cfg.parallel.use_megatron_fsdp:
        require(c.optimizer_format == "auto", "checkpoint.optimizer_format", c.optimizer_format,
                "is the distributed optimizer's format; Megatron-FSDP runs write megatron-core's fsdp_dtensor "
                "format (reshardable across DP sizes and ZeRO-2/3): leave it auto")


def _validate_monitoring(cfg: RecipeConfig, world_size: int) -> None:
    t, g = cfg.train, cfg.logging
    require(t.spike_policy != "rewind" or cfg.checkpoint.save is not None, "train.spike_policy", t.spike_policy,
            "goes back to the newest checkpoint in checkpoint.save: set checkpoint.save (and a "
            "checkpoint.save_interval), or use train.spike_policy=skip")
    require(t.recurring_fault == "policies" or (t.rerun_mode == "validate_results" and cfg.checkpoint.save),
            "train.recurring_fault", t.recurring_fault, "re-runs a step whose fault recurred in place on other GPUs, "
            "from a checkpoint saved before it: set train.rerun_mode=validate_results and checkpoint.save")
    collective_timeout_s, hang_s = collective_timeout_minutes(cfg) * 60, hang_timeout_s(cfg)
    require(hang_s is None or 0 < hang_s < collective_timeout_s, "train.hang_timeout_s", hang_s, f"must be null (off) or between 0 and parallel.distributed_timeout_minutes × 60 = "
            f"{collective_timeout_s} s, so that the watchdog names the hung rank before the collectives time out")
    steps = g.profile_steps
    require(steps is None or (len(steps) == 2 and 1 <= steps[0] <= steps[1] <= t.train_iters),
            "logging.profile_steps", steps, f"must be [first, last] iterations with 1 <= first <= last <= "
            f"train.train_iters ({t.train_iters}), or null (off)")
    require(all(0 <= r < world_size for r in g.profile_ranks), "logging.profile_ranks", g.profile_ranks,
            f"must be ranks of this job (0..{world_size - 1})")
    require(not g.memory_snapshot or steps is not None, "logging.memory_snapshot", True,
            "is taken at the end of logging.profile_steps: set those iterations too")
    require(not g.wandb_project or importlib.util.find_spec("wandb") is not None, "logging.wandb_project",
            g.wandb_project, "needs the wandb package here: pip install -r requirements.txt (or logging.wandb_project=null)")


def validate_layout(cfg: RecipeConfig, world_size: int, te_available: bool = False,
                    compute_capability: Optional[Capability] = None) -> None:
    """Cross-field checks of the model shape and the 4D layout for `world_size` processes.

    `te_available`: TransformerEngine imports; `compute_capability`: the GPU's CUDA compute capability (major, minor),
    None without one (a CPU rehearsal) — the GPUs each low-precision recipe runs on are config/precision.py's.
    """
    _check_enum_values(cfg)
    validate_layout_rules(cfg, world_size, te_available, compute_capability)


def validate_layout_rules(cfg: RecipeConfig, world_size: int, te_available: bool,
                          compute_capability: Optional[Capability]) -> None:
    """:func:`validate_layout` without checking the Literal keys' values again: for a search's candidates, which
    change only keys it sets from values of their own type in a config already checked (the re-check was a fifth of
    a 192-GPU DeepSeek-V3 search)."""
    validate_moe_layer_freq(cfg.model)
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size

    model_parallel = tp * pp * cp
    require(
        world_size % model_parallel == 0,
        "world size (processes started)",
        world_size,
        f"must be a multiple of parallel.tensor_model_parallel_size × pipeline_model_parallel_size × "
        f"context_parallel_size = {tp}×{pp}×{cp} = {model_parallel} (DP = world size / {model_parallel}); "
        f"valid world sizes: {model_parallel}, {2 * model_parallel}, {4 * model_parallel}, ...",
    )
    dp = world_size // model_parallel

    shape = ModelShape.of(m)
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    require(
        m.hidden_size % heads == 0 or m.kv_channels is not None or m.multi_latent_attention,
        "model.hidden_size",
        m.hidden_size,
        f"must be divisible by model.num_attention_heads={heads} (or set model.kv_channels)",
    )
    require(
        heads % groups == 0,
        "model.num_query_groups",
        groups,
        f"must divide model.num_attention_heads={heads}",
    )
    require(
        heads % tp == 0,
        "model.num_attention_heads",
        heads,
        f"must be divisible by parallel.tensor_model_parallel_size={tp}",
    )
    require(
        groups % tp == 0,
        "model.num_query_groups",
        groups,
        f"must be divisible by parallel.tensor_model_parallel_size={tp} "
        f"(valid TP sizes: {[d for d in range(1, groups + 1) if groups % d == 0 and heads % d == 0]})",
    )
    ffn = shape.ffn_hidden_size
    require(
        ffn % tp == 0,
        "model.ffn_hidden_size",
        ffn,
        f"must be divisible by parallel.tensor_model_parallel_size={tp}",
    )
    require(
        m.attention_backend != "te" or te_available,
        "model.attention_backend",
        m.attention_backend,
        "TransformerEngine is not importable here; use auto or local",
    )

    validate_mla(cfg)
    validate_mtp(cfg)
    validate_model_class(cfg)
    validate_attention_and_glu(cfg)
    _validate_pipeline(cfg)
    for key in ("hidden_dropout", "attention_dropout"):
        require(0.0 <= getattr(m, key) < 1.0, f"model.{key}", getattr(m, key), "must be in [0, 1)")
    require(m.attention_dropout == 0.0 or cp == 1 or m.attention_backend == "te", "model.attention_dropout",
            m.attention_dropout, "ring attention (context_parallel_size > 1 without TransformerEngine) has no "
            "attention dropout: set it to 0, or model.attention_backend=te")
    require(m.attention_dropout == 0.0 or not cfg.data.reset_attention_mask or m.attention_backend == "te",
            "model.attention_dropout", m.attention_dropout, "document masking (data.reset_attention_mask) in the local "
            "layers runs FlexAttention on a GPU, which has no attention dropout: set it to 0, or "
            "model.attention_backend=te")

    if p.sequence_parallel:
        require(tp > 1, "parallel.sequence_parallel", True, "needs tensor_model_parallel_size > 1")
    if cp > 1:
        require(
            m.seq_length % (2 * cp) == 0,
            "model.seq_length",
            m.seq_length,
            f"must be divisible by 2×context_parallel_size={2 * cp} "
            "(the load-balanced causal split cuts the sequence into 2×CP chunks)",
        )
    if p.sequence_parallel:
        require(
            (m.seq_length // cp) % tp == 0,
            "model.seq_length",
            m.seq_length,
            f"with sequence_parallel the per-CP-rank length seq_length/CP must be divisible by TP={tp}",
        )

    per_step = t.micro_batch_size * dp
    require(
        t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        t.global_batch_size,
        f"must be a multiple of micro_batch_size×DP = {t.micro_batch_size}×{dp} = {per_step}",
    )
    if vpp is not None and pp > 1:
        microbatches = t.global_batch_size // per_step
        require(
            microbatches % pp == 0,
            "train.global_batch_size",
            t.global_batch_size,
            f"the interleaved schedule needs the number of microbatches ({microbatches}) to be a "
            f"multiple of pipeline_model_parallel_size={pp}",
        )
    validate_precision(cfg, te_available, compute_capability)
    _validate_kernels(cfg, te_available)
    validate_cuda_graphs(cfg)
    _validate_megatron_fsdp(cfg, dp * cp)
    validate_megatron_fsdp_model(cfg)
    validate_moe(cfg, world_size)
    validate_optimizer(cfg)
    _validate_activation_offload(cfg)
    _validate_recompute(cfg, te_available)
    _validate_layer_offload(cfg)
    _validate_tp_comm_overlap(cfg)
    require(o.lr_decay_iters is None or o.lr_decay_iters > o.lr_warmup_iters, "optimizer.lr_decay_iters",
            o.lr_decay_iters, f"must exceed optimizer.lr_warmup_iters={o.lr_warmup_iters}")
    decay_iters = lr_decay_iterations(cfg)
    require(o.lr_decay_style != "WSD" or o.lr_wsd_decay_iters is not None, "optimizer.lr_wsd_decay_iters",
            None, "must be set with optimizer.lr_decay_style=WSD: the anneal's length, e.g. a tenth of the decay")
    require(o.lr_wsd_decay_iters is None or o.lr_wsd_decay_iters <= decay_iters - o.lr_warmup_iters,
            "optimizer.lr_wsd_decay_iters", o.lr_wsd_decay_iters,
            f"must fit in the decay after warm-up ({decay_iters} - {o.lr_warmup_iters} iterations)")
    require(o.lr >= o.min_lr >= 0, "optimizer.min_lr", o.min_lr, f"must be in [0, optimizer.lr={o.lr}]")
    require(p.overlap_param_gather is False or p.use_distributed_optimizer,
            "parallel.overlap_param_gather", True, "needs parallel.use_distributed_optimizer=true")
    require(p.ddp_bucket_size is None or p.overlap_grad_reduce, "parallel.ddp_bucket_size", p.ddp_bucket_size,
            "sizes the buckets of overlapped gradient reduction (one bucket without it): set "
            "parallel.overlap_grad_reduce=true or the key null")


def require_packed_sequence_layout(cfg: RecipeConfig, why_te: str) -> None:
    """Document masking in TransformerEngine's layers (its packed-sequence, THD, attention): the layouts it runs in.
    `why_te` says why TE's layers are built (model.attention_backend=te, or auto where TE imports)."""
    local = "model.attention_backend=local (FlexAttention, and the ring attention under CP)"
    cp = cfg.parallel.context_parallel_size
    require(cp == 1, "parallel.context_parallel_size", cp, f"{why_te}, and with data.reset_attention_mask its "
            "packed-sequence attention would need every document padded to a multiple of 2·CP tokens, which "
            f"GPTDataset's packing does not do: set {local}")
    require(cfg.data.reset_position_ids, "data.reset_position_ids", False,
            f"{why_te}, whose packed-sequence attention restarts RoPE at every document: set data.reset_position_ids="
            f"true with data.reset_attention_mask, or set {local}")


def _validate_kernels(cfg: RecipeConfig, te_available: bool) -> None:
    """Fused kernels and compile against precision, layout and the layer spec (CUDA graphs: config/cuda_graph_rules.py;
    the machine-dependent rules are in resolve_kernel_options)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    # megatron-core 0.19.2's native fused cross-entropy casts the logit gradient to bf16
    # unconditionally: in an fp32 run it would silently round every gradient through bf16.
    require(t.fused_cross_entropy is not True or t.precision == "bf16", "train.fused_cross_entropy", True,
            "needs train.precision=bf16 (megatron-core's fused kernel returns bf16 logit gradients)")
    if t.fused_linear_cross_entropy:
        require(p.tensor_model_parallel_size == 1, "train.fused_linear_cross_entropy", True,
                "needs the whole vocabulary on each rank (liger-kernel's kernel has no vocab-parallel form): set "
                "parallel.tensor_model_parallel_size=1, or use train.fused_cross_entropy with tensor parallelism")
        require(t.fused_cross_entropy is not True, "train.fused_cross_entropy", True,
                "replaced by train.fused_linear_cross_entropy=true, which computes the loss itself: set one")
    if cfg.data.reset_attention_mask:
        if m.attention_backend == "te":
            require_packed_sequence_layout(cfg, "model.attention_backend=te builds TransformerEngine's layers")
    require(t.compile is not True or m.attention_backend == "local" or not te_available, "train.compile", True,
            "compiles megatron-core's local layers; TransformerEngine layers bring their own fused "
            "kernels — set model.attention_backend=local to compile, or train.compile=false")


def _validate_activation_offload(cfg: RecipeConfig) -> None:
    """train.offload_modules against megatron-core's own asserts and what has been verified here (docs/memory.md)."""
    t, p = cfg.train, cfg.parallel
    if not t.offload_modules:
        return
    modules = list(t.offload_modules)
    vpp = p.virtual_pipeline_model_parallel_size
    for ok, key, value, why in [
        # megatron-core 0.19.2's offload manager keeps the groups of the first backward chunk on the device (its
        # offload margin: one group per module name); a one-layer virtual stage is left with nothing to offload,
        # skipped in the backward order, and the next step fails ("Chunk mismatch")
        (not vpp or cfg.model.num_layers >= 2 * vpp * p.pipeline_model_parallel_size,
         "parallel.virtual_pipeline_model_parallel_size", vpp,
         "leaves one layer per virtual pipeline stage, which megatron-core's activation offload cannot run (the "
         "second step fails): at least 2 layers per virtual stage, fewer virtual stages, or train.offload_modules=[]"),
        (len(set(modules)) == len(modules), "train.offload_modules", modules, "names a module twice"),
        ("attn_proj" not in modules or "core_attn" in modules, "train.offload_modules", modules,
         "attn_proj needs core_attn too: attn_proj's input is core attention's output, which core attention's "
         "backward pass still reads on the GPU (megatron-core's rule)"),
        (t.recompute_granularity != "full", "train.recompute_granularity", "full",
         "full recompute keeps only each layer's input: there is nothing left to offload — set "
         "train.offload_modules=[] or use selective/no recompute"),
    ]:
        require(ok, key, value, why)


def _validate_recompute(cfg: RecipeConfig, te_available: bool) -> None:
    """train.recompute_modules: megatron-core's selective-recompute modules, each where the model has what it
    recomputes (megatron-core's own rules, and the modules that would recompute nothing here)."""
    m, t = cfg.model, cfg.train
    modules = list(t.recompute_modules)
    if not modules:
        return
    key = "train.recompute_modules"
    moe = m.num_moe_experts is not None
    pattern = moe_layer_pattern(m.moe_layer_freq, m.num_layers) if moe else ()
    for ok, name, value, why in [
        (t.recompute_granularity == "selective", key, modules, "chooses what selective recompute repeats: set "
         "train.recompute_granularity=selective (full recompute repeats whole layers), or leave it []"),
        (len(set(modules)) == len(modules), key, modules, "names a module twice"),
        ("mla_up_proj" not in modules or m.multi_latent_attention, key, modules, "mla_up_proj recomputes multi-latent "
         "attention's up-projections, and this model has none (model.multi_latent_attention=false): drop it"),
        (moe or not {"moe", "moe_act", "shared_experts"} & set(modules), key, modules, "moe, moe_act and "
         "shared_experts recompute parts of MoE layers, and this model is dense (model.num_moe_experts=null): drop them"),
        ("shared_experts" not in modules or not moe or m.moe_shared_expert_intermediate_size is not None, key, modules,
         "shared_experts recomputes the shared experts, and this model has none "
         "(model.moe_shared_expert_intermediate_size=null): drop it"),
        ("moe_act" not in modules or not moe or (m.moe_grouped_gemm is not False and m.attention_backend != "local"),
         key, modules, "moe_act recomputes the experts' activation inside TransformerEngine's grouped GEMM "
         "(megatron-core's rule): leave model.moe_grouped_gemm auto or true with TransformerEngine's layers, or drop "
         "it"),
        ("mlp" not in modules or not pattern or 0 in pattern, key, modules, "mlp recomputes the dense MLPs, and every "
         "layer of this model is an MoE layer: use moe or moe_act"),
        (t.fp8 != "delayed" or not {"moe_act", "layernorm"} & set(modules), key, modules, "moe_act and layernorm "
         "recompute do not run with train.fp8=delayed (megatron-core's rule): use train.fp8=tensorwise or blockwise, or "
         "drop them"),
        # megatron-core 0.19.2's CheckpointWithoutOutput sets its fp8 flag for any argument but None, then reads TE's
        # FP8 state (tensor_parallel/random.py): without TE it fails with NameError 'FP8GlobalStateManager'
        (te_available or not {"layernorm", "mla_up_proj"} & set(modules), key, modules, "layernorm and mla_up_proj "
         "are recomputed by megatron-core's CheckpointWithoutOutput, which reads TransformerEngine's FP8 state "
         "(megatron-core 0.19.2) and fails where TE is not importable, as here: drop them, or run in the NGC container"),
    ]:
        require(ok, name, value, why)


def _validate_layer_offload(cfg: RecipeConfig) -> None:
    """train.cpu_offloading_num_layers: megatron-core's layer-level activation offload (TransformerEngine's CPU-offload
    context; the machine rules are resolve_kernel_options')."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    layers = t.cpu_offloading_num_layers
    if not layers:
        return
    key = "train.cpu_offloading_num_layers"
    for ok, name, value, why in [
        (layers < m.num_layers, key, layers, f"must be below model.num_layers={m.num_layers} (megatron-core offloads "
         "every layer's activations but the last's, which the backward pass starts from)"),
        (p.pipeline_model_parallel_size == 1, "parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size,
         f"megatron-core's layer offload ({key}) runs without pipeline parallelism: use pipeline size 1, or {key}=0"),
        (t.recompute_granularity is None, "train.recompute_granularity", t.recompute_granularity,
         f"megatron-core's layer offload ({key}) does not run with activation recompute: set it null, or {key}=0"),
        (not t.offload_modules, "train.offload_modules", list(t.offload_modules), f"megatron-core runs one activation "
         f"offload at a time (its rule): set train.offload_modules=[] or {key}=0"),
        (m.attention_backend != "local", key, layers, "offloads TransformerEngine's layers' activations (TE's "
         "CPU-offload context): set model.attention_backend=auto or te"),
    ]:
        require(ok, name, value, why)


def _validate_tp_comm_overlap(cfg: RecipeConfig) -> None:
    """parallel.tp_comm_overlap: TransformerEngine's userbuffers overlapping sequence parallelism's all-gathers and
    reduce-scatters with the GEMMs around them (the machine rules are resolve_kernel_options')."""
    m, p = cfg.model, cfg.parallel
    if not p.tp_comm_overlap:
        return
    key = "parallel.tp_comm_overlap"
    require(p.tensor_model_parallel_size > 1, key, True, "overlaps tensor-parallel communication, and "
            "parallel.tensor_model_parallel_size=1 has none: set it false")
    require(p.sequence_parallel, "parallel.sequence_parallel", False, f"{key} overlaps sequence parallelism's "
            "all-gathers and reduce-scatters with the GEMMs (megatron-core's rule): set it true")
    require(m.attention_backend != "local", key, True, "is TransformerEngine's (userbuffers inside its layers): set "
            "model.attention_backend=auto or te")


def _validate_megatron_fsdp(cfg: RecipeConfig, dp_cp: int) -> None:
    """What parallel.use_megatron_fsdp runs with here: megatron-core 0.19.2's own limits, and what this recipe has
    verified (each combination below trained 1-process-identical on CPU, or was refused)."""
    p, t = cfg.parallel, cfg.train
    replicas = p.num_distributed_optimizer_instances
    require(replicas == 1 or p.use_megatron_fsdp, "parallel.num_distributed_optimizer_instances", replicas,
            "is HSDP, Megatron-FSDP's: set parallel.use_megatron_fsdp=true (megatron-core's partial distributed "
            "optimizer without it is not verified here)")
    require(p.outer_dp_sharding_strategy == "no_shard" or replicas > 1, "parallel.outer_dp_sharding_strategy",
            p.outer_dp_sharding_strategy, "shards across HSDP replicas: set "
            "parallel.num_distributed_optimizer_instances > 1, or leave it no_shard")
    if not p.use_megatron_fsdp:
        return
    for ok, key, value, why in [
        (replicas == 1 or (dp_cp % replicas == 0 and dp_cp // replicas >= 2),
         "parallel.num_distributed_optimizer_instances", replicas,
         f"must divide DP×CP={dp_cp} into groups of at least 2 ranks to shard over"),
        (p.outer_dp_sharding_strategy != "optim" or p.data_parallel_sharding_strategy == "optim_grads_params",
         "parallel.outer_dp_sharding_strategy", "optim", "sharding across HSDP replicas needs the parameters sharded "
         "inside them (megatron-core's rule): parallel.data_parallel_sharding_strategy=optim_grads_params"),
        (p.data_parallel_sharding_strategy != "optim", "parallel.data_parallel_sharding_strategy", "optim",
         "ZeRO-1 is the distributed optimizer: set parallel.use_megatron_fsdp=false (with "
         "parallel.use_distributed_optimizer=true); Megatron-FSDP's optim mode reduces gradients DP times too large "
         "under this recipe's per-token loss (measured at DP2)"),
        (p.use_distributed_optimizer, "parallel.use_distributed_optimizer", False,
         "Megatron-FSDP shards the optimizer state itself and needs megatron-core's distributed optimizer on top"),
        (p.pipeline_model_parallel_size == 1, "parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size,
         "megatron-core 0.19.2's Megatron-FSDP builds its device mesh over TP×CP×DP only: use it with PP=1"),
        (dp_cp > 1, "parallel.use_megatron_fsdp", True, "there is nothing to shard at DP×CP=1"),
        (not (p.overlap_grad_reduce or p.overlap_param_gather), "parallel.overlap_grad_reduce",
         p.overlap_grad_reduce, "Megatron-FSDP overlaps its own gathers and reduce-scatters: leave "
         "parallel.overlap_grad_reduce and parallel.overlap_param_gather false"),
        (t.precision != "fp16", "train.precision", "fp16", "fp16 under Megatron-FSDP is not verified here: use bf16 "
         "or fp32"),
    ]:
        require(ok, key, value, why)


def _validate_pipeline(cfg: RecipeConfig) -> None:
    m, p = cfg.model, cfg.parallel
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if vpp is not None:
        require(vpp >= 1, "parallel.virtual_pipeline_model_parallel_size", vpp, "must be >= 1 or null")
        require(
            pp > 1,
            "parallel.virtual_pipeline_model_parallel_size",
            vpp,
            "needs pipeline_model_parallel_size > 1",
        )
    if first is not None or last is not None:
        # megatron-core 0.19.2 divides by zero (transformer_layer.py) if both are set at PP=2 with virtual stages
        # (stricter here: both are refused at PP=2)
        require(
            pp > 2 or first is None or last is None,
            "parallel.num_layers_in_last_pipeline_stage",
            last,
            "set only one of num_layers_in_first/last_pipeline_stage when pipeline_model_parallel_size=2",
        )
        require(vpp is None, "parallel.virtual_pipeline_model_parallel_size", vpp,
                "uneven pipeline stages are not combined with virtual stages here")
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        require(
            middle_layers >= 0 and (middle_stages == 0 and middle_layers == 0
                                    or middle_stages > 0 and middle_layers % middle_stages == 0),
            "model.num_layers",
            m.num_layers,
            f"after the first/last stage overrides ({first}/{last}) the remaining {middle_layers} "
            f"layers must divide evenly over the other {middle_stages} pipeline stages",
        )
        return
    chunks = pp * (vpp or 1)
    require(
        m.num_layers % chunks == 0,
        "model.num_layers",
        m.num_layers,
        f"must be divisible by pipeline_model_parallel_size×virtual_pipeline_model_parallel_size="
        f"{chunks}, or set parallel.num_layers_in_first_pipeline_stage/last for an uneven split",
    )
