"""Training data a run skips: ``<checkpoint.save>/data_skips.json``, kept beside the checkpoints it refers to.

Each entry says: once iteration ``iteration`` is done with ``from_sample`` samples consumed, the training data goes on
at sample ``to_sample`` (positions in megatron-core's shuffled sample order, as ``consumed_samples`` counts them).
A spike rewind writes one (:mod:`megatron_ext.resilience.spikes`), so a restart from a checkpoint before the spike
skips the same batches again; an operator may write entries by hand, as the PaLM and OPT teams did when they
restarted before a spike and skipped the batches around it. Entries at the same iteration and position chain (a
second rewind to the same checkpoint skips further). The file is checked when it is read: a malformed one is one
error naming the file and the entry.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megatron_ext.checkpoint import layout
from megatron_ext.errors import CheckpointError
from megatron_ext.storage import files


@dataclass(frozen=True)
class DataSkip:
    """After `iteration`, with `from_sample` samples consumed, the data continues at `to_sample`."""

    iteration: int
    from_sample: int
    to_sample: int
    reason: str = ""


def _entry(path: Path, index: int, value: object) -> DataSkip:
    fields = ("iteration", "from_sample", "to_sample")
    if (not isinstance(value, dict) or set(value) - {*fields, "reason"}
            or not all(type(value.get(k)) is int and value[k] >= 0 for k in fields)
            or value["to_sample"] <= value["from_sample"] or not isinstance(value.get("reason", ""), str)):
        raise CheckpointError(
            f"{path}: entry {index} ({json.dumps(value)}) is not a data skip: expected "
            '{"iteration": N, "from_sample": A, "to_sample": B, "reason": "..."} with whole numbers 0 <= A < B; '
            "correct or delete it")
    return DataSkip(**value)


class DataSkips:
    """The data skips of the run saving into `root` (None: it saves nothing, so none are kept)."""

    def __init__(self, root: Optional[str | Path]):
        self.path = files.at(root) / layout.DATA_SKIPS if root else None
        self.entries: list[DataSkip] = []
        if self.path is not None and self.path.is_file():
            try:
                entries = json.loads(self.path.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.path}: not readable as JSON ({e}); correct or delete it") from None
            if not isinstance(entries, list):
                raise CheckpointError(f"{self.path}: expected a list of data skips; correct or delete it")
            self.entries = [_entry(self.path, i, value) for i, value in enumerate(entries)]

    def position(self, iteration: int, consumed_samples: int) -> tuple[int, list[DataSkip]]:
        """Where the data goes on after `iteration` at `consumed_samples`, and the skips that took it there."""
        applied = []
        while True:
            found = [s for s in self.entries if s.iteration == iteration and s.from_sample == consumed_samples]
            if not found:
                return consumed_samples, applied
            skip = max(found, key=lambda s: s.to_sample)
            applied.append(skip)
            consumed_samples = skip.to_sample

    def add(self, skip: DataSkip) -> None:
        """Collective: remember `skip` (replacing an entry from the same iteration and position) and write the file
        (rank 0, atomically) before any rank goes on."""
        self.entries = [s for s in self.entries if (s.iteration, s.from_sample) != (skip.iteration, skip.from_sample)]
        self.entries.append(skip)
        if dist.get_rank() == 0:
            files.write_atomically(self.path, json.dumps([asdict(s) for s in self.entries], indent=1) + "\n")
        dist.barrier()
