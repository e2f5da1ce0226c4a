"""No code runs from a checkpoint: a pickle payload in a distributed checkpoint's ``.metadata`` or in one of its
non-tensor items (the common state, RNG states) is refused with one line naming the checkpoint, before it runs; a
checkpoint torch and megatron-core wrote still reads."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ext.checkpoint import layout
from megatron_ext.checkpoint.common_state import CommonState, read_common
from megatron_ext.errors import CheckpointError

COMMON_KEY = "common_state/shard_0_1"  # megatron-core's key for the common state (a ShardedObject)


class _Payload:
    """Unpickled, it creates a directory: the proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _checkpoint(directory: Path, common: object) -> Path:
    """A torch_dist-format checkpoint as megatron-core >= 0.17 writes its common state: one bytes item holding
    ``torch.save([common])``, written raw by megatron-core's save planner."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    blob = io.BytesIO()
    torch.save([common], blob)
    dcp.save({COMMON_KEY: blob}, checkpoint_id=str(directory), no_dist=True,
             planner=MCoreSavePlanner(flatten_state_dict=False))
    (directory / layout.DIST_METADATA).write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    return directory


def test_a_checkpoint_written_by_torch_reads(tmp_path):
    ckpt = _checkpoint(tmp_path / "iter_0000003", {"iteration": 3, "config": {"model": {"num_layers": 2}}})
    # written before the common state had a version: a training checkpoint in the optimizer format of its day
    assert read_common(ckpt) == CommonState(3, 0, {"model": {"num_layers": 2}}, "training_state",
                                            "fully_reshardable", version=0)


def test_the_optimizer_classes_an_offloaded_optimizer_records_load(tmp_path):
    """megatron-core's HybridDeviceOptimizer keeps its CPU and GPU optimizer classes in its param groups."""
    from megatron.core import optimizer

    groups = {"cpu_optimizer_cls": optimizer.CPUAdam, "gpu_optimizer_cls": optimizer.Adam}
    ckpt = _checkpoint(tmp_path / "iter_0000003", {"iteration": 3, "config": {}, "param_groups": [groups]})
    assert read_common(ckpt).iteration == 3  # unpickled: a refused class would have raised


def test_a_payload_in_the_common_state_is_refused_before_it_runs(tmp_path):
    ckpt = _checkpoint(tmp_path / "iter_0000003", {"iteration": 3, "x": _Payload(tmp_path / "ran")})
    with pytest.raises(CheckpointError) as refused:
        read_common(ckpt)
    assert not (tmp_path / "ran").exists()
    message = str(refused.value)
    assert message.startswith(f"{ckpt}: ") and "refused to unpickle" in message and "\n" not in message, message


def test_a_payload_in_the_dcp_metadata_is_refused_before_it_runs(tmp_path):
    ckpt = _checkpoint(tmp_path / "iter_0000003", {"iteration": 3})
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "ran")))
    with pytest.raises(CheckpointError) as refused:
        read_common(ckpt)
    assert not (tmp_path / "ran").exists()
    message = str(refused.value)
    assert message.startswith(f"{ckpt}: refused to unpickle posix.mkdir in .metadata"), message
    assert "\n" not in message


def test_a_payload_in_a_legacy_common_pt_is_refused_before_it_runs(tmp_path):
    ckpt = tmp_path / "iter_0000003"
    ckpt.mkdir()
    torch.save({"iteration": 3, "x": _Payload(tmp_path / "ran")}, ckpt / layout.COMMON_STATE)
    with pytest.raises(CheckpointError, match=f"^{ckpt}: refused to unpickle posix.mkdir"):
        read_common(ckpt)
    assert not (tmp_path / "ran").exists()


def test_a_payload_in_a_sharded_object_is_refused_by_the_full_load(tmp_path):
    """megatron-core's full load hands each ShardedObject (RNG states, ...) to torch's DefaultLoadPlanner.load_bytes,
    which unpickles with weights_only=False unless restricted."""
    from megatron_ext.checkpoint import safe_unpickle

    safe_unpickle.install()
    ckpt = _checkpoint(tmp_path / "iter_0000003", _Payload(tmp_path / "ran"))
    with pytest.raises(CheckpointError) as refused, safe_unpickle.refusals_named(ckpt):
        dcp.load({COMMON_KEY: io.BytesIO()}, checkpoint_id=str(ckpt), no_dist=True)
    assert not (tmp_path / "ran").exists()
    assert str(refused.value).startswith(f"{ckpt}: refused to unpickle posix.mkdir in item '{COMMON_KEY}'"), refused
