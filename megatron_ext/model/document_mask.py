"""Document masking for packed sequences: attention that stays inside each document (``data.reset_attention_mask``)
and RoPE positions that restart at each document (``data.reset_position_ids``).

megatron-core's GPTDataset packs several documents into one sequence, each ended by EOD. With document masking a
token attends only to the earlier tokens of its own document, so a document trains as if it were alone in its
sequence. Which document each token is in travels as the model's ``attention_mask``: an integer tensor [b, s] of
document ids over the whole sequence (before any context-parallel split; the data loader makes it,
:func:`megatron_ext.data.datasets.document_ids`), document d being the tokens after the d-th EOD — the EOD belongs
to the document it ends, as in megatron-core's own (dense) ``reset_attention_mask``. The
core attentions (:mod:`attention`, :mod:`ring_attention`) read it; it is never made into an [s, s] mask on a GPU:
there FlexAttention skips the masked blocks, with a block mask built once per micro batch (memory per 128×128
block). On CPU, where FlexAttention has no backward pass, SDPA takes a boolean mask.

In TransformerEngine's layers the document ids become TE's packed-sequence (THD) description instead
(:func:`pack_documents`): the micro batch is flattened into one row of tokens, and ``cu_seqlens`` marks where each
document (or sequence) starts; TE's fused attention then attends within each segment, and megatron-core restarts
RoPE at each one. TE's THD attention under context parallelism needs every segment padded to a multiple of 2·CP,
which GPTDataset's packing does not do, so that combination runs in the local layers (the ring attention).

RoPE: megatron-core's GPTModel rotates by a token's index in the sequence and ignores ``position_ids``; with
``data.reset_position_ids`` a forward hook on its rotary embedding (:func:`restart_rotary_at_documents`) gives each
token the rotation of its own ``position_ids`` (GPTDataset restarts them at each document), so a document's queries
and keys are rotated exactly as they would be alone (RoPE depends on relative positions only, but the rotation
angles of later positions round differently).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ext.config.kernels import FLEX_BLOCK
from megatron_ext.config.schema import DataConfig

# a key is hidden from a query by this score (not -inf): a query row that sees no key in a block the ring attention
# computes then gets finite garbage whose weight in the log-sum-exp merge is exactly 0, instead of NaN
MASKED_SCORE = -1e30


def visible(documents: Optional[torch.Tensor], q_positions: torch.Tensor, k_positions: torch.Tensor,
            causal: bool = True) -> Optional[torch.Tensor]:
    """[b or 1, 1, sq, sk] bool: which keys (at sequence positions `k_positions`) each query (at `q_positions`) may
    see — not a later one when `causal`, only its own document's with `documents` — or None when all of them."""
    allowed = None
    if causal:
        allowed = (q_positions[:, None] >= k_positions[None, :])[None, None]
    if documents is not None:
        same = documents[:, q_positions, None] == documents[:, None, k_positions]
        allowed = same[:, None] if allowed is None else allowed & same[:, None]
    return allowed


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


_last_block_mask: list[Any] = [None, None]  # (document ids, their BlockMask): every layer of a micro batch shares it


def _block_mask(documents: torch.Tensor):
    if _last_block_mask[0] is documents:
        return _last_block_mask[1]
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, k):
        return (q >= k) & (documents[b, q] == documents[b, k])

    b, s = documents.shape
    mask = create_block_mask(same_document_causal, b, None, s, s, device=documents.device, BLOCK_SIZE=FLEX_BLOCK)
    _last_block_mask[:] = [documents, mask]
    return mask


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                            scale: float, grouped_query: bool) -> torch.Tensor:
    """Causal attention within documents on [b, heads, s, dim] through compiled FlexAttention (GPU)."""
    return _compiled_flex_attention()(q, k, v, block_mask=_block_mask(documents), scale=scale,
                                      enable_gqa=grouped_query)


def uses_packed_sequences(data: DataConfig, use_te: bool) -> bool:
    """Whether document masking runs through TransformerEngine's packed-sequence (THD) attention: in TE's layers."""
    return use_te and data.reset_attention_mask


def pack_documents(batch: dict[str, torch.Tensor], documents: torch.Tensor
                   ) -> tuple[dict[str, torch.Tensor], PackedSeqParams]:
    """A micro batch for TransformerEngine's THD attention: every [b, s] tensor of `batch` flattened to [1, b·s], and
    the segments — each document of each sequence, cut at sequence ends too — as TE's cumulative lengths."""
    b, s = documents.shape
    flat = documents.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::s] = True
    cu_seqlens = torch.cat([starts.nonzero().flatten(), flat.new_tensor([b * s])]).to(torch.int32)
    longest = int(cu_seqlens.diff().max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return {key: value.reshape(1, b * s) for key, value in batch.items()}, packed


def describe_document_masking(data: DataConfig, on_gpu: bool, context_parallel_size: int, use_te: bool) -> str:
    """The start-up line for data.reset_attention_mask / reset_position_ids / eod_mask_loss."""
    parts = []
    if data.reset_attention_mask:
        how = ("TransformerEngine's packed-sequence (THD) attention" if use_te
               else "the ring attention's blocks" if context_parallel_size > 1
               else "FlexAttention's block mask" if on_gpu else "SDPA's boolean mask (CPU)")
        parts.append(f"attention within each document ({how})")
    if data.reset_position_ids:
        parts.append("positions and RoPE restart at each document")
    if data.eod_mask_loss:
        parts.append("no loss where the input token is EOD")
    return "packed documents: " + "; ".join(parts)


def restart_rotary_at_documents(model: GPTModel) -> None:
    """Make `model` rotate each token by its ``position_ids`` (megatron-core rotates by the index in the sequence,
    which is the same unless data.reset_position_ids restarts them at each document)."""
    positions: list[Optional[torch.Tensor]] = [None]

    def take_positions(_module, args: tuple, kwargs: dict) -> None:
        positions[0] = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def rotate_by_position(rotary, _args: tuple, emb: torch.Tensor) -> torch.Tensor:
        if positions[0] is None:
            return emb
        # this rank's tokens (after any context-parallel split) → rows of the table of positions 0..max
        table = rotary.get_emb(int(positions[0].max()) + 1)  # [positions, 1, 1, dim]
        return table[positions[0].t(), 0]  # [s, b, 1, dim]: megatron-core's RoPE broadcasts it over heads

    model.register_forward_pre_hook(take_positions, with_kwargs=True)
    model.rotary_pos_emb.register_forward_hook(rotate_by_position)
