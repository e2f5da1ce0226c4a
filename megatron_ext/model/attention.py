"""Core attention for megatron-core's local layer spec: causal SDPA (within documents when the model is given document
ids, :mod:`document_mask`), and the shared module interface, which records each head's largest attention logit for
QK-clip as TransformerEngine's attention does (megatron-core reads it as ``current_max_attn_logits``).

GPT-OSS's attention runs here too: a sliding window on the layers megatron-core's ``window_size`` /
``window_attn_skip_freq`` choose, and attention sinks (``softmax_type``: one logit per head that joins each row's
softmax and attends to nothing; ``learnable`` holds it as the parameter ``softmax_offset``, megatron-core's name, split
over TP with the heads). SDPA takes neither a per-head extra logit nor returns the log-sum-exp to add one, so those
layers compute the softmax in the open (fp32, an [s, s] score matrix per head: the CPU rehearsal's sizes; on GPUs
TransformerEngine's attention runs them fused).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from megatron_ext.model.document_mask import flex_document_attention, visible


class CausalCoreAttention(MegatronModule):
    """megatron-core's ``core_attention`` interface for causal self-attention.

    Takes megatron's [s, b, heads, dim] query/key/value (key/value may have fewer, grouped heads; under multi-latent
    attention the values another head size, `v_channels`, than the queries and keys, `k_channels`) and, as
    ``attention_mask``, None or the sequence's document ids (:func:`megatron_ext.data.datasets.document_ids`),
    and returns [s, b, heads·value dim]; subclasses implement :meth:`attend` on [b, heads, s, dim].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: object = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"{type(self).__name__} supports causal masks only, got {attn_mask_type}")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels)
        # A Python bool, not a shape comparison: torch.compile with dynamic shapes would turn the
        # comparison into a SymBool, which SDPA rejects.
        self.grouped_query = config.num_query_groups not in (None, config.num_attention_heads)
        # [heads on this rank]: the largest pre-softmax logit each head produced in the training step so far;
        # megatron-core's clip_qk reads it after the optimizer step and resets it to None
        self.current_max_attn_logits: Optional[torch.Tensor] = None
        self.records_max_logits = config.qk_clip or config.log_max_attention_logit
        # the keys before a query it may still see on this layer (None: all earlier ones)
        self.window: Optional[int] = (config.window_size[0] if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        tp_group = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        self.tp_group = tp_group
        heads_here = config.num_attention_heads // tp_group.size()
        self.softmax_offset: Optional[torch.Tensor] = None
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads_here, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads_here, dtype=config.params_dtype),
                                 persistent=False)

    def allowed(self, documents: Optional[torch.Tensor], q_positions: torch.Tensor,
                k_positions: torch.Tensor) -> Optional[torch.Tensor]:
        """[b or 1, 1, sq, sk] bool: the keys each query may see — earlier ones, within its document and this
        layer's window (:func:`visible` and the window)."""
        allowed = visible(documents, q_positions, k_positions)
        if self.window is not None:
            allowed = allowed & (q_positions[:, None] - k_positions[None, :] <= self.window)[None, None]
        return allowed

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The learnable sinks split over TP along their heads (megatron-core's DotProductAttention's layout, so a
        checkpoint moves between the local and TransformerEngine's attention); nothing else to save."""
        state = {"softmax_offset": self.softmax_offset} if isinstance(self.softmax_offset,
                                                                      torch.nn.Parameter) else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=(metadata or {}).get(
                                                       "dp_cp_group"))

    def attend_in_the_open(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           documents: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention as matmuls and an fp32 softmax, with this layer's window and sinks (the sink logit joins every
        row's softmax, and its probability is dropped)."""
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        positions = torch.arange(q.size(2), device=q.device)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(~self.allowed(documents, positions, positions), float("-inf"))
        if self.softmax_offset is not None:
            sinks = self.softmax_offset.float().view(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, self.dropout_p, self.training)
        return torch.matmul(probs.to(v.dtype), v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(f"{type(self).__name__}: packed sequences / attention bias are not supported")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if self.records_max_logits and self.training:
            batch_max = max_logit_per_head(q, k, self.softmax_scale, attention_mask, self.allowed)
            self.current_max_attn_logits = batch_max if self.current_max_attn_logits is None else torch.maximum(
                self.current_max_attn_logits, batch_max)
        out = self.attend(q, k, v, attention_mask)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


LOGIT_ROWS = 1024  # query rows per block: the logits of one block are [b, heads, 1024, s] in fp32


@torch.no_grad()
def max_logit_per_head(q: torch.Tensor, k: torch.Tensor, scale: float, documents: Optional[torch.Tensor],
                       allowed: Callable[..., Optional[torch.Tensor]] = visible) -> torch.Tensor:
    """[heads]: each query head's largest scaled q·k over the keys it may see (`allowed`: causal, its own document,
    the layer's window), from [b, heads, s, dim] queries and [b, groups, s, dim] keys. Fused attention never
    materializes the logits, so they are computed here once more, block by block (one more QKᵀ per layer while QK-clip
    is on)."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1).float()
    positions = torch.arange(q.size(2), device=q.device)
    best = torch.full((q.size(1),), float("-inf"), device=q.device)
    for start in range(0, q.size(2), LOGIT_ROWS):
        rows = positions[start:start + LOGIT_ROWS]
        logits = torch.matmul(q[:, :, rows].float(), k.transpose(-1, -2)) * scale
        logits = logits.masked_fill(~allowed(documents, rows, positions), float("-inf"))
        best = torch.maximum(best, logits.amax(dim=(0, 2, 3)))
    return best


class SDPAttention(CausalCoreAttention):
    """Causal attention through torch.nn.functional.scaled_dot_product_attention (flash on GPU, GQA native); within
    documents through FlexAttention's block mask on a GPU, SDPA's boolean mask on CPU."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not split sequences across context-parallel ranks")
        super().__init__(config, *args, **kwargs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Optional[torch.Tensor]) -> torch.Tensor:
        if self.window is not None or self.softmax_offset is not None:
            return self.attend_in_the_open(q, k, v, documents)
        dropout = self.dropout_p if self.training else 0.0
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                  dropout_p=dropout, enable_gqa=self.grouped_query)
        if q.is_cuda:
            return flex_document_attention(q, k, v, documents, self.softmax_scale, self.grouped_query)
        positions = torch.arange(q.size(2), device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(documents, positions, positions),
                                              scale=self.softmax_scale, dropout_p=dropout,
                                              enable_gqa=self.grouped_query)
