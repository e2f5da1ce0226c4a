"""One micro batch's forward pass and its loss, as megatron-core's pipeline schedules call them: the batch onto this
rank's device, packed for document masking where TransformerEngine wants it, cut into this rank's context-parallel
chunks, through the model; the loss summed over tokens so that micro batches, DP and CP ranks weigh every token
alike."""

from __future__ import annotations

from functools import partial
from typing import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_ext.distributed.parallel import device
from megatron_ext.model.document_mask import pack_documents


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed loss (megatron's 3-value form): exact token weighting across micro batches, DP and CP.
    `output_tensor` holds per-token losses, or (fused linear cross-entropy) their masked sum already."""
    mask = loss_mask.view(-1).float()
    loss_sum = output_tensor.float() if output_tensor.dim() == 0 else torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module,
                 packed_documents: bool = False, return_schedule_plan: bool = False):
    """One micro batch through `model`; `packed_documents`: document masking in TransformerEngine's layers, which
    take the micro batch as one packed row of documents (:func:`pack_documents`). With `return_schedule_plan`
    (megatron-core's overlapped 1F1B schedule, parallel.overlap_moe_expert_parallel_comm) the model builds its
    schedule plan for the micro batch instead of running it; the schedule runs the plan."""
    batch = {k: v.to(device(), non_blocking=True) for k, v in next(data_iterator).items()}
    documents = batch.pop("documents", None)  # data.reset_attention_mask: the whole sequence's, on every CP rank
    packed = None
    if packed_documents:
        batch, packed = pack_documents(batch, documents)
        documents = None
    # Under CP, tokens, labels, loss mask and positions are cut into the same zigzag chunks
    # (RoPE slices its global positions the same way inside GPTModel).
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                      cp_group=parallel_state.get_context_parallel_group())
    run = model.build_schedule_plan if return_schedule_plan else model
    output = run(batch["tokens"], batch["position_ids"], attention_mask=documents, labels=batch["labels"],
                 loss_mask=batch["loss_mask"], packed_seq_params=packed)
    return output, partial(loss_func, batch["loss_mask"])


def set_up_micro_batch_calculator(rank: int, global_batch_size: int, micro_batch_size: int,
                                  data_parallel_size: int) -> None:
    """megatron-core's global micro-batch calculator, set as Megatron-LM sets it (constant global batch, no ramp-up):
    parts of megatron-core read it (TransformerEngine's CUDA-graph capture under pipelining) rather than being told.
    The loop itself counts micro batches with config.schema.microbatches_per_step, which this agrees with."""
    from megatron.core import num_microbatches_calculator as calculator

    calculator.unset_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(rank, None, global_batch_size, micro_batch_size, data_parallel_size)
