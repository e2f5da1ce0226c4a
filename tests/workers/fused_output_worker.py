"""Subprocess worker: the fused-output model (train.fused_linear_cross_entropy) against megatron-core's GPTModel and
HybridModel (model.model_class).

CPU, world of one, fp32. liger-kernel's kernel is Triton, so the fused model gets a torch stand-in with the same
contract (hidden [tokens, h], weight [vocab, h], targets with -100 = skip → summed loss); what is checked here is
the wiring around it: which weight (tied or untied), the [s, b] / [b, s] orders, the loss mask, and the loss
function's handling of a pre-summed loss. Prints one JSON line per tying: loss and gradient differences.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from megatron_ext.config.schema import load_config
from megatron_ext.distributed import cpu_backend
from megatron_ext.distributed.parallel import destroy_distributed, init_distributed
from megatron_ext.model.fused_output import IGNORE_INDEX
from megatron_ext.model.llama import build_model_chunks, describe_layers, transformer_config
from megatron_ext.training.micro_batch import forward_step

VOCAB, SEQ, BATCH = 96, 16, 3


def reference_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=IGNORE_INDEX, reduction="sum")


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward/backward through the recipe's own forward step and loss function."""
    model.zero_grad()
    output, loss_func = forward_step(iter([batch]), model)
    loss_sum, num_tokens, _ = loss_func(output)
    loss_sum.backward()
    assert int(num_tokens) == int(batch["loss_mask"].sum())
    return loss_sum.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


if __name__ == "__main__":
    cpu_backend.install()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.3).float()
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
             "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}
    for model_class, untied in ((c, u) for c in ("gpt", "hybrid") for u in (False, True)):
        overrides = [f"model.model_class={model_class}", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                     "model.num_query_groups=2", f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}",
                     "model.make_vocab_size_divisible_by=32", "model.attention_backend=local",
                     f"model.untie_embeddings_and_output_weights={str(untied).lower()}",
                     "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                     "train.fused_cross_entropy=false"]
        cfg = load_config(None, overrides)
        init_distributed(cfg, on_gpu=False)
        try:
            config = transformer_config(cfg, on_gpu=False, use_te=False)
            plain = build_model_chunks(cfg, VOCAB, config, use_te=False)[0]
            fused_cfg = load_config(None, [*overrides, "train.fused_linear_cross_entropy=true"])
            fused = build_model_chunks(fused_cfg, VOCAB, config, use_te=False)[0]
            fused.linear_cross_entropy = reference_linear_cross_entropy
            fused.load_state_dict(plain.state_dict())
            reference_loss, reference_grads = loss_and_grads(plain, batch)
            fused_loss, fused_grads = loss_and_grads(fused, batch)
            print(json.dumps({
                "model_class": model_class, "untied": untied, "loss": fused_loss, "reference_loss": reference_loss,
                "loss_rel_diff": abs(fused_loss - reference_loss) / reference_loss,
                "max_grad_rel_diff": max(((fused_grads[n] - g).norm() / g.norm()).item()
                                         for n, g in reference_grads.items()),
                "output_weight_grad_norm": fused_grads[
                    "output_layer.weight" if untied else "embedding.word_embeddings.weight"].norm().item(),
                "describe": describe_layers([fused], config, use_te=False, fp8=None),
            }))
        finally:
            destroy_distributed()
