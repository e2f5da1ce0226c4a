"""What a conversion will read, write and hold, said before it starts, and refused in one line where the output's
disk cannot take what it will write. Export streams (a layer's tensors at a time, each shard written as it fills):
its peak is the embedding and output layer, one layer twice (read and converted) and two shards' tensors (the one
filling and the last, which holds the output layer). Import still builds the whole model in one process: its peak
is the model once (it reads one tensor at a time)."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

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


def export_cost(parameters: int, copied: int, bytes_per_value: int, shard_bytes: int, output: Path,
                held_parameters: int) -> ConversionCost:
    """export-hf of a model of `parameters` (and `copied` more written twice, as DeepSeek-V3's MTP layer repeats the
    embedding and output layer) in `bytes_per_value`, sharded at `shard_bytes`, streaming: `held_parameters` at once
    (the embedding and output layer, one layer twice) beside two shards."""
    written = (parameters + copied) * bytes_per_value
    peak = held_parameters * bytes_per_value + min(2 * shard_bytes, written)
    return ConversionCost("export-hf", parameters * bytes_per_value, written, peak,
                          max(1, math.ceil(written / shard_bytes)), output)


def import_cost(files: Iterable[Path], parameters: int, bytes_per_value: int, output: Path) -> ConversionCost:
    """import-hf of the safetensors `files` into a weights-only checkpoint of `parameters` in `bytes_per_value`."""
    read = sum(path.stat().st_size for path in set(files))
    written = parameters * bytes_per_value
    return ConversionCost("import-hf", read, written, written, 1, output)
