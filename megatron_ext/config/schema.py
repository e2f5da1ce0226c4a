"""Typed recipe config: YAML + ``section.key=value`` overrides, validated before any process group exists.

Field names follow megatron-core's own (``TransformerConfig``, ``OptimizerConfig``, parallel_state).
OmegaConf structured configs give type checking and dotlist overrides; :func:`validate` adds the
cross-field rules of 4D parallelism so a bad layout fails with one message naming the key, the
value and what would be valid, instead of a traceback (or a hang) deep inside megatron-core.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_ext.errors import ConfigError


@dataclass
class RecipeMeta:
    name: str = "unnamed"
    description: str = ""
    gpus: Optional[int] = None  # the GPU count this recipe's layout is written for
    published_params: Optional[int] = None  # parameter count published for this model shape


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: Optional[int] = None  # None = multi-head attention (one group per head)
    ffn_hidden_size: Optional[int] = None  # None = Llama's 8/3·h rounded up to a multiple of 256
    kv_channels: Optional[int] = None  # None = hidden_size / num_attention_heads
    seq_length: int = 256
    vocab_size: Optional[int] = None  # None = the tokenizer's vocabulary size
    make_vocab_size_divisible_by: int = 128  # padded vocab is a multiple of this × TP
    rotary_base: float = 10000.0
    rope_scaling_factor: Optional[float] = None  # Llama-3.1-style long-context RoPE scaling (e.g. 8.0, 32.0)
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    attention_backend: str = "auto"  # auto (TE when importable) | te | local (SDPA; ring attention under CP)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    distributed_timeout_minutes: int = 10
    auto: bool = False  # replace the layout above by the planner's best for the started world size
    auto_gpu: Optional[str] = None  # planner GPU for auto (h100-80gb, h200-141gb, ...); None = detect


AUTO = "auto"  # a kernel option the Trainer decides for this machine (resolve_kernel_options)


@dataclass
class TrainConfig:
    train_iters: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seed: int = 1234
    eval_interval: int = 50
    eval_iters: int = 4
    precision: str = "fp32"  # fp32 | bf16
    fp8: Optional[str] = None  # None | delayed | tensorwise: TransformerEngine FP8 recipe (hybrid E4M3/E5M2)
    recompute_granularity: Optional[str] = None  # None | selective | full
    fused_swiglu: bool = False  # megatron-core's fused SwiGLU (bias_activation_fusion, torch.compile'd)
    # megatron-core's fused vocab-parallel cross-entropy (TE's with TE); auto = on in bf16 (its only precision)
    fused_cross_entropy: Any = AUTO
    # torch.compile every transformer layer (local layer spec); auto = on for local layers on a GPU, off on CPU
    # and with TransformerEngine (measured on an H100: +13-20 % tokens/s, docs/performance.md)
    compile: Any = AUTO
    # liger-kernel's Triton RMSNorm, SwiGLU and vocab-parallel cross-entropy through its megatron-core adapter
    # (local layer spec on a GPU; `pip install liger-kernel==0.8.5`). Refused on CPU and with TE. Unmeasured.
    liger_kernels: bool = False
    # The output layer and cross-entropy as one chunked liger-kernel kernel (megatron_ext/model/fused_output.py): the
    # [seq, batch, vocab] logits never exist, freeing memory for a larger micro batch. GPU, TP=1. Unmeasured.
    fused_linear_cross_entropy: bool = False
    # megatron-core's CUDA graphs of every decoder layer (cuda_graph_impl=local): captured during the first step,
    # replayed after it, so the layers' kernel launches cost no CPU time. Local layers on a GPU, eager (compile
    # auto turns off), pipeline size 1, no full recompute. Unmeasured.
    cuda_graphs: bool = False
    exit_interval: Optional[int] = None  # stop (and checkpoint) once iteration % exit_interval == 0
    exit_signal_handler: bool = True  # checkpoint and exit cleanly on SIGTERM/SIGUSR1
    # No finished step for this long (after the first): stacks to the rank logs, stopped ranks named, job ends
    # (exit 4) for SLURM to requeue. Below parallel.distributed_timeout_minutes, so it fires first; null = off
    hang_timeout_s: Optional[float] = 300.0
    skip_nonfinite_steps: int = 0  # skip up to N steps with a non-finite loss/gradient before stopping


@dataclass
class OptimizerSection:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None = train_iters (or warmup + 1 for runs shorter than warmup)
    lr_decay_style: str = "cosine"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    # torch AdamW's single-kernel update where megatron-core falls back to torch (no TE/apex
    # FusedAdam); false = torch's multi-pass foreach update.
    fused_adam: bool = True


@dataclass
class DataConfig:
    # A Megatron-style blend: [prefix] or [w1, prefix1, w2, prefix2, ...] (weights need not sum to 1).
    blend: Optional[list[Any]] = None
    # Per-split blends override `blend` + `split` (each in the same form as `blend`).
    train_blend: Optional[list[Any]] = None
    valid_blend: Optional[list[Any]] = None
    test_blend: Optional[list[Any]] = None
    split: str = "98,2,0"
    tokenizer_model: Optional[str] = None  # a sentencepiece .model or a Hugging Face tokenizer directory
    tokenizer_type: Optional[str] = None  # GPTSentencePieceTokenizer | HuggingFaceTokenizer; None = from the path
    mock: bool = False  # random tokens (megatron-core MockGPTDataset): benchmarks and smoke tests
    num_workers: int = 0
    path_to_cache: Optional[str] = None


# How the distributed optimizer's state is written: megatron-core's formats (DistributedOptimizer.sharded_state_dict).
# fully_reshardable: each TP×PP shard's state all-gathered over DP into every rank's host memory, loadable under any
# layout; *_mem_efficient: the same files, gathered over gloo onto DP rank 0 only; dp_reshardable: each rank writes
# its own slice, no gather, loadable under another DP size only. auto: dp_reshardable, but the checkpoint at
# train.train_iters (the finished run, the one handed on) fully_reshardable_mem_efficient. Measured in
# docs/performance.md ("Checkpoint format"). (megatron-core's fourth, fully_sharded_model_space, fails to save in
# 0.16.1: "ShardedTensor.flattened_range is not supported".)
OPTIMIZER_FORMATS = ("auto", "dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None  # resume: model, optimizer, scheduler, RNG, consumed samples
    pretrained_checkpoint: Optional[str] = None  # weights only, start at iteration 0
    save_interval: Optional[int] = None  # None = only at the end
    keep_last: Optional[int] = None  # delete older complete checkpoints beyond the newest N (None = keep all)
    keep_every: Optional[int] = None  # with keep_last: also keep every iteration that is a multiple of this
    # Write in the background (megatron-core's async dist_checkpointing). None = on GPUs, where it cut the
    # 1.2B recipe's stall per 17 GB save from 30-40 s to 0.5 s on an H100; off in CPU rehearsal.
    async_save: Optional[bool] = None
    # The distributed optimizer's state in megatron-core's format of this name (see OPTIMIZER_FORMATS).
    optimizer_format: str = "auto"


@dataclass
class LoggingConfig:
    tensorboard_dir: Optional[str] = None
    log_interval: int = 1
    gpu_peak_tflops: Optional[float] = None  # overrides the built-in table for MFU
    log_dir: Optional[str] = None  # per-rank tracebacks and hang stacks (rank-N.log); None = runs/<recipe.name>/logs
    loss_spike_factor: Optional[float] = 1.5  # warn when a loss exceeds this × the rolling median; null = off
    loss_spike_window: int = 50  # steps in that median
    straggler_factor: Optional[float] = 1.2  # warn about a rank computing this × slower than the others; null = off
    straggler_intervals: int = 3  # ... for this many log intervals in a row


@dataclass
class RecipeConfig:
    recipe: RecipeMeta = field(default_factory=RecipeMeta)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _yaml_line(path: Path, dotted_key: str) -> Optional[int]:
    """1-based line of `dotted_key` in a YAML file, so errors can point at it."""
    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return None
    for part in dotted_key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        for key_node, value_node in node.value:
            if key_node.value == part:
                node = value_node
                break
        else:
            return None
    return node.start_mark.line + 1


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RecipeConfig:
    """YAML file (optional) merged over the defaults, then `section.key=value` overrides."""
    merged = OmegaConf.structured(RecipeConfig)
    path = Path(path) if path is not None else None
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            from_file = OmegaConf.load(path)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        try:
            merged = OmegaConf.merge(merged, from_file)
        except OmegaConfBaseException as e:
            line = _yaml_line(path, e.full_key) if e.full_key else None
            where = f"{path}:{line}" if line else str(path)
            raise ConfigError(f"{where}: {e.full_key}: {e.msg}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {item!r}: {e.full_key or item}: {e.msg}") from None
    return OmegaConf.to_object(merged)


def default_ffn_hidden_size(hidden_size: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * hidden_size / 3) / 256)


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's rule: the embedding rows are a multiple of make_divisible_by × TP."""
    multiple = make_divisible_by * tensor_parallel_size
    return multiple * math.ceil(vocab_size / multiple)


def data_parallel_size(cfg: RecipeConfig, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )


def _require(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {valid}")


def validate(cfg: RecipeConfig, world_size: int, te_available: bool = False, fp8_capable: bool = False) -> None:
    """Every check: the model shape and 4D layout for `world_size` processes, then the data files."""
    validate_layout(cfg, world_size, te_available, fp8_capable)
    _validate_checkpoint(cfg)
    _validate_monitoring(cfg)
    _validate_data(cfg)


def _validate_checkpoint(cfg: RecipeConfig) -> None:
    c = cfg.checkpoint
    for key in ("save_interval", "keep_last", "keep_every"):
        value = getattr(c, key)
        _require(value is None or value >= 1, f"checkpoint.{key}", value, "must be a positive integer or null")
    _require(c.keep_every is None or c.keep_last is not None, "checkpoint.keep_every", c.keep_every,
             "only applies with checkpoint.keep_last (without it every checkpoint is kept)")
    _require(c.optimizer_format in OPTIMIZER_FORMATS, "checkpoint.optimizer_format", c.optimizer_format,
             f"must be one of {', '.join(OPTIMIZER_FORMATS)}")


def _validate_monitoring(cfg: RecipeConfig) -> None:
    t, g = cfg.train, cfg.logging
    collective_timeout_s = cfg.parallel.distributed_timeout_minutes * 60
    _require(t.hang_timeout_s is None or 0 < t.hang_timeout_s < collective_timeout_s, "train.hang_timeout_s",
             t.hang_timeout_s, f"must be null (off) or between 0 and parallel.distributed_timeout_minutes × 60 = "
             f"{collective_timeout_s} s, so that the watchdog names the hung rank before the collectives time out")
    _require(t.skip_nonfinite_steps >= 0, "train.skip_nonfinite_steps", t.skip_nonfinite_steps, "must be >= 0")
    for key in ("loss_spike_factor", "straggler_factor"):
        value = getattr(g, key)
        _require(value is None or value > 1, f"logging.{key}", value, "must be above 1, or null (off)")
    _require(g.loss_spike_window >= 5, "logging.loss_spike_window", g.loss_spike_window, "must be >= 5")
    _require(g.straggler_intervals >= 1, "logging.straggler_intervals", g.straggler_intervals, "must be >= 1")


def log_dir(cfg: RecipeConfig) -> str:
    """Where each rank writes its tracebacks and hang stacks."""
    return cfg.logging.log_dir or f"runs/{cfg.recipe.name}/logs"


def validate_layout(cfg: RecipeConfig, world_size: int, te_available: bool = False,
                    fp8_capable: bool = False) -> None:
    """Cross-field checks of the model shape and the 4D layout for `world_size` processes.

    `te_available`: TransformerEngine imports; `fp8_capable`: this GPU has FP8 tensor cores (sm89+).
    """
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size
    for key, value in [
        ("parallel.tensor_model_parallel_size", tp),
        ("parallel.pipeline_model_parallel_size", pp),
        ("parallel.context_parallel_size", cp),
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.seq_length", m.seq_length),
        ("train.global_batch_size", t.global_batch_size),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.eval_interval", t.eval_interval),
        ("logging.log_interval", cfg.logging.log_interval),
    ]:
        _require(value >= 1, key, value, "must be a positive integer")
    _require(t.train_iters >= 0, "train.train_iters", t.train_iters, "must be >= 0")
    _require(t.eval_iters >= 0, "train.eval_iters", t.eval_iters, "must be >= 0")

    model_parallel = tp * pp * cp
    _require(
        world_size % model_parallel == 0,
        "world size (processes started)",
        world_size,
        f"must be a multiple of parallel.tensor_model_parallel_size × pipeline_model_parallel_size × "
        f"context_parallel_size = {tp}×{pp}×{cp} = {model_parallel} (DP = world size / {model_parallel}); "
        f"valid world sizes: {model_parallel}, {2 * model_parallel}, {4 * model_parallel}, ...",
    )
    dp = world_size // model_parallel

    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    _require(
        m.hidden_size % heads == 0 or m.kv_channels is not None,
        "model.hidden_size",
        m.hidden_size,
        f"must be divisible by model.num_attention_heads={heads} (or set model.kv_channels)",
    )
    _require(
        heads % groups == 0,
        "model.num_query_groups",
        groups,
        f"must divide model.num_attention_heads={heads}",
    )
    _require(
        heads % tp == 0,
        "model.num_attention_heads",
        heads,
        f"must be divisible by parallel.tensor_model_parallel_size={tp}",
    )
    _require(
        groups % tp == 0,
        "model.num_query_groups",
        groups,
        f"must be divisible by parallel.tensor_model_parallel_size={tp} "
        f"(valid TP sizes: {[d for d in range(1, groups + 1) if groups % d == 0 and heads % d == 0]})",
    )
    ffn = m.ffn_hidden_size or default_ffn_hidden_size(m.hidden_size)
    _require(
        ffn % tp == 0,
        "model.ffn_hidden_size",
        ffn,
        f"must be divisible by parallel.tensor_model_parallel_size={tp}",
    )
    _require(
        m.attention_backend in ("auto", "te", "local"),
        "model.attention_backend",
        m.attention_backend,
        "one of auto, te, local",
    )
    _require(
        m.attention_backend != "te" or te_available,
        "model.attention_backend",
        m.attention_backend,
        "TransformerEngine is not importable here; use auto or local",
    )

    _validate_pipeline(cfg)

    if p.sequence_parallel:
        _require(tp > 1, "parallel.sequence_parallel", True, "needs tensor_model_parallel_size > 1")
    if cp > 1:
        _require(
            m.seq_length % (2 * cp) == 0,
            "model.seq_length",
            m.seq_length,
            f"must be divisible by 2×context_parallel_size={2 * cp} "
            "(the load-balanced causal split cuts the sequence into 2×CP chunks)",
        )
    if p.sequence_parallel:
        _require(
            (m.seq_length // cp) % tp == 0,
            "model.seq_length",
            m.seq_length,
            f"with sequence_parallel the per-CP-rank length seq_length/CP must be divisible by TP={tp}",
        )

    per_step = t.micro_batch_size * dp
    _require(
        t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        t.global_batch_size,
        f"must be a multiple of micro_batch_size×DP = {t.micro_batch_size}×{dp} = {per_step}",
    )
    if vpp is not None and pp > 1:
        microbatches = t.global_batch_size // per_step
        _require(
            microbatches % pp == 0,
            "train.global_batch_size",
            t.global_batch_size,
            f"the interleaved schedule needs the number of microbatches ({microbatches}) to be a "
            f"multiple of pipeline_model_parallel_size={pp}",
        )
    _validate_precision(cfg, te_available, fp8_capable)
    _validate_kernels(cfg, te_available)
    _require(
        t.recompute_granularity in (None, "selective", "full"),
        "train.recompute_granularity",
        t.recompute_granularity,
        "one of null, selective, full",
    )
    _require(o.lr_decay_iters is None or o.lr_decay_iters > o.lr_warmup_iters, "optimizer.lr_decay_iters",
             o.lr_decay_iters, f"must exceed optimizer.lr_warmup_iters={o.lr_warmup_iters}")
    _require(o.lr >= o.min_lr >= 0, "optimizer.min_lr", o.min_lr, f"must be in [0, optimizer.lr={o.lr}]")
    _require(
        o.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
        "optimizer.lr_decay_style",
        o.lr_decay_style,
        "one of constant, linear, cosine, inverse-square-root, WSD",
    )
    _require(p.overlap_param_gather is False or p.use_distributed_optimizer,
             "parallel.overlap_param_gather", True, "needs parallel.use_distributed_optimizer=true")


def _validate_precision(cfg: RecipeConfig, te_available: bool, fp8_capable: bool) -> None:
    """train.precision / fp8 against the layer spec this machine builds."""
    m, t = cfg.model, cfg.train
    _require(t.precision in ("fp32", "bf16"), "train.precision", t.precision, "one of fp32, bf16")
    if t.fp8 is not None:
        _require(t.fp8 in ("delayed", "tensorwise"), "train.fp8", t.fp8, "one of null, delayed, tensorwise")
        _require(te_available, "train.fp8", t.fp8, "FP8 runs through TransformerEngine, which is not importable "
                 "here (use the NGC container, see docs/docker.md) — or set train.fp8=null")
        # Local layers ignore TE's fp8_autocast: the run would train in BF16 without a word.
        _require(m.attention_backend != "local", "train.fp8", t.fp8,
                 "FP8 runs only in TransformerEngine's layers, and model.attention_backend=local (also what "
                 "train.compile needs) builds megatron-core's local layers — set model.attention_backend=auto "
                 "and train.compile=false, or train.fp8=null")
        _require(fp8_capable, "train.fp8", t.fp8, "needs a GPU with FP8 tensor cores (compute capability 8.9+: "
                 "Ada, Hopper, Blackwell) — or set train.fp8=null")
        _require(t.precision == "bf16", "train.precision", t.precision, "FP8 training needs train.precision=bf16")


def _validate_kernels(cfg: RecipeConfig, te_available: bool) -> None:
    """Fused kernels, compile and CUDA graphs against precision, layout and the layer spec (the machine-dependent
    rules are in resolve_kernel_options)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    for key in ("fused_cross_entropy", "compile"):
        _require(getattr(t, key) in (True, False, AUTO), f"train.{key}", getattr(t, key), "one of true, false, auto")
    # megatron-core 0.16.1's native fused cross-entropy casts the logit gradient to bf16
    # unconditionally: in an fp32 run it would silently round every gradient through bf16.
    _require(t.fused_cross_entropy is not True or t.precision == "bf16", "train.fused_cross_entropy", True,
             "needs train.precision=bf16 (megatron-core's fused kernel returns bf16 logit gradients)")
    if t.fused_linear_cross_entropy:
        _require(p.tensor_model_parallel_size == 1, "train.fused_linear_cross_entropy", True,
                 "needs the whole vocabulary on each rank (liger-kernel's kernel has no vocab-parallel form): set "
                 "parallel.tensor_model_parallel_size=1, or use train.fused_cross_entropy with tensor parallelism")
        _require(t.fused_cross_entropy is not True, "train.fused_cross_entropy", True,
                 "replaced by train.fused_linear_cross_entropy=true, which computes the loss itself: set one")
    _require(t.compile is not True or m.attention_backend == "local" or not te_available, "train.compile", True,
             "compiles megatron-core's local layers; TransformerEngine layers bring their own fused "
             "kernels — set model.attention_backend=local to compile, or train.compile=false")
    if t.cuda_graphs:
        # Each a combination megatron-core refuses (full recompute) or that no GPU run here has verified yet.
        for ok, key, value, why in [
            (t.compile is not True, "train.compile", True, "train.cuda_graphs captures eager layers; compiled layers "
             "under CUDA graphs are unverified — set train.compile=false (or auto) or train.cuda_graphs=false"),
            (t.recompute_granularity != "full", "train.recompute_granularity", "full", "megatron-core captures "
             "no layer graphs under full recompute — use selective or null with train.cuda_graphs"),
            (p.pipeline_model_parallel_size == 1, "parallel.pipeline_model_parallel_size",
             p.pipeline_model_parallel_size, "train.cuda_graphs keeps one graph per micro batch in flight under "
             "pipelining, which eval's different micro-batch count breaks; use it with pipeline size 1"),
        ]:
            _require(ok, key, value, why)


def resolve_kernel_options(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> RecipeConfig:
    """`cfg` with train.compile / train.fused_cross_entropy `auto` decided for this machine and layer spec:
    compile on for local layers on a GPU (off under CUDA graphs), fused cross-entropy on in bf16 (off where the
    fused linear cross-entropy computes the loss) (docs/performance.md). Raises ConfigError for kernels this
    machine or spec cannot run."""
    t = cfg.train
    if t.liger_kernels:
        _require(not use_te, "train.liger_kernels", True, "replaces megatron-core's local layers "
                 "only; with TransformerEngine set model.attention_backend=local to use it")
        _require_liger("train.liger_kernels", on_gpu, "liger_kernel.megatron")
    if t.fused_linear_cross_entropy:
        _require_liger("train.fused_linear_cross_entropy", on_gpu, "liger_kernel.transformers.functional")
    if t.cuda_graphs:
        _require(on_gpu, "train.cuda_graphs", True, "CUDA graphs need a GPU; a CPU rehearsal runs the same layers "
                 "eagerly — set train.cuda_graphs=false there")
        _require(not use_te, "train.cuda_graphs", True, "captures megatron-core's local layers; TransformerEngine's "
                 "graphs (cuda_graph_impl=transformer_engine) are not wired here — set model.attention_backend=local")
    compile_ = (on_gpu and not use_te and not t.cuda_graphs) if t.compile == AUTO else t.compile
    fused_ce = (t.precision == "bf16" and not t.fused_linear_cross_entropy if t.fused_cross_entropy == AUTO
                else t.fused_cross_entropy)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, compile=compile_, fused_cross_entropy=fused_ce))


def _require_liger(key: str, on_gpu: bool, module: str) -> None:
    """liger-kernel's Triton kernels run here: a GPU, and the package's `module` imports."""
    _require(on_gpu, key, True, "liger-kernel's kernels are Triton and need a GPU; a CPU rehearsal runs "
             "megatron-core's own (the numerics differ slightly, so nothing is swapped silently)")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}=True needs liger-kernel: pip install liger-kernel==0.8.5 ({e})")


def _validate_pipeline(cfg: RecipeConfig) -> None:
    m, p = cfg.model, cfg.parallel
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if vpp is not None:
        _require(vpp >= 1, "parallel.virtual_pipeline_model_parallel_size", vpp, "must be >= 1 or null")
        _require(
            pp > 1,
            "parallel.virtual_pipeline_model_parallel_size",
            vpp,
            "needs pipeline_model_parallel_size > 1",
        )
    if first is not None or last is not None:
        # megatron-core 0.16.1 divides by zero (transformer_layer.py) if both are set at PP=2.
        _require(
            pp > 2 or first is None or last is None,
            "parallel.num_layers_in_last_pipeline_stage",
            last,
            "set only one of num_layers_in_first/last_pipeline_stage when pipeline_model_parallel_size=2",
        )
        _require(vpp is None, "parallel.virtual_pipeline_model_parallel_size", vpp,
                 "uneven pipeline stages are not combined with virtual stages here")
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        _require(
            middle_layers >= 0 and (middle_stages == 0 and middle_layers == 0
                                    or middle_stages > 0 and middle_layers % middle_stages == 0),
            "model.num_layers",
            m.num_layers,
            f"after the first/last stage overrides ({first}/{last}) the remaining {middle_layers} "
            f"layers must divide evenly over the other {middle_stages} pipeline stages",
        )
        return
    chunks = pp * (vpp or 1)
    _require(
        m.num_layers % chunks == 0,
        "model.num_layers",
        m.num_layers,
        f"must be divisible by pipeline_model_parallel_size×virtual_pipeline_model_parallel_size="
        f"{chunks}, or set parallel.num_layers_in_first_pipeline_stage/last for an uneven split",
    )


def parse_blend(blend: Optional[list[Any]], key: str) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """Megatron's [w1, p1, w2, p2] or [p1, p2] list → (prefixes, weights) as megatron-core wants it."""
    if not blend:
        return None
    items = list(blend)
    if all(isinstance(x, str) for x in items):
        return items, None
    if len(items) % 2 or not all(
        isinstance(w, (int, float)) and isinstance(pfx, str) for w, pfx in zip(items[::2], items[1::2])
    ):
        raise ConfigError(
            f"{key}={items!r} is invalid: use [prefix, ...] or [weight1, prefix1, weight2, prefix2, ...]"
        )
    weights = [float(w) for w in items[::2]]
    _require(all(w > 0 for w in weights), key, items, "every weight must be > 0")
    return list(items[1::2]), weights


def _validate_data(cfg: RecipeConfig) -> None:
    d = cfg.data
    if d.mock:
        _require(cfg.model.vocab_size is not None, "model.vocab_size", None,
                 "data.mock=true needs an explicit vocabulary size")
        return
    has_split_blends = any(b for b in (d.train_blend, d.valid_blend, d.test_blend))
    _require(bool(d.blend) or has_split_blends, "data.blend", d.blend,
             "give a dataset prefix list (or data.train_blend/valid_blend)")
    for key, prefix in _blend_prefixes(cfg):
        for suffix in (".bin", ".idx"):
            _require(Path(prefix + suffix).is_file(), key, prefix,
                     f"{prefix}{suffix} does not exist (a prefix names PREFIX.bin + PREFIX.idx)")
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    _require(len(parts) == 3 and all(x >= 0 for x in parts) and sum(parts) > 0, "data.split", d.split,
             "three non-negative numbers like 98,2,0 (train,valid,test)")
    from megatron_ext.data.tokenizer import load_tokenizer
    from megatron_ext.errors import TokenizerError

    _require(d.tokenizer_model is not None, "data.tokenizer_model", d.tokenizer_model,
             "a sentencepiece .model file or a Hugging Face tokenizer directory")
    try:
        vocab = load_tokenizer(d.tokenizer_model, d.tokenizer_type).vocab_size
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer_model={d.tokenizer_model!r} is invalid: {e}") from None
    _require(cfg.model.vocab_size is None or cfg.model.vocab_size >= vocab, "model.vocab_size",
             cfg.model.vocab_size, f"must be >= the vocabulary of {d.tokenizer_model} ({vocab}) or null")
    _check_token_ids(cfg, cfg.model.vocab_size or vocab)


def _blend_prefixes(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """(data.KEY, dataset prefix) for every prefix the blends name."""
    pairs = []
    for key in ("blend", "train_blend", "valid_blend", "test_blend"):
        parsed = parse_blend(getattr(cfg.data, key), f"data.{key}")
        pairs += [(f"data.{key}", prefix) for prefix in (parsed[0] if parsed else [])]
    return pairs


def _check_token_ids(cfg: RecipeConfig, vocab: int) -> None:
    """Every token id in the data below the model's vocabulary: data written with another tokenizer is one error
    here, not a device-side assert in the embedding or a silently wrong run. One pass over every .bin, by the
    first process of each node only (the others would read the same pages again)."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.datasets import max_token_id

    d = cfg.data
    for key, prefix in _blend_prefixes(cfg):
        top = max_token_id(IndexedDataset(prefix))
        _require(top < vocab, key, prefix,
                 f"{prefix}.bin holds token id {top}, but the model's vocabulary is {vocab} "
                 f"(data.tokenizer_model={d.tokenizer_model}): the data was written with another tokenizer — "
                 "preprocess it with this one, or point data.tokenizer_model at the one that wrote it")
