"""Kernel options against the machine: `auto` resolved for this GPU (or CPU) and layer spec, and the kernels this
machine cannot run refused. The recipe's start-up and the planner both resolve through here."""

from __future__ import annotations

import dataclasses
import importlib

from megatron_ext.config.schema import AUTO, RecipeConfig, TrainConfig
from megatron_ext.config.validate import require, require_packed_sequence_layout
from megatron_ext.errors import ConfigError

FLEX_BLOCK = 128  # FlexAttention's block size: the block mask holds one entry per FLEX_BLOCK² query×key block


def block_mask_bytes(micro_batch_size: int, seq_length: int) -> int:
    """Device bytes of one micro batch's document ids and FlexAttention block mask (int32 block counts and indices,
    for the full and the partial blocks, by query and by key)."""
    blocks = -(-seq_length // FLEX_BLOCK)
    return micro_batch_size * (4 * seq_length + 4 * 4 * (blocks * blocks + blocks))


def uses_transformer_engine(cfg: RecipeConfig, on_gpu: bool, te_available: bool) -> bool:
    """Whether the run builds TransformerEngine's layer spec: model.attention_backend=te, or auto on a GPU where
    TransformerEngine imports; otherwise megatron-core's local layers."""
    backend = cfg.model.attention_backend
    return backend == "te" or (backend == AUTO and on_gpu and te_available)


def refuse_what_this_machine_cannot_run(cfg: RecipeConfig, on_gpu: bool, te_available: bool) -> None:
    """Before any process starts (the launcher) and before any process group exists (each rank): the kernels and the
    offloads `cfg` asks for against this machine — a GPU or CPU rehearsal, TransformerEngine or not. Raises
    ConfigError."""
    resolve_kernel_options(cfg, on_gpu, uses_transformer_engine(cfg, on_gpu, te_available))
    o, t = cfg.optimizer, cfg.train
    if o.optimizer_cpu_offload:
        require(not on_gpu or te_available, "optimizer.optimizer_cpu_offload", True, "megatron-core's offload on a "
                "GPU is not verified here without TransformerEngine: use the NGC container")
        require(on_gpu or o.optimizer_offload_fraction == 1.0, "optimizer.optimizer_offload_fraction",
                o.optimizer_offload_fraction, "in CPU rehearsal only 1.0 (all of the state on the host) rehearses "
                "faithfully without a GPU")
    require(not (t.offload_modules and on_gpu and not te_available), "train.offload_modules",
            list(t.offload_modules), "megatron-core's activation offload needs TransformerEngine on a GPU (the NGC "
            "container) — or set train.offload_modules=[]")


def resolve_kernel_options(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> RecipeConfig:
    """`cfg` with model.attention_backend, model.moe_grouped_gemm, train.compile and train.fused_cross_entropy
    `auto` decided for this machine and layer spec (`use_te`: :func:`uses_transformer_engine`): the backend te or
    local, the experts' grouped GEMM where TE's layers are built, compile on for local layers on a GPU (off under
    CUDA graphs), fused cross-entropy on in bf16 (off where the fused linear cross-entropy computes the loss)
    (docs/performance.md). Raises ConfigError for kernels this machine or spec cannot run."""
    t = cfg.train
    if use_te and cfg.data.reset_attention_mask:
        require_packed_sequence_layout(cfg, "TransformerEngine imports here, so model.attention_backend=auto builds "
                                            "its layers")
    if t.liger_kernels:
        require(not use_te, "train.liger_kernels", True, "replaces megatron-core's local layers "
                "only; with TransformerEngine set model.attention_backend=local to use it")
        _require_liger("train.liger_kernels", on_gpu, "liger_kernel.megatron")
    if t.fused_linear_cross_entropy:
        _require_liger("train.fused_linear_cross_entropy", on_gpu, "liger_kernel.transformers.functional")
    if t.cuda_graphs:
        require(on_gpu, "train.cuda_graphs", True, "CUDA graphs need a GPU; a CPU rehearsal runs the same layers "
                "eagerly — set train.cuda_graphs=false there")
        require(not use_te, "train.cuda_graphs", True, "captures megatron-core's local layers; TransformerEngine's "
                "graphs (cuda_graph_impl=transformer_engine) are not wired here — set model.attention_backend=local")
    m = cfg.model
    require(m.moe_grouped_gemm is not True or use_te, "model.moe_grouped_gemm", True, "the grouped GEMM is "
            "TransformerEngine's (TEGroupedMLP), and this machine builds megatron-core's local layers: set it auto")
    grouped_gemm = use_te and m.num_moe_experts is not None if m.moe_grouped_gemm == AUTO else m.moe_grouped_gemm
    compile_ = compiles_layers(t, on_gpu, use_te)
    fused_ce = (t.precision == "bf16" and not t.fused_linear_cross_entropy if t.fused_cross_entropy == AUTO
                else t.fused_cross_entropy)
    model = dataclasses.replace(m, attention_backend="te" if use_te else "local", moe_grouped_gemm=grouped_gemm)
    return dataclasses.replace(cfg, model=model,
                               train=dataclasses.replace(t, compile=compile_, fused_cross_entropy=fused_ce))


def _require_liger(key: str, on_gpu: bool, module: str) -> None:
    """liger-kernel's Triton kernels run here: a GPU, and the package's `module` imports."""
    require(on_gpu, key, True, "liger-kernel's kernels are Triton and need a GPU; a CPU rehearsal runs "
            "megatron-core's own (the numerics differ slightly, so nothing is swapped silently)")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}=True needs liger-kernel: pip install liger-kernel==0.8.5 ({e})")


def compiles_layers(train: TrainConfig, on_gpu: bool, use_te: bool) -> bool:
    """train.compile for this machine: `auto` compiles megatron-core's local layers on a GPU, never
    TransformerEngine's (they bring their own fused kernels) nor layers captured in CUDA graphs."""
    return (on_gpu and not use_te and not train.cuda_graphs) if train.compile == AUTO else train.compile
