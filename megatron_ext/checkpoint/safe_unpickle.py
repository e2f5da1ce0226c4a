"""No code runs from a checkpoint: the two places where torch's distributed checkpoint unpickles a file by itself,
restricted to what a checkpoint of this recipe holds.

* The ``.metadata`` file (torch's ``FileSystemReader.read_metadata``, a plain ``pickle.load``): read with an
  unpickler that builds only torch.distributed.checkpoint's metadata and plan classes, ``torch.Size``, torch dtypes
  and layouts, ``OrderedDict`` and ``PosixPath`` — what torch and megatron-core write there (listed from the
  checkpoints of megatron-core 0.16.1 and 0.19.2 in ``tests/legacy_checkpoints`` and a fresh one).
* Every non-tensor item — the common state (iteration, config), RNG states, optimizer groups (torch's
  ``DefaultLoadPlanner.load_bytes``, ``torch.load(weights_only=False)``): loaded with ``weights_only=True`` (tensors and
  plain Python values, plus the optimizer classes an offloaded optimizer's param groups name).

A refused file is one :class:`CheckpointError` naming it and what it tried to build. The legacy ``common.pt`` is
read with ``weights_only=True`` where it is read (``common_state.read_common``). :func:`install` applies both; it runs when
``checkpoint.compat`` is imported (every load of a checkpoint's state goes through it) and in ``common_state.read_common``.
The trust model is in docs/security.md.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

import torch
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.errors import CheckpointError

_REFUSED, _SEE_DOCS = "refused to unpickle", "(docs/security.md)"
_TORCH_REFUSAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)")  # torch.load(weights_only=True)'s words
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     ("collections", "OrderedDict"), ("pathlib", "PosixPath")}


def _allowed_in_metadata(module: str, name: str) -> bool:
    """The classes of torch's checkpoint metadata and plans, and the torch values they hold (no functions)."""
    if (module, name) in _METADATA_GLOBALS:
        return True
    if module in _METADATA_MODULES:
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    return module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))


class UnpicklingRefused(CheckpointError):
    """A checkpoint file tried to unpickle something a checkpoint never holds."""


def _refused(what: str, where: str, holds: str) -> str:
    return (f"{_REFUSED} {what} in {where}: {holds}, so the checkpoint was altered or comes from elsewhere; "
            f"do not load it {_SEE_DOCS}")


def refusal_in(error: BaseException) -> Optional[str]:
    """The refusal's one line if `error` is one or carries one, else None. torch wraps each rank's failure in a
    CheckpointException (the metadata's even into another error's text), and refuses a weights_only load with a
    long message of its own: all come out as one line naming what was refused."""
    pending = [error]
    while pending:
        e = pending.pop()
        text = str(e)
        if _REFUSED in text:
            return text[text.index(_REFUSED):text.index(_SEE_DOCS) + len(_SEE_DOCS)]
        torch_refusal = _TORCH_REFUSAL.search(text)
        if torch_refusal:
            return _refused(torch_refusal[1], "a non-tensor item",
                            "this recipe's checkpoints hold only tensors and plain values there")
        pending.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        for failure in getattr(e, "failures", {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


@contextlib.contextmanager
def refusals_named(ckpt_dir: str | Path) -> Iterator[None]:
    """Around a checkpoint read: a refusal, however torch wrapped it, comes out as one UnpicklingRefused naming
    `ckpt_dir`; other errors pass unchanged."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        refused = refusal_in(e)
        if refused is None or isinstance(e, UnpicklingRefused):
            raise
        raise UnpicklingRefused(f"{ckpt_dir}: {refused}") from None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_in_metadata(module, name):
            raise UnpicklingRefused(_refused(f"{module}.{name}", ".metadata",
                                             "that file holds only torch.distributed.checkpoint's own types"))
        return super().find_class(module, name)


class _RestrictedPickle:
    """What ``torch.distributed.checkpoint.filesystem`` sees as its ``pickle`` module: loads restricted, the rest
    (``dump``) the real module's."""

    @staticmethod
    def load(stream: BinaryIO, **_: Any) -> Any:
        return _MetadataUnpickler(stream).load()

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


REPLACED_LOAD_BYTES = default_planner.DefaultLoadPlanner.load_bytes  # torch's, hashed by test_upstream_patches


def _optimizer_classes() -> list[type]:
    """The optimizer classes megatron-core's CPU-offloading optimizer records in its param groups (the ones its
    optimizer module chose here: torch's, TE's or apex's): referenced by a checkpoint, never called by loading it."""
    from megatron.core import optimizer

    return [optimizer.CPUAdam, optimizer.CPUSGD, optimizer.Adam, optimizer.SGD]


def _load_bytes(self: default_planner.DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=True)``."""
    fqn = read_item.dest_index.fqn
    try:
        with torch.serialization.safe_globals(_optimizer_classes()):
            loaded = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _TORCH_REFUSAL.search(str(e))
        raise UnpicklingRefused(_refused(refused[1] if refused else "it", f"item {fqn!r}",
                                         "this recipe's checkpoints hold only tensors and plain values there")
                                ) from None
    if self.flatten_state_dict:
        default_planner.set_element(self.original_state_dict, self.mappings[fqn], loaded)
    else:
        self.state_dict[fqn] = loaded


def install() -> None:
    """Restrict both unpicklers for every later checkpoint read in this process (idempotent)."""
    filesystem.pickle = _RestrictedPickle()
    default_planner.DefaultLoadPlanner.load_bytes = _load_bytes
