"""A checkpoint's weights read and written a group at a time — the embedding, output layer and final norm, then one
decoder (or MTP) layer after another — never the whole model: what lets ``export-hf`` and ``import-hf`` run in bounded
memory.

The model is built on the meta device (no memory): its sharded state dict says, for every tensor, which checkpoint
key holds it and where (megatron-core's layer-stacked keys: layer i is row i of a [layers, ...] tensor; tensors saved
in parts, such as the [gate; up] projection, through megatron-core's own factories). A group's regions are read by
torch.distributed.checkpoint's reader with a load planner that asks for those regions only (megatron-core's own load
insists on every region of every key it is given), then merged back by the factories.

Writing is megatron-core's own save (``dist_checkpointing.save``: its validation, common state and metadata) with a
strategy whose tensors are produced only when torch.distributed.checkpoint's writer asks for them, one file per group:
megatron-core's writer resolves every tensor before writing any, and torch's keeps each tensor of a file until the file
is closed.
"""

from __future__ import annotations

import copy
import queue
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_ext.storage import files
from megatron_ext.storage.files import AnyPath

GLOBALS = "embedding, output layer and final norm"
_LAYER = re.compile(r"^((?:decoder|mtp)\.layers\.\d+)\.")


def groups(sharded: dict[str, Any]) -> dict[str, list[str]]:
    """The model's state-dict names (of tensors) in the groups read together, in reading order: the non-layer
    tensors, then each layer's (decoder layers, then MTP layers)."""
    grouped: dict[str, list[str]] = defaultdict(list)
    for name, item in sharded.items():
        if isinstance(getattr(item, "data", None), torch.Tensor):
            grouped[group_of(name)].append(name)
    return {GLOBALS: grouped.pop(GLOBALS, []), **grouped}


def group_of(name: str) -> str:
    """The group a state-dict name is read and written with: its layer's, or the globals'."""
    match = _LAYER.match(name)
    return match.group(1) if match else GLOBALS


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


def stored_keys(iteration_dir: AnyPath) -> set[str]:
    """The tensor keys a torch_dist checkpoint holds (its metadata; the caller restricts what unpickling may build,
    :mod:`megatron_ext.checkpoint.safe_unpickle`)."""
    metadata = files.checkpoint_reader(iteration_dir).read_metadata()
    return {key for key, stored in metadata.state_dict_metadata.items() if isinstance(stored, TensorStorageMetadata)}


def read_group(sharded: dict[str, Any], names: list[str], iteration_dir: AnyPath) -> dict[str, torch.Tensor]:
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
    dcp_load({}, storage_reader=files.checkpoint_reader(iteration_dir), planner=_Regions(regions), no_dist=True)
    loaded = dict_list_map_outplace(lambda part: part.data, parts)
    factories, _ = extract_matching_values(wanted, lambda item: isinstance(item, ShardedTensorFactory))
    apply_factory_merges(loaded, factories)
    return loaded


# ---------------------------------------------------------------------------------------------
# Writing


Region = tuple[str, tuple[int, ...]]  # (checkpoint key, global offsets): one chunk torch's checkpoint writes


def _parts(item: Any) -> list[Any]:
    """The ShardedTensors an item of a sharded state dict is saved as: itself, or its factory's parts (in the
    factory's order: the same for the meta model's item and for a copy holding real data)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return list(nested_values(item.build())) if isinstance(item, ShardedTensorFactory) else [item]


def _chunk(part: Any) -> torch.Tensor:
    return part.data.view((1,) * part.prepend_axis_num + tuple(part.local_shape))


class TensorSource:
    """Each region of the named tensors of a (meta) sharded state dict, produced on demand from ``tensor(name)``
    — the whole tensor as the one-process model holds it — and kept only while that tensor's regions are asked
    for (a factory's parts are written one after another)."""

    def __init__(self, sharded: dict[str, Any], names: list[str], tensor: Callable[[str], torch.Tensor]):
        self.sharded, self.tensor = sharded, tensor
        self.regions: dict[Region, tuple[str, int]] = {}
        for name in names:
            for index, part in enumerate(_parts(copy.copy(sharded[name]))):
                self.regions[(part.key, tuple(part.global_offset))] = (name, index)
        self._last: Optional[tuple[str, list[Any]]] = None

    def name_of(self, region: Region) -> str:
        return self.regions[region][0]

    def region(self, region: Region) -> torch.Tensor:
        name, index = self.regions[region]
        if self._last is None or self._last[0] != name:
            self._last = None  # the previous tensor let go before the next is made
            item = copy.copy(self.sharded[name])
            item.data = self.tensor(name)
            self._last = (name, _parts(item))
        return _chunk(self._last[1][index])


class _OnDemand(MCoreSavePlanner):
    """megatron-core's save planner, whose tensors come from a TensorSource when the writer reaches them."""

    def __init__(self, source: TensorSource):
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False)
        self.source = source

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:  # megatron-core's common state and objects
            return super().resolve_data(write_item)
        index: MetadataIndex = write_item.index
        assert index.offset is not None, index
        return self.source.region((index.fqn, tuple(index.offset)))


class _FilePerGroup(FileSystemWriter):
    """torch's file-system writer, one file for each group's chunks (`group_of` a write item): it holds a file's
    tensors until the file is closed."""

    def __init__(self, path: Path, group_of: Callable[[WriteItem], str]):
        super().__init__(str(path), single_file_per_rank=True, thread_count=1)
        self.group_of = group_of

    def write_data(self, plan: SavePlan, planner: SavePlanner):  # torch 2.13's FileSystemWriter.write_data, regrouped
        by_group: dict[str, list[WriteItem]] = defaultdict(list)
        for item in plan.items:
            by_group[self.group_of(item)].append(item)
        files: queue.Queue = queue.Queue()
        for number, items in enumerate(by_group.values()):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)


class StreamingSave(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist format, written by torch's checkpoint writer a group at a time, each tensor
    produced by `source` when it is written (synchronous saves only)."""

    def __init__(self, source: TensorSource):
        super().__init__()
        self.source = source

    def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                             self.keep_only_main_replica)

        def file_of(item: WriteItem) -> str:  # objects (megatron-core's common state) in a file of their own
            return "" if item.type == WriteItemType.BYTE_IO else \
                group_of(self.source.name_of((item.index.fqn, tuple(item.index.offset))))

        dcp_save(mcore_to_pyt_state_dict(sharded_state_dict, False), planner=_OnDemand(self.source),
                 storage_writer=_FilePerGroup(Path(checkpoint_dir), file_of))

    def async_save(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("StreamingSave writes synchronously")
