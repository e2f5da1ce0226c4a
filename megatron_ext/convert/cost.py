"""What a conversion will read, write and hold, said before it starts, and refused in one line where the output's
disk cannot take what it will write. Both stream a group at a time (:mod:`megatron_ext.convert.streaming`: the
embedding, output layer and final norm, then each layer). Export's peak is the embedding and output layer, one layer
twice (read and converted) and two shards' tensors (the one filling and the last, which holds the output layer).
Import writes each group's file as it converts it: its peak is the larger of that first group and one layer twice
(converted, and the tensor being split into its saved parts)."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from megatron_ext.config.shape import ModelShape
from megatron_ext.errors import ConversionError

GB = 1e9
DISK_MARGIN = 1.02  # the files' headers, index and config beside the tensors' bytes


@dataclass(frozen=True)
class ConversionCost:
    """Bytes one conversion reads, writes (in `files` files) and holds at its peak in this process."""

    command: Literal["import-hf", "export-hf"]
    read_bytes: int
    write_bytes: int
    peak_bytes: int
    files: int
    output: Path

    def free_bytes(self) -> int:
        """Free bytes on the file system the output will be written to (its nearest existing ancestor)."""
        where = self.output
        while not where.exists() and where != where.parent:
            where = where.parent
        return shutil.disk_usage(where).free

    def describe(self, free: int) -> str:
        return (f"{self.command}: reads {self.read_bytes / GB:,.2f} GB, writes {self.write_bytes / GB:,.2f} GB in "
                f"{self.files} file{'s' if self.files > 1 else ''} to {self.output} ({free / GB:,.1f} GB free there); "
                f"this process holds about {self.peak_bytes / GB:,.2f} GB at its peak")

    def check_disk(self, free: int) -> None:
        needed = self.write_bytes * DISK_MARGIN
        if free < needed:
            raise ConversionError(f"{self.output}: {free / GB:,.2f} GB free, {self.command} writes "
                                  f"{needed / GB:,.2f} GB: free space there or choose another --output")


def streamed_parameters(shape: ModelShape, vocab_size: int) -> tuple[int, int]:
    """The parameters of a streamed conversion's groups: (the embedding, output layer and final norm; the largest
    decoder or MTP layer)."""
    h = shape.hidden_size
    first = (1 if shape.tied_embeddings else 2) * vocab_size * h + h
    return first, max(map(shape.layer_parameters, range(shape.num_layers + shape.mtp_num_layers)))


def export_cost(parameters: int, copied: int, bytes_per_value: int, shard_bytes: int, output: Path,
                first_group: int, largest_layer: int) -> ConversionCost:
    """export-hf of a model of `parameters` (and `copied` more written twice, as DeepSeek-V3's MTP layer repeats the
    embedding and output layer) in `bytes_per_value`, sharded at `shard_bytes`, streaming: the first group and the
    largest layer twice held at once (:func:`streamed_parameters`) beside two shards."""
    written = (parameters + copied) * bytes_per_value
    peak = (first_group + 2 * largest_layer) * bytes_per_value + min(2 * shard_bytes, written)
    return ConversionCost("export-hf", parameters * bytes_per_value, written, peak,
                          max(1, math.ceil(written / shard_bytes)), output)


def import_cost(files: Iterable[Path], parameters: int, first_group: int, largest_layer: int, layers: int,
                bytes_per_value: int, output: Path) -> ConversionCost:
    """import-hf of the safetensors `files` into a weights-only checkpoint of `parameters` in `bytes_per_value`,
    a file per group (the first, then each of `layers`), each written as it is converted."""
    read = sum(path.stat().st_size for path in set(files))
    return ConversionCost("import-hf", read, parameters * bytes_per_value,
                          max(first_group, 2 * largest_layer) * bytes_per_value, layers + 1, output)
