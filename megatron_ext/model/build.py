"""Builds this rank's model: the layer spec and kernels the recipe asks for and this machine runs, the chunks on
their device, and the start-up lines (rank 0) that say what was built, read from the built model."""

from __future__ import annotations

import logging

import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.kernels import resolve_kernel_options, uses_transformer_engine
from megatron_ext.config.schema import RecipeConfig
from megatron_ext.distributed.parallel import describe_layout
from megatron_ext.model import activation_offload
from megatron_ext.model.document_mask import describe_document_masking
from megatron_ext.model.hybrid import decoder_layer_numbers
from megatron_ext.model.llama import (
    build_model_chunks,
    compile_layers,
    describe_layers,
    transformer_config,
    transformer_engine_available,
    use_liger_kernels,
)
from megatron_ext.model.moe import describe_moe
from megatron_ext.model.mtp import describe_mtp

log = logging.getLogger("megatron_ext")


def build_model(cfg: RecipeConfig, vocab_size: int, on_gpu: bool
                ) -> tuple[RecipeConfig, TransformerConfig, list[GPTModel]]:
    """`cfg` with its `auto` kernel options decided for this machine, megatron-core's TransformerConfig, and this
    rank's model chunks (on the GPU when there is one), not yet wrapped in DDP."""
    use_te = uses_transformer_engine(cfg, on_gpu, transformer_engine_available())
    cfg = resolve_kernel_options(cfg, on_gpu, use_te)
    if cfg.train.liger_kernels:
        # before the model is built: it rebinds megatron-core functions the layers call
        use_liger_kernels(cross_entropy=not cfg.train.fused_linear_cross_entropy)
    activation_offload.prepare(cfg, on_gpu)
    config = transformer_config(cfg, on_gpu, use_te)
    chunks = build_model_chunks(cfg, vocab_size, config, use_te)
    notes = []
    if cfg.train.compile:
        compile_layers(chunks)
        notes.append("compiling decoder layers with torch.compile: the first step includes the compilation")
    graphs = {"local": "megatron-core captures every decoder layer at the end of the first step (a few warm-up "
                       "passes each) and replays the graphs from the second step on",
              "transformer_engine": f"TransformerEngine captures every decoder layer after "
                                    f"{config.cuda_graph_warmup_steps} eager steps and replays the graphs after that",
              "full_iteration": f"megatron-core captures each step's whole forward-backward schedule at step "
                                f"{config.cuda_graph_warmup_steps + 1} (and evaluation's at its "
                                f"{config.cuda_graph_warmup_steps + 1}th batch) and replays it from then on"}
    if cfg.train.cuda_graph_impl in graphs:
        notes.append(f"CUDA graphs ({cfg.train.cuda_graph_impl}): {graphs[cfg.train.cuda_graph_impl]}")
    if on_gpu:
        chunks = [c.cuda() for c in chunks]
    if cfg.data.reset_attention_mask or cfg.data.reset_position_ids or cfg.data.eod_mask_loss:
        notes.append(describe_document_masking(cfg.data, on_gpu, cfg.parallel.context_parallel_size, use_te))
    notes.append(describe_layout(chunks, decoder_layer_numbers(chunks)))
    notes.append(f"{describe_layers(chunks, config, use_te, cfg.train.fp8)}; "
                 f"backend: {'NCCL/GPU' if on_gpu else 'gloo/CPU rehearsal'}")
    if cfg.model.num_moe_experts is not None:
        notes.append(describe_moe(chunks, config))
    if config.mtp_num_layers:
        notes.append(describe_mtp(config))
    if use_te and not config.gradient_accumulation_fusion:
        notes.append("TE gradient-accumulation fusion is off: megatron-core's output layer needs apex's "
                     "fused_weight_gradient_mlp_cuda for it, which is not installed here")
    if dist.get_rank() == 0:
        for note in notes:
            log.info(note)
    return cfg, config, chunks
