"""torchrun worker (4 processes): with document masking, a document B packed between A and C gives the per-token
losses and parameter gradients it gives alone, through the trainer's own path — samples made as megatron-core's
GPTDataset makes them with the recipe's data.reset_position_ids / reset_attention_mask / eod_mask_loss, document ids
from the data loader's collate, and the trainer's forward step and loss (CP cutting, TransformerEngine's packed-sequence
(THD) input) — in the recipe's model under TP2 (+SP), PP2, CP2 and CP4 (ring attention), and in megatron-core's
TransformerEngine layer spec under TP2 (+SP) × PP2 (megatron-core's THD RoPE into the TE-shaped core attention
stand-in).

For each layout in fp64 (where only the masking can make a difference), and for CP4 in fp32 too, the ranks build one
model (megatron-core GPTModel through megatron_ext.model.llama) and run it through megatron-core's pipeline schedule
twice: on A|B|C (64 tokens; B spans tokens 20-43, so it crosses the CP chunks' boundaries) with the loss on B's tokens
only, and on B alone (24 tokens). Gradients are summed over the CP group and, for sequence-parallel parameters, the TP
group (as megatron-core's grad finalisation does), then compared on every rank; B's per-token losses are gathered
from the CP ranks' zigzag chunks. Rank 0 writes the worst relative differences per layout and precision, and the
number of tokens each loss counted (B's EOD is not one of them), to argv[1] as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext.config.schema import RecipeConfig, load_config
from megatron_ext.data.datasets import _WithDocumentIds
from megatron_ext.distributed import cpu_backend
from megatron_ext.model.llama import build_model_chunks, transformer_config
from megatron_ext.training import micro_batch
from tests.launch import ROOT, SMALL_MODEL
from tests.workers import te_standin

# name: (TP, PP, CP, TransformerEngine's layer spec)
LAYOUTS = {"tp2_sp": (2, 1, 1, False), "pp2": (1, 2, 1, False), "cp2": (1, 1, 2, False), "cp4": (1, 1, 4, False),
           "te_tp2_sp_pp2": (2, 2, 1, True)}
LENGTHS = (20, 24, 20)  # A, B, C: each ends with EOD
VOCAB, EOD = 256, 0


def documents() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7)
    docs = [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]
    for doc in docs:
        doc[-1] = EOD
    labels = torch.randint(1, VOCAB, (sum(LENGTHS),), generator=generator)
    return docs, labels


def sample(cfg: RecipeConfig, tokens: torch.Tensor, labels: torch.Tensor, loss_on: slice) -> dict[str, torch.Tensor]:
    """One micro batch as the trainer's data loader gives it: GPTDataset's loss mask and positions under the recipe's
    data switches (the loss further limited to `loss_on`), and the collate's document ids."""
    d = cfg.data
    _, loss_mask, positions = _get_ltor_masks_and_position_ids(
        tokens, EOD, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss, create_attention_mask=False)
    only = torch.zeros(len(tokens))
    only[loss_on] = 1.0
    return _WithDocumentIds(EOD)([{"tokens": tokens, "labels": labels, "loss_mask": loss_mask * only,
                                   "position_ids": positions}])


def unzigzag(local: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole sequence from every CP rank's two zigzag chunks of it."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=parallel_state.get_context_parallel_group())
    chunks = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def run(model, batch: dict[str, torch.Tensor], forward_only: bool, use_te: bool):
    """Through megatron-core's schedule and the trainer's forward step: B's per-token losses [b, s] and the number
    of tokens the loss counted (forward_only), or the gradients."""
    kept = []

    def forward_step(iterator, chunk):
        output, loss_func = micro_batch.forward_step(iterator, chunk, packed_documents=use_te)

        def loss(output_tensor):
            loss_sum, tokens, logged = loss_func(output_tensor)
            if forward_only:
                kept.append((output_tensor.detach(), tokens))
            return loss_sum, tokens, logged
        return output, loss

    for param in model.parameters():
        param.grad = None
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=model,
                                num_microbatches=1, seq_length=batch["tokens"].size(1), micro_batch_size=1,
                                forward_only=forward_only)
    if forward_only:
        if not kept:
            return None, None
        losses, tokens = kept[0]
        tokens = tokens.clone()
        dist.all_reduce(tokens, group=parallel_state.get_context_parallel_group())
        return unzigzag(losses, 1), int(tokens)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = grad.clone()
    return grads


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def compare(tp: int, pp: int, cp: int, use_te: bool, dtype: torch.dtype) -> dict[str, float]:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        *SMALL_MODEL, f"model.vocab_size={VOCAB}", "model.seq_length=64", "train.precision=fp32",
        "train.fused_cross_entropy=false",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.context_parallel_size={cp}", f"parallel.sequence_parallel={str(tp > 1).lower()}",
        "data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"])
    config = transformer_config(cfg, on_gpu=False, use_te=use_te)
    config.pipeline_dtype = dtype
    model = build_model_chunks(cfg, VOCAB, config, use_te=use_te)[0].to(dtype)
    (a, b, c), labels = documents()
    first = LENGTHS[0]
    packed = sample(cfg, torch.cat([a, b, c]), labels, slice(first, first + len(b)))
    alone = sample(cfg, b, labels[first:first + len(b)], slice(None))
    worst = {}
    (losses_packed, counted_packed), (losses_alone, counted_alone) = (run(model, packed, True, use_te),
                                                                      run(model, alone, True, use_te))
    if losses_packed is not None:  # the last pipeline stage
        worst["losses"] = relative(losses_packed[:, first:first + len(b)], losses_alone)
        worst["tokens_counted"] = [counted_packed, counted_alone]
    grads_packed, grads_alone = run(model, packed, False, use_te), run(model, alone, False, use_te)
    worst["gradients"] = max(relative(grads_packed[k], grads_alone[k]) for k in grads_alone
                             if grads_alone[k].abs().max() > 0)
    values = torch.tensor([worst.get("losses", 0.0), worst["gradients"], *worst.get("tokens_counted", (0, 0))],
                          dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    counts = torch.tensor([float("losses" in worst), sum(g.abs().max() > 0 for g in grads_alone.values())])
    dist.all_reduce(counts)
    return {"losses": values[0].item(), "gradients": values[1].item(), "ranks_with_losses": counts[0].item(),
            "nonzero_gradients": counts[1].item(), "tokens_counted": [int(values[2]), int(values[3])]}


def main() -> None:
    cpu_backend.install()
    te_standin.install()  # what megatron-core's TE spec builds here; the local spec is untouched
    dist.init_process_group("gloo")
    results = {f"{name}_fp64": compare(*sizes, torch.float64) for name, sizes in LAYOUTS.items()}
    results["cp4_fp32"] = compare(*LAYOUTS["cp4"], torch.float32)  # what fp32's rounding leaves, in the ring
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
