"""The output layer and the cross-entropy as one chunked kernel: the [seq, batch, vocab] logits never exist.

``train.fused_linear_cross_entropy`` builds :class:`FusedOutputGPTModel` (or :class:`FusedOutputHybridModel`), a
megatron-core ``GPTModel`` (``HybridModel``) whose last stage hands its final hidden states and output weight
straight to liger-kernel's fused linear cross-entropy (Triton; logits are made and consumed a chunk of tokens at a time, and the gradients are computed in the same
pass). For the 1B recipe at micro batch 4 that frees ~11 GB: 12.6 GB of bf16 logits and fp32 softmax become
1.8 GB of kept gradients and working chunk (planner arithmetic, not yet measured on a GPU).

The loss comes back as one scalar, already summed over the tokens the loss mask keeps (masked tokens are
given liger's ignore index): the ``sum`` reduction is the kernel's fast path, which computes the gradients
in the forward pass; a per-token reduction would recompute every logit chunk in the backward pass (one more
vocab-sized GEMM, ~7 % of the 1B model's FLOPs). Parameter names are GPTModel's, so checkpoints are shared
with the unfused model, and a call without labels (export, logits checks) runs megatron-core's output layer.
The vocabulary must be whole on the rank (tensor parallel size 1): liger's kernel has no vocab-parallel form.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
    FineGrainedActivationOffloadingInterface as off_interface,
)

IGNORE_INDEX = -100  # liger's (and torch's) "no loss for this token"

# (hidden [tokens, h], output weight [vocab, h], targets [tokens] with IGNORE_INDEX = skip) -> summed loss, 0-dim
LinearCrossEntropy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """liger-kernel's fused linear cross-entropy, summed; the weight gradient accumulates over chunks in fp32
    (bf16 accumulation over ~30 chunks of the 1B recipe would round away small contributions)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, target, ignore_index=IGNORE_INDEX, reduction="sum",
                                            accum_dtype=torch.float32)


class FusedOutput:
    """What the fused-output model classes share: the kernel (a class attribute tests replace) and the loss of the
    last stage's final hidden states."""

    linear_cross_entropy: LinearCrossEntropy = staticmethod(liger_linear_cross_entropy)

    def _fused_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor,
                    loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        if loss_mask is not None:
            labels = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
        # hidden states are [s, b, h] and labels [b, s]: flatten both in (s, b) order
        return self.linear_cross_entropy(hidden_states.reshape(-1, hidden_states.shape[-1]), weight,
                                         labels.t().reshape(-1))

    def kernel_name(self) -> str:
        """The fused kernel, for the start-up log."""
        fn = self.linear_cross_entropy
        return "liger-kernel" if fn is liger_linear_cross_entropy else getattr(fn, "__name__", type(fn).__name__)


class FusedOutputGPTModel(FusedOutput, GPTModel):
    """GPTModel whose last stage returns the summed, masked loss from one fused linear cross-entropy kernel."""

    def _postprocess(self, hidden_states: torch.Tensor, labels: Optional[torch.Tensor] = None,
                     loss_mask: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        if not self.post_process or labels is None:
            return super()._postprocess(hidden_states=hidden_states, labels=labels, loss_mask=loss_mask, **kwargs)
        return self._fused_loss(hidden_states, labels, loss_mask)


class FusedOutputHybridModel(FusedOutput, HybridModel):
    """HybridModel whose last stage returns the summed, masked loss from one fused linear cross-entropy kernel.

    megatron-core's HybridModel computes its logits and loss inside its forward, with no step to override: the
    forward runs as a middle stage's does (``post_process`` off for the call: the final hidden states come back, the
    final norm applied, since the decoder keeps its own flag), then the kernel takes them. The output layer's weight
    is marked as megatron-core's forward marks it for activation offload (which the flag would skip)."""

    def forward(self, *args, labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                **kwargs) -> torch.Tensor:
        if not self.post_process or labels is None:
            return super().forward(*args, labels=labels, loss_mask=loss_mask, **kwargs)
        if self.config.fine_grained_activation_offloading:
            for param in self.output_layer.parameters():
                off_interface.mark_not_offload(param)
        self.post_process = False
        try:
            hidden_states = super().forward(*args, labels=labels, loss_mask=loss_mask, **kwargs)
        finally:
            self.post_process = True
        return self._fused_loss(hidden_states, labels, loss_mask)
