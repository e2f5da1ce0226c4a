"""Weights & Biases, offline: rank 0 logs the same scalars as TensorBoard and the resolved config, and a relaunch
that resumes the training run appends to the same W&B run. The offline run files are read back record by record
(wandb's LevelDB-style log of protobuf records)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.launch import SINGLE_PROCESS, SMALL_MODEL, read_scalars, run_pretrain

_BLOCK, _HEADER = 32768, 7  # the log's block size and chunk header (crc32, length, type)


def _records(path: Path) -> list[bytes]:
    buf, pos, part, out = path.read_bytes(), len(b":W&B") + 3, b"", []  # file header: ident, magic, version
    while pos + _HEADER <= len(buf):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", buf[pos:pos + _HEADER])
        part += buf[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            out.append(part)
            part = b""
    return out


def _history_and_config(path: Path) -> tuple[dict[str, dict[int, float]], dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    history: dict[str, dict[int, float]] = {}
    config = {}
    for data in _records(path):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for key, value in row.items():
                history.setdefault(key, {})[row["_step"]] = value
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({i.key: json.loads(i.value_json) for i in updates})
    return history, config


def test_wandb_gets_the_tensorboard_scalars_and_the_resolved_config_and_a_resume_appends(tmp_path):
    """Stopped after step 2 and relaunched: both launches log to one W&B run id (offline, each launch writes its own
    file of that run, which `wandb sync` appends), the relaunch from step 3 on; together they are TensorBoard's."""
    import wandb  # noqa: F401  (pinned in requirements.txt: a missing package fails here, not skips)
    run = [*SMALL_MODEL, *SINGLE_PROCESS, "train.train_iters=3", "train.eval_interval=2",
           f"logging.tensorboard_dir={tmp_path / 'tb'}", f"logging.log_dir={tmp_path / 'run' / 'logs'}",
           f"checkpoint.save={tmp_path / 'run' / 'ckpt'}", "logging.wandb_project=recipe-test",
           "logging.wandb_run_name=smoke"]
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_pretrain(1, [*run, "train.exit_interval=2"], env=wandb_env)
    # the relaunch a fresh interpreter, as a user's rank is: the temporary directories its import of wandb made are
    # gone when it ends, as they would be without os._exit
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = run_pretrain(1, run, env={**wandb_env, "TMPDIR": str(temp)}, launcher="torchrun")
    assert not [p.name for p in temp.iterdir() if "wandb" in p.name], list(temp.iterdir())
    first, second = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert first.name == second.name, (first, second)  # run-<id>.wandb: one run id for both launches
    (history, config), (appended, _) = _history_and_config(first), _history_and_config(second)
    assert sorted(appended["train/lm_loss"]) == [3] and sorted(history["train/lm_loss"]) == [1, 2]
    for tag in ("train/lm_loss", "train/lr", "val/lm_loss", "progress/hours_left"):
        tensorboard = read_scalars(tmp_path / "tb", tag)
        both = {**history.get(tag, {}), **appended.get(tag, {})}
        assert tensorboard and both == pytest.approx(tensorboard, rel=1e-6), (tag, both)
    assert config["model"]["hidden_size"] == 128 and config["train"]["compile"] is False, config  # resolved: auto → off
    assert proc.returncode == 0
