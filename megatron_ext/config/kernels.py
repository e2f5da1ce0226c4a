"""Kernel options against the machine: `auto` resolved for this GPU (or CPU) and layer spec, and the kernels this
machine cannot run refused. The recipe's start-up and the planner both resolve through here."""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Mapping

from megatron_ext.config.cuda_graph_rules import (
    refuse_graphs_this_machine_cannot_run,
    refuse_te_graphs_under_expandable_segments,
    uses_cuda_graphs,
)
from megatron_ext.config.schema import AUTO, RecipeConfig
from megatron_ext.config.validate import require_packed_sequence_layout
from megatron_ext.errors import ConfigError, require

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
    use_te = uses_transformer_engine(cfg, on_gpu, te_available)
    resolve_kernel_options(cfg, on_gpu, use_te)
    if use_te:
        refuse_conflicting_te_attention_variables(cfg.model.te_attention_kernel, os.environ)
        refuse_te_graphs_under_expandable_segments(cfg, os.environ)
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


# The NVTE_*_ATTN values megatron-core sets for each model.te_attention_kernel (and asserts on, mid start-up, when
# the environment already holds others)
TE_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
TE_ATTENTION_VALUES: dict[str, tuple[str, str, str]] = {
    "auto": ("1", "1", "1"), "flash": ("1", "0", "0"), "fused": ("0", "1", "0"), "unfused": ("0", "0", "1")}


def refuse_conflicting_te_attention_variables(kernel: str, environ: Mapping[str, str]) -> None:
    """TE's usual switches (NVTE_FUSED_ATTN=0 ...) in the environment against model.te_attention_kernel: one line
    naming the key value that means the same, before megatron-core's assertion inside the model build."""
    def agrees(values: tuple[str, str, str]) -> bool:
        return all(environ.get(name) in (None, value) for name, value in zip(TE_ATTENTION_VARIABLES, values))

    if agrees(TE_ATTENTION_VALUES[kernel]):
        return
    set_ = " ".join(f"{name}={environ[name]}" for name in TE_ATTENTION_VARIABLES if name in environ)
    meaning = [k for k, values in TE_ATTENTION_VALUES.items() if agrees(values)]
    raise ConfigError(f"model.te_attention_kernel={kernel} is invalid: the environment sets {set_}, which "
                      f"megatron-core refuses with it — unset the NVTE_*_ATTN variables and set "
                      f"model.te_attention_kernel={' or '.join(meaning) or 'flash, fused or unfused'}")


def resolve_kernel_options(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> RecipeConfig:
    """`cfg` with model.attention_backend, model.moe_grouped_gemm, train.compile and train.fused_cross_entropy
    `auto` decided for this machine and layer spec (`use_te`: :func:`uses_transformer_engine`): the backend te or
    local, the experts' grouped GEMM where TE's layers are built, compile on for local dense layers on a GPU (off
    under CUDA graphs), fused cross-entropy on in bf16 (off where the fused linear cross-entropy computes the loss)
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
    refuse_graphs_this_machine_cannot_run(cfg, on_gpu, use_te)
    _refuse_gpu_only_overlaps(cfg, on_gpu, use_te)
    m = cfg.model
    require(m.te_attention_kernel == AUTO or use_te, "model.te_attention_kernel", m.te_attention_kernel,
            "chooses TransformerEngine's attention kernel, and this run builds megatron-core's local layers: set it "
            "auto")
    require(m.moe_grouped_gemm is not True or use_te, "model.moe_grouped_gemm", True, "the grouped GEMM is "
            "TransformerEngine's (TEGroupedMLP), and this machine builds megatron-core's local layers: set it auto")
    grouped_gemm = use_te and m.num_moe_experts is not None if m.moe_grouped_gemm == AUTO else m.moe_grouped_gemm
    require("moe_act" not in t.recompute_modules or grouped_gemm, "train.recompute_modules", list(t.recompute_modules),
            "moe_act recomputes the experts' activation inside TransformerEngine's grouped GEMM (megatron-core's rule), "
            "and this run builds megatron-core's local experts: drop moe_act, or run with TransformerEngine")
    compile_ = compiles_layers(cfg, on_gpu, use_te)
    fused_ce = (t.precision == "bf16" and not t.fused_linear_cross_entropy if t.fused_cross_entropy == AUTO
                else t.fused_cross_entropy)
    model = dataclasses.replace(m, attention_backend="te" if use_te else "local", moe_grouped_gemm=grouped_gemm)
    return dataclasses.replace(cfg, model=model,
                               train=dataclasses.replace(t, compile=compile_, fused_cross_entropy=fused_ce))


def _refuse_gpu_only_overlaps(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> None:
    """What runs only on GPUs, on CUDA streams or in TransformerEngine's kernels: megatron-core's layer offload, TP
    communication overlap, the overlapped MoE all-to-alls and the flex token dispatcher (DeepEP/HybridEP). A CPU
    rehearsal refuses each in one line rather than rehearse something else."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    te = ("this run builds megatron-core's local layers (TransformerEngine is not importable here, or "
          "model.attention_backend=local): the NGC container (docs/docker.md)")
    if t.cpu_offloading_num_layers:
        key, value = "train.cpu_offloading_num_layers", t.cpu_offloading_num_layers
        require(on_gpu, key, value, "megatron-core's layer offload copies activations to pinned host memory on CUDA "
                f"streams; a CPU rehearsal keeps them where they are — set {key}=0 there")
        require(use_te, key, value, f"is TransformerEngine's CPU-offload context around its layers, and {te}, or "
                f"{key}=0")
    if p.tp_comm_overlap:
        key = "parallel.tp_comm_overlap"
        require(on_gpu, key, True, "TransformerEngine's userbuffers overlap the GEMMs with NVLink copies on GPUs; a "
                f"CPU rehearsal's gloo collectives have nothing to overlap — set {key}=false there")
        require(use_te, key, True, f"runs in TransformerEngine's layers, and {te}, or {key}=false")
    if p.overlap_moe_expert_parallel_comm:
        require(on_gpu, "parallel.overlap_moe_expert_parallel_comm", True, "megatron-core's overlapped schedule runs "
                "the expert all-to-alls on a second CUDA stream; a CPU rehearsal has none — set it false there")
    if m.num_moe_experts is not None and m.moe_token_dispatcher_type == "flex":
        from megatron.core.transformer.moe import fused_a2a  # DeepEP's and HybridEP's kernels, if installed

        backend = m.moe_flex_dispatcher_backend
        require(on_gpu, "model.moe_token_dispatcher_type", "flex", f"{backend}'s fused dispatch kernels need GPUs "
                "(NVLink, RDMA); a CPU rehearsal routes with model.moe_token_dispatcher_type=alltoall — set it there")
        installed, package = ((fused_a2a.HAVE_DEEP_EP, "DeepEP (github.com/deepseek-ai/DeepEP)") if backend == "deepep"
                              else (fused_a2a.HAVE_HYBRIDEP, "HybridEP (DeepEP's hybrid-ep branch)"))
        require(installed, "model.moe_flex_dispatcher_backend", backend, f"{package} is not installed here (its "
                "deep_ep package does not import) — install it, or set model.moe_token_dispatcher_type=alltoall")


def _require_liger(key: str, on_gpu: bool, module: str) -> None:
    """liger-kernel's Triton kernels run here: a GPU, and the package's `module` imports."""
    require(on_gpu, key, True, "liger-kernel's kernels are Triton and need a GPU; a CPU rehearsal runs "
            "megatron-core's own (the numerics differ slightly, so nothing is swapped silently)")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}=True needs liger-kernel: pip install liger-kernel==0.8.5 ({e})")


def compiles_layers(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> bool:
    """train.compile for this machine: `auto` compiles megatron-core's local dense layers on a GPU, never
    TransformerEngine's (they bring their own fused kernels), layers captured in CUDA graphs, nor MoE layers
    (inductor failed on megatron-core's MoE layer, Qwen3-MoE and Mixtral shapes, on an H100 on 2026-11-26:
    docs/measurements/h100-2026-11-26.md)."""
    if cfg.train.compile != AUTO:
        return cfg.train.compile
    return on_gpu and not use_te and not uses_cuda_graphs(cfg) and cfg.model.num_moe_experts is None
