"""Every path a config names, and the refusal of one outside a container step's mounts (megatron_ext/config/paths.py):
under pyxis a checkpoint written outside the mounts vanishes with the container, and data there cannot be read."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.config.paths import CONTAINER_MOUNTS_ENV, named_paths, refuse_unmounted_paths
from megatron_ext.config.schema import RecipeConfig, load_config
from megatron_ext.errors import ConfigError
from tests.launch import ROOT, TINY

REAL_DATA = ["data.mock=false", "data.blend=[/data/corpus/a_text_document,/lustre/b_text_document]",
             "data.tokenizer_model=/data/tok.model", "checkpoint.pretrained_checkpoint=/hf/ckpt"]


def test_every_path_key_of_the_schema_is_named():
    """A new string key holding a path (…_dir, …_path, …_model, a checkpoint directory) must be listed."""
    path_like = ("_dir", "_path", "_model", "_checkpoint", "save", "load", "blend", "_cache")
    keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(RecipeConfig)
            for f in dataclasses.fields(s.default_factory) if f.name.endswith(path_like) and "str" in str(f.type)}
    cfg = load_config(TINY, [*REAL_DATA, "data.train_blend=[/t]", "data.valid_blend=[/v]", "data.test_blend=[/s]",
                             "data.path_to_cache=/cache", "logging.tensorboard_dir=/tb", "logging.log_dir=/logs",
                             "checkpoint.save=/ckpt", "checkpoint.load=/other"])
    assert keys <= {key for key, _, _ in named_paths(cfg)}, keys - {key for key, _, _ in named_paths(cfg)}


def test_a_checkpoint_outside_the_mounts_is_refused_before_it_is_lost(monkeypatch):
    monkeypatch.setenv(CONTAINER_MOUNTS_ENV, f"{ROOT}:{ROOT},/lustre/runs:/lustre/runs,/data:/data:ro")
    cfg = load_config(TINY, ["checkpoint.save=/scratch/me/ckpt", "logging.tensorboard_dir=/lustre/runs/tb"])
    with pytest.raises(ConfigError) as error:
        refuse_unmounted_paths(cfg)
    assert str(error.value) == (
        f"checkpoint.save=/scratch/me/ckpt lies outside the container's mounts ({ROOT}, /lustre/runs, /data): the "
        "run would write it inside the container, where it is lost with the container; mount /scratch/me "
        "(CONTAINER_MOUNTS=/scratch/me:/scratch/me under SLURM, DOCKER_ARGS='-v /scratch/me:/scratch/me' with "
        "docker_run.sh) or move it under a mount")
    refuse_unmounted_paths(load_config(TINY, ["checkpoint.save=/lustre/runs/x/ckpt"]))  # mounted: passes
    refuse_unmounted_paths(load_config(TINY, ["checkpoint.save=runs/tiny/ckpt"]))  # relative: under the checkout


def test_data_outside_the_mounts_is_said_to_be_invisible(monkeypatch):
    monkeypatch.setenv(CONTAINER_MOUNTS_ENV, f"{ROOT}:{ROOT},/data:/data")
    with pytest.raises(ConfigError, match=r"^data.blend=/lustre/b_text_document lies outside the container's mounts "
                                          r".*: the ranks cannot see it inside the container; mount /lustre "
                                          r"\(CONTAINER_MOUNTS=/lustre:/lustre under SLURM"):
        refuse_unmounted_paths(load_config(TINY, [*REAL_DATA, "checkpoint.save=null"]))


def test_outside_a_container_step_nothing_is_refused(monkeypatch):
    monkeypatch.delenv(CONTAINER_MOUNTS_ENV, raising=False)
    refuse_unmounted_paths(load_config(TINY, [*REAL_DATA, "checkpoint.save=/anywhere"]))


def test_the_slurm_step_exports_its_mounts_under_the_name_the_check_reads():
    common = (ROOT / "launch" / "slurm" / "common.sh").read_text()
    assert f"export {CONTAINER_MOUNTS_ENV}=$mounts\n" in common


def test_mock_data_names_no_data_paths():
    cfg = load_config(TINY, ["data.mock=true", "model.vocab_size=512"])
    assert not [key for key, _, _ in named_paths(cfg) if key.startswith("data.")]




def test_object_storage_prefixes_are_not_file_system_paths():
    """msc://PROFILE/... and s3://BUCKET/... blends are objects (data/object_storage.py): not mount-checked; the client's configuration
    file and the index cache are files the run reads and writes."""
    from megatron.core.datasets import object_storage_utils

    from megatron_ext.config.paths import MSC_PREFIX, S3_PREFIX

    assert (MSC_PREFIX, S3_PREFIX) == (object_storage_utils.MSC_PREFIX, object_storage_utils.S3_PREFIX)
    cfg = load_config(TINY, ["data.blend=[msc://tokens/a_text_document,/data/b_text_document,s3://tok/c_text_document]",
                             "storage.msc_config=/etc/msc.yaml", "storage.cache=/cache/objects"])
    named = {key: (path, written) for key, path, written in named_paths(cfg)}
    assert [path for path, _ in named.values() if "a_text_document" in path or "c_text_document" in path] == []
    assert named["data.blend"] == ("/data/b_text_document", False)
    assert named["storage.msc_config"] == ("/etc/msc.yaml", False) and named["storage.cache"] == ("/cache/objects", True)
