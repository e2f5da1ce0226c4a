"""Portable context-parallel core attention: causal ring attention over the CP group (gloo or NCCL).

megatron-core's local attention refuses ``context_parallel_size > 1`` and TransformerEngine's
fused CP attention is not available everywhere (CPU machines, bare GPUs). This module plugs into
megatron-core's layer spec as ``core_attention`` and reproduces full causal attention exactly.

Sequence layout (the one megatron-core's ``get_batch_on_this_cp_rank`` and RoPE use): the
sequence is cut into 2·CP chunks and CP rank r holds chunks r and 2·CP−1−r, so causal work is
balanced. K/V blocks travel around the ring (rank r receives from r−1 and sends to r+1); after
i shifts rank r holds the K/V of rank j = (r−i) mod CP and, by the zigzag layout:

* i = 0: both local chunks attend causally to themselves, the late chunk fully to the early one;
* j < r: both query chunks see K/V chunk j fully and never its late chunk 2·CP−1−j;
* j > r: only the late query chunk 2·CP−1−r sees anything: both of rank j's chunks, fully.

With document ids (:mod:`document_mask`), each block also hides the keys of other documents, by the global
positions of its query and key chunks; a query that sees no key of a block gets a finite placeholder whose weight in
the merge is exactly 0. Blocks are merged with their log-sum-exp. Each block runs through a math path (matmul, masked
softmax) rather than ``scaled_dot_product_attention``: the public SDPA returns no log-sum-exp,
and the private kernels that do cannot back-propagate through it, which the merge needs. The
backward pass is autograd's; the ring shift is an autograd Function whose backward sends the
gradient of a received block back to the rank it came from.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig

from megatron_ext.model.attention import CausalCoreAttention
from megatron_ext.model.document_mask import MASKED_SCORE, visible


def _exchange(send: torch.Tensor, to_rank: int, from_rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    received = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, to_rank, group), dist.P2POp(dist.irecv, received, from_rank, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _RingShift(torch.autograd.Function):
    """Forward: pass a block to the next CP rank. Backward: return its gradient to the previous one."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, next_rank: int, prev_rank: int, group: dist.ProcessGroup):
        ctx.next_rank, ctx.prev_rank, ctx.group = next_rank, prev_rank, group
        return _exchange(block.contiguous(), next_rank, prev_rank, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.prev_rank, ctx.next_rank, ctx.group), None, None, None


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: Optional[torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, h, sq, d] to k/v [b, h, sk, d], each query seeing the keys `allowed` [b|1, 1, sq, sk]
    lets it (all when None): (output, log-sum-exp [b, h, sq, 1])."""
    scores = torch.matmul(q, k.transpose(-2, -1))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale  # fp32 at least
    if allowed is not None:
        scores = scores.masked_fill(~allowed, MASKED_SCORE)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse).to(v.dtype), v)
    return out, lse


def _merge(acc: Optional[tuple[torch.Tensor, torch.Tensor]], new: tuple[torch.Tensor, torch.Tensor]):
    if acc is None:
        return new
    (out_a, lse_a), (out_b, lse_b) = acc, new
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse).to(out_a.dtype) + out_b * torch.exp(lse_b - lse).to(out_b.dtype), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   group: dist.ProcessGroup, global_ranks: list[int],
                   documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag chunks q [b, h, 2c, d] against the whole sequence, within the
    documents `documents` [b, 2c·CP] (the whole sequence's document ids) says.

    k/v may have fewer (grouped) heads than q, and v another head size than q and k (multi-latent attention's); they
    travel the ring un-expanded, joined along the channels.
    """
    cp, rank = len(global_ranks), dist.get_rank(group)
    next_rank, prev_rank = global_ranks[(rank + 1) % cp], global_ranks[(rank - 1) % cp]
    repeat = q.size(1) // k.size(1)
    c = q.size(2) // 2

    def chunk(index: int) -> torch.Tensor:  # sequence positions of zigzag chunk `index`
        return torch.arange(index * c, (index + 1) * c, device=q.device)

    def allowed(q_chunk: int, k_chunks: tuple[int, ...], causal: bool) -> Optional[torch.Tensor]:
        if documents is None and not causal:
            return None
        return visible(documents, chunk(q_chunk), torch.cat([chunk(i) for i in k_chunks]), causal)

    q_early, q_late = q[:, :, :c], q[:, :, c:]
    early: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    late: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    kv = torch.cat([k, v], dim=-1)
    for step in range(cp):
        if step > 0:
            kv = _RingShift.apply(kv, next_rank, prev_rank, group)
        source = (rank - step) % cp
        k_blk, v_blk = (x.repeat_interleave(repeat, dim=1) if repeat > 1 else x
                        for x in kv.split([k.size(-1), v.size(-1)], dim=-1))
        k_early, k_late, v_early, v_late = k_blk[:, :, :c], k_blk[:, :, c:], v_blk[:, :, :c], v_blk[:, :, c:]
        mine, late_chunk, source_late = rank, 2 * cp - 1 - rank, 2 * cp - 1 - source
        if source == rank:
            early = _merge(early, _block(q_early, k_early, v_early, scale, allowed(mine, (mine,), True)))
            late = _merge(late, _block(q_late, k_early, v_early, scale, allowed(late_chunk, (mine,), False)))
            late = _merge(late, _block(q_late, k_late, v_late, scale, allowed(late_chunk, (late_chunk,), True)))
        elif source < rank:
            early = _merge(early, _block(q_early, k_early, v_early, scale, allowed(mine, (source,), False)))
            late = _merge(late, _block(q_late, k_early, v_early, scale, allowed(late_chunk, (source,), False)))
        else:
            late = _merge(late, _block(q_late, k_blk, v_blk, scale,
                                       allowed(late_chunk, (source, source_late), False)))
    return torch.cat([early[0], late[0]], dim=2)


class RingAttention(CausalCoreAttention):
    """megatron-core ``core_attention`` for context parallelism without TransformerEngine."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.dropout_p > 0:
            raise ValueError("RingAttention does not implement attention dropout")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Optional[torch.Tensor]) -> torch.Tensor:
        return ring_attention(q, k, v, self.softmax_scale, parallel_state.get_context_parallel_group(),
                              parallel_state.get_context_parallel_global_ranks(), documents)
