"""train.cuda_graph_impl and train.cuda_graph_modules: what megatron-core 0.19.2 refuses for each implementation
(``TransformerConfig.__post_init__``, its per-layer and full-iteration capture code), and what this loop has not
verified under graphs. Each broken rule is one ConfigError naming the key and what to do, before any process starts;
the machine's part (a GPU, the layer spec the graphs capture) is :func:`refuse_graphs_this_machine_cannot_run`'s, which
:mod:`megatron_ext.config.kernels` calls."""

from __future__ import annotations

from typing import Mapping

from megatron_ext.config.schema import RecipeConfig, recomputed_modules
from megatron_ext.config.shape import moe_layer_pattern
from megatron_ext.errors import require

PER_LAYER = ("local", "transformer_engine")  # graphs of each decoder layer (of cuda_graph_modules' regions)
MOE_MODULES = ("moe", "moe_router", "moe_preprocess")  # the regions of an MoE layer


def uses_cuda_graphs(cfg: RecipeConfig) -> bool:
    return cfg.train.cuda_graph_impl != "none"


def validate_cuda_graphs(cfg: RecipeConfig) -> None:
    """train.cuda_graph_impl/cuda_graph_modules against the model, the layout and the other switches."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    impl, modules = t.cuda_graph_impl, list(t.cuda_graph_modules)
    if impl == "none":
        require(not modules, "train.cuda_graph_modules", modules, "chooses what per-layer CUDA graphs capture: set "
                "train.cuda_graph_impl=local or transformer_engine, or leave it []")
        return
    key, dropout = "train.cuda_graph_impl", m.hidden_dropout or m.attention_dropout
    for ok, name, value, why in [
        (t.compile is not True, "train.compile", True, f"{key}={impl} captures eager layers; compiled layers under "
         "CUDA graphs are unverified — set train.compile=false (or auto) or train.cuda_graph_impl=none"),
        (not cfg.data.reset_attention_mask, key, impl, "captures one attention pattern, and data.reset_attention_mask "
         "changes it with every micro batch: set one of them off"),
        (p.pipeline_model_parallel_size == 1, "parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size,
         f"{key}={impl} keeps graphs per micro batch in flight under pipelining, which evaluation's other micro-batch "
         "count breaks (megatron-core's TE capture counts them from its micro-batch calculator, set for training): use "
         "pipeline size 1"),
        (not t.offload_modules, "train.offload_modules", list(t.offload_modules), "activation offload inside "
         "captured CUDA graphs is not verified here: use one of train.cuda_graph_impl and train.offload_modules"),
        (t.rerun_mode == "disabled" or not dropout, "train.rerun_mode", t.rerun_mode, "a re-run restores the random "
         "streams it saved, and the graph-safe ones of CUDA graphs are saved by reference, so a re-run would draw "
         "other dropout masks: set the dropouts to 0 or train.rerun_mode=disabled"),
        (t.cpu_offloading_num_layers == 0 or impl == "full_iteration", "train.cpu_offloading_num_layers",
         t.cpu_offloading_num_layers, f"megatron-core's layer offload does not run inside per-layer CUDA graphs "
         f"({key}={impl}; megatron-core's rule): set it 0, or train.cuda_graph_impl=full_iteration"),
    ]:
        require(ok, name, value, why)
    if impl == "full_iteration":
        _validate_full_iteration(cfg)
    else:
        _validate_per_layer(cfg)


def _validate_full_iteration(cfg: RecipeConfig) -> None:
    """One graph of a step's whole forward-backward schedule (megatron-core's FullCudaGraphWrapper)."""
    m, t = cfg.model, cfg.train
    for ok, name, value, why in [
        (not t.cuda_graph_modules, "train.cuda_graph_modules", list(t.cuda_graph_modules), "must be [] with "
         "train.cuda_graph_impl=full_iteration, which captures the whole schedule (megatron-core's rule)"),
        (not cfg.logging.step_breakdown, "logging.step_breakdown", True, "times megatron-core's regions inside the "
         "schedule, which a full-iteration graph runs once, at its capture (its replays time nothing): set it false "
         "with train.cuda_graph_impl=full_iteration"),
        (not cfg.data.reset_position_ids, "data.reset_position_ids", True, "restarts RoPE at documents from the "
         "largest position read on the host each micro batch, which a captured step cannot do: set it false, or "
         "train.cuda_graph_impl=local (per-layer graphs)"),
        (m.num_moe_experts is None or (m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity),
         "model.moe_pad_expert_input_to_capacity", m.moe_pad_expert_input_to_capacity, "a dropless MoE layer's token "
         "dispatcher reads its token counts on the host, which a captured step cannot: set "
         "model.moe_expert_capacity_factor and model.moe_pad_expert_input_to_capacity=true (static shapes) with "
         "train.cuda_graph_impl=full_iteration"),
    ]:
        require(ok, name, value, why)


def _validate_per_layer(cfg: RecipeConfig) -> None:
    """Graphs of each decoder layer (local: megatron-core's own; transformer_engine: TE's make_graphed_callables),
    as megatron-core 0.19.2's TransformerConfig checks their capture regions."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    impl, modules = t.cuda_graph_impl, list(t.cuda_graph_modules)
    key, moe = "train.cuda_graph_modules", m.num_moe_experts is not None
    pattern = moe_layer_pattern(m.moe_layer_freq, m.num_layers) if moe else ()
    recomputed = recomputed_modules(cfg)
    whole_layer = not modules
    for ok, name, value, why in [
        (len(set(modules)) == len(modules), key, modules, "names a module twice"),
        (moe or not set(modules) & set(MOE_MODULES), key, modules, "moe, moe_router and moe_preprocess capture parts "
         "of MoE layers, and this model has none (model.num_moe_experts=null)"),
        (not {"moe", "moe_router"} <= set(modules), key, modules, "must not hold both moe and moe_router (moe "
         "captures the whole MoE layer, moe_router a part of it; megatron-core's rule)"),
        ("moe_preprocess" not in modules or "moe_router" in modules, key, modules, "moe_preprocess is captured with "
         "the router: add moe_router (megatron-core's rule)"),
        ("mlp" not in modules or not pattern or 0 in pattern, key, modules, "mlp captures dense MLPs, and every "
         "layer of this model is an MoE layer: use moe or moe_router"),
        ("moe" not in modules or (m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity),
         key, modules, "moe captures whole MoE layers, which needs static shapes: set model.moe_expert_capacity_factor "
         "and model.moe_pad_expert_input_to_capacity=true (megatron-core's rule), or use moe_router"),
        ("moe_preprocess" not in modules or m.moe_pad_expert_input_to_capacity or m.moe_token_dispatcher_type !=
         "alltoall" or m.moe_expert_capacity_factor is None, key, modules, "moe_preprocess cannot be captured with "
         "the alltoall dispatcher and a capacity factor: its preprocess copies token counts to the host (megatron-core's "
         "rule) — drop it, or set model.moe_pad_expert_input_to_capacity=true"),
        (t.recompute_granularity != "full", "train.recompute_granularity", "full", f"megatron-core captures no layer "
         f"graphs under full recompute (train.cuda_graph_impl={impl}): use selective or null, or "
         "train.cuda_graph_impl=full_iteration"),
        (impl != "transformer_engine" or "moe" not in recomputed or "moe_router" not in modules,
         "train.recompute_modules", list(t.recompute_modules), "moe recompute covers the router that "
         "train.cuda_graph_modules' moe_router captures with TransformerEngine's graphs (megatron-core's rule): drop "
         "one of them"),
        # a graphed region's recompute cannot redraw its dropout masks (megatron-core's rules)
        (not m.attention_dropout or "core_attn" not in recomputed or (not whole_layer and "attn" not in modules),
         "model.attention_dropout", m.attention_dropout, "attention dropout does not run in a recomputed core "
         "attention inside a CUDA graph (megatron-core's rule): set it 0, leave attention out of "
         "train.cuda_graph_modules, or leave core_attn out of train.recompute_modules"),
        (not m.hidden_dropout or all((not whole_layer and part not in modules) or part not in recomputed
                                     for part in ("mlp", "moe")), "model.hidden_dropout", m.hidden_dropout,
         "hidden dropout does not run in a recomputed MLP or MoE layer inside a CUDA graph (megatron-core's rule): set "
         "it 0, leave mlp/moe out of train.cuda_graph_modules or out of train.recompute_modules"),
        # megatron-core's TE capture under the overlapped all-to-alls captures every micro batch, counted by its global
        # micro-batch calculator (training/micro_batch.py sets it), and refuses whole-layer or mlp/moe graphs
        (not p.overlap_moe_expert_parallel_comm, "parallel.overlap_moe_expert_parallel_comm", True, "per-layer CUDA "
         f"graphs (train.cuda_graph_impl={impl}) with the overlapped expert all-to-alls are not wired here: use "
         "train.cuda_graph_impl=full_iteration or none"),
    ]:
        require(ok, name, value, why)


def refuse_graphs_this_machine_cannot_run(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> None:
    """CUDA graphs against this machine: a GPU, and the layer spec each per-layer implementation captures (`use_te`:
    this run builds TransformerEngine's layers)."""
    impl = cfg.train.cuda_graph_impl
    if impl == "none":
        return
    key = "train.cuda_graph_impl"
    require(on_gpu, key, impl, "CUDA graphs need a GPU; a CPU rehearsal runs the same layers eagerly — set "
            "train.cuda_graph_impl=none there")
    require(impl != "local" or not use_te, key, impl, "captures megatron-core's local layers, and this run builds "
            "TransformerEngine's: set model.attention_backend=local, or train.cuda_graph_impl=transformer_engine")
    require(impl != "transformer_engine" or use_te, key, impl, "captures TransformerEngine's layers (its "
            "make_graphed_callables), and this run builds megatron-core's local layers: TransformerEngine (the NGC "
            "container, docs/docker.md) with model.attention_backend=auto or te, or train.cuda_graph_impl=local")


def refuse_te_graphs_under_expandable_segments(cfg: RecipeConfig, environ: Mapping[str, str]) -> None:
    """megatron-core's TE capture asserts, mid start-up, that PyTorch's expandable segments come with
    NCCL_GRAPH_REGISTER=0 (NCCL's graph buffer registration on them is an illegal memory access): one line before."""
    if cfg.train.cuda_graph_impl != "transformer_engine":
        return
    expandable = "expandable_segments:True" in environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    require(not expandable or environ.get("NCCL_GRAPH_REGISTER") == "0", "train.cuda_graph_impl", "transformer_engine",
            "the environment sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, under which TransformerEngine's "
            "graphs need NCCL_GRAPH_REGISTER=0 (megatron-core's rule: an illegal memory access otherwise) — set "
            "NCCL_GRAPH_REGISTER=0, or drop expandable_segments")
