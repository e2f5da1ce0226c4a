"""A saved checkpoint's weights read a group at a time — the embedding, output layer and final norm, then one decoder
(or MTP) layer after another — never the whole model: what lets ``export-hf`` run in bounded memory.

The model is built on the meta device (no memory): its sharded state dict says, for every tensor, which checkpoint
key holds it and where (megatron-core's layer-stacked keys: layer i is row i of a [layers, ...] tensor; tensors saved
in parts, such as the [gate; up] projection, through megatron-core's own factories). A group's regions are read by
torch.distributed.checkpoint's reader with a load planner that asks for those regions only (megatron-core's own load
insists on every region of every key it is given), then merged back by the factories.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

GLOBALS = "embedding, output layer and final norm"
_LAYER = re.compile(r"^((?:decoder|mtp)\.layers\.\d+)\.")


def groups(sharded: dict[str, Any]) -> dict[str, list[str]]:
    """The model's state-dict names (of tensors) in the groups read together, in reading order: the non-layer
    tensors, then each layer's (decoder layers, then MTP layers)."""
    grouped: dict[str, list[str]] = defaultdict(list)
    for name, item in sharded.items():
        if isinstance(getattr(item, "data", None), torch.Tensor):
            match = _LAYER.match(name)
            grouped[match.group(1) if match else GLOBALS].append(name)
    return {GLOBALS: grouped.pop(GLOBALS, []), **grouped}


def keys_of(sharded: dict[str, Any]) -> set[str]:
    """The checkpoint keys the model's sharded state dict reads its tensors from."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {item.key for item in nested_values(sharded) if isinstance(item, (ShardedTensor, ShardedTensorFactory))}


class _Regions(DefaultLoadPlanner):
    """Reads into each destination tensor its region of a checkpoint key: {(key, offsets): tensor}."""

    def __init__(self, regions: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
        super().__init__()
        self.regions = regions

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for (key, offsets), tensor in self.regions.items():
            stored = self.metadata.state_dict_metadata[key]
            assert isinstance(stored, TensorStorageMetadata), key
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            requests += create_read_items_for_chunk_list(key, stored, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.regions[(index.fqn, tuple(index.offset))]


def stored_keys(iteration_dir: Path) -> set[str]:
    """The tensor keys a torch_dist checkpoint holds (its metadata; the caller restricts what unpickling may build,
    :mod:`megatron_ext.checkpoint.safe_unpickle`)."""
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    return {key for key, stored in metadata.state_dict_metadata.items() if isinstance(stored, TensorStorageMetadata)}


def read_group(sharded: dict[str, Any], names: list[str], iteration_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors `names` (state-dict names of the meta model whose sharded state dict is `sharded`) read from the
    checkpoint at `iteration_dir`, each whole as the one-process model holds it (the caller restricts unpickling, as
    for :func:`stored_keys`)."""
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_outplace,
        extract_matching_values,
        nested_values,
    )
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories, apply_factory_merges

    wanted = {name: copy.copy(sharded[name]) for name in names}  # `sharded` keeps its meta tensors
    for item in wanted.values():  # real memory for the tensors this group reads, let go with the group
        item.data = torch.empty(item.data.shape, dtype=item.data.dtype)
    parts = dict(wanted)
    apply_factories(parts)  # a factory's parts, each a region of its own key
    regions: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    for part in nested_values(parts):
        assert part.flattened_range is None, part.key  # model weights are saved whole per region
        regions[(part.key, tuple(part.global_offset))] = part.data.view(
            (1,) * part.prepend_axis_num + tuple(part.local_shape))
    dcp_load({}, storage_reader=FileSystemReader(str(iteration_dir)), planner=_Regions(regions), no_dist=True)
    loaded = dict_list_map_outplace(lambda part: part.data, parts)
    factories, _ = extract_matching_values(wanted, lambda item: isinstance(item, ShardedTensorFactory))
    apply_factory_merges(loaded, factories)
    return loaded
