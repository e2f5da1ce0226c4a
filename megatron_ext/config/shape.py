"""The model's shape with every default resolved, and what follows from it alone: the padded vocabulary, the
parameter count and the model FLOPs per token.

The one place these rules live: config validation, the model build, metrics (MFU), the Hugging Face converter,
the resume checks and the planner all read a :class:`ModelShape`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from megatron_ext.config.schema import ModelConfig


def default_ffn_hidden_size(hidden_size: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * hidden_size / 3) / 256)


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's rule: the embedding rows are a multiple of make_divisible_by × TP."""
    multiple = make_divisible_by * tensor_parallel_size
    return multiple * math.ceil(vocab_size / multiple)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads
    kv_channels: int  # head dimension
    ffn_hidden_size: int
    seq_length: int
    tied_embeddings: bool

    @classmethod
    def of(cls, model: ModelConfig | Mapping[str, Any]) -> ModelShape:
        """From a model section, or its dict as a checkpoint saved it (missing optional keys mean their default)."""
        m = model if isinstance(model, Mapping) else vars(model)
        hidden, heads = m["hidden_size"], m["num_attention_heads"]
        return cls(
            num_layers=m["num_layers"], hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=m.get("num_query_groups") or heads,
            kv_channels=m.get("kv_channels") or hidden // heads,
            ffn_hidden_size=m.get("ffn_hidden_size") or default_ffn_hidden_size(hidden),
            seq_length=m.get("seq_length", ModelConfig.seq_length),
            tied_embeddings=not m.get("untie_embeddings_and_output_weights", True),
        )

    def num_parameters(self, vocab_size: int) -> int:
        """Parameters with a `vocab_size`-row embedding (unpadded: as published model cards count them)."""
        h, d = self.hidden_size, self.kv_channels
        attention = h * d * (self.num_attention_heads + 2 * self.num_query_groups) + self.num_attention_heads * d * h
        per_layer = attention + 3 * h * self.ffn_hidden_size + 2 * h
        embeddings = vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def flops_per_token(self, vocab_size: int, causal: bool = True) -> float:
        """Forward+backward model FLOPs for one token: 6 × the matmul parameters (the output layer's included,
        tied or not; embedding lookups and norms excluded) + attention's 6·L·(heads·head_dim)·s causal (12 over
        the full score matrix)."""
        h = self.hidden_size
        norms = (2 * self.num_layers + 1) * h
        matmuls = self.num_parameters(vocab_size) - vocab_size * h - norms
        if self.tied_embeddings:  # the tied output layer is still a matmul
            matmuls += vocab_size * h
        query_width = self.kv_channels * self.num_attention_heads
        return 6.0 * matmuls + (6.0 if causal else 12.0) * self.num_layers * query_width * self.seq_length
