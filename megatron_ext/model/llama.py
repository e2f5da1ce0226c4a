"""The Llama-style decoder: megatron-core GPTModel with RMSNorm, SwiGLU, RoPE, GQA and a chosen layer spec.

Two layer specs: TransformerEngine's when TE imports (the NGC container on GPUs), otherwise
megatron-core's local layers with replacements from this package — a torch SDPA core attention
(flash/memory-efficient kernels on GPU), ring attention for context parallelism
(``cp_attention``), and an RMSNorm that supports sequence parallelism (megatron-core's
torch-norm wrapper refuses SP).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_ext.config.schema import YARN_KEYS, RecipeConfig, recomputed_modules
from megatron_ext.config.shape import ModelShape, moe_layer_pattern, padded_vocab_size
from megatron_ext.model.attention import SDPAttention
from megatron_ext.model.document_mask import restart_rotary_at_documents, uses_packed_sequences
from megatron_ext.model.fused_output import FusedOutput, FusedOutputGPTModel, FusedOutputHybridModel
from megatron_ext.model.hybrid import (
    attention_layers,
    build_hybrid_model,
    is_hybrid,
    layer_fields,
    positions_per_layer,
    stack_spec,
)
from megatron_ext.model.mla import mla_local_layer_spec, mla_transformer_config
from megatron_ext.model.moe import (
    give_biased_experts_their_own_output,
    moe_transformer_config,
    reduce_experts_over_expert_data_parallel,
)
from megatron_ext.model.mtp import hybrid_mtp_block_spec, mtp_block_spec, mtp_transformer_config
from megatron_ext.model.ring_attention import RingAttention


def transformer_engine_available() -> bool:
    """megatron-core's own decision, so the spec chosen here is one megatron-core can build.

    Its TE layer wrappers need ``transformer_engine.pytorch`` (extensions/transformer_engine.py) and its
    GPT specs need those wrappers (gpt_layer_specs.py); a bare ``import transformer_engine`` can succeed
    where both fail (TE's top-level package swallows a broken ``.pytorch``).
    """
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(te_extension.HAVE_TE and gpt_layer_specs.HAVE_TE)


def te_gradient_accumulation_fusion(use_te: bool) -> bool:
    """TE layers accumulate weight gradients straight into megatron's fp32 ``main_grad`` buffers.

    The flag is model-wide: megatron-core's local output layer then needs apex's
    ``fused_weight_gradient_mlp_cuda`` (present in the NGC container) and refuses to build without it.
    """
    from megatron.core.tensor_parallel import layers

    return use_te and layers._grad_accum_fusion_available


def gpu_compute_capability() -> Optional[tuple[int, int]]:
    """This machine's GPU's CUDA compute capability (major, minor), None without a GPU: what config validation checks
    the low-precision recipes against (config/precision.py)."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's constructor and sequence-parallel grad marking.

    With SP the norm sees a different sequence shard on each TP rank, so its weight grad must be
    all-reduced across TP; megatron's finalize_model_grads does that for params marked
    ``sequence_parallel``.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def block_spec(config: TransformerConfig, use_te: bool, vp_stage: Optional[int],
               liger: bool = False) -> TransformerBlockSubmodules:
    """This GPTModel chunk's decoder layers: TE fused layers, or megatron-core local layers with an SP-capable
    RMSNorm (liger-kernel's with `liger`) and SDPA core attention (ring attention when the sequence is split
    across CP ranks); an MoE model's MLPs are megatron-core's MoE layers (one GEMM per expert in local layers) where
    ``moe_layer_freq`` says, dense SwiGLUs elsewhere."""
    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                          vp_stage=vp_stage)
    dense, moe, norm = layer_specs(config, use_te, liger)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers) if config.num_moe_experts else ()
    layers = range(first, first + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[moe if pattern and pattern[i] else dense for i in layers],
                                      layer_norm=norm)


def layer_specs(config: TransformerConfig, use_te: bool, liger: bool = False
                ) -> tuple[ModuleSpec, Optional[ModuleSpec], type]:
    """The model's dense decoder layer spec, its MoE layer spec (None for a dense model) and its norm: TE's fused
    layers and norm, or the local layers of `block_spec`."""
    if use_te:
        shape = dict(qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention)
        dense = get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False, **shape)
        moe = (get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts,
                                                          moe_grouped_gemm=config.moe_grouped_gemm, **shape)
               if config.num_moe_experts else None)
        return dense, moe, gpt_layer_specs.TENorm  # the norm megatron-core's own TE block spec builds
    norm = RMSNorm
    if liger:
        from liger_kernel.megatron import LigerMegatronRMSNorm as norm
    moe = _local_layer_spec(config, norm, True) if config.num_moe_experts else None
    return _local_layer_spec(config, norm, False), moe, norm


def _local_layer_spec(config: TransformerConfig, norm: type, moe: bool) -> ModuleSpec:
    experts = config.num_moe_experts if moe else None
    core_attention = RingAttention if config.context_parallel_size > 1 else SDPAttention
    layer = (mla_local_layer_spec(experts, norm, core_attention) if config.multi_latent_attention
             else _local_gqa_layer_spec(config, norm, experts, core_attention))
    if experts and config.add_bias_linear:
        give_biased_experts_their_own_output(layer)
    return layer


def _local_gqa_layer_spec(config: TransformerConfig, norm: type, experts: Optional[int],
                          core_attention: type) -> ModuleSpec:
    layer = copy.deepcopy(get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm",
                                                   qk_layernorm=config.qk_layernorm))
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    if experts:
        # megatron-core 0.19.2's local spec saves the pre-MLP norm as the dense TE layer's fused norm
        # (mlp.linear_fc1.layer_norm_weight) even before MoE layers, where its TE spec keeps the norm apart
        # (pre_mlp_layernorm.weight): saved under TE's key, a checkpoint moves between the specs (Megatron-LM PR 6270)
        layer.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.")
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = core_attention
    if config.qk_layernorm:  # over each head's channels; megatron-core sums their gradients over TP itself
        attention.q_layernorm = attention.k_layernorm = norm
    return layer


def use_liger_kernels(cross_entropy: bool = True) -> None:
    """liger-kernel's SwiGLU and vocab-parallel cross-entropy, through its own megatron-core adapter (it rebinds
    megatron-core's SwiGLUFunction and both cross-entropy call sites; the RMSNorm goes in by `block_spec`).
    Its SwiGLU replaces the fused path: the config turns bias_activation_fusion on with it. `cross_entropy`
    off where the fused linear cross-entropy computes the loss (the start-up log then names no liger CE)."""
    from liger_kernel.megatron import apply_liger_kernel_to_megatron

    apply_liger_kernel_to_megatron(rms_norm=False, cross_entropy=cross_entropy, swiglu=True)


def _liger_kernels(chunks: list[GPTModel]) -> list[str]:
    """Which liger-kernel pieces the built model runs, read from the model and the patched functions."""
    from megatron.core.fusions import fused_bias_swiglu

    norms = [type(m).__name__ for chunk in chunks for m in chunk.modules()]
    return [name for name, on in [
        ("RMSNorm", "LigerMegatronRMSNorm" in norms),
        ("SwiGLU", getattr(fused_bias_swiglu.SwiGLUFunction, "__liger_patched__", False)),
        ("cross-entropy", getattr(tensor_parallel.vocab_parallel_cross_entropy, "__liger_patched__", False)),
    ] if on]


PARAMETER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # by train.precision
ACTIVATIONS = {"silu": F.silu, "quick_gelu": quick_gelu}  # by model.activation_func: the GLU's gate activation


def transformer_config(cfg: RecipeConfig, on_gpu: bool, use_te: bool) -> TransformerConfig:
    """megatron-core TransformerConfig for a Llama-style decoder under `cfg`'s parallel layout."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dtype = PARAMETER_DTYPES[t.precision]
    vpp = p.virtual_pipeline_model_parallel_size
    mla = mla_transformer_config(cfg)
    config = (MLATransformerConfig if mla else TransformerConfig)(
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=ModelShape.of(m).ffn_hidden_size,
        kv_channels=m.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=m.layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[m.activation_func],
        activation_func_clamp_value=m.activation_func_clamp_value,
        glu_linear_offset=m.glu_linear_offset,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        softmax_type=m.softmax_type,
        window_size=tuple(m.window_size) if m.window_size else None,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        # megatron-core does not read these from parallel_state: without them every pipeline
        # stage builds every layer.
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel,
        tp_comm_overlap=p.tp_comm_overlap,  # TE's userbuffers: megatron_ext/distributed/tp_comm_overlap.py
        # layers counted as the model class counts them (hybrid.py): decoder layers, or HybridModel's positions
        **layer_fields(cfg),
        # The interleaved schedule at PP=2 swaps the two stages' tensors when p2p ops are
        # batched (megatron-core 0.19.2, Megatron-LM issues 750/1450): never batch them.
        batch_p2p_comm=vpp is None,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # every FP8 recipe in TE's hybrid format: E4M3 forward, E5M2 gradients
        fp8="hybrid" if t.fp8 else None,
        fp8_recipe=t.fp8 or "delayed",
        fp8_param=t.fp8_param_gather,  # the DDP config gathers them in FP8 (distributed/parallel.py)
        fp4="e2m1" if t.fp4 else None,
        fp4_recipe=t.fp4 or "nvfp4",
        calculate_per_token_loss=True,
        bias_activation_fusion=t.fused_swiglu or t.liger_kernels,
        cross_entropy_loss_fusion=t.fused_cross_entropy,
        cross_entropy_fusion_impl="te" if use_te else "native",
        attention_backend=AttnBackend[m.te_attention_kernel] if use_te else AttnBackend.auto,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=te_gradient_accumulation_fusion(use_te),
        cuda_graph_impl=t.cuda_graph_impl,
        # [] = the whole layer (megatron-core's deprecated default "full" warns on every build)
        cuda_graph_modules=list(t.cuda_graph_modules),
        recompute_granularity=t.recompute_granularity,
        recompute_method="uniform" if t.recompute_granularity == "full" else None,
        # one decoder layer per recomputed block (a HybridModel's two positions)
        recompute_num_layers=positions_per_layer(cfg) if t.recompute_granularity == "full" else None,
        recompute_modules=list(recomputed_modules(cfg)) or None,  # None: megatron-core's default
        cpu_offloading=t.cpu_offloading_num_layers > 0,
        cpu_offloading_num_layers=t.cpu_offloading_num_layers,
        fine_grained_activation_offloading=bool(t.offload_modules),
        offload_modules=list(t.offload_modules),
        min_offloaded_tensor_size=t.min_offloaded_tensor_size,
        qk_clip=m.qk_clip, qk_clip_threshold=m.qk_clip_threshold, qk_clip_alpha=m.qk_clip_alpha,
        **moe_transformer_config(cfg),
        **mtp_transformer_config(cfg),
        **(mla or {"qk_layernorm": m.qk_layernorm}),
    )
    if uses_yarn_in_model(cfg):
        # megatron-core's GPTModel and attention read YaRN's numbers as these attributes of a plain TransformerConfig
        # (no fields of its own: Megatron-LM sets them from its arguments)
        for key in YARN_KEYS:
            setattr(config, f"yarn_{key}", getattr(m, key))
        config.yarn_correction_range_round_to_int = m.correction_range_round_to_int
    return config


def uses_yarn_in_model(cfg: RecipeConfig) -> bool:
    """YaRN applied by megatron-core's GPTModel (its ``yarn`` position embedding) rather than inside multi-latent
    attention."""
    return cfg.model.rope_type == "yarn" and not cfg.model.multi_latent_attention


def describe_layers(chunks: list[GPTModel], config: TransformerConfig, use_te: bool, fp8: Optional[str]) -> str:
    """One line naming what will actually run, read from the built model and its TransformerConfig (not from
    the recipe config, so a flag lost on the way shows): layer spec, attention, precision/FP8, kernels."""
    if use_te:
        spec = "TransformerEngine"
        attention = "TE DotProductAttention" + (
            f" ({config.attention_backend.name} kernel)" if config.attention_backend != AttnBackend.auto else "") + (
            " with TE's context parallelism" if config.context_parallel_size > 1 else "")
    else:
        spec = "megatron-core local"
        attention = "ring attention over CP" if config.context_parallel_size > 1 else "torch SDPA"
        if config.softmax_type != "vanilla" or config.window_size:
            attention = "matmuls and an fp32 softmax (sinks or a window: no SDPA kernel takes them)"
    if config.multi_latent_attention:
        attention = (f"multi-latent (query rank {config.q_lora_rank}, KV rank {config.kv_lora_rank}, head channels "
                     f"{config.qk_head_dim}+{config.qk_pos_emb_head_dim} rotary / value {config.v_head_dim}) through "
                     f"{attention}")
    attention += _attention_and_glu_variants(chunks, config, use_te)
    precision = ("bf16" if config.bf16 else "fp16 with dynamic loss scaling" if config.fp16 else "fp32") + (
        f" + FP8 ({fp8} scaling, E4M3/E5M2 hybrid, through TE"
        + (", parameters kept and gathered in FP8" if config.fp8_param else "") + ")" if config.fp8
        else " + FP4 (NVFP4 block scaling, through TE)" if config.fp4 else ", no FP8")
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    regions = f" of {', '.join(m.name for m in config.cuda_graph_modules)}" if config.cuda_graph_modules else ""
    liger = [] if use_te else _liger_kernels(chunks)
    fused_output = chunks[0] if isinstance(chunks[0], FusedOutput) else None  # every chunk has the class
    kernels = [name for name, on in [
        ("sequence parallel", config.sequence_parallel),
        ("fused SwiGLU", config.bias_activation_fusion and "SwiGLU" not in liger),
        (f"fused cross-entropy ({config.cross_entropy_fusion_impl})", config.cross_entropy_loss_fusion),
        (f"fused linear cross-entropy ({fused_output and fused_output.kernel_name()})", fused_output is not None),
        ("torch.compile per layer", bool(layers) and all(layer._compiled_call_impl is not None for layer in layers)),
        (f"CUDA graphs per layer{regions} (megatron-core, captured in the first step)",
         bool(layers) and all(getattr(layer, "cudagraph_manager", None) is not None for layer in layers)),
        (f"CUDA graphs per layer{regions} (TransformerEngine's, captured after {config.cuda_graph_warmup_steps} "
         "eager steps)", config.cuda_graph_impl == "transformer_engine"),
        (f"one CUDA graph of each step's forward-backward (captured at step {config.cuda_graph_warmup_steps + 1})",
         config.cuda_graph_impl == "full_iteration"),
        (f"liger-kernel {', '.join(liger)}", bool(liger)),
        ("TE gradient-accumulation fusion", config.gradient_accumulation_fusion),
        (f"{config.recompute_granularity} recompute" + (f" of {', '.join(config.recompute_modules)}" if
         config.recompute_granularity == "selective" else ""), config.recompute_granularity is not None),
        (f"layer offload of the first {config.cpu_offloading_num_layers} layers' activations", config.cpu_offloading),
        ("TP communication overlap (TE userbuffers)", config.tp_comm_overlap),
        (f"activation offload of {', '.join(config.offload_modules)}", config.fine_grained_activation_offloading),
    ] if on]
    return (f"layer spec: {spec}; attention: {attention}; precision: {precision}; "
            f"kernels: {', '.join(kernels) or 'eager, none fused'}")


def _attention_and_glu_variants(chunks: list[GPTModel], config: TransformerConfig, use_te: bool) -> str:
    """The start-up line's words for GPT-OSS's pieces this model runs (sinks, windows, biases, the GLU's variant)."""
    parts = []
    if config.softmax_type != "vanilla":
        parts.append(f", {config.softmax_type} attention sinks")
    if config.window_size:
        layers = attention_layers(chunks)
        where = (f"window_attn_skip_freq {config.window_attn_skip_freq}" if use_te else
                 f"on {sum(layer.self_attention.core_attention.window is not None for layer in layers)} of this "
                 f"rank's {len(layers)} layers")
        parts.append(f", a window of {config.window_size[0]} earlier keys {where}")
    if config.add_bias_linear:
        parts.append(", biases in every linear layer")
    if config.activation_func is not F.silu or config.activation_func_clamp_value is not None:
        clamp = config.activation_func_clamp_value
        parts.append(f"; GLU {config.activation_func.__name__}" + (f" clamped at {clamp:g}" if clamp else "")
                     + (f", linear half + {config.glu_linear_offset:g}" if config.glu_linear_offset else ""))
    return "".join(parts)


def build_model_chunks(cfg: RecipeConfig, vocab_size: int, config: TransformerConfig,
                       use_te: bool) -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving); with
    train.fused_linear_cross_entropy the last stage's output layer and loss are one kernel (`fused_output`)."""
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by,
                               cfg.parallel.tensor_model_parallel_size)
    fused = cfg.train.fused_linear_cross_entropy
    model_class, hybrid_class = (FusedOutputGPTModel, FusedOutputHybridModel) if fused else (GPTModel, HybridModel)
    stack = None
    if is_hybrid(cfg):
        dense, moe, norm = layer_specs(config, use_te, cfg.train.liger_kernels)
        stack = stack_spec(dense, moe, norm, hybrid_mtp_block_spec(config, use_te, norm))
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        common = dict(
            config=config,
            vocab_size=padded,
            max_sequence_length=cfg.model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            # (multi-latent attention applies its own RoPE or YaRN: megatron-core builds none here for it)
            position_embedding_type="yarn" if uses_yarn_in_model(cfg) else "rope",
            rotary_base=int(cfg.model.rotary_base),
            vp_stage=stage)
        if stack is not None:
            chunks.append(build_hybrid_model(cfg, stack, hybrid_class, **common))
            continue
        decoder = block_spec(config, use_te, stage, cfg.train.liger_kernels)
        chunks.append(model_class(
            transformer_layer_spec=decoder,
            mtp_block_spec=mtp_block_spec(config, decoder, use_te, stage),
            rope_scaling=cfg.model.rope_scaling_factor is not None,
            rope_scaling_factor=cfg.model.rope_scaling_factor or 8.0,
            **common))
    _give_row_parallel_layers_their_group(chunks)
    reduce_experts_over_expert_data_parallel(chunks)
    # (TransformerEngine's packed-sequence attention has megatron-core restart RoPE at each document itself)
    if cfg.data.reset_position_ids and not uses_packed_sequences(cfg.data, use_te):
        for chunk in chunks:
            restart_rotary_at_documents(chunk)
    return chunks


def compile_layers(chunks: list[GPTModel]) -> None:
    """torch.compile each decoder layer in place (parameter names, hence checkpoints, are unchanged)."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            layer.compile()


def _give_row_parallel_layers_their_group(chunks: list[GPTModel]) -> None:
    """megatron-core 0.19.2's RowParallelLinear.forward hands its GEMM ``tp_group=None`` (tensor_parallel/
    layers.py:1466), which then warns "tp_group is None, using default tp group" on rank 0 at every call and,
    under torch.compile, puts a warnings.warn into every compiled layer. The layer's own group is the one
    meant: pass it."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, RowParallelLinear):
                module._forward_impl = partial(_with_tp_group, module._forward_impl, module.tp_group)


def _with_tp_group(forward_impl, group, /, *args, **kwargs):
    if kwargs.get("tp_group") is None:
        kwargs["tp_group"] = group
    return forward_impl(*args, **kwargs)
