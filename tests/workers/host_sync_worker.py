"""The recipe's entry point with every host read of a tensor counted: ``Tensor.item/tolist/cpu/numpy`` and a tensor's
conversion to bool/float/int (each waits for the device on a GPU), ``torch.cuda.synchronize`` and the object and
barrier collectives (which block every rank). Each call is charged to the training iteration under way — from the
start of its forward pass to the start of the next one, so the loop's bookkeeping after a step counts too — with
its caller; rank R writes ``{iteration: [caller, ...]}`` as JSON to ``$SYNC_COUNTS.R``.

Collectives on tensors are not counted: on a GPU NCCL enqueues them on the stream and the host goes on (gloo on CPU
blocks, which is CPU rehearsal's cost, not the GPU's). Calls made inside C++ (``torch.tensor`` of a list of device
scalars) are invisible here."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_ext.training import trainer
from recipes.pretrain import main

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SEEN: dict[int, list[str]] = defaultdict(list)
_ITERATION = [0]  # the iteration under way (0: start-up)
# a counted call made by a counted call (CPU rehearsal's torch-function mode re-dispatches) counts once
_COUNTING = [False]
_NOT_THE_CALLER = ("/torch/", "cpu_backend.py", __file__)


def _caller() -> str:
    """The innermost frame outside torch, CPU rehearsal's dispatch and this file: who asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in _NOT_THE_CALLER):
            where = os.path.relpath(frame.filename, _ROOT) if frame.filename.startswith(_ROOT) else \
                frame.filename.split("site-packages/")[-1]
            return f"{where}:{frame.lineno} {frame.name}"
    return "?"


def _counted(owner, name: str, kind: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def counting(*args, **kwargs):
        if _COUNTING[0]:
            return original(*args, **kwargs)
        _COUNTING[0] = True
        try:
            _SEEN[_ITERATION[0]].append(f"{kind} {_caller()}")
            return original(*args, **kwargs)
        finally:
            _COUNTING[0] = False

    setattr(owner, name, counting)


def _install() -> None:
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        _counted(torch.Tensor, name, name)
    _counted(torch.cuda, "synchronize", "cuda.synchronize")
    for name in ("barrier", "all_gather_object", "broadcast_object_list", "gather_object"):
        _counted(dist, name, name)
    train_step = trainer.Trainer.train_step

    def marked_train_step(self, data_iterator):
        _ITERATION[0] = self.iteration + 1
        return train_step(self, data_iterator)

    trainer.Trainer.train_step = marked_train_step


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    _install()
    code = main()
    _ITERATION[0] = -1  # after the loop
    with open(f"{os.environ['SYNC_COUNTS']}.{os.environ.get('RANK', '0')}", "w") as out:
        json.dump(_SEEN, out, indent=1)
    sys.exit(code)
