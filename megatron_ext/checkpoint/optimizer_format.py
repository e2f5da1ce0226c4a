"""The distributed optimizer's checkpoint format: megatron-core's metadata for it, the guard on dp_reshardable, and
the repairs of both formats' saves (:func:`padding_within_buckets`, :func:`state_in_buffer_layout`).

dp_reshardable writes each DP rank's slice of the optimizer's flat grad buffers as they are: it loads correctly
only into buffers with the same parameters at the same offsets in the same buckets (same TP/PP/VPP split, same
layer spec, same bucket size; the DP size may change). A save records a signature of that layout per (PP, TP)
rank; a load compares it first, so a mismatch is one error instead of optimizer state silently landing on the
wrong parameters (megatron-core only checks the buckets' total sizes).

fully_reshardable gathers each grad buffer's optimizer state into one tensor per state (``param``, ``exp_avg``, ...)
and cuts every parameter's state out of it. In megatron-core 0.19.2 the gathered tensor packs the buckets one after
the other without the padding at each bucket's end, while the cuts are at the parameter's offsets in the padded
buffer: every parameter after a bucket whose end is padded is saved shifted by that padding, its tail zeros (fixed
upstream after 0.19.2 by Megatron-LM pull request 5077). Any buffer of more than one bucket is exposed: overlapped
grad reduction splits buffers into 40M-element buckets, and megatron-core puts an embedding that another pipeline
stage shares (tied output layer, multi-token prediction) in a bucket of its own. :func:`state_in_buffer_layout`
lays the gathered tensors out as the buffer is, so the cuts hold; :func:`master_weights_problem` refuses a
checkpoint written without it (or damaged since) on load.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_ext.checkpoint.common_state import CommonState
from megatron_ext.checkpoint.compat import megatron_optimizers, optimizer_substates
from megatron_ext.checkpoint.model_class import gpt_parameter_name

DP_RESHARDABLE = "dp_reshardable"
# Config keys that change the buffers' layout: named in the error as the likely cause.
_LAYOUT_KEYS = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                "parallel.virtual_pipeline_model_parallel_size", "parallel.num_layers_in_first_pipeline_stage",
                "parallel.num_layers_in_last_pipeline_stage", "parallel.use_distributed_optimizer",
                "parallel.overlap_grad_reduce", "parallel.ddp_bucket_size",
                "model.attention_backend", "model.model_class", "train.compile")


def optimizer_metadata(optimizer_format: str) -> dict[str, Any]:
    """megatron-core's `metadata` for one of config.OPTIMIZER_FORMATS (other than auto)."""
    return {"distrib_optim_sharding_type": optimizer_format.removesuffix("_mem_efficient"),
            "distrib_optim_fully_reshardable_mem_efficient": optimizer_format.endswith("_mem_efficient")}


def _rank_key() -> str:
    return f"pp{parallel_state.get_pipeline_model_parallel_rank()}.tp{parallel_state.get_tensor_model_parallel_rank()}"


def _local_signature(model_chunks) -> str:
    """Every parameter's name (as GPTModel names it: model_class.py), bucket and offset within its bucket, in every
    grad buffer of this rank."""
    entries = []
    for chunk_index, chunk in enumerate(model_chunks):
        hybrid = chunk.module.config.is_hybrid_model
        names = {param: gpt_parameter_name(name, hybrid) for name, param in chunk.module.named_parameters()}
        for buffer_index, buffer in enumerate([*chunk.buffers, *chunk.expert_parallel_buffers]):
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                offset = buffer.buckets[bucket_id].offset  # bucket starts move with the DP padding; offsets don't
                entries.append((chunk_index, buffer_index, bucket_id, start - offset, end - offset, names[param]))
    return hashlib.sha256(repr(sorted(entries)).encode()).hexdigest()[:16]


def buffer_layouts(model_chunks) -> dict[str, str]:
    """Collective: the buffer-layout signature of every (PP, TP) rank, to record in the checkpoint."""
    mine = (_rank_key(), _local_signature(model_chunks))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return dict(every)


def load_problem(ckpt_dir: Path, common: CommonState, model_chunks, current_config: dict[str, Any]
                 ) -> Optional[str]:
    """Collective: why `ckpt_dir`'s optimizer state cannot load into this run's buffers (the same on every rank),
    or None when it can."""
    if common.optimizer_format != DP_RESHARDABLE:
        return None
    saved = (common.buffer_layouts or {}).get(_rank_key())
    same = [None] * dist.get_world_size()
    dist.all_gather_object(same, saved == _local_signature(model_chunks))
    if all(same):
        return None
    saved_config = common.config

    def value(config: dict[str, Any], key: str) -> Any:
        section, name = key.split(".")
        return config.get(section, {}).get(name)

    changed = [f"{k}: {value(saved_config, k)} → {value(current_config, k)}" for k in _LAYOUT_KEYS
               if value(saved_config, k) != value(current_config, k)]
    return (
        f"{ckpt_dir} holds its optimizer state in megatron-core's dp_reshardable format, which loads only into the "
        "same parameter buffers (it reshards across data parallelism alone), and this run's differ"
        + (f" ({', '.join(changed)})" if changed else "")
        + ". Resume it under its saved layout with checkpoint.optimizer_format=fully_reshardable and "
          "train.exit_interval=1 (one step, then a checkpoint loadable under any layout), or start from its "
          "weights only with checkpoint.pretrained_checkpoint")


def placed_at_bucket_offsets(packed: torch.Tensor, buckets: list[tuple[int, int]], numel: int) -> torch.Tensor:
    """`packed` (the buckets' unpadded elements one after the other) placed at each bucket's offset in a buffer of
    `numel` elements; `buckets`: (offset, unpadded numel) per bucket, in order."""
    placed = packed.new_zeros(numel)
    start = 0
    for offset, size in buckets:
        placed[offset:offset + size] = packed[start:start + size]
        start += size
    return placed


def _gathered_in_buffer_layout(optimizer: DistributedOptimizer, gathered: Optional[dict]) -> Optional[dict]:
    """get_parameter_state_dp_zero's world tensors (None on the DP ranks that receive none), each in its buffer's
    layout."""
    if gathered is None:
        return None
    for buffer_index, buffer in enumerate(optimizer.buffers):
        buckets = [(bucket.offset, bucket.numel_unpadded) for bucket in buffer.buckets]
        for world in gathered[buffer_index].values():
            for key, packed in world.items():
                if isinstance(packed, torch.Tensor):
                    world[key] = placed_at_bucket_offsets(packed, buckets, buffer.numel)
    return gathered


def padding_within_buckets(sharded: Any) -> Any:
    """dp_reshardable's `sharded` optimizer state with every padding shard cut at its bucket's unpadded end.

    megatron-core 0.19.2 covers the gap between a DP rank's last parameter and the end of its slice with a padding
    shard that reaches the slice's end, while each bucket's checkpoint tensor ends at the bucket's unpadded size. The
    two differ when the unpadded end is the aligned start of a shared embedding (tied output layer at PP > 1, or
    multi-token prediction) that lies inside the last slice: the shard runs past its tensor and torch's distributed
    checkpoint refuses the whole save (Megatron-LM pull request 5898, open). The padding holds no state; the cut
    shard covers exactly what the tensor has, in a save and in the load that reads it."""
    if isinstance(sharded, list):
        return [padding_within_buckets(item) for item in sharded]
    if not isinstance(sharded, dict):
        return sharded
    padding = sharded.get("padding")
    if isinstance(padding, LocalNonpersistentObject) and padding.obj is True:
        return {key: _cut_at_tensor_end(value) if isinstance(value, ShardedTensor) else value
                for key, value in sharded.items()}
    return {key: padding_within_buckets(value) for key, value in sharded.items()}


def _cut_at_tensor_end(shard: ShardedTensor) -> ShardedTensor:
    fits = shard.global_shape[0] - shard.global_offset[0]
    if fits >= shard.local_shape[0]:
        return shard
    return replace(shard, data=shard.data[:fits], local_shape=(fits,))


@contextmanager
def state_in_buffer_layout(optimizer: MegatronOptimizer) -> Iterator[None]:
    """While it is open, the fully_reshardable format cuts each parameter's optimizer state from tensors laid out as
    its grad buffer is (see the module's docstring)."""
    distributed = [opt for opt in megatron_optimizers(optimizer) if isinstance(opt, DistributedOptimizer)]
    for opt in distributed:
        def gather(*args, _opt=opt, _gather=opt.get_parameter_state_dp_zero, **kwargs):
            return _gathered_in_buffer_layout(_opt, _gather(*args, **kwargs))

        opt.get_parameter_state_dp_zero = gather
    try:
        yield
    finally:
        for opt in distributed:
            del opt.get_parameter_state_dp_zero


def master_weights_problem(ckpt_dir: Path, optimizer: MegatronOptimizer, loaded: Any) -> Optional[str]:
    """Collective: why `ckpt_dir`'s fully reshardable optimizer state (`loaded`, as the load returned it) is not the
    state of the weights the model now holds from it (the same on every rank), or None.

    After every step megatron-core copies each fp32 master weight into the model's weight, so a saved master copy
    cast to the weight's dtype is the saved weight, bit for bit; one that is not was saved at the wrong offsets
    (megatron-core 0.19.2's save, see the module's docstring) or damaged since, and would become the weight. The
    saved states are numbered as megatron-core's load reads them: parameter by parameter through each grad buffer."""
    mine = None
    for opt, part in optimizer_substates(optimizer, loaded):
        if not isinstance(opt, DistributedOptimizer) or part.get("param_state_sharding_type") != "fully_reshardable":
            continue
        names = {param: name for chunk in opt.model_chunks for name, param in chunk.module.named_parameters()}
        params = [param for buffer in opt.buffers for param in buffer.param_index_map]
        for param, saved in zip(params, (part["param_state"][index] for index in range(len(params)))):
            master = saved.get("param", saved.get("fp32_param")).to(param.dtype).view_as(param)
            if not torch.equal(master, param.detach()):
                differ = int((master != param.detach()).sum())
                mine = f"{names[param]} ({differ} of {param.numel()} elements on rank {dist.get_rank()})"
                break
        if mine:
            break
    every: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    first = next((problem for problem in every if problem), None)
    if first is None:
        return None
    return (f"{ckpt_dir}'s optimizer state does not belong to its weights: the master copy of {first} differs from "
            "the saved weight (megatron-core 0.19.2's fully reshardable save, before this project repaired it, cut "
            "such state at the wrong offsets: docs/architecture.md). Resume from an earlier checkpoint of the run "
            "(checkpoint.optimizer_format=auto saves dp_reshardable along the way, which this does not touch), or "
            f"take its weights alone: checkpoint.pretrained_checkpoint={ckpt_dir.parent} with checkpoint.load=null "
            "(iteration 0, a fresh optimizer state)")
